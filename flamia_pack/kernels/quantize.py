"""Fused token-block FP8 quantizer (Triton): one pass over x -> E4M3 codes + UE8M0 exponents.

DESIGN.md §4 (paper §3.1-3.5). Bitwise equal to the torch reference
:func:`flamia_pack.quant.quantize_token_blocks` (same exact exponent rule, same round-to-nearest-even
codes); see that module for the numerics. What this file adds is speed and layout:

* **one launch for Q, K and V** (:func:`quantize_qkv`), GQA head counts allowed;
* **metadata on device, no host sync**: every program finds its tokens' documents by a binary
  search over ``cu_seqlens`` (``ceil(log2(n_docs + 1))`` steps, the array stays in L1/L2), or
  reads a precomputed ``group_start`` (:func:`flamia_pack.quant.scale_groups`);
* optionally the **feature-major copy** of the codes, ``codes_t`` of shape ``(H, D, T)`` (DESIGN.md
  §4 "Hopper operand layouts": FP8 wgmma needs K-major operands, so ``P @ V``, ``dS^T @ Q`` and
  ``dS @ K`` want the transposed payload; because a scale covers whole token rows the transposed
  codes are the same codes), in token order or, per input, in the wgmma order
  (:func:`to_wgmma_order`, ``(H, D, ceil16(T))``: what the FP8 kernels' register A operands
  contract against). The kernel can write it in the same pass, but the toolchain miscompiles that
  variant on sm_90 for some inputs (see ``transposed_store``), so by default it is a torch copy of
  the codes after the kernel; the FP8 path has a second Triton kernel transpose the codes
  (``transposed_store="triton"``), which lets the quantizer keep the hardware convert.

Tiling. A program handles one head of one tensor and ``BLOCK_R`` consecutive rows (tokens) starting
at a multiple of ``BLOCK_R``, so every store (codes, exponents, and the transposed copy) is aligned
and unmasked except at T. Group maxima inside the tile are two segmented max-scans over the
per-row maxima (keys = group start; the combine functions are commutative, so scan-direction
conventions do not matter). A document-local group can straddle the tile edge: the first group
may start up to 31 rows before the tile and the last may end up to 31 rows after it, so the
program also reads those rows of those two groups only (a "halo", reduced to one max each; masked
lanes move no bytes). With documents aligned to the tile the halo is empty; with unaligned ones it
re-reads on average about 32 rows per tile edge, mostly from L2 (neighbouring tiles run at the same
time). ``"token"`` granularity (GROUP = 1) needs neither metadata nor halo.

Addressing: x is read as ``((t * row_stride + h) * D + d)`` with ``D`` a compile-time constant, so
the compiler can prove 16-byte alignment (a runtime head stride selected per tensor defeated the
vectorizer: scalar 2-byte halo loads and 170 registers; see benchmarks/NOTES.md). Inputs need
feature stride 1, head stride D and a row stride that is a multiple of D -- contiguous tensors and
views into a fused ``(T, 3, H, D)`` QKV buffer qualify; anything else is copied first.

Amax is the integer max of the float32 bit patterns with the sign cleared (exact, and NaN/Inf sort
above every finite value); the exponent comes from integer ops on those bits. Codes use the
hardware ``cvt.rn.satfinite.e4m3x2.f32`` on GPU; on CPU the kernel runs in Triton's interpreter,
whose float8 cast does not round to nearest even, so there (and optionally on GPU, ``hw_cvt=False``)
an integer RNE encoder is used (:func:`flamia_pack.quant.e4m3_rne_bits`, same bits).

CPU tensors run through ``triton.runtime.interpreter`` (slow; meant for tests). Without triton
installed, CPU calls fall back to the torch reference (bitwise the same by definition).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels.interpret import kernel_for
from flamia_pack.kernels.qk_rotation import device_matrix, rotate_qk
from flamia_pack.quant import (
    GROUP_SIZE,
    UE8M0_NAN,
    _as_device_cu,
    _check_finite,
    _maybe_validate,
    group_size_of,
    quantize_token_blocks,
    residual_codes,
)

try:  # triton ships with CUDA builds of torch; the CPU build gets it from the dev extra
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False


class QuantizedOperand(NamedTuple):
    """Output of the fused quantizer for one tensor.

    Fields:
        codes: ``(T, H, D)`` ``torch.float8_e4m3fn``.
        exponents: ``(T, H)`` uint8 UE8M0 (``e + 127``), dense per token; 255 = non-finite group.
        codes_t: ``(H, D, T)`` ``torch.float8_e4m3fn`` feature-major copy of ``codes``
            (``codes_t[h, d, t] == codes[t, h, d]``), or, with ``wgmma_order``, ``(H, D, ceil16(T))``
            in the order of :func:`to_wgmma_order`; None unless ``transposed=True``.
        codes_lo: ``(T, H, D)`` ``torch.float8_e4m3fn`` residual codes (``quant.residual_codes``: the second
            term of a two-term operand, ``qk_terms=2``) or None. codes_lo_t: their ``(H, D, T)`` token-order
            copy (the FP8 backward's K_lo^T) or None.
    """

    codes: torch.Tensor
    exponents: torch.Tensor
    codes_t: Optional[torch.Tensor] = None
    codes_lo: Optional[torch.Tensor] = None
    codes_lo_t: Optional[torch.Tensor] = None


def _check_token_axis(name: str, xt) -> None:
    if not isinstance(xt, torch.Tensor) or xt.dim() < 1:
        raise FlamiaError(f"{name}: needs a tensor with a token axis last (..., TP), got "
                          f"{type(xt).__name__}{' of 0 dims' if isinstance(xt, torch.Tensor) else ''}")


def to_wgmma_order(xt: torch.Tensor) -> torch.Tensor:
    """Feature-major codes ``(..., TP)`` in token order (``TP`` a multiple of 16) in the *wgmma order*:
    within every 16-token block, position ``4 q + 2 h + r`` holds token ``8 h + 2 q + r`` (``q < 4``,
    ``h, r < 2``). Why: an FP8 wgmma accumulator gives the thread of quad lane ``q`` the columns
    ``8 h + 2 q + r`` of each 16-column block, and the FP8 A operand wants that thread to hold
    ``k = 4 q .. 4 q + 3``; so ``P`` read straight from the accumulator is the A operand of the
    product with a B operand (V^T, K-major over tokens) stored in this order, with no byte moves
    between the two products (``gluon_fp8_fwd``: the P~ V product). A new tensor; any dtype."""
    _check_token_axis("to_wgmma_order", xt)
    *lead, tp = xt.shape
    if tp % 16:
        raise FlamiaError(f"to_wgmma_order: the token axis must be a multiple of 16, got {tp}")
    return xt.reshape(*lead, tp // 16, 2, 4, 2).transpose(-3, -2).reshape(*lead, tp)


def from_wgmma_order(xt: torch.Tensor, T: int) -> torch.Tensor:
    """The inverse of :func:`to_wgmma_order`, cut to the first ``T`` tokens: ``(..., T)`` in token order."""
    _check_token_axis("from_wgmma_order", xt)
    if not isinstance(T, int) or isinstance(T, bool):
        raise FlamiaError(f"from_wgmma_order: T must be an int, got {T!r}")
    *lead, tp = xt.shape
    if tp % 16 or not 0 <= T <= tp:
        raise FlamiaError(f"from_wgmma_order: need a token axis that is a multiple of 16 and >= T, got {tp} "
                          f"for T={T}")
    return xt.reshape(*lead, tp // 16, 4, 2, 2).transpose(-3, -2).reshape(*lead, tp)[..., :T]


TRANSPOSED_STORES = ("torch", "kernel", "triton")
"""How ``codes_t`` is written (``quantize(transposed_store=)``)."""
TRANSPOSE_BLOCK_T = 128
"""Tokens per program of the ``"triton"`` transposed store (128-byte runs per feature row)."""


class LaunchConfig(NamedTuple):
    """Tile shape of the quantizer: ``block_rows`` rows (power of two) per program, ``num_warps``."""

    block_rows: int
    num_warps: int


def launch_config(group: int, head_dim: int, transposed: bool = False, residual: bool = False,
                  rotate: bool = False) -> LaunchConfig:
    """Default tile for a token-group size, head dim and output layout.

    Args:
        group: tokens per scale group (32 for ``"block"``, 1 for ``"token"``).
        head_dim: D (features per head).
        transposed: whether the kernel also writes the ``(H, D, T)`` copy itself.
        residual: whether it also encodes residual codes (the encoder's second pass keeps the tile's
            scaled values live: 32-token groups at 256 x 8 need 255 registers and spill).
        rotate: whether it rotates the rows first (``rotate_qk``: a ``tl.dot`` with the (D, D) matrix).

    Returns:
        :class:`LaunchConfig` (``block_rows``, ``num_warps``); a pure function, no checks.

    Measured on the H200 (benchmarks/bench_quant.py, RESULTS.md "Quantizer (issue 3)"), QKV at
    T = 65,536, 16 heads, D = 128, time over a same-bytes copy floor: 32-token groups with
    128 rows x 8 warps 1.20 (aligned documents) / 1.36 (unaligned), 256 rows x 8 warps 1.05 / 1.26
    -- the halo of a straddling group is amortised over twice the rows; 128 registers, no spills.
    "token" needs no halo: 128 x 8 (66 registers) is at 1.02. The in-kernel transposed copy holds a
    second layout of the tile in shared memory: with 32-token groups 64 x 4, the fastest tile for
    V^T and for Q^T K^T V^T (three programs an SM instead of one; times: RESULTS.md "Session of
    2026-12-03", run 1, and benchmarks/NOTES.md item 14). The encoder's second pass (residual codes)
    and the rotation's ``tl.dot`` are issue time, not bytes: 64 x 4 (more programs an SM to hide them)
    is the fastest tile for both in "token" and for residual codes in "block", and 256 x 8 for the
    rotation in "block", where the halo's rotated rows cost most at small tiles (RESULTS.md "Session
    of 2026-12-06 (fourth)" and "(fifth)", on an H100, ``benchmarks/probes/quant_tile_probe.py``).
    """
    if head_dim > 128:
        return LaunchConfig(64, 8)
    if group > 1:
        if transposed or (residual and not rotate):
            return LaunchConfig(64, 4)
        return LaunchConfig(256, 8)
    if residual or rotate:
        return LaunchConfig(64, 4)
    return LaunchConfig(128, 8 if head_dim >= 128 else 4)


if HAS_TRITON:

    # Only core builtins and our own combine functions are used in the kernel (no triton.language
    # standard-library @jit helpers such as tl.max / tl.zeros), so the same source also runs in
    # Triton's interpreter without TRITON_INTERPRET being set at import time.
    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    # tl.max's own combine: the interpreter recognises it and reduces with numpy (fast)
    _MAX = getattr(tl.standard, "_elementwise_max", _max_combine)

    @triton.jit
    def _min_combine(a, b):
        return tl.minimum(a, b)

    _MIN = getattr(tl.standard, "_elementwise_min", _min_combine)

    @triton.jit
    def _segmax_fwd(ka, va, kb, vb):
        # result = max of the values carrying the largest key (commutative, associative); with
        # non-decreasing keys a forward scan gives the within-group prefix max.
        k = tl.maximum(ka, kb)
        v = tl.where(ka == kb, tl.maximum(va, vb), tl.where(ka > kb, va, vb))
        return k, v

    @triton.jit
    def _segmax_bwd(ka, va, kb, vb):
        # mirror image: values carrying the smallest key; a reverse scan gives the suffix max.
        k = tl.minimum(ka, kb)
        v = tl.where(ka == kb, tl.maximum(va, vb), tl.where(ka < kb, va, vb))
        return k, v

    @triton.jit
    def _quantize_kernel(
        x0, x1, x2,  # inputs (same dtype), last dim contiguous
        c0, c1, c2,  # codes, uint8 views of (T, H, D) contiguous
        e0, e1, e2,  # exponents, uint8 (T, H) contiguous
        t0, t1, t2,  # transposed codes, uint8 (H, D, TP) contiguous (written where TRANSPOSED has the bit)
        r0, r1, r2,  # residual codes, uint8 (T, H, D) contiguous (written where RESIDUAL has the bit)
        cu_ptr, gs_ptr, rot_ptr,
        T, n_docs, TP,
        H0, H1, H2,
        sx0, sx1, sx2,  # row strides of the inputs in units of D (head stride == D)
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HAS_GS: tl.constexpr,
        TRANSPOSED: tl.constexpr,  # bit i: input i gets its transposed copy (7: all three)
        WGMMA: tl.constexpr,  # bit i: input i's transposed copy in the wgmma order (to_wgmma_order)
        HW_CVT: tl.constexpr,
        N_ITER: tl.constexpr,
        X_BF16: tl.constexpr,
        ROTATE: tl.constexpr,  # bf16 inputs multiplied by rot_ptr's (D, D) bf16 matrix first (qk_rotation)
        RESIDUAL: tl.constexpr,  # bit i: input i also gets its residual codes (quant.residual_codes)
        N_CODES: tl.constexpr,  # 2 where RESIDUAL != 0 (the encoder runs twice), else 1
    ):
        pid = tl.program_id(0)
        NH = H0 + H1 + H2
        tile = pid // NH
        hh = pid % NH
        if hh < H0:
            x_ptr = x0
            c_ptr = c0
            e_ptr = e0
            t_ptr = t0
            r_ptr = r0
            h = hh
            H = H0
            sxt = sx0
            t_want = hh * 0 + (TRANSPOSED & 1)
            w_want = hh * 0 + (WGMMA & 1)
            r_want = hh * 0 + (RESIDUAL & 1)
        elif hh < H0 + H1:
            x_ptr = x1
            c_ptr = c1
            e_ptr = e1
            t_ptr = t1
            r_ptr = r1
            h = hh - H0
            H = H1
            sxt = sx1
            t_want = hh * 0 + (TRANSPOSED & 2)
            w_want = hh * 0 + (WGMMA & 2)
            r_want = hh * 0 + (RESIDUAL & 2)
        else:
            x_ptr = x2
            c_ptr = c2
            e_ptr = e2
            t_ptr = t2
            r_ptr = r2
            h = hh - H0 - H1
            H = H2
            sxt = sx2
            t_want = hh * 0 + (TRANSPOSED & 4)
            w_want = hh * 0 + (WGMMA & 4)
            r_want = hh * 0 + (RESIDUAL & 4)

        start = tile * BLOCK_R
        rows = start + tl.arange(0, BLOCK_R)
        in_t = rows < T
        rows64 = rows.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        if BLOCK_D == D:
            mask = in_t[:, None]
        else:
            mask = in_t[:, None] & (offs_d < D)[None, :]
        x = tl.load(x_ptr + (rows64[:, None] * sxt + h) * D + offs_d[None, :], mask=mask, other=0.0)
        if ROTATE:  # x M in fp32, rounded once to bf16: the rows qk_rotation.rotate_qk gives (BLOCK_D == D)
            rot = tl.load(rot_ptr + offs_d[:, None] * BLOCK_D + offs_d[None, :])
            # rounded to the nearest bf16 (ties to even) by integer ops, kept as float32: Triton's
            # interpreter (whose bf16 cast truncates) and the GPU agree; Inf stays Inf, and a NaN (whose
            # bits the rounding could carry into the sign: the GPU's 0x7FFFFFFF) becomes 0x7FC00000
            rb = tl.dot(x, rot).to(tl.int32, bitcast=True)
            rb = tl.where((rb & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, (rb + 0x7FFF + ((rb >> 16) & 1)) & -65536)
            x = rb.to(tl.float32, bitcast=True)
            bits = rb & 0x7FFFFFFF
        elif X_BF16:
            # |x| as float32 bits straight from the bf16 bits: x stays packed (half the registers)
            bits = (x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
        else:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax = tl.reduce(bits, 1, _MAX)  # (BLOCK_R,) row max of |x| as float32 bits

        if GROUP > 1:
            # group start (and, for the halo below, the end of the tile's last group) per row
            if HAS_GS:
                gs = tl.load(gs_ptr + rows, mask=in_t, other=0)
                gs = tl.where(in_t, gs, rows)
            else:
                # document of each row: largest i with cu[i] <= row (binary search, cu[0] == 0)
                lo = rows * 0
                hi = lo + n_docs
                for _ in tl.static_range(N_ITER):
                    mid = (lo + hi + 1) // 2
                    ok = tl.load(cu_ptr + mid).to(tl.int32) <= rows
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid - 1)
                doc_start = tl.load(cu_ptr + lo).to(tl.int32)
                doc_end = tl.load(cu_ptr + lo + 1, mask=lo < n_docs, other=0).to(tl.int32)
                in_doc = rows < tl.load(cu_ptr + n_docs).to(tl.int32)
                gs = tl.where(in_doc, doc_start + ((rows - doc_start) // GROUP) * GROUP, rows)
                g_end = tl.where(in_doc, tl.minimum(gs + GROUP, doc_end), rows + 1)
            _, fwd = tl.associative_scan((gs, amax), 0, _segmax_fwd)
            _, bwd = tl.associative_scan((gs, amax), 0, _segmax_bwd, reverse=True)
            amax = tl.maximum(fwd, bwd)

            # halo: the tile's first group may start up to GROUP-1 rows before the tile and its
            # last group may end up to GROUP-1 rows after it. Only the rows of those two groups
            # are loaded (masked lanes move no bytes; they are the neighbours' rows, mostly L2
            # hits), reduced to one max each and folded in. Aligned documents load nothing.
            g_first = tl.reduce(gs, 0, _MIN)
            g_last = tl.reduce(gs, 0, _MAX)
            # the halo tiles are addressed as flat (GROUP * BLOCK_D,) vectors so that the compiler
            # sees D-contiguous runs with a row-constant mask and issues 16-byte loads
            offs_f = tl.arange(0, GROUP * BLOCK_D)
            f_row = offs_f // BLOCK_D
            f_d = offs_f % BLOCK_D
            hb = start - GROUP + f_row
            hb_mask = (hb >= g_first) & (hb >= 0)
            if BLOCK_D != D:
                hb_mask = hb_mask & (f_d < D)
            xb = tl.load(x_ptr + (hb.to(tl.int64) * sxt + h) * D + f_d, mask=hb_mask, other=0.0)
            if ROTATE:
                xb = tl.reshape(tl.dot(tl.reshape(xb, (GROUP, BLOCK_D)), rot), (GROUP * BLOCK_D,))
                xb = xb.to(tl.int32, bitcast=True)
                xb = tl.where((xb & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000,
                              (xb + 0x7FFF + ((xb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # as above
            mb = tl.reduce(xb.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0, _MAX)
            ha = start + BLOCK_R + f_row
            if HAS_GS:
                ha_mask = ha < T
                ha_mask = ha_mask & (tl.load(gs_ptr + ha, mask=ha_mask, other=-1) == g_last)
            else:
                ha_mask = (ha < T) & (ha < tl.reduce(g_end, 0, _MAX))
            if BLOCK_D != D:
                ha_mask = ha_mask & (f_d < D)
            xa = tl.load(x_ptr + (ha.to(tl.int64) * sxt + h) * D + f_d, mask=ha_mask, other=0.0)
            if ROTATE:
                xa = tl.reshape(tl.dot(tl.reshape(xa, (GROUP, BLOCK_D)), rot), (GROUP * BLOCK_D,))
                xa = xa.to(tl.int32, bitcast=True)
                xa = tl.where((xa & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000,
                              (xa + 0x7FFF + ((xa >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # as above
            ma = tl.reduce(xa.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0, _MAX)
            amax = tl.where(gs == g_first, tl.maximum(amax, mb), amax)
            amax = tl.where(gs == g_last, tl.maximum(amax, ma), amax)

        # exact e = ceil(log2(amax / 448)) from the bits (see flamia_pack.quant)
        big_e = amax >> 23
        e = big_e - 135 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(big_e == 0, -127, e)
        e = tl.maximum(e, -127)
        nonfinite = amax >= 0x7F800000
        e = tl.where(nonfinite, 0, e)  # all-zero: big_e == 0 above, so -127 (quant.py's rule)
        ebyte = tl.where(nonfinite, 255, e + 127)
        scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, a normal float32
        y = x.to(tl.float32) * scale[:, None]
        val = y
        # pass 0 encodes y (the codes); pass 1 (RESIDUAL) encodes y minus the codes' values on the same
        # exponent: exact in float32 (the code is y rounded, within a factor 2 of it), rounded once, at most
        # half a code ulp (never saturates); the group of a non-finite input gets NaN codes, as residual_codes
        for it in tl.static_range(N_CODES):
            if it == 1:
                # the code's value: its 7 magnitude bits placed at the top of a float32's exponent / mantissa
                # fields read as 2^(ex - 127) (1 + mt / 8), or for ex == 0 the float32 subnormal mt 2^-129,
                # times 2^120 (exact, both cases: E4M3's bias is 7, its subnormals mt 2^-9)
                cb = code.to(tl.int32)
                dec = (((cb & 0x7F) << 20) | ((cb & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36
                val = y - dec
            if HW_CVT and it == 0:
                cd = val.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:  # (the residual pass always: a second hardware convert in the kernel miscompiles on sm_90)
                yb = val.to(tl.int32, bitcast=True)
                sign = (yb >> 24) & 0x80
                a = yb & 0x7FFFFFFF
                r = a + 0x7FFFF + ((a >> 20) & 1)
                normal = (r >> 20) - 960
                sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
                cd = (tl.where(a < 0x3C800000, sub, normal) | sign).to(tl.uint8)
            if it == 0:
                code = cd
                tl.store(c_ptr + rows64[:, None] * (H * D) + h * D + offs_d[None, :], code, mask=mask)
            else:
                cd = tl.where(nonfinite[:, None], 0x7F, cd).to(tl.uint8)
                if RESIDUAL == 7:
                    tl.store(r_ptr + rows64[:, None] * (H * D) + h * D + offs_d[None, :], cd, mask=mask)
                elif r_want != 0:
                    tl.store(r_ptr + rows64[:, None] * (H * D) + h * D + offs_d[None, :], cd, mask=mask)
        tl.store(e_ptr + rows64 * H + h, ebyte.to(tl.uint8), mask=in_t)
        # in-kernel transposed copy (transposed_store="kernel"), row pitch TP bytes. Known
        # miscompile: with the hardware e4m3 cvt plus two stores of the codes, ptxas 12.9
        # (bundled with triton <= 3.8 for Hopper) corrupts the transposed output for some
        # tile layouts (triton-lang/triton#11111; reproduced here on the H200, see
        # benchmarks/NOTES.md). Hence the host default transposed_store="torch".
        if TRANSPOSED != 0:
            if TRANSPOSED == 7:  # every input
                t_go = hh * 0 + 1
            else:  # only the inputs whose bit is set (the FP8 forward: V)
                t_go = t_want
            if WGMMA == 7:
                t_perm = hh * 0 + 1
            else:
                t_perm = w_want
            if t_go != 0:
                col = (h * D + offs_d).to(tl.int64) * TP
                if WGMMA == 0:
                    tl.store(t_ptr + col[None, :] + rows64[:, None], code, mask=mask)
                else:
                    if t_perm != 0:
                        # the wgmma order (to_wgmma_order): the tile permuted in registers, so the store
                        # stays contiguous; the padding tokens up to TP are written as their zero codes
                        # (their positions interleave with real ones)
                        pc = tl.reshape(tl.permute(tl.reshape(code, (BLOCK_R // 16, 2, 4, 2, BLOCK_D)),
                                                   (0, 2, 1, 3, 4)), (BLOCK_R, BLOCK_D))
                        pmask = (rows < TP)[:, None]
                        if BLOCK_D != D:
                            pmask = pmask & (offs_d < D)[None, :]
                        tl.store(t_ptr + col[None, :] + rows64[:, None], pc, mask=pmask)
                    else:
                        tl.store(t_ptr + col[None, :] + rows64[:, None], code, mask=mask)


    @triton.jit
    def _transpose_codes_kernel(c_ptr, t_ptr, T, TP, H, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_T: tl.constexpr, WGMMA: tl.constexpr):
        # codes (T, H, D) uint8 -> (H, D, TP) uint8, token order or the wgmma order (to_wgmma_order);
        # the padding tokens T..TP as zero codes. One program: BLOCK_T tokens of one head, read as D-byte
        # rows, stored as BLOCK_T-byte runs per feature (the layout change goes through shared memory).
        tile = tl.program_id(0)
        h = tl.program_id(1)
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        x = tl.load(c_ptr + (rows.to(tl.int64)[:, None] * H + h) * D + offs_d[None, :],
                    mask=(rows < T)[:, None] & (offs_d < D)[None, :], other=0)
        if WGMMA:
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_T // 16, 2, 4, 2, BLOCK_D)), (0, 2, 1, 3, 4)),
                           (BLOCK_T, BLOCK_D))
        xt = tl.trans(x)
        tl.store(t_ptr + (h * D + offs_d).to(tl.int64)[:, None] * TP + rows[None, :], xt,
                 mask=(offs_d < D)[:, None] & (rows < TP)[None, :])


def _search_steps(n_docs: int) -> int:
    """Binary-search steps over ``n_docs + 1`` boundaries, rounded up to a multiple of 8 so that
    only a handful of kernel variants get compiled (extra steps are no-ops once lo == hi; each is
    one L1-resident load per row)."""
    need = int(n_docs).bit_length()
    return -(-need // 8) * 8


def _check_inputs(xs: list[torch.Tensor]) -> None:
    x0 = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise FlamiaError(f"input {i} must be a bfloat16/float16/float32 torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise FlamiaError(f"input {i} must be a bfloat16/float16/float32 tensor, got {x.dtype}")
        if x.dim() != 3 or x.shape[2] < 1:
            raise FlamiaError(f"input {i} must be (T, H, D) with D >= 1, got shape {tuple(x.shape)}")
        if x.dtype != x0.dtype or x.device != x0.device:
            raise FlamiaError(f"inputs must share dtype and device; input {i} is {x.dtype} on {x.device}, "
                              f"input 0 is {x0.dtype} on {x0.device}")
        if x.shape[0] != x0.shape[0] or x.shape[2] != x0.shape[2]:
            raise FlamiaError(f"inputs must share T and D; input {i} has shape {tuple(x.shape)}, "
                              f"input 0 has {tuple(x0.shape)}")


def _per_tensor_flags(flags, n: int, name: str = "transposed") -> list[bool]:
    """``flags`` as one flag per input: a bool for all, or a sequence of ``n`` bools."""
    if isinstance(flags, (tuple, list)):
        if len(flags) != n or not all(isinstance(t, bool) for t in flags):
            raise FlamiaError(f"{name} must be a bool or {n} bools (one per input), got {flags!r}")
        return list(flags)
    if not isinstance(flags, bool):
        raise FlamiaError(f"{name} must be a bool, got {flags!r}")
    return [flags] * n


def _quantize_many(
    xs: list[torch.Tensor],
    cu_seqlens,
    granularity: str,
    *,
    transposed: bool,
    group_start: torch.Tensor | None,
    check_finite: bool,
    validate: bool | None,
    block_rows: int | None,
    num_warps: int | None,
    hw_cvt: bool | None,
    transposed_store: str = "torch",
    group_size: int = GROUP_SIZE,
    wgmma_order=False,
    rotate: bool = False,
    residual=False,
    residual_transposed=False,
) -> list[QuantizedOperand]:
    _check_inputs(xs)
    if rotate and (xs[0].dtype != torch.bfloat16 or xs[0].shape[2] not in (64, 128)):
        raise FlamiaError(f"the quantizer's fused qk rotation takes bfloat16 inputs of head_dim 64 or 128, got "
                          f"{xs[0].dtype}, head_dim {xs[0].shape[2]}")
    want_t = _per_tensor_flags(transposed, len(xs))
    want_w = _per_tensor_flags(wgmma_order, len(xs), "wgmma_order")
    if any(w and not t for w, t in zip(want_w, want_t)):
        raise FlamiaError(f"wgmma_order orders the transposed copies: it needs transposed for the same inputs, "
                          f"got wgmma_order={wgmma_order!r}, transposed={transposed!r}")
    want_r = _per_tensor_flags(residual, len(xs), "residual")
    want_rt = _per_tensor_flags(residual_transposed, len(xs), "residual_transposed")
    if any(w and not r for w, r in zip(want_rt, want_r)):
        raise FlamiaError(f"residual_transposed transposes the residual codes: it needs residual for the same inputs, "
                          f"got residual_transposed={residual_transposed!r}, residual={residual!r}")
    group = group_size_of(granularity, group_size)
    x0 = xs[0]
    T, _, D = x0.shape
    dev = x0.device
    cu = _as_device_cu(cu_seqlens, dev)
    _maybe_validate(cu, T, validate)
    if group_start is not None:
        group_start = group_start.to(device=dev, dtype=torch.int32).contiguous()
        if group_start.shape != (T,):
            raise MetadataError(f"group_start must have shape (T={T},), got {tuple(group_start.shape)}")

    if not HAS_TRITON:  # CPU build without triton: the reference is the same function
        if dev.type != "cpu":
            raise FlamiaError("the fused quantizer needs triton for CUDA tensors (pip install triton)")
        if rotate:  # (q, k: the only inputs quantize_qkv rotates)
            xs = list(rotate_qk(*xs))
        outs = []
        for x in xs:
            qz = quantize_token_blocks(x, cu, granularity, group_size=group_size, group_start=group_start,
                                       check_finite=check_finite, validate=False)
            i = len(outs)
            ct = qz.codes.permute(1, 2, 0).contiguous() if want_t[i] else None
            if want_w[i]:
                tp = -(-T // 16) * 16
                ct = to_wgmma_order(torch.nn.functional.pad(ct.view(torch.uint8), (0, tp - T))).view(ct.dtype)
            lo = residual_codes(x, qz) if want_r[i] else None
            lot = lo.permute(1, 2, 0).contiguous() if want_rt[i] else None
            if want_rt[i] and want_w[i]:
                lot = to_wgmma_order(torch.nn.functional.pad(lot.view(torch.uint8), (0, tp - T))).view(lot.dtype)
            outs.append(QuantizedOperand(qz.codes, qz.exponents, ct, lo, lot))
        return outs

    # the kernel addresses x as ((t * row_stride + h) * D + d): head stride D, feature stride 1,
    # row stride a multiple of D (true for contiguous tensors and for views into a fused QKV
    # projection); with D a compile-time constant the compiler can prove 16-byte alignment.
    xs = [x if (x.stride(2) == 1 and x.stride(1) == D and x.stride(0) % D == 0) else x.contiguous() for x in xs]
    if transposed_store not in TRANSPOSED_STORES:
        raise FlamiaError(f"transposed_store must be one of {', '.join(map(repr, TRANSPOSED_STORES))}, got "
                          f"{transposed_store!r}")
    transposed = any(want_t)
    in_kernel_t = transposed and transposed_store == "kernel"
    if any(want_rt) and transposed_store == "kernel":
        raise FlamiaError("residual_transposed: the residual codes' copy is written by transposed_store='triton' or "
                          "'torch', not 'kernel'")
    cfg = launch_config(group, D, in_kernel_t, any(want_r), rotate=bool(rotate))
    block_r = int(block_rows or cfg.block_rows)
    if block_r & (block_r - 1) or block_r < 16:
        raise FlamiaError(f"block_rows must be a power of two >= 16, got {block_r}")
    warps = int(num_warps or cfg.num_warps)
    if warps & (warps - 1) or not 1 <= warps <= 32:
        raise FlamiaError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    if hw_cvt is None:
        hw_cvt = dev.type == "cuda"
    elif hw_cvt and dev.type != "cuda":
        raise FlamiaError("hw_cvt=True needs CUDA tensors: Triton's CPU interpreter float8 cast does not "
                          "round to nearest even (use the default, the integer encoder)")
    n_docs = cu.numel() - 1

    codes = [torch.empty(x.shape, dtype=torch.uint8, device=dev) for x in xs]
    exps = [torch.empty(x.shape[:2], dtype=torch.uint8, device=dev) for x in xs]
    # residual codes where asked (the others point at their codes, never written: RESIDUAL has no bit for them)
    lows = [torch.empty(x.shape, dtype=torch.uint8, device=dev) if r else c for x, r, c in zip(xs, want_r, codes)]
    r_bits = sum(1 << i for i, r in enumerate(want_r) if r)
    r_bits = 7 if r_bits == sum(1 << i for i in range(len(xs))) else r_bits  # as t_bits: padding inputs count
    tp = -(-T // 16) * 16  # codes_t row pitch: 16-byte aligned (TMA needs 16-byte strides)
    # a tensor without a transposed copy gets a 16-byte dummy (never written: the kernel writes the
    # copy of the inputs whose bit is set in TRANSPOSED)
    codes_t = ([torch.empty((x.shape[1], D, tp) if w else (16,), dtype=torch.uint8, device=dev)
                for x, w in zip(xs, want_t)] if transposed else codes)
    pad = 3 - len(xs)
    # the padding inputs (no programs: 0 heads) count as transposed when every real one is, so that
    # all-transposed calls compile the kernel without a per-program test
    t_bits = 7 if all(want_t) else sum(1 << i for i, w in enumerate(want_t) if w)
    w_bits = sum(1 << i for i, w in enumerate(want_w) if w)
    w_bits = 7 if w_bits == sum(1 << i for i in range(len(xs))) else w_bits  # as t_bits: padding inputs count
    xa = xs + [xs[0]] * pad
    ca = codes + [codes[0]] * pad
    ea = exps + [exps[0]] * pad
    ta = list(codes_t) + [codes_t[0]] * pad
    ra = lows + [lows[0]] * pad
    hs = [x.shape[1] for x in xs] + [0] * pad
    strides = [x.stride(0) // D for x in xa]
    n_tiles = triton.cdiv(T, block_r) if T else 0
    grid = (n_tiles * sum(hs),)
    if grid[0] > 0:
        kernel_for(_quantize_kernel, dev)[grid](
            *xa, *ca, *ea, *ta, *ra,
            cu, group_start if group_start is not None else cu, device_matrix(D, dev) if rotate else cu,
            T, n_docs, tp,
            *hs, *strides,
            D=D, BLOCK_D=triton.next_power_of_2(D), GROUP=group, BLOCK_R=block_r,
            HAS_GS=group_start is not None, TRANSPOSED=t_bits if in_kernel_t else 0,
            WGMMA=w_bits if in_kernel_t else 0, HW_CVT=bool(hw_cvt),
            N_ITER=_search_steps(n_docs),
            X_BF16=x0.dtype == torch.bfloat16,
            ROTATE=bool(rotate), RESIDUAL=r_bits, N_CODES=2 if r_bits else 1,
            num_warps=warps,
        )
    if transposed and transposed_store == "triton":  # one launch a tensor: 1 B read + 1 B written an element
        for c, ct, w, wo in zip(codes, codes_t, want_t, want_w):
            if w and tp:
                kernel_for(_transpose_codes_kernel, dev)[(triton.cdiv(tp, TRANSPOSE_BLOCK_T), c.shape[1])](
                    c, ct, T, tp, c.shape[1], D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=TRANSPOSE_BLOCK_T,
                    WGMMA=bool(wo), num_warps=4)
    elif transposed and not in_kernel_t:  # one extra pass over the codes (1 B read + 1 B written)
        for c, ct, w, wo in zip(codes, codes_t, want_t, want_w):
            if w:
                ct[:, :, :T].copy_(c.permute(1, 2, 0))
                ct[:, :, T:].zero_()
                if wo:
                    ct.copy_(to_wgmma_order(ct))
    elif in_kernel_t:
        for ct, w, wo in zip(codes_t, want_t, want_w):
            if w and not wo:  # (the wgmma order's kernel store writes the padding's zero codes itself)
                ct[:, :, T:].zero_()
    lows_t = [_transpose_codes(lo, dev, transposed_store, wo) if w else None
              for lo, w, wo in zip(lows, want_rt, want_w)]
    outs = []
    for i in range(len(xs)):
        ct = (codes_t[i] if want_w[i] else codes_t[i][:, :, :T]).view(torch.float8_e4m3fn) if want_t[i] else None
        lo = lows[i].view(torch.float8_e4m3fn) if want_r[i] else None
        lot = (lows_t[i] if want_w[i] else lows_t[i][:, :, :T]).view(torch.float8_e4m3fn) if want_rt[i] else None
        outs.append(QuantizedOperand(codes[i].view(torch.float8_e4m3fn), exps[i], ct, lo, lot))
    if check_finite:
        _check_outputs_finite(outs, xs)
    return outs


def _transpose_codes(c: torch.Tensor, dev, transposed_store: str, wgmma_order: bool = False) -> torch.Tensor:
    """uint8 codes ``(T, H, D)`` -> ``(H, D, ceil16(T))`` in token order (``wgmma_order``: in the wgmma order,
    :func:`to_wgmma_order`), zeros past T (the residual codes' copy)."""
    T, H, D = c.shape
    tp = -(-T // 16) * 16
    ct = torch.empty((H, D, tp), dtype=torch.uint8, device=dev)
    if transposed_store == "triton" and tp:
        kernel_for(_transpose_codes_kernel, dev)[(triton.cdiv(tp, TRANSPOSE_BLOCK_T), H)](
            c, ct, T, tp, H, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=TRANSPOSE_BLOCK_T,
            WGMMA=bool(wgmma_order), num_warps=4)
    else:
        ct[:, :, :T].copy_(c.permute(1, 2, 0))
        ct[:, :, T:].zero_()
        if wgmma_order:
            ct.copy_(to_wgmma_order(ct))
    return ct


def _check_outputs_finite(outs: list, xs: list) -> None:
    """FlamiaError naming the first input (``q``, ``k``, ``v`` for three) whose exponents hold the non-finite
    byte, and where; one device sync."""
    if len(outs) == 1:
        _check_finite(outs[0].exponents, "quantize")
    elif bool((torch.cat([o.exponents.reshape(-1) for o in outs]) == UE8M0_NAN).any()):  # one sync
        names = ("q", "k", "v") if len(outs) == 3 else tuple(f"input {i}" for i in range(len(outs)))
        for name, o, x in zip(names, outs, xs):  # the error path: name the first tensor that holds it
            _check_finite(o.exponents, f"quantize_qkv ({name})", x)


def quantize(
    x: torch.Tensor,
    cu_seqlens,
    granularity: str = "block",
    *,
    transposed: bool = False,
    group_start: torch.Tensor | None = None,
    check_finite: bool = True,
    validate: bool | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    hw_cvt: bool | None = None,
    transposed_store: str = "torch",
    wgmma_order: bool = False,
) -> QuantizedOperand:
    """Fused token-block quantization of one packed tensor (DESIGN.md §4).

    Args:
        x: ``(T, H, D)`` bfloat16/float16/float32, CUDA (compiled) or CPU (Triton interpreter),
            last dim contiguous.
        cu_seqlens: ``(n_docs + 1,)`` int32/int64 on any device (moved to x's device);
            ``cu_seqlens[-1] <= T``, tokens after it are padding (singleton groups).
        granularity: ``"block"`` (32-token groups) or ``"token"`` (strict mode, no metadata read).
        transposed: also write ``codes_t`` ``(H, D, T)`` in the same pass. Its row pitch is padded
            to a multiple of 16 bytes (``codes_t.stride() == (D * TP, TP, 1)``, ``TP = ceil16(T)``;
            TMA descriptors need 16-byte aligned strides); the padding holds zeros.
        group_start: optional precomputed ``(T,)`` int32 group starts (skips the binary search).
        check_finite: raise :class:`FlamiaError` on NaN/Inf (reads back one flag: one sync).
        validate: full ``cu_seqlens`` check; default only for CPU metadata (free). On CUDA the
            default does no host sync, so a malformed ``cu_seqlens`` gives unspecified output.
        block_rows, num_warps: tile override (default :func:`launch_config`).
        hw_cvt: use the hardware float8 cast (default on CUDA) or the integer RNE encoder.
        transposed_store: how ``codes_t`` is written. ``"torch"`` (default): the kernel writes
            the row-major codes and one torch copy transposes them (an extra 1 B/elem read and
            write). ``"kernel"``: written by the quantizer in the same pass (DESIGN.md §4), but
            ptxas 12.9 (bundled with triton <= 3.8) miscompiles that kernel on sm_90 for float32
            inputs and "token" tiles (corrupted codes_t, triton-lang/triton#11111; measured on the
            H200, benchmarks/NOTES.md). With ``hw_cvt=False`` (the integer encoder) and every input
            transposed it is bitwise on the H200 for bf16 inputs, "block" and "token"
            (benchmarks/RESULTS.md). ``quantize_qkv``'s per-input flags compile another variant
            (only the flagged inputs' programs store the copy; the all-transposed variant's SASS is
            unchanged by that): not yet checked on a GPU. Check bitwise on your toolchain before
            other combinations (the GPU tests and ``benchmarks/probes/fp8_fwd_probe.py`` do).
            ``"triton"``: the kernel writes the row-major codes (with the hardware convert on CUDA) and a
            second Triton launch per tensor transposes them (1 B read + 1 B written an element, the
            padding's zero codes included); what the FP8 path uses (no convert in the transposing
            kernel, so no miscompile to avoid).
        wgmma_order: ``codes_t`` as ``(H, D, ceil16(T))`` in the order of :func:`to_wgmma_order` (the
            FP8 forward's V^T), zeros at the padding tokens' positions; needs ``transposed`` (FlamiaError).

    Returns:
        :class:`QuantizedOperand`; bitwise equal to ``quant.quantize_token_blocks`` (the codes of a non-finite
        group excepted: its exponent byte 255 marks it, whatever its codes).

    Raises:
        FlamiaError: bad dtype/shape (``D == 0`` included)/tile (``block_rows`` not a power of two
            >= 16, ``num_warps`` not a power of two <= 32), non-finite input; MetadataError: bad
            ``cu_seqlens``.
    """
    return _quantize_many([x], cu_seqlens, granularity, transposed=transposed, group_start=group_start,
                          check_finite=check_finite, validate=validate, block_rows=block_rows,
                          num_warps=num_warps, hw_cvt=hw_cvt, transposed_store=transposed_store,
                          wgmma_order=wgmma_order)[0]


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    granularity: str = "block",
    *,
    transposed: bool | tuple[bool, bool, bool] = False,
    group_start: torch.Tensor | None = None,
    check_finite: bool = True,
    validate: bool | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    hw_cvt: bool | None = None,
    transposed_store: str = "torch",
    wgmma_order: bool | tuple[bool, bool, bool] = False,
    rotate_qk: bool = False,
    residual: bool | tuple[bool, bool, bool] = False,
    residual_transposed: bool | tuple[bool, bool, bool] = False,
) -> tuple[QuantizedOperand, QuantizedOperand, QuantizedOperand]:
    """Quantize Q, K and V in ONE launch (DESIGN.md §4); arguments as in :func:`quantize`.

    ``q`` is ``(T, H_q, D)``, ``k`` and ``v`` are ``(T, H_kv, D)`` (any head counts, GQA included);
    all three share T, D, dtype and device. ``transposed`` writes the ``(H, D, T)`` copy for all
    three (the FP8 backward needs Q^T and K^T, the forward V^T), or, given as three bools, for the
    inputs that ask for it (the forward: ``(False, False, True)``), with either ``transposed_store``
    (``"kernel"``: only the flagged inputs' programs write their copy). ``wgmma_order``, a bool or
    three: which transposed copies are in the order of :func:`to_wgmma_order` (the forward's V^T).
    ``rotate_qk``: q and k are quantized as ``bf16(q M)``, ``bf16(k M)`` (``qk_rotation.hadamard_matrix``,
    computed in the quantizer: an fp32 ``tl.dot`` a tile, halo rows included, so the rotated tensors
    never reach memory); bfloat16 inputs of head_dim 64 / 128 only. Two launches then (q and k, then v).
    ``residual``, a bool or three: which inputs also get their residual codes (``codes_lo``, bitwise
    ``quant.residual_codes``; two-term Q and K, ``qk_terms=2``), encoded in the same pass (the encoder runs
    twice; two-term V, ``pv_terms=2``, too); ``residual_transposed``: which of those also get the ``(H, D, T)``
    copy ``codes_lo_t``, in the wgmma order where ``wgmma_order`` asks it for that input (one transposing launch
    each, never in the quantizer: ``transposed_store="kernel"`` is an error then).

    Returns:
        ``(q_quant, k_quant, v_quant)`` :class:`QuantizedOperand` each.

    Raises:
        FlamiaError: an input that is not a float16/bfloat16/float32 ``(T, H, D)`` tensor, inputs
            that differ in T, D, dtype or device, a bad tile override, non-finite input (with
            ``check_finite``); MetadataError: bad ``cu_seqlens`` or ``group_start``.
    """
    kw = dict(group_start=group_start, check_finite=check_finite, validate=validate, block_rows=block_rows,
              num_warps=num_warps, hw_cvt=hw_cvt, transposed_store=transposed_store)
    if not rotate_qk:
        qq, kq, vq = _quantize_many([q, k, v], cu_seqlens, granularity, transposed=transposed,
                                    wgmma_order=wgmma_order, residual=residual, residual_transposed=residual_transposed,
                                    **kw)
        return qq, kq, vq
    _check_inputs([q, k, v])
    t, w = _per_tensor_flags(transposed, 3), _per_tensor_flags(wgmma_order, 3, "wgmma_order")
    r, rt = _per_tensor_flags(residual, 3, "residual"), _per_tensor_flags(residual_transposed, 3, "residual_transposed")
    kw["check_finite"] = False  # checked once below, over the three, with their names
    qq, kq = _quantize_many([q, k], cu_seqlens, granularity, transposed=t[:2], wgmma_order=w[:2], rotate=True,
                            residual=r[:2], residual_transposed=rt[:2], **kw)
    (vq,) = _quantize_many([v], cu_seqlens, granularity, transposed=t[2:], wgmma_order=w[2:], residual=r[2:],
                           residual_transposed=rt[2:], **kw)
    if check_finite:
        _check_outputs_finite([qq, kq, vq], [q, k, v])
    return qq, kq, vq
