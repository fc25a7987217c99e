"""``precision="fp8"``: token-block scaled FP8 attention, the host side (DESIGN.md §4-5, issue 27).

One call quantizes Q, K and V to E4M3 with document-local exponents (``kernels.quantize.quantize_qkv``,
one launch; V also in the feature-major layout the FP8 ``P~ V`` product reads) and runs the Gluon
FP8 forward (``gluon_fp8_fwd.py``) over a work list without merged items (every item holds one
document, so the kernel needs no per-token document mask). Callers that quantize inside their
projection pass codes + exponents instead (:func:`fp8_attention_forward`).

Paths: CUDA sm_90 with triton -> the kernels; anything else (CPU, other GPUs) -> the CPU emulation
:func:`~flamia_pack.kernels.fp8_emulation.fp8_varlen_attention_emulated`, which computes the same
numerics (module docs there) and is differentiable. On the GPU, a call that needs gradients saves the
codes (and Q^T, K^T from the same quantizer launch) for the Gluon FP8 backward (``fp8_backward.py``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.quant import GRANULARITIES
from flamia_pack.scheduler.worklist import WorkList

__all__ = ["FP8Operands", "FP8WorkList", "fp8_quantize", "fp8_attention_forward", "fp8_varlen_attention",
           "build_fp8_work_list", "fp8_kernels_available"]

FP8_BLOCK_M = 128
"""Query rows per work-list item and per kernel entry of the FP8 forward."""


class FP8Operands(NamedTuple):
    """What the FP8 forward reads: E4M3 codes and UE8M0 exponent bytes (``e + 127``, dense per token).

    Fields: ``qc`` ``(T, H_q, D)``, ``kc`` ``(T, H_kv, D)`` float8_e4m3fn; ``vt`` V's codes feature-major
    ``(H_kv, D, ceil16(T))`` in the wgmma order (``kernels.quantize.to_wgmma_order``: the kernel's P~ is
    the A operand straight from the accumulator), zeros at the padding tokens; ``eq`` ``(T, H_q)``, ``ek`` /
    ``ev`` ``(T, H_kv)`` uint8; ``ekt`` / ``evt``: ``ek`` / ``ev`` as the kernel's key-major float32 factor
    tables ``(H_kv, ceil16(T) + TABLE_PAD)``, ``2^(clamp(byte, 1, 254) - 127)`` per token, 1.0 past T
    (``gluon_fp8_fwd.exponent_table``); ``granularity``: ``"block"`` or ``"token"`` (labels the exponents).
    What only the backward reads (``fp8_quantize(backward=True)``, else None): ``qt`` ``(H_q, D, ceil16(T))``
    in the wgmma order (the dK product's B operand) and ``kt`` ``(H_kv, D, T)`` in token order (the dQ
    partial's, whose A operand goes through shared memory), feature-major codes; ``vc`` ``(T, H_kv, D)`` row-major.
    Two-term Q and K (``fp8_quantize(qk_terms=2)``, else None): ``qc_lo`` ``(T, H_q, D)``, ``kc_lo`` ``(T, H_kv, D)``
    the residual codes on ``eq`` / ``ek`` (``quant.residual_codes``); ``kt_lo`` ``(H_kv, D, T)`` K_lo^T as ``kt``
    (with ``backward``). Two-term V (``fp8_quantize(pv_terms=2)``, else None): ``vt_lo`` V's residual codes as
    ``vt`` (the forward's P~ V_lo), ``vc_lo`` as ``vc`` (with ``backward``: the backward's V_lo dO^T).
    """

    qc: torch.Tensor
    kc: torch.Tensor
    vt: torch.Tensor
    eq: torch.Tensor
    ek: torch.Tensor
    ev: torch.Tensor
    ekt: torch.Tensor
    evt: torch.Tensor
    granularity: str = "block"
    qt: Optional[torch.Tensor] = None
    kt: Optional[torch.Tensor] = None
    vc: Optional[torch.Tensor] = None
    qc_lo: Optional[torch.Tensor] = None
    kc_lo: Optional[torch.Tensor] = None
    kt_lo: Optional[torch.Tensor] = None
    vt_lo: Optional[torch.Tensor] = None
    vc_lo: Optional[torch.Tensor] = None


def fp8_kernels_available(device) -> bool:
    """True where the Gluon FP8 forward runs: a CUDA device of compute capability 9.x with triton's Gluon."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    from flamia_pack.kernels.flash_fwd import gluon_available

    return gluon_available()


def fp8_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 scale_granularity: str = "block", *, check_finite: bool = False,
                 backward: bool = False, rotate_qk: bool = False, qk_terms: int = 1, pv_terms: int = 1) -> FP8Operands:
    """Quantize Q, K, V for the FP8 forward in one launch (V also feature-major, in the wgmma order).

    ``quantize_qkv(transposed=(backward, backward, True), wgmma_order=(backward, False, True),
    transposed_store="triton")``: the quantizer writes the row-major codes with the hardware E4M3
    convert, and one transposing launch per copy writes V^T (and, ``backward``, Q^T and K^T) from those
    codes (the in-kernel transposed store needed the integer encoder, which doubled the quantizer's
    time: benchmarks/NOTES.md). The codes are ``quant.quantize_token_blocks``' bits for finite inputs;
    a NaN input gets the NaN code (as BF16, it propagates within its document).

    Args:
        q: ``(T, H_q, D)``, k, v: ``(T, H_kv, D)`` bf16 / fp16 / fp32 on one device.
        cu_seqlens: ``(n_docs + 1,)`` int32 on that device (validated by the caller).
        scale_granularity: ``"block"`` (document-local 32-token groups) or ``"token"``.
        check_finite: raise on NaN / Inf (one sync); default off, as the BF16 GPU path.
        backward: also keep what the FP8 backward reads (Q^T, in the wgmma order, and K^T written by
            the same launch, V's row-major codes).
        rotate_qk: quantize ``q M`` and ``k M`` (``qk_rotation.hadamard_matrix``, ``qk_rotation="hadamard"``),
            rotated inside the quantizer (bf16 q, k; one more launch, for V); the caller scales
            ``softmax_scale`` by ``qk_rotation.rotation_scale_factor``.
        qk_terms: 1, or 2: Q's and K's residual codes too (``qc_lo``, ``kc_lo``; with ``backward`` also
            ``kt_lo``), encoded in the same launch (``fp8_emulation`` ``qk_terms=2``).
        pv_terms: 1, or 2: V's residual codes too (``vt_lo``; with ``backward`` also ``vc_lo``), the same launch.

    Returns:
        :class:`FP8Operands`.
    """
    from flamia_pack.kernels.fp8_emulation import check_pv_terms, check_qk_terms
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table
    from flamia_pack.kernels.quantize import quantize_qkv

    if not isinstance(backward, bool):
        raise FlamiaError(f"fp8_quantize: backward must be a bool, got {backward!r}")
    two = check_qk_terms(qk_terms) == 2
    two_v = check_pv_terms(pv_terms) == 2
    qq, kq, vq = quantize_qkv(q, k, v, cu_seqlens, scale_granularity, transposed=(backward, backward, True),
                              wgmma_order=(backward, False, True), transposed_store="triton",
                              check_finite=check_finite, validate=False, rotate_qk=rotate_qk,
                              residual=(two, two, two_v), residual_transposed=(False, two and backward, two_v))
    return FP8Operands(qq.codes, kq.codes, vq.codes_t, qq.exponents, kq.exponents, vq.exponents,
                       exponent_table(kq.exponents), exponent_table(vq.exponents), scale_granularity,
                       qq.codes_t if backward else None, kq.codes_t if backward else None,
                       vq.codes if backward else None, qq.codes_lo, kq.codes_lo, kq.codes_lo_t, vq.codes_lo_t,
                       vq.codes_lo if backward else None)


@dataclasses.dataclass
class FP8WorkList(WorkList):
    """A :class:`~flamia_pack.scheduler.worklist.WorkList` of the FP8 forward plus the FP8 backward's
    dK/dV entries for the same ``cu_seqlens`` (``bwd_entries``: ``gluon_fp8_bwd.fp8_bwd_entries``'
    ``(entries, n_entries, max_entries)``, or None where the kernels do not run). One list per packed row
    serves every layer's forward and backward: the entries are ~15 small device ops, which a backward
    without them rebuilds on every call."""

    bwd_entries: tuple | None = None


def build_fp8_work_list(cu_seqlens: torch.Tensor, total_tokens: int, *, causal: bool = True, validate: bool = True,
                        max_items: int | None = None, backward: bool = True) -> FP8WorkList:
    """The work list of the FP8 forward (128-row items, no merged items) and, with ``backward`` on a device
    where the kernels run, the backward's entries (:class:`FP8WorkList`), for reuse across calls, layers
    and CUDA graphs: ``fp8_attention_forward(..., work_list=)`` / ``varlen_attention(precision="fp8",
    work_list=)``. No host sync with ``validate=False``.

    Args/Raises: as :func:`flamia_pack.scheduler.worklist.build_work_list`; ``causal``, ``validate`` and
    ``backward`` must be bools (FlamiaError). The list describes the ``cu_seqlens`` it was built from: a
    call with other ``cu_seqlens`` of the same T is an error where both are on the CPU (the list
    remembers a CPU ``cu_seqlens``; ``scheduler.worklist.check_work_list_row``) and not detected on a
    GPU (no host sync), as for every prebuilt list.
    """
    from flamia_pack.scheduler.worklist import TileConfig, build_work_list

    for name, flag in (("causal", causal), ("validate", validate), ("backward", backward)):
        if not isinstance(flag, bool):
            raise FlamiaError(f"build_fp8_work_list: {name} must be a bool, got {flag!r}")
    wl = build_work_list(cu_seqlens, total_tokens, TileConfig(block_m=FP8_BLOCK_M, causal=bool(causal),
                                                              merge_short=False),
                         max_items=max_items, validate=validate)
    entries = None
    if backward and fp8_kernels_available(wl.items.device):
        from flamia_pack.kernels.gluon_fp8_bwd import fp8_bwd_entries

        cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        entries = fp8_bwd_entries(cu32.to(wl.items.device), total_tokens, causal=bool(causal))
    out = FP8WorkList(**{f.name: getattr(wl, f.name) for f in dataclasses.fields(WorkList)}, bwd_entries=entries)
    out._hint_versions = getattr(wl, "_hint_versions", None)  # the build's stamp: same buffers, same hints
    out._built_from = getattr(wl, "_built_from", None)  # and the cu_seqlens it remembers (CPU builds)
    return out


def _check_fp8_list(work_list, causal: bool, device, T: int, cu_seqlens: torch.Tensor):
    from flamia_pack.scheduler.worklist import check_work_list_row, check_work_list_tensors

    items, num_items = check_work_list_tensors(work_list, device)
    wcfg = work_list.config
    if wcfg.block_m != FP8_BLOCK_M or wcfg.merge_short or bool(wcfg.causal) != bool(causal):
        raise FlamiaError(f"the FP8 forward needs a work list of {FP8_BLOCK_M}-row items without merged items built "
                          f"for causal={causal} (build_fp8_work_list), got block_m={wcfg.block_m}, "
                          f"merge_short={wcfg.merge_short}, causal={wcfg.causal}")
    built_t = getattr(work_list, "total_tokens", None)
    if built_t is not None and int(built_t) != int(T):
        raise FlamiaError(f"work_list was built for a row of T={built_t} tokens but q has T={T}")
    ent = getattr(work_list, "bwd_entries", None)
    if ent is not None and not (isinstance(ent, tuple) and len(ent) == 3 and isinstance(ent[0], torch.Tensor)
                                and ent[0].dtype == torch.int32 and ent[0].dim() == 2 and ent[0].shape[1] == 4
                                and isinstance(ent[1], torch.Tensor) and ent[1].dtype == torch.int32
                                and ent[1].numel() == 1 and isinstance(ent[2], int) and ent[0].shape[0] == ent[2]
                                and ent[0].device == items.device and ent[1].device == items.device):
        raise FlamiaError("work_list.bwd_entries must be None or gluon_fp8_bwd.fp8_bwd_entries' (entries, n_entries, "
                          "max_entries) for this row, on the list's device: build the list with build_fp8_work_list")
    # other cu_seqlens of the same T: caught where both are on the CPU (no sync), see check_work_list_row
    check_work_list_row(work_list, cu_seqlens, "build_fp8_work_list(cu_seqlens, T)")
    return items, num_items


def fp8_attention_forward(ops: FP8Operands, cu_seqlens: torch.Tensor, *, causal: bool = True,
                          softmax_scale: float | None = None, work_list=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward on already-quantized operands (CUDA sm_90; no host sync with a ``work_list``).

    Args:
        ops: :class:`FP8Operands` (e.g. from :func:`fp8_quantize`, or a projection that quantizes).
        cu_seqlens: ``(n_docs + 1,)`` int32 on the device, validated (``cu_seqlens[-1] <= T``).
        causal, softmax_scale: as ``varlen_attention`` (default scale ``D ** -0.5``).
        work_list: :func:`build_fp8_work_list`'s list for this row (default: built here).

    Returns:
        ``(o, lse)``: ``(T, H_q, D)`` bf16 and ``(H_q, T)`` float32 natural-log LSE; row-end padding
        rows get ``o = 0``, ``lse = +inf``.

    Raises:
        FlamiaError: not on a device with the FP8 kernels, or a work list built for something else;
        ValueError (from the kernel launcher): operands of the wrong dtype / shape / layout.
    """
    if not isinstance(ops, FP8Operands):
        raise FlamiaError(f"ops must be FP8Operands (fp8_quantize), got {type(ops).__name__}")
    if not fp8_kernels_available(ops.qc.device):
        raise FlamiaError(f"the FP8 attention kernels need a CUDA GPU of compute capability 9.x (Hopper) with "
                          f"triton's Gluon; got {ops.qc.device} (use varlen_attention(precision='fp8') for the "
                          "CPU emulation)")
    from flamia_pack.kernels.flash_fwd import fill_tails
    from flamia_pack.kernels.gluon_fp8_fwd import gluon_fp8_fwd

    T, H, D = ops.qc.shape
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    if work_list is None:
        work_list = build_fp8_work_list(cu32, T, causal=causal, validate=False)
    items, num_items = _check_fp8_list(work_list, causal, ops.qc.device, T, cu32)
    o, lse = gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu32, items, num_items, scale,
                           causal=causal, wl_block_m=FP8_BLOCK_M, skip_len=0, qc_lo=ops.qc_lo, kc_lo=ops.kc_lo,
                           vt_lo=ops.vt_lo)
    fill_tails([(o, 0.0, 0), (lse, math.inf, 1)], cu32)
    return o, lse


class _FP8Attention(torch.autograd.Function):
    """The GPU FP8 forward and backward (``fp8_backward.py``) as one autograd node: the forward's codes
    are saved for the backward (no re-quantization of Q, K, V). ``quantizer``: optional
    ``(q, k, v, cu32) -> FP8Operands`` with the backward's layouts, replacing :func:`fp8_quantize` (for
    experiments with other exponent assignments; the kernels read any per-token exponents)."""

    @staticmethod
    def forward(ctx, q, k, v, cu32, causal, softmax_scale, granularity, work_list, quantizer=None,
                deterministic=False, rotate_qk=False, qk_terms=1, pv_terms=1):
        if quantizer is None:
            ops = fp8_quantize(q, k, v, cu32, granularity, backward=True, rotate_qk=rotate_qk, qk_terms=qk_terms,
                               pv_terms=pv_terms)
        elif rotate_qk or qk_terms != 1 or pv_terms != 1:
            raise FlamiaError("_FP8Attention: a custom quantizer with rotate_qk=True, qk_terms=2 or pv_terms=2 (the "
                              "quantizer must rotate / write the residual codes itself; pass rotate_qk=False, "
                              "qk_terms=1, pv_terms=1)")
        else:
            ops = quantizer(q, k, v, cu32)
        o, lse = fp8_attention_forward(ops, cu32, causal=causal, softmax_scale=softmax_scale, work_list=work_list)
        # V^T (and V_lo^T) are the forward's operands only (the backward reads V row-major): not kept
        ctx.save_for_backward(o, lse, cu32, ops.qc, ops.kc, *(ops[3:8]), ops.qt, ops.kt, ops.vc, ops.qc_lo, ops.kc_lo,
                              ops.kt_lo, ops.vc_lo)
        ctx.fp8 = (causal, float(softmax_scale), granularity, bool(deterministic), bool(rotate_qk))
        ctx.entries = getattr(work_list, "bwd_entries", None)  # built for this cu_seqlens with the list
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        from flamia_pack.kernels.fp8_backward import fp8_backward

        o, lse, cu32, qc, kc, *rest = ctx.saved_tensors
        causal, scale, granularity, deterministic, rotated = ctx.fp8
        ops = FP8Operands(qc, kc, None, *rest[:5], granularity, *rest[5:11], vc_lo=rest[11])
        dq, dk, dv = fp8_backward(do, ops, o, lse, cu32, causal=causal, softmax_scale=scale, dlse=dlse,
                                  entries=ctx.entries, deterministic=deterministic)
        if rotated:  # gradients of the rotated q M, k M: back through M (symmetric), a bf16 matmul each
            from flamia_pack.kernels.qk_rotation import device_matrix

            m = device_matrix(dq.shape[-1], dq.device)
            dq, dk = dq @ m, dk @ m
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def fp8_varlen_attention(q, k, v, cu32: torch.Tensor, max_seqlen: int, *, causal: bool, softmax_scale: float,
                         scale_granularity: str, use_kernels: bool, work_list=None, deterministic: bool = False,
                         qk_rotation: str | None = None, qk_terms: int = 1, pv_terms: int = 1):
    """``varlen_attention(precision="fp8")`` after the common checks (``attention.py``): ``(o, lse)``.

    ``use_kernels``: the Gluon FP8 path (CUDA sm_90); else the differentiable CPU emulation.
    ``deterministic``: the GPU backward adds dQ partials in a fixed order (``gluon_fp8_bwd``); the
    emulation is deterministic either way. ``qk_rotation="hadamard"``: q and k rotated before the
    quantization and ``softmax_scale`` scaled to match (``kernels/qk_rotation.py``), on both paths.
    ``qk_terms=2``: Q and K as code + residual code (``fp8_emulation`` module docs), on both paths;
    ``pv_terms=2``: P~ and V too (the forward's P~ V three products, the backward's dP two), on both paths.
    """
    if scale_granularity not in GRANULARITIES:
        raise FlamiaError(f"scale_granularity must be one of {GRANULARITIES}, got {scale_granularity!r}")
    D = q.shape[2]
    if D not in (64, 128) and use_kernels:
        raise FlamiaError(f"precision='fp8' on the GPU supports head_dim 64 and 128, got {D} (precision='bf16' runs 64 "
                          "and 128)")
    if use_kernels and (q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16):
        raise FlamiaError(f"precision='fp8' on the GPU takes bfloat16 q, k, v (quantized inside), got {q.dtype}")
    if qk_rotation is not None:
        from flamia_pack.kernels.qk_rotation import rotate_qk, rotation_scale_factor

        if D not in (64, 128):
            raise FlamiaError(f"FP8 attention supports head_dim in (64, 128), got {D}")
        softmax_scale = softmax_scale * rotation_scale_factor(D)
    if not use_kernels:
        if work_list is not None:  # checked for the same mistakes as on the GPU, then unused by the emulation
            _check_fp8_list(work_list, causal, q.device, q.shape[0], cu32)
        from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_fwd
        from flamia_pack.kernels.fp8_emulation import fp8_varlen_attention_emulated

        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        n = int(cu32[-1]) if cu32.numel() else 0  # (the emulation reads cu_seqlens on the host anyway)
        if n < q.shape[0]:  # the row-end padding's values are never read: zeros, so a NaN there is no error
            q, k, v = (torch.cat([x[:n], x.new_zeros((x.shape[0] - n,) + tuple(x.shape[1:]))]) for x in (q, k, v))
        if qk_rotation is not None:  # (the GPU path rotates inside its quantizer)
            was_finite = bool(torch.isfinite(q).all() and torch.isfinite(k).all())
            q, k = rotate_qk(q, k)
            if was_finite and not bool(torch.isfinite(q).all() and torch.isfinite(k).all()):
                raise FlamiaError(f"qk_rotation='hadamard' overflowed {q.dtype}: a rotated entry is up to sum |x| / 8 "
                                  "over the head's channels; scale q and k down (and softmax_scale up) or leave "
                                  "qk_rotation off")
        try:
            if grad:
                o = fp8_varlen_attention_emulated(q, k, v, cu32, max_seqlen, causal=causal,
                                                  softmax_scale=softmax_scale, scale_granularity=scale_granularity,
                                                  qk_terms=qk_terms, pv_terms=pv_terms)
                return o, None
            o, lse = emulated_fwd(q, k, v, cu32, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                                  scale_granularity=scale_granularity, qk_terms=qk_terms, pv_terms=pv_terms)
        except FlamiaError as exc:
            if "NaN or Inf" in str(exc):
                raise FlamiaError("varlen_attention(precision='fp8') on the CPU runs the FP8 emulation, which needs "
                                  "finite q, k, v (check_finite=False does not apply to it): "
                                  f"{str(exc).split(';')[0]}") from None
            raise
        return o.to(q.device), lse.to(q.device)
    return _fp8_gpu_call(q, k, v, cu32, causal, softmax_scale, scale_granularity, work_list, deterministic,
                         qk_rotation is not None, qk_terms, pv_terms)


@torch.compiler.disable
def _fp8_gpu_call(q, k, v, cu32, causal, softmax_scale, scale_granularity, work_list, deterministic=False,
                  rotate_qk=False, qk_terms=1, pv_terms=1):
    """The Gluon FP8 path, eager under ``torch.compile`` (one graph break per call): Inductor would re-emit
    the Triton quantizer from source and loses its module-level combine functions."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FP8Attention.apply(q, k, v, cu32, bool(causal), float(softmax_scale), scale_granularity, work_list,
                                   None, bool(deterministic), bool(rotate_qk), int(qk_terms), int(pv_terms))
    ops = fp8_quantize(q, k, v, cu32, scale_granularity, rotate_qk=rotate_qk, qk_terms=qk_terms, pv_terms=pv_terms)
    return fp8_attention_forward(ops, cu32, causal=causal, softmax_scale=softmax_scale, work_list=work_list)
