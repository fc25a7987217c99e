"""Packed attention in Gluon, warp-specialized (Hopper, sm_90): the backward's dK/dV and dQ programs
and an experimental forward.

FlashAttention-3's backward structure (Shah et al. 2024, §3 and the backward algorithm of its
appendix) for the two program kinds of ``flash_bwd`` (same work list, same tile decisions, same
products in the same fp32 accumulation; deterministic unless the dK/dV programs also reduce dQ,
``dq_acc`` below, which is the default for ``deterministic=False``):

- a **producer** partition (one warp, 24 registers) issues TMA loads: the program's own tiles once
  (K, V for dK/dV; Q, dO for dQ), then the walked tiles into a ``STAGES``-deep shared-memory ring,
  each slot guarded by a ``ready`` / ``empty`` mbarrier pair; for dK/dV it also stages each step's
  LSE and Delta rows in shared memory (plain loads issued before it waits for the slot, stored
  before the slot's ``ready`` arrive), so the consumer reads them with shared-memory latency instead
  of waiting on global loads inside its step (2026-11-29 night: training call 1.07-1.12x on W1, W3,
  W5, W8, and the dQ-reduce kernel spill-free, 76 B before);
- the **consumer** (8 warps, two warpgroups, 240 registers each via ``setmaxnreg``) runs per walked
  tile two asynchronous wgmma products (``S^T = K Q^T``, ``dP^T = V dO^T`` for dK/dV; ``S = Q K^T``,
  ``dP = dO V^T`` for dQ), the softmax recomputation ``P = 2^(S log2e scale - LSE log2e)`` and
  ``dS = P (dP - Delta)`` in registers, then ``dV += P^T dO``, ``dK += dS^T Q`` (or ``dQ += dS K``)
  with P / dS as register A operands, left in flight while the next tile's products are issued;
  a slot goes back to the producer once the products that read it have retired.

Tiles: dK/dV programs own 128 keys and walk 64-query steps; dQ programs own 128 queries and walk
64-key tiles (H200, 2026-11-29: dK/dV 1.01-1.11x and dQ 1.02-1.07x the Triton programs; splitting
the consumer into two single-warpgroup partitions measured 0.97-1.05x and 0.79-0.84x; 32-query
dK/dV steps 0.90-1.02x). Masks only on the causal-diagonal tiles and the tile cut by the document
end, as in ``tiles.py``.

Scope: causal; non-merged items of documents longer than ``skip_len`` tokens (``flash_bwd`` runs
merged items and shorter documents in a Triton launch with ``sel = -skip_len``); contiguous bf16
q/k/v/dO with ``head_dim`` 64 or 128; the padding rows are filled by ``flash_bwd``.

Forward (``gluon_fwd``, config ``fwd_gluon``; persistent, the head_dim 128 default): the dQ programs' structure applied to
FlashAttention's forward -- the same producer (Q once, K / V through the ring, K and V with their own
barriers) and, by default, **two 4-warp consumer partitions** of 64 query rows each (``parts=2``,
FlashAttention-3's two consumer warpgroups) running ``S = Q K^T``, the base-2 online softmax and
``O += P V`` (P as the register A operand) over 128-key tiles, software-pipelined (``S_j`` and
``P_{j-1} V_{j-1}`` in flight together), causal or not; merged items and 1-token documents stay in
``flash_fwd``'s Triton kernel. Spill-free on sm_90a. Persistent (one program per SM, entries from a
global counter, two Q slots): 1.02-1.06x the Triton forward on W1, W2, W4, W6, W8, W9 and 1.10x on W3
with one 8-warp consumer (H200, 2026-11-29 late); the two partitions then 1.14x / 1.17x / 1.07x that
on W1 / W8 / W3 (2026-11-29 night: a Gluon ``mbarrier.arrive`` is one thread's arrive after a
``bar.sync`` of its whole partition, so one 8-warp consumer met at a 256-thread barrier at every
slot release; the software pipelining alone measured 1.00x). benchmarks/RESULTS.md.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from flamia_pack.kernels.flash_fwd import LOG2E

__all__ = ["gluon_dkdv", "gluon_dq", "gluon_fwd"]




CONSUMER_WARPS = gl.constexpr(8)
"""Warps of every kernel's consumer (two warpgroups): one partition of 8 warps (the kernels' ``num_warps``),
or, in the forward with ``parts=2``, two partitions of 4 (``num_warps`` 4)."""
MAXNREG = (65536 // (12 * 32)) // 8 * 8
"""Launch register cap (168): three warpgroups -- the consumer's two and the producer's warp, registers
being allocated per warpgroup -- share the SM's 64 K; the consumer then raises itself to 240 with
``setmaxnreg`` on what the 24-register producer leaves."""


@constexpr_function
def _wgmma_layout(num_warps, n):
    """Accumulator layout of a wgmma product with ``n`` columns, the warps stacked along its rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@constexpr_function
def _dq_part_layout(num_warps, m, n):
    """Accumulator layout of the ``m x n`` dQ partial of a dK/dV step (``m`` = 64 queries): one
    warpgroup per 64-row block, the remaining warpgroups side by side along the ``n`` columns."""
    along_m = max(1, min(num_warps // 4, m // 64))
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * along_m, num_warps // (4 * along_m)],
                                     instr_shape=[16, n // (num_warps // (4 * along_m)), 16])


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce (``cp.reduce.async.bulk.tensor ... .add``): global[box at ``coord``] += the shared
    tile ``src``; completion tracked like a TMA store (``tma.store_wait``). triton 3.6's Gluon builds
    the op (``GluonOpBuilder.create_async_tma_reduce``) but exposes no Python wrapper for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _handoff_store(slot_smem, layout: gl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
    """A persistent producer's hand-over of one entry to its consumer: ten int32 scalars (the entry
    index and its geometry, so the consumer does no dependent global loads) into a 16-int slot."""
    i = gl.arange(0, 16, layout=layout)
    v = (gl.where(i == 0, a0, 0) + gl.where(i == 1, a1, 0) + gl.where(i == 2, a2, 0) + gl.where(i == 3, a3, 0)
         + gl.where(i == 4, a4, 0) + gl.where(i == 5, a5, 0) + gl.where(i == 6, a6, 0) + gl.where(i == 7, a7, 0)
         + gl.where(i == 8, a8, 0) + gl.where(i == 9, a9, 0))
    slot_smem.store(v)


@gluon.jit
def _entry_counts(num_items_ptr, max_entries, total, PER_ITEM: gl.constexpr):
    """A persistent launch's entry counts: valid list entries per head (``num_items * PER_ITEM``,
    never past the list's capacity ``max_entries``) and over all ``total // max_entries`` heads."""
    n_valid = gl.minimum(gl.load(num_items_ptr) * PER_ITEM, max_entries)
    return n_valid, (total // max_entries) * n_valid


@gluon.jit
def _claim_slot(empty_bars, n):
    """Producer side: the hand-over slot of its ``n``-th kept entry, once the consumer released it (a
    fresh mbarrier counts as having completed phase 1: the first lap does not wait)."""
    STAGES: gl.constexpr = empty_bars.type.shape[0]
    slot = n % STAGES
    mbarrier.wait(empty_bars.index(slot), ((n // STAGES) & 1) ^ 1)
    return slot


@gluon.jit
def _next_entry(ready_bars, t_smem, n, layout: gl.constexpr):
    """Consumer side: wait for the ``n``-th hand-over and return its entry index (``>=`` the entry
    count: the producer's stop signal)."""
    STAGES: gl.constexpr = ready_bars.type.shape[0]
    slot = n % STAGES
    mbarrier.wait(ready_bars.index(slot), (n // STAGES) & 1)
    return _handoff_first(t_smem.index(slot), layout)


@gluon.jit
def _handoff_first(slot_smem, layout: gl.constexpr):
    """The entry index of a hand-over slot (``>=`` the entry count: the producer's stop signal)."""
    v = slot_smem.load(layout)
    return gl.sum(gl.where(gl.arange(0, 16, layout=layout) == 0, v, 0), 0)


@gluon.jit
def _handoff_load(slot_smem, layout: gl.constexpr):
    """The ten scalars of ``_handoff_store`` (after the slot's barrier)."""
    v = slot_smem.load(layout)
    i = gl.arange(0, 16, layout=layout)
    return (gl.sum(gl.where(i == 0, v, 0), 0), gl.sum(gl.where(i == 1, v, 0), 0), gl.sum(gl.where(i == 2, v, 0), 0),
            gl.sum(gl.where(i == 3, v, 0), 0), gl.sum(gl.where(i == 4, v, 0), 0), gl.sum(gl.where(i == 5, v, 0), 0),
            gl.sum(gl.where(i == 6, v, 0), 0), gl.sum(gl.where(i == 7, v, 0), 0), gl.sum(gl.where(i == 8, v, 0), 0),
            gl.sum(gl.where(i == 9, v, 0), 0))


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
def _zero_rows_from(buf, keep, NW: gl.constexpr = 8):
    """Rows ``>= keep`` of the consumer's shared tile ``buf`` (``ROWS x HEAD_DIM``, landed by TMA) set to 0.

    TMA boxes are cut at the tensor's end, not at a document's: the tile cut by a document end holds
    the next document's rows. Masking their scores (P = 0) is not enough, ``0 x NaN = NaN`` in the
    products that read them (P V, dS K, dS^T Q, P^T dO), so a NaN / Inf there would leak across the
    document boundary (Triton's masked loads read zeros). Only the one tile per program that crosses
    the document end pays this (one shared-memory round trip); callers test the runtime condition.
    ``NW``: warps of the calling partition. Two consumer partitions reading the same tile (the
    forward's ``parts=2``) each zero it before their own product (two round trips), each fenced and
    synchronised only within its partition: one partition's stores may land while the other's
    wgmma reads the tile, a formal generic/async-proxy race that is benign because every store is
    bit-exact -- 0 for rows past ``keep`` (which the other partition writes too) or the value TMA
    loaded there. The producer cannot reuse the slot before both partitions released it."""
    ROWS: gl.constexpr = buf.type.shape[0]
    CHUNK: gl.constexpr = 8  # 8-row slices: 2 registers a thread, not 16-32 (the dK/dV consumer spills)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
    for i in gl.static_range(ROWS // CHUNK):
        part = buf.slice(i * CHUNK, CHUNK, dim=0)
        x = part.load(layout)
        r = i * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        part.store(gl.where((r < keep)[:, None], x, gl.zeros_like(x)))
    fence_async_shared()  # generic-proxy writes before the async proxy (wgmma) reads them
    gl.thread_barrier()  # the partition's rows written before any of its warpgroups issues its product


@gluon.jit
def _rows_through_smem(buf, x, NW: gl.constexpr):
    """``x`` (bf16 registers in a wgmma accumulator layout) in a row-contiguous layout: 16 bytes a
    thread, 8 threads a 128-column row. Goes through ``buf`` (``x``'s shape, in shared memory, every
    product that read it retired; the calling partition's ``NW`` warps only).

    Why: stores straight from the wgmma layout write 4 bytes a thread, 8 rows x 16 bytes a warp, so
    every 32-byte sector is written in two halves -- twice the L2 write requests (ncu, W7 forward
    2026-11-30: 8.4 M excessive sectors, the ``STG`` the top stall at 12% of the samples; RESULTS.md
    "Session of 2026-11-30 (third)"). A TMA store instead would make the slot wait for the TMA
    engine's read before it is released (long rows 0.95x, ``next/fwd-tma-epilogue``)."""
    COLS: gl.constexpr = buf.type.shape[1]
    buf.store(x)
    gl.thread_barrier()  # the partition's rows written before its warps read other warps' rows
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [NW, 1], [1, 0])
    return buf.load(layout)


@gluon.jit
def _release_after_reads(bar):
    """Hand the slot behind ``bar`` back once every warp of the partition has read it (one thread's arrive)."""
    gl.thread_barrier()  # every warp's reads done before the one-thread arrive
    fence_async_shared()  # generic-proxy reads ordered before the next TMA write of the slot
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _store_rows(ptr, x, row0, row_end, stride_row, col0):
    """``ptr[row0 + r, col0 + c] = x[r, c]`` for rows ``row0 + r < row_end`` (x in the layout of
    :func:`_rows_through_smem`)."""
    ROWS: gl.constexpr = x.type.shape[0]
    COLS: gl.constexpr = x.type.shape[1]
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, x.type.layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, x.type.layout))
    gl.store(ptr + rows.to(gl.int64)[:, None] * stride_row + col0 + cols[None, :], x, mask=(rows < row_end)[:, None])


@gluon.jit
def _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
               rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0,
               MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               s_layout: gl.constexpr, op_layout: gl.constexpr, RETIRE_FIRST: gl.constexpr,
               DQ_REDUCE: gl.constexpr, dq_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    s = c % STAGES
    q0 = rs + j * BLOCK_M
    if MASKED:  # the tile cut by the document end was loaded ending there (_dkdv_produce_entry)
        q0 = gl.minimum(q0, o_hi - BLOCK_M)
    q_pos = q0 + offs_m
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    if RETIRE_FIRST:
        # the previous tile's dV/dK products retire before this tile's are issued, so their
        # register A operands (P^T, dS^T) are dead when S^T / dP^T are allocated
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=c > 0)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    # groups retire in order: at most dP^T in flight means the previous tile's dV/dK are done
    st = warpgroup_mma_wait(1, deps=(st,))
    if not RETIRE_FIRST:
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=c > 0)
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
                        BLOCK_N: gl.constexpr, RETIRE_FIRST: gl.constexpr, DQ_REDUCE: gl.constexpr,
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
                                BLOCK_M, BLOCK_N, s_layout, op_layout, RETIRE_FIRST, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
        for j in range(u0, u1):
            dk, dv = _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
                                rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0, False,
                                BLOCK_M, BLOCK_N, s_layout, op_layout, RETIRE_FIRST, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
        for j in range(u1, n_steps):
            dk, dv = _dkdv_step(q_bufs, do_bufs, k_smem, v_smem, ready, empty, ld_bufs, h,
                                rs, o_hi, k_pos, offs_m, j, c, dk, dv, qk_scale, ds_smem, p_smem, dq_stage, dq_desc, dq_h0, True,
                                BLOCK_M, BLOCK_N, s_layout, op_layout, RETIRE_FIRST, DQ_REDUCE, dq_layout, HEAD_DIM)
            c += 1
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    if DQ_REDUCE:
        tma.store_wait(0)  # the last reduce has read its staging tile before the program exits
    if DQ_REDUCE and RELEASE_KV:
        # the persistent dQ-reduce programs (a candidate) keep the direct stores: staged, ptxas spills
        # 48 B into their step loop (CPU screen, 2026-11-30; 8 B before)
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
                   BLOCK_N: gl.constexpr, RETIRE_FIRST: gl.constexpr, DQ_REDUCE: gl.constexpr):
    _dkdv_consume_entry(q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar, 0, kv_bar, DK, DV,
                        stride_dkt, stride_dvt, rs, re, o_hi, hk, n_steps, u0, u1, qk_scale, sm_scale,
                        ds_smem, p_smem, dq_stage, dq_desc, dq_h0, 0, ld_bufs,
                        GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, RETIRE_FIRST, DQ_REDUCE, False)


@gluon.jit
def _dkdv_consumer_loop(q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, kv_ready, kv_empty, t_smem, DK, DV,
                        stride_dkt, stride_dvt, qk_scale, sm_scale, ds_smem, p_smem, dq_stage, dq_desc,
                        num_items_ptr, max_entries, kv_head0, total, ld_bufs,
                        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, RETIRE_FIRST: gl.constexpr,
                        DQ_REDUCE: gl.constexpr):
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
                                kv_head0 * GROUP, c, ld_bufs, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, RETIRE_FIRST,
                                DQ_REDUCE, True)
        n += 1
        t = _next_entry(kv_ready, t_smem, n, idx_layout)


@gluon.jit
def _item_span(items_ptr, num_items_ptr, cu_ptr, e, F: gl.constexpr, skip_len):
    """Entry ``e`` (item ``e // F``): its query range ``[qs, qe)``, its document ``[ds, de)`` and
    whether a Gluon program runs it (a valid row, not merged (qe > de), document longer than
    ``skip_len``; the rest run in flash_bwd's Triton launch). Rows past the valid ones read row 0."""
    valid = e < gl.load(num_items_ptr) * F
    it = gl.where(valid, e // F, 0)
    doc = gl.load(items_ptr + it * 4)
    qs = gl.load(items_ptr + it * 4 + 1)
    qe = gl.load(items_ptr + it * 4 + 2)
    ds = gl.load(cu_ptr + doc)
    de = gl.load(cu_ptr + doc + 1)
    return qs, qe, ds, de, valid & (qe <= de) & (de - ds > skip_len)


@gluon.jit
def _query_rows(qs, qe, ds, de, e, F: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr):
    """Geometry of a program owning query rows (dQ, forward) of entry ``e`` of a non-merged item
    (``_item_span``): its rows ``[rs, re)`` and the walked keys ``[o_lo, o_hi)`` in ``n_steps`` tiles,
    the first ``u1`` mask-free (tiles_triton.program_geometry, rows are queries)."""
    rs = qs + (e % F) * BLOCK_M
    re = gl.minimum(rs + BLOCK_M, qe)
    o_lo = ds
    if CAUSAL:
        o_hi = re
        u1 = gl.maximum(rs - o_lo + 1, 0) // BLOCK_N
    else:
        o_hi = de
        u1 = (o_hi - o_lo) // BLOCK_N
    n_steps = (o_hi - o_lo + BLOCK_N - 1) // BLOCK_N
    return rs, re, o_lo, o_hi, u1, n_steps


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
          INIT_EMPTY: gl.constexpr = True, SPLIT_KV: gl.constexpr = False, EMPTY_COUNT: gl.constexpr = 1):
    """The walked tiles' shared-memory ring: ``STAGES`` slots of one ``a_desc`` and one ``b_desc`` tile
    (``ROWS x HEAD_DIM`` bf16 each: Q / dO for dK/dV programs, K / V for dQ and forward programs) and
    each slot's ``ready`` (producer's TMA bytes) / ``empty`` (consumer's release) mbarrier (the
    ``empty`` ones initialised only with ``INIT_EMPTY``: a dK/dV program's own K / V slot is
    released only by persistent programs). With ``SPLIT_KV`` there are ``2 * STAGES`` pairs: ``s`` for
    the ``a`` tile of slot ``s``, ``STAGES + s`` for its ``b`` tile (the forward's K and V).
    ``EMPTY_COUNT``: consumer partitions that release each slot."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, HEAD_DIM], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, HEAD_DIM], b_desc.layout)
    if SPLIT_KV:
        ready, empty = _slot_barriers(2 * STAGES, INIT_EMPTY, EMPTY_COUNT)
    else:
        ready, empty = _slot_barriers(STAGES, INIT_EMPTY, EMPTY_COUNT)
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def _slot_barriers(STAGES: gl.constexpr, INIT_EMPTY: gl.constexpr = True, EMPTY_COUNT: gl.constexpr = 1):
    """One ``ready`` / ``empty`` mbarrier pair per slot (``ready`` count 1; ``empty`` count
    ``EMPTY_COUNT``, one arrive per consumer partition, initialised only with ``INIT_EMPTY``)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        if INIT_EMPTY:
            mbarrier.init(empty.index(s), count=EMPTY_COUNT)
    return ready, empty


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
                 RETIRE_FIRST: gl.constexpr = False, DQ_REDUCE: gl.constexpr = False,
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
                                   GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, RETIRE_FIRST, DQ_REDUCE)),
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
                              GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, RETIRE_FIRST, DQ_REDUCE)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, ready, empty, kv_bar,
                              rs, o_hi, hk, n_steps, LSE, DELTA, stride_lh, ld_bufs, GROUP, HEAD_DIM, BLOCK_M)),
        ], [1], [24])


# ----------------------------------------------------------------------------------------------
# dQ programs: own BLOCK_M queries of one query head, walk the visible key tiles (K and V through
# the ring), dQ += dS K with dS as the register A operand.

@gluon.jit
def _rows_produce_entry(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar,
                        rs, o_lo, h, hk, n_steps, c, j0, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                        HAS_DO: gl.constexpr):
    """One entry's loads for programs that own query rows (dQ, forward): its Q (and dO) tile once
    (``qo_bar``), then its K / V tiles ``j0, ..., n_steps - 1`` into the ring at positions ``c + j``
    (``c + n_steps`` returned; ``j0 > 0``: the forward's item-sharing entries, whose first tiles the
    item's previous entry left in the ring, ``_fwd_item_producer_loop``). The
    forward (no dO) has separate K and V barriers (``_ring(SPLIT_KV=True)``): V slot ``s`` is waited on
    and released through barriers ``STAGES + s``, since its consumer frees K slot ``r`` once ``S_r``
    retired, in step ``r``, and V slot ``r`` only in step ``r + 1``, after ``P_r V_r`` (``_fwd_step``)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    if HAS_DO:
        mbarrier.expect(qo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    else:
        mbarrier.expect(qo_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [rs, h * HEAD_DIM], qo_bar, q_smem)
    if HAS_DO:
        tma.async_copy_global_to_shared(do_desc, [rs, h * HEAD_DIM], qo_bar, do_smem)
    for j in range(j0, n_steps):
        r = c + j  # ring position (c is the literal 0 for one-entry programs)
        s = r % STAGES
        row = o_lo + j * BLOCK_N
        mbarrier.wait(empty.index(s), ((r // STAGES) & 1) ^ 1)
        if HAS_DO:  # dQ programs: K and V of a slot are read by the same step, one barrier pair
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_DIM], ready.index(s), k_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_DIM], ready.index(s), v_bufs.index(s))
        else:  # forward: K slot s (barriers s) frees a step before V slot s (barriers STAGES + s)
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_DIM], ready.index(s), k_bufs.index(s))
            mbarrier.wait(empty.index(STAGES + s), ((r // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(STAGES + s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_DIM], ready.index(STAGES + s), v_bufs.index(s))
    return c + n_steps


@gluon.jit
def _rows_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar,
                   rs, o_lo, h, hk, n_steps, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, HAS_DO: gl.constexpr):
    # programs that own query rows (dQ, forward): their Q (and dO) tile once, then the K / V ring
    _rows_produce_entry(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar,
                        rs, o_lo, h, hk, n_steps, 0, 0, HEAD_DIM, BLOCK_N, HAS_DO)


@gluon.jit
def _dq_step(q_smem, do_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, lse2, delta, j, c, dq, qk_scale,
             MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr, op_layout: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    r = c + j  # ring position of walked tile j (c: the entry's first; the literal 0 for one-entry programs)
    s = r % STAGES
    mbarrier.wait(ready.index(s), (r // STAGES) & 1)
    if MASKED:
        if o_lo + (j + 1) * BLOCK_N > o_hi:  # the key tile cut by the document end: dS K reads K
            _zero_rows_from(k_bufs.index(s), o_hi - o_lo - j * BLOCK_N)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(do_smem, v_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st,))  # the previous tile's dQ product is done: free its slot
    mbarrier.arrive(empty.index((r + STAGES - 1) % STAGES), count=1, pred=r > 0)
    p = gl.exp2(st * qk_scale - lse2[:, None])
    if MASKED:
        k_pos = o_lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < o_hi)
        p = gl.where(vis, p, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    ds = p * (dpt - delta[:, None])
    if MASKED:
        ds = gl.where(vis, ds, 0.0)  # P = 0 times a non-finite dP (another document's V) stays 0
    ds_op = gl.convert_layout(ds.to(gl.bfloat16), op_layout)
    dq = warpgroup_mma(ds_op, k_bufs.index(s), dq, is_async=True)
    return dq


@gluon.jit
def _dq_consume_entry(q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar, qo_phase, qo_empty, LSE, DELTA, DQ,
                      stride_lh, stride_dqt, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale, c,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      RELEASE_QO: gl.constexpr):
    """One entry's dQ from ring position ``c`` (returned advanced) and its store; with ``RELEASE_QO``
    its Q / dO slot is handed back (``qo_empty``) once its last product retired."""
    # the consumer's warps own the program's BLOCK_M queries, 16 rows per warp
    s_layout: gl.constexpr = _wgmma_layout(CONSUMER_WARPS, BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(CONSUMER_WARPS, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q0 = rs
    q_pos = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_ok = q_pos < re
    lse2 = gl.load(LSE + h * stride_lh + q_pos, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = gl.load(DELTA + h * stride_lh + q_pos, mask=row_ok, other=0.0)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(qo_bar, qo_phase)
    for j in range(0, u1):
        dq = _dq_step(q_smem, do_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, lse2, delta, j, c, dq, qk_scale,
                      False, BLOCK_M, BLOCK_N, s_layout, op_layout)
    for j in range(u1, n_steps):
        dq = _dq_step(q_smem, do_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, lse2, delta, j, c, dq, qk_scale,
                      True, BLOCK_M, BLOCK_N, s_layout, op_layout)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    # dQ through the entry's own Q tile (every product that read it retired): 16-byte stores
    dq_out = _rows_through_smem(q_smem, (dq * sm_scale).to(gl.bfloat16), CONSUMER_WARPS)
    if RELEASE_QO:
        _release_after_reads(qo_empty)  # the next entry's Q, dO may load
    _store_rows(DQ, dq_out, q0, re, stride_dqt, h * HEAD_DIM)
    return c + n_steps


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar, LSE, DELTA, DQ,
                 stride_lh, stride_dqt, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    _dq_consume_entry(q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar, 0, qo_bar, LSE, DELTA, DQ,
                      stride_lh, stride_dqt, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale, 0,
                      HEAD_DIM, BLOCK_M, BLOCK_N, False)


@gluon.jit
def _dq_kernel(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DQ, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len,
               stride_lh, stride_dqt, qk_scale, sm_scale, total, counter_ptr,
               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               WL_BM: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr = False):
    # head-major grid: all entries of query head 0 in the list's decreasing-cost order, then head 1, ...
    # (PERSISTENT: one program per SM taking entries from a global counter, Q / dO double-buffered)
    if not PERSISTENT:
        e, h, qs, qe, ds, de, keep = _rows_span(items_ptr, num_items_ptr, cu_ptr, gl.program_id(0), max_entries,
                                                skip_len, GROUP, WL_BM, BLOCK_M, False)
        hk = h // GROUP
        if not keep:
            return
        rs, re, o_lo, o_hi, u1, n_steps = _query_rows(qs, qe, ds, de, e, WL_BM // BLOCK_M, BLOCK_M, BLOCK_N, True)
        if rs >= re:
            return
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], do_desc.layout)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)
        qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qo_bar, count=1)
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar, LSE, DELTA, DQ,
                            stride_lh, stride_dqt, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale,
                            HEAD_DIM, BLOCK_M, BLOCK_N)),
            (_rows_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar,
                              rs, o_lo, h, hk, n_steps, HEAD_DIM, BLOCK_N, True)),
        ], [1], [24])
    else:
        q_bufs, do_bufs, qo_ready, qo_empty = _ring(q_desc, do_desc, 2, BLOCK_M, HEAD_DIM)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)
        t_smem = gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        gl.warp_specialize([
            (_rows_consumer_loop, (q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem, DQ, LSE,
                                   DELTA, stride_dqt, stride_lh, qk_scale, sm_scale, num_items_ptr,
                                   max_entries, total, qo_ready, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, True,
                                   False)),
            (_rows_producer_loop, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                                   qo_ready, qo_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                   max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, True,
                                   False)),
        ], [1], [24])


# ----------------------------------------------------------------------------------------------
# Forward programs: own BLOCK_M queries of one query head, walk the visible key tiles, online softmax.

@gluon.jit
def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong (FlashAttention-3's ``warp_scheduler_barrier_sync``): partition ``WG`` waits for its
    ``k``-th turn to issue wgmma products; ``turn[WG]`` completes a phase each time the other
    partition has issued. Partition 0 goes first: its turn ``k`` waits for phase ``k - 1`` (the
    parity flip: on a fresh barrier the wait for the "previous" phase returns at once, as the
    producers' first claims of empty slots do), partition 1's for phase ``k``."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _turn_barriers(unused, PINGPONG: gl.constexpr):
    """The two ping-pong mbarriers (count 1 each), or ``unused`` (any shared-memory handle, never
    waited on) without ``PINGPONG``: a kernel without turns (``small_fwd_pers``'s, the dQ kernels)
    allocates nothing more."""
    if PINGPONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(turn.index(s), count=1)
        return turn
    else:
        return unused


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: partition ``WG`` has issued its products; the other partition's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _fwd_softmax(st, m_i, l_i, lim, j, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
                 s_layout: gl.constexpr, op_layout: gl.constexpr):
    """Base-2 online softmax of walked tile ``j``'s raw scores ``st``: ``(P as the bf16 A operand, m, l,
    alpha)``, ``m`` in the scaled (base-2) domain. ``lim`` (per row): the last visible key of the row
    relative to the entry's first key (``min(q_pos, o_hi - 1) - o_lo``, causal; ``o_hi - 1 - o_lo``
    otherwise), so a masked tile costs one compare and one select a score; masked scores are
    ``-inf`` (exp2 -> 0; a row's first tile always holds its document's first key, so ``m`` stays
    finite). The scale is applied inside the exponent (``st * qk_scale - m``: one FFMA, as
    FlashAttention's ``exp2f(x * scale - max_scaled)``): the row max commutes with a positive scale."""
    if MASKED:
        k_rel = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        st = gl.where(k_rel[None, :] <= (lim - j * BLOCK_N)[:, None], st, float("-inf"))
    m_ij = gl.maximum(m_i, gl.max(st, 1) * qk_scale)
    p = gl.exp2(st * qk_scale - m_ij[:, None])
    alpha = gl.exp2(m_i - m_ij)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(gl.bfloat16), op_layout), m_ij, l_i, alpha


@gluon.jit
def _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, lim, j, c, acc, p_prev, m_i, l_i, qk_scale, turn, k_turn, rel,
              MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr, op_layout: gl.constexpr, acc_layout: gl.constexpr,
              WG: gl.constexpr = 0, PINGPONG: gl.constexpr = False):
    """Walked tile ``j >= 1``, software-pipelined as FlashAttention-3's forward (Shah et al. 2024, §3.2
    "intra-warpgroup overlapping"): ``S_j = Q K_j^T`` and the previous tile's ``O += P_{j-1} V_{j-1}``
    are in flight together, and tile ``j``'s softmax runs while the second one computes. K slot ``s``
    is freed once ``S_j`` retired, V slot ``s - 1`` once ``P_{j-1} V_{j-1}`` did (split barriers: the
    producer loads K_{j+1} during this step). The tile the document end cuts is the last one: its V
    rows are zeroed by ``_fwd_consume_entry`` before its product. ``rel`` False: no slot is released
    (an item-sharing entry whose tiles the item's next entry reads again, ``_fwd_consume_entry``)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    r = c + j  # ring position of walked tile j (c: the entry's first; the literal 0 for one-entry programs)
    s = r % STAGES
    sp = (r - 1) % STAGES
    mbarrier.wait(ready.index(s), (r // STAGES) & 1)
    if PINGPONG:  # both tiles landed before the turn is taken: a turn is held only while issuing
        mbarrier.wait(ready.index(STAGES + sp), ((r - 1) // STAGES) & 1)
        _turn_wait(turn, k_turn + j, WG, PINGPONG)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if not PINGPONG:
        mbarrier.wait(ready.index(STAGES + sp), ((r - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_prev, v_bufs.index(sp), acc, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    st = warpgroup_mma_wait(1, deps=(st,))  # groups retire in order: S_j done, P V may still run
    mbarrier.arrive(empty.index(s), count=1, pred=rel)
    p, m_ij, l_i, alpha = _fwd_softmax(st, m_i, l_i, lim, j, qk_scale, MASKED, BLOCK_N, s_layout, op_layout)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(STAGES + sp), count=1, pred=rel)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout))[:, None]
    return acc, p, m_ij, l_i


@gluon.jit
def _fwd_consume_entry(q_smem, k_bufs, v_bufs, ready, empty, q_bar, q_phase, q_empty, O, LSE, stride_ot, stride_lh,
                       rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, c, turn, k_turn, rel,
                       CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       RELEASE_Q: gl.constexpr, WG: gl.constexpr = 0, NW: gl.constexpr = 8,
                       PINGPONG: gl.constexpr = False, PART_SKIP: gl.constexpr = False):
    """One entry's forward from ring position ``c`` (returned advanced) and its O / LSE stores, by the
    consumer partition ``WG`` of ``NW`` warps (8: the whole entry; 4: rows ``WG * BLOCK_M / 2`` on of
    the entry's ``BLOCK_M``, each of the two partitions arriving on the shared slot barriers (count 2)
    on its own: FA3's two consumer warpgroups, which no CTA-wide barrier couples); with
    ``RELEASE_Q`` its Q slot is handed back (``q_empty``) once its last product retired. Tile 0's
    ``S`` and softmax are peeled before the pipelined steps (``_fwd_step``), the last tile's ``P V``
    after them (``n_steps >= 1`` for every entry a program runs). ``rel`` (int 0 / 1): 0 for an
    item-sharing entry that is not its item's last (``_fwd_item_producer_loop``): it releases no ring
    slot and leaves ``c`` where it was, since the item's next entry walks the same tiles again.
    ``PART_SKIP`` (causal, two partitions without turns): the partition computes only the walked tiles
    that hold a key visible to one of its rows (``min(r0 + PART_M, re, o_hi) - 1``: the upper partition
    of a 128-row diagonal entry skips the last 64-key tile, all of whose scores are masked for it); for
    each skipped tile it still waits until the tile landed (so the other partition released the slot's
    previous lap: the count-2 empty barrier cannot be completed by one partition's two laps) and then
    arrives on the tile's K / V empty barriers, as the other partition does once it read them."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    PART_M: gl.constexpr = BLOCK_M * NW // 8
    s_layout: gl.constexpr = _wgmma_layout(NW, BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_part = q_smem.slice(WG * PART_M, PART_M, dim=0)
    r0 = rs + WG * PART_M
    q_pos = r0 + gl.arange(0, PART_M, layout=gl.SliceLayout(1, s_layout))
    if CAUSAL:
        lim = gl.minimum(q_pos, o_hi - 1) - o_lo  # _fwd_softmax: the row's last visible key
    else:
        lim = gl.zeros_like(q_pos) + (o_hi - 1 - o_lo)
    m_i = gl.full([PART_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([PART_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, acc_layout)  # carried as a plain tensor (rescaled each step)
    n_all = n_steps  # the entry's walked tiles (the ring advances by all of them)
    if PART_SKIP and CAUSAL:  # this partition's tiles: up to its last row's last visible key
        last = gl.minimum(gl.minimum(r0 + PART_M, re), o_hi) - 1 - o_lo
        n_steps = gl.maximum(gl.minimum(last // BLOCK_N + 1, n_all), 1)
    mbarrier.wait(q_bar, q_phase)
    s0 = c % STAGES
    mbarrier.wait(ready.index(s0), (c // STAGES) & 1)
    zero = gl.zeros([PART_M, BLOCK_N], gl.float32, s_layout)
    _turn_wait(turn, k_turn, WG, PINGPONG)  # the entry's n_steps + 1 turns: k_turn, ..., k_turn + n_steps
    st = warpgroup_mma(q_part, k_bufs.index(s0).permute((1, 0)), zero, use_acc=False, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    release = rel != 0
    st = warpgroup_mma_wait(0, deps=(st,))
    mbarrier.arrive(empty.index(s0), count=1, pred=release)
    if u1 > 0:
        p, m_i, l_i, _alpha = _fwd_softmax(st, m_i, l_i, lim, 0, qk_scale, False, BLOCK_N, s_layout, op_layout)
    else:
        p, m_i, l_i, _alpha = _fwd_softmax(st, m_i, l_i, lim, 0, qk_scale, True, BLOCK_N, s_layout, op_layout)
    for j in range(1, u1):
        acc, p, m_i, l_i = _fwd_step(q_part, k_bufs, v_bufs, ready, empty, lim, j, c, acc, p, m_i, l_i, qk_scale,
                                     turn, k_turn, release, False, PART_M, BLOCK_N, s_layout, op_layout, acc_layout, WG,
                                     PINGPONG)
    for j in range(gl.maximum(u1, 1), n_steps):
        acc, p, m_i, l_i = _fwd_step(q_part, k_bufs, v_bufs, ready, empty, lim, j, c, acc, p, m_i, l_i, qk_scale,
                                     turn, k_turn, release, True, PART_M, BLOCK_N, s_layout, op_layout, acc_layout, WG,
                                     PINGPONG)
    r = c + n_steps - 1
    sl = r % STAGES
    mbarrier.wait(ready.index(STAGES + sl), (r // STAGES) & 1)
    if o_lo + n_steps * BLOCK_N > o_hi:  # the key tile cut by the document end: P V reads V
        _zero_rows_from(v_bufs.index(sl), o_hi - o_lo - (n_steps - 1) * BLOCK_N, NW)
    _turn_wait(turn, k_turn + n_steps, WG, PINGPONG)
    acc = warpgroup_mma(p, v_bufs.index(sl), acc, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(STAGES + sl), count=1, pred=release)
    if PART_SKIP and CAUSAL:
        if release:  # the tiles this partition skipped: released once landed (docstring)
            for j in range(n_steps, n_all):
                rj = c + j
                mbarrier.wait(ready.index(rj % STAGES), (rj // STAGES) & 1)
                mbarrier.arrive(empty.index(rj % STAGES), count=1)
                mbarrier.wait(ready.index(STAGES + rj % STAGES), (rj // STAGES) & 1)
                mbarrier.arrive(empty.index(STAGES + rj % STAGES), count=1)
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, acc_layout))[:, None]).to(gl.bfloat16)
    out = _rows_through_smem(q_part, out, NW)  # O through the partition's own Q rows (all products retired)
    if RELEASE_Q:
        _release_after_reads(q_empty)  # the next entry's Q may load
    _store_rows(O, out, r0, re, stride_ot, h * HEAD_DIM)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    gl.store(LSE + h * stride_lh + q_pos, lse, mask=q_pos < re)
    return c + n_all * rel


@gluon.jit
def _fwd_consumer(q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                  rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, turn,
                  CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  WG: gl.constexpr = 0, NW: gl.constexpr = 8, PINGPONG: gl.constexpr = False):
    _fwd_consume_entry(q_smem, k_bufs, v_bufs, ready, empty, q_bar, 0, q_bar, O, LSE, stride_ot, stride_lh,
                       rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, 0, turn, 0, 1, CAUSAL, HEAD_DIM, BLOCK_M,
                       BLOCK_N, False, WG, NW, PINGPONG)


@gluon.jit
def _rows_span(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, GROUP: gl.constexpr, WL_BM: gl.constexpr,
               BLOCK_M: gl.constexpr, IS_FWD: gl.constexpr):
    """Entry ``t`` of the head-major order of programs owning query rows (``per_head`` list entries
    per query head): dQ programs walk query head after query head; forward programs kv head after
    kv head with a GQA group's query heads side by side (flash_fwd's grid_head_major). Returns the
    list entry ``e``, the query head ``h`` and its ``_item_span``."""
    if IS_FWD:
        x = t % (per_head * GROUP)
        e = x // GROUP
        h = (t // (per_head * GROUP)) * GROUP + x % GROUP
    else:
        e = t % per_head
        h = t // per_head
    qs, qe, ds, de, keep = _item_span(items_ptr, num_items_ptr, cu_ptr, e, WL_BM // BLOCK_M, skip_len)
    return e, h, qs, qe, ds, de, keep


@gluon.jit
def _rows_geometry(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, GROUP: gl.constexpr,
                   WL_BM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                   IS_FWD: gl.constexpr):
    """Entry ``t`` of a persistent launch of programs owning query rows (``_rows_span``): whether a
    Gluon program runs it, its heads and ``_query_rows``."""
    e, h, qs, qe, ds, de, keep = _rows_span(items_ptr, num_items_ptr, cu_ptr, t, per_head, skip_len, GROUP,
                                            WL_BM, BLOCK_M, IS_FWD)
    rs, re, o_lo, o_hi, u1, n_steps = _query_rows(qs, qe, ds, de, e, WL_BM // BLOCK_M, BLOCK_M, BLOCK_N, CAUSAL)
    return keep & (rs < re), h, h // GROUP, rs, re, o_lo, o_hi, u1, n_steps


@gluon.jit
def _rows_producer_loop(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                        qo_ready, qo_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries,
                        skip_len, total, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, CAUSAL: gl.constexpr, IS_FWD: gl.constexpr):
    """Persistent dQ / forward programs' producer: as ``_dkdv_producer_loop`` (global counter, the
    index and geometry handed over in ``t_smem``), the Q (and dO) tiles in slot ``n % 2``, the K / V ring
    running on."""
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])
    n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, WL_BM // BLOCK_M)
    c = 0
    n = 0
    t = gl.atomic_add(counter_ptr, 1)
    while t < n_total:
        t_next = gl.atomic_add(counter_ptr, 1)  # taken early: its latency hides under this entry's loads
        keep, h, hk, rs, re, o_lo, o_hi, u1, n_steps = _rows_geometry(items_ptr, num_items_ptr, cu_ptr, t, n_valid,
                                                                      skip_len, GROUP, WL_BM, BLOCK_M, BLOCK_N,
                                                                      CAUSAL, IS_FWD)
        if keep:
            slot = _claim_slot(qo_empty, n)
            _handoff_store(t_smem.index(slot), idx_layout, t, h, hk, rs, re, o_lo, o_hi, u1, n_steps,
                           0)  # the tenth (rel) is read only by ITEMS consumers
            c = _rows_produce_entry(q_desc, do_desc, k_desc, v_desc, q_bufs.index(slot), do_bufs.index(slot),
                                    k_bufs, v_bufs, ready, empty, qo_ready.index(slot), rs, o_lo, h, hk, n_steps,
                                    c, 0, HEAD_DIM, BLOCK_N, not IS_FWD)
            n += 1
        t = t_next
    slot = _claim_slot(qo_empty, n)
    _handoff_store(t_smem.index(slot), idx_layout, n_total, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    mbarrier.arrive(qo_ready.index(slot), count=1)


@gluon.jit
def _fwd_item_producer_loop(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem,
                            counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len, total,
                            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, CAUSAL: gl.constexpr,
                            HEAD_INNER: gl.constexpr = False, STATIC: gl.constexpr = False):
    """Persistent forward programs' producer claiming whole list items (``gluon_fwd(items=True)``):
    the item's ``F = WL_BM / BLOCK_M`` query tiles run back to back on this program, one entry each
    (Q slot ``n % 2``). A causal item that starts at its document's start and whose keys fit the ring
    (``ceil((q_end - doc_start) / BLOCK_N) <= STAGES``: a whole document of <= 256 tokens with 128-key
    tiles and 2 slots) loads each K / V tile once: the item's earlier entries release no slot
    (hand-over flag 0) and its last entry walks the same ring positions and frees them. So W7's
    256-token documents read K / V once from L2 per (document, head) instead of 1.5 times, and from
    DRAM once (the cost order re-read tile 0 ~4,000 entries later). Other items: independent entries
    (the second re-reads its K / V from L2 right after the first). ``HEAD_INNER``: claim ``t`` is item
    ``t // H``, query head ``t % H`` (every head of one item side by side: the programs in flight read
    whole token rows of K / V) instead of head after head. ``STATIC``: the claims are dealt by DESIGN.md
    §6's static snake (claim ``k`` of round ``r = k // P`` to program ``k % P`` in even rounds and
    ``P - 1 - k % P`` in odd ones, as ``scheduler.worklist.static_assignment``) instead of taken from
    the global counter: no counter to zero before each launch, no fenced atomic per claim."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    F: gl.constexpr = WL_BM // BLOCK_M
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])
    n_valid, n_total = _entry_counts(num_items_ptr, max_entries // F, total // F, 1)
    c = 0
    n = 0
    if STATIC:
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        r = 0
        t = gl.to_tensor(pid)
    else:
        t = gl.atomic_add(counter_ptr, 1)
    while t < n_total:
        if STATIC:
            r += 1
            t_next = r * n_prog + gl.where(r % 2 == 0, pid, n_prog - 1 - pid)
        else:
            t_next = gl.atomic_add(counter_ptr, 1)  # taken early: its latency hides under this item's loads
        if HEAD_INNER:
            n_heads = total // max_entries
            h = t % n_heads
            qs, qe, ds, de, keep = _item_span(items_ptr, num_items_ptr, cu_ptr, t // n_heads, 1, skip_len)
        else:  # the forward's head-major order over items (one entry per item: WL_BM = BLOCK_M there)
            _e, h, qs, qe, ds, de, keep = _rows_span(items_ptr, num_items_ptr, cu_ptr, t, n_valid, skip_len, GROUP,
                                                     BLOCK_M, BLOCK_M, True)
        hk = h // GROUP
        if keep:
            if CAUSAL:
                share = (qs == ds) & ((qe - ds + BLOCK_N - 1) // BLOCK_N <= STAGES)
            else:  # every query tile walks the whole document: no last entry reads all the others' tiles
                share = qs < 0
            loaded = gl.to_tensor(0)  # the item's tiles already in the ring (sharing)
            for f in gl.static_range(F):
                rs, re, o_lo, o_hi, u1, n_steps = _query_rows(qs, qe, ds, de, f, F, BLOCK_M, BLOCK_N, CAUSAL)
                if rs < re:
                    rel = (re >= qe) | (share == 0)
                    slot = _claim_slot(qo_empty, n)
                    _handoff_store(t_smem.index(slot), idx_layout, t, h, hk, rs, re, o_lo, o_hi, u1, n_steps,
                                   rel.to(gl.int32))
                    j0 = gl.where(share, loaded, 0)
                    nxt = _rows_produce_entry(q_desc, q_desc, k_desc, v_desc, q_bufs.index(slot), q_bufs.index(slot),
                                              k_bufs, v_bufs, ready, empty, qo_ready.index(slot), rs, o_lo, h, hk,
                                              n_steps, c, j0, HEAD_DIM, BLOCK_N, False)
                    c = gl.where(rel, nxt, c)
                    loaded = gl.maximum(loaded, n_steps)
                    n += 1
        t = t_next
    slot = _claim_slot(qo_empty, n)
    _handoff_store(t_smem.index(slot), idx_layout, n_total, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    mbarrier.arrive(qo_ready.index(slot), count=1)


@gluon.jit
def _rows_consumer_loop(q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem, OUT, LSE, DELTA,
                        stride_out, stride_lh, qk_scale, sm_scale, num_items_ptr, max_entries,
                        total, turn, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, CAUSAL: gl.constexpr, IS_FWD: gl.constexpr,
                        WG: gl.constexpr = 0, NW: gl.constexpr = 8, PINGPONG: gl.constexpr = False,
                        ITEMS: gl.constexpr = False, PART_SKIP: gl.constexpr = False):
    """Persistent dQ / forward programs' consumer: the entries the producer hands over; ``OUT`` is dQ
    (``IS_FWD`` False) or O (LSE written too). ``WG`` / ``NW``: the forward's consumer partition
    (``_fwd_consume_entry``, also for ``PART_SKIP``). ``ITEMS``: the producer claims whole list items
    (``_fwd_item_producer_loop``), so its stop signal is the item count."""
    QO_STAGES: gl.constexpr = q_bufs.type.shape[0]
    F: gl.constexpr = WL_BM // BLOCK_M
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [NW], [0])  # each thread: the whole slot
    if ITEMS:
        _n_valid, n_total = _entry_counts(num_items_ptr, max_entries // F, total // F, 1)
    else:
        _n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, F)
    c = 0
    n = 0
    kt = 0  # ITEMS: ping-pong turns taken (an entry takes n_steps + 1; c stays put on sharing entries)
    t = _next_entry(qo_ready, t_smem, n, idx_layout)
    while t < n_total:
        slot = n % QO_STAGES
        t, h, hk, rs, re, o_lo, o_hi, u1, n_steps, rel = _handoff_load(t_smem.index(slot), idx_layout)
        if ITEMS:
            k_turn = kt
        else:  # every entry frees its slots and takes its turns from c + n (constants: the SASS of main)
            rel = 1
            k_turn = c + n
        if IS_FWD:
            c = _fwd_consume_entry(q_bufs.index(slot), k_bufs, v_bufs, ready, empty, qo_ready.index(slot),
                                   (n // QO_STAGES) & 1, qo_empty.index(slot), OUT, LSE, stride_out, stride_lh, rs,
                                   re, o_lo, o_hi, h, n_steps, u1, qk_scale, c, turn, k_turn, rel, CAUSAL, HEAD_DIM,
                                   BLOCK_M, BLOCK_N, True, WG, NW, PINGPONG, PART_SKIP)
            kt += n_steps + 1
        else:
            c = _dq_consume_entry(q_bufs.index(slot), do_bufs.index(slot), k_bufs, v_bufs, ready, empty,
                                  qo_ready.index(slot), (n // QO_STAGES) & 1, qo_empty.index(slot), LSE, DELTA, OUT,
                                  stride_lh, stride_out, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale, c,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, True)
        n += 1
        t = _next_entry(qo_ready, t_smem, n, idx_layout)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, O, LSE, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len,
                stride_ot, stride_lh, qk_scale, total, counter_ptr,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                WL_BM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr = False,
                PARTS: gl.constexpr = 1, PINGPONG: gl.constexpr = False, ITEMS: gl.constexpr = False,
                HEAD_INNER: gl.constexpr = False, STATIC: gl.constexpr = False, PART_SKIP: gl.constexpr = False):
    if not PERSISTENT:
        # head-major grid (flash_fwd's grid_head_major): kv head after kv head, entries in decreasing
        # cost inside it, the query heads of one GQA group side by side (they share K / V in L2)
        e, h, qs, qe, ds, de, keep = _rows_span(items_ptr, num_items_ptr, cu_ptr, gl.program_id(0), max_entries,
                                                skip_len, GROUP, WL_BM, BLOCK_M, True)
        hk = h // GROUP
        if not keep:
            return
        rs, re, o_lo, o_hi, u1, n_steps = _query_rows(qs, qe, ds, de, e, WL_BM // BLOCK_M, BLOCK_M, BLOCK_N,
                                                      CAUSAL)
        if rs >= re:
            return

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM, True, True, PARTS)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        turn = _turn_barriers(q_bar, PINGPONG)
        if PARTS == 1:
            gl.warp_specialize([
                (_fwd_consumer, (q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                                 rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, turn, CAUSAL, HEAD_DIM, BLOCK_M,
                                 BLOCK_N)),
                (_rows_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_bufs, v_bufs, ready, empty,
                                  q_bar, rs, o_lo, h, hk, n_steps, HEAD_DIM, BLOCK_N, False)),
            ], [1], [24])
        else:  # two 4-warp consumer partitions, half of the entry's rows each
            gl.warp_specialize([
                (_fwd_consumer, (q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                                 rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, turn, CAUSAL, HEAD_DIM, BLOCK_M,
                                 BLOCK_N, 0, 4, PINGPONG)),
                (_fwd_consumer, (q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                                 rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, turn, CAUSAL, HEAD_DIM, BLOCK_M,
                                 BLOCK_N, 1, 4, PINGPONG)),
                (_rows_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_bufs, v_bufs, ready, empty,
                                  q_bar, rs, o_lo, h, hk, n_steps, HEAD_DIM, BLOCK_N, False)),
            ], [4, 1], [240, 24])
    else:  # one program per SM taking entries from a global counter; two Q slots
        q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        q_ready, q_empty = _slot_barriers(2, True, PARTS)
        k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM, True, True, PARTS)
        t_smem = gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        turn = _turn_barriers(q_ready, PINGPONG)
        if PARTS == 1:
            gl.warp_specialize([
                (_rows_consumer_loop, (q_bufs, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                       LSE, stride_ot, stride_lh, qk_scale, qk_scale, num_items_ptr,
                                       max_entries, total, turn, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True)),
                (_rows_producer_loop, (q_desc, q_desc, k_desc, v_desc, q_bufs, q_bufs, k_bufs, v_bufs, ready, empty,
                                       q_ready, q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                       max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True)),
            ], [1], [24])
        elif ITEMS:  # two consumer partitions; the producer claims whole list items (_fwd_item_producer_loop)
            gl.warp_specialize([
                (_rows_consumer_loop, (q_bufs, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                       LSE, stride_ot, stride_lh, qk_scale, qk_scale, num_items_ptr,
                                       max_entries, total, turn, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True, 0, 4, PINGPONG, True, PART_SKIP)),
                (_rows_consumer_loop, (q_bufs, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                       LSE, stride_ot, stride_lh, qk_scale, qk_scale, num_items_ptr,
                                       max_entries, total, turn, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True, 1, 4, PINGPONG, True, PART_SKIP)),
                (_fwd_item_producer_loop, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready,
                                           q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries,
                                           skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                           HEAD_INNER, STATIC)),
            ], [4, 1], [240, 24])
        else:  # two 4-warp consumer partitions, half of each entry's rows each
            gl.warp_specialize([
                (_rows_consumer_loop, (q_bufs, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                       LSE, stride_ot, stride_lh, qk_scale, qk_scale, num_items_ptr,
                                       max_entries, total, turn, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True, 0, 4, PINGPONG)),
                (_rows_consumer_loop, (q_bufs, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                       LSE, stride_ot, stride_lh, qk_scale, qk_scale, num_items_ptr,
                                       max_entries, total, turn, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True, 1, 4, PINGPONG)),
                (_rows_producer_loop, (q_desc, q_desc, k_desc, v_desc, q_bufs, q_bufs, k_bufs, v_bufs, ready, empty,
                                       q_ready, q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                       max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                       True)),
            ], [4, 1], [240, 24])


@functools.cache
def _smem_layout(block_rows: int, head_dim: int, fp32: bool):
    """The NVMMA shared layout of a ``block_rows x head_dim`` TMA block (built once per shape: it is
    an immutable value, and building it cost ~50 us of host time per attention call)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl.float32 if fp32 else gl.bfloat16)


def _descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over ``x`` (T, H, D) bf16 or float32 viewed as (T, H * D), blocks of ``block_rows`` tokens x D."""
    T, H, D = x.shape
    layout = _smem_layout(block_rows, D, x.dtype == torch.float32)
    return TensorDescriptor(x.view(T, H * D), [T, H * D], [H * D, 1], [block_rows, D], layout)


def _check_stages(fn: str, stages: int) -> None:
    """The ring needs >= 2 slots: the dK/dV and dQ consumers release a slot only once the next one is
    ready, so one slot would hang every program that walks two or more tiles (the forward, whose K and V
    have their own barriers, would not hang, but is held to the same rule)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"{fn}: stages (the ring depth) must be an int >= 2, got {stages!r}")


def _check_inputs(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> None:
    """The launchers' input rules (ValueError naming what was wrong and what is allowed)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        if x.dim() != 3 or not x.is_contiguous() or x.dtype != torch.bfloat16:
            raise ValueError(f"{fn}: {name} must be a contiguous (T, H, D) bf16 CUDA tensor, got {x.dtype} "
                             f"shape {tuple(x.shape)} strides {x.stride()} on {x.device}")
    T, H, D = q.shape
    if do.shape != q.shape or k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"{fn}: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"do {tuple(do.shape)} (need q = do = (T, H_q, D), k = v = (T, H_kv, D))")
    if H % k.shape[1]:
        raise ValueError(f"{fn}: H_q={H} must be a multiple of H_kv={k.shape[1]}")
    if D not in (64, 128):
        raise ValueError(f"{fn}: head_dim must be 64 or 128, got {D}")
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        if not x.is_cuda:
            raise ValueError(f"{fn}: {name} must be a CUDA tensor (the kernels run on sm_90), got {x.device}")


def gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
               softmax_scale: float, *, block_m: int = 64, block_n: int = 128, wl_block_m: int = 128,
               stages: int = 2, skip_len: int = 0, retire_first: bool = True,
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
        retire_first: wait for the previous step's dV / dK products before issuing the next step's
            ``S^T`` / ``dP^T`` (config ``bwd_gluon_retire_first``). Without it ptxas serializes
            every wgmma of the D = 128 kernel for lack of registers (C7512, CPU-screened); with
            it (and LSE / Delta read from shared memory, staged there by the producer warp) they
            stay asynchronous and the kernel is spill-free: 1.02-1.06x faster training calls on the
            H200 (the default).
        dk, dv: optional preallocated outputs.
        dq_acc: optional ``(T, Hc, D)`` float32 contiguous accumulator (zeroed by the caller; ``Hc >=
            kv_heads * H_q / H_kv``): each step also computes its dQ partial ``dS K`` (a fifth
            product, dS^T through shared memory) and adds it to ``dq_acc[:, h - kv_head0 * H_q / H_kv]``
            by a TMA bulk reduce (FlashAttention-3's dQ path; needs ``retire_first``). ``dq_acc`` then
            holds ``dQ / softmax_scale`` of the chunk's query heads for the rows this kernel owns, so
            the dQ programs are not needed; the summation order of the reduces varies run to run
            (not bitwise reproducible). Config ``bwd_gluon_dq_reduce``.
        kv_head0, kv_heads: run only kv heads ``[kv_head0, kv_head0 + kv_heads)`` (default all: a
            caller bounding the accumulator's memory runs the heads in chunks,
            ``bwd_dq_reduce_max_bytes``).
        persistent: one program per SM taking entries of the same head-major list from a global
            counter (greedy, like the hardware's dispatch of one-entry programs); its producer loads the next entry's K, V (a second slot, without
            ``dq_acc``) and first Q / dO tiles while the current entry computes, hiding the
            per-program prologue / epilogue that dominates short documents (config
            ``bwd_gluon_persistent``; H200: 0.93-1.00x on long rows, so off there).

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
    _check_stages("gluon_dkdv", stages)
    _check_inputs("gluon_dkdv", q, k, v, do)
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
        if not retire_first:
            raise ValueError("gluon_dkdv: dq_acc (the dQ reduce) needs retire_first=True")
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    max_entries = items.shape[0] * (wl_block_m // block_n)
    if T == 0 or max_entries == 0:
        return dk, dv
    total = max_entries * kv_heads
    grid = min(total, torch.cuda.get_device_properties(q.device).multi_processor_count) if persistent else total
    _dkdv_kernel[(grid,)](
        _descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        lse, delta, dk, dv, items, num_items, cu_seqlens, max_entries, int(skip_len),
        lse.stride(0), dk.stride(0), dv.stride(0), float(softmax_scale) * LOG2E, float(softmax_scale),
        _descriptor(dq_acc if dq_acc is not None else q, block_m), int(kv_head0), total,
        torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else num_items,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, WL_BM=wl_block_m, STAGES=stages,
        BLOCK_N=block_n, RETIRE_FIRST=bool(retire_first), DQ_REDUCE=dq_acc is not None,
        PERSISTENT=bool(persistent), num_warps=CONSUMER_WARPS.value, maxnreg=MAXNREG)
    return dk, dv


def gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
             softmax_scale: float, *, block_m: int = 128, block_n: int = 64, wl_block_m: int = 128,
             stages: int = 4, skip_len: int = 0, dq: torch.Tensor | None = None,
             persistent: bool = False) -> torch.Tensor:
    """dQ of causal packed attention (the dQ programs of ``flash_bwd``), warp-specialized Gluon.

    Args: as :func:`gluon_dkdv`; ``block_m`` queries per program, ``block_n`` keys per walked tile;
    ``dq`` an optional preallocated output; ``persistent``: one program per SM taking entries from a
    global counter, the next entry's Q / dO (second slot) and K / V tiles loading while the current
    one computes (K / V ring at most 2 deep then; config ``bwd_gluon_persistent``; on for MHA rows
    of 513-1,024 tokens, W3: 1.02-1.04x).

    Returns:
        ``dq`` ``(T, H_q, D)`` bf16; rows of skipped items (``skip_len``) and padding rows untouched.

    Raises:
        ValueError: as :func:`gluon_dkdv`.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    _check_stages("gluon_dq", stages)
    _check_inputs("gluon_dq", q, k, v, do)
    if dq is None:
        dq = torch.empty_like(q)
    max_entries = items.shape[0] * (wl_block_m // block_m)
    if T == 0 or max_entries == 0:
        return dq
    total = max_entries * H
    if persistent:  # two Q / dO slots (128 KB) leave room for a 2-deep K / V ring only
        stages = min(stages, 2)
    grid = min(total, torch.cuda.get_device_properties(q.device).multi_processor_count) if persistent else total
    _dq_kernel[(grid,)](
        _descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        lse, delta, dq, items, num_items, cu_seqlens, max_entries, int(skip_len),
        lse.stride(0), dq.stride(0), float(softmax_scale) * LOG2E, float(softmax_scale), total,
        torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else num_items,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        PERSISTENT=bool(persistent), num_warps=CONSUMER_WARPS.value, maxnreg=MAXNREG)
    return dq


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor,
              num_items: torch.Tensor, softmax_scale: float, *, causal: bool = True, block_m: int = 128,
              block_n: int = 128, wl_block_m: int = 128, stages: int = 2, skip_len: int = 1,
              o: torch.Tensor | None = None, lse: torch.Tensor | None = None,
              persistent: bool = False, parts: int = 2, pingpong: bool = False,
              items_whole: bool = False, head_inner: bool = False,
              static: bool = False, part_skip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward (the programs of ``flash_fwd``), warp-specialized Gluon, sm_90.

    Args:
        q: ``(T, H_q, D)`` bf16 contiguous CUDA; k, v: ``(T, H_kv, D)``; D in {64, 128}.
        cu_seqlens, items, num_items: as ``flash_fwd`` (list built with ``block_m=wl_block_m``).
        softmax_scale: scale of ``q . k``; causal: causal mask inside each document.
        block_m / block_n: queries per program / keys per walked tile; stages: K/V ring depth.
        skip_len: items of documents of at most this many tokens, and merged items, are skipped
            (>= 1: this kernel has no per-token document mask); ``flash_fwd`` runs them.
        o, lse: optional preallocated outputs.
        persistent: one program per SM taking entries from a global counter, the next entry's Q
            (second slot) and K / V tiles loading while the current one computes (config
            ``fwd_gluon_persistent``; the head_dim 128 default).
        parts: consumer partitions (1: one of 8 warps, a 256-thread barrier before each slot release;
            2, the default: two of 4 warps, ``block_m / 2`` rows each, releasing each slot on their own,
            FA3's layout; config ``fwd_gluon_parts``).
        pingpong: with ``parts=2``, the two partitions take turns issuing their wgmma products
            (FlashAttention-3 §3.1; config ``fwd_gluon_pingpong``); ignored with ``parts=1``.
        items_whole: with ``persistent`` and ``parts=2``, a program claims whole list items and runs
            their ``wl_block_m / block_m`` query tiles back to back; a causal item holding a whole
            document whose keys fit the ring (<= ``stages * block_n`` tokens) loads each K / V tile
            once for all its query tiles (config ``fwd_gluon_items``; with ``wl_block_m=256``, W7's
            256-token documents read K / V once per (document, head)).
        head_inner: with ``items_whole``, claims take every query head of one item side by side
            (config ``fwd_gluon_head_inner``) instead of head after head.
        static: with ``items_whole``, the programs take their items by DESIGN.md §6's static snake
            (config ``fwd_gluon_static``) instead of a global atomic counter: no counter to zero
            (one fill launch fewer per call), no fenced atomic per claim.
        part_skip: with ``items_whole`` and no ``pingpong``: in causal entries each consumer
            partition computes only the walked tiles holding a key one of its rows sees (config
            ``fwd_gluon_part_skip``; with 64-key tiles the upper half of a 128-row diagonal entry skips
            the last tile: W7's 256-token documents run 10 of 12 half-tile products).

    Returns:
        ``(o, lse)``: ``(T, H_q, D)`` bf16 and ``(H_q, T)`` float32 natural-log LSE; rows of skipped
        items and padding rows untouched.

    Raises:
        ValueError: as :func:`gluon_dkdv` (inputs), ``skip_len < 1``, tiles that do not divide, ``parts``
            not 1 or 2, ``block_m / parts`` not a multiple of 64, tiles that need more shared memory
            than an sm_90 program has, ``items_whole`` without ``persistent`` and ``parts=2``, or
            ``head_inner`` / ``static`` without ``items_whole``, ``part_skip`` without ``items_whole``
            or with ``pingpong``.
    """
    _check_stages("gluon_fwd", stages)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts not in (1, 2):
        raise ValueError(f"gluon_fwd: parts must be the int 1 or 2, got {parts!r}")
    if head_inner and not items_whole:
        raise ValueError("gluon_fwd: head_inner needs items_whole=True")
    if static and not items_whole:
        raise ValueError("gluon_fwd: static needs items_whole=True")
    if part_skip and not (items_whole and not pingpong):
        raise ValueError(f"gluon_fwd: part_skip needs items_whole=True and pingpong=False, got "
                         f"items_whole={items_whole!r}, pingpong={pingpong!r}")
    if items_whole and not (persistent and parts == 2):
        raise ValueError(f"gluon_fwd: items_whole needs persistent=True and parts=2, got persistent={persistent!r}, "
                         f"parts={parts!r}")
    if (block_m // parts) % 64:
        raise ValueError(f"gluon_fwd: each of the {parts} consumer partitions needs a multiple of 64 query rows "
                         f"(wgmma), got block_m={block_m}")
    _check_inputs("gluon_fwd", q, k, v, q)
    if skip_len < 1:
        raise ValueError(f"gluon_fwd: skip_len must be >= 1 (merged items need the Triton kernel), got {skip_len}")
    if wl_block_m % block_m:
        raise ValueError(f"gluon_fwd: block_m={block_m} must divide wl_block_m={wl_block_m}")
    smem = ((2 if persistent else 1) * block_m + 2 * stages * block_n) * q.shape[2] * 2
    if smem > 227 * 1024:
        raise ValueError(f"gluon_fwd: block_m={block_m}, block_n={block_n}, stages={stages}"
                         f"{' (persistent: two Q slots)' if persistent else ''} need {smem} B of shared memory, "
                         f"more than the 232,448 B of an sm_90 program")
    T, H, D = q.shape
    Hkv = k.shape[1]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device) if lse is None else lse
    max_entries = items.shape[0] * (wl_block_m // block_m)
    if T == 0 or max_entries == 0:
        return o, lse
    total = max_entries * H
    grid = min(total, torch.cuda.get_device_properties(q.device).multi_processor_count) if persistent else total
    _fwd_kernel[(grid,)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), o, lse,
        items, num_items, cu_seqlens, max_entries, int(skip_len), o.stride(0), lse.stride(0),
        float(softmax_scale) * LOG2E, total,
        torch.zeros(1, dtype=torch.int32, device=q.device) if persistent and not static else num_items,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        CAUSAL=bool(causal), PERSISTENT=bool(persistent), PARTS=int(parts), PINGPONG=bool(pingpong) and parts == 2,
        ITEMS=bool(items_whole), HEAD_INNER=bool(head_inner), STATIC=bool(static),
        PART_SKIP=bool(part_skip), num_warps=CONSUMER_WARPS.value // int(parts), maxnreg=MAXNREG)
    return o, lse


def compile_sm90(kind: str = "dkdv", *, head_dim: int = 128, block_m: int | None = None, block_n: int | None = None,
                 stages: int | None = None, group: int = 1, causal: bool = True,
                 retire_first: bool = True, dq_reduce: bool = False, persistent: bool = False, parts: int = 2,
                 pingpong: bool = False, items_whole: bool = False, wl_block_m: int = 128,
                 head_inner: bool = False, static: bool = False, part_skip: bool = False) -> dict:
    """Compile one of this module's kernels for sm_90a WITHOUT a GPU (triton's bundled ptxas) and report.

    For screening before spending device time (benchmarks/gluon_compile_report.py prints it; the CPU
    tests keep the shipped kernels compiling). Pointer and stride arguments are marked divisible by
    16 as the launcher's specialization does at run time.

    Args:
        kind: ``"dkdv"``, ``"dq"`` or ``"fwd"``; the other arguments default to the shipped tiles of
            ``gluon_dkdv`` / ``gluon_dq`` / ``gluon_fwd``.
        parts: the forward's consumer partitions (``gluon_fwd(parts=)``; ignored for the other kinds).
        pingpong: the forward's ``gluon_fwd(pingpong=)`` (ignored for the other kinds); the default False
            is ``gluon_fwd``'s default and ``small_fwd_pers``'s kernel, the long-row config runs True
            (``fwd_gluon_pingpong`` in ``config.PERSISTENT_FWD``).
        items_whole, wl_block_m, head_inner, static, part_skip: the forward's ``gluon_fwd(items_whole=,
            wl_block_m=, head_inner=, static=, part_skip=)``.

    Returns:
        dict: ``shared`` (bytes), ``ptxas`` (ptxas -v stderr), ``spill_bytes`` (stores), ``serialized``
        (ptxas warning C7512/C7515: the wgmma products were serialized), ``sass`` (cuobjdump text),
        ``ptx``, ``ttgir``.

    Raises:
        ValueError: unknown kind; FileNotFoundError: no ptxas in the triton wheel;
        triton.compiler.errors.CompilationError: the kernel does not compile.
    """
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    if kind not in ("dkdv", "dq", "fwd"):
        raise ValueError(f"compile_sm90: kind must be 'dkdv', 'dq' or 'fwd', got {kind!r}")
    bm = block_m or (64 if kind == "dkdv" else 128)
    bn = block_n or {"dkdv": 128, "dq": 64, "fwd": 128}[kind]
    st = stages or {"dkdv": 2, "dq": 4, "fwd": 2}[kind]
    if isinstance(parts, bool) or parts not in (1, 2):
        raise ValueError(f"compile_sm90: parts must be 1 or 2, got {parts!r}")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise FileNotFoundError(f"compile_sm90: no ptxas at {ptxas}")
    x = torch.zeros(256, 16, head_dim, dtype=torch.bfloat16)
    rows, walked = mangle_type(_descriptor(x, bm)), mangle_type(_descriptor(x, bn))
    acc = mangle_type(_descriptor(x.float(), bm)) if dq_reduce else rows
    fn = {"dkdv": _dkdv_kernel, "dq": _dq_kernel, "fwd": _fwd_kernel}[kind]
    types = {"q_desc": rows, "do_desc": rows, "k_desc": walked, "v_desc": walked, "LSE": "*fp32", "DELTA": "*fp32",
             "DK": "*bf16", "DV": "*bf16", "DQ": "*bf16", "O": "*bf16", "items_ptr": "*i32", "num_items_ptr": "*i32",
             "cu_ptr": "*i32", "counter_ptr": "*i32", "qk_scale": "fp32", "sm_scale": "fp32", "dq_desc": acc}
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, WL_BM=wl_block_m, STAGES=st,
                  RETIRE_FIRST=bool(retire_first), CAUSAL=bool(causal), DQ_REDUCE=bool(dq_reduce),
                  PERSISTENT=bool(persistent), PARTS=int(parts), PINGPONG=bool(pingpong) and parts == 2,
                  ITEMS=bool(items_whole), HEAD_INNER=bool(head_inner), STATIC=bool(static),
                  PART_SKIP=bool(part_skip))
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": CONSUMER_WARPS.value // (int(parts) if kind == "fwd" else 1),
                                       "maxnreg": MAXNREG})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", os.path.join(d, "k.o")],
                              capture_output=True, text=True).stdout
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return {"shared": compiled.metadata.shared, "ptxas": r.stderr, "spill_bytes": sum(int(b) for b in spills),
            "serialized": "serialized" in r.stderr, "sass": sass, "ptx": compiled.asm["ptx"],
            "ttgir": compiled.asm["ttgir"]}
