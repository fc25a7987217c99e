"""``precision="fp8"`` backward on the GPU, the host side (issue 28; DESIGN.md §4-5).

Quantizes dO once (the forward's token-block scheme, both layouts, one launch), forms
``Delta = rowsum(dO^ O) - dLSE`` from the reconstructed dO and the saved O (``fp8_bwd_prep``),
builds the factor tables and the dK/dV programs' list, and runs ``gluon_fp8_bwd`` (dK, dV and the dQ reduce in one launch).
The forward saves its codes (:class:`~flamia_pack.kernels.fp8_attention.FP8Operands` with the
feature-major Q^T, K^T and the row-major V codes: ``fp8_quantize(backward=True)``), so nothing is
re-quantized but dO.
"""
from __future__ import annotations

import torch

from flamia_pack.errors import FlamiaError

__all__ = ["fp8_backward", "quantize_do"]


def quantize_do(do: torch.Tensor, cu32: torch.Tensor, granularity: str):
    """dO ``(T, H_q, D)`` bf16 as the FP8 backward reads it: ``kernels.quantize.quantize`` with the
    forward's granularity, codes and their feature-major copy in the wgmma order (the dV product's
    B operand: ``to_wgmma_order``): the quantizer's launch (hardware E4M3 convert) and one transposing
    launch (``transposed_store="triton"``, as ``fp8_attention.fp8_quantize``)."""
    from flamia_pack.kernels.quantize import quantize

    return quantize(do, cu32, granularity, transposed=True, wgmma_order=True, transposed_store="triton",
                    check_finite=False, validate=False)


def fp8_backward(do: torch.Tensor, ops, o: torch.Tensor, lse: torch.Tensor, cu32: torch.Tensor, *, causal: bool,
                 softmax_scale: float, dlse: torch.Tensor | None = None, entries=None, deterministic: bool = False):
    """Gradients of the FP8 forward on CUDA sm_90.

    Args:
        do: ``(T, H_q, 128)`` bf16 gradient of ``o``; ops: the forward's ``FP8Operands`` (built with
            ``fp8_quantize(backward=True)``; with ``qk_terms=2`` the backward recomputes S from the same three
            products and forms dQ against K + K_lo; with ``pv_terms=2``, ``vc_lo``, dP against V + V_lo); o, lse:
            the forward's outputs; cu32: validated int32 ``cu_seqlens`` on the device; causal, softmax_scale: the forward's; dlse: optional ``(H_q, T)``.
        entries: optional ``gluon_fp8_bwd.fp8_bwd_entries`` result (reuse across calls).
        deterministic: bitwise reproducible dQ (``gluon_fp8_bwd(deterministic=True)``: a document's key
            tiles add their dQ partials in a fixed order); dK / dV are reproducible either way.

    Returns:
        ``(dq, dk, dv)`` bf16 ``(T, H_q, 128)``, ``(T, H_kv, 128)`` x 2; padding rows 0.

    Raises:
        FlamiaError: operands saved without the backward's layouts.
    """
    from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta
    from flamia_pack.kernels.gluon_fp8_bwd import gluon_fp8_bwd
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    if ops.qt is None or ops.kt is None or ops.vc is None or (ops.kc_lo is not None and ops.kt_lo is None) or (
            ops.vt_lo is not None and ops.vc_lo is None):
        raise FlamiaError("the FP8 backward needs the forward's Q^T, K^T and row-major V codes (two-term operands: "
                          "K_lo^T, V_lo too): quantize with fp8_quantize(..., backward=True)")
    dq8 = quantize_do(do.to(torch.bfloat16).contiguous(), cu32, ops.granularity)
    delta = fp8_bwd_delta(dq8.codes, dq8.exponents, o, dlse)
    dq_acc, dk, dv = gluon_fp8_bwd(ops.qc, ops.kc, ops.vc, ops.qt, ops.kt, dq8.codes, dq8.codes_t,
                                   exponent_table(ops.eq), ops.ekt, ops.evt, exponent_table(dq8.exponents),
                                   lse, delta, cu32, softmax_scale, causal=causal, entries=entries, cast_dq=False,
                                   deterministic=deterministic, qc_lo=ops.qc_lo, kc_lo=ops.kc_lo, kt_lo=ops.kt_lo,
                                   vc_lo=ops.vc_lo)
    del dq8, delta  # dO's codes are dead: freed before the bf16 dQ is allocated (the call's memory peak)
    return dq_acc.to(torch.bfloat16), dk, dv
