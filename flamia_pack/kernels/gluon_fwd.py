"""Packed attention forward in Gluon, warp-specialized and persistent (sm_90).

FlashAttention-3's forward (Shah et al. 2024, §3.1-3.2) on the work list: one program per SM takes
entries from a global counter; a producer warp loads Q once per entry (two slots: the next entry's
loads under the current one's compute) and K / V through the ring with their own barriers; **two
4-warp consumer partitions** of ``BLOCK_M / 2`` query rows each run ``S = Q K^T``, the base-2 online
softmax and ``O += P V`` (P as the register A operand), software-pipelined (``S_j`` and
``P_{j-1} V_{j-1}`` in flight together), optionally taking turns issuing their products
(ping-pong). Two independent partitions rather than one 8-warp consumer: a Gluon ``mbarrier.arrive``
follows a barrier of its whole partition, so one 8-warp consumer would meet at a 256-thread barrier
at every slot release. With whole-item claims a short document's K / V tiles load once for all its
query tiles. Merged items and 1-token documents run in ``flash_fwd``'s Triton kernel. Shared pieces:
``gluon_common.py``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait)

from flamia_pack.kernels.constants import LOG2E
from flamia_pack.kernels.gluon_common import (
    _wgmma_layout, _handoff_store, _entry_counts, _claim_slot, _next_entry, _handoff_load, _zero_rows_from,
    _rows_through_smem, _release_after_reads, _store_rows, _query_rows, _ring, _slot_barriers, _rows_span,
    _rows_produce_entry, _rows_producer_loop, descriptor, check_stages, check_inputs, CONSUMER_WARPS,
    MAXNREG)

__all__ = ["gluon_fwd"]


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
                       WG: gl.constexpr, NW: gl.constexpr, PINGPONG: gl.constexpr = False,
                       PART_SKIP: gl.constexpr = False):
    """One entry's forward from ring position ``c`` (returned advanced) and its O / LSE stores, by the
    consumer partition ``WG`` of ``NW = 4`` warps (rows ``WG * BLOCK_M / 2`` on of the entry's
    ``BLOCK_M``, each of the two partitions arriving on the shared slot barriers (count 2) on its own:
    FA3's two consumer warpgroups, which no CTA-wide barrier couples); its Q slot is handed back
    (``q_empty``) once its last product retired. Tile 0's
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
    _release_after_reads(q_empty)  # the next entry's Q may load
    _store_rows(O, out, r0, re, stride_ot, h * HEAD_DIM)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    gl.store(LSE + h * stride_lh + q_pos, lse, mask=q_pos < re)
    return c + n_all * rel


@gluon.jit
def _fwd_item_producer_loop(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem,
                            counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len, total,
                            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, WL_BM: gl.constexpr, CAUSAL: gl.constexpr):
    """Persistent forward programs' producer claiming whole list items (``gluon_fwd(items=True)``):
    the item's ``F = WL_BM / BLOCK_M`` query tiles run back to back on this program, one entry each
    (Q slot ``n % 2``). A causal item that starts at its document's start and whose keys fit the ring
    (``ceil((q_end - doc_start) / BLOCK_N) <= STAGES``: a whole document of <= 256 tokens with 128-key
    tiles and 2 slots) loads each K / V tile once: the item's earlier entries release no slot
    (hand-over flag 0) and its last entry walks the same ring positions and frees them. So W7's
    256-token documents read K / V once from L2 per (document, head) instead of 1.5 times, and from
    DRAM once (the cost order re-read tile 0 ~4,000 entries later). Other items: independent entries
    (the second re-reads its K / V from L2 right after the first). Items are claimed from a global
    counter in the list's head-major order (kv head after kv head, decreasing cost inside it)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    F: gl.constexpr = WL_BM // BLOCK_M
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])
    n_valid, n_total = _entry_counts(num_items_ptr, max_entries // F, total // F, 1)
    c = 0
    n = 0
    t = gl.atomic_add(counter_ptr, 1)
    while t < n_total:
        t_next = gl.atomic_add(counter_ptr, 1)  # taken early: its latency hides under this item's loads
        # the head-major order over items (one entry per item: WL_BM = BLOCK_M there)
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
def _fwd_consumer_loop(q_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem, O, LSE, stride_ot,
                       stride_lh, qk_scale, num_items_ptr, max_entries, total, turn, GROUP: gl.constexpr,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WL_BM: gl.constexpr,
                       CAUSAL: gl.constexpr, WG: gl.constexpr, NW: gl.constexpr, PINGPONG: gl.constexpr = False,
                       ITEMS: gl.constexpr = False, PART_SKIP: gl.constexpr = False):
    """Consumer partition ``WG`` (of ``NW`` warps) of the persistent forward: the entries the producer
    hands over (``t_smem``), each run by ``_fwd_consume_entry``. ``ITEMS``: the producer claims whole
    list items (``_fwd_item_producer_loop``), so its stop signal is the item count and an entry may
    keep its ring slots for the item's next entry (hand-over flag ``rel``)."""
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
        else:  # every entry frees its slots and takes its turns from c + n
            rel = 1
            k_turn = c + n
        c = _fwd_consume_entry(q_bufs.index(slot), k_bufs, v_bufs, ready, empty, qo_ready.index(slot),
                               (n // QO_STAGES) & 1, qo_empty.index(slot), O, LSE, stride_ot, stride_lh, rs,
                               re, o_lo, o_hi, h, n_steps, u1, qk_scale, c, turn, k_turn, rel, CAUSAL, HEAD_DIM,
                               BLOCK_M, BLOCK_N, WG, NW, PINGPONG, PART_SKIP)
        kt += n_steps + 1
        n += 1
        t = _next_entry(qo_ready, t_smem, n, idx_layout)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, O, LSE, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len,
                stride_ot, stride_lh, qk_scale, total, counter_ptr,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                WL_BM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr = False,
                ITEMS: gl.constexpr = False, PART_SKIP: gl.constexpr = False):
    # one program per SM taking entries (ITEMS: whole items) from a global counter; two Q slots; two
    # 4-warp consumer partitions, half of each entry's rows each, and the producer warp
    PARTS: gl.constexpr = 2
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    q_ready, q_empty = _slot_barriers(2, True, PARTS)
    k_bufs, v_bufs, ready, empty = _ring(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM, True, True, PARTS)
    t_smem = gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    turn = _turn_barriers(q_ready, PINGPONG)
    if ITEMS:
        gl.warp_specialize([
            (_fwd_consumer_loop, (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                  stride_ot, stride_lh, qk_scale, num_items_ptr, max_entries, total, turn, GROUP,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 0, 4, PINGPONG, True, PART_SKIP)),
            (_fwd_consumer_loop, (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                  stride_ot, stride_lh, qk_scale, num_items_ptr, max_entries, total, turn, GROUP,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 1, 4, PINGPONG, True, PART_SKIP)),
            (_fwd_item_producer_loop, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready,
                                       q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr, max_entries,
                                       skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_fwd_consumer_loop, (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                  stride_ot, stride_lh, qk_scale, num_items_ptr, max_entries, total, turn, GROUP,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 0, 4, PINGPONG)),
            (_fwd_consumer_loop, (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, q_empty, t_smem, O, LSE,
                                  stride_ot, stride_lh, qk_scale, num_items_ptr, max_entries, total, turn, GROUP,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL, 1, 4, PINGPONG)),
            (_rows_producer_loop, (q_desc, q_desc, k_desc, v_desc, q_bufs, q_bufs, k_bufs, v_bufs, ready, empty,
                                   q_ready, q_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                   max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, CAUSAL,
                                   True)),
        ], [4, 1], [240, 24])


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor,
              num_items: torch.Tensor, softmax_scale: float, *, causal: bool = True, block_m: int = 128,
              block_n: int = 128, wl_block_m: int = 128, stages: int = 2, skip_len: int = 1,
              o: torch.Tensor | None = None, lse: torch.Tensor | None = None, pingpong: bool = False,
              items_whole: bool = False, part_skip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward (the programs of ``flash_fwd``), warp-specialized Gluon, sm_90.

    One persistent program per SM takes work-list entries from a global counter (the dynamic
    policy of DESIGN.md §6); its producer warp loads the next entry's Q (second slot) and K / V
    tiles while two 4-warp consumer partitions (``block_m / 2`` rows each) compute the current one.

    Args:
        q: ``(T, H_q, D)`` bf16 contiguous CUDA; k, v: ``(T, H_kv, D)``; D in {64, 128}.
        cu_seqlens, items, num_items: as ``flash_fwd`` (list built with ``block_m=wl_block_m``).
        softmax_scale: scale of ``q . k``; causal: causal mask inside each document.
        block_m / block_n: queries per entry / keys per walked tile; stages: K/V ring depth (>= 2).
        skip_len: items of documents of at most this many tokens, and merged items, are skipped
            (>= 1: this kernel has no per-token document mask); ``flash_fwd`` runs them.
        o, lse: optional preallocated outputs.
        pingpong: the two partitions take turns issuing their wgmma products (FlashAttention-3 §3.1).
        items_whole: a program claims whole list items and runs their ``wl_block_m / block_m`` query
            tiles back to back; a causal item holding a whole document whose keys fit the ring
            (<= ``stages * block_n`` tokens) loads each K / V tile once for all its query tiles.
        part_skip: with ``items_whole`` and no ``pingpong``: in causal entries each consumer
            partition computes only the walked tiles holding a key one of its rows sees (with 64-key
            tiles the upper half of a 128-row diagonal entry skips the last tile).

    Returns:
        ``(o, lse)``: ``(T, H_q, D)`` bf16 and ``(H_q, T)`` float32 natural-log LSE; rows of skipped
        items and padding rows untouched.

    Raises:
        ValueError: as :func:`~flamia_pack.kernels.gluon_common.check_inputs` (inputs), ``skip_len < 1``,
            tiles that do not divide, ``block_m / 2`` not a multiple of 64, tiles that need more
            shared memory than an sm_90 program has, ``part_skip`` without ``items_whole`` or with
            ``pingpong``.
    """
    check_stages("gluon_fwd", stages)
    if part_skip and not (items_whole and not pingpong):
        raise ValueError(f"gluon_fwd: part_skip needs items_whole=True and pingpong=False, got "
                         f"items_whole={items_whole!r}, pingpong={pingpong!r}")
    if (block_m // 2) % 64:
        raise ValueError(f"gluon_fwd: each of the 2 consumer partitions needs a multiple of 64 query rows "
                         f"(wgmma), got block_m={block_m}")
    check_inputs("gluon_fwd", q, k, v, q)
    if skip_len < 1:
        raise ValueError(f"gluon_fwd: skip_len must be >= 1 (merged items need the Triton kernel), got {skip_len}")
    if wl_block_m % block_m:
        raise ValueError(f"gluon_fwd: block_m={block_m} must divide wl_block_m={wl_block_m}")
    smem = (2 * block_m + 2 * stages * block_n) * q.shape[2] * 2
    if smem > 227 * 1024:
        raise ValueError(f"gluon_fwd: block_m={block_m}, block_n={block_n}, stages={stages} (two Q slots) need "
                         f"{smem} B of shared memory, more than the 232,448 B of an sm_90 program")
    T, H, D = q.shape
    Hkv = k.shape[1]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device) if lse is None else lse
    max_entries = items.shape[0] * (wl_block_m // block_m)
    if T == 0 or max_entries == 0:
        return o, lse
    total = max_entries * H
    grid = min(total, torch.cuda.get_device_properties(q.device).multi_processor_count)
    _fwd_kernel[(grid,)](
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), o, lse,
        items, num_items, cu_seqlens, max_entries, int(skip_len), o.stride(0), lse.stride(0),
        float(softmax_scale) * LOG2E, total, torch.zeros(1, dtype=torch.int32, device=q.device),
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        CAUSAL=bool(causal), PINGPONG=bool(pingpong), ITEMS=bool(items_whole), PART_SKIP=bool(part_skip),
        num_warps=CONSUMER_WARPS.value // 2, maxnreg=MAXNREG)
    return o, lse
