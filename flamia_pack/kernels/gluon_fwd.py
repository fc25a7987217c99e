"""Experimental: the packed attention forward in Gluon, warp-specialized (Hopper, sm_90). Off by default.

The structure of ``gluon_bwd.py``'s dQ programs applied to FlashAttention's forward (Dao 2023,
Alg. 1; FlashAttention-3, Shah et al. 2024, §3.1): a one-warp TMA producer loads the program's
Q tile once and streams K / V tiles through a ``STAGES``-deep mbarrier ring; an 8-warp wgmma
consumer (two warpgroups, 240 registers each) runs per key tile ``S = Q K^T`` (async wgmma), the
online softmax in base 2 (``m``, ``l``, rescaled accumulator) and ``O += P V`` with P as the
register A operand, left in flight while the next tile's ``Q K^T`` is issued. Same work list, tile
decisions and outputs as ``flash_fwd`` (O in q's dtype, natural-log LSE ``(H_q, T)``).

Scope: non-merged items of documents longer than ``skip_len`` tokens (``flash_fwd`` runs merged
items and shorter documents in a Triton launch with ``sel = -skip_len``), causal or not, contiguous
bf16 q/k/v, head_dim 64 or 128. Config ``fwd_gluon`` (default False): compiled and screened on the
CPU (``benchmarks/gluon_compile_report.py``), not yet run on the GPU (benchmarks/NOTES.md).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from flamia_pack.kernels.flash_fwd import LOG2E
from flamia_pack.kernels.gluon_bwd import _check_inputs, _descriptor, _wgmma_layout

__all__ = ["gluon_fwd"]


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready, empty, q_bar,
                  rs, o_lo, h, hk, n_steps, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [rs, h * HEAD_DIM], q_bar, q_smem)
    for j in range(n_steps):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        row = o_lo + j * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_DIM], ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_DIM], ready.index(s), v_bufs.index(s))


@gluon.jit
def _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, j, acc, m_i, l_i, qk_scale,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr, op_layout: gl.constexpr, acc_layout: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    # groups retire in order: with S done, the previous tile's P V product is done too: free its slot
    st = warpgroup_mma_wait(0, deps=(st,))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
    st = st * qk_scale
    if MASKED:
        k_pos = o_lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = k_pos[None, :] < o_hi
        if CAUSAL:
            vis = vis & (k_pos[None, :] <= q_pos[:, None])
        st = gl.where(vis, st, -1.0e6)
    m_ij = gl.maximum(m_i, gl.max(st, 1))
    p = gl.exp2(st - m_ij[:, None])
    alpha = gl.exp2(m_i - m_ij)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout))[:, None]
    p_op = gl.convert_layout(p.to(gl.bfloat16), op_layout)
    acc = warpgroup_mma(p_op, v_bufs.index(s), acc, is_async=True)
    return acc, m_ij, l_i


@gluon.jit
def _fwd_consumer(q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                  rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale,
                  CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NW: gl.constexpr):
    s_layout: gl.constexpr = _wgmma_layout(NW, BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(NW, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_pos = rs + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(q_bar, 0)
    for j in range(0, u1):
        acc, m_i, l_i = _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, j, acc, m_i, l_i, qk_scale,
                                  False, CAUSAL, BLOCK_M, BLOCK_N, s_layout, op_layout, acc_layout)
    for j in range(u1, n_steps):
        acc, m_i, l_i = _fwd_step(q_smem, k_bufs, v_bufs, ready, empty, o_lo, o_hi, q_pos, j, acc, m_i, l_i, qk_scale,
                                  True, CAUSAL, BLOCK_M, BLOCK_N, s_layout, op_layout, acc_layout)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, acc_layout))[:, None]
    rows = rs + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(O + rows.to(gl.int64)[:, None] * stride_ot + h * HEAD_DIM + cols[None, :], out.to(gl.bfloat16),
             mask=(rows < re)[:, None])
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    gl.store(LSE + h * stride_lh + q_pos, lse, mask=q_pos < re)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, O, LSE, items_ptr, num_items_ptr, cu_ptr, max_entries, skip_len,
                stride_ot, stride_lh, qk_scale,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                WL_BM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    # head-major grid (flash_fwd's grid_head_major): kv head after kv head, entries in decreasing
    # cost inside it, the query heads of one GQA group side by side (they share K / V in L2)
    pid = gl.program_id(0)
    x = pid % (max_entries * GROUP)
    e = x // GROUP
    h = (pid // (max_entries * GROUP)) * GROUP + x % GROUP
    hk = h // GROUP
    F: gl.constexpr = WL_BM // BLOCK_M
    # tiles_triton.program_geometry, rows are queries (non-merged items only: skip_len >= 1); the same
    # lines as gluon_bwd._item_span, inline: calling a @gluon.jit function of another module fails to
    # compile on triton 3.6 (IndexError in the code generator)
    valid = e < gl.load(num_items_ptr) * F
    it = gl.where(valid, e // F, 0)
    doc = gl.load(items_ptr + it * 4)
    qs = gl.load(items_ptr + it * 4 + 1)
    qe = gl.load(items_ptr + it * 4 + 2)
    ds = gl.load(cu_ptr + doc)
    de = gl.load(cu_ptr + doc + 1)
    keep = valid & ((skip_len == 0) | ((qe <= de) & (de - ds > skip_len)))
    if not keep:
        return
    rs = qs + (e % F) * BLOCK_M
    re = gl.minimum(rs + BLOCK_M, qe)
    if rs >= re:
        return
    o_lo = ds
    if CAUSAL:
        o_hi = re
        u1 = gl.maximum(rs - o_lo + 1, 0) // BLOCK_N
    else:
        o_hi = de
        u1 = (o_hi - o_lo) // BLOCK_N
    n_steps = (o_hi - o_lo + BLOCK_N - 1) // BLOCK_N

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(q_bar, count=1)
    gl.warp_specialize([
        (_fwd_consumer, (q_smem, k_bufs, v_bufs, ready, empty, q_bar, O, LSE, stride_ot, stride_lh,
                         rs, re, o_lo, o_hi, h, n_steps, u1, qk_scale, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, 8)),
        (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, ready, empty, q_bar,
                         rs, o_lo, h, hk, n_steps, HEAD_DIM, BLOCK_N)),
    ], [1], [24])


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, items: torch.Tensor,
              num_items: torch.Tensor, softmax_scale: float, *, causal: bool = True, block_m: int = 128,
              block_n: int = 128, wl_block_m: int = 128, stages: int = 2, skip_len: int = 1,
              o: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention forward (the programs of ``flash_fwd``), warp-specialized Gluon, sm_90.

    Args:
        q: ``(T, H_q, D)`` bf16 contiguous CUDA; k, v: ``(T, H_kv, D)``; D in {64, 128}.
        cu_seqlens, items, num_items: as ``flash_fwd`` (list built with ``block_m=wl_block_m``).
        softmax_scale: scale of ``q . k``; causal: causal mask inside each document.
        block_m / block_n: queries per program / keys per walked tile; stages: K/V ring depth.
        skip_len: items of documents of at most this many tokens, and merged items, are skipped
            (>= 1: this kernel has no per-token document mask); ``flash_fwd`` runs them.
        o, lse: optional preallocated outputs.

    Returns:
        ``(o, lse)``: ``(T, H_q, D)`` bf16 and ``(H_q, T)`` float32 natural-log LSE; rows of skipped
        items and padding rows untouched.

    Raises:
        ValueError: as ``gluon_bwd.gluon_dkdv`` (inputs), ``skip_len < 1``, or tiles that do not divide.
    """
    _check_inputs("gluon_fwd", q, k, v, q)
    if skip_len < 1:
        raise ValueError(f"gluon_fwd: skip_len must be >= 1 (merged items need the Triton kernel), got {skip_len}")
    if wl_block_m % block_m:
        raise ValueError(f"gluon_fwd: block_m={block_m} must divide wl_block_m={wl_block_m}")
    T, H, D = q.shape
    Hkv = k.shape[1]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device) if lse is None else lse
    max_entries = items.shape[0] * (wl_block_m // block_m)
    if T == 0 or max_entries == 0:
        return o, lse
    maxnreg = (65536 // (12 * 32)) // 8 * 8
    _fwd_kernel[(max_entries * H,)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), o, lse,
        items, num_items, cu_seqlens, max_entries, int(skip_len), o.stride(0), lse.stride(0),
        float(softmax_scale) * LOG2E,
        GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WL_BM=wl_block_m, STAGES=stages,
        CAUSAL=bool(causal), num_warps=8, maxnreg=maxnreg)
    return o, lse
