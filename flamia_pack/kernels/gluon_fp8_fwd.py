"""Packed attention forward in FP8 (E4M3 codes, document-local token-block scales), Gluon, sm_90.

The kernel of ``precision="fp8"`` (DESIGN.md §4-5, paper §3.1-3.5, seed 001 §3-5); its numerics are
the contract of :mod:`flamia_pack.kernels.fp8_emulation` (same codes, tiles, folds, boost and
rounding; what cannot be bitwise is listed there). The layout is the BF16 forward's
(``gluon_fwd.py``): one persistent program per SM takes work-list entries from a global counter, a
producer warp loads Q once per entry and K / V^T through a ring, and two 4-warp consumer partitions
of ``BLOCK_M / 2`` query rows each run, per walked key tile ``j`` (software-pipelined: ``S_j`` and
``P~_{j-1} V_{j-1}`` in flight together; with ``PINGPONG`` the two partitions take turns issuing
their products, FlashAttention-3's ping-pong, so one partition's softmax runs under the other's
products)::

    S     = Qc Kc^T                       FP8 wgmma (QGMMA), both operands K-major in shared memory
    x_ij  = S_ij 2^e_k(j);  s_ij = x_ij (qk 2^e_q(i))      qk = softmax_scale log2 e; masked: -inf
    m, l  = base-2 online softmax of s;  p_ij = exp2(s_ij - m_i)
    r_i   = max( max { e_v(j) : j in the tile, visible to i },  R_i - 64,  BOOST - 110 )
            (a tile row that sees no key keeps its r; R_i = max of the row's earlier r: the floors)
    P~_ij = E4M3( exp2(s_ij - m_i + BOOST - r_i) 2^e_v(j) ) = E4M3( p_ij 2^(e_v(j) - r_i + BOOST) )
                                                           exactly 0 on masked pairs
    acc_i = acc_i alpha_i 2^(r_prev,i - r_i) + (P~ Vc)_i   FP8 wgmma, P~ the register A operand,
                                                           V^T's tile the K-major B operand
    O_i   = bf16( acc_i 2^(r_i - BOOST) / l_i ),  LSE_i = (m_i + log2 l_i) ln 2

P~ enters the product as it lies in S's accumulator registers: V^T's tokens are stored in the wgmma
order (``kernels.quantize.to_wgmma_order``), the order of the accumulator's columns in the FP8 A
operand's k slots, so the fold's E4M3 conversion packs each thread's four codes into its operand
register (:func:`_e4m3_words`) and nothing moves between the threads (benchmarks/NOTES.md: what the
layout change cost).

The exponents enter as float32 factors: K's and V's from the key-major tables ``2^e``
(:func:`exponent_table`; a walk's first tile read straight from L2, each later tile's copied into the
partition's shared memory a step ahead by cp.async, :func:`_factors_ready`, so no step waits on an L2
load), ``r_i`` carried as ``2^r_i``, so the fold and the rescale are multiplications
by powers of two (exact, range argument in :func:`_fp8_softmax`). The row factor ``2^(BOOST - r_i)``
enters the exponential's argument (one FFMA per score subtracts ``m_i - BOOST + r_i``), so a per-row
reference costs no multiplication per score. The floors keep every rescale of the accumulator
finite: ``r_i`` never falls more than ``REF_FLOOR_LOG2`` = 64 binades below the row's largest so far
(the backward's rule, ``constants.REF_FLOOR_LOG2``; an all-zero V tile would drop it ~110 binades) and
is at least ``BOOST - FOLD_REF_MIN_OFFSET`` = ``BOOST - 110`` (so ``2^(BOOST - r_i) <= 2^110`` and a tile's
row sum of ``p 2^(BOOST - r_i)`` stays finite). Both read only the row's visible keys (causal), and
both bind only where a row's visible V groups are ``2^-64`` of its earlier ones or below ``~2^-93``
in amax: such keys' ``P~`` round to E4M3 0 (below ``2^-9``), as all-zero groups' do anyway.

Range budget (seed 001 §5), next to the fold in :func:`_fp8_softmax`: ``m`` includes the tile, so
``p <= 1``; ``e_v(j) <= r_i`` for every visible ``j``; so ``P~ <= 2^BOOST <= 448`` for ``BOOST <= 8``
(nothing saturates; the E4M3 conversion is ``satfinite`` anyway). Causality: ``r_i`` reads only the
exponents of keys row ``i`` sees (a per-tile max would read future keys on a diagonal tile and leak
through E4M3's subnormal boundary, seed 001 §4); masked scores are ``-inf`` before the max.

Why ``P~ V`` accumulates across key tiles in the MMA accumulator by default (``acc_i`` in units of
``2^(r_i - BOOST)``, rescaled by ``alpha_i 2^(r_prev,i - r_i)`` after each tile, the emulation's
``pv_accumulator="mma14"`` model): against promoting each tile's product into a separate fp32
register accumulator (``pv_promote=True``, ``acc_i = acc_i alpha_i + (P~ Vc)_i 2^(r_i - BOOST)``,
the emulation's ``"fp32"`` up to the MMA's accumulation inside one tile) it saves the promotion's
two operations per output element and 64 registers a thread, and it is as accurate on every input
measured (issue 27 item 3; numbers: benchmarks/NOTES.md "FP8 forward"). The reference floors keep its
rescale finite (``2^(r_prev - r) <= 2^64``; an all-zero V tile used to overflow it). Each step issues
``P~_{j-1} V_{j-1}`` before ``S_j``, so no non-wgmma instruction defines a product's input inside a
wgmma pipeline stage (ptxas serialized the other order's products, C7513).

Two-term P~ and V (``vt_lo``: ``PV_LO``, the emulation's ``pv_terms=2``): the fold also packs the E4M3 code of
each P~'s residual (``gluon_fp8_regs._e4m3_words2``), and each tile's product is ``P~_lo V + P~ V_lo + P~ V`` onto
the accumulator (the small products first, as S's); V_lo^T's ring sits beside V^T's on the same barriers, and O is
stored from the accumulator's registers (the staging rows' 32 KB do not fit beside the two-term Q, K and V tiles).

Merged items are not supported: ``fp8_attention.py`` builds lists without them (``merge_short``
off), so every item holds one document, 1-token documents included. Inputs: codes and exponents from ``kernels.quantize.quantize_qkv`` (V with
its feature-major copy).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from flamia_pack.kernels.constants import FOLD_REF_MIN_OFFSET, LOG2E, REF_FLOOR_LOG2
from flamia_pack.scheduler.cost import fp8_masked_tile0
from flamia_pack.kernels.gluon_common import (
    _entry_counts, _next_entry, _handoff_load, _rows_producer_loop, _rows_through_smem, _release_after_reads,
    _store_rows, _slot_barriers, check_stages, CONSUMER_WARPS, MAXNREG)
from flamia_pack.kernels.gluon_fp8_regs import (
    _e4m3_words, _e4m3_words2, _exp2_const, _qgmma_layout, _wgmma_cols, _words_operand)
from flamia_pack.kernels.gluon_fwd import _turn_barriers, _turn_pass, _turn_wait

__all__ = ["gluon_fp8_fwd", "BOOST_LOG2", "MASKED_TILE0_MAX_MEAN"]

#: Probability boost of the P~ fold (fp8_emulation.DEFAULT_BOOST_LOG2: the largest with no saturation).
BOOST_LOG2 = 8
#: ``gluon_fp8_fwd(masked_tile0=None)``: rows whose mean document length is at most this many tokens run
#: every entry's first key tile masked (short entries are bound by instruction fetch, long ones pay the masked
#: step; the threshold's measurements: benchmarks/NOTES.md, "FP8 session of 2026-12-03 (second)").
MASKED_TILE0_MAX_MEAN = 1536


_REF_FLOOR = gl.constexpr(2.0 ** -REF_FLOOR_LOG2)
"""``2^-REF_FLOOR_LOG2``: a rescaled accumulator's reference floor relative to the largest one so far (this
kernel's fold reference; ``gluon_fp8_bwd``'s dV / dK references)."""
_REF_MIN_OFFSET = gl.constexpr(FOLD_REF_MIN_OFFSET)
"""``constants.FOLD_REF_MIN_OFFSET``: the fold reference is at least ``2^(BOOST - _REF_MIN_OFFSET)``."""



@constexpr_function
def _key_pair_layout(n):
    """Layout of the ``n // 2`` column pairs of ``SliceLayout(0, _qgmma_layout(4, n))`` (a thread of a
    4-warp product holds columns ``8 i + 2 q + {0, 1}``, ``q`` its lane in the quad): pair ``4 i + q``
    on lane ``q`` of every quad, register ``i``."""
    regs = [[4 << i] for i in range((n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[1], [2], [0], [0], [0]], warp_bases=[[0], [0]],
                                      block_bases=[], shape=[n // 2])


@constexpr_function
def _key_pair_tile_layout(n):
    """:func:`_key_pair_layout` as a ``(n // 8, 4)`` tile: pair ``4 i + q`` at ``(i, q)``, ``i`` in
    registers, ``q`` the lane in the quad."""
    regs = [[1 << i, 0] for i in range((n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[n // 8, 4])



@gluon.jit
def _pow2(ebyte):
    """``2^(ebyte - 127)`` as float32 for UE8M0 bytes (int32) in ``[1, 254]``; byte 0 (``2^-127``, the
    exponent of a group whose largest magnitude is an fp32 subnormal) gives 0."""
    return (ebyte << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _log2_pow2(x):
    """``log2(x)`` for a normal power-of-two float32 ``x``, exact (its exponent field, as float32)."""
    return ((x.to(gl.int32, bitcast=True) >> 23) - 127).to(gl.float32)


@gluon.jit
def _boost_over(r, BOOST: gl.constexpr):
    """``2^BOOST / r`` for powers of two ``r = 2^(R - 127)`` in ``[2^(BOOST - 126), 2^126]``, exact and a
    normal float (``2^(BOOST + 127 - R)``): the reciprocal from the exponent field, ``(254 - R) << 23``,
    times ``2^BOOST``. ``r = 2^127`` (only a non-finite group's clamped byte) gives 0."""
    return ((254 << 23) - r.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True) * _exp2_const(BOOST)


@gluon.jit
def _zero_cols_outside(buf, lo, hi, NW: gl.constexpr, WGMMA_ORDER: gl.constexpr = False,
                       SYNC: gl.constexpr = True):
    """Columns (tokens) outside ``[lo, hi)`` of the consumer's V^T tile ``buf`` (``HEAD_DIM x BLOCK_N``
    E4M3) set to 0: the feature-major twin of ``gluon_common._zero_rows_from``. A document's first
    tile starts at the 16-token boundary before it (TMA) and holds the previous document's codes
    below ``lo``; the tile its end cuts holds the next document's from ``hi``: ``0 x NaN`` in
    ``P~ V`` would carry a NaN across documents. Called only where :func:`_may_be_nonfinite_outside`
    finds a group there whose codes may be NaN: this is a load / store pass over the tile, per item and
    partition, with a fence and a barrier; the check is one load of table entries. ``SYNC=False`` leaves the
    fence and the barrier to the caller (a ``noinline`` caller must: a barrier in a called function is the
    whole CTA's, which a warp-specialized kernel's other partitions never join)."""
    ROWS: gl.constexpr = buf.type.shape[0]
    COLS: gl.constexpr = buf.type.shape[1]
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // COLS, COLS // 16], [NW, 1], [1, 0])
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    if WGMMA_ORDER:  # column 16 b + 4 q + 2 h + r holds token 16 b + 8 h + 2 q + r (to_wgmma_order)
        cols = (cols & ~15) | ((cols & 2) << 2) | ((cols & 12) >> 1) | (cols & 1)
    keep = (cols >= lo) & (cols < hi)
    for i in gl.static_range(ROWS // CHUNK):
        part = buf.slice(i * CHUNK, CHUNK, dim=0)
        x = part.load(layout)
        part.store(gl.where(keep[None, :], x, gl.zeros_like(x)))
    if SYNC:
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _may_be_nonfinite_outside(F, stride_e, hk, o_lo, j, lo, hi, BLOCK_N: gl.constexpr, NW: gl.constexpr):
    """Whether a column (token) of walked tile ``j`` outside ``[lo, hi)`` has V factor ``2^127`` in the
    table ``F`` (:func:`exponent_table`: its group's byte is the non-finite sentinel 255, or 254): only
    such a group's codes can be NaN (every finite group's E4M3 codes are finite), so only then must the
    tile's columns of the neighbouring documents be zeroed (``0 x NaN`` in ``P~ V``). One masked load
    of ``BLOCK_N`` table entries (L2), reduced to a scalar shared by the partition."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // (32 * NW)], [32], [NW], [0])
    cols = gl.arange(0, BLOCK_N, layout=layout)
    out = (cols < lo) | (cols >= hi)
    f = gl.load(F + hk * stride_e + o_lo + j * BLOCK_N + cols, mask=out, other=1.0)
    return gl.max(f, 0) >= _exp2_const(127)


@gluon.jit
def _split_pairs(x2, BLOCK_N: gl.constexpr):
    """int64 column pairs (:func:`_key_pair_layout`) as the ``BLOCK_N`` float32 values they hold (low
    word first): register moves only."""
    lo = (x2 & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)
    hi = (x2 >> 32).to(gl.int32).to(gl.float32, bitcast=True)
    return gl.join(lo, hi).reshape([BLOCK_N])


@gluon.jit
def _tile_factors(F, stride_e, hk, o_lo, j, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The exponent factors ``2^e`` (float32) of walked tile ``j``'s keys from a key-major table ``F``
    (:func:`exponent_table`: ``(H_kv, TPE)`` float32, padded past T), in the columns' layout of the
    scores ``s_layout``: unmasked, so each thread's column pairs load as 8-byte vectors from one base
    address (``o_lo`` is a multiple of 16). Entries of other documents or padding are read but enter
    nothing: those pairs are masked (and every entry is a finite normal float, so a masked factor
    times ``p = 0`` is 0)."""
    # the table is read as int64 pairs (one 8-byte load per column pair of the thread) and split;
    # pair 4 i + q as element (i, q) of a 2-d tile (i in registers, q the lane in the quad), so that
    # each load's address is the thread's base plus a constant (an immediate offset)
    L2: gl.constexpr = _key_pair_tile_layout(BLOCK_N)
    ii = gl.arange(0, BLOCK_N // 8, layout=gl.SliceLayout(1, L2))
    qq = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
    base = hk * (stride_e // 2) + gl.multiple_of(o_lo, 16) // 2 + j * (BLOCK_N // 2)
    pf = F.to(gl.pointer_type(gl.int64), bitcast=True) + base
    f2 = gl.load((pf + qq)[None, :] + (ii * 4)[:, None]).reshape([BLOCK_N // 2])
    f = _split_pairs(gl.convert_layout(f2, _key_pair_layout(BLOCK_N)), BLOCK_N)
    return gl.convert_layout(f, gl.SliceLayout(0, s_layout))


@gluon.jit
def _factors_fetch(f_bufs, v_fbufs, FK, FV, stride_e, hk, o_lo, j, BLOCK_N: gl.constexpr, NW: gl.constexpr):
    """Start copying walked tile ``j``'s K and V factors (``BLOCK_N`` float32 each from the tables
    ``FK`` / ``FV``, :func:`exponent_table`) into row ``j % 2`` of the partition's shared buffers
    ``f_bufs`` (K) and ``v_fbufs`` (V), ``(2, BLOCK_N)`` each (cp.async, one 4-byte copy a thread and
    table, one commit group): issued a step ahead of their use, so their L2 latency runs under the step
    before (benchmarks/NOTES.md: the factor loads' stall). Two allocations, not one: triton's membar
    pass puts a barrier between two copies into one allocation."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // (32 * NW)], [32], [NW], [0])
    off = hk * stride_e + o_lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    async_copy.async_copy_global_to_shared(f_bufs.index(j % 2), FK + off)
    async_copy.async_copy_global_to_shared(v_fbufs.index(j % 2), FV + off)
    async_copy.commit_group()


@gluon.jit
def _factors_ready(f_bufs, v_fbufs, FK, FV, stride_e, hk, o_lo, j, n_steps, BLOCK_N: gl.constexpr,
                   NW: gl.constexpr):
    """Walked tile ``j``'s factors are in row ``j % 2`` of ``f_bufs`` (K) and ``v_fbufs`` (V) once this
    returns (the copies every thread of the partition started a step earlier landed), and tile
    ``j + 1``'s copy is started into the other row, which every thread finished reading in step
    ``j - 1`` (the barrier)."""
    async_copy.wait_group(0)
    gl.thread_barrier()
    if j + 1 < n_steps:
        _factors_fetch(f_bufs, v_fbufs, FK, FV, stride_e, hk, o_lo, j + 1, BLOCK_N, NW)






@gluon.jit
def _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, j, row_f, fk, fv, MASKED: gl.constexpr, BOOST: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr, PV_LO: gl.constexpr = False):
    """Walked tile ``j``: scores from the raw FP8 product ``st``, the base-2 online softmax and the
    P~ fold. Returns ``(P~ as E4M3 words, P~_lo, m, l, alpha, r, r_run)`` (:func:`_e4m3_words` of P~ with its
    columns in the wgmma order, :func:`_wgmma_cols`; ``PV_LO``: P~_lo the residual's words, :func:`_e4m3_words2`,
    else the scalar 0); ``r`` (float32 ``2^r_i`` per row, at least
    ``2^(BOOST - FOLD_REF_MIN_OFFSET)``) is the fold's reference, ``r_run`` the largest ``r`` of the row
    so far (the floor's). ``fk`` / ``fv``: the tile's K / V factors ``2^e`` (:func:`_tile_factors` for
    a walk's first tile, :func:`_factors_ready`'s shared buffers for the later ones). ``lim``: the row's
    last visible key relative to the walk's first key (as ``gluon_fwd._fwd_softmax``); ``ph``: the
    document's first key relative to it (tile 0 of a document that starts off the 16-token grid holds
    ``ph`` keys of the previous one); ``row_f = qk 2^e_q(i)``."""
    x = st * fk[None, :]
    if MASKED:
        k_rel = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = (k_rel[None, :] <= (lim - j * BLOCK_N)[:, None]) & (k_rel >= ph - j * BLOCK_N)[None, :]
        x = gl.where(vis, x, float("-inf"))
    m_ij = gl.maximum(m_i, gl.max(x, 1) * row_f)
    alpha = gl.exp2(m_i - m_ij)
    # The reference r = 2^r_i: the max of f_v = 2^e_v(j) over the row's visible keys (powers of two order
    # as their exponents), floored at 2^-64 x the row's largest so far and at RMIN (module docs). A row
    # that sees no key of the tile keeps its r (its p are 0: the tile is an exact no-op for it). Every
    # table entry is a normal float in [2^-126, 2^127] (exponent_table).
    RMIN: gl.constexpr = _exp2_const(BOOST - _REF_MIN_OFFSET)
    if MASKED:
        r_max = gl.max(gl.where(vis, fv[None, :], 0.0), 1)
        r_new = gl.where(r_max > 0.0, gl.maximum(gl.maximum(r_max, RMIN), r_run * _REF_FLOOR), r_i)
    else:  # every key of the tile is visible to every row
        r_new = gl.maximum(r_run * _REF_FLOOR, gl.maximum(gl.max(fv, 0), RMIN))
    # The fold P~ = E4M3(p 2^(e_v(j) - r_i + BOOST)) as pc f_v with pc = exp2(s - (m - log2 c)), c =
    # 2^BOOST / r (exact, _boost_over; log2 c an integer, so m - log2 c is exact for |m| < 2^23).
    # Range budget (seed 001 §5): p <= 1 (m_ij includes this tile) and f_v <= r on visible pairs, so
    # P~ <= 2^BOOST <= 448 (BOOST <= 8: nothing saturates; the conversion is satfinite anyway).
    # c <= 2^FOLD_REF_MIN_OFFSET = 2^110, so pc <= 2^110 and its tile row sum <= 2^117 (finite); l
    # takes that sum times 1 / c (exact: powers of two). Masked pairs: s = -inf, pc = 0, 0 f_v = 0
    # (f_v finite). Edge: pc below 2^-126 loses bits, which matter (P~ = pc f_v >= 2^-10, f_v <= r) only
    # where r > 2^116 (V groups of amax > 2^124, beyond real activations; a non-finite group's 2^127).
    c = _boost_over(r_new, BOOST)
    p = gl.exp2(x * row_f[:, None] - (m_ij - _log2_pow2(c))[:, None])
    l_i = l_i * alpha + gl.sum(p, 1) * (r_new * _exp2_const(-BOOST))
    pt = _wgmma_cols(p * fv[None, :], op_layout)
    r_run = gl.maximum(r_run, r_new)
    if PV_LO:
        hi, lo = _e4m3_words2(pt)
    else:
        hi = _e4m3_words(pt)
        lo = gl.to_tensor(0)
    return hi, lo, m_ij, l_i, alpha, r_new, r_run


@gluon.jit
def _rescale(acc, alpha, r_old, r_new, acc_layout: gl.constexpr):
    """``acc * alpha * (r_old / r_new)``: the running accumulator (in units of ``r / 2^BOOST``) moved to
    the new tile's softmax max and fold reference. ``r_old / r_new`` is a power of two, formed exactly
    as ``r_old * 2^(127 - R_new)`` (``r_new = 2^(R_new - 127)``) and clamped to fp32's normal range
    ``[2^-126, 2^127]`` (an overflow to inf clamps to 2^127: real activations' V exponents differ by
    far less within a document)."""
    q = r_old * ((254 << 23) - r_new.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True)
    f = alpha * gl.minimum(gl.maximum(q, _exp2_const(-126)), _exp2_const(127))
    return acc * gl.convert_layout(f, gl.SliceLayout(1, acc_layout))[:, None]


@gluon.jit
def _pv_issue(p, v_buf, acc, PV_PROMOTE: gl.constexpr, op_layout: gl.constexpr, p_lo=None, vlo_buf=None,
              PV_LO: gl.constexpr = False):
    """Issue ``P~ V`` (asynchronous FP8 wgmma; ``p``: P~'s :func:`_e4m3_words`, the register A operand; ``v_buf``:
    the ``HEAD_DIM x BLOCK_N`` V^T tile in the wgmma order, K-major): accumulated onto the MMA accumulator
    ``acc``, or, ``PV_PROMOTE``, into a zero-initialized one (the tile's product alone, :func:`_promote`).
    ``PV_LO`` (two-term P~ and V, the emulation's ``pv_terms=2``): ``P~_lo V + P~ V_lo + P~ V`` in that order
    (``p_lo`` the residual's words, ``vlo_buf`` V_lo^T's tile; ``lo.lo`` left out): the small products are summed
    while the accumulator's new terms are small, as :func:`_s_issue`'s."""
    a = _words_operand(p, op_layout)
    if PV_LO:
        a_lo = _words_operand(p_lo, op_layout)
        if PV_PROMOTE:
            out = warpgroup_mma(a_lo, v_buf.permute((1, 0)), gl.zeros_like(acc), use_acc=False, is_async=True)
        else:
            out = warpgroup_mma(a_lo, v_buf.permute((1, 0)), acc, is_async=True)
        out = warpgroup_mma(a, vlo_buf.permute((1, 0)), out, is_async=True)
        out = warpgroup_mma(a, v_buf.permute((1, 0)), out, is_async=True)
    elif PV_PROMOTE:
        out = warpgroup_mma(a, v_buf.permute((1, 0)), gl.zeros_like(acc), use_acc=False, is_async=True)
    else:
        out = warpgroup_mma(a, v_buf.permute((1, 0)), acc, is_async=True)
    return out


@gluon.jit
def _promote(acc, pv, alpha, r, BOOST: gl.constexpr, acc_layout: gl.constexpr):
    """``PV_PROMOTE``: the fp32 register accumulator (absolute units) after tile ``t``:
    ``acc alpha_t + pv_t 2^(r_t - BOOST)`` (``pv_t``: the tile's ``P~ V`` in units of ``r_t / 2^BOOST``,
    ``alpha_t`` the softmax's rescale at that tile): the emulation's per-tile fp32 promotion
    (``fp8_emulation.pv_accumulator="fp32"`` / ``"promote14"``)."""
    a = gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout))
    u = gl.convert_layout(r * _exp2_const(-BOOST), gl.SliceLayout(1, acc_layout))  # exact: r >= 2^(BOOST - 110)
    return acc * a[:, None] + pv * u[:, None]


@gluon.jit
def _s_issue(q_smem, qlo_smem, k_bufs, klo_bufs, s, zero, QK_LO: gl.constexpr):
    """Issue ``S = Q K^T`` for ring slot ``s`` (asynchronous FP8 wgmma into a zero accumulator); ``QK_LO``
    (two-term Q and K, ``fp8_emulation.scores(qc_lo=, kc_lo=)``): ``+ Q K_lo^T + Q_lo K^T`` onto the same
    accumulator, three products in flight (``lo.lo`` left out). The residual products go first: the MMA
    truncates its running sum after every k-step (``fp8_emulation.MMA_ACC_BITS``), so the small terms are summed
    while the sum is small and the sum of all three sees the four k-steps of ``Q K^T`` only, as one term does."""
    if QK_LO:
        st = warpgroup_mma(q_smem, klo_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        st = warpgroup_mma(qlo_smem, k_bufs.index(s).permute((1, 0)), st, is_async=True)
        st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), st, is_async=True)
    else:
        st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    return st


@gluon.jit
def _fp8_step(q_smem, k_bufs, v_bufs, f_bufs, v_fbufs, ready, empty, FK, FV, stride_e, hk, o_lo, ph, o_hi, lim, row_f,
              j, c, n_steps, acc, p_prev, m_i, l_i, r_i, r_run, a_i, turn, k_turn, MASKED: gl.constexpr,
              BOOST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr,
              s_layout: gl.constexpr, op_layout: gl.constexpr, acc_layout: gl.constexpr, WG: gl.constexpr,
              PINGPONG: gl.constexpr, PV_PROMOTE: gl.constexpr, qlo_smem=None, klo_bufs=None,
              QK_LO: gl.constexpr = False, p_lo_prev=None, vlo_bufs=None, PV_LO: gl.constexpr = False):
    """Walked tile ``j >= 1``: ``P~_{j-1} V_{j-1}`` issued first, then ``S_j``, both in flight together;
    tile ``j``'s softmax and fold once both retired (with ``PINGPONG`` under the other partition's
    products). Returns ``(acc, P~_j, P~_lo_j, m, l, r, r_run, alpha)`` (``PV_LO``: :func:`_pv_issue`'s three
    products; else P~_lo is 0). ``PINGPONG``: the two products are issued in
    the partition's turn ``k_turn + j`` (``gluon_fwd._turn_wait``), taken once both tiles landed.
    ``acc``: the MMA accumulator in units of ``r_{j-1} / 2^BOOST`` (rescaled after the softmax to tile
    ``j``'s max and reference), or, ``PV_PROMOTE``, the fp32 register accumulator that ``P~_{j-1} V_{j-1}``
    (a zero-initialized product) is promoted into with ``a_i = alpha_{j-1}`` (:func:`_promote`) while
    ``S_j`` computes. Issuing ``P~_{j-1} V_{j-1}`` first keeps every input of a product defined before its
    pipeline stage (ptxas serializes the products otherwise, C7513: the softmax would write the next
    product's A registers while this one is in flight)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    S_GROUPS: gl.constexpr = 3 if QK_LO else 1  # wgmma groups of S still in flight when P~V retires
    f_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    r = c + j
    s = r % STAGES
    sp = (r - 1) % STAGES
    _factors_ready(f_bufs, v_fbufs, FK, FV, stride_e, hk, o_lo, j, n_steps, BLOCK_N, NW)
    mbarrier.wait(ready.index(s), (r // STAGES) & 1)
    if PINGPONG:  # a turn is held only while issuing
        mbarrier.wait(ready.index(STAGES + sp), ((r - 1) // STAGES) & 1)
        _turn_wait(turn, k_turn + j, WG, PINGPONG)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if PV_PROMOTE:
        # P~_{j-1} V_{j-1} issued first and promoted while S_j computes, so that its product's
        # registers are free again before the softmax
        if not PINGPONG:
            mbarrier.wait(ready.index(STAGES + sp), ((r - 1) // STAGES) & 1)
        pv = _pv_issue(p_prev, v_bufs.index(sp), acc, PV_PROMOTE, op_layout, p_lo_prev, vlo_bufs.index(sp), PV_LO)
        st = _s_issue(q_smem, qlo_smem, k_bufs, klo_bufs, s, zero, QK_LO)
        _turn_pass(turn, WG, PINGPONG)
        pv = warpgroup_mma_wait(S_GROUPS, deps=(pv,))
        mbarrier.arrive(empty.index(STAGES + sp), count=1)
        acc = _promote(acc, pv, a_i, r_i, BOOST, acc_layout)
        st = warpgroup_mma_wait(0, deps=(st,))
        mbarrier.arrive(empty.index(s), count=1)
        fk = f_bufs.index(j % 2).load(f_layout)
        fv = v_fbufs.index(j % 2).load(f_layout)
        p, p_lo, m_ij, l_i, alpha, r_new, r_run = _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, j, row_f, fk, fv,
                                                               MASKED, BOOST, BLOCK_N, s_layout, op_layout, PV_LO)
    else:
        # P~_{j-1} V_{j-1} issued first onto the accumulator (rescaled at the end of step j - 1), then S_j:
        # no non-wgmma instruction defines a product's input inside the pipeline stage (C7513)
        if not PINGPONG:
            mbarrier.wait(ready.index(STAGES + sp), ((r - 1) // STAGES) & 1)
        acc = _pv_issue(p_prev, v_bufs.index(sp), acc, PV_PROMOTE, op_layout, p_lo_prev, vlo_bufs.index(sp), PV_LO)
        st = _s_issue(q_smem, qlo_smem, k_bufs, klo_bufs, s, zero, QK_LO)
        _turn_pass(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(S_GROUPS, deps=(acc,))
        mbarrier.arrive(empty.index(STAGES + sp), count=1)
        st = warpgroup_mma_wait(0, deps=(st,))
        mbarrier.arrive(empty.index(s), count=1)
        fk = f_bufs.index(j % 2).load(f_layout)
        fv = v_fbufs.index(j % 2).load(f_layout)
        p, p_lo, m_ij, l_i, alpha, r_new, r_run = _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, j, row_f, fk, fv,
                                                               MASKED, BOOST, BLOCK_N, s_layout, op_layout, PV_LO)
        acc = _rescale(acc, alpha, r_i, r_new, acc_layout)
    return acc, p, p_lo, m_ij, l_i, r_new, r_run, alpha


@gluon.jit
def _fp8_consume_entry(q_smem, k_bufs, v_bufs, f_bufs, v_fbufs, o_smem, ready, empty, q_bar, q_phase, q_empty, O, LSE,
                       EQ, FK, FV, stride_ot, stride_lh, stride_eq, stride_e, rs, re, o_lo, ph, o_hi, h, hk, n_steps,
                       u1, qk_scale, c, T, turn, k_turn, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WG: gl.constexpr, NW: gl.constexpr,
                       BOOST: gl.constexpr, PINGPONG: gl.constexpr, PV_PROMOTE: gl.constexpr,
                       MASKED_TILE0: gl.constexpr, qlo_smem=None, klo_bufs=None, QK_LO: gl.constexpr = False,
                       vlo_bufs=None, PV_LO: gl.constexpr = False):
    """One entry's FP8 forward from ring position ``c`` (returned advanced) by consumer partition ``WG``
    (rows ``WG * BLOCK_M / 2`` on): ``gluon_fwd._fwd_consume_entry`` with the FP8 softmax / fold, O
    through the partition's own bf16 staging rows ``o_smem``. ``PINGPONG``: the entry's products are
    issued in the partition's turns ``k_turn, ..., k_turn + n_steps`` (``S_0``, the steps, the last
    ``P~ V``), as ``gluon_fwd``'s. ``PV_PROMOTE``: each tile's ``P~ V`` promoted into an fp32 register
    accumulator (:func:`_fp8_step`). ``PV_LO`` (two-term P~ and V): three P~V products a tile, V_lo^T's tiles in
    ``vlo_bufs`` (zeroed with V^T's where a neighbour's codes may be NaN), and O stored straight from the
    accumulator's registers (the staging rows' shared memory does not fit beside the residual tiles)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    PART_M: gl.constexpr = BLOCK_M * NW // 8
    s_layout: gl.constexpr = _qgmma_layout(NW, BLOCK_N)
    acc_layout: gl.constexpr = _qgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    q_part = q_smem.slice(WG * PART_M, PART_M, dim=0)
    if QK_LO:
        qlo_part = qlo_smem.slice(WG * PART_M, PART_M, dim=0)
    else:
        qlo_part = q_part
    r0 = rs + WG * PART_M
    q_pos = r0 + gl.arange(0, PART_M, layout=gl.SliceLayout(1, s_layout))
    if CAUSAL:
        lim = gl.minimum(q_pos, o_hi - 1) - o_lo
    else:
        lim = gl.zeros_like(q_pos) + (o_hi - 1 - o_lo)
    eq = gl.load(EQ + q_pos.to(gl.int64) * stride_eq + h, mask=q_pos < T, other=127).to(gl.int32)
    row_f = _pow2(gl.maximum(eq, 1)) * qk_scale  # byte 0 (2^-127, a subnormal amax) read as 2^-126: never 0
    m_i = gl.full([PART_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([PART_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    r_i = gl.full([PART_M], _exp2_const(BOOST - _REF_MIN_OFFSET), gl.float32, gl.SliceLayout(1, s_layout))
    r_run = r_i
    acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, acc_layout)
    fk = _tile_factors(FK, stride_e, hk, o_lo, 0, BLOCK_N, s_layout)
    fv = _tile_factors(FV, stride_e, hk, o_lo, 0, BLOCK_N, s_layout)
    if n_steps > 1:  # tile 1's factors (the buffers are free: the last entry's epilogue barrier)
        _factors_fetch(f_bufs, v_fbufs, FK, FV, stride_e, hk, o_lo, 1, BLOCK_N, NW)
    mbarrier.wait(q_bar, q_phase)
    s0 = c % STAGES
    mbarrier.wait(ready.index(s0), (c // STAGES) & 1)
    zero = gl.zeros([PART_M, BLOCK_N], gl.float32, s_layout)
    _turn_wait(turn, k_turn, WG, PINGPONG)
    st = _s_issue(q_part, qlo_part, k_bufs, klo_bufs, s0, zero, QK_LO)
    _turn_pass(turn, WG, PINGPONG)
    st = warpgroup_mma_wait(0, deps=(st,))
    mbarrier.arrive(empty.index(s0), count=1)
    if MASKED_TILE0:  # one copy of the softmax in the prologue: what short documents' entries are bound by
        p, p_lo, m_i, l_i, a_i, r_i, r_run = _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, 0, row_f, fk, fv, True,
                                                          BOOST, BLOCK_N, s_layout, op_layout, PV_LO)
    elif (u1 > 0) & (ph == 0):
        p, p_lo, m_i, l_i, a_i, r_i, r_run = _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, 0, row_f, fk, fv, False,
                                                          BOOST, BLOCK_N, s_layout, op_layout, PV_LO)
    else:
        p, p_lo, m_i, l_i, a_i, r_i, r_run = _fp8_softmax(st, m_i, l_i, r_i, r_run, lim, ph, 0, row_f, fk, fv, True,
                                                          BOOST, BLOCK_N, s_layout, op_layout, PV_LO)
    if (ph > 0) & (n_steps > 1):  # tile 0's leading columns hold the previous document (the last tile: below)
        if _may_be_nonfinite_outside(FV, stride_e, hk, o_lo, 0, ph, BLOCK_N, BLOCK_N, NW):
            mbarrier.wait(ready.index(STAGES + s0), (c // STAGES) & 1)
            _zero_cols_outside(v_bufs.index(s0), ph, BLOCK_N, NW, True)
            if PV_LO:
                _zero_cols_outside(vlo_bufs.index(s0), ph, BLOCK_N, NW, True)
    for j in range(1, u1):
        acc, p, p_lo, m_i, l_i, r_i, r_run, a_i = _fp8_step(
            q_part, k_bufs, v_bufs, f_bufs, v_fbufs, ready, empty, FK, FV, stride_e, hk, o_lo, ph, o_hi, lim, row_f, j,
            c, n_steps, acc, p, m_i, l_i, r_i, r_run, a_i, turn, k_turn, False, BOOST, PART_M, BLOCK_N, NW, s_layout,
            op_layout, acc_layout, WG, PINGPONG, PV_PROMOTE, qlo_part, klo_bufs, QK_LO, p_lo, vlo_bufs, PV_LO)
    for j in range(gl.maximum(u1, 1), n_steps):
        acc, p, p_lo, m_i, l_i, r_i, r_run, a_i = _fp8_step(
            q_part, k_bufs, v_bufs, f_bufs, v_fbufs, ready, empty, FK, FV, stride_e, hk, o_lo, ph, o_hi, lim, row_f, j,
            c, n_steps, acc, p, m_i, l_i, r_i, r_run, a_i, turn, k_turn, True, BOOST, PART_M, BLOCK_N, NW, s_layout,
            op_layout, acc_layout, WG, PINGPONG, PV_PROMOTE, qlo_part, klo_bufs, QK_LO, p_lo, vlo_bufs, PV_LO)
    r = c + n_steps - 1
    sl = r % STAGES
    mbarrier.wait(ready.index(STAGES + sl), (r // STAGES) & 1)
    lo_last = gl.where(n_steps == 1, ph, 0)  # a one-tile walk: tile 0 is also the last
    hi_last = o_hi - o_lo - (n_steps - 1) * BLOCK_N
    if (hi_last < BLOCK_N) | (lo_last > 0):  # the tile the document end cuts (and a one-tile walk's start)
        if _may_be_nonfinite_outside(FV, stride_e, hk, o_lo, n_steps - 1, lo_last, hi_last, BLOCK_N, NW):
            _zero_cols_outside(v_bufs.index(sl), lo_last, hi_last, NW, True)
            if PV_LO:
                _zero_cols_outside(vlo_bufs.index(sl), lo_last, hi_last, NW, True)
    _turn_wait(turn, k_turn + n_steps, WG, PINGPONG)
    pv = _pv_issue(p, v_bufs.index(sl), acc, PV_PROMOTE, op_layout, p_lo, vlo_bufs.index(sl), PV_LO)
    _turn_pass(turn, WG, PINGPONG)
    pv = warpgroup_mma_wait(0, deps=(pv,))
    mbarrier.arrive(empty.index(STAGES + sl), count=1)
    _release_after_reads(q_empty)  # every product that read this Q slot retired
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    if PV_PROMOTE:
        acc = _promote(acc, pv, a_i, r_i, BOOST, acc_layout)
        f = 1.0 / l_safe
    else:
        acc = pv
        f = (r_i * _exp2_const(-BOOST)) / l_safe  # r >= 2^(BOOST - 110): a normal float, exact
    out = (acc * gl.convert_layout(f, gl.SliceLayout(1, acc_layout))[:, None]).to(gl.bfloat16)
    if not PV_LO:
        out = _rows_through_smem(o_smem, out, NW)
        gl.thread_barrier()  # every warp read its rows before the partition's next entry writes o_smem
    _store_rows(O, out, r0, re, stride_ot, h * HEAD_DIM)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    gl.store(LSE + h * stride_lh + q_pos, lse, mask=q_pos < re)
    return c + n_steps


@gluon.jit
def _fp8_consumer_loop(q_bufs, k_bufs, v_bufs, f_smem, v_fsmem, o_smem, ready, empty, qo_ready, qo_empty, t_smem, O,
                       LSE, EQ, FK, FV, stride_ot, stride_lh, stride_eq, stride_e, qk_scale, num_items_ptr, max_entries,
                       total, T, turn, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       WL_BM: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr, NW: gl.constexpr,
                       BOOST: gl.constexpr, PINGPONG: gl.constexpr, PV_PROMOTE: gl.constexpr,
                       MASKED_TILE0: gl.constexpr, qlo_bufs, klo_bufs, QK_LO: gl.constexpr, vlo_bufs,
                       PV_LO: gl.constexpr):
    """Consumer partition ``WG`` of the persistent FP8 forward: the entries the producer hands over
    (both partitions run every entry, so with ``PINGPONG`` their turns stay paired: entry ``n`` from
    ring position ``c`` takes turns ``c + n, ..., c + n + n_steps``)."""
    QO_STAGES: gl.constexpr = q_bufs.type.shape[0]
    PART_M: gl.constexpr = BLOCK_M * NW // 8
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [NW], [0])
    _n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, WL_BM // BLOCK_M)
    o_part = o_smem.index(WG)
    c = 0
    n = 0
    t = _next_entry(qo_ready, t_smem, n, idx_layout)
    while t < n_total:
        slot = n % QO_STAGES
        t, h, hk, rs, re, o_lo, o_hi, u1, n_steps, ph = _handoff_load(t_smem.index(slot), idx_layout)
        c = _fp8_consume_entry(q_bufs.index(slot), k_bufs, v_bufs, f_smem, v_fsmem, o_part, ready, empty,
                               qo_ready.index(slot), (n // QO_STAGES) & 1, qo_empty.index(slot), O, LSE, EQ, FK, FV,
                               stride_ot, stride_lh, stride_eq, stride_e, rs, re, o_lo, ph, o_hi, h, hk, n_steps, u1,
                               qk_scale, c, T, turn, c + n, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, WG, NW, BOOST, PINGPONG,
                               PV_PROMOTE, MASKED_TILE0, qlo_bufs.index(slot), klo_bufs, QK_LO, vlo_bufs, PV_LO)
        n += 1
        t = _next_entry(qo_ready, t_smem, n, idx_layout)


@gluon.jit
def _fp8_fwd_kernel(q_desc, k_desc, v_desc, qlo_desc, klo_desc, vlo_desc, O, LSE, EQ, FK, FV, items_ptr, num_items_ptr, cu_ptr,
                    max_entries, skip_len, stride_ot, stride_lh, stride_eq, stride_e, qk_scale, total, T, counter_ptr,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    WL_BM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, BOOST: gl.constexpr,
                    PINGPONG: gl.constexpr, PV_PROMOTE: gl.constexpr, MASKED_TILE0: gl.constexpr,
                    QK_LO: gl.constexpr, PV_LO: gl.constexpr):
    # one program per SM; two Q slots; the K / V^T ring (split barriers, as the BF16 forward); two 4-warp
    # consumer partitions (PINGPONG: taking turns to issue their products) and the producer warp
    # (gluon_common._rows_producer_loop, V^T boxes on the 16-token grid)
    PARTS: gl.constexpr = 2
    PART_M: gl.constexpr = BLOCK_M // PARTS
    q_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    if QK_LO:  # two-term Q and K: the residual codes' tiles beside Q's slots and K's ring
        qlo_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, HEAD_DIM], qlo_desc.layout)
        klo_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], klo_desc.layout)
    else:
        qlo_bufs = q_bufs
        klo_bufs = k_bufs
    if PV_LO:  # two-term P~ and V: V_lo^T's ring beside V^T's; O goes out from registers (no staging rows)
        vlo_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], vlo_desc.layout)
        o_smem = q_bufs  # unread
    else:
        vlo_bufs = v_bufs  # unread
        o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PART_M, HEAD_DIM], gl.bfloat16)
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [PARTS, PART_M, HEAD_DIM], o_layout)
    q_ready, q_empty = _slot_barriers(2, True, PARTS)
    ready, empty = _slot_barriers(2 * STAGES, True, PARTS)
    t_smem = gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # each partition's K / V factors of its current and next key tile (_factors_ready)
    f_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    f_smem0 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], f_layout)
    v_fsmem0 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], f_layout)
    f_smem1 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], f_layout)
    v_fsmem1 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], f_layout)
    turn = _turn_barriers(q_ready, PINGPONG)
    gl.warp_specialize([
        (_fp8_consumer_loop, (q_bufs, k_bufs, v_bufs, f_smem0, v_fsmem0, o_smem, ready, empty, q_ready, q_empty, t_smem,
                              O, LSE, EQ, FK, FV, stride_ot, stride_lh, stride_eq, stride_e, qk_scale, num_items_ptr,
                              max_entries, total, T, turn, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 0, 4, BOOST,
                              PINGPONG, PV_PROMOTE, MASKED_TILE0, qlo_bufs, klo_bufs, QK_LO, vlo_bufs, PV_LO)),
        (_fp8_consumer_loop, (q_bufs, k_bufs, v_bufs, f_smem1, v_fsmem1, o_smem, ready, empty, q_ready, q_empty, t_smem,
                              O, LSE, EQ, FK, FV, stride_ot, stride_lh, stride_eq, stride_e, qk_scale, num_items_ptr,
                              max_entries, total, T, turn, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 1, 4, BOOST,
                              PINGPONG, PV_PROMOTE, MASKED_TILE0, qlo_bufs, klo_bufs, QK_LO, vlo_bufs, PV_LO)),
        (_rows_producer_loop, (q_desc, q_desc, k_desc, v_desc, q_bufs, q_bufs, k_bufs, v_bufs, ready, empty,
                               q_ready, q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                               max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                               True, True, qlo_desc, klo_desc, qlo_bufs, klo_bufs, QK_LO, vlo_desc, vlo_bufs, PV_LO)),
    ], [4, 1], [240, 24])


@functools.cache
def fp8_smem_layout(rows: int, cols: int):
    """NVMMA shared layout of a ``rows x cols`` E4M3 TMA box (128-byte swizzle for 128 columns)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


def fp8_descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over E4M3 codes ``x`` ``(T, H, D)`` viewed as ``(T, H * D)``, boxes of ``block_rows x D``."""
    T, H, D = x.shape
    return TensorDescriptor(x, [T, H * D], [H * D, 1], [block_rows, D], fp8_smem_layout(block_rows, D))


def fp8_descriptor_t(xt: torch.Tensor, block_cols: int) -> TensorDescriptor:
    """TMA descriptor over the feature-major codes ``xt`` ``(H, D, T)`` (token stride 1, feature stride
    ``TP``, a multiple of 16: ``quantize(transposed=True)``; T is ``TP`` for a copy in the wgmma order)
    viewed as ``(H * D, T)``, boxes of ``D x block_cols``."""
    H, D, T = xt.shape
    return TensorDescriptor(xt, [H * D, T], [xt.stride(1), 1], [D, block_cols], fp8_smem_layout(D, block_cols))


#: Columns of an exponent table past ceil16(T): a walk starts up to 15 tokens before its document
#: and reads whole tiles, up to 15 + 127 tokens past the row's last one.
TABLE_PAD = 256


def exponent_table(e: torch.Tensor) -> torch.Tensor:
    """The kernel's key-major factor table of ``e`` (``(T, H)`` uint8 UE8M0 bytes ``b``, dense per token):
    ``(H, ceil16(T) + TABLE_PAD)`` float32, ``table[h, t] = 2^(clamp(b, 1, 254) - 127)`` for ``b = e[t, h]``,
    1.0 past T. Every entry is a normal float in ``[2^-126, 2^127]``: byte 0 (an all-zero group, or
    one whose largest magnitude is an fp32 subnormal) reads as ``2^-126``, and the non-finite group's
    byte 255 as ``2^127``, so a masked key's factor is finite and ``p = 0`` times it is 0."""
    T, H = e.shape
    out = torch.ones((H, -(-T // 16) * 16 + TABLE_PAD), dtype=torch.float32, device=e.device)
    out[:, :T] = (e.t().to(torch.int32).clamp(1, 254) << 23).view(torch.float32)
    return out


def _check_fp8_inputs(qc, kc, vt, eq, ek, ev) -> None:
    for name, x in (("q codes", qc), ("k codes", kc), ("v^T codes", vt)):
        if x.dtype != torch.float8_e4m3fn or x.dim() != 3 or not x.is_cuda:
            raise ValueError(f"gluon_fp8_fwd: {name} must be a 3-d float8_e4m3fn CUDA tensor, got {x.dtype} "
                             f"shape {tuple(x.shape)} on {x.device}")
    T, H, D = qc.shape
    Hkv = kc.shape[1]
    if not (qc.is_contiguous() and kc.is_contiguous()):
        raise ValueError("gluon_fp8_fwd: q / k codes must be contiguous (T, H, D)")
    tp = -(-T // 16) * 16
    if kc.shape != (T, Hkv, D) or vt.shape != (Hkv, D, tp) or vt.stride(2) != 1 or vt.stride(1) % 16:
        raise ValueError(f"gluon_fp8_fwd: shapes disagree: q {tuple(qc.shape)}, k {tuple(kc.shape)}, v^T "
                         f"{tuple(vt.shape)} strides {vt.stride()} (need k (T, H_kv, D), v^T (H_kv, D, ceil16(T)) "
                         "in the wgmma order with token stride 1 and a 16-byte feature stride)")
    if H % Hkv or D not in (64, 128):
        raise ValueError(f"gluon_fp8_fwd: need H_q % H_kv == 0 and head_dim 64 or 128, got H_q={H}, H_kv={Hkv}, D={D}")
    if eq.dtype != torch.uint8 or eq.shape != (T, H) or not eq.is_contiguous():
        raise ValueError(f"gluon_fp8_fwd: q exponents must be contiguous uint8 (T, {H}), got {eq.dtype} {tuple(eq.shape)}")
    width = -(-T // 16) * 16 + TABLE_PAD
    for name, e in (("k", ek), ("v", ev)):
        if e.dtype != torch.float32 or e.shape != (Hkv, width) or not e.is_contiguous():
            raise ValueError(f"gluon_fp8_fwd: {name} exponents must be the float32 table (H_kv, ceil16(T) + {TABLE_PAD}) "
                             f"= ({Hkv}, {width}) of exponent_table, got {e.dtype} {tuple(e.shape)}")


def gluon_fp8_fwd(qc: torch.Tensor, kc: torch.Tensor, vt: torch.Tensor, eq: torch.Tensor, ek: torch.Tensor,
                  ev: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
                  softmax_scale: float, *, causal: bool = True, block_m: int = 128, block_n: int = 128,
                  wl_block_m: int = 128, stages: int = 2, skip_len: int = 1, o: torch.Tensor | None = None,
                  lse: torch.Tensor | None = None, pingpong: bool = True, pv_promote: bool = False,
                  masked_tile0: bool | None = None, qc_lo: torch.Tensor | None = None,
                  kc_lo: torch.Tensor | None = None, vt_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP8 attention forward, warp-specialized Gluon, sm_90 (module docs: the numerics).

    Args:
        qc: ``(T, H_q, 128)`` float8_e4m3fn codes; kc: ``(T, H_kv, 128)``; vt: V's feature-major codes
            ``(H_kv, 128, ceil16(T))`` in the wgmma order (``quantize(transposed=True, wgmma_order=True)``;
            token stride 1, feature stride a multiple of 16).
        eq: Q's UE8M0 exponent bytes ``(T, H_q)`` uint8, dense per token; ek, ev: K's and V's as
            :func:`exponent_table` factor tables ``(H_kv, ceil16(T) + TABLE_PAD)`` float32 (``2^e``).
        cu_seqlens, items, num_items: as ``gluon_fwd`` (list built with ``block_m=wl_block_m``; merged
            items are skipped: build the list without them).
        softmax_scale: scale of ``q . k``; causal: causal mask inside each document.
        block_m, stages, o, lse: as ``gluon_fwd``; block_n: 128 (the only key tile).
        skip_len: items of documents of at most this many tokens are skipped (0: none; the list must
            hold no merged items either way).
        pingpong: the two consumer partitions take turns issuing their wgmma products
            (FlashAttention-3 §3.1, ``gluon_fwd(pingpong=True)``): one partition's softmax and fold run
            while the other's products compute. Default on (bitwise the same results as off; its
            speed: benchmarks/NOTES.md "FP8 forward").
        pv_promote: each key tile's ``P~ V`` goes into a zero-initialized MMA accumulator and is
            promoted into a separate fp32 register accumulator. Default False: ``P~ V`` accumulates
            across tiles in the MMA accumulator (module docs: why).
        masked_tile0: every entry's first key tile takes the masked softmax (one copy of the softmax in
            the entry's prologue instead of two; bitwise the same output). Short documents' entries walk
            2-3 tiles and are bound by instruction fetch, long ones pay a masked step an entry. Default:
            on where the mean document length ``T / n_docs`` is at most :data:`MASKED_TILE0_MAX_MEAN`
            tokens (known on the host: no sync; ``scheduler.cost.fp8_masked_tile0``, the rule the cost model
            applies too).
        qc_lo, kc_lo: two-term Q and K (``fp8_emulation`` ``qk_terms=2``): the residual codes of ``qc`` and
            ``kc`` (``quant.residual_codes``), same shapes and layout; S is then three FP8 products.
            Both or neither.
        vt_lo: two-term P~ and V (``fp8_emulation`` ``pv_terms=2``): the residual codes of V^T, ``vt``'s shape,
            layout and wgmma order; each tile's ``P~ V`` is then three FP8 products (``P~_lo V + P~ V_lo + P~ V``).

    Returns:
        ``(o, lse)``: ``(T, H_q, 128)`` bf16 and ``(H_q, T)`` float32 natural-log LSE; rows of skipped
        items and padding rows untouched.

    Raises:
        ValueError: inputs of the wrong dtype / shape / layout, head_dim other than 64 / 128, tiles that do
            not divide, ``block_m / 2`` not a multiple of 64, ``skip_len < 0``.
    """
    check_stages("gluon_fp8_fwd", stages)
    _check_fp8_inputs(qc, kc, vt, eq, ek, ev)
    if (block_m // 2) % 64 or wl_block_m % block_m or skip_len < 0 or block_n != 128:
        raise ValueError(f"gluon_fp8_fwd: need block_m / 2 a multiple of 64 dividing wl_block_m, block_n 128 "
                         f"and skip_len >= 0, got block_m={block_m}, wl_block_m={wl_block_m}, block_n={block_n}, "
                         f"skip_len={skip_len}")
    T, H, D = qc.shape
    Hkv = kc.shape[1]
    o = torch.empty((T, H, D), dtype=torch.bfloat16, device=qc.device) if o is None else o
    lse = torch.empty((H, T), dtype=torch.float32, device=qc.device) if lse is None else lse
    max_entries = items.shape[0] * (wl_block_m // block_m)
    if T == 0 or max_entries == 0:
        return o, lse
    total = max_entries * H
    if masked_tile0 is None:
        masked_tile0 = fp8_masked_tile0(T, cu_seqlens.numel() - 1, MASKED_TILE0_MAX_MEAN)
    if (qc_lo is None) != (kc_lo is None) or (qc_lo is not None and (
            qc_lo.shape != qc.shape or kc_lo.shape != kc.shape or qc_lo.dtype != qc.dtype or kc_lo.dtype != kc.dtype
            or not qc_lo.is_contiguous() or not kc_lo.is_contiguous())):
        raise ValueError("gluon_fp8_fwd: qc_lo and kc_lo come together, contiguous, in qc's and kc's shapes and dtype")
    if vt_lo is not None and (vt_lo.dtype != vt.dtype or vt_lo.shape != vt.shape or vt_lo.stride() != vt.stride()):
        raise ValueError("gluon_fp8_fwd: vt_lo must be in vt's dtype, shape and strides")
    grid = min(total, torch.cuda.get_device_properties(qc.device).multi_processor_count)
    q_d, k_d = fp8_descriptor(qc, block_m), fp8_descriptor(kc, block_n)
    two = qc_lo is not None
    v_d = fp8_descriptor_t(vt, block_n)
    _fp8_fwd_kernel[(grid,)](
        q_d, k_d, v_d, fp8_descriptor(qc_lo, block_m) if two else q_d,
        fp8_descriptor(kc_lo, block_n) if two else k_d, fp8_descriptor_t(vt_lo, block_n) if vt_lo is not None else v_d, o, lse, eq, ek, ev,
        items, num_items, cu_seqlens, max_entries, int(skip_len), o.stride(0), lse.stride(0), eq.stride(0),
        ek.stride(0), float(softmax_scale) * LOG2E, total, T, torch.zeros(1, dtype=torch.int32, device=qc.device),
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        CAUSAL=bool(causal), BOOST=BOOST_LOG2, PINGPONG=bool(pingpong), PV_PROMOTE=bool(pv_promote),
        MASKED_TILE0=bool(masked_tile0), QK_LO=two, PV_LO=vt_lo is not None, num_warps=CONSUMER_WARPS.value // 2, maxnreg=MAXNREG)
    return o, lse
