"""Packed (document-masked) attention backward in Triton for Hopper, driven by the work list.

FlashAttention-2 backward (Dao 2023, Alg. 2) with the forward's tile decisions (tiles.py)::

    preprocess:  Delta_i = sum_d dO_id * O_id  - dLSE_i                       (fp32)
    P_ij  = 2^(s_ij * log2(e) - lse_i * log2(e))      (recomputed from the saved LSE)
    dV_j  = sum_i P_ij dO_i ;   dP_ij = dO_i . v_j ;   dS_ij = P_ij (dP_ij - Delta_i)
    dK_j  = softmax_scale * sum_i dS_ij q_i ;   dQ_i = softmax_scale * sum_j dS_ij k_j

One fused launch holds two program kinds, interleaved rank by rank of the sorted work list so
both start with their most expensive work:

- dK/dV programs own ``bwd_block_n1`` keys of one kv head and walk the query tiles after them
  (causal) up to the end of the document; for GQA they also loop over the ``H_q / H_kv`` query
  heads of the group, so dK/dV are summed in registers and written once (no atomics);
- dQ programs own ``bwd_block_m2`` queries of one query head and walk the visible key tiles.

Programs launch kv head after kv head (its dK/dV programs and its group's dQ programs interleaved
rank by rank). The Triton path uses no atomics: it is deterministic (bitwise reproducible run to
run); the price is recomputing QK^T and dO V^T in both program kinds (7 matrix products per tile pair
instead of 5), as in FlashAttention-2's Triton kernels and FlexAttention. Padding rows
(``>= cu_seqlens[-1]``) get zero gradients.

With ``config.gluon_bwd`` (the default on sm_90) causal calls run both program kinds as the
warp-specialized Gluon kernels of ``gluon_dkdv.py`` / ``gluon_dq.py`` instead (by default the dK/dV
programs also reduce dQ, ``GluonBwdConfig.dq_reduce``), and this file's kernel only for merged items
and documents of at most ``GluonBwdConfig.min_len`` tokens, on ``config.SMALL_BWD`` tiles, in one
launch with ``sel = -min_len``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flamia_pack.kernels.config import SMALL_BWD, AttentionKernelConfig, gluon_bwd_min_len
from flamia_pack.kernels.constants import LOG2E
from flamia_pack.kernels.flash_fwd import fill_tails, gluon_applies
from flamia_pack.kernels.tiles_triton import masked_tile_index, program_geometry, relative_doc, tile_visible


@triton.jit
def _gluon_rows(CU, n_docs, rows, T, skip, n_steps):
    """Mask of the ``rows`` (int32 block) the Gluon dK/dV programs own: rows of documents longer than
    ``skip`` tokens, and padding rows past ``cu_seqlens[-1]`` (their dQ is zero).

    A branch-free binary search over ``cu_seqlens`` (``n_steps >= ceil(log2(n_docs + 1))``) for the
    document ``d`` with ``cu[d] <= row < cu[d + 1]``.
    """
    lo = tl.zeros_like(rows)
    hi = lo + n_docs
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        go = tl.load(CU + mid, mask=rows < T, other=0) <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    start = tl.load(CU + lo, mask=rows < T, other=0)
    end = tl.load(CU + lo + 1, mask=rows < T, other=0)
    total = tl.load(CU + n_docs)
    return (rows >= total) | (end - start > skip)


@triton.jit
def _row_delta(o, do, dlse_ptrs, mask, HAS_DLSE: tl.constexpr):
    """``Delta = rowsum(O * dO) - dLSE`` (fp32) of one block of query rows whose ``O`` / ``dO`` tiles are
    loaded; ``dLSE`` read (masked) only with ``HAS_DLSE``. FlashAttention-2 Algorithm 2's ``D_i``."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptrs, mask=mask, other=0.0)
    return delta


@triton.jit(do_not_specialize=["T", "n_docs", "skip", "n_steps", "acc_heads"])
def _bwd_preprocess(O, DO, DLSE, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
                    DQ_ACC, CU, n_docs, skip, n_steps, acc_heads,
                    HAS_DLSE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    ZERO_DQ: tl.constexpr):
    """``Delta[h, t] = sum_d O[t, h, d] * dO[t, h, d] - dLSE[h, t]`` (fp32).

    With ``ZERO_DQ`` it also zeroes the contiguous ``(T, acc_heads, HEAD_DIM)`` fp32 dQ accumulator of
    the Gluon dQ reduce (the first chunk's heads ``h < acc_heads``) on the rows those programs own
    (:func:`_gluon_rows`); the other rows are left alone.
    """
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows.to(tl.int64)[:, None] * stride_dot + h * stride_doh + d[None, :], mask=ok[:, None], other=0.0)
    delta = _row_delta(o, do, DLSE + h * stride_lh + rows, ok, HAS_DLSE)
    tl.store(DELTA + h * stride_lh + rows, delta, mask=ok)
    if ZERO_DQ:
        if h < acc_heads:
            own = ok & _gluon_rows(CU, n_docs, rows, T, skip, n_steps)
            acc = DQ_ACC + (rows.to(tl.int64)[:, None] * acc_heads + h) * HEAD_DIM + d[None, :]
            tl.store(acc, tl.zeros((BLOCK, HEAD_DIM), tl.float32), mask=own[:, None])


@triton.jit(do_not_specialize=["T", "n_docs", "skip", "n_steps", "acc_heads", "h0"])
def _dq_reduce_cast(DQ_ACC, DQ, CU, n_docs, skip, n_steps, T, acc_heads, h0, stride_qt, stride_qh, sm_scale,
                    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ZERO_AFTER: tl.constexpr):
    """``dQ[:, h0 + h] = softmax_scale * acc[:, h]`` (the ``(T, acc_heads, HEAD_DIM)`` fp32 accumulator of
    the Gluon dQ reduce -> dQ's dtype) on the rows those programs own (:func:`_gluon_rows`); the
    other rows are left to the small-document launch. With ``ZERO_AFTER`` the read rows are zeroed
    for the next chunk of heads. Grid ``(cdiv(T, BLOCK), heads of the chunk)``."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    own = (rows < T) & _gluon_rows(CU, n_docs, rows, T, skip, n_steps)
    d = tl.arange(0, HEAD_DIM)
    ptrs = DQ_ACC + (rows.to(tl.int64)[:, None] * acc_heads + h) * HEAD_DIM + d[None, :]
    acc = tl.load(ptrs, mask=own[:, None], other=0.0)
    tl.store(DQ + rows.to(tl.int64)[:, None] * stride_qt + (h0 + h) * stride_qh + d[None, :],
             (acc * sm_scale).to(DQ.dtype.element_ty), mask=own[:, None])
    if ZERO_AFTER:
        tl.store(ptrs, tl.zeros((BLOCK, HEAD_DIM), tl.float32), mask=own[:, None])


@triton.jit
def _dkdv_tile(
    Q, K, V, DO, LSE, DELTA, DK, DV, items_ptr, cu_ptr, n_docs, e, hk, sel,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    qk_scale, sm_scale, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    F1: tl.constexpr, WL_BM: tl.constexpr, CAUSAL: tl.constexpr, MASKED_STAGES: tl.constexpr,
):
    rs, re, o_lo, o_hi, n, u0, u1, merged, doc = program_geometry(
        items_ptr, cu_ptr, e, sel, F1, WL_BM, BLOCK_N1, BLOCK_M1, True, CAUSAL)
    if rs < re:
        offs_n = tl.arange(0, BLOCK_N1)
        offs_m = tl.arange(0, BLOCK_M1)
        offs_d = tl.arange(0, HEAD_DIM)
        k_pos = rs + offs_n
        k_ok = k_pos < re
        k = tl.load(K + rs.to(tl.int64) * stride_kt + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                    mask=k_ok[:, None], other=0.0)
        v = tl.load(V + rs.to(tl.int64) * stride_vt + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                    mask=k_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
        r_rel = relative_doc(k_pos, cu_ptr, doc, tl.maximum(re, o_hi), merged)
        for g in range(0, GROUP):  # a compile-time trip count: MHA has no loop (and no spills, sm_90)
            h = hk * GROUP + g
            q_ptrs = Q + o_lo.to(tl.int64) * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
            do_ptrs = DO + o_lo.to(tl.int64) * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :]
            l_ptrs = LSE + h * stride_lh + o_lo + offs_m
            d_ptrs = DELTA + h * stride_lh + o_lo + offs_m
            # mask-free query tiles
            for t in range(u0, u1):
                q = tl.load(q_ptrs + t * BLOCK_M1 * stride_qt)
                lse2 = tl.load(l_ptrs + t * BLOCK_M1) * 1.4426950408889634
                s_t = tl.dot(k, tl.trans(q))
                p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
                do = tl.load(do_ptrs + t * BLOCK_M1 * stride_dot)
                dv = tl.dot(p_t.to(do.dtype), do, dv)
                delta = tl.load(d_ptrs + t * BLOCK_M1)
                dp_t = tl.dot(v, tl.trans(do))
                ds_t = p_t * (dp_t - delta[None, :])
                dk = tl.dot(ds_t.to(q.dtype), q, dk)
            # masked query tiles: causal diagonal, document end, merged short documents
            for jj in tl.range(0, u0 + n - u1, num_stages=MASKED_STAGES):
                t = masked_tile_index(jj, u0, u1)
                q_pos = o_lo + t * BLOCK_M1 + offs_m
                q_ok = q_pos < o_hi
                q = tl.load(q_ptrs + t * BLOCK_M1 * stride_qt, mask=q_ok[:, None], other=0.0)
                lse2 = tl.load(l_ptrs + t * BLOCK_M1, mask=q_ok, other=0.0) * 1.4426950408889634
                s_t = tl.dot(k, tl.trans(q))
                vis = tile_visible(k_pos, q_pos, o_hi, r_rel, cu_ptr, doc, merged, True, CAUSAL)
                p_t = tl.where(vis, tl.math.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
                do = tl.load(do_ptrs + t * BLOCK_M1 * stride_dot, mask=q_ok[:, None], other=0.0)
                dv = tl.dot(p_t.to(do.dtype), do, dv)
                delta = tl.load(d_ptrs + t * BLOCK_M1, mask=q_ok, other=0.0)
                dp_t = tl.dot(v, tl.trans(do))
                ds_t = p_t * (dp_t - delta[None, :])
                dk = tl.dot(ds_t.to(q.dtype), q, dk)
        dk = dk * sm_scale
        tl.store(DK + rs.to(tl.int64) * stride_dkt + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=k_ok[:, None])
        tl.store(DV + rs.to(tl.int64) * stride_dvt + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _dq_tile(
    Q, K, V, DO, LSE, DELTA, DQ, items_ptr, cu_ptr, n_docs, e, h, sel,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    qk_scale, sm_scale, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    F2: tl.constexpr, WL_BM: tl.constexpr, CAUSAL: tl.constexpr, MASKED_STAGES: tl.constexpr,
):
    rs, re, o_lo, o_hi, n, u0, u1, merged, doc = program_geometry(
        items_ptr, cu_ptr, e, sel, F2, WL_BM, BLOCK_M2, BLOCK_N2, False, CAUSAL)
    if rs < re:
        hk = h // GROUP
        offs_m = tl.arange(0, BLOCK_M2)
        offs_n = tl.arange(0, BLOCK_N2)
        offs_d = tl.arange(0, HEAD_DIM)
        q_pos = rs + offs_m
        q_ok = q_pos < re
        q = tl.load(Q + rs.to(tl.int64) * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                    mask=q_ok[:, None], other=0.0)
        do = tl.load(DO + rs.to(tl.int64) * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                     mask=q_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + h * stride_lh + q_pos, mask=q_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + h * stride_lh + q_pos, mask=q_ok, other=0.0)
        k_ptrs = K + o_lo.to(tl.int64) * stride_kt + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = V + o_lo.to(tl.int64) * stride_vt + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        dq = tl.zeros([BLOCK_M2, HEAD_DIM], tl.float32)
        for t in range(u0, u1):
            k = tl.load(k_ptrs + t * BLOCK_N2 * stride_kt)
            v = tl.load(v_ptrs + t * BLOCK_N2 * stride_vt)
            s = tl.dot(q, tl.trans(k))
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq)
        r_rel = relative_doc(q_pos, cu_ptr, doc, tl.maximum(re, o_hi), merged)
        for jj in tl.range(0, u0 + n - u1, num_stages=MASKED_STAGES):
            t = masked_tile_index(jj, u0, u1)
            k_pos = o_lo + t * BLOCK_N2 + offs_n
            k_ok = k_pos < o_hi
            k = tl.load(k_ptrs + t * BLOCK_N2 * stride_kt, mask=k_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + t * BLOCK_N2 * stride_vt, mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            vis = tile_visible(q_pos, k_pos, o_hi, r_rel, cu_ptr, doc, merged, False, CAUSAL)
            p = tl.where(vis, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq)
        dq = dq * sm_scale
        tl.store(DQ + rs.to(tl.int64) * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


@triton.jit(do_not_specialize=["n_docs", "max_items", "sel"])
def _bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, items_ptr, num_items_ptr, cu_ptr, n_docs, max_items, sel,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    F1: tl.constexpr, F2: tl.constexpr, WL_BM: tl.constexpr, CAUSAL: tl.constexpr,
    MASKED_STAGES: tl.constexpr, GROUP: tl.constexpr,
):
    # GROUP = num_heads // num_kv_heads (a constexpr: with a runtime trip count the GQA loop of the
    # dK/dV programs cost 172 B of register spills on sm_90 even for MHA; 0 B as a constant).
    # One kv head after the other (its dK/dV programs and its query heads' dQ programs interleaved
    # rank by rank), ranks in decreasing cost inside a head: the programs in flight share one head's
    # Q/K/V/dO in L2.
    pid = tl.program_id(0)
    n_kv = F1
    per_rank = n_kv + F2 * GROUP
    hk0 = pid // (max_items * per_rank)
    x = pid % (max_items * per_rank)
    r = x // per_rank
    rem = x % per_rank
    e1 = r * F1 + rem
    head1 = hk0
    rem2 = rem - n_kv
    e2 = r * F2 + rem2 // GROUP
    head2 = hk0 * GROUP + rem2 % GROUP
    if r < tl.load(num_items_ptr):
        if rem < n_kv:
            _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, items_ptr, cu_ptr, n_docs, e1, head1, sel,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                       stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
                       qk_scale, sm_scale, GROUP, HEAD_DIM, BLOCK_M1, BLOCK_N1, F1, WL_BM, CAUSAL, MASKED_STAGES)
        else:
            _dq_tile(Q, K, V, DO, LSE, DELTA, DQ, items_ptr, cu_ptr, n_docs, e2, head2, sel,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dqt, stride_dqh, stride_lh,
                     qk_scale, sm_scale, GROUP, HEAD_DIM, BLOCK_M2, BLOCK_N2, F2, WL_BM, CAUSAL, MASKED_STAGES)


def _gluon_applies(config: AttentionKernelConfig, causal: bool, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> bool:
    """True if the config has a Gluon backward and it can run this call (causal, ``gluon_applies``)."""
    return causal and gluon_applies(config.gluon_bwd is not None, config, q, k, v)


def flash_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor, items: torch.Tensor, num_items: torch.Tensor, *, causal: bool,
    softmax_scale: float, config: AttentionKernelConfig, dlse: torch.Tensor | None = None, leftover: bool = True,
    tail: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward (no host sync). Shapes as :func:`flash_fwd.flash_fwd`.

    Args:
        do: ``(T, H_q, D)`` gradient of the output (last dim contiguous).
        q, k, v, o, lse: the forward's inputs and outputs.
        cu_seqlens, items, num_items: as the forward.
        dlse: optional ``(H_q, T)`` float32 gradient of the LSE output.
        leftover: False when the row is known to hold no merged item and no document of at most
            ``GluonBwdConfig.min_len`` tokens (``attention.leftover_bits``): the Triton launch behind the
            Gluon programs is skipped.
        tail: False when the row is known to have no row-end padding (``cu_seqlens[-1] == T``,
            ``attention.PAD_TAIL``): the launch that zeroes the padding rows of dq / dk / dv is skipped.

    Returns:
        ``(dq, dk, dv)`` in q/k/v's dtype and shapes; zero on padding rows.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    gluon = _gluon_applies(config, causal, q, k, v)
    g = config.gluon_bwd
    has_dlse = dlse is not None
    # with dq_reduce the Gluon dK/dV programs add their dQ partials to an fp32 accumulator (TMA bulk
    # reduce); the preprocess zeroes it and one cast replaces the dQ programs, both only on the rows
    # those programs own (documents > min_len tokens, and padding rows); heads in chunks of chunk_kv
    # kv heads when the whole accumulator would pass dq_reduce_max_bytes
    dq_red = None
    n_docs = cu_seqlens.shape[0] - 1
    n_steps = max(1, int(n_docs).bit_length() + 1)
    group = H // Hkv
    chunk_kv = Hkv  # one Gluon launch over every kv head unless the accumulator is bounded
    min_len = gluon_bwd_min_len(config)
    if gluon and g.dq_reduce:
        chunk_kv = max(1, min(Hkv, g.dq_reduce_max_bytes // max(1, 4 * T * group * D)))
        dq_red = torch.empty((T, chunk_kv * group, D), dtype=torch.float32, device=q.device)
    if T > 0:
        blk = 64
        _bwd_preprocess[(triton.cdiv(T, blk), H)](
            o, do, dlse if has_dlse else lse, delta, T, o.stride(0), o.stride(1), do.stride(0), do.stride(1),
            delta.stride(0), dq_red if dq_red is not None else delta, cu_seqlens, n_docs,
            min_len, n_steps, chunk_kv * group, HAS_DLSE=has_dlse, BLOCK=blk, HEAD_DIM=D,
            ZERO_DQ=dq_red is not None, num_warps=4)
    cfg, sel = config.bwd, 0  # the Triton launch: its tiles and which items it runs
    launch = True
    if gluon:
        from flamia_pack.kernels.gluon_dkdv import gluon_dkdv
        from flamia_pack.kernels.gluon_dq import gluon_dq

        do_c = do if do.is_contiguous() else do.contiguous()
        for kv0 in range(0, Hkv, chunk_kv):
            n_kv = min(Hkv - kv0, chunk_kv)
            gluon_dkdv(q, k, v, do_c, lse, delta, cu_seqlens, items, num_items, softmax_scale,
                       wl_block_m=config.wl_block_m, skip_len=min_len, dk=dk, dv=dv, dq_acc=dq_red,
                       kv_head0=kv0, kv_heads=n_kv, persistent=g.persistent)
            if dq_red is not None and T > 0:  # the chunk's dQ rows; its accumulator zeroed for the next chunk
                _dq_reduce_cast[(triton.cdiv(T, 64), n_kv * group)](
                    dq_red, dq, cu_seqlens, n_docs, min_len, n_steps, T, chunk_kv * group, kv0 * group,
                    dq.stride(0), dq.stride(1), softmax_scale, BLOCK=64, HEAD_DIM=D,
                    ZERO_AFTER=kv0 + n_kv < Hkv, num_warps=4)
        if dq_red is None:
            gluon_dq(q, k, v, do_c, lse, delta, cu_seqlens, items, num_items, softmax_scale,
                     wl_block_m=config.wl_block_m, skip_len=min_len, dq=dq, persistent=g.persistent)
        # merged items and documents of <= min_len tokens (skipped by the Gluon programs), small tiles;
        # none at all when the row is known to hold neither (attention.leftover_bits)
        cfg, sel, launch = SMALL_BWD, -min_len, leftover
    f1 = config.wl_block_m // cfg.block_n1
    f2 = config.wl_block_m // cfg.block_m2
    n_prog = items.shape[0] * (f1 * Hkv + f2 * H)
    if launch and n_prog > 0:
        _bwd_kernel[(n_prog,)](
            q, k, v, do, lse, delta, dq, dk, dv, items, num_items, cu_seqlens, cu_seqlens.numel() - 1,
            items.shape[0], sel,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), delta.stride(0),
            float(softmax_scale) * LOG2E, float(softmax_scale),
            HEAD_DIM=D, BLOCK_M1=cfg.block_m1, BLOCK_N1=cfg.block_n1,
            BLOCK_M2=cfg.block_m2, BLOCK_N2=cfg.block_n2,
            F1=f1, F2=f2, WL_BM=config.wl_block_m, CAUSAL=bool(causal),
            MASKED_STAGES=cfg.num_stages, GROUP=H // Hkv, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if tail:
        fill_tails([(dq, 0.0, 0), (dk, 0.0, 0), (dv, 0.0, 0)], cu_seqlens)
    return dq, dk, dv
