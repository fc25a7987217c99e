"""Packed causal attention, the public op: ``varlen_attention`` (DESIGN.md §7, issue 5).

Query ``i`` attends key ``j`` iff both lie in the same document of ``cu_seqlens`` and, when
``causal``, ``j <= i`` (FlashAttention's varlen convention). Drawn for a row of three documents
with ``cu_seqlens = [0, 3, 5, 8]`` (x = visible)::

            keys ->  0 1 2 | 3 4 | 5 6 7
    query 0          x     |     |
    query 1          x x   |     |
    query 2          x x x |     |
    query 3                | x   |
    query 4                | x x |
    query 5                |     | x
    query 6                |     | x x
    query 7                |     | x x x

Execution paths (chosen per call from the tensors' device):

- CUDA + triton: the Triton kernels of ``flash_fwd.py`` / ``flash_bwd.py`` driven by the sorted work
  list of ``flamia_pack.scheduler`` (Hopper sm_90 is the tuned target; other CUDA GPUs with
  bf16 tensor cores run the same code untuned).
- CPU (or no triton): the exact torch reference ``reference.packed_attention_reference``
  (float32 compute, float64 for float64 inputs; result cast back to the input dtype), differentiable
  through the same op (float64 inputs pass ``torch.autograd.gradcheck``).
  With ``TRITON_INTERPRET=1`` set before triton is imported, CPU tensors run the Triton kernels
  in the interpreter instead (tests; see ``interpret.py``).

Under ``torch.compile`` both paths go through one ``torch.library`` custom op
(``flamia_pack::varlen_attn_fwd`` and its backward ``flamia_pack::varlen_attn_bwd``) with fake (meta)
implementations, so the op works without graph breaks inside it. Eager calls run the same bodies
through a ``torch.autograd.Function`` (or, with nothing to differentiate, the forward body alone):
the custom-op dispatch cost ~65 us of host time per call. With a prebuilt ``work_list`` the GPU path
does no host synchronisation and can be captured in a CUDA graph for a fixed T.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Optional

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels.config import (AttentionKernelConfig, GluonFwdConfig, check_row_hints, env_candidate,
                                        gluon_bwd_min_len, host_cache, kernel_config, work_list_tile_config)
from flamia_pack.kernels.fp8_emulation import check_pv_terms, check_qk_terms
from flamia_pack.kernels.qk_rotation import QK_ROTATIONS

__all__ = ["varlen_attention", "build_attention_work_list", "check_attention_inputs", "kernels_available"]

_SUPPORTED_HEAD_DIMS = (64, 128)
_FALLBACK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# ----------------------------------------------------------------------------------------------
# path selection
# ----------------------------------------------------------------------------------------------

_TRITON_OK: Optional[bool] = None


def _triton_importable() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401

            _TRITON_OK = True
        except Exception:  # pragma: no cover - depends on the install
            _TRITON_OK = False
    return _TRITON_OK


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def kernels_available(device: torch.device | str) -> bool:
    """True if tensors on ``device`` run the Triton kernels (else the torch reference).

    CUDA devices need triton; CPU tensors use the kernels only under ``TRITON_INTERPRET=1``.

    Args:
        device: a ``torch.device`` or its name (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        bool.

    Raises:
        FlamiaError: a device name torch does not know.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FlamiaError(f"unknown device {device!r}: {exc}") from None
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _interpreting()


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def _expect_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        err = MetadataError if name == "cu_seqlens" else FlamiaError
        raise err(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen,
    *,
    kernel_path: bool,
) -> tuple[int, int, int, int]:
    """Check names, shapes, dtypes, devices and strides of an attention call (no host sync).

    Args:
        q: ``(T, H_q, D)``; k, v: ``(T, H_kv, D)``; ``H_q % H_kv == 0``; last dim contiguous.
        cu_seqlens: 1-D int32/int64 ``(n_docs + 1,)`` on q's device.
        max_seqlen: int >= 0 (Python or numpy integer; FlashAttention API parity; the values are
            checked with cu_seqlens).
        kernel_path: the Triton path (bf16 and D in {64, 128} required) or the reference fallback
            (bf16/fp16/fp32/fp64, any D).

    Returns:
        ``(T, H_q, H_kv, D)``.

    Raises:
        FlamiaError / MetadataError: with what was wrong and what is allowed.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _expect_tensor(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise FlamiaError(f"{name} must be 3-D (total_tokens, num_heads, head_dim), got shape {tuple(x.shape)}")
    T, H, D = q.shape
    if k.shape != v.shape:
        raise FlamiaError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != T or k.shape[2] != D:
        raise FlamiaError(f"k/v must be (T={T}, num_kv_heads, head_dim={D}), got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if H < 1 or Hkv < 1 or H % Hkv:
        raise FlamiaError(f"num_heads ({H}) must be a positive multiple of num_kv_heads ({Hkv})")
    if D < 1:
        raise FlamiaError(f"head_dim must be >= 1, got q of shape {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FlamiaError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if kernel_path:
        if q.dtype != torch.bfloat16:
            raise FlamiaError(f"the GPU kernels take bfloat16 q/k/v (precision='bf16'), got {q.dtype}")
        if D not in _SUPPORTED_HEAD_DIMS:
            raise FlamiaError(f"head_dim must be one of {_SUPPORTED_HEAD_DIMS} for the GPU kernels, got {D}")
    elif q.dtype not in _FALLBACK_DTYPES:
        raise FlamiaError(f"q/k/v dtype must be one of {_FALLBACK_DTYPES}, got {q.dtype}")
    devs = {x.device for x in (q, k, v, cu_seqlens)}
    if len(devs) != 1:
        where = ", ".join(f"{n} on {x.device}" for n, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)))
        # only cu_seqlens elsewhere: a metadata mistake (MetadataError, as the README promises)
        err = MetadataError if len({q.device, k.device, v.device}) == 1 else FlamiaError
        raise err(f"q, k, v and cu_seqlens must be on one device, got {where}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.numel() and x.stride(2) != 1:
            raise FlamiaError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {x.stride()}; call .contiguous()")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise MetadataError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise MetadataError(f"cu_seqlens must be 1-D of shape (n_docs + 1,), got shape {tuple(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0:
        raise MetadataError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if T >= 2**31 // max(1, H * D):
        raise FlamiaError(f"T * num_heads * head_dim must be < 2**31, got {T} * {H} * {D}")
    return T, H, Hkv, D


@torch.compiler.disable
def _check_cu_values(cu_seqlens: torch.Tensor, T: int, max_seqlen: int) -> tuple[int | None, int]:
    """Host check of the values of cu_seqlens (one device-to-host copy,
    :func:`flamia_pack.scheduler.worklist.cu_seqlens_summary`); returns the shortest document's
    length (None for zero documents), which :func:`leftover_bits` uses, and ``cu_seqlens[-1]`` (the
    tokens in documents), which :func:`launch_bits` uses."""
    from flamia_pack.scheduler.worklist import cu_seqlens_summary

    return cu_seqlens_summary(cu_seqlens, T, max_seqlen, name="the number of tokens T")


LEFTOVER_FWD = 1
""":func:`leftover_bits`: the forward's Triton launch behind the Gluon programs may have work."""
LEFTOVER_BWD = 2
""":func:`leftover_bits`: the backward's Triton launch behind the Gluon programs may have work."""
PAD_TAIL = 4
""":func:`launch_bits`: the row may have row-end padding (tokens past ``cu_seqlens[-1]``), so the
forward fills O / LSE there and the backward zeroes dQ / dK / dV there (one launch each)."""


def leftover_bits(cfg: AttentionKernelConfig, min_seqlen: int | None) -> int:
    """Which of the Gluon paths' leftover Triton launches can have work on a row whose shortest
    document has ``min_seqlen`` tokens (None: unknown -> both): a bit mask of :data:`LEFTOVER_FWD`
    and :data:`LEFTOVER_BWD`.

    The Gluon forward leaves merged items and 1-token documents to a Triton launch, the Gluon backward
    merged items and documents of at most ``GluonBwdConfig.min_len`` tokens
    (``gluon_common._item_span``; ``tiles_triton.program_geometry``
    selects the same rows with ``sel < 0``). A merged item holds >= 2 whole documents inside one
    aligned window of ``wl_block_m`` tokens (``scheduler.worklist.build_work_list_host``), so it needs
    a document shorter than ``wl_block_m``. Without such documents every program of the launch
    exits at once: W1's backward spent ~60 us and the forward 32-42 us on them (RESULTS.md). Pure
    host arithmetic, no sync; the soundness check against the work list is a CPU test.
    """
    if min_seqlen is None:
        return LEFTOVER_FWD | LEFTOVER_BWD
    merged_possible = min_seqlen < cfg.wl_block_m
    bits = 0
    if merged_possible or min_seqlen <= 1:
        bits |= LEFTOVER_FWD
    if merged_possible or min_seqlen <= gluon_bwd_min_len(cfg):
        bits |= LEFTOVER_BWD
    return bits


# ----------------------------------------------------------------------------------------------
# work lists
# ----------------------------------------------------------------------------------------------


def build_attention_work_list(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    *,
    causal: bool = True,
    head_dim: int = 128,
    config: AttentionKernelConfig | None = None,
    max_items: int | None = None,
    validate: bool = True,
    max_seqlen: int | None = None,
    num_kv_groups: int = 1,
):
    """The work list ``varlen_attention`` builds by default, for reuse across calls / CUDA graphs.

    Build it once per packed row (outside graph capture, or inside with ``validate=False``) and
    pass it as ``work_list=``; the attention call then does no host synchronisation.

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32 on the device.
        total_tokens: T.
        causal, head_dim: as the attention call (choose the tile configuration).
        config: tile configuration (default :func:`kernel_config` of ``head_dim``, ``causal``,
            ``max_seqlen`` and ``num_kv_groups``: the list the call with the same arguments builds).
        max_items, validate: see ``flamia_pack.scheduler.worklist.build_work_list``.
        max_seqlen: the calls' ``max_seqlen`` (host int), or None: rows of short documents get the
            list geometry of their tile set (256-row items where ``max_seqlen <= 256``, the
            whole-item forward); a list built without it (128-row items) still serves every call,
            with that band's 128-row programs.
        num_kv_groups: ``num_heads // num_kv_heads`` of the calls (1: MHA).

    Returns:
        ``flamia_pack.scheduler.worklist.WorkList``.

    Raises:
        FlamiaError: ``head_dim`` without a kernel configuration (not 64 or 128) when no ``config``
            is given; ``config`` not an ``AttentionKernelConfig``; ``num_kv_groups`` not an int >= 1.
        MetadataError: ``total_tokens`` not an int in ``[0, 2**31 - 1]``, invalid ``cu_seqlens``
            (with ``validate``), as ``build_work_list`` reports them; ``max_seqlen`` not None or an
            int >= 0, or (with ``validate``) below the longest document.
    """
    from flamia_pack.scheduler.worklist import build_work_list

    _check_config_arg(config)
    check_row_hints(max_seqlen, num_kv_groups)  # also with a config given (kernel_config checks them otherwise)
    cfg = config or kernel_config(head_dim, causal, max_seqlen=max_seqlen, num_kv_groups=num_kv_groups)
    # total_tokens as given: build_work_list checks it (an int in range; 20.7, "20", True are errors); the
    # list's geometry follows max_seqlen, so validate also checks it against the longest document, as the
    # call without a list does (in the same host copy of cu_seqlens)
    return build_work_list(cu_seqlens, total_tokens, work_list_tile_config(cfg, causal), max_items=max_items,
                           validate=validate, max_seqlen=max_seqlen)


@torch.compiler.disable
def _default_work_list(cu32: torch.Tensor, T: int, max_seqlen: int, causal: bool, cfg: AttentionKernelConfig):
    # (cu_seqlens' values were checked by the caller, before the int32 cast)
    wl = build_attention_work_list(cu32, T, causal=causal, config=cfg, validate=False)
    return wl.items, wl.num_items


def _check_finite_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skippable: bool = True) -> None:
    """Raise FlamiaError if q, k or v holds a NaN / Inf (one sync; a second only to locate it); ``skippable``:
    the message names ``check_finite=False`` (not where the FP8 CPU emulation runs: it needs finite inputs)."""
    flags = torch.stack([torch.isfinite(x).all() for x in (q, k, v)])
    if bool(flags.all()):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            t, h = (int(i) for i in bad.any(dim=-1).nonzero()[0])
            hint = ("check_finite=False skips this check" if skippable else
                    "precision='fp8' off Hopper runs the FP8 emulation, which needs finite inputs")
            raise FlamiaError(f"{name} holds NaN / Inf (first at token {t}, head {h}); attention inputs must be "
                              f"finite ({hint})")


def _check_config_arg(config) -> None:
    """``config=`` of the public calls: an ``AttentionKernelConfig`` or None (a name gets a hint)."""
    if config is not None and not isinstance(config, AttentionKernelConfig):
        hint = (f" (for a named candidate pass config=candidate_config({config!r}) from flamia_pack.kernels.config)"
                if isinstance(config, str) else "")
        raise FlamiaError(f"config must be an AttentionKernelConfig or None, got {type(config).__name__}{hint}")


def _config_for_list(cfg: AttentionKernelConfig, work_list) -> AttentionKernelConfig:
    """The automatic ``cfg`` on the geometry of a given work list: a list built without ``max_seqlen``
    (128-row items) for a row whose band runs the whole-item forward on 256-row items gets that band's
    128-row programs (``small_fwd_pers``: one claim per query tile, the default 2 x 128-key ring);
    anything else is left to ``_check_work_list``'s error."""
    block_m = getattr(getattr(work_list, "config", None), "block_m", None)
    if block_m == 128 and cfg.wl_block_m == 256 and cfg.gluon_fwd is not None and cfg.gluon_fwd.whole_items:
        return dataclasses.replace(cfg, wl_block_m=128, gluon_fwd=GluonFwdConfig(pingpong=False))
    return cfg


def _check_work_list(work_list, causal: bool, cfg: AttentionKernelConfig, device: torch.device, T: int,
                     cu_seqlens: torch.Tensor):
    from flamia_pack.scheduler.worklist import check_work_list_row, check_work_list_tensors

    items, num_items = check_work_list_tensors(work_list, device)
    wcfg = work_list.config
    if hasattr(work_list, "bwd_entries"):
        raise FlamiaError("work_list is an FP8 list (build_fp8_work_list: no merged items, the FP8 backward's "
                          "entries); precision='bf16' takes build_attention_work_list(cu_seqlens, T, ...)'s")
    if bool(wcfg.causal) != bool(causal):
        raise FlamiaError(f"work_list was built with causal={wcfg.causal} but the call has causal={causal}")
    built_t = getattr(work_list, "total_tokens", None)
    if built_t is not None and int(built_t) != int(T):
        raise FlamiaError(
            f"work_list was built for a row of T={built_t} tokens but q has T={T}; build one for this row "
            "(build_attention_work_list(cu_seqlens, T)): a list for another row would address tokens outside it")
    if wcfg.block_m != cfg.wl_block_m:
        raise FlamiaError(
            f"work_list was built with block_m={wcfg.block_m}; the kernels chosen for this call expect "
            f"block_m={cfg.wl_block_m}: build it with build_attention_work_list(cu_seqlens, T, causal=..., "
            "head_dim=..., max_seqlen=<this call's max_seqlen>, num_kv_groups=<num_heads // num_kv_heads>) or "
            "with this call's config=")
    # other cu_seqlens of the same T: caught where both are on the CPU (no sync), see check_work_list_row
    check_work_list_row(work_list, cu_seqlens, "build_attention_work_list(cu_seqlens, T, causal=..., head_dim=...)")
    return items, num_items


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


def _config_to_ints(cfg: AttentionKernelConfig) -> list[int]:
    """The config as the custom ops' int list (a fresh list: callers may hand it to torch)."""
    return list(_config_ints(cfg))


# cached (host_cache): the conversion and its inverse cost ~30 us per call on the host
@host_cache
def _config_ints(cfg: AttentionKernelConfig) -> tuple[int, ...]:
    return cfg.key()


def _config_from_ints(vals) -> AttentionKernelConfig:
    return _config_from_tuple(tuple(int(x) for x in vals))


_N_CONFIG_FIELDS = AttentionKernelConfig.key_length()
_DEFAULT_CONFIG = AttentionKernelConfig()
"""The CPU path's config (a module constant: ``torch.compile`` traces a global, not a constructor call)."""


def launch_bits(cfg: AttentionKernelConfig, min_seqlen: int | None, doc_tokens: int | None, T: int) -> int:
    """The launches a row may need beyond the main kernels, from host knowledge only (no sync): the
    :func:`leftover_bits` of its shortest document, plus :data:`PAD_TAIL` unless ``doc_tokens``
    (``cu_seqlens[-1]``) is known to equal ``T`` -- a row without row-end padding has no padding
    rows to fill, and each fill is a launch of ``T / 64`` programs and ~65 us of host time per call.
    ``None``: unknown (the launch runs)."""
    bits = leftover_bits(cfg, min_seqlen)
    if doc_tokens is None or int(doc_tokens) != int(T):
        bits |= PAD_TAIL
    return bits


def _op_config_ints(cfg: AttentionKernelConfig, bits: int) -> list[int]:
    """The custom ops' ``config`` argument: the config's ints, then the :func:`launch_bits` mask."""
    return _config_to_ints(cfg) + [int(bits)]


def _op_config(vals) -> tuple[AttentionKernelConfig, int]:
    """Inverse of :func:`_op_config_ints` (a list without the mask, as older callers pass: every bit)."""
    bits = int(vals[_N_CONFIG_FIELDS]) if len(vals) > _N_CONFIG_FIELDS else LEFTOVER_FWD | LEFTOVER_BWD | PAD_TAIL
    return _config_from_ints(vals[:_N_CONFIG_FIELDS]), bits


@host_cache
def _config_from_tuple(vals: tuple[int, ...]) -> AttentionKernelConfig:
    return AttentionKernelConfig.from_key(vals)


@host_cache
def _resolve_policy(cfg: AttentionKernelConfig, causal: bool, max_seqlen: int, T: int, n_docs: int) -> AttentionKernelConfig:
    """``schedule="policy"`` -> ``"static"`` (snake) or ``"persistent"`` (atomic counter) per
    ``scheduler.policy.policy_for_call``'s rule (DESIGN.md §6); trace-safe (symbolic T under
    ``torch.compile(dynamic=True)``: ``policy_name_for_call`` builds no reason string)."""
    from flamia_pack.scheduler.policy import policy_name_for_call

    policy = policy_name_for_call(bool(causal), max_seqlen, T, n_docs)
    return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, schedule="static" if policy == "static" else "persistent"))


# softmax_scale * log2(e) must be a normal float32 (the kernels' qk_scale): 2**-126 <= it <= 2**127
_MIN_SOFTMAX_SCALE = 2.0 ** -126 / math.log2(math.e)
_MAX_SOFTMAX_SCALE = 2.0 ** 127 / math.log2(math.e)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The fallback's compute (and LSE) dtype: float64 for float64 inputs (gradcheck-exact), else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _reference_fwd(q, k, v, cu, causal, scale):
    from flamia_pack.kernels.reference import packed_attention_reference

    ct = _compute_dtype(q)
    o, lse = packed_attention_reference(q, k, v, cu, causal=causal, softmax_scale=scale,
                                        compute_dtype=ct, return_lse=True)
    return o.to(q.dtype), lse.to(ct)


def _reference_bwd(do, dlse, q, k, v, o, lse, cu, causal, scale):
    """The fallback path's exact gradient: :func:`reference.packed_attention_reference_bwd` (query
    blocks of bounded memory), in float32 (float64 for float64 inputs)."""
    from flamia_pack.kernels.reference import packed_attention_reference_bwd

    return packed_attention_reference_bwd(do, q, k, v, o, lse, cu, causal=causal, softmax_scale=scale, dlse=dlse)


def _fwd_impl(q, k, v, cu_seqlens, items, num_items, causal, softmax_scale, config):
    """The forward's launches (or the reference fallback): the body of the custom op
    ``flamia_pack::varlen_attn_fwd`` and of the eager path's :class:`_VarlenAttnFn`."""
    if kernels_available(q.device):
        if q.device.type == "cpu":
            from flamia_pack.kernels.interpret import patch_triton_interpreter

            patch_triton_interpreter()
        from flamia_pack.kernels.flash_fwd import flash_fwd

        cfg, bits = _op_config(config)
        return flash_fwd(q, k, v, cu_seqlens, items, num_items, causal=causal, softmax_scale=softmax_scale,
                         config=cfg, leftover=bool(bits & LEFTOVER_FWD), tail=bool(bits & PAD_TAIL))
    return _reference_fwd(q, k, v, cu_seqlens, causal, softmax_scale)


@torch.library.custom_op("flamia_pack::varlen_attn_fwd", mutates_args=())
def _varlen_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor,
    num_items: torch.Tensor, causal: bool, softmax_scale: float, config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens, items, num_items, causal, softmax_scale, config)


@_varlen_attn_fwd.register_fake
def _varlen_attn_fwd_fake(q, k, v, cu_seqlens, items, num_items, causal, softmax_scale, config):
    T, H, D = q.shape
    return q.new_empty((T, H, D)), q.new_empty((H, T), dtype=_compute_dtype(q))


def _bwd_impl(do, dlse, q, k, v, o, lse, cu_seqlens, items, num_items, causal, softmax_scale, config):
    """The backward's launches (or the reference gradient): the body of the custom op
    ``flamia_pack::varlen_attn_bwd`` and of :class:`_VarlenAttnFn`'s backward."""
    if kernels_available(q.device):
        if q.device.type == "cpu":
            from flamia_pack.kernels.interpret import patch_triton_interpreter

            patch_triton_interpreter()
        from flamia_pack.kernels.flash_bwd import flash_bwd

        cfg, bits = _op_config(config)
        return flash_bwd(do, q, k, v, o, lse, cu_seqlens, items, num_items, causal=causal,
                         softmax_scale=softmax_scale, config=cfg, dlse=dlse, leftover=bool(bits & LEFTOVER_BWD),
                         tail=bool(bits & PAD_TAIL))
    return _reference_bwd(do, dlse, q, k, v, o, lse, cu_seqlens, causal, softmax_scale)


@torch.library.custom_op("flamia_pack::varlen_attn_bwd", mutates_args=())
def _varlen_attn_bwd(
    do: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
    causal: bool, softmax_scale: float, config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(do, dlse, q, k, v, o, lse, cu_seqlens, items, num_items, causal, softmax_scale, config)


@_varlen_attn_bwd.register_fake
def _varlen_attn_bwd_fake(do, dlse, q, k, v, o, lse, cu_seqlens, items, num_items, causal, softmax_scale, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, items, num_items, causal, softmax_scale, config = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, items, num_items)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.config = config
    ctx.set_materialize_grads(False)


def _grads(ctx, do, dlse, bwd):
    """The input gradients from a context :func:`_setup_context` filled, through ``bwd`` (the custom op
    ``varlen_attn_bwd`` or its body :func:`_bwd_impl`)."""
    q, k, v, o, lse, cu_seqlens, items, num_items = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = bwd(do.contiguous(), None if dlse is None else dlse.contiguous(), q, k, v, o, lse, cu_seqlens, items,
                     num_items, ctx.causal, ctx.softmax_scale, ctx.config)
    return dq, dk, dv, None, None, None, None, None, None


def _backward(ctx, do, dlse):
    return _grads(ctx, do, dlse, torch.ops.flamia_pack.varlen_attn_bwd)


_varlen_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _VarlenAttnFn(torch.autograd.Function):
    """The eager path of :func:`varlen_attention`: the same forward / backward bodies as the custom ops
    without the custom-op dispatch, which costs ~65 us of host time per forward call (W7: 202 us for
    the op vs 136 us for its body). ``torch.compile`` traces the custom op instead (``varlen_attention`` picks by
    ``torch.compiler.is_compiling()``); both give the same tensors."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the custom op: no double backward (raises, never silently 0)
    def backward(ctx, do, dlse):
        return _grads(ctx, do, dlse, _bwd_impl)


# ----------------------------------------------------------------------------------------------
# public op
# ----------------------------------------------------------------------------------------------


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    precision: str = "bf16",
    work_list=None,
    return_lse: bool = False,
    deterministic: bool = False,
    config: AttentionKernelConfig | None = None,
    check_finite: bool | None = None,
    scale_granularity: str = "block",
    causal_dq_scale: bool = False,
    qk_rotation: str | None = None,
    qk_terms: int = 1,
    pv_terms: int = 1,
):
    """Packed (document-masked) attention over one packed row, forward and backward.

    Args:
        q: ``(T, H_q, D)`` bfloat16 (the CPU reference fallback also takes fp16/fp32/fp64 and any D).
        k, v: ``(T, H_kv, D)``, same dtype; ``H_q % H_kv == 0`` (GQA/MQA: query head ``h`` reads
            kv head ``h // (H_q // H_kv)``); ``D`` in {64, 128}. Any token/head strides; the last
            dim must be contiguous.
        cu_seqlens: ``(n_docs + 1,)`` int32 (int64 is converted), row-local offsets: first 0,
            strictly increasing, last ``<= T``. Documents may start at any offset; tokens at or past
            ``cu_seqlens[-1]`` are row-end padding: ``o = 0``, ``lse = +inf``, zero gradients.
        max_seqlen: longest document, or an upper bound on it (Python or numpy int;
            FlashAttention API parity; checked to be at least the longest document when no
            ``work_list`` is given). It also picks the tiles: a larger bound than needed can only
            select the default tiles where the small ones would be faster.
        causal: key ``j`` visible to query ``i`` only if ``j <= i`` (inside the document).
        softmax_scale: finite real > 0 (Python or numpy float), at least ~8.2e-39 and at most
            ~1.2e38 (times log2(e) it must be a normal float32, the kernels' ``qk_scale``); default
            ``D ** -0.5``.
        precision: ``"bf16"`` or ``"fp8"``: Q, K, V quantized inside the call to E4M3 with
            document-local token-block exponents (DESIGN.md §4; ``kernels/fp8_attention.py``), the
            Gluon FP8 forward and backward on CUDA sm_90 (head_dim 64 or 128, bf16 inputs; the forward saves
            the codes for the backward, ``kernels/fp8_backward.py``), the differentiable CPU emulation
            of the same numerics elsewhere (``kernels/fp8_emulation.py``). ``config`` is refused with it.
        work_list: a prebuilt ``WorkList`` (:func:`build_attention_work_list`). Given one, the call
            trusts ``cu_seqlens`` (validated when the list was built) and does no host sync: use it
            for CUDA graphs and in training loops. A list built for a row of another T or ``causal`` is
            rejected on every path. One built for other ``cu_seqlens`` of the same T is rejected where
            that costs no sync: when the list was built from a ``cu_seqlens`` on the CPU (it keeps a
            copy) and the call's ``cu_seqlens`` is on the CPU too (the CPU fallback); on a GPU it is
            not detected (``scheduler.worklist.check_work_list_row``). Without one, ``cu_seqlens`` is
            validated on the host (one sync) and a list is built on the device.
        return_lse: also return the LSE ``(H_q, T)`` float32 (float64 for float64 inputs on the CPU
            fallback; natural log; differentiable).
        deterministic: bitwise reproducible gradients. With ``False`` (default) the Gluon
            backward's dK/dV programs also accumulate dQ in fp32 by TMA bulk reduces
            (``GluonBwdConfig.dq_reduce``: 5 matrix products per tile pair, the order of the
            additions varies run to run); ``True`` runs its separate dQ programs instead (7
            products; FlashAttention's ``deterministic`` flag). The forward, dK and dV, and the
            Triton backward are deterministic either way. With ``precision="fp8"`` the FP8 backward's
            programs of one document add their dQ partials in the order of their key tiles
            (``gluon_fp8_bwd(deterministic=True)``, turn counters); the CPU emulation always is.
        config: tile/launch configuration, an ``AttentionKernelConfig`` (by name:
            ``candidate_config(name)``; default :func:`flamia_pack.kernels.config.kernel_config`
            for ``head_dim``, ``causal``, ``max_seqlen`` and the GQA group, at ``D == 128``: MHA rows
            with ``max_seqlen < 128`` the small tile set's ``small_n32r``, 128-256 the persistent Gluon
            forward on whole 256-row items (each document's K / V loaded once) with the small set's Triton
            backward (``small_fwd_pers_items_n64s5_skip``), 257-512 the same on 128-row items
            (``small_fwd_pers``), 513-1,024 the persistent
            Gluon kernels ``all_pers_dqp``; GQA rows with ``max_seqlen <= 1024`` ``small_m16``;
            longer rows the persistent Gluon forward and the Gluon backward). On the CPU fallback
            the config is validated but does not change the (reference) computation.
        check_finite: reject NaN / Inf in the documents' tokens of q, k, v (the row-end padding after
            ``cu_seqlens[-1]`` is not checked) with an error naming the tensor, token and head.
            ``None`` (default): on the CPU fallback only (outside ``torch.compile``); the GPU path
            skips it, since it reads q, k, v once more and syncs (W7: +45% on the forward).
            ``True``: on every path (one device sync); ``False``: never. Unchecked non-finite
            inputs give non-finite outputs. A document with items of its own keeps them to itself,
            in O and in dQ, dK, dV (Triton kernels: masked loads; Gluon kernels: the tile a
            document end cuts has the next document's rows zeroed or is loaded ending at the
            document end; GPU test ``test_nan_in_one_document_stays_in_it``, every kernel family);
            short documents merged into one 128-query item (``merge_short``)
            share key tiles, and a NaN / Inf in one's K or V reaches the others (masked P is 0, and
            0 x NaN is NaN in the P V product): a known defect.
        scale_granularity: FP8 only: ``"block"`` (one exponent per document-local 32-token group,
            the default) or ``"token"`` (one per token: strict causal mode, O_i reads nothing from
            tokens after i, bitwise). With ``precision="bf16"`` both are accepted and change nothing
            (no scales: BF16 attention already reads nothing after i), so code that switches
            ``precision`` can keep one setting.
        causal_dq_scale: FP8 only: the backward's dQ uses no data-dependent scale that reads later
            keys (paper §3.4). Always satisfied: the dQ payload's scale of query i reads only the keys
            i sees and dQ accumulates in fp32 without a data-dependent scale
            (``kernels/fp8_emulation_bwd.py``), so the flag changes nothing.
        qk_rotation: FP8 only: ``None`` (default; ``"none"`` too) or ``"hadamard"``: q and k are multiplied by a
            scaled Hadamard matrix before the quantization (scores unchanged up to rounding; a
            channel's outliers spread over all D channels, so the E4M3 scales follow the tokens'
            norms; FlashAttention-3 §3.3). Helps inputs with large channels (outlier channels,
            trained models' RoPE pairs), neutral on N(0, 1); costs two matmuls a pass
            (``kernels/qk_rotation.py``). Per token, so causal safety is unchanged. With
            ``precision="bf16"`` it is an error (BF16 needs no rotation).
        qk_terms: FP8 only: ``1`` (default) or ``2``: Q and K each as an E4M3 code plus an E4M3 code of its
            rounding residual on the same exponent (about 8 significant bits instead of 4), S from three FP8
            products (``Q K^T + Q K_lo^T + Q_lo K^T``) in the forward and in the backward's recomputation, dQ
            against ``K + K_lo``. Closes most of the gap to BF16 on peaked softmaxes (trained models, outlier
            channels; ``kernels/fp8_emulation.py``); costs two more Q K^T products a tile (forward and
            backward) and, with gradients, ``T D (H_q + 2 H_kv)`` bytes more of saved codes. Combines with
            ``qk_rotation``. With ``precision="bf16"`` ``2`` is an error.
        pv_terms: FP8 only: ``1`` (default) or ``2``: P~ and V as E4M3 code + residual code: the forward's P~V three
            FP8 products, the backward's dP two. With ``qk_terms=2`` it meets issue 28's gradient targets on
            trained-model inputs, at more MMA work than BF16. With ``precision="bf16"`` ``2`` is an error.

    Returns:
        ``o`` ``(T, H_q, D)`` in q's dtype (``precision="fp8"``: bf16), or ``(o, lse)`` if ``return_lse``.

    Raises:
        FlamiaError / MetadataError: invalid inputs (message says what was expected), a
            ``work_list`` built for another T or ``causal`` (or, on the CPU, other ``cu_seqlens``).
    """
    if precision not in ("bf16", "fp8"):
        raise FlamiaError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if scale_granularity not in ("block", "token"):
        raise FlamiaError(f"scale_granularity must be 'block' or 'token', got {scale_granularity!r}")
    if not isinstance(causal_dq_scale, bool):
        raise FlamiaError(f"causal_dq_scale must be a bool, got {causal_dq_scale!r}")
    if not (qk_rotation is None or (isinstance(qk_rotation, str) and qk_rotation in QK_ROTATIONS)):
        raise FlamiaError(f"qk_rotation must be None, 'none' or 'hadamard', got {qk_rotation!r}")
    if qk_rotation == "none":  # the transformers options' spelling of "off"
        qk_rotation = None
    if qk_rotation is not None and precision != "fp8":
        raise FlamiaError("qk_rotation applies to precision='fp8' (it spreads outlier channels before the E4M3 "
                          "quantization); leave it None with precision='bf16'")
    qk_terms, pv_terms = check_qk_terms(qk_terms), check_pv_terms(pv_terms)
    for name, terms, operands in (("qk_terms", qk_terms, "Q and K"), ("pv_terms", pv_terms, "P~ and V")):
        if terms == 2 and precision != "fp8":
            raise FlamiaError(f"{name}=2 applies to precision='fp8' ({operands} as E4M3 code + residual code); leave "
                              "it 1 with precision='bf16'")
    # numpy bools (e.g. from a config array) are bools too
    causal, return_lse, deterministic = (bool(x) if isinstance(x, np.bool_) else x
                                         for x in (causal, return_lse, deterministic))
    for flag, val in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(val, bool):
            raise FlamiaError(f"{flag} must be a bool (True or False), got {val!r} ({type(val).__name__})")
    if check_finite is not None and not isinstance(check_finite, bool):
        raise FlamiaError(f"check_finite must be None, True or False, got {check_finite!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _expect_tensor(name, x)
    env_candidate()  # a FLAMIA_ATTN_CONFIG typo fails on every path (CPU fallback, explicit config)
    use_kernels = kernels_available(q.device)
    T, H, Hkv, D = check_attention_inputs(q, k, v, cu_seqlens, max_seqlen, kernel_path=use_kernels)
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) or not (
            math.isfinite(softmax_scale) and softmax_scale > 0):
        raise FlamiaError(f"softmax_scale must be a finite float > 0, got {softmax_scale!r}")
    # the kernels take softmax_scale * log2(e) as a normal float32: a scale that rounds to 0 or a
    # subnormal there (or to inf) would turn the -inf masks into NaN rather than scale the scores
    if not _MIN_SOFTMAX_SCALE <= softmax_scale <= _MAX_SOFTMAX_SCALE:
        raise FlamiaError(f"softmax_scale must lie in [{_MIN_SOFTMAX_SCALE:.3g}, {_MAX_SOFTMAX_SCALE:.3g}] (its "
                          f"product with log2(e) must be a normal float32), got {softmax_scale!r}")
    if qk_rotation is not None and D in (64, 128):  # (other D: the FP8 path's head_dim error follows)
        from flamia_pack.kernels.qk_rotation import rotation_scale_factor

        if softmax_scale * rotation_scale_factor(D) < _MIN_SOFTMAX_SCALE:  # halved at head_dim 128
            raise FlamiaError(f"softmax_scale {softmax_scale!r} is too small for qk_rotation at head_dim {D} (which "
                              f"scales it by {rotation_scale_factor(D)}): it must be >= "
                              f"{_MIN_SOFTMAX_SCALE / rotation_scale_factor(D):.3g}")
    max_seqlen = int(max_seqlen)
    _check_config_arg(config)
    # cu_seqlens values, checked once and as given (int64 before the int32 cast below, which would wrap
    # 2**32 + n to n) whenever no work list is given; the CPU fallback also with one (the reference
    # reads cu_seqlens itself and has no device sync to save), except while torch.compile traces
    min_seqlen = doc_tokens = None
    if work_list is None or (not use_kernels and not torch.compiler.is_compiling()):
        min_seqlen, doc_tokens = _check_cu_values(cu_seqlens, T, max_seqlen)
    if check_finite or (check_finite is None and not use_kernels and not torch.compiler.is_compiling()):
        # the documents' tokens (the row-end padding's values are never read into a document's output)
        n = T if doc_tokens is None else int(doc_tokens)
        from flamia_pack.kernels.fp8_attention import fp8_kernels_available

        emulated = precision == "fp8" and not (use_kernels and fp8_kernels_available(q.device))
        _check_finite_inputs(q[:n], k[:n], v[:n], skippable=not emulated)
    # a captured / compiled step must not bake in one row's launch decision (and dynamo cannot guard
    # on the buffers' version counters): no hint there
    if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        min_seqlen = doc_tokens = None
    elif work_list is not None and min_seqlen is None:
        from flamia_pack.scheduler.worklist import work_list_hints

        # known if it was built with validate=True (or given the host values), and still current
        min_seqlen, doc_tokens = work_list_hints(work_list)
    cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    if not cu32.is_contiguous():
        cu32 = cu32.contiguous()
    if precision == "fp8":
        from flamia_pack.kernels.fp8_attention import fp8_kernels_available, fp8_varlen_attention

        if config is not None:
            raise FlamiaError("config= picks the BF16 kernels' tiles; precision='fp8' runs its own (leave config=None)")
        o, lse = fp8_varlen_attention(q, k, v, cu32, max_seqlen, causal=causal, softmax_scale=float(softmax_scale),
                                      scale_granularity=scale_granularity,
                                      use_kernels=use_kernels and fp8_kernels_available(q.device), work_list=work_list,
                                      deterministic=deterministic, qk_rotation=qk_rotation, qk_terms=qk_terms,
                                      pv_terms=pv_terms)
        if return_lse and lse is None:
            raise FlamiaError("return_lse=True with gradients is not supported by the FP8 CPU emulation; call it "
                              "under torch.no_grad() for the LSE")
        return (o, lse) if return_lse else o
    if use_kernels:
        cfg = config if config is not None else kernel_config(D, causal, max_seqlen=max_seqlen,
                                                               num_kv_groups=q.shape[1] // k.shape[1])
        if deterministic and cfg.gluon_bwd is not None and cfg.gluon_bwd.dq_reduce:
            cfg = dataclasses.replace(cfg, gluon_bwd=dataclasses.replace(cfg.gluon_bwd, dq_reduce=False))
        if cfg.fwd.schedule == "policy":  # the scheduler's static / dynamic rule, from host ints
            cfg = _resolve_policy(cfg, causal, max_seqlen, T, cu32.numel() - 1)
        if work_list is None:
            items, num_items = _default_work_list(cu32, T, max_seqlen, causal, cfg)
        else:
            if config is None:  # the automatic choice follows a 128-row list built without max_seqlen
                cfg = _config_for_list(cfg, work_list)
            items, num_items = _check_work_list(work_list, causal, cfg, q.device, T, cu_seqlens)
        cfg_ints = _op_config_ints(cfg, launch_bits(cfg, min_seqlen, doc_tokens, T))
    else:
        cfg = config if config is not None else _DEFAULT_CONFIG
        if work_list is not None:  # checked for the same mistakes as on the GPU, then unused by the reference
            if config is None and D in (64, 128):  # the list of the config the GPU path would pick
                cfg = _config_for_list(kernel_config(D, causal, max_seqlen=max_seqlen,
                                                     num_kv_groups=q.shape[1] // k.shape[1]), work_list)
            _check_work_list(work_list, causal, cfg, q.device, T, cu_seqlens)
        items = torch.empty((0, 4), dtype=torch.int32, device=q.device)
        num_items = torch.zeros((1,), dtype=torch.int32, device=q.device)
        cfg_ints = _config_to_ints(cfg)
    args = (q, k, v, cu32, items, num_items, causal, float(softmax_scale), cfg_ints)
    # the custom op (with its fake implementation) whenever a tracer may be watching: torch.compile /
    # export, or a dispatch mode such as FakeTensorMode / make_fx's proxy mode outside of them
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        o, lse = torch.ops.flamia_pack.varlen_attn_fwd(*args)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = _VarlenAttnFn.apply(*args)
    else:  # no graph to record: the forward's body alone
        o, lse = _fwd_impl(*args)
    return (o, lse) if return_lse else o
