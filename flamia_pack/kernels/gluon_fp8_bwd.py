"""Packed attention backward in FP8 (E4M3 codes, document-local token-block scales), Gluon, sm_90.

The backward of ``precision="fp8"`` (issue 28; DESIGN.md §4-5; paper §3.3; seed 001 §4-5). Its
numerics are the contract of :mod:`flamia_pack.kernels.fp8_emulation_bwd`. One program owns a
128-key tile of one kv head on the forward's key grid (``f + 128 n``, ``f = floor16(doc start)``:
the feature-major TMA boxes must start on a 16-byte boundary) and walks the 64-row query steps on
the grid ``f + 64 m`` that see it, for every query head of its GQA group. A producer warp loads K,
V, K^T once and, per step, Q, dO (row-major: the ``S^T`` / ``dP^T`` B operands, K-major along D)
and Q^T, dO^T (feature-major: the ``dK`` / ``dV`` B operands, K-major along the queries, stored in
the wgmma order, ``kernels.quantize.to_wgmma_order``, so that the register A operands ``P~v`` and
``Ck`` are the ``S^T`` / ``dP^T`` accumulators' registers as they lie, ``gluon_fp8_regs._wgmma_cols``)
plus the step's per-query vectors; the consumer (8 warps, 16 keys each) runs, per step::

    S^T   = Kc Qc^T,  dP^T = Vc dOc^T                  FP8 wgmma (QGMMA), fp32 out
    P     = exp2( S 2^e_k(j) (qk 2^e_q(i)) - LSE_i log2 e )       replicates the forward's scores
    dS    = P ( dP 2^(e_v(j) + e_do(i)) - Delta_i );  Uq = dS 2^e_k(j),  Uk = dS 2^e_q(i)
    dV:   rho_j = max {2^e_do(i) : i sees j};  P~v = E4M3(P 2^e_do(i) 2^BOOST / rho_j)
          dv <- dv (rho_prev / rho_j) + P~v dOc^T-tile        (acc in units of rho_j 2^-BOOST)
    dK:   s_j = 2^sigma_k(j) (quant.py's rule on max_i |Uk_ij| of the step);  Ck = E4M3(Uk / s_j)
          dk <- dk (s_prev / s_j) + Ck Qc^T-tile               (acc in units of s_j; dK = dk s_j scale)
          rho_j and s_j are floored (2^(BOOST - 126); 2^-REF_FLOOR_LOG2 x the largest so far) so the
          rescales stay finite on zero / tiny-dO steps (the emulation's ``_floor_references``)
    dQ:   t_i = 2^sigma_q(i) (the rule on max_j |Uq_ij| of the tile);  Cq = E4M3(Uq / t_i) through
          shared memory (keys contiguous);  dQacc_i += (Cq Kc)_i t_i scale         (TMA reduce-add)

Range budget (seed 001 §5): ``P <= 1`` (the saved LSE bounds every visible score) and ``2^e_do(i) <=
rho_j``, so ``P~v <= 2^BOOST <= 448``; ``|U / s_j| <= 448`` and ``|U / t_i| <= 448`` by the rule's
choice (``amax <= 448 2^sigma``); each payload carries only the exponent of the operand its
product contracts over (``e_k`` for dQ = dS K, ``e_q`` for dK = dS^T Q); the E4M3 conversion is ``satfinite``. The rescale ratios are powers
of two clamped to ``2^127`` (an accumulator that is still 0). Causality: ``rho_j`` and ``s_j`` read
the step's queries that see key ``j`` (dK_j and dV_j depend on them in exact attention), ``t_i``
reads the keys query ``i`` sees; dQ accumulates in fp32 with no data-dependent accumulator scale,
so ``causal_dq_scale`` holds in both granularities. Masked pairs are selected to 0 (never ``0 x
NaN``); tiles' columns of other documents are zeroed in shared memory before the products that
contract over them (K^T once, Q^T / dO^T on steps cut by the document), only where the factor
tables (K's; Q's or dO's) mark a neighbouring group whose codes may be NaN (``2^127``,
:func:`_nonfinite_outside`: a finite group's codes are finite), so a NaN in one document reaches no
other.

Why two payloads and not one ``32 x 32``-block payload: Hopper's FP8 wgmma has no block scales and a
k = 32 instruction, so a scale that varies along a product's contraction needs one promotion per
instruction (4 per step and product); a per-row scale of each product needs one rescale per step.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.runtime.jit import constexpr_function

from flamia_pack.kernels.constants import LOG2E
from flamia_pack.scheduler.cost import fp8_masked_tile0
from flamia_pack.kernels.gluon_common import (
    _tma_reduce_add, _rows_through_smem, _slot_barriers, _store_doc_rows, check_stages, descriptor, CONSUMER_WARPS,
    MAXNREG)
from flamia_pack.kernels.gluon_fp8_fwd import (
    BOOST_LOG2, TABLE_PAD, _REF_FLOOR, _zero_cols_outside, fp8_descriptor, fp8_descriptor_t)
from flamia_pack.kernels.gluon_fp8_regs import _e4m3_words, _exp2_const, _qgmma_layout, _wgmma_cols, _words_operand

__all__ = ["gluon_fp8_bwd", "fp8_bwd_entries", "BWD_BLOCK_M", "BWD_BLOCK_N", "COLD_CALL_MAX_MEAN"]

BWD_BLOCK_M = 64
"""Query rows per step of the FP8 dK/dV programs (the grid ``floor16(doc start) + 64 m``)."""
BWD_BLOCK_N = 128
"""Keys per FP8 dK/dV program (the forward's key tile)."""
COLD_CALL_MAX_MEAN = 1536
"""``gluon_fp8_bwd(cold_call=None)`` compiles the masked steps' column zeroing as a call on rows whose mean
document length is at most this many tokens (``scheduler.cost.fp8_masked_tile0``'s rule): their programs run
few steps, half of them masked, and the masked loops' code size binds (instruction fetch), which the call
shrinks by a third. Rows of long documents keep the inlined code: the call changes the whole kernel's register
allocation, which their mask-free steps pay for (measurements: benchmarks/NOTES.md, 2026-12-06 (sixth))."""


@constexpr_function
def _dq_layout(num_warps, m, n):
    """Accumulator layout of the ``m x n`` FP8 dQ partial (``m`` = 64 queries): one warpgroup along
    the rows, the others side by side along the columns (k = 32 per instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                     instr_shape=[16, n // (num_warps // 4), 32])


@gluon.jit
def _pow2_of(x):
    """``2^sigma`` as float32 for quant.py's rule ``sigma = ceil(log2(x / 448))`` on ``x >= 0`` (fp32):
    from the bits, exact. 0 where ``x`` is 0 or subnormal (callers keep their reference there)."""
    b = x.to(gl.int32, bitcast=True)
    big = b >> 23
    e = big - 135 + ((b & 0x7FFFFF) > 0x600000).to(gl.int32)
    e = gl.minimum(gl.maximum(e, -126), 120)
    return gl.where(big > 0, ((e + 127) << 23).to(gl.float32, bitcast=True), 0.0)


@gluon.jit
def _inv(x):
    """``1 / x`` for a power of two ``x = 2^e``, ``e`` in ``[-126, 126]``, exactly, from the bits (no
    division: the IEEE one costs ~10 instructions an element)."""
    return ((254 << 23) - x.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True)


@gluon.jit
def _nonfinite_outside(fac, pos, lo, hi):
    """Whether a token at ``pos`` outside ``[lo, hi)`` has factor ``2^127`` in ``fac`` (a tile's vector of
    factor-table entries, ``gluon_fp8_fwd.exponent_table``: that group's exponent byte is the non-finite
    sentinel 255, or 254; ``pos`` the tokens, in ``fac``'s layout): only such a group's E4M3 codes can
    be NaN (every finite group's codes are finite; past T the table is 1.0 and TMA fills zeros), so
    only then must the tile's columns of the neighbouring documents be zeroed (``0 x NaN`` in the dK /
    dV products over Q^T / dO^T, the dQ partial over K^T). The skip-unless-marked rule of the forward's
    ``_may_be_nonfinite_outside``, on factors the consumer already holds (the step's ``ld_bufs``
    vectors 2^e_q, 2^e_do, their maximum; the tile's ``kf``): no global load, no pointer live across
    the step loops."""
    return gl.max(gl.where((pos < lo) | (pos >= hi), fac, 0.0), 0) >= _exp2_const(127)


@gluon.jit
def _wait_turn(lock, rank):
    """Spin until the turn counter at ``lock`` (int32, global) reads ``rank`` (acquire, GPU scope)."""
    t = gl.atomic_add(lock, 0, sem="acquire", scope="gpu")
    while t != rank:
        t = gl.atomic_add(lock, 0, sem="acquire", scope="gpu")


@gluon.jit
def _bulk_wait_all():
    """``cp.async.bulk.wait_group 0``: this thread's bulk copies / reduces have completed, their writes
    done (``tma.store_wait`` emits the ``.read`` form: only their shared-memory source is free)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _bwd_produce(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, kt_desc, q_bufs, do_bufs, qt_bufs, dot_bufs,
                 k_smem, v_smem, kt_smem, ready, empty, kv_bar, ld_bufs, LSE, DELTA, FQ, FDO, stride_lh, stride_f,
                 a, f, m0, n_steps, end, hk, qk_scale, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, lo, QK_LO: gl.constexpr, V_LO: gl.constexpr = False):
    """The producer warp: K, V, K^T of the tile (``kv_bar``), then per step ``(g, j)`` the query step's
    four tiles into ring slot ``s`` and its vectors into ``ld_bufs[5 s + (0..4)]``: ``LSE log2 e``,
    ``Delta``, ``qk 2^e_q`` (the forward's row factor), ``2^e_q``, ``2^e_do`` (stored before the
    slot's ``ready`` arrive). ``QK_LO`` (two-term Q and K): ``lo`` = the residual codes' descriptors
    ``(Q, K, K^T, V)`` and buffers ``(Q ring, K, K^T, V)``, loaded on the same barriers (``V_LO``, two-term V:
    the last pair)."""
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    ld_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    qlo_desc, klo_desc, ktlo_desc, vlo_desc, qlo_bufs, klo_smem, ktlo_smem, vlo_smem = lo
    # K, V, K^T, and the residual tiles: K_lo, K_lo^T (QK_LO), V_lo (V_LO)
    kv_bytes: gl.constexpr = ((1 + QK_LO) * (k_desc.block_type.nbytes + kt_desc.block_type.nbytes)
                              + (1 + V_LO) * v_desc.block_type.nbytes)
    mbarrier.expect(kv_bar, kv_bytes)
    if QK_LO:
        tma.async_copy_global_to_shared(klo_desc, [a, hk * HEAD_DIM], kv_bar, klo_smem)
        tma.async_copy_global_to_shared(ktlo_desc, [hk * HEAD_DIM, a], kv_bar, ktlo_smem)
    if V_LO:
        tma.async_copy_global_to_shared(vlo_desc, [a, hk * HEAD_DIM], kv_bar, vlo_smem)
    tma.async_copy_global_to_shared(k_desc, [a, hk * HEAD_DIM], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [a, hk * HEAD_DIM], kv_bar, v_smem)
    tma.async_copy_global_to_shared(kt_desc, [hk * HEAD_DIM, a], kv_bar, kt_smem)
    c = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        for j in range(n_steps):
            s = c % STAGES
            q0 = f + (m0 + j) * BLOCK_M
            ri = q0 + gl.arange(0, BLOCK_M, layout=ld_layout)
            ok = ri < end
            lse = gl.load(LSE + h * stride_lh + ri, mask=ok, other=0.0)
            delta = gl.load(DELTA + h * stride_lh + ri, mask=ok, other=0.0)
            fq = gl.load(FQ + h * stride_f + ri)  # factor tables are padded past T: unmasked
            fdo = gl.load(FDO + h * stride_f + ri)
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            ld_bufs.index(5 * s).store(lse * 1.4426950408889634)
            ld_bufs.index(5 * s + 1).store(delta)
            ld_bufs.index(5 * s + 2).store(fq * qk_scale)
            ld_bufs.index(5 * s + 3).store(fq)
            ld_bufs.index(5 * s + 4).store(fdo)
            gl.thread_barrier()
            if QK_LO:
                mbarrier.expect(ready.index(s), 3 * q_desc.block_type.nbytes + 2 * qt_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(qlo_desc, [q0, h * HEAD_DIM], ready.index(s), qlo_bufs.index(s))
            else:
                mbarrier.expect(ready.index(s), 2 * q_desc.block_type.nbytes + 2 * qt_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q0, h * HEAD_DIM], ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(do_desc, [q0, h * HEAD_DIM], ready.index(s), do_bufs.index(s))
            tma.async_copy_global_to_shared(qt_desc, [h * HEAD_DIM, q0], ready.index(s), qt_bufs.index(s))
            tma.async_copy_global_to_shared(dot_desc, [h * HEAD_DIM, q0], ready.index(s), dot_bufs.index(s))
            c += 1


@gluon.jit(noinline=True)
def _zero_step_cols_call(qt_buf, dot_buf, lo, hi, NW: gl.constexpr):
    """The masked step's zeroing of Q^T / dO^T columns outside ``[lo, hi)`` as a call (``COLD_CALL``): one
    copy of the code instead of one inlined in each masked loop. No fence or barrier in here (the caller's):
    a barrier in a called function is the whole CTA's, which the producer warp never joins."""
    _zero_cols_outside(qt_buf, lo, hi, NW, True, False)
    _zero_cols_outside(dot_buf, lo, hi, NW, True, False)


@gluon.jit
def _bwd_step(q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, ld_bufs, ds_smem, tq_smem,
              dq_stage, dq_desc, h, a, f, m0, j, c, start, end, k_pos, kf, vf, dk, dv, sk, rho, sk_run, rho_run,
              sm_scale, sem_doc, stride_sem, rank,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, BOOST: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr, DETERMINISTIC: gl.constexpr,
              lo, QK_LO: gl.constexpr, COLD_CALL: gl.constexpr, V_LO: gl.constexpr = False):
    """One query step (module docs); returns ``(dk, dv, sk, rho, sk_run, rho_run)`` with the dK / dV
    products in flight (``sk_run``: per key, the largest dK reference so far; ``rho_run``: a scalar, the
    largest 2^e_do so far; the floors of the references). ``QK_LO`` (two-term Q and K, the emulation's
    ``qk_terms=2``; ``lo``: the residual codes' buffers ``(Q ring, K, K^T)``): S^T is three products
    (``K Q^T + K Q_lo^T + K_lo Q^T``) and the dQ partial ``dS (K + K_lo)`` two; dK reads Q's codes only.
    ``V_LO`` (two-term V, the emulation's ``pv_terms=2``; ``lo[3]`` V's residual codes): dP^T is two products,
    ``V_lo dO^T`` first, then ``V dO^T``."""
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    s_layout: gl.constexpr = _qgmma_layout(NW, BLOCK_M)
    acc_layout: gl.constexpr = _qgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    dq_layout: gl.constexpr = _dq_layout(NW, BLOCK_M, HEAD_DIM)
    col: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
    s = c % STAGES
    q0 = f + (m0 + j) * BLOCK_M
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    if MASKED:
        if (q0 < start) | (q0 + BLOCK_M > end):  # the step holds other documents' rows: 0 in Q^T, dO^T
            # (dK / dV contract over the step's queries), only where 2^e_q or 2^e_do marks a group of those
            # rows whose codes may be NaN (both tiles then: one check, less code in the masked loops); here,
            # under the previous step's dK / dV (they read another slot), not under S^T / dP^T: fewer
            # registers live
            vec: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [NW], [0])  # each warp all the rows
            q_out = q0 + gl.arange(0, BLOCK_M, layout=vec)
            fac = gl.maximum(ld_bufs.index(5 * s + 3).load(vec), ld_bufs.index(5 * s + 4).load(vec))
            if _nonfinite_outside(fac, q_out, start, end):
                if COLD_CALL:
                    _zero_step_cols_call(qt_bufs.index(s), dot_bufs.index(s), start - q0, end - q0, NW)
                    fence_async_shared()
                    gl.thread_barrier()
                else:
                    _zero_cols_outside(qt_bufs.index(s), start - q0, end - q0, NW, True)
                    _zero_cols_outside(dot_bufs.index(s), start - q0, end - q0, NW, True)
    # the previous step's dK / dV retire first: their A operands are dead, their B slot is released
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=c > 0)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if QK_LO:  # the forward's three S products in its order: K_lo Q^T, K Q_lo^T, then K Q^T
        st = warpgroup_mma(lo[1], q_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        st = warpgroup_mma(k_smem, lo[0].index(s).permute((1, 0)), st, is_async=True)
        st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), st, is_async=True)
    else:
        st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if V_LO:  # V (V + V_lo): the residual product first (as S)
        dpt = warpgroup_mma(lo[3], do_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), dpt, is_async=True)
    else:
        dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if MASKED:
        q_pos = q0 + gl.arange(0, BLOCK_M, layout=col)
        vis = (q_pos >= start)[None, :] & (q_pos < end)[None, :] & (k_pos >= start)[:, None] & (k_pos < end)[:, None]
        if CAUSAL:
            vis = vis & (k_pos[:, None] <= q_pos[None, :])
    st = warpgroup_mma_wait(2 if V_LO else 1, deps=(st,))  # S^T retired, dP^T's products in flight
    lse2 = ld_bufs.index(5 * s).load(col)
    rowf = ld_bufs.index(5 * s + 2).load(col)
    p = gl.exp2((st * kf[:, None]) * rowf[None, :] - lse2[None, :])
    fdo = ld_bufs.index(5 * s + 4).load(col)
    # dV fold (the E4M3 A operand made while dP^T runs): reference per key over the step's queries
    # that see it, floored at 2^(BOOST - 126) (so 2^BOOST / rho is a normal float: a key seen only by
    # zero-dO queries, e.g. a document's last token, has rho = 2^-126) and at 2^-REF_FLOOR_LOG2 x
    # rho_run, the largest 2^e_do so far among the tile's queries that see a key of it (so the
    # accumulator's rescale rho_prev / rho stays <= 2^64: a step whose dO is all 0 overflowed it).
    # Masked pairs are selected to 0 after the product (their 2^e_do / rho is unbounded).
    RMIN: gl.constexpr = _exp2_const(BOOST - 126)
    floor = gl.maximum(rho_run * _REF_FLOOR, RMIN)
    if MASKED:
        p = gl.where(vis, p, 0.0)
        rho_step = gl.max(gl.where(vis, fdo[None, :], 0.0), 1)
        rho_new = gl.where(rho_step > 0.0, gl.maximum(rho_step, floor), rho)
        pv = gl.where(vis, p * (fdo[None, :] * (_inv(rho_new) * (2.0 ** BOOST))[:, None]), 0.0)
        q_sees = (q_pos >= start) & (q_pos < end)
        if CAUSAL:
            q_sees = q_sees & (q_pos >= gl.maximum(a, start))
        rho_run = gl.maximum(rho_run, gl.max(gl.where(q_sees, fdo, 0.0), 0))
    else:
        rho_t = gl.max(fdo, 0)
        rho_s = gl.maximum(rho_t, floor)
        rho_new = gl.zeros_like(rho) + rho_s
        pv = p * (fdo * (_inv(rho_s) * (2.0 ** BOOST)))[None, :]
        rho_run = gl.maximum(rho_run, rho_t)
    pv8 = _words_operand(_e4m3_words(_wgmma_cols(pv, op_layout)), op_layout)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    delta = ld_bufs.index(5 * s + 1).load(col)
    ds = p * ((dpt * vf[:, None]) * fdo[None, :] - delta[None, :])
    if MASKED:
        ds = gl.where(vis, ds, 0.0)
    # dK payload: one power of two per key over the step's queries
    uk = ds * ld_bufs.index(5 * s + 3).load(col)[None, :]
    sk_step = _pow2_of(gl.max(gl.abs(uk), 1))
    sk_new = gl.where(sk_step > 0.0, gl.maximum(sk_step, sk_run * _REF_FLOOR), sk)
    sk_run = gl.where(sk_step > 0.0, gl.maximum(sk_run, sk_new), sk_run)
    ck8 = _words_operand(_e4m3_words(_wgmma_cols(uk * _inv(sk_new)[:, None], op_layout)), op_layout)
    # dQ payload: one power of two per query over the tile's keys (8 warps: a cross-warp max)
    uq = ds * kf[:, None]
    tq = _pow2_of(gl.max(gl.abs(uq), 0))
    tq_safe = gl.where(tq > 0.0, tq, 1.0)
    # the factor goes to the dQ partial's row layout through shared memory, read after the dS tile's barrier
    # (a convert_layout costs two barriers of its own)
    tq_smem.store(tq_safe * sm_scale)
    cq = (uq * _inv(tq_safe)[None, :]).to(gl.float8e4nv)
    ds_smem.store(gl.permute(cq, (1, 0)))  # (queries, keys), keys contiguous: the K-major A operand
    fence_async_shared()
    gl.thread_barrier()
    fq = tq_smem.load(gl.SliceLayout(1, dq_layout))
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    if QK_LO:  # dS (K + K_lo), the residual product first (as S)
        dqp = warpgroup_mma(ds_smem, lo[2].permute((1, 0)), dq_zero, use_acc=False, is_async=True)
        dqp = warpgroup_mma(ds_smem, kt_smem.permute((1, 0)), dqp, is_async=True)
    else:
        dqp = warpgroup_mma(ds_smem, kt_smem.permute((1, 0)), dq_zero, use_acc=False, is_async=True)
    dv = dv * gl.convert_layout(gl.minimum(rho * _inv(rho_new), 1.7014118346046923e38), row_acc)[:, None]
    dv = warpgroup_mma(pv8, dot_bufs.index(s).permute((1, 0)), dv, is_async=True)
    dk = dk * gl.convert_layout(gl.minimum(sk * _inv(sk_new), 1.7014118346046923e38), row_acc)[:, None]
    dk = warpgroup_mma(ck8, qt_bufs.index(s).permute((1, 0)), dk, is_async=True)
    # the dQ partial retires first (groups retire in order), then goes out by one TMA reduce-add
    dqp = warpgroup_mma_wait(2, deps=(dqp,))
    dqp = dqp * fq[:, None]
    if MASKED:
        if (q0 < start) | (q0 + BLOCK_M > end):  # the step holds other documents' rows: their dQ partial
            # rows are 0 x K, and a NaN code in this document's K (a non-finite input of its own) would make
            # them NaN in the other documents' dQ: selected to 0 before the reduce-add
            q_row = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            dqp = gl.where(((q_row >= start) & (q_row < end))[:, None], dqp, 0.0)
    tma.store_wait(0)  # the previous reduce has read the staging tile
    gl.thread_barrier()
    dq_stage.store(dqp)
    fence_async_shared()
    gl.thread_barrier()
    if DETERMINISTIC:  # this document's earlier key tiles (rank 0 .. rank - 1) have added their partials first
        lock = sem_doc + (m0 + j) * stride_sem + h
        _wait_turn(lock, rank)
    _tma_reduce_add(dq_desc, [q0, h * HEAD_DIM], dq_stage)
    if DETERMINISTIC:  # the partial is in dQ (not only read from shared memory) before the next rank's turn
        _bulk_wait_all()
        gl.thread_barrier()
        gl.atomic_add(lock, 1, sem="release", scope="gpu")
    return dk, dv, sk_new, rho_new, sk_run, rho_run



@gluon.jit
def _bwd_consume(q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, kv_bar, ld_bufs, ds_smem,
                 tq_smem, dq_stage, dq_desc, DK, DV, FK, FV, stride_f, stride_dkt, stride_dvt, a, f, m0, n_steps, u0,
                 u1, start, end, hk, sm_scale, sem_doc, stride_sem, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                 BOOST: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DETERMINISTIC: gl.constexpr, lo, QK_LO: gl.constexpr, COLD_CALL: gl.constexpr,
                 V_LO: gl.constexpr = False):
    """The 8-warp consumer of one program: every step of every head of the group, then dK, dV
    (``QK_LO`` / ``V_LO``: ``lo`` the residual codes' buffers, :func:`_bwd_step`)."""
    NW: gl.constexpr = CONSUMER_WARPS
    s_layout: gl.constexpr = _qgmma_layout(NW, BLOCK_M)
    acc_layout: gl.constexpr = _qgmma_layout(NW, HEAD_DIM)
    row: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_pos = a + gl.arange(0, BLOCK_N, layout=row)
    kf = gl.load(FK + hk * stride_f + k_pos)
    vf = gl.load(FV + hk * stride_f + k_pos)
    k_nan = _nonfinite_outside(kf, k_pos, start, end)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    sk = gl.full([BLOCK_N], 1.0, gl.float32, row)
    rho = gl.full([BLOCK_N], 1.0, gl.float32, row)
    sk_run = gl.zeros([BLOCK_N], gl.float32, row)
    rho_run = 0.0
    mbarrier.wait(kv_bar, 0)
    if (a < start) | (a + BLOCK_N > end):  # other documents' keys: 0 in K^T (the dQ partial reads every key)
        if k_nan:  # only where one of their groups' codes may be NaN
            _zero_cols_outside(kt_smem, start - a, end - a, NW)
            if QK_LO:
                _zero_cols_outside(lo[2], start - a, end - a, NW)
    rank = (a - f) // BLOCK_N  # the tile's place among its document's programs (the dQ turn order)
    c = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        for j in range(0, u0):
            dk, dv, sk, rho, sk_run, rho_run = _bwd_step(
                q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, ld_bufs, ds_smem, tq_smem,
                dq_stage, dq_desc, h, a, f, m0, j, c, start, end, k_pos, kf, vf, dk, dv, sk, rho, sk_run, rho_run,
                sm_scale, sem_doc, stride_sem, rank, True, CAUSAL, BOOST, HEAD_DIM, BLOCK_M, BLOCK_N, NW,
                DETERMINISTIC, lo, QK_LO, COLD_CALL, V_LO)
            c += 1
        for j in range(u0, u1):
            dk, dv, sk, rho, sk_run, rho_run = _bwd_step(
                q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, ld_bufs, ds_smem, tq_smem,
                dq_stage, dq_desc, h, a, f, m0, j, c, start, end, k_pos, kf, vf, dk, dv, sk, rho, sk_run, rho_run,
                sm_scale, sem_doc, stride_sem, rank, False, CAUSAL, BOOST, HEAD_DIM, BLOCK_M, BLOCK_N, NW,
                DETERMINISTIC, lo, QK_LO, COLD_CALL, V_LO)
            c += 1
        for j in range(u1, n_steps):
            dk, dv, sk, rho, sk_run, rho_run = _bwd_step(
                q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, ld_bufs, ds_smem, tq_smem,
                dq_stage, dq_desc, h, a, f, m0, j, c, start, end, k_pos, kf, vf, dk, dv, sk, rho, sk_run, rho_run,
                sm_scale, sem_doc, stride_sem, rank, True, CAUSAL, BOOST, HEAD_DIM, BLOCK_M, BLOCK_N, NW,
                DETERMINISTIC, lo, QK_LO, COLD_CALL, V_LO)
            c += 1
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    tma.store_wait(0)  # the last reduce has read its staging tile before the program exits
    fk = gl.convert_layout(sk * sm_scale, gl.SliceLayout(1, acc_layout))
    fv = gl.convert_layout(rho * (2.0 ** -BOOST), gl.SliceLayout(1, acc_layout))
    # dK, dV through the free dQ staging tile (fp32 64 x D: the bytes of bf16 128 x D) as 16-byte row
    # stores (from the accumulator layout a thread writes 4 bytes: every 32-byte sector in two halves)
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    stage = dq_stage._reinterpret(gl.bfloat16, [BLOCK_N, HEAD_DIM], stage_layout)
    gl.thread_barrier()  # every warp is past the last reduce's read of the staging tile
    out = _rows_through_smem(stage, (dk * fk[:, None]).to(gl.bfloat16), NW)
    _store_doc_rows(DK, out, a, start, end, stride_dkt, hk * HEAD_DIM)
    gl.thread_barrier()  # every warp read its dK rows before dV overwrites the tile
    out = _rows_through_smem(stage, (dv * fv[:, None]).to(gl.bfloat16), NW)
    _store_doc_rows(DV, out, a, start, end, stride_dvt, hk * HEAD_DIM)


@gluon.jit
def _fp8_bwd_kernel(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, kt_desc, dq_desc, qlo_desc, klo_desc,
                    ktlo_desc, vlo_desc, LSE, DELTA, FQ, FDO, FK, FV, DK, DV, ENTRIES, n_entries_ptr, max_entries, stride_lh,
                    stride_f, stride_dkt, stride_dvt, qk_scale, sm_scale, SEM, SEM_BASE, stride_sem,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, BOOST: gl.constexpr, DETERMINISTIC: gl.constexpr,
                    QK_LO: gl.constexpr, COLD_CALL: gl.constexpr, V_LO: gl.constexpr):
    # head-major: entry e of kv head hk (fp8_bwd_entries' decreasing-cost order)
    pid = gl.program_id(0)
    e = pid % max_entries
    hk = pid // max_entries
    if e >= gl.load(n_entries_ptr):
        return
    a = gl.load(ENTRIES + 4 * e)
    f = gl.load(ENTRIES + 4 * e + 1)
    start = gl.load(ENTRIES + 4 * e + 2)
    end = gl.load(ENTRIES + 4 * e + 3)
    if DETERMINISTIC:
        sem_doc = SEM + gl.load(SEM_BASE + e) * stride_sem  # the document's (64-row step, query head) turn counters
    else:
        sem_doc = SEM
    if CAUSAL:
        m0 = (a - f) // BLOCK_M
        u0 = 2
    else:
        m0 = 0
        u0 = gl.where(f < start, 1, 0)
    n_steps = (end - f + BLOCK_M - 1) // BLOCK_M - m0
    u0 = gl.minimum(u0, n_steps)
    u1 = gl.maximum(u0, (end - f) // BLOCK_M - m0)
    if (a < start) | (a + BLOCK_N > end):  # a tile with other documents' keys: every step masked
        u0 = n_steps
        u1 = n_steps
    q_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    qt_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_M], qt_desc.layout)
    dot_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_M], dot_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM], v_desc.layout)
    kt_smem = gl.allocate_shared_memory(gl.float8e4nv, [HEAD_DIM, BLOCK_N], kt_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv)
    ds_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N], ds_layout)
    dq_stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_desc.layout)
    tq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ld_bufs = gl.allocate_shared_memory(gl.float32, [5 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if QK_LO:  # two-term Q and K: the residual codes' tiles (Q ring, K, K^T)
        qlo_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, HEAD_DIM], qlo_desc.layout)
        klo_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM], klo_desc.layout)
        ktlo_smem = gl.allocate_shared_memory(gl.float8e4nv, [HEAD_DIM, BLOCK_N], ktlo_desc.layout)
    else:  # unread
        qlo_bufs, klo_smem, ktlo_smem = q_bufs, k_smem, kt_smem
    if V_LO:  # two-term V: its residual codes' tile
        vlo_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, HEAD_DIM], vlo_desc.layout)
    else:
        vlo_smem = v_smem  # unread
    lo_bufs = (qlo_bufs, klo_smem, ktlo_smem, vlo_smem)
    lo_prod = (qlo_desc, klo_desc, ktlo_desc, vlo_desc, qlo_bufs, klo_smem, ktlo_smem, vlo_smem)
    ready, empty = _slot_barriers(STAGES, True)
    kv_ready, _kv_empty = _slot_barriers(1, False)
    kv_bar = kv_ready.index(0)
    gl.warp_specialize([
        (_bwd_consume, (q_bufs, do_bufs, qt_bufs, dot_bufs, k_smem, v_smem, kt_smem, ready, empty, kv_bar, ld_bufs,
                        ds_smem, tq_smem, dq_stage, dq_desc, DK, DV, FK, FV, stride_f, stride_dkt, stride_dvt, a, f, m0,
                        n_steps, u0, u1, start, end, hk, sm_scale, sem_doc, stride_sem, GROUP, CAUSAL, BOOST,
                        HEAD_DIM, BLOCK_M, BLOCK_N, DETERMINISTIC, lo_bufs, QK_LO, COLD_CALL, V_LO)),
        (_bwd_produce, (q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, kt_desc, q_bufs, do_bufs, qt_bufs,
                        dot_bufs, k_smem, v_smem, kt_smem, ready, empty, kv_bar, ld_bufs, LSE, DELTA, FQ, FDO,
                        stride_lh, stride_f, a, f, m0, n_steps, end, hk, qk_scale, GROUP, HEAD_DIM, BLOCK_M,
                        lo_prod, QK_LO, V_LO)),
    ], [1], [24])


def fp8_bwd_entries(cu_seqlens: torch.Tensor, total_tokens: int, *, causal: bool = True,
                    block_m: int = BWD_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The FP8 dK/dV programs' work list, built on the device (no host sync): one entry per
    (document, 128-key tile on the grid ``floor16(start) + 128 n``), in decreasing cost (query steps).

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32 on the device, validated; total_tokens: T.
        causal: as the forward (the cost order differs).

    Returns:
        ``(entries, n_entries, max_entries)``: ``(max_entries, 4)`` int32 rows ``(a, f, start, end)``
        (tile base, the document's grid origin ``floor16(start)``, its token range), entries past
        ``n_entries`` (a ``(1,)`` int32 device tensor) unused; ``max_entries = ceil(T / 128) + n_docs``.
    """
    cu = cu_seqlens.to(torch.int64)
    n_docs = cu.numel() - 1
    max_entries = -(-int(total_tokens) // BWD_BLOCK_N) + n_docs
    dev = cu.device
    start, end = cu[:-1], cu[1:]
    f = start - start % 16
    n_tiles = torch.where(end > start, (end - f + BWD_BLOCK_N - 1) // BWD_BLOCK_N, torch.zeros_like(start))
    cum = torch.cumsum(n_tiles, 0)
    p = torch.arange(max_entries, device=dev)
    doc = torch.searchsorted(cum, p, right=True).clamp(max=max(n_docs - 1, 0))
    valid = p < cum[-1] if n_docs else torch.zeros_like(p, dtype=torch.bool)
    n = p - (cum[doc] - n_tiles[doc])
    a = f[doc] + n * BWD_BLOCK_N
    e_end = end[doc]
    steps = (e_end - f[doc] + block_m - 1) // block_m - (((a - f[doc]) // block_m) if causal else 0)
    cost = torch.where(valid, steps, torch.full_like(steps, -1))
    order = torch.argsort(cost, descending=True, stable=True)
    entries = torch.stack([a, f[doc], start[doc], e_end], 1)[order].to(torch.int32).contiguous()
    return entries, cum[-1:].to(torch.int32) if n_docs else torch.zeros(1, dtype=torch.int32, device=dev), max_entries


def _turn_counters(cu_seqlens: torch.Tensor, entries: torch.Tensor, T: int, H: int):
    """``deterministic=True``'s turn counters: ``(sem, sem_base)``. ``sem``: zeroed int32 ``(n_slots, H)``,
    one counter per (64-row step of a document on its grid ``floor16(start) + 64 m``, query head), the
    documents' steps back to back (``n_slots = T // 64 + 2 n_docs`` bounds their number with no host
    sync); ``sem_base``: int32 per entry, the first slot of the entry's document (found by its start)."""
    cu = cu_seqlens.to(torch.int64)
    start, end = cu[:-1], cu[1:]
    f = start - start % 16
    nb = torch.where(end > start, (end - f + BWD_BLOCK_M - 1) // BWD_BLOCK_M, torch.zeros_like(start))
    base = torch.cumsum(nb, 0) - nb
    # an empty document shares its start with the next one: right=True picks the last (non-empty) of them
    doc = (torch.searchsorted(start, entries[:, 2].to(torch.int64), right=True) - 1).clamp(min=0)
    sem_base = base[doc].to(torch.int32).contiguous() if start.numel() else torch.zeros(
        entries.shape[0], dtype=torch.int32, device=cu.device)
    n_slots = T // BWD_BLOCK_M + 2 * max(start.numel(), 1)
    return torch.zeros((n_slots, H), dtype=torch.int32, device=cu.device), sem_base


def gluon_fp8_bwd(qc, kc, vc, qt, kt, dc, dct, fq, fk, fv, fdo, lse, delta, cu_seqlens, softmax_scale,
                  *, causal: bool = True, stages: int = 2, entries=None, dq_acc: torch.Tensor | None = None,
                  cast_dq: bool = True, deterministic: bool = False, qc_lo: torch.Tensor | None = None,
                  kc_lo: torch.Tensor | None = None,
                  kt_lo: torch.Tensor | None = None, vc_lo: torch.Tensor | None = None,
                  cold_call: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 attention backward (module docs), warp-specialized Gluon, sm_90.

    Args:
        qc, dc: ``(T, H_q, 128)`` float8_e4m3fn codes of Q and dO; kc, vc: ``(T, H_kv, 128)``;
            qt, dct: ``(H_q, 128, ceil16(T))`` feature-major codes in the wgmma order (the dK / dV
            products' B operands, ``kernels.quantize.to_wgmma_order``) and kt: ``(H_kv, 128, T)`` in token
            order (token stride 1, feature stride a multiple of 16).
        fq, fdo: ``(H_q, ceil16(T) + TABLE_PAD)`` and fk, fv: ``(H_kv, ...)`` float32 factor tables
            (``gluon_fp8_fwd.exponent_table`` of the exponent bytes).
        lse: ``(H_q, T)`` float32 natural-log LSE of the FP8 forward; delta: ``(H_q, T)`` float32
            ``rowsum(dO^ O) - dLSE``.
        cu_seqlens: ``(n_docs + 1,)`` int32, validated; softmax_scale: the forward's.
        causal: as the forward; stages: ring depth (>= 2); entries: :func:`fp8_bwd_entries`' result
            (default: built here); dq_acc: optional zeroed ``(T, H_q, 128)`` float32 accumulator.
        cast_dq: return dQ cast to bf16 (default), or its float32 accumulator (the caller casts it
            once it has freed what the kernel read: ``fp8_backward`` frees dO's codes first, 2 T H_q D
            bytes less at the call's memory peak).
        deterministic: bitwise reproducible dQ. The programs of one document add their dQ partials of a
            64-row step in the order of their key tiles (turn counters per (step, query head), spun on
            with acquire loads, released after each reduce has completed), instead of whenever they get
            there; dK and dV are reproducible either way. A program waits only on programs of lower
            index (``fp8_bwd_entries`` orders a document's tiles first to last), which cannot deadlock as
            long as the GPU starts programs in index order (it does on Hopper; CUDA does not promise it).
        qc_lo, kc_lo, kt_lo: two-term Q and K (``fp8_emulation_bwd`` ``qk_terms=2``, the forward's
            ``gluon_fp8_fwd(qc_lo=, kc_lo=)``): the residual codes of ``qc``, ``kc`` and ``kt``, same shapes
            and layouts; S^T is then three FP8 products and the dQ partial two. All three or none.
        vc_lo: two-term V (``fp8_emulation_bwd`` ``pv_terms=2``): the residual codes of ``vc``, same shape and
            layout; dP^T is then two FP8 products.
        cold_call: compile the masked steps' zeroing of other documents' Q^T / dO^T columns (a branch taken
            only next to a non-finite group) as a call instead of inline; ``None`` (default): on where the
            mean document length is at most :data:`COLD_CALL_MAX_MEAN`. The same bits either way.

    Returns:
        ``(dq, dk, dv)``: bf16 (``cast_dq=False``: float32) ``(T, H_q, 128)`` and bf16 ``(T, H_kv, 128)`` x 2;
        padding rows 0 (every row of a document is written by exactly one program: dK / dV are not
        pre-zeroed).

    Raises:
        ValueError: operands of the wrong dtype / shape / layout, head_dim other than 64 / 128.
    """
    check_stages("gluon_fp8_bwd", stages)
    T, H, D = qc.shape
    Hkv = kc.shape[1]
    for name, x in (("q", qc), ("k", kc), ("v", vc), ("do", dc)):
        if x.dtype != torch.float8_e4m3fn or x.dim() != 3 or x.shape[0] != T or x.shape[2] != D \
                or not x.is_contiguous() or not x.is_cuda:
            raise ValueError(f"gluon_fp8_bwd: {name} codes must be contiguous float8_e4m3fn CUDA (T={T}, H, {D}), got "
                             f"{x.dtype} {tuple(x.shape)}")
    tp = -(-T // 16) * 16
    for name, x, hh, tt in (("q^T", qt, H, tp), ("k^T", kt, Hkv, T), ("do^T", dct, H, tp)):
        if x.dtype != torch.float8_e4m3fn or x.shape != (hh, D, tt) or x.stride(2) != 1 or x.stride(1) % 16:
            raise ValueError(f"gluon_fp8_bwd: {name} codes must be feature-major float8_e4m3fn ({hh}, {D}, {tt}) with "
                             f"token stride 1 and a 16-byte feature stride, got {x.dtype} {tuple(x.shape)} "
                             f"{x.stride()}")
    if D not in (64, 128) or H % Hkv or dc.shape[1] != H or vc.shape[1] != Hkv:
        raise ValueError(f"gluon_fp8_bwd: need head_dim 64 or 128 and H_q % H_kv == 0, got D={D}, H_q={H}, H_kv={Hkv}")
    width = -(-T // 16) * 16 + TABLE_PAD  # (a step reads up to 63 rows past a document's end)
    for name, x, hh in (("q", fq, H), ("k", fk, Hkv), ("v", fv, Hkv), ("do", fdo, H)):
        if x.dtype != torch.float32 or x.shape != (hh, width) or not x.is_contiguous():
            raise ValueError(f"gluon_fp8_bwd: the {name} factor table must be float32 ({hh}, {width}) "
                             f"(gluon_fp8_fwd.exponent_table), got {x.dtype} {tuple(x.shape)}")
    for name, x in (("lse", lse), ("delta", delta)):
        if x.dtype != torch.float32 or x.shape != (H, T) or x.stride(1) != 1:
            raise ValueError(f"gluon_fp8_bwd: {name} must be float32 ({H}, {T}), got {x.dtype} {tuple(x.shape)}")
    lo = (qc_lo, kc_lo, kt_lo)
    if any(x is None for x in lo) != all(x is None for x in lo) or (qc_lo is not None and any(
            x.dtype != y.dtype or x.shape != y.shape or x.stride() != y.stride() for x, y in zip(lo, (qc, kc, kt)))):
        raise ValueError("gluon_fp8_bwd: qc_lo, kc_lo, kt_lo come together, in qc's, kc's and kt's dtype, shape and "
                         "strides")
    if vc_lo is not None and (vc_lo.dtype != vc.dtype or vc_lo.shape != vc.shape or vc_lo.stride() != vc.stride()):
        raise ValueError("gluon_fp8_bwd: vc_lo must be in vc's dtype, shape and strides")
    dq_acc = torch.zeros((T, H, D), dtype=torch.float32, device=qc.device) if dq_acc is None else dq_acc
    dk = torch.empty((T, Hkv, D), dtype=torch.bfloat16, device=qc.device)
    dv = torch.empty((T, Hkv, D), dtype=torch.bfloat16, device=qc.device)
    if entries is None:
        entries = fp8_bwd_entries(cu_seqlens, T, causal=causal)
    ent, n_ent, max_entries = entries
    if not isinstance(deterministic, bool):
        raise ValueError(f"gluon_fp8_bwd: deterministic must be a bool, got {deterministic!r}")
    if cold_call is None:
        cold_call = fp8_masked_tile0(T, cu_seqlens.numel() - 1, COLD_CALL_MAX_MEAN)
    elif not isinstance(cold_call, bool):
        raise ValueError(f"gluon_fp8_bwd: cold_call must be a bool or None, got {cold_call!r}")
    if deterministic:
        sem, sem_base = _turn_counters(cu_seqlens, ent, T, H)
    else:
        sem, sem_base = n_ent, n_ent  # unread
    if T > 0 and max_entries > 0:
        q_d, k_d = fp8_descriptor(qc, BWD_BLOCK_M), fp8_descriptor(kc, BWD_BLOCK_N)
        kt_d = fp8_descriptor_t(kt, BWD_BLOCK_N)
        two = qc_lo is not None
        _fp8_bwd_kernel[(max_entries * Hkv,)](
            q_d, fp8_descriptor(dc, BWD_BLOCK_M), fp8_descriptor_t(qt, BWD_BLOCK_M),
            fp8_descriptor_t(dct, BWD_BLOCK_M), k_d, fp8_descriptor(vc, BWD_BLOCK_N), kt_d,
            descriptor(dq_acc, BWD_BLOCK_M), fp8_descriptor(qc_lo, BWD_BLOCK_M) if two else q_d,
            fp8_descriptor(kc_lo, BWD_BLOCK_N) if two else k_d, fp8_descriptor_t(kt_lo, BWD_BLOCK_N) if two else kt_d,
            fp8_descriptor(vc_lo if vc_lo is not None else vc, BWD_BLOCK_N), lse, delta, fq, fdo, fk, fv, dk, dv,
            ent, n_ent, max_entries, lse.stride(0), fq.stride(0), dk.stride(0), dv.stride(0),
            float(softmax_scale) * LOG2E, float(softmax_scale), sem, sem_base, H,
            GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=stages,
            CAUSAL=bool(causal), BOOST=BOOST_LOG2, DETERMINISTIC=deterministic, QK_LO=two, COLD_CALL=cold_call,
            V_LO=vc_lo is not None, num_warps=CONSUMER_WARPS.value,
            maxnreg=MAXNREG)
    from flamia_pack.kernels.flash_fwd import fill_tails

    fill_tails([(dk, 0.0, 0), (dv, 0.0, 0)], cu_seqlens)
    return (dq_acc.to(torch.bfloat16) if cast_dq else dq_acc), dk, dv
