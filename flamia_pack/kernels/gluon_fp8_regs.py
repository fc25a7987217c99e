"""Register-operand helpers of the FP8 Gluon kernels (``gluon_fp8_fwd``, ``gluon_fp8_bwd``), sm_90.

An FP8 wgmma's accumulator is fp32 in :func:`_qgmma_layout`; a product's E4M3 A operand can come straight from
such registers when the B operand's tokens are stored in the wgmma order (``kernels.quantize.to_wgmma_order``):
:func:`_wgmma_cols` renames the columns, :func:`_e4m3_words` / :func:`_e4m3_words2` pack four codes a 32-bit
register (one code, or a code and its residual's code), :func:`_words_operand` hands the words to the product
without moving a byte between threads.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function

__all__: list[str] = []


@constexpr_function
def _qgmma_layout(num_warps, n):
    """Accumulator layout of an FP8 wgmma product with ``n`` columns (k = 32 per instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])


@constexpr_function
def _exp2_const(e):
    """``2.0 ** e`` for an int ``e`` in fp32's normal range (a compile-time float)."""
    return 2.0 ** e


@gluon.jit
def _wgmma_cols(x, op_layout: gl.constexpr):
    """An FP8 wgmma accumulator ``x`` ``(M, N)`` (fp32, :func:`_qgmma_layout`) with its columns in the
    wgmma order (``kernels.quantize.to_wgmma_order``: column ``16 b + 8 h + 2 q + r`` to ``16 b + 4 q +
    2 h + r``) in ``op_layout``, the E4M3 A operand's layout: register renaming only (asserted)."""
    M: gl.constexpr = x.type.shape[0]
    N: gl.constexpr = x.type.shape[1]
    xp = x.reshape([M, N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([M, N])
    return gl.convert_layout(xp, op_layout, assert_trivial=True)


@gluon.jit
def _quads(x):
    """fp32 ``x`` ``(M, N)`` as the four ``(M, N // 4)`` tiles of its columns ``4 g``, ``4 g + 1``, ``4 g + 2``,
    ``4 g + 3`` (a list, the packing asm's arguments: register renaming only)."""
    M: gl.constexpr = x.type.shape[0]
    N: gl.constexpr = x.type.shape[1]
    lo, hi = gl.split(x.reshape([M, N // 4, 2, 2]))
    a, b = gl.split(lo)
    c, d = gl.split(hi)
    return [a, c, b, d]


@gluon.jit
def _e4m3_words(x):
    """fp32 ``x`` ``(M, N)`` as int32 words ``(M, N // 4)``, word ``g`` holding the E4M3 codes of columns
    ``4 g .. 4 g + 3`` (low byte first; ``cvt.rn.satfinite``, as ``.to(float8e4nv)``). Why words: P~ is
    carried across the step loop's back edge, where 64 codes a thread as bytes are unpacked and
    repacked (one phi a byte); 16 words pass as they are."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
        constraints="=r,r,r,r,r", args=_quads(x), dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _e4m3_words2(x):
    """fp32 ``x`` ``(M, N)`` as two :func:`_e4m3_words` tiles ``(hi, lo)``: ``hi`` the E4M3 codes of ``x``, ``lo``
    the E4M3 codes of ``x - hi`` (the residual, exact in fp32; round to nearest even, ``satfinite``), so ``hi + lo``
    holds ~8 significant bits of ``x`` (the emulation's two-term P~, ``pv_terms=2``). ``hi`` is decoded for the
    subtraction through ``cvt.rn.f16x2.e4m3x2`` (exact: every E4M3 value is an f16)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .b16 h01, h23, l01, l23; .reg .b32 f01, f23; .reg .f16 e0, e1, e2, e3; "
            ".reg .f32 g0, g1, g2, g3; "
            "cvt.rn.satfinite.e4m3x2.f32 h01, $3, $2; cvt.rn.satfinite.e4m3x2.f32 h23, $5, $4; "
            "mov.b32 $0, {h01, h23}; "
            "cvt.rn.f16x2.e4m3x2 f01, h01; cvt.rn.f16x2.e4m3x2 f23, h23; "
            "mov.b32 {e0, e1}, f01; mov.b32 {e2, e3}, f23; "
            "cvt.f32.f16 g0, e0; cvt.f32.f16 g1, e1; cvt.f32.f16 g2, e2; cvt.f32.f16 g3, e3; "
            "sub.f32 g0, $2, g0; sub.f32 g1, $3, g1; sub.f32 g2, $4, g2; sub.f32 g3, $5, g3; "
            "cvt.rn.satfinite.e4m3x2.f32 l01, g1, g0; cvt.rn.satfinite.e4m3x2.f32 l23, g3, g2; "
            "mov.b32 $1, {l01, l23}; }",
        constraints="=r,=r,r,r,r,r", args=_quads(x), dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _words_operand(w, op_layout: gl.constexpr):
    """int32 words :func:`_e4m3_words` as the ``(M, 4 N')`` E4M3 A operand in ``op_layout``: each word
    broadcast to its 4 columns and passed through as the thread's operand register (no byte moves)."""
    M: gl.constexpr = w.type.shape[0]
    N4: gl.constexpr = w.type.shape[1]
    w2 = gl.join(w, w)
    x = gl.join(w2, w2).reshape([M, N4 * 4])
    x = gl.convert_layout(x, op_layout, assert_trivial=True)
    return gl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r,r,r,r", args=[x], dtype=gl.int8,
                                     is_pure=True, pack=4).to(gl.float8e4nv, bitcast=True)
