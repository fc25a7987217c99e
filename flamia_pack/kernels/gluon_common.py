"""Shared pieces of the warp-specialized Gluon attention kernels (Hopper, sm_90): the TMA ring and its
mbarriers, the producer -> consumer hand-over of persistent programs, work-list claims and geometry,
epilogue stores, TMA descriptors and the launchers' input checks.

Every kernel of ``gluon_fwd.py``, ``gluon_dkdv.py`` and ``gluon_dq.py`` is FlashAttention-3's layout
(Shah et al. 2024, §3): one **producer** warp (24 registers) issues TMA loads into a ``STAGES``-deep
shared-memory ring, each slot guarded by a ``ready`` / ``empty`` mbarrier pair; the **consumer**
warps (two warpgroups, 240 registers each after ``setmaxnreg``) run the wgmma products and release a
slot once the products that read it retired. Persistent programs (one per SM) take work-list entries
from a global atomic counter (the dynamic policy of DESIGN.md §6) and hand each entry's index and
geometry to the consumer through a 16-int shared-memory slot (``_handoff_store`` / ``_handoff_load``).
Masks only on the causal-diagonal tiles and the tile cut by the document end, as in ``tiles.py``.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

__all__ = ["CONSUMER_WARPS", "MAXNREG", "descriptor", "check_inputs", "check_stages"]


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
    every 32-byte sector is written in two halves -- twice the L2 write requests (ncu on W7's forward:
    8.4 M excessive sectors, the ``STG`` the top stall). A TMA store instead would make the slot wait
    for the TMA engine's read before it is released (long rows 0.95x)."""
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
def _store_doc_rows(ptr, x, row0, row_start, row_end, stride_row, col0):
    """:func:`_store_rows` for the rows ``row_start <= row0 + r < row_end``: a tile that starts before its
    document (the FP8 backward's key tiles on the grid ``floor16(start) + 128 n``) must not write the
    previous document's rows. A sibling rather than a ``row_start`` argument of :func:`_store_rows`,
    whose callers' tiles never start before their rows."""
    ROWS: gl.constexpr = x.type.shape[0]
    COLS: gl.constexpr = x.type.shape[1]
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, x.type.layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, x.type.layout))
    ok = ((rows >= row_start) & (rows < row_end))[:, None]
    gl.store(ptr + rows.to(gl.int64)[:, None] * stride_row + col0 + cols[None, :], x, mask=ok)


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
def _rows_produce_entry(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, ready, empty, qo_bar,
                        rs, o_lo, h, hk, n_steps, c, j0, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                        HAS_DO: gl.constexpr, V_T: gl.constexpr = False, qlo_desc=None, klo_desc=None,
                        qlo_smem=None, klo_bufs=None, QK_LO: gl.constexpr = False, vlo_desc=None, vlo_bufs=None,
                        V_LO: gl.constexpr = False):
    """One entry's loads for programs that own query rows (dQ, forward): its Q (and dO) tile once
    (``qo_bar``), then its K / V tiles ``j0, ..., n_steps - 1`` into the ring at positions ``c + j``
    (``c + n_steps`` returned; ``j0 > 0``: the forward's item-sharing entries, whose first tiles the
    item's previous entry left in the ring, ``_fwd_item_producer_loop``). The
    forward (no dO) has separate K and V barriers (``_ring(SPLIT_KV=True)``): V slot ``s`` is waited on
    and released through barriers ``STAGES + s``, since its consumer frees K slot ``r`` once ``S_r``
    retired, in step ``r``, and V slot ``r`` only in step ``r + 1``, after ``P_r V_r`` (``_fwd_step``).
    ``V_T``: ``v_desc`` is the feature-major copy (``(H_kv * D, T)``, the FP8 forward's V^T), so a V tile
    is the ``D x BLOCK_N`` box at ``[hk * D, row]``. ``QK_LO`` (the FP8 forward's two-term Q and K): each Q
    tile's residual codes ride on the Q barrier and each K tile's on the K barrier; ``V_LO`` (its two-term P~ and V):
    each V tile's on the V barrier."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    if HAS_DO:
        mbarrier.expect(qo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    elif QK_LO:
        mbarrier.expect(qo_bar, q_desc.block_type.nbytes + qlo_desc.block_type.nbytes)
    else:
        mbarrier.expect(qo_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [rs, h * HEAD_DIM], qo_bar, q_smem)
    if HAS_DO:
        tma.async_copy_global_to_shared(do_desc, [rs, h * HEAD_DIM], qo_bar, do_smem)
    if QK_LO:
        tma.async_copy_global_to_shared(qlo_desc, [rs, h * HEAD_DIM], qo_bar, qlo_smem)
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
            if QK_LO:
                mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + klo_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(klo_desc, [row, hk * HEAD_DIM], ready.index(s), klo_bufs.index(s))
            else:
                mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_DIM], ready.index(s), k_bufs.index(s))
            mbarrier.wait(empty.index(STAGES + s), ((r // STAGES) & 1) ^ 1)
            if V_LO:  # (the FP8 forward: V^T boxes)
                mbarrier.expect(ready.index(STAGES + s), 2 * v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(vlo_desc, [hk * HEAD_DIM, row], ready.index(STAGES + s),
                                                vlo_bufs.index(s))
            else:
                mbarrier.expect(ready.index(STAGES + s), v_desc.block_type.nbytes)
            if V_T:
                tma.async_copy_global_to_shared(v_desc, [hk * HEAD_DIM, row], ready.index(STAGES + s),
                                                v_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_DIM], ready.index(STAGES + s),
                                                v_bufs.index(s))
    return c + n_steps


@gluon.jit
def _rows_producer_loop(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                        qo_ready, qo_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries,
                        skip_len, total, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, CAUSAL: gl.constexpr, IS_FWD: gl.constexpr,
                        V_T: gl.constexpr = False, qlo_desc=None, klo_desc=None, qlo_bufs=None, klo_bufs=None,
                        QK_LO: gl.constexpr = False, vlo_desc=None, vlo_bufs=None, V_LO: gl.constexpr = False):
    """Persistent dQ / forward programs' producer: as ``_dkdv_producer_loop`` (global counter, the
    index and geometry handed over in ``t_smem``), the Q (and dO) tiles in slot ``n % 2``, the K / V ring
    running on. ``V_T`` (the FP8 forward, ``v_desc`` over V^T, as ``_rows_produce_entry``): each entry's
    key walk starts at the 16-token boundary at or before its document's first token (TMA boxes of V^T,
    whose token axis is the contiguous one, must start 16-byte aligned), and the hand-over's tenth value
    is ``ph``, the document's first key relative to that start."""
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
            if V_T:
                ph = o_lo % 16
                o_lo = o_lo - ph
                n_steps = (o_hi - o_lo + BLOCK_N - 1) // BLOCK_N
                if CAUSAL:  # tiles wholly at or before the entry's first row
                    u1 = (rs - o_lo + 1) // BLOCK_N
                else:
                    u1 = (o_hi - o_lo) // BLOCK_N
            else:
                ph = 0  # the tenth hand-over value (rel) is read only by ITEMS consumers
            slot = _claim_slot(qo_empty, n)
            _handoff_store(t_smem.index(slot), idx_layout, t, h, hk, rs, re, o_lo, o_hi, u1, n_steps, ph)
            if QK_LO:
                qlo_slot = qlo_bufs.index(slot)
            else:
                qlo_slot = None
            c = _rows_produce_entry(q_desc, do_desc, k_desc, v_desc, q_bufs.index(slot), do_bufs.index(slot),
                                    k_bufs, v_bufs, ready, empty, qo_ready.index(slot), rs, o_lo, h, hk, n_steps,
                                    c, 0, HEAD_DIM, BLOCK_N, not IS_FWD, V_T, qlo_desc, klo_desc, qlo_slot, klo_bufs,
                                    QK_LO, vlo_desc, vlo_bufs, V_LO)
            n += 1
        t = t_next
    slot = _claim_slot(qo_empty, n)
    _handoff_store(t_smem.index(slot), idx_layout, n_total, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    mbarrier.arrive(qo_ready.index(slot), count=1)


@functools.cache
def smem_layout(block_rows: int, head_dim: int, fp32: bool):
    """The NVMMA shared layout of a ``block_rows x head_dim`` TMA block (built once per shape: it is
    an immutable value, and building it cost ~50 us of host time per attention call)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl.float32 if fp32 else gl.bfloat16)


def descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over ``x`` (T, H, D) bf16 or float32 viewed as (T, H * D), blocks of ``block_rows`` tokens x D."""
    T, H, D = x.shape
    layout = smem_layout(block_rows, D, x.dtype == torch.float32)
    return TensorDescriptor(x.view(T, H * D), [T, H * D], [H * D, 1], [block_rows, D], layout)


def check_stages(fn: str, stages: int) -> None:
    """The ring needs >= 2 slots: the dK/dV and dQ consumers release a slot only once the next one is
    ready, so one slot would hang every program that walks two or more tiles (the forward, whose K and V
    have their own barriers, would not hang, but is held to the same rule)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"{fn}: stages (the ring depth) must be an int >= 2, got {stages!r}")


def check_inputs(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> None:
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
