"""Packed (document-masked) attention forward in Triton for Hopper, driven by the work list.

FlashAttention-2 forward (Dao 2023, Alg. 1) over the sorted work list of DESIGN.md §6: a program
owns ``BLOCK_M`` queries of one work item (tiles.py) and one query head, keeps Q in registers and
walks the visible key tiles with an online softmax in base 2::

    s_ij = (q_i . k_j) * softmax_scale * log2(e)
    m_i  = max_j s_ij ;  l_i = sum_j 2^(s_ij - m_i) ;  o_i = sum_j 2^(s_ij - m_i) v_j / l_i
    lse_i = (m_i + log2 l_i) * ln 2          (natural log, saved for the backward)

Mask-free key tiles run without any mask arithmetic; only tiles that cut a document boundary or
the causal diagonal (tiles.py) build a mask. GQA: query head h reads kv head ``h // (H_q // H_kv)``.
Rows past ``cu_seqlens[-1]`` (row-end padding) get ``o = 0`` and ``lse = +inf`` from a small fill
kernel that only touches those rows.

Launch orders: ``config.fwd.schedule`` (``config.SCHEDULES``). With ``config.gluon_fwd`` (the head_dim 128
default on sm_90) the programs run as the warp-specialized Gluon kernel of ``gluon_fwd.py``, and this file's
kernel only for merged items and 1-token documents (``sel = -1``), one program per (entry, chunk of 8 / 4 / 2
heads) (``HEADS_PER_PROGRAM``): most of those programs find nothing to do, and chunks of 8 heads make the
launch 8x smaller (W7: 42 -> 11.9 us).
"""
from __future__ import annotations

import functools
import importlib
import math

import torch
import triton
import triton.language as tl

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.config import AttentionKernelConfig
from flamia_pack.kernels.constants import LN2, LOG2E  # noqa: F401 (LN2: re-exported)
from flamia_pack.kernels.tiles_triton import masked_tile_index, program_geometry, relative_doc, tile_visible



@triton.jit
def _fwd_tile(
    Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, e, h, group, sel,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F: tl.constexpr, WL_BM: tl.constexpr, CAUSAL: tl.constexpr,
):
    rs, re, o_lo, o_hi, n, u0, u1, merged, doc = program_geometry(
        items_ptr, cu_ptr, e, sel, F, WL_BM, BLOCK_M, BLOCK_N, False, CAUSAL)
    if rs < re:
        hk = h // group
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_pos = rs + offs_m
        row_ok = q_pos < re
        q_base = Q + rs.to(tl.int64) * stride_qt + h * stride_qh
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        k_base = K + o_lo.to(tl.int64) * stride_kt + hk * stride_kh
        v_base = V + o_lo.to(tl.int64) * stride_vt + hk * stride_vh
        k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # mask-free key tiles: every (query, key) pair visible
        for t in range(u0, u1):
            k = tl.load(k_ptrs + t * BLOCK_N * stride_kt)
            s = tl.dot(q, tl.trans(k))
            m_ij = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_ij[:, None]
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_ptrs + t * BLOCK_N * stride_vt)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_ij
        # masked key tiles: document edge / causal diagonal / merged short documents
        r_rel = relative_doc(q_pos, cu_ptr, doc, tl.maximum(re, o_hi), merged)
        for jj in range(0, u0 + n - u1):
            t = masked_tile_index(jj, u0, u1)
            k_pos = o_lo + t * BLOCK_N + offs_n
            k_ok = k_pos < o_hi
            k = tl.load(k_ptrs + t * BLOCK_N * stride_kt, mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            vis = tile_visible(q_pos, k_pos, o_hi, r_rel, cu_ptr, doc, merged, False, CAUSAL)
            s = s * qk_scale + tl.where(vis, 0.0, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_ij[:, None]
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_ptrs + t * BLOCK_N * stride_vt, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_ij
        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        o_base = O + rs.to(tl.int64) * stride_ot + h * stride_oh
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h * stride_lh + q_pos, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_docs", "max_entries", "sel"])
def _fwd_kernel(
    Q, K, V, O, LSE, items_ptr, num_items_ptr, cu_ptr, counter_ptr, n_docs, max_entries, num_heads, group, sel,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F: tl.constexpr, WL_BM: tl.constexpr, CAUSAL: tl.constexpr, PERSISTENT: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, STATIC: tl.constexpr = False, HEADS_PER_PROGRAM: tl.constexpr = 1,
):
    total = tl.load(num_items_ptr) * F * num_heads
    if HEADS_PER_PROGRAM > 1:
        # the leftover launch behind the Gluon forward (few selected entries, most rows none): one program
        # per (entry, chunk of HEADS_PER_PROGRAM heads), so the launch is HEADS_PER_PROGRAM x fewer
        # programs that find nothing to do (W7: 12,288 of them took 42 us at one program per SM)
        tile = tl.program_id(0)
        chunks = num_heads // HEADS_PER_PROGRAM
        e = tile // chunks
        if e < tl.load(num_items_ptr) * F:
            for hh in tl.static_range(HEADS_PER_PROGRAM):
                _fwd_tile(Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, e, (tile % chunks) * HEADS_PER_PROGRAM + hh, group,
                          sel, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                          stride_oh, stride_lh, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, F, WL_BM, CAUSAL)
    elif STATIC:
        # static snake (DESIGN.md §6; seed 001 Algorithm 2 line 06): unit k of round r = k // P goes to
        # program k % P in even rounds and P - 1 - k % P in odd ones; each program walks its units in
        # increasing k (scheduler.worklist.static_assignment deals the same way)
        c = tl.program_id(0)
        n_prog = tl.num_programs(0)
        r = 0
        tile = c
        while tile < total:
            _fwd_tile(Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, tile // num_heads, tile % num_heads, group, sel,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                      qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, F, WL_BM, CAUSAL)
            r += 1
            tile = r * n_prog + tl.where(r % 2 == 0, c, n_prog - 1 - c)
    elif PERSISTENT:
        tile = tl.atomic_add(counter_ptr, 1)
        while tile < total:
            nxt = tl.atomic_add(counter_ptr, 1)
            _fwd_tile(Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, tile // num_heads, tile % num_heads, group, sel,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                      qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, F, WL_BM, CAUSAL)
            tile = nxt
    elif HEAD_MAJOR:
        # one kv head after the other, entries in decreasing cost inside it, the query heads of its
        # GQA group side by side (max_entries = rows of the work list x F; entries past the valid
        # ones exit at once)
        tile = tl.program_id(0)
        x = tile % (max_entries * group)
        e = x // group
        if e < tl.load(num_items_ptr) * F:
            _fwd_tile(Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, e, (tile // (max_entries * group)) * group + x % group, group, sel,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                      qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, F, WL_BM, CAUSAL)
    else:
        tile = tl.program_id(0)
        if tile < total:
            _fwd_tile(Q, K, V, O, LSE, items_ptr, cu_ptr, n_docs, tile // num_heads, tile % num_heads, group, sel,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                      qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, F, WL_BM, CAUSAL)


@triton.jit
def _fill_rows(X, stride_row, stride_col, n_cols, first, r0, total_rows, value,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``X[row, col] = value`` for the rows ``first <= row < total_rows`` of the block at ``r0``."""
    if (r0 + BLOCK_R > first) & (r0 < total_rows):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = (rows >= first) & (rows < total_rows)
        cols = tl.arange(0, BLOCK_C)
        val = (tl.zeros([BLOCK_R, BLOCK_C], tl.float32) + value).to(X.dtype.element_ty)
        for c0 in range(0, n_cols, BLOCK_C):
            c = c0 + cols
            ptrs = X + rows.to(tl.int64)[:, None] * stride_row + c[None, :] * stride_col
            tl.store(ptrs, val, mask=rmask[:, None] & (c < n_cols)[None, :])


@triton.jit(do_not_specialize=["n_docs", "total_rows0", "total_rows1", "total_rows2", "value0", "value1", "value2"])
def _fill_tails_kernel(cu_ptr, n_docs,
                       X0, stride_row0, stride_col0, n_cols0, total_rows0, value0,
                       X1, stride_row1, stride_col1, n_cols1, total_rows1, value1,
                       X2, stride_row2, stride_col2, n_cols2, total_rows2, value2,
                       NUM: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C0: tl.constexpr, BLOCK_C1: tl.constexpr, BLOCK_C2: tl.constexpr):
    """``Xi[row, col] = value_i`` for rows ``cu_seqlens[-1] <= row < total_rows_i`` (row-end padding) of
    the first ``NUM`` (1-3) slots; a program owns ``BLOCK_R`` rows of every slot."""
    first = tl.load(cu_ptr + n_docs)
    r0 = tl.program_id(0) * BLOCK_R
    _fill_rows(X0, stride_row0, stride_col0, n_cols0, first, r0, total_rows0, value0, BLOCK_R, BLOCK_C0)
    if NUM > 1:
        _fill_rows(X1, stride_row1, stride_col1, n_cols1, first, r0, total_rows1, value1, BLOCK_R, BLOCK_C1)
    if NUM > 2:
        _fill_rows(X2, stride_row2, stride_col2, n_cols2, first, r0, total_rows2, value2, BLOCK_R, BLOCK_C2)


def fill_tails(targets: list[tuple[torch.Tensor, float, int]], cu_seqlens: torch.Tensor) -> None:
    """Fill the row-end padding tokens (``>= cu_seqlens[-1]``) of up to three tensors in place, in ONE launch.

    Args:
        targets: a sequence of at most 3 ``(x, value, token_dim)``. ``x`` is ``(T, ...)`` (``token_dim=0``,
            trailing dims flattened, must be contiguous in them) or ``(H, T)`` (``token_dim=1``; any value
            other than 0 is read as 1), bf16 / fp16 / fp32 (any dtype a Triton
            store takes); each tensor has its own ``T``, dtype and ``value`` (a float, cast to ``x``'s dtype
            in the kernel: ``0.0`` and ``+inf`` are exact). Tensors with ``T == 0`` or no columns are skipped.
        cu_seqlens: ``(n_docs + 1,)`` int32 / int64 on ``x``'s device; only ``cu_seqlens[-1]`` is read, on
            the device (no host sync, CUDA-graph capturable).

    One Triton launch of ``cdiv(max T, 64)`` programs (none if every tensor is skipped) for the
    forward's ``o`` / ``lse`` and for the backward's ``dq`` / ``dk`` / ``dv``, which took one launch
    each: every launch costs host time (two fills: 0.155 ms per forward call under the profiler).

    Raises:
        FlamiaError: more than 3 targets.
    """
    if len(targets) > 3:
        raise FlamiaError(f"fill_tails takes at most 3 tensors, got {len(targets)}")
    slots = []
    for x, value, token_dim in targets:
        t = x.shape[0] if token_dim == 0 else x.shape[1]
        if t == 0:  # (before the reshape: (0, -1) is ambiguous)
            continue
        if token_dim == 0:
            x2 = x.reshape(t, -1)
            stride_row, stride_col, n_cols = x2.stride(0), x2.stride(1), x2.shape[1]
        else:
            x2 = x
            stride_row, stride_col, n_cols = x.stride(1), x.stride(0), x.shape[0]
        if n_cols == 0:
            continue
        slots.append((x2, stride_row, stride_col, n_cols, t, float(value),
                      min(triton.next_power_of_2(n_cols), 256)))
    if not slots:
        return
    num = len(slots)
    block_r = 64
    grid = (triton.cdiv(max(s[4] for s in slots), block_r),)
    # unused slots: slot 0's tensor again, never touched (NUM skips them at compile time)
    slots += [slots[0]] * (3 - num)
    args = [a for s in slots for a in s[:6]]
    _fill_tails_kernel[grid](
        cu_seqlens, cu_seqlens.numel() - 1, *args,
        NUM=num, BLOCK_R=block_r, BLOCK_C0=slots[0][6], BLOCK_C1=slots[1][6], BLOCK_C2=slots[2][6], num_warps=4)


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@functools.cache
def gluon_available() -> bool:
    """True if this triton has the Gluon API the ``gluon_*.py`` kernels are written and tested against.

    Gluon is experimental and its API changes between triton releases, so only 3.6.x qualifies; any
    other version runs the Triton kernels (same results, the measured Triton speed). Answered once per
    process (it is asked on every attention call).
    """
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) != (3, 6):
        return False
    try:
        importlib.import_module("triton.experimental.gluon")
    except ImportError:
        return False
    return True


def gluon_applies(enabled: bool, config: AttentionKernelConfig, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> bool:
    """True if a Gluon family (``enabled``: the config has it) can run this call: a CUDA device of compute
    capability 9.x, bf16, head_dim 64 / 128, contiguous 16-byte aligned q / k / v, ``wl_block_m`` a
    multiple of 128, triton 3.6."""
    if not (enabled and q.is_cuda and q.dtype == torch.bfloat16 and q.shape[0] > 0 and q.shape[2] in (64, 128)
            and config.wl_block_m % 128 == 0):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if not all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q, k, v)):
        return False
    return gluon_available()


def flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    items: torch.Tensor, num_items: torch.Tensor, *, causal: bool, softmax_scale: float,
    config: AttentionKernelConfig, leftover: bool = True, tail: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward (inputs already validated by ``attention.py``; no host sync).

    Args:
        q: ``(T, H_q, D)`` bf16, last dim contiguous. k, v: ``(T, H_kv, D)``.
        cu_seqlens: ``(n_docs + 1,)`` int32, same device.
        items, num_items: the work list (``(max_items, 4)`` int32, ``(1,)`` int32) built with
            ``TileConfig(block_m=config.wl_block_m, causal=causal)``.
        causal, softmax_scale: as in ``varlen_attention``.
        config: tile/launch configuration.
        leftover: False when the row is known to hold no merged item and no document the Gluon
            programs leave to the Triton launch (``attention.leftover_bits``): that launch is skipped.
        tail: False when the row is known to have no row-end padding (``cu_seqlens[-1] == T``,
            ``attention.PAD_TAIL``): the launch that fills the padding rows of ``o`` / ``lse`` is
            skipped (it would write nothing).

    Returns:
        ``(o, lse)``: ``(T, H_q, D)`` in q's dtype and ``(H_q, T)`` float32 (natural log).
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    o = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    n_docs = cu_seqlens.numel() - 1
    cfg = config.fwd
    sel, hpp, launch = 0, 1, True
    if gluon_applies(config.gluon_fwd is not None, config, q, k, v):
        from flamia_pack.kernels.gluon_fwd import gluon_fwd

        g = config.gluon_fwd
        gluon_fwd(q, k, v, cu_seqlens, items, num_items, softmax_scale, causal=causal, wl_block_m=config.wl_block_m,
                  skip_len=1, o=o, lse=lse, block_n=g.block_n, stages=g.stages, pingpong=g.pingpong,
                  items_whole=g.whole_items, part_skip=g.part_skip)
        # left: merged items and 1-token documents, a few heads per program (fewer programs that exit at once)
        sel, launch = -1, leftover
        hpp = next(c for c in (8, 4, 2, 1) if H % c == 0)
    f = config.wl_block_m // cfg.block_m
    n_entries = items.shape[0] * f * H
    if cfg.schedule == "policy":
        raise FlamiaError("schedule='policy' must be resolved to 'static' or 'persistent' before the launch "
                          "(varlen_attention does it with scheduler.policy.policy_for_call)")
    static = cfg.schedule == "static"
    persistent = cfg.schedule == "persistent" or static
    if launch and n_entries > 0:
        # the atomic counter only for the dynamic schedule (the static snake deals units by program id)
        counter = torch.zeros((1,), dtype=torch.int32, device=q.device) if persistent and not static else num_items
        hpp = hpp if not persistent else 1
        grid = (max(1, min(n_entries, 2 * _num_sms(q.device))),) if persistent else (max(1, n_entries // hpp),)
        _fwd_kernel[grid](
            q, k, v, o, lse, items, num_items, cu_seqlens, counter, n_docs, items.shape[0] * f, H, H // Hkv, sel,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), lse.stride(0),
            float(softmax_scale) * LOG2E,
            HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, F=f, WL_BM=config.wl_block_m,
            CAUSAL=bool(causal), PERSISTENT=persistent, HEAD_MAJOR=cfg.schedule == "grid_head_major",
            STATIC=static, HEADS_PER_PROGRAM=hpp,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        )
    if tail:
        fill_tails([(o, 0.0, 0), (lse, math.inf, 1)], cu_seqlens)
    return o, lse
