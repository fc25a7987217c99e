"""Run the Triton kernels on the CPU with ``TRITON_INTERPRET=1`` (development and CI tests).

Triton picks the interpreter when ``@triton.jit`` runs, so ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported (the CPU tests start a fresh interpreter process for this).
Two defects of the interpreter in triton 3.6 with numpy >= 2 and a CPU build of torch are
patched here, in the interpreter only (nothing changes for compiled kernels):

- ``tl.dot`` on bfloat16 operands multiplies their raw uint16 storage: we widen to float32
  first (exact, and what the tensor cores do: bf16 products accumulated in fp32); also applied by
  :func:`kernel_for`, whose in-process interpreter runs without ``TRITON_INTERPRET``;
- a loaded scalar used as a ``range`` bound fails ``__index__`` (a 1-element array is no longer
  convertible to int);
- tensor-descriptor ``atomic_add`` (TMA bulk reduce) is not implemented: emulated as a masked
  read-add-write of the block.
"""
from __future__ import annotations

import os

_PATCHED = False
_INTERPRETED: dict = {}


def kernel_for(kernel, device):
    """``kernel`` (a ``@triton.jit`` function) for tensors on ``device``: itself on CUDA, else its
    in-process interpreted twin (built once per kernel), so CPU tensors run in Triton's interpreter
    without ``TRITON_INTERPRET`` (the quantizer's and the FP8 backward's CPU path)."""
    if device.type == "cuda":
        return kernel
    _patch_bf16_dot()  # the quantizer's fused qk rotation is a bf16 tl.dot
    if kernel not in _INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


_DOT_PATCHED = False


def _patch_bf16_dot() -> None:
    """The interpreter's ``tl.dot`` on bfloat16 operands multiplies their raw uint16 storage: widen them to
    float32 first (exact; the tensor cores' bf16 products accumulated in fp32). Interpreter only."""
    global _DOT_PATCHED
    if _DOT_PATCHED:
        return
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig_dot = interp.InterpreterBuilder.create_dot

    def _widen(h):
        if h.dtype == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            out = np.matmul(_widen(a), _widen(b), dtype=np.float32).astype(d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot
    _DOT_PATCHED = True


def patch_triton_interpreter() -> bool:
    """Apply the interpreter patches once. Returns True if the interpreter is active.

    Raises:
        RuntimeError: ``TRITON_INTERPRET`` is not set (patching a compiled setup is pointless).
    """
    global _PATCHED
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton to use the interpreter")
    if _PATCHED:
        return True
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig_patch = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor

    _patch_bf16_dot()

    if not hasattr(interp.InterpreterBuilder, "create_descriptor_reduce"):
        import inspect

        from triton._C.libtriton import ir as _ir

        # the masked load/store signatures differ between triton versions (3.6: cache_modifier,
        # eviction_policy[, is_volatile]; 3.9: cache_policy[, is_volatile]): pass the trailing
        # arguments by name, None / False
        def _tail(fn, skip):
            names = list(inspect.signature(fn).parameters)[1 + skip:]
            return {n: (False if n == "is_volatile" else None) for n in names}

        load_kw = _tail(interp.InterpreterBuilder.create_masked_load, 3)
        store_kw = _tail(interp.InterpreterBuilder.create_masked_store, 3)

        def create_descriptor_reduce(self, kind, desc, value, indices):
            # TMA bulk reduce-add (tensor descriptor ``atomic_add``): read, add and write back the
            # in-bounds part of the block; the interpreter runs one program at a time, so this is
            # atomic there
            if kind != _ir.DESCRIPTOR_REDUCE_KIND.ADD:
                raise NotImplementedError(f"descriptor reduce {kind} in the interpreter")
            ptrs, mask = desc.materialize_pointers(indices)
            zero = interp.TensorHandle(np.zeros_like(value.data), value.dtype.scalar)
            old = self.create_masked_load(ptrs, mask, zero, **load_kw)
            summed = interp.TensorHandle(old.data + value.data, value.dtype.scalar)
            return self.create_masked_store(ptrs, summed, mask, **store_kw)

        interp.InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce
    _PATCHED = True
    return True
