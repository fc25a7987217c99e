"""dK / dV programs of the packed causal attention backward in Gluon, warp-specialized (sm_90).

FlashAttention-3's backward (Shah et al. 2024, appendix B) for ``flash_bwd``'s dK/dV programs: a
program owns ``BLOCK_N`` keys of one kv head (K, V loaded once) and walks the visible ``BLOCK_M``-query
steps (Q, dO, and the step's LSE / Delta rows staged by the producer warp in shared memory). Per step
the consumer (8 warps) runs ``S^T = K Q^T`` and ``dP^T = V dO^T`` as asynchronous wgmma products,
``P = 2^(S log2e scale - LSE log2e)`` and ``dS = P (dP - Delta)`` in registers, then ``dV += P^T dO``
and ``dK += dS^T Q`` left in flight while the next step's products are issued; the previous step's
dV / dK retire first, which keeps the kernel spill-free and its wgmma asynchronous. With ``dq_acc``
each step also computes its dQ partial ``dS K`` and adds it to an fp32 accumulator by a TMA bulk
reduce (FlashAttention-3's dQ path: no dQ programs; not bitwise reproducible). Shared pieces:
``gluon_common.py``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from flamia_pack.kernels.constants import LOG2E
from flamia_pack.kernels.gluon_common import (
    _wgmma_layout, _dq_part_layout, _tma_reduce_add, _handoff_store, _entry_counts, _claim_slot, _next_entry,
    _handoff_load, _zero_rows_from, _rows_through_smem, _release_after_reads, _store_rows, _item_span, _ring,
    descriptor, check_stages, check_inputs, CONSUMER_WARPS, MAXNREG)

__all__ = ["gluon_dkdv"]


@gluon.jit
def _dkdv_produce_entry(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar,
                        rs, o_hi, hk, n_steps, c, LSE, DELTA, stride_lh, ld_bufs, GROUP: gl.constexpr,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, LOOP: gl.constexpr):
    """One entry's loads: its K, V tiles (``kv_bar``), then its walked Q / dO tiles into the ring from
    ring position ``c`` (returned advanced). The query tile cut by the document end ``o_hi`` is loaded
    ending at ``o_hi`` (``_dkdv_step``: its rows of the previous tile are masked), so no row of the
    next document reaches the products (documents of >= BLOCK_M tokens: ``gluon_dkdv``'s skip_len).
    Each step's LSE and Delta rows (the same rows; 0 outside ``[0, o_hi)``) go to ``ld_bufs[s]`` and
    ``ld_bufs[STAGES + s]`` before the slot's ``ready`` arrive (ordered by the warp's barrier and the
    arrive's release semantics), so the consumer reads them from shared memory instead of waiting on
    global loads inside its step."""
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    ld_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [rs, hk * HEAD_DIM], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [rs, hk * HEAD_DIM], kv_bar, v_smem)
    if not LOOP:  # one entry per program: the ring starts at 0 (a literal, as the shipped kernel)
        c = 0
    for g in range(GROUP):
        col = (hk * GROUP + g) * HEAD_DIM
        lse_row = LSE + (hk * GROUP + g) * stride_lh
        delta_row = DELTA + (hk * GROUP + g) * stride_lh
        for j in range(n_steps):
            s = c % STAGES
            row = gl.minimum(rs + j * BLOCK_M, o_hi - BLOCK_M)
            ri = row + gl.arange(0, BLOCK_M, layout=ld_layout)
            ok = (ri < o_hi) & (ri >= 0)
            lse = gl.load(lse_row + ri, mask=ok, other=0.0)  # issued before the slot wait: latency hidden
            delta = gl.load(delta_row + ri, mask=ok, other=0.0)
            # a fresh mbarrier counts as having completed phase 1: the first lap does not wait
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            ld_bufs.index(s).store(lse)
            ld_bufs.index(STAGES + s).store(delta)
            gl.thread_barrier()  # every lane's stores before the (one-thread) release arrive below
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, col], ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(do_desc, [row, col], ready.index(s), do_bufs.index(s))
            c += 1
    return c


@gluon.jit
def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar,
                   rs, o_hi, hk, n_steps, LSE, DELTA, stride_lh, ld_bufs, GROUP: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    _dkdv_produce_entry(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar,
                        rs, o_hi, hk, n_steps, 0, LSE, DELTA, stride_lh, ld_bufs, GROUP, HEAD_DIM, BLOCK_M, False)


@gluon.jit
def _dkdv_producer_loop(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                        kv_ready, kv_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries,
                        skip_len, kv_head0, total, LSE, DELTA, stride_lh, ld_bufs, GROUP: gl.constexpr,
                        HEAD_DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WL_BM: gl.constexpr):
    """Persistent programs' producer (dynamic schedule, FlashAttention-3's tile scheduler): it takes
    the next entry of the head-major list from a global counter (skipping entries no Gluon program
    runs), hands its index and geometry to the consumer in ``t_smem[slot]`` (``_handoff_store``) and
    loads its K, V into slot ``n % KV_STAGES`` once the consumer released it, then its Q / dO tiles
    into the ring (which runs on across entries): the next entry's loads overlap the current entry's
    products. An index ``>=`` the entry count tells the consumer to stop."""
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])
    # only the list's valid rows are counted: entry t is row entry t % n_valid of kv head t // n_valid
    n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, WL_BM // BLOCK_N)
    c = 0
    n = 0
    t = gl.atomic_add(counter_ptr, 1)
    while t < n_total:
        t_next = gl.atomic_add(counter_ptr, 1)  # taken early: its latency hides under this entry's loads
        keep, hk, rs, re, o_hi, u0, u1, n_steps = _dkdv_geometry(items_ptr, num_items_ptr, cu_ptr, t, n_valid,
                                                                 skip_len, kv_head0, WL_BM, BLOCK_N, BLOCK_M)
        if keep:
            slot = _claim_slot(kv_empty, n)
            _handoff_store(t_smem.index(slot), idx_layout, t, hk, rs, re, o_hi, u0, u1, n_steps, 0, 0)
            c = _dkdv_produce_entry(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs.index(slot),
                                    v_bufs.index(slot), ready, empty, kv_ready.index(slot), rs, o_hi, hk, n_steps, c,
                                    LSE, DELTA, stride_lh, ld_bufs, GROUP, HEAD_DIM, BLOCK_M, True)
            n += 1
        t = t_next
    slot = _claim_slot(kv_empty, n)
    _handoff_store(t_smem.index(slot), idx_layout, n_total, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    mbarrier.arrive(kv_ready.index(slot), count=1)


@gluon.jit
def _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
               rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0,
               MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               s_layout: gl.constexpr, op_layout: gl.constexpr, DQ_REDUCE: gl.constexpr, dq_layout: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    s = c % STAGES
    q0 = rs + j * BLOCK_M
    if MASKED:  # the tile cut by the document end was loaded ending there (_dkdv_produce_entry)
        q0 = gl.minimum(q0, o_hi - BLOCK_M)
    q_pos = q0 + offs_m
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    # the previous tile's dV/dK products retire before this tile's are issued, so their register A
    # operands (P^T, dS^T) are dead when S^T / dP^T are allocated (without it ptxas serializes every
    # wgmma of the D = 128 kernel for lack of registers)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=c > 0)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st,))
    # this step's LSE / Delta rows, staged in ld_bufs[s] by the producer (_dkdv_produce_entry)
    lse = ld_bufs.index(s).load(gl.SliceLayout(0, s_layout))
    p = gl.exp2(st * qk_scale - (lse * 1.4426950408889634)[None, :])
    if MASKED:
        # (rows below rs + j * BLOCK_M: the previous step's, in a tile shifted to end at o_hi)
        vis = (k_pos[:, None] <= q_pos[None, :]) & (q_pos[None, :] < o_hi) & (q_pos[None, :] >= rs + j * BLOCK_M)
        p = gl.where(vis, p, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    delta = ld_bufs.index(STAGES + s).load(gl.SliceLayout(0, s_layout))
    ds = p * (dpt - delta[None, :])  # dP^T finite: the entry's V rows past its keys are zeroed
    ds_bf = ds.to(gl.bfloat16)
    if DQ_REDUCE:
        # dQ partial = dS K: dS^T goes through shared memory (both warpgroups read all 128 keys of
        # it), and so does P^T (registers for the dQ partial's accumulator instead of the A
        # operands); the previous step's readers retired before this step (retire-first)
        gl.thread_barrier()
        ds_smem.store(ds_bf)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        dqp = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma(p_smem, do_bufs.index(s), dv, is_async=True)
        dk = warpgroup_mma(ds_smem, q_bufs.index(s), dk, is_async=True)
        # the dQ partial retires first (groups retire in order) while dV / dK run; it is added to
        # the fp32 dQ accumulator by one TMA bulk reduce (FlashAttention-3's dQ path)
        dqp = warpgroup_mma_wait(2, deps=(dqp,))
        tma.store_wait(0)  # the issuing thread's previous reduce has read the staging tile
        gl.thread_barrier()
        dq_stage.store(dqp)
        fence_async_shared()
        gl.thread_barrier()
        _tma_reduce_add(dq_desc, [q0, (h - dq_h0) * HEAD_DIM], dq_stage)  # shifted rows' partial: 0
    else:
        dv = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), op_layout), do_bufs.index(s), dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_bf, op_layout), q_bufs.index(s), dk, is_async=True)
    return dk, dv


@gluon.jit
def _dkdv_consume_entry(q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar, kv_phase, kv_empty, DK, DV,
                        stride_dkt, stride_dvt, rs, re, o_hi, hk, n_steps, u0, u1, qk_scale, sm_scale,
                        ds_smem, p_smem, dq_stage, dq_desc, dq_h0, c, ld_bufs,
                        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, DQ_REDUCE: gl.constexpr,
                        RELEASE_KV: gl.constexpr):
    """One entry's products from ring position ``c`` (returned advanced) and its dK, dV stores; with
    ``RELEASE_KV`` the K, V slot is handed back (``kv_empty``) once its last products retired."""
    # the consumer's warps own the program's BLOCK_N keys, 16 rows per warp
    s_layout: gl.constexpr = _wgmma_layout(CONSUMER_WARPS, BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(CONSUMER_WARPS, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dq_layout: gl.constexpr = _dq_part_layout(CONSUMER_WARPS, BLOCK_M, HEAD_DIM)
    k0 = rs  # the key tile's first row; the walked query tiles start there too (causal)
    k_pos = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(kv_bar, kv_phase)
    if re < k0 + BLOCK_N:  # the key tile cut by the document end: the next document's rows to 0
        _zero_rows_from(v_smem, re - k0)  # dP^T = V dO^T (P = 0 there, but 0 x NaN = NaN in dS)
        if DQ_REDUCE:
            _zero_rows_from(k_smem, re - k0)  # the dQ partial dS K reads every key row
    if not RELEASE_KV:  # one entry per program: the ring starts at 0 (a literal, as the shipped kernel)
        c = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        for j in range(0, u0):
            dk, dv = _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
                                rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0, True,
                                BLOCK_M, BLOCK_N, s_layout, op_layout, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
        for j in range(u0, u1):
            dk, dv = _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
                                rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0, False,
                                BLOCK_M, BLOCK_N, s_layout, op_layout, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
        for j in range(u1, n_steps):
            dk, dv = _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
                                rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0, True,
                                BLOCK_M, BLOCK_N, s_layout, op_layout, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    if DQ_REDUCE:
        tma.store_wait(0)  # the last reduce has read its staging tile before the program exits
    if DQ_REDUCE and RELEASE_KV:
        # persistent programs with the dQ reduce keep the direct stores: staged, ptxas spills 48 B into
        # their step loop (8 B direct)
        mbarrier.arrive(kv_empty, count=1)  # K, V read by every product: the next entry's may load
        rows = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        ok = (rows < re)[:, None]
        r64 = rows.to(gl.int64)[:, None]
        gl.store(DK + r64 * stride_dkt + hk * HEAD_DIM + cols[None, :], (dk * sm_scale).to(gl.bfloat16), mask=ok)
        gl.store(DV + r64 * stride_dvt + hk * HEAD_DIM + cols[None, :], dv.to(gl.bfloat16), mask=ok)
    else:
        # dK, dV through the entry's own K, V tiles (every product that read them retired): 16-byte
        # stores, one at a time (fewer registers live)
        _store_rows(DK, _rows_through_smem(k_smem, (dk * sm_scale).to(gl.bfloat16), CONSUMER_WARPS), k0, re,
                    stride_dkt, hk * HEAD_DIM)
        dv_out = _rows_through_smem(v_smem, dv.to(gl.bfloat16), CONSUMER_WARPS)
        if RELEASE_KV:
            _release_after_reads(kv_empty)  # the next entry's K, V may load
        _store_rows(DV, dv_out, k0, re, stride_dvt, hk * HEAD_DIM)
    return c


@gluon.jit
def _dkdv_consumer(q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar, DK, DV,
                   stride_dkt, stride_dvt, rs, re, o_hi, hk, n_steps, u0, u1, qk_scale, sm_scale,
                   ds_smem, p_smem, dq_stage, dq_desc, dq_h0, ld_bufs,
                   GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, DQ_REDUCE: gl.constexpr):
    _dkdv_consume_entry(q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar, 0, kv_bar, DK, DV,
                        stride_dkt, stride_dvt, rs, re, o_hi, hk, n_steps, u0, u1, qk_scale, sm_scale,
                        ds_smem, p_smem, dq_stage, dq_desc, dq_h0, 0, ld_bufs,
                        GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, DQ_REDUCE, False)


@gluon.jit
def _dkdv_consumer_loop(q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, t_smem, DK, DV,
                        stride_dkt, stride_dvt, qk_scale, sm_scale, ds_smem, p_smem, dq_stage, dq_desc,
                        num_items_ptr, max_entries, kv_head0, total, ld_bufs,
                        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, DQ_REDUCE: gl.constexpr):
    """Persistent programs' consumer: the entries the producer hands over (``_dkdv_producer_loop``)."""
    KV_STAGES: gl.constexpr = k_bufs.type.shape[0]
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [CONSUMER_WARPS], [0])  # each thread: the whole slot
    _n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, WL_BM // BLOCK_N)
    c = 0
    n = 0
    t = _next_entry(kv_ready, t_smem, n, idx_layout)
    while t < n_total:
        slot = n % KV_STAGES
        # the slot stays this entry's until its K / V are released: read the geometry here, so only t
        # is carried around the loop (carrying all nine spilled 464 B)
        t, hk, rs, re, o_hi, u0, u1, n_steps, _unused, _unused2 = _handoff_load(t_smem.index(slot), idx_layout)
        c = _dkdv_consume_entry(q_bufs, do_bufs, k_bufs.index(slot), v_bufs.index(slot), ready, empty,
                                kv_ready.index(slot), (n // KV_STAGES) & 1, kv_empty.index(slot),
                                DK, DV, stride_dkt, stride_dvt, rs, re, o_hi, hk,
                                n_steps, u0, u1, qk_scale, sm_scale, ds_smem, p_smem, dq_stage, dq_desc,
                                kv_head0 * GROUP, c, ld_bufs, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, DQ_REDUCE, True)
        n += 1
        t = _next_entry(kv_ready, t_smem, n, idx_layout)


@gluon.jit
def _dkdv_rows(qs, ds, de, e, WL_BM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Geometry of the dK/dV program of entry ``e`` of a kept item (``_item_span``;
    ``tiles_triton.program_geometry``, rows are keys, causal, non-merged item): its key rows
    ``[rs, re)`` (empty: nothing to run), the document end ``o_hi`` and the walked query steps (the
    first ``u0`` and the steps from ``u1`` masked)."""
    F: gl.constexpr = WL_BM // BLOCK_N
    i = (qs - ds) // WL_BM
    nt = (de - ds + WL_BM - 1) // WL_BM
    mb = ds + (nt - 1 - i) * WL_BM
    end = gl.minimum(mb + WL_BM, de)
    rs = mb + (e % F) * BLOCK_N
    re = gl.minimum(rs + BLOCK_N, end)
    o_hi = de
    u0 = (re - 1 - rs + BLOCK_M - 1) // BLOCK_M
    u1 = gl.maximum(u0, (o_hi - rs) // BLOCK_M)
    n_steps = (o_hi - rs + BLOCK_M - 1) // BLOCK_M
    return rs, re, o_hi, u0, u1, n_steps


@gluon.jit
def _dkdv_span(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, kv_head0,
               WL_BM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Entry ``t`` of the dK/dV programs' head-major list (list entry ``e = t % per_head`` of kv head
    ``hk = kv_head0 + t // per_head``): ``(e, hk)`` and its ``_item_span``."""
    e = t % per_head
    hk = kv_head0 + t // per_head
    qs, qe, ds, de, keep = _item_span(items_ptr, num_items_ptr, cu_ptr, e, WL_BM // BLOCK_N, skip_len)
    return e, hk, qs, ds, de, keep


@gluon.jit
def _dkdv_geometry(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, kv_head0,
                   WL_BM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Entry ``t`` of the head-major list (``_dkdv_span``): whether a Gluon program runs it, its kv
    head and ``_dkdv_rows``."""
    e, hk, qs, ds, de, keep = _dkdv_span(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, kv_head0,
                                         WL_BM, BLOCK_N)
    rs, re, o_hi, u0, u1, n_steps = _dkdv_rows(qs, ds, de, e, WL_BM, BLOCK_N, BLOCK_M)
    return keep & (rs < re), hk, rs, re, o_hi, u0, u1, n_steps


@gluon.jit
def _dkdv_kernel(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len,
                 stride_lh, stride_dkt, stride_dvt, qk_scale, sm_scale, dq_desc, kv_head0, total, counter_ptr,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 WL_BM: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 DQ_REDUCE: gl.constexpr = False,
                 PERSISTENT: gl.constexpr = False):
    # head-major: all entries of kv head kv_head0 in the list's decreasing-cost order, then the next, ...
    # (one program per entry; PERSISTENT: one program per SM taking entries from a global counter)
    if not PERSISTENT:
        e, hk, qs, ds, de, keep = _dkdv_span(items_ptr, num_items_ptr, cu_ptr, gl.program_id(0), max_entries,
                                             skip_len, kv_head0, WL_BM, BLOCK_N)
        if not keep:
            return
        rs, re, o_hi, u0, u1, n_steps = _dkdv_rows(qs, ds, de, e, WL_BM, BLOCK_N, BLOCK_M)
        if rs >= re:
            return
    # persistent programs double-buffer K, V (the next entry's load while this one computes) when
    # shared memory allows: not next to the dQ reduce's staging tiles
    KV_STAGES: gl.constexpr = 2 if PERSISTENT and not DQ_REDUCE else 1
    q_bufs, do_bufs, ready, empty = _ring(q_desc, do_desc, STAGES, BLOCK_M, HEAD_DIM)
    k_bufs, v_bufs, kv_ready, kv_empty = _ring(k_desc, v_desc, KV_STAGES, BLOCK_N, HEAD_DIM, PERSISTENT)
    # ring slot s's query-step LSE rows in row s, its Delta rows in row STAGES + s (fp32; the producer's)
    ld_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if PERSISTENT:  # the entry index handed from the producer to the consumer, one per K/V slot
        t_smem = gl.allocate_shared_memory(gl.int32, [KV_STAGES, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if DQ_REDUCE:
        ds_smem = gl.allocate_shared_memory(
            gl.bfloat16, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(
            gl.bfloat16, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16))
        dq_stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_desc.layout)
    else:
        ds_smem = k_bufs  # unused
        p_smem = k_bufs
        dq_stage = k_bufs
    # one consumer of 8 warps (two warpgroups side by side on the 128 keys) and the producer warp
    if PERSISTENT:
        gl.warp_specialize([
            (_dkdv_consumer_loop, (q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, t_smem,
                                   DK, DV,
                                   stride_dkt, stride_dvt, qk_scale, sm_scale, ds_smem, p_smem, dq_stage,
                                   dq_desc, num_items_ptr, max_entries, kv_head0, total, ld_bufs,
                                   GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, DQ_REDUCE)),
            (_dkdv_producer_loop, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                                   kv_ready, kv_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                   max_entries, skip_len, kv_head0, total, LSE, DELTA, stride_lh, ld_bufs,
                                   GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM)),
        ], [1], [24])
    else:
        k_smem = k_bufs.index(0)
        v_smem = v_bufs.index(0)
        kv_bar = kv_ready.index(0)
        gl.warp_specialize([
            (_dkdv_consumer, (q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar, DK, DV,
                              stride_dkt, stride_dvt, rs, re, o_hi, hk, n_steps, u0, u1, qk_scale, sm_scale,
                              ds_smem, p_smem, dq_stage, dq_desc, kv_head0 * GROUP, ld_bufs,
                              GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, DQ_REDUCE)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar,
                              rs, o_hi, hk, n_steps, LSE, DELTA, stride_lh, ld_bufs, GROUP, HEAD_DIM, BLOCK_M)),
        ], [1], [24])


def gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
               softmax_scale: float, *, block_m: int = 64, block_n: int = 128, wl_block_m: int = 128,
               stages: int = 2, skip_len: int = 0,
               dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
               dq_acc: torch.Tensor | None = None, kv_head0: int = 0,
               kv_heads: int | None = None, persistent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of causal packed attention (the dK/dV programs of ``flash_bwd``), warp-specialized Gluon.

    Args:
        q, do: ``(T, H_q, D)`` bf16 contiguous; k, v: ``(T, H_kv, D)`` bf16 contiguous; D in {64, 128}.
        lse: ``(H_q, T)`` float32 natural-log LSE of the forward; delta: ``(H_q, T)`` float32
            ``rowsum(dO * O)`` (``flash_bwd._bwd_preprocess``).
        cu_seqlens, items, num_items: as ``flash_bwd`` (a list built with ``block_m=wl_block_m``,
            causal); merged items and documents of at most ``skip_len`` tokens are skipped.
            A NaN / Inf in another document's rows stays out of a document's dK, dV and dQ partial
            (the query step cut by the document end is loaded ending there, the key tile's rows past
            it are zeroed in shared memory) when documents have at least ``block_m`` tokens
            (``skip_len >= block_m - 1``; ``flash_bwd`` passes 512); shorter documents' query step
            also covers the previous document's rows (masked, but ``0 x NaN`` is NaN).
        softmax_scale: the forward's scale.
        block_m, block_n, stages: query step, key tile, ring depth.
        dk, dv: optional preallocated outputs.
        dq_acc: optional ``(T, Hc, D)`` float32 contiguous accumulator (zeroed by the caller; ``Hc >=
            kv_heads * H_q / H_kv``): each step also computes its dQ partial ``dS K`` (a fifth
            product, dS^T through shared memory) and adds it to ``dq_acc[:, h - kv_head0 * H_q / H_kv]``
            by a TMA bulk reduce (FlashAttention-3's dQ path). ``dq_acc`` then
            holds ``dQ / softmax_scale`` of the chunk's query heads for the rows this kernel owns, so
            the dQ programs are not needed; the summation order of the reduces varies run to run
            (not bitwise reproducible). Config ``GluonBwdConfig.dq_reduce``.
        kv_head0, kv_heads: run only kv heads ``[kv_head0, kv_head0 + kv_heads)`` (default all: a
            caller bounding the accumulator's memory runs the heads in chunks,
            ``GluonBwdConfig.dq_reduce_max_bytes``).
        persistent: one program per SM taking entries of the same head-major list from a global
            counter (greedy, like the hardware's dispatch of one-entry programs); its producer loads
            the next entry's K, V (a second slot, without ``dq_acc``) and first Q / dO tiles while the
            current entry computes, hiding the per-program prologue / epilogue that dominates short
            documents (config ``GluonBwdConfig.persistent``; 0.93-1.00x on long rows, so off there).

    Returns:
        ``(dk, dv)`` ``(T, H_kv, D)`` bf16; rows past ``cu_seqlens[-1]`` are left uninitialised.

    Raises:
        ValueError: an input not a contiguous bf16 CUDA tensor, shapes that disagree (T, head_dim,
            ``H_q % H_kv``), a head_dim other than 64 / 128, block sizes that do not tile, a ring of
            fewer than 2 ``stages`` (it would hang), a kv head
            range outside ``[0, H_kv)``, or a ``dq_acc`` too small for the range's query heads.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    check_stages("gluon_dkdv", stages)
    check_inputs("gluon_dkdv", q, k, v, do)
    if wl_block_m % block_n or block_n % block_m:
        raise ValueError(f"gluon_dkdv: need block_n | wl_block_m and block_m | block_n, got {block_m}, {block_n}, {wl_block_m}")
    kv_heads = Hkv - kv_head0 if kv_heads is None else kv_heads
    if not (0 <= kv_head0 and 1 <= kv_heads and kv_head0 + kv_heads <= Hkv):
        raise ValueError(f"gluon_dkdv: kv heads [{kv_head0}, {kv_head0} + {kv_heads}) must lie in [0, H_kv={Hkv})")
    if dq_acc is not None:
        hc = kv_heads * (H // Hkv)
        if dq_acc.dim() != 3 or dq_acc.shape[0] != T or dq_acc.shape[2] != D or dq_acc.shape[1] < hc \
                or dq_acc.dtype != torch.float32 or not dq_acc.is_contiguous() or dq_acc.device != q.device:
            raise ValueError(f"gluon_dkdv: dq_acc must be a contiguous float32 (T={T}, >= {hc}, D={D}) tensor "
                             f"on {q.device} (the query heads of kv heads [{kv_head0}, {kv_head0 + kv_heads})), "
                             f"got {dq_acc.dtype} {tuple(dq_acc.shape)} on {dq_acc.device}")
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    max_entries = items.shape[0] * (wl_block_m // block_n)
    if T == 0 or max_entries == 0:
        return dk, dv
    total = max_entries * kv_heads
    grid = min(total, torch.cuda.get_device_properties(q.device).multi_processor_count) if persistent else total
    _dkdv_kernel[(grid,)](
        descriptor(q, block_m), descriptor(do, block_m), descriptor(k, block_n), descriptor(v, block_n),
        lse, delta, dk, dv, items, num_items, cu_seqlens, max_entries, int(skip_len),
        lse.stride(0), dk.stride(0), dv.stride(0), float(softmax_scale) * LOG2E, float(softmax_scale),
        descriptor(dq_acc if dq_acc is not None else q, block_m), int(kv_head0), total,
        torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else num_items,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, WL_BM=wl_block_m, STAGES=stages,
        BLOCK_N=block_n, DQ_REDUCE=dq_acc is not None,
        PERSISTENT=bool(persistent), num_warps=CONSUMER_WARPS.value, maxnreg=MAXNREG)
    return dk, dv
