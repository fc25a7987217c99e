"""Preprocessing of the FP8 attention backward (Triton): ``Delta = rowsum(dO^ * O) - dLSE``.

:func:`fp8_bwd_delta` computes, per token ``t`` and query head ``h``::

    Delta[h, t] = fp32( sum_d  fp32(code[t, h, d] * 2^(ebyte[t, h] - 127)) * fp32(o[t, h, d]) ) - dlse[h, t]

from dO's E4M3 codes and dense per-token UE8M0 exponents (the quantizer's output,
:mod:`flamia_pack.kernels.quantize`), the forward's bf16 O and the optional LSE gradient. Every
product is one fp32 rounding (the decoded dO is exact in fp32: 4 significant bits times a power of
two); the sum over ``d`` is an fp32 tree reduction (Triton's reduce with ``tl.sum``'s combine), so the result equals the
emulation's (:mod:`flamia_pack.kernels.fp8_emulation_bwd`: the same products summed in fp64, rounded
once) within a few fp32 ulps of ``sum_d |dO^ O|``, not bitwise.

Kernel: one program per (block of ``BLOCK_T = 64`` tokens, head), grid ``(ceil(T / 64), H)``; rows
``t >= T`` of the last block are masked (nothing read, nothing written); ``BLOCK_D`` is the next
power of two of ``D`` with the extra features masked. Decoding E4M3: on CUDA the hardware cast
(``float8e4nv -> float32``); in Triton's CPU interpreter an integer decoder (sign, 4-bit exponent,
3-bit mantissa; exponent field 0 = subnormal ``m * 2^-9``; ``S.1111.111`` = NaN), because the
interpreter's float8 cast decodes the NaN codes as +-480 (its finite values are exact; both
decoders give the same bits for every finite code, tested). UE8M0 ``ebyte`` is decoded as
``2^(ebyte - 127)`` (``ebyte = 0``: the fp32 subnormal ``2^-127``; 255: NaN).

CPU tensors run the kernel in Triton's interpreter (tests); without triton installed they use
:func:`fp8_bwd_delta_reference`, the same formula in torch with a sequential-order fp32 sum.
"""
from __future__ import annotations

from typing import Optional

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.interpret import kernel_for

try:  # triton ships with CUDA builds of torch; the CPU build gets it from the dev extra
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["fp8_bwd_delta", "fp8_bwd_delta_reference", "BLOCK_T"]

#: Tokens per program.
BLOCK_T = 64


if HAS_TRITON:

    # only core builtins and our own combine function in the kernel (no triton.language standard
    # @jit helpers such as tl.sum), so the same source runs in the interpreter without
    # TRITON_INTERPRET set at import time (as kernels/quantize.py)
    @triton.jit
    def _add_combine(a, b):
        return a + b

    # tl.sum's own combine: the interpreter recognises it and reduces with numpy
    _SUM = getattr(tl.standard, "_sum_combine", _add_combine)

    @triton.jit
    def _delta_kernel(
        c_ptr, e_ptr, o_ptr, dlse_ptr, out_ptr,
        T,
        sc_t, sc_h, se_t, se_h, so_t, so_h, sl_h, sl_t,  # element strides (feature strides are 1)
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_DLSE: tl.constexpr,
        INT_DECODE: tl.constexpr,
    ):
        tb = tl.program_id(0)
        h = tl.program_id(1)
        rows = tb * BLOCK + tl.arange(0, BLOCK)
        in_t = rows < T
        rows64 = rows.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        if BLOCK_D == D:
            mask = in_t[:, None]
        else:
            mask = in_t[:, None] & (offs_d < D)[None, :]
        b = tl.load(c_ptr + rows64[:, None] * sc_t + h * sc_h + offs_d[None, :], mask=mask, other=0)
        if INT_DECODE:
            bi = b.to(tl.int32)
            ef = (bi >> 3) & 0xF
            mant = bi & 0x7
            sign = (bi & 0x80) << 24
            normal = (sign | ((ef + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
            sub = mant.to(tl.float32) * 0.001953125  # m * 2^-9, exact
            sub = tl.where(sign != 0, -sub, sub)
            x = tl.where(ef == 0, sub, normal)
            x = tl.where((bi & 0x7F) == 0x7F, float("nan"), x)
        else:
            x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        eb = tl.load(e_ptr + rows64 * se_t + h * se_h, mask=in_t, other=127).to(tl.int32)
        scale = tl.where(eb == 0, 1 << 22, eb << 23).to(tl.float32, bitcast=True)  # 2^(eb - 127)
        scale = tl.where(eb == 255, float("nan"), scale)
        o = tl.load(o_ptr + rows64[:, None] * so_t + h * so_h + offs_d[None, :], mask=mask, other=0.0)
        acc = tl.reduce((x * scale[:, None]) * o.to(tl.float32), 1, _SUM)
        if HAS_DLSE:
            acc = acc - tl.load(dlse_ptr + h * sl_h + rows64 * sl_t, mask=in_t, other=0.0)
        tl.store(out_ptr + h * T + rows64, acc, mask=in_t)



def _check(do_codes, do_exponents, o, dlse) -> tuple[int, int, int]:
    if not isinstance(do_codes, torch.Tensor) or do_codes.dtype != torch.float8_e4m3fn or do_codes.dim() != 3:
        raise FlamiaError(f"do_codes must be a (T, H, D) float8_e4m3fn tensor, got "
                          f"{getattr(do_codes, 'dtype', type(do_codes).__name__)} {tuple(getattr(do_codes, 'shape', ()))}")
    T, H, D = do_codes.shape
    if D < 1:
        raise FlamiaError("do_codes must have D >= 1")
    if not isinstance(do_exponents, torch.Tensor) or do_exponents.dtype != torch.uint8 or \
            tuple(do_exponents.shape) != (T, H):
        raise FlamiaError(f"do_exponents must be a (T, H) = {(T, H)} uint8 (UE8M0) tensor, got "
                          f"{getattr(do_exponents, 'dtype', None)} {tuple(getattr(do_exponents, 'shape', ()))}")
    if not isinstance(o, torch.Tensor) or o.dtype != torch.bfloat16 or tuple(o.shape) != (T, H, D):
        raise FlamiaError(f"o must be a (T, H, D) = {(T, H, D)} bfloat16 tensor, got "
                          f"{getattr(o, 'dtype', None)} {tuple(getattr(o, 'shape', ()))}")
    if dlse is not None and (not isinstance(dlse, torch.Tensor) or dlse.dtype != torch.float32
                             or tuple(dlse.shape) != (H, T)):
        raise FlamiaError(f"dlse must be None or an (H, T) = {(H, T)} float32 tensor, got "
                          f"{getattr(dlse, 'dtype', None)} {tuple(getattr(dlse, 'shape', ()))}")
    devs = {x.device for x in (do_codes, do_exponents, o, dlse) if x is not None}
    if len(devs) != 1:
        raise FlamiaError(f"do_codes, do_exponents, o and dlse must be on one device, got {sorted(map(str, devs))}")
    return T, H, D


def fp8_bwd_delta_reference(do_codes: torch.Tensor, do_exponents: torch.Tensor, o: torch.Tensor,
                            dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`fp8_bwd_delta`'s formula in torch (same arguments; any device): the same fp32
    products, summed over ``d`` in torch's fp32 order. Returns ``(H, T)`` float32."""
    _check(do_codes, do_exponents, o, dlse)
    eb = do_exponents.to(torch.int32)
    scale = torch.where(eb == 0, torch.full_like(eb, 1 << 22), eb << 23).view(torch.float32)
    scale = torch.where(eb == 255, torch.full_like(scale, float("nan")), scale)
    delta = ((do_codes.float() * scale[..., None]) * o.float()).sum(-1).transpose(0, 1).contiguous()
    return delta if dlse is None else delta - dlse


def fp8_bwd_delta(do_codes: torch.Tensor, do_exponents: torch.Tensor, o: torch.Tensor,
                  dlse: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                  int_decode: Optional[bool] = None) -> torch.Tensor:
    """``Delta = rowsum(dO^ * O) - dLSE`` of the FP8 backward (module docs give the formula).

    Args:
        do_codes: ``(T, H, D)`` ``torch.float8_e4m3fn``, dO's E4M3 codes (feature stride 1).
        do_exponents: ``(T, H)`` uint8 UE8M0 (``e + 127``), dense per token.
        o: ``(T, H, D)`` bfloat16, the forward's output (feature stride 1).
        dlse: optional ``(H, T)`` float32 gradient of the natural-log LSE.
        out: optional ``(H, T)`` float32 contiguous output buffer on the same device (written and
            returned; by default a new one).
        int_decode: decode E4M3 with integer ops (default: on CPU, where the interpreter's cast
            decodes NaN codes as 480) or with the hardware cast (default on CUDA).

    Returns:
        ``(H, T)`` float32 contiguous (``out`` if given), on the inputs' device; every element
        written.

    Raises:
        FlamiaError: wrong dtype / shape / device mix, a bad ``out``; a CUDA tensor without triton.
    """
    T, H, D = _check(do_codes, do_exponents, o, dlse)
    dev = do_codes.device
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or
                            tuple(out.shape) != (H, T) or not out.is_contiguous() or out.device != dev):
        raise FlamiaError(f"out must be a contiguous (H, T) = {(H, T)} float32 tensor on {dev}, got "
                          f"{getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}")
    if not HAS_TRITON:
        if dev.type != "cpu":
            raise FlamiaError("fp8_bwd_delta needs triton for CUDA tensors (pip install triton)")
        ref = fp8_bwd_delta_reference(do_codes, do_exponents, o, dlse)
        return ref if out is None else out.copy_(ref)
    c = do_codes.view(torch.uint8)
    if c.stride(2) != 1:
        c = c.contiguous()
    if o.stride(2) != 1:
        o = o.contiguous()
    if out is None:
        out = torch.empty((H, T), dtype=torch.float32, device=dev)
    if T == 0 or H == 0:
        return out
    dl = dlse if dlse is not None else out
    block_d = triton.next_power_of_2(D)
    int_decode = dev.type != "cuda" if int_decode is None else bool(int_decode)
    kernel_for(_delta_kernel, dev)[(triton.cdiv(T, BLOCK_T), H)](
        c, do_exponents, o, dl, out, T,
        c.stride(0), c.stride(1), do_exponents.stride(0), do_exponents.stride(1), o.stride(0), o.stride(1),
        dl.stride(0), dl.stride(1),
        D=D, BLOCK_D=block_d, BLOCK=BLOCK_T, HAS_DLSE=dlse is not None, INT_DECODE=int_decode,
        num_warps=4,
    )
    return out
