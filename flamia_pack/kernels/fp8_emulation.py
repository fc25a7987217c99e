"""CPU emulation of the FP8 (token-block scaled, "MXFP8-style") attention forward: the numerics
contract the Gluon FP8 kernels reproduce (DESIGN.md §4-5, issue 27 item 4; paper §3.1-3.5;
seed 001 §3-5). The backward lives in :mod:`flamia_pack.kernels.fp8_emulation_bwd`; the autograd
wrapper :func:`fp8_varlen_attention_emulated` is here. ``docs/fp8.md`` summarises the formulas.

Forward, per document, per key tile ``t`` of ``block_n`` keys on the grid anchored at the
16-token boundary at or before the document's first token (``a = doc_start - doc_start % 16``,
row-local; tile ``t`` is ``[a + t*block_n, a + (t+1)*block_n)`` cut to the document: the kernel's
TMA boxes of V^T must start 16-byte aligned), for every query row ``i`` that sees a key
of the tile (all units base 2, all arithmetic fp32 unless said otherwise)::

    Q, K, V -> E4M3 codes qc, kc, vc with exponents e_q(i), e_k(j), e_v(j)   (quant.py, per head)
    dot_ij  = fp32( sum_d qc_id kc_jd )                  exact in fp64, rounded once (1)
    s_ij    = fp32( dot_ij * 2^(e_q(i)+e_k(j)) * qk )    qk = fp32(softmax_scale * log2 e);  (2)
    masked pairs (other document, key after query): s_ij = -inf
    m_new   = max(m_i, max_j s_ij);  p_ij = exp2(s_ij - m_new);  alpha = exp2(m_i - m_new)
    l_i     = l_i * alpha + fp32( sum_j p_ij )           tile row sum in fp64, rounded once
    r_i     = max( max { e_v(j) : j in the tile, j visible to i },   (reads visible keys only)
                   R_i - REF_FLOOR_LOG2,  boost - FOLD_REF_MIN_OFFSET )  R_i: the row's largest r so far
    P~_ij   = E4M3_RNE( p_ij * 2^(e_v(j) - r_i + boost) )  if visible, else exactly 0   (3)
    pv_i    = fp32( sum_j P~_ij vc_j )                   exact in fp64, rounded once (1)
    acc_i   = fp32( fp32(acc_i * alpha) + pv_i * 2^(r_i - boost) )
    at the end: O_i = bf16( fp32(acc_i / l_i) ),  LSE_i = fp32( (m_i + log2 l_i) * ln 2 )  (natural log)

(1) E4M3 codes have 4 significant bits and magnitudes in [2^-9, 448], so every product of two codes
    has <= 8 significant bits in [2^-18, 2^17.6] and a sum of up to 2^7 of them is an integer
    multiple of 2^-18 below 2^25: exact in fp64 whatever the order. The emulation's MMA output is
    therefore the exact dot product rounded once to fp32 (RNE). Hopper's FP8 wgmma accumulates
    with fewer bits (DeepSeek-V3 §3.3.2: ~14); ``pv_accumulator`` models that for P~V (below).
(2) Power-of-two factors are exact in fp32 (no overflow/underflow for the exponents of real
    activations), so the kernel may apply ``2^e_q``, ``2^e_k`` and ``qk`` in any order, or fold ``qk``
    into the row factor, and get the same bits: only the multiplication by ``qk`` rounds.
(3) **Range budget** (seed 001 §5), next to the code in :func:`_fold_p`: ``m_new`` is the exact
    running max *including this tile*, so ``p_ij <= 1``; ``r_i >= e_v(j)`` for every visible ``j``
    by definition, so ``2^(e_v(j) - r_i) <= 1``; hence ``P~_ij <= 2^boost``, and 2^boost <= 448 (the
    largest finite E4M3) iff ``boost <= 8``. Nothing can saturate; the default ``boost = 8`` is the
    largest legal value and keeps small probabilities above E4M3's subnormal floor longest.
    Masked pairs get an explicit 0 (never ``p * 2^(e_v - r)``: with no visible key ``r_i`` is a
    sentinel and ``2^(e_v - r)`` could be ``inf``, ``0 * inf = NaN``). The floors of ``r_i`` (64
    binades below the row's largest so far, ``constants.REF_FLOOR_LOG2``, and ``boost - 110``,
    ``constants.FOLD_REF_MIN_OFFSET``) only raise it, so the budget holds; they keep the kernel's
    accumulator rescale ``2^(r_old - r_new)`` and its folded row factor ``2^(boost - r_i)`` finite, and
    bind only where a row's visible V groups are 2^-64 of its earlier ones or below ~2^-93 in amax
    (all-zero groups, ``e = -127``): those keys' ``P~`` round to 0 as zero codes contribute 0 anyway.

Causality. ``r_i`` reads only keys visible to row ``i``, and the masked scores are ``-inf`` (they
enter neither ``m``, ``l``, ``r`` nor ``P~``), so row ``i`` reads exactly: the codes and exponents
of q_i and of the visible keys/values. A key tile with no key visible to ``i`` is an exact no-op
for row ``i`` (``alpha = 1``, ``+0``), so the query tile size ``block_m`` does not change the bits
(tested). Under ``scale_granularity="token"`` every exponent is per token, so O_i and LSE_i depend
on tokens ``<= i`` of i's document only (bitwise; tested). Under ``"block"`` the exponents of the
cut's 32-token group see the whole group (the documented within-group dependency).
``leaky_reference=True`` (positive control only) uses the per-tile max of e_v over *all* the
document's keys of the tile, which reads future keys on diagonal tiles and leaks through the E4M3
subnormal boundary (seed 001 §4).

``qk_terms=2`` (``varlen_attention(precision="fp8", qk_terms=2)``; the GPU kernels take the residual codes
from the quantizer): Q and K are each an E4M3 code plus the E4M3 code of its residual on the same exponent,
``x 2^-e ~ qc + qc_lo`` (``quant.residual_codes``: ~8 significant bits instead of 4), and
``dot_ij = fp32( qc_i.kc_j + qc_i.kc_lo_j + qc_lo_i.kc_j )`` (three FP8 products into one accumulator,
exact in fp64 and rounded once; ``lo.lo`` left out; the MMA's truncated accumulation is not modelled, as
for one term). The backward recomputes S the same way and contracts its dQ payload against
``kc + kc_lo``; dK's product reads ``qc`` only (a second register-A product there makes ptxas serialize
the backward's wgmmas; it buys < 4e-4 of cosine). V, P~, dO and the payloads keep one term. It meets
issue 27's O target on every input of its row and issue 28's gradient targets on N(0, 1), where one term
meets none (E4M3's 3-bit mantissa on Q and K; on trained layers the one-term V, P~ and dS roundings still
limit the gradients: benchmarks/RESULTS.md "Session of 2026-12-06 (fourth)"), for 1.5x the forward's and
1.6x the backward's MMA work.

``pv_terms=2`` (``varlen_attention(precision="fp8", pv_terms=2)``): V gets its residual codes as Q and K do, and
the folded P~ is two codes, ``hi = E4M3(y)``, ``lo = E4M3(fp32(y - hi))`` with ``y`` what (3) rounds;
``pv_i = fp32( lo.vc + hi.vc_lo + hi.vc )`` (three FP8 products in this order: the residual products first onto
the running accumulator, then P~V; ``lo.lo`` left out; exact in fp64 and rounded once under ``"fp32"``, each
product's k-steps truncated under ``"promote14"`` / ``"mma14"``); ``ptilde_max`` and ``p_zero_fraction`` read
``hi``. The backward's dP contracts dO against ``vc + vc_lo``; its dV fold P~v keeps one term. With
``qk_terms=2`` the trained-layer gradients are limited by the forward's P~ rounding (through
``Delta = rowsum(dO o O)``) and V's rounding; this removes both (benchmarks/RESULTS.md "two-term operands beyond
Q and K").

``pv_accumulator``: ``"fp32"`` (default) promotes each tile's exact product into the fp32
accumulator as above. ``"promote14"`` forms each tile's P~V in 32-key k-steps whose running sum is
truncated (round toward zero) to ``MMA_ACC_BITS = 14`` significant bits -- a *model* of the FP8
wgmma accumulator -- and then promotes it into fp32. ``"mma14"`` keeps the accumulator in the
MMA across key tiles (in units of ``2^(r_i - boost)``, rescaled by ``alpha * 2^(r_old - r_new)``
before each tile, every k-step truncated to 14 bits). Both are models, not bit-exact hardware.

What cannot be bitwise on a GPU and is not claimed: MUFU ``ex2.approx`` vs ``torch.exp2`` (a few
ulp), the fp32 tree sums of ``l`` and the reduced-precision MMA accumulation; GPU tests compare the
kernel with this emulation within a tolerance and bitwise only through the codes and exponents.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels.constants import FOLD_REF_MIN_OFFSET, REF_FLOOR_LOG2
from flamia_pack.quant import GRANULARITIES, UE8M0_BIAS, UE8M0_NAN, quantize_token_blocks, residual_codes
from flamia_pack.varlen import validate_cu_seqlens

__all__ = [
    "fp8_attention_forward",
    "fp8_attention_backward",
    "fp8_varlen_attention_emulated",
    "DEFAULT_BOOST_LOG2",
    "PV_ACCUMULATORS",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: Largest probability boost with no E4M3 saturation: 2**8 = 256 <= 448 < 2**9 (module docs (3)).
MAX_BOOST_LOG2 = 8
#: Default boost: the largest legal one (small probabilities stay normal E4M3 longest).
DEFAULT_BOOST_LOG2 = 8
#: Head dims of the FP8 kernels (DESIGN.md §7).
HEAD_DIMS = (64, 128)
#: Input dtypes accepted (quantized to E4M3 inside).
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Accumulator models of the P~V product (module docs).
PV_ACCUMULATORS = ("fp32", "promote14", "mma14")
#: Significant bits kept by the modelled FP8 MMA accumulator (DeepSeek-V3 §3.3.2).
MMA_ACC_BITS = 14
#: k-step of one FP8 wgmma instruction (32 bytes of K per step).
MMA_K = 32
#: Token-group block side (DESIGN.md §4); the forward's tile sizes are multiples of it.
BLOCK = 32
#: Key tiles of a document start at the TILE_ALIGN-token boundary at or before its first token
#: (row-local index): the kernel's V^T boxes start on 16-byte boundaries (TMA), E4M3 is 1 byte.
TILE_ALIGN = 16


class OperandCodes(NamedTuple):
    """E4M3 codes ``(T, H, D)`` and UE8M0 exponent bytes ``(T, H)`` (``quant.Quantized`` or
    ``kernels.quantize.QuantizedOperand`` fit: only ``codes`` and ``exponents`` are read), and for a
    two-term operand (Q, K: ``qk_terms=2``; V: ``pv_terms=2``) the residual's codes on the same exponents
    (``quant.residual_codes``)."""

    codes: torch.Tensor
    exponents: torch.Tensor
    codes_lo: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, val, lo: int, hi: int) -> int:
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or not lo <= int(val) <= hi:
        raise FlamiaError(f"{name} must be an int in [{lo}, {hi}], got {val!r}")
    return int(val)


def _check_terms(name: str, value, operands: str) -> int:
    """A term count ``name`` as an int, 1 or 2 (FlamiaError otherwise: bools, floats and strings included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value not in (1, 2):
        raise FlamiaError(f"{name} must be 1 ({operands} as one E4M3 code each) or 2 (code + residual code), got "
                          f"{value!r}")
    return int(value)


def check_qk_terms(qk_terms) -> int:
    """``qk_terms`` as an int, 1 or 2 (:func:`_check_terms`)."""
    return _check_terms("qk_terms", qk_terms, "Q and K")


def check_pv_terms(pv_terms) -> int:
    """``pv_terms`` as an int, 1 or 2 (:func:`_check_terms`)."""
    return _check_terms("pv_terms", pv_terms, "P~ and V")


def _check_options(scale_granularity, block_m, block_n, boost_log2, pv_accumulator="fp32") -> None:
    if scale_granularity not in GRANULARITIES:
        raise FlamiaError(f"scale_granularity must be one of {GRANULARITIES}, got {scale_granularity!r}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        _check_int(name, b, BLOCK, 256)
        if b % BLOCK:
            raise FlamiaError(f"{name} must be a multiple of {BLOCK} (the scale-group block), got {b}")
    if isinstance(boost_log2, bool) or not isinstance(boost_log2, numbers.Integral) or not (
            0 <= int(boost_log2) <= MAX_BOOST_LOG2):
        raise FlamiaError(
            f"boost_log2 must be an int in [0, {MAX_BOOST_LOG2}]: P~ <= 2^boost must fit E4M3's 448 "
            f"(2^9 = 512 would saturate), got {boost_log2!r}")
    if pv_accumulator not in PV_ACCUMULATORS:
        raise FlamiaError(f"pv_accumulator must be one of {PV_ACCUMULATORS}, got {pv_accumulator!r}")


def _check_operand(name: str, op, T: Optional[int], H: Optional[int], D: Optional[int]) -> OperandCodes:
    codes = getattr(op, "codes", None)
    ex = getattr(op, "exponents", None)
    if not isinstance(codes, torch.Tensor) or not isinstance(ex, torch.Tensor):
        raise FlamiaError(f"quantized {name} must have .codes and .exponents tensors, got {type(op).__name__}")
    if codes.dtype != torch.float8_e4m3fn or ex.dtype != torch.uint8:
        raise FlamiaError(f"quantized {name}: codes must be float8_e4m3fn and exponents uint8 (UE8M0), "
                          f"got {codes.dtype}, {ex.dtype}")
    if codes.dim() != 3 or tuple(ex.shape) != tuple(codes.shape[:2]):
        raise FlamiaError(f"quantized {name}: codes (T, H, D) with exponents (T, H), got "
                          f"{tuple(codes.shape)}, {tuple(ex.shape)}")
    for what, want, got in (("T", T, codes.shape[0]), ("H", H, codes.shape[1]), ("D", D, codes.shape[2])):
        if want is not None and want != got:
            raise FlamiaError(f"quantized {name}: {what} = {got}, expected {want}")
    if bool((ex == UE8M0_NAN).any()):
        raise FlamiaError(f"quantized {name} has UE8M0 NaN exponents (255): the input was not finite")
    return OperandCodes(codes, ex)


def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise FlamiaError(f"{name} must be a torch.Tensor (T, H, D), got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise FlamiaError(f"{name} must be bfloat16, float16 or float32 for the FP8 path, got {x.dtype}")
    if x.dim() != 3:
        raise FlamiaError(f"{name} must be (T, H, D), got shape {tuple(x.shape)}")
    return x


def _prepare(q, k, v, cu_seqlens, max_seqlen, scale_granularity, quantized, kernel_head_dims=True, qk_terms=1,
             pv_terms=1):
    """Validate and quantize; returns (cu list, (qo, ko, vo) OperandCodes, T, H, Hkv, D); ``qk_terms=2``:
    q's and k's operands also carry their residual codes, ``pv_terms=2``: v's (from q, k, v; not available
    with ``quantized``)."""
    if check_qk_terms(qk_terms) == 2 and quantized is not None:
        raise FlamiaError("qk_terms=2 quantizes q and k itself (code + residual code): pass q, k, v, not quantized=")
    if check_pv_terms(pv_terms) == 2 and quantized is not None:
        raise FlamiaError("pv_terms=2 quantizes v itself (code + residual code): pass q, k, v, not quantized=")
    if quantized is not None:
        if not isinstance(quantized, (tuple, list)) or len(quantized) != 3:
            raise FlamiaError("quantized must be a (q, k, v) triple of codes + exponents")
        qo = _check_operand("q", quantized[0], None, None, None)
        T, H, D = qo.codes.shape
        ko = _check_operand("k", quantized[1], T, None, D)
        vo = _check_operand("v", quantized[2], T, ko.codes.shape[1], D)
    else:
        q, k, v = (_check_tensor(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
        T, H, D = q.shape
        if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
            raise FlamiaError(f"k and v must be (T={T}, H_kv, D={D}), got {tuple(k.shape)}, {tuple(v.shape)}")
    Hkv = (ko.codes if quantized is not None else k).shape[1]
    if Hkv < 1 or H % Hkv:
        raise FlamiaError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
    if kernel_head_dims and D not in HEAD_DIMS:
        raise FlamiaError(f"FP8 attention supports head_dim in {HEAD_DIMS}, got {D}")
    if D < 1:
        raise FlamiaError(f"head_dim must be >= 1, got {D}")
    cu_arr = validate_cu_seqlens(cu_seqlens, allow_empty_segments=True)
    if int(cu_arr[-1]) > T:
        raise MetadataError(f"cu_seqlens[-1]={int(cu_arr[-1])} exceeds the number of tokens T={T}")
    longest = int(np.diff(cu_arr).max()) if len(cu_arr) > 1 else 0
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < longest:
            raise MetadataError(f"max_seqlen must be an int >= the longest document ({longest}), got {max_seqlen!r}")
    if quantized is None:
        cu_t = torch.as_tensor(cu_arr)
        qo, ko, vo = (OperandCodes(*quantize_token_blocks(x, cu_t, scale_granularity, validate=False))
                      for x in (q, k, v))
        if qk_terms == 2:
            qo, ko = (OperandCodes(op.codes, op.exponents, residual_codes(x, op)) for op, x in ((qo, q), (ko, k)))
        if pv_terms == 2:
            vo = OperandCodes(vo.codes, vo.exponents, residual_codes(v, vo))
    return [int(c) for c in cu_arr], (qo, ko, vo), T, H, Hkv, D


# ---------------------------------------------------------------------------------------------
# segments: one long document, or a chunk of short documents that each fit one tile
# ---------------------------------------------------------------------------------------------


def _segments(cu: Sequence[int], short: int, chunk: int = 512) -> list[tuple[int, int, bool]]:
    """Split the row into ``(lo, hi, single)`` segments: ``single`` = one document whose keys span
    more than one ``short``-key tile of the grid (:func:`_steps`; walked tile by tile); otherwise
    consecutive whole documents that each fit one query tile and one key tile, about ``chunk``
    tokens in all. A chunk computes every document's one tile pair in one masked product; the
    other documents' entries are exact zeros, so the bits equal the per-document computation."""
    out: list[tuple[int, int, bool]] = []
    lo = None
    for a, b in zip(cu[:-1], cu[1:]):
        if b <= a:
            continue
        if b - a > short or a % TILE_ALIGN + (b - a) > short:
            if lo is not None:
                out.append((lo, a, False))
                lo = None
            out.append((a, b, True))
            continue
        if lo is None:
            lo = a
        if b - lo >= chunk:
            out.append((lo, b, False))
            lo = None
    if lo is not None:
        out.append((lo, cu[-1], False))  # the open chunk ends with the row's last document
    return out


def _doc_local(cu: Sequence[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of ``[lo, hi)``: (document index, position inside its document), int64."""
    cu_t = torch.tensor(cu, dtype=torch.long)
    pos = torch.arange(lo, hi, dtype=torch.long)
    doc = torch.searchsorted(cu_t, pos, right=True) - 1
    return doc, pos - cu_t[doc]


def _steps(L: int, single: bool, block_n: int, causal: bool, phase: int = 0):
    """Key-tile steps of a segment of ``L`` tokens: ``(k0, k1, r0)`` = keys ``[k0, k1)`` and the
    first row that can see one of them (segment-relative). A single document's tiles lie on the
    grid of ``block_n`` keys anchored ``phase = doc_start % TILE_ALIGN`` tokens before its first
    token (module docs: the kernel's TMA boxes of V^T start 16-byte aligned), so its first tile
    holds ``block_n - phase`` of its keys."""
    if not single:
        return [(0, L, 0)]
    starts = [0] + list(range(block_n - phase, L, block_n))
    return [(k0, k1, k0 if causal else 0) for k0, k1 in zip(starts, starts[1:] + [L])]


# ---------------------------------------------------------------------------------------------
# arithmetic shared by the forward and the backward (the replication contract)
# ---------------------------------------------------------------------------------------------


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for an integer tensor (exact; 0 below 2**-149, inf above 2**127)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e.to(torch.int32))


def exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``fp32(a @ b)`` for E4M3-valued operands: the fp64 product is exact (module docs (1)),
    rounded once to fp32."""
    return torch.matmul(a.double(), b.double()).float()


def truncate_bits(x: torch.Tensor, bits: int = MMA_ACC_BITS) -> torch.Tensor:
    """Round fp32 ``x`` toward zero to ``bits`` significant bits (model of the FP8 MMA accumulator)."""
    mask = ~((1 << (24 - bits)) - 1)
    return (x.contiguous().view(torch.int32) & mask).view(torch.float32)


def mma_model(a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor], bits: int = MMA_ACC_BITS) -> torch.Tensor:
    """``acc + a @ b`` in k-steps of :data:`MMA_K`: each step's partial product exact, the running
    sum truncated to ``bits`` significant bits after every step (``acc`` None = start from 0)."""
    n = a.shape[-1]
    out = acc
    for k0 in range(0, n, MMA_K):
        part = exact_mm(a[..., k0:k0 + MMA_K], b[..., k0:k0 + MMA_K, :])
        out = truncate_bits(part if out is None else out + part, bits)
    if out is None:
        out = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.float32)
    return out


def qk_scale_f32(softmax_scale: float) -> torch.Tensor:
    """``fp32(softmax_scale * log2 e)``, the kernel's ``qk_scale`` (one rounding)."""
    return torch.tensor(float(softmax_scale) * LOG2E, dtype=torch.float32)


def scores(qc: torch.Tensor, eq: torch.Tensor, kc: torch.Tensor, ek: torch.Tensor,
           qk: torch.Tensor, qc_lo: Optional[torch.Tensor] = None,
           kc_lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Base-2 scaled scores of one tile pair, ``s_ij = fp32(fp32(qc_i . kc_j) * 2^(e_q+e_k) * qk)``.

    Args:
        qc: ``(H, m, D)`` codes as float (E4M3 values). eq: ``(H, m)`` int exponents.
        kc: ``(H, n, D)``. ek: ``(H, n)``. qk: 0-d float32 (:func:`qk_scale_f32`).
        qc_lo, kc_lo: the residual codes of two-term operands (``qk_terms=2``) or None: the dot is
            then ``qc.kc + qc.kc_lo + qc_lo.kc`` (three FP8 products into one accumulator; ``lo.lo``,
            2^-8 of the rest, left out), exact in fp64 (<= 3 x 128 products, module docs (1)), rounded once.

    Returns:
        ``(H, m, n)`` float32. The forward and the backward both call this: S is recomputed
        bitwise (replication, DESIGN.md §4).
    """
    if qc_lo is None and kc_lo is None:
        dot = exact_mm(qc, kc.transpose(-1, -2))
    else:
        d = torch.matmul(qc.double(), kc.double().transpose(-1, -2))
        if kc_lo is not None:
            d = d + torch.matmul(qc.double(), kc_lo.double().transpose(-1, -2))
        if qc_lo is not None:
            d = d + torch.matmul(qc_lo.double(), kc.double().transpose(-1, -2))
        dot = d.float()
    # exact power-of-two factors, then the only rounding: the product with qk (module docs (2))
    f = pow2(eq)[..., :, None] * pow2(ek)[..., None, :]
    return (dot * f) * qk


def visibility(doc: torch.Tensor, dpos: torch.Tensor, rows: slice, keys: slice, causal: bool) -> torch.Tensor:
    """``(m, n)`` bool: row and key in one document and (causal) key position <= row position."""
    vis = doc[rows, None] == doc[None, keys]
    if causal:
        vis &= dpos[None, keys] <= dpos[rows, None]
    return vis


def reference_exponent(e: torch.Tensor, vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row reference ``r_i = max { e(j) : vis[i, j] }`` over one tile.

    Args:
        e: ``(H, n)`` int exponents of the tile's keys. vis: ``(m, n)`` or ``(H, m, n)`` bool.

    Returns:
        ``(r, has)``: ``(H, m)`` int32 (0 where the row sees no key of the tile) and ``(m,)`` /
        ``(H, m)`` bool "row sees a key".
    """
    big = torch.iinfo(torch.int32).min
    ee = e[:, None, :].expand(*e.shape[:1], vis.shape[-2], e.shape[-1])
    r = ee.masked_fill(~vis, big).amax(-1)
    has = vis.any(-1)
    return torch.where(has, r, torch.zeros_like(r)).to(torch.int32), has


def _fold_p(p: torch.Tensor, e: torch.Tensor, r: torch.Tensor, vis: torch.Tensor, boost: int) -> torch.Tensor:
    """``P~ = E4M3_RNE(p * 2^(e_j - r_i + boost))`` on visible pairs, exactly 0 elsewhere.

    Range budget (seed 001 §5; DESIGN.md §4): ``p <= 1`` (exact running max, or the saved LSE:
    ``l >= 1`` so ``s - lse <= s - m <= 0`` up to one rounding of LSE, a factor ``1 + 2^-20`` at
    most) and ``e_j <= r_i`` for every visible ``j`` (``r_i`` is the max over exactly those keys),
    so ``P~ <= 2^boost * (1 + 2^-20) <= 256.001 < 448`` for ``boost <= 8``: no value saturates.
    Masked pairs are set to 0 explicitly: ``2^(e_j - r_i)`` for them is unbounded.

    Args:
        p: ``(H, m, n)`` float32 probabilities in [0, 1]. e: ``(H, n)`` int exponents of the
            contraction side (V's for the forward). r: ``(H, m)`` int32. vis: ``(m, n)`` bool.
        boost: ``boost_log2`` in [0, 8].

    Returns:
        ``(H, m, n)`` ``torch.float8_e4m3fn``.
    """
    return _fold_y(p, e, r, vis, boost).to(torch.float8_e4m3fn)


def _fold_y(p: torch.Tensor, e: torch.Tensor, r: torch.Tensor, vis: torch.Tensor, boost: int) -> torch.Tensor:
    """:func:`_fold_p` before the rounding: ``p * 2^(e_j - r_i + boost)`` (fp32) on visible pairs, 0 elsewhere."""
    d = (e[:, None, :] - r[:, :, None] + boost).clamp(min=-200)  # <= boost on visible pairs
    return torch.where(vis, p * pow2(d), torch.zeros((), dtype=torch.float32))


def split_e4m3(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` (fp32, ``|y| <= 448``) as two E4M3 codes (float32 values): ``hi = E4M3_RNE(y)`` and
    ``lo = E4M3_RNE(y - hi)`` (the fp32 difference is exact) -- ``pv_terms=2``'s P~ (module docs)."""
    hi = y.to(torch.float8_e4m3fn).float()
    return hi, (y - hi).to(torch.float8_e4m3fn).float()


def _heads_lo(op: OperandCodes, lo: int, hi: int, g: int) -> Optional[torch.Tensor]:
    """:func:`_heads`' codes of the operand's residual term (``(H * g, L, D)`` float64), or None."""
    return None if op.codes_lo is None else _heads(op.codes_lo, op.exponents, lo, hi, g)[0]


def _heads(codes: torch.Tensor, ex: torch.Tensor, lo: int, hi: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ``[lo, hi)`` of an operand as ``(H * g, L, D)`` float64 codes and ``(H * g, L)``
    int32 exponents (kv heads repeated for their ``g`` query heads)."""
    c = codes[lo:hi].to(torch.float64).transpose(0, 1)
    e = (ex[lo:hi].to(torch.int32) - UE8M0_BIAS).transpose(0, 1)
    if g > 1:
        c = c.repeat_interleave(g, dim=0)
        e = e.repeat_interleave(g, dim=0)
    return c.contiguous(), e.contiguous()


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


def _forward_impl(cu, ops, T, H, Hkv, D, *, causal, softmax_scale, block_m, block_n, boost,
                  pv_accumulator, leaky_reference, stats, pv_terms=1):
    qo, ko, vo = ops
    if pv_terms == 2 and vo.codes_lo is None:
        raise FlamiaError("pv_terms=2 needs V's residual codes (_prepare(pv_terms=2))")
    g = H // Hkv
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    qk = qk_scale_f32(scale)
    o = torch.zeros((T, H, D), dtype=torch.bfloat16)
    lse = torch.full((H, T), math.inf, dtype=torch.float32)
    pt_max = 0.0
    n_vis = n_zero = 0
    for lo, hi, single in _segments(cu, min(block_m, block_n)):
        L = hi - lo
        doc, dpos = _doc_local(cu, lo, hi)
        qc, eq = _heads(qo.codes, qo.exponents, lo, hi, 1)
        kc, ek = _heads(ko.codes, ko.exponents, lo, hi, g)
        vc, ev = _heads(vo.codes, vo.exponents, lo, hi, g)
        qcl, kcl = _heads_lo(qo, lo, hi, 1), _heads_lo(ko, lo, hi, g)
        vcl = _heads_lo(vo, lo, hi, g) if pv_terms == 2 else None
        m = torch.full((H, L), -math.inf, dtype=torch.float32)
        l = torch.zeros((H, L), dtype=torch.float32)
        acc = torch.zeros((H, L, D), dtype=torch.float32)
        r_run = torch.zeros((H, L), dtype=torch.int32)  # "mma14": the accumulator's unit 2^(r - boost)
        r_hi = torch.full((H, L), -(1 << 30), dtype=torch.int32)  # the row's largest r so far (the floor's)
        for k0, k1, r0 in _steps(L, single, block_n, causal, lo % TILE_ALIGN):
            rows, keys = slice(r0, L), slice(k0, k1)
            vis = visibility(doc, dpos, rows, keys, causal)
            s = scores(qc[:, rows], eq[:, rows], kc[:, keys], ek[:, keys], qk,
                       None if qcl is None else qcl[:, rows], None if kcl is None else kcl[:, keys])
            s = s.masked_fill(~vis, -math.inf)
            m_old = m[:, rows]
            m_new = torch.maximum(m_old, s.amax(-1))
            finite = torch.isfinite(m_new)
            p = torch.where(vis & finite[..., None], torch.exp2(s - m_new[..., None]), 0.0)
            alpha = torch.where(torch.isfinite(m_old), torch.exp2(m_old - m_new), torch.zeros((), dtype=torch.float32))
            alpha = torch.where(finite, alpha, torch.ones((), dtype=torch.float32))
            l[:, rows] = l[:, rows] * alpha + p.double().sum(-1).float()
            if leaky_reference:  # positive control: max over ALL the document's keys of the tile
                r, has = reference_exponent(ev[:, keys], doc[rows, None] == doc[None, keys])
            else:
                r, has = reference_exponent(ev[:, keys], vis)
            r = torch.maximum(r, (r_hi[:, rows] - REF_FLOOR_LOG2).clamp(min=boost - FOLD_REF_MIN_OFFSET))
            r_hi[:, rows] = torch.where(has, torch.maximum(r_hi[:, rows], r), r_hi[:, rows])
            if vcl is None:
                ptf = _fold_p(p, ev[:, keys], r, vis, boost).float()
                terms = ((ptf, vc[:, keys]),)
            else:  # pv_terms=2: P~ = hi + lo, products lo.V, hi.V_lo, hi.V in this order (module docs)
                ptf, ptl = split_e4m3(_fold_y(p, ev[:, keys], r, vis, boost))
                terms = ((ptl, vc[:, keys]), (ptf, vcl[:, keys]), (ptf, vc[:, keys]))
            pt_max = max(pt_max, float(ptf.max()) if ptf.numel() else 0.0)
            if stats is not None:
                n_vis += int((p > 0).sum())
                n_zero += int(((p > 0) & (ptf == 0)).sum())
            if pv_accumulator == "mma14":
                first = (m_old == -math.inf)
                r_keep = torch.where(has, r, r_run[:, rows])
                shift = torch.where(first, torch.zeros_like(r_keep), r_run[:, rows] - r_keep)
                t = truncate_bits((acc[:, rows] * alpha[..., None]) * pow2(shift)[..., None])
                for a, b in terms:
                    t = mma_model(a, b, t)
                acc[:, rows] = t
                r_run[:, rows] = r_keep
            else:
                if pv_accumulator == "fp32":  # the products' fp64 sum is exact (module docs (1)): one rounding
                    pv = functools.reduce(torch.add, (torch.matmul(a.double(), b.double()) for a, b in terms)).float()
                else:
                    pv = None
                    for a, b in terms:
                        pv = mma_model(a, b, pv)
                acc[:, rows] = acc[:, rows] * alpha[..., None] + pv * pow2(r - boost)[..., None]
            m[:, rows] = m_new
        if pv_accumulator == "mma14":
            acc = acc * pow2(r_run - boost)[..., None]
        o[lo:hi] = (acc / l[..., None]).to(torch.bfloat16).transpose(0, 1)
        lse[:, lo:hi] = (m + torch.log2(l)) * torch.tensor(LN2, dtype=torch.float32)
    if stats is not None:
        stats["ptilde_max"] = pt_max
        stats["p_zero_fraction"] = n_zero / max(n_vis, 1)
    return o, lse


def fp8_attention_forward(
    q: Optional[torch.Tensor],
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cu_seqlens,
    max_seqlen: Optional[int] = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    scale_granularity: str = "block",
    block_m: int = 128,
    block_n: int = 128,
    boost_log2: int = DEFAULT_BOOST_LOG2,
    pv_accumulator: str = "fp32",
    quantized=None,
    leaky_reference: bool = False,
    stats: Optional[dict] = None,
    _kernel_head_dims: bool = True,
    qk_terms: int = 1,
    pv_terms: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulated FP8 attention forward on packed rows (module docs give every formula).

    Args:
        q: ``(T, H, D)`` bfloat16 / float16 / float32 (CPU; other devices are copied to the CPU).
        k, v: ``(T, H_kv, D)``, ``H % H_kv == 0`` (GQA: query head h reads kv head ``h // (H / H_kv)``).
            q, k, v may be None when ``quantized`` is given.
        cu_seqlens: ``(n_docs + 1,)`` int32/int64, row-local, ``cu_seqlens[-1] <= T`` (the rest is
            padding); empty documents allowed.
        max_seqlen: optional hint, checked to be >= the longest document.
        causal: causal mask inside each document (else each document attends to all of itself).
        softmax_scale: default ``D ** -0.5``.
        scale_granularity: ``"block"`` (document-local 32-token exponents) or ``"token"`` (strict).
        block_m, block_n: query / key tile sizes, multiples of 32 in [32, 256]. ``block_n`` changes
            the bits (online-softmax grouping, ``r_i``); ``block_m`` provably does not.
        boost_log2: power-of-two probability boost, int in [0, 8] (range budget, module docs (3)).
        pv_accumulator: ``"fp32"`` (default), ``"promote14"`` or ``"mma14"`` (module docs).
        quantized: optional ``(q, k, v)`` of codes ``(T, H, D)`` float8_e4m3fn + exponents ``(T, H)``
            uint8 (``quant.Quantized`` / ``QuantizedOperand``); then q, k, v are ignored and
            ``scale_granularity`` only labels the call.
        leaky_reference: positive control only: ``r_i`` over all the tile's keys of the document.
        stats: optional dict, filled with ``ptilde_max`` (largest P~, <= 2^boost) and
            ``p_zero_fraction`` (share of p > 0 whose P~ rounded to 0).
        qk_terms: 1 (default) or 2: Q and K each as an E4M3 code plus an E4M3 residual code on the
            same exponent (``quant.residual_codes``), S from three FP8 products (:func:`scores`);
            V and P~ unchanged. Not with ``quantized``. ``varlen_attention(qk_terms=2)`` runs it on the CPU
            and the kernels' equivalent on the GPU.
        pv_terms: 1 (default) or 2: V and the folded P~ each as an E4M3 code plus a residual code, P~V from
            three FP8 products (module docs). Not with ``quantized``.

    Returns:
        ``(o, lse)``: ``(T, H, D)`` bfloat16 and ``(H, T)`` float32 natural-log LSE (the BF16
        kernels' layout and convention); padding rows: ``o = 0``, ``lse = +inf``.

    Raises:
        FlamiaError: wrong dtype/rank/shape, head_dim not in (64, 128), H not a multiple of H_kv,
            bad granularity, tile size, boost, accumulator, ``qk_terms`` or ``pv_terms``, non-finite input,
            bad ``quantized``;
        MetadataError: invalid ``cu_seqlens`` or ``max_seqlen``.
    """
    _check_options(scale_granularity, block_m, block_n, boost_log2, pv_accumulator)
    if quantized is None:
        q, k, v = (x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    cu, ops, T, H, Hkv, D = _prepare(q, k, v, cu_seqlens, max_seqlen, scale_granularity, quantized,
                                     _kernel_head_dims, qk_terms, pv_terms)
    ops = tuple(_on_cpu(x) for x in ops)
    return _forward_impl(cu, ops, T, H, Hkv, D, causal=bool(causal), softmax_scale=softmax_scale,
                         block_m=block_m, block_n=block_n, boost=int(boost_log2), pv_accumulator=pv_accumulator,
                         leaky_reference=bool(leaky_reference), stats=stats, pv_terms=int(pv_terms))


def _on_cpu(op) -> OperandCodes:
    """An operand's tensors on the CPU (``codes_lo`` kept where it has one)."""
    lo = getattr(op, "codes_lo", None)
    return OperandCodes(op.codes.cpu(), op.exponents.cpu(), None if lo is None else lo.cpu())


def fp8_attention_backward(*args, **kwargs):
    """See :func:`flamia_pack.kernels.fp8_emulation_bwd.fp8_attention_backward`."""
    from flamia_pack.kernels.fp8_emulation_bwd import fp8_attention_backward as bwd
    return bwd(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------


class _FP8Emulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, opts):
        _check_options(opts["scale_granularity"], opts["block_m"], opts["block_n"], opts["boost_log2"],
                       opts["pv_accumulator"])
        dev = q.device
        qc, kc, vc = (x.detach().cpu() for x in (q, k, v))
        cu, ops, T, H, Hkv, D = _prepare(qc, kc, vc, cu_seqlens, max_seqlen, opts["scale_granularity"], None,
                                         opts["kernel_head_dims"], opts["qk_terms"], opts["pv_terms"])
        o, lse = _forward_impl(cu, ops, T, H, Hkv, D, causal=opts["causal"], softmax_scale=opts["softmax_scale"],
                               block_m=opts["block_m"], block_n=opts["block_n"], boost=opts["boost_log2"],
                               pv_accumulator=opts["pv_accumulator"], leaky_reference=False, stats=None,
                               pv_terms=opts["pv_terms"])
        # the forward's codes are saved for the backward (no re-quantization; same bits either way), with the
        # residual codes of the two-term operands (Q, K: qk_terms=2; V: pv_terms=2)
        ctx.has_lo = tuple(op.codes_lo is not None for op in ops)
        lo = (op.codes_lo for op in ops if op.codes_lo is not None)
        ctx.save_for_backward(*(t for op in ops for t in op[:2]), o, lse, *lo)
        ctx.cu, ctx.opts, ctx.shape = cu, opts, (T, H, Hkv, D)
        ctx.dtypes, ctx.dev = (q.dtype, k.dtype, v.dtype), dev
        return o.to(dev)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        from flamia_pack.kernels.fp8_emulation_bwd import BWD_BLOCK_M, _backward_impl

        qc, qe, kc, ke, vc, ve, o, lse, *saved_lo = ctx.saved_tensors
        it = iter(saved_lo)
        lo = [next(it) if has else None for has in ctx.has_lo]
        T, H, Hkv, D = ctx.shape
        opts = ctx.opts
        ops = (OperandCodes(qc, qe, lo[0]), OperandCodes(kc, ke, lo[1]), OperandCodes(vc, ve, lo[2]))
        if not bool(torch.isfinite(do).all()):
            raise FlamiaError("the gradient reaching varlen_attention(precision='fp8') holds NaN / Inf: the FP8 "
                              "backward quantizes dO to E4M3 and needs it finite (check the loss and the layers "
                              "after attention)")
        dq, dk, dv = _backward_impl(do.detach().cpu(), ops, o, lse, ctx.cu, T, H, Hkv, D,
                                    causal=opts["causal"], softmax_scale=opts["softmax_scale"],
                                    scale_granularity=opts["scale_granularity"], block_m=BWD_BLOCK_M,
                                    block_n=opts["block_n"], boost=opts["boost_log2"], dlse=None, stats=None,
                                    bf16_scores=None, pv_terms=opts["pv_terms"])
        dq, dk, dv = (g.to(device=ctx.dev, dtype=dt) for g, dt in zip((dq, dk, dv), ctx.dtypes))
        return dq, dk, dv, None, None, None


def fp8_varlen_attention_emulated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    max_seqlen: Optional[int] = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    scale_granularity: str = "block",
    block_m: int = 128,
    block_n: int = 128,
    boost_log2: int = DEFAULT_BOOST_LOG2,
    pv_accumulator: str = "fp32",
    _kernel_head_dims: bool = True,
    qk_terms: int = 1,
    pv_terms: int = 1,
) -> torch.Tensor:
    """Differentiable emulated FP8 attention: :func:`fp8_attention_forward` forward and
    :func:`~flamia_pack.kernels.fp8_emulation_bwd.fp8_attention_backward` backward (issue 27/28).

    Same arguments, shapes and errors as :func:`fp8_attention_forward` (no ``quantized``:
    gradients flow to q, k, v). Computes on the CPU; the result and the gradients are moved to
    q's device. Returns ``o`` ``(T, H, D)`` bfloat16; gradients in q, k, v's dtypes (bfloat16
    values: the backward rounds them to bf16 first). The forward's codes, O and LSE are saved.
    The backward walks the kernel's 64-row query steps (``fp8_emulation_bwd.BWD_BLOCK_M``) whatever
    ``block_m`` (the forward's query tile, which does not change the forward's bits)."""
    opts = dict(causal=bool(causal), softmax_scale=softmax_scale, scale_granularity=scale_granularity,
                block_m=block_m, block_n=block_n, boost_log2=boost_log2, pv_accumulator=pv_accumulator,
                kernel_head_dims=bool(_kernel_head_dims), qk_terms=check_qk_terms(qk_terms),
                pv_terms=check_pv_terms(pv_terms))
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    return _FP8Emulated.apply(q, k, v, cu_seqlens, max_seqlen, opts)
