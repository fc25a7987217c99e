"""dQ programs of the packed causal attention backward in Gluon, warp-specialized (sm_90).

A program owns ``BLOCK_M`` queries of one query head (Q, dO loaded once) and walks the visible
``BLOCK_N``-key tiles (K, V through the ring): ``S = Q K^T`` and ``dP = dO V^T`` as wgmma products,
``dS = P (dP - Delta)`` in registers, ``dQ += dS K`` with dS as the register A operand. One program
per entry, or (``persistent``) one per SM taking entries from a global counter with the next entry's
Q / dO in a second slot. Used where dQ is not reduced by the dK/dV programs (``deterministic=True``,
the persistent band). Shared pieces: ``gluon_common.py``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from flamia_pack.kernels.constants import LOG2E
from flamia_pack.kernels.gluon_common import (
    _wgmma_layout, _entry_counts, _next_entry, _handoff_load, _zero_rows_from, _rows_through_smem,
    _release_after_reads, _store_rows, _query_rows, _ring, _rows_span, _rows_produce_entry,
    _rows_producer_loop, descriptor, check_stages, check_inputs, CONSUMER_WARPS, MAXNREG)

__all__ = ["gluon_dq"]


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
def _dq_consumer_loop(q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem, DQ, LSE, DELTA,
                      stride_dqt, stride_lh, qk_scale, sm_scale, num_items_ptr, max_entries, total,
                      GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      WL_BM: gl.constexpr):
    """The persistent dQ programs' consumer: the entries the producer hands over (``t_smem``), each
    run by ``_dq_consume_entry``."""
    QO_STAGES: gl.constexpr = q_bufs.type.shape[0]
    F: gl.constexpr = WL_BM // BLOCK_M
    idx_layout: gl.constexpr = gl.BlockedLayout([16], [32], [8], [0])  # each thread: the whole slot
    _n_valid, n_total = _entry_counts(num_items_ptr, max_entries, total, F)
    c = 0
    n = 0
    t = _next_entry(qo_ready, t_smem, n, idx_layout)
    while t < n_total:
        slot = n % QO_STAGES
        t, h, hk, rs, re, o_lo, o_hi, u1, n_steps, rel = _handoff_load(t_smem.index(slot), idx_layout)
        c = _dq_consume_entry(q_bufs.index(slot), do_bufs.index(slot), k_bufs, v_bufs, ready, empty,
                              qo_ready.index(slot), (n // QO_STAGES) & 1, qo_empty.index(slot), LSE, DELTA, DQ,
                              stride_lh, stride_dqt, rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, sm_scale, c,
                              HEAD_DIM, BLOCK_M, BLOCK_N, True)
        n += 1
        t = _next_entry(qo_ready, t_smem, n, idx_layout)


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
            (_dq_consumer_loop, (q_bufs, do_bufs, k_bufs, v_bufs, ready, empty, qo_ready, qo_empty, t_smem, DQ, LSE,
                                 DELTA, stride_dqt, stride_lh, qk_scale, sm_scale, num_items_ptr,
                                 max_entries, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM)),
            (_rows_producer_loop, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, ready, empty,
                                   qo_ready, qo_empty, t_smem, counter_ptr, items_ptr, num_items_ptr, cu_ptr,
                                   max_entries, skip_len, total, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, WL_BM, True,
                                   False)),
        ], [1], [24])


def gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor,
             softmax_scale: float, *, block_m: int = 128, block_n: int = 64, wl_block_m: int = 128,
             stages: int = 4, skip_len: int = 0, dq: torch.Tensor | None = None,
             persistent: bool = False) -> torch.Tensor:
    """dQ of causal packed attention (the dQ programs of ``flash_bwd``), warp-specialized Gluon.

    Args: as :func:`gluon_dkdv`; ``block_m`` queries per program, ``block_n`` keys per walked tile;
    ``dq`` an optional preallocated output; ``persistent``: one program per SM taking entries from a
    global counter, the next entry's Q / dO (second slot) and K / V tiles loading while the current
    one computes (K / V ring at most 2 deep then; config ``GluonBwdConfig.persistent``; on for MHA rows
    of 513-1,024 tokens, W3: 1.02-1.04x).

    Returns:
        ``dq`` ``(T, H_q, D)`` bf16; rows of skipped items (``skip_len``) and padding rows untouched.

    Raises:
        ValueError: as :func:`gluon_dkdv`.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    check_stages("gluon_dq", stages)
    check_inputs("gluon_dq", q, k, v, do)
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
        descriptor(q, block_m), descriptor(do, block_m), descriptor(k, block_n), descriptor(v, block_n),
        lse, delta, dq, items, num_items, cu_seqlens, max_entries, int(skip_len),
        lse.stride(0), dq.stride(0), float(softmax_scale) * LOG2E, float(softmax_scale), total,
        torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else num_items,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        PERSISTENT=bool(persistent), num_warps=CONSUMER_WARPS.value, maxnreg=MAXNREG)
    return dq
