"""Fused Triton path of :func:`flamia_pack.scheduler.worklist.build_work_list` (CUDA only).

Same result as the torch path (tests compare both to the host reference), fewer launches:

1. ``_count_kernel`` (one thread per document): items per document (``ceil(len / BLOCK_M)``, or
   with ``merge_short`` 1 for the head of a run of documents inside one aligned window, 0 for the
   rest of the run);
2. ``torch.cumsum`` -> inclusive offsets (one CUB scan);
3. ``_expand_kernel`` (one thread per item slot ``j < max_items``): binary search of ``j`` in the
   offsets gives the document, then ``q_start, q_end, cost`` and the sort key ``-cost``
   (``+1`` for empty slots, so they sort last); empty slots are written as -1; program 0 writes
   the item count;
4. ``torch.sort(stable=True)`` on the key (int16 when costs fit: fewer radix passes); stability
   keeps the (doc, q_start) order of equal costs;
5. ``_gather_kernel``: ``items[k] = unsorted[perm[k]]``.

No host synchronisation, fixed sizes: CUDA-graph capturable. Offsets are int32 (T < 2**31 - 512).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flamia_pack.scheduler.keys import cost_key_dtype

_BLOCK = 512


@triton.jit
def _count_kernel(cu_ptr, cnt_ptr, n, BM: tl.constexpr, MERGE: tl.constexpr, BLOCK: tl.constexpr):
    d = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dm = d < n
    s = tl.load(cu_ptr + d, mask=dm, other=0).to(tl.int32)
    e = tl.load(cu_ptr + d + 1, mask=dm, other=0).to(tl.int32)
    cnt = (e - s + (BM - 1)) // BM
    if MERGE:
        w = s // BM
        contained = (w == (e - 1) // BM) & (e > s)
        has_prev = d > 0
        sp = tl.load(cu_ptr + d - 1, mask=dm & has_prev, other=0).to(tl.int32)
        prev_contained = has_prev & (sp // BM == w) & ((s - 1) // BM == w) & (s > sp)
        cnt = tl.where(contained, tl.where(prev_contained, 0, 1), cnt)
    tl.store(cnt_ptr + d, cnt, mask=dm)


@triton.jit
def _search(offs_ptr, j, n, LOG_N: tl.constexpr):
    """Smallest d in [0, n] with offs[d] > j (offs inclusive, non-decreasing)."""
    lo = tl.zeros_like(j)
    hi = tl.zeros_like(j) + n
    for _ in tl.static_range(LOG_N):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(offs_ptr + mid, mask=active & (mid < n), other=0)
        right = v <= j
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _expand_kernel(
    cu_ptr, cnt_ptr, offs_ptr, key_ptr, unsorted_ptr, num_items_ptr, n, M,
    LOG_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, MERGE: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    jm = j < M
    total = tl.load(offs_ptr + n - 1)
    valid = j < total
    d = tl.minimum(_search(offs_ptr, j, n, LOG_N), n - 1)
    first = tl.load(offs_ptr + d, mask=jm, other=0) - tl.load(cnt_ptr + d, mask=jm, other=0)
    s = tl.load(cu_ptr + d, mask=jm, other=0).to(tl.int32)
    e = tl.load(cu_ptr + d + 1, mask=jm, other=0).to(tl.int32)
    qs = s + (j - first) * BM
    qe = tl.minimum(qs + BM, e)
    first_key = s
    if CAUSAL:
        last_key = qe - 1
    else:
        last_key = e - 1
    if MERGE:
        merged = (s // BM == (e - 1) // BM) & (e > s)
        # a merged run ends where the next item (the next document) starts, or at cu[n]
        d2 = tl.minimum(_search(offs_ptr, j + 1, n, LOG_N), n)
        nxt = tl.load(cu_ptr + d2, mask=jm & merged, other=0).to(tl.int32)
        qe = tl.where(merged, nxt, qe)
        first_key = tl.where(merged, qs, s)
        last_key = tl.where(merged, qe - 1, last_key)
    cost = last_key // BN - first_key // BN + 1
    key = tl.where(valid, -cost, 1)
    tl.store(key_ptr + j, key.to(key_ptr.dtype.element_ty), mask=jm)
    neg = tl.full([BLOCK], -1, tl.int32)
    tl.store(unsorted_ptr + j, tl.where(valid, d, neg), mask=jm)
    tl.store(unsorted_ptr + M + j, tl.where(valid, qs, neg), mask=jm)
    tl.store(unsorted_ptr + 2 * M + j, tl.where(valid, qe, neg), mask=jm)
    tl.store(unsorted_ptr + 3 * M + j, tl.where(valid, cost, neg), mask=jm)
    if pid == 0:
        tl.store(num_items_ptr, total)


@triton.jit
def _gather_kernel(perm_ptr, unsorted_ptr, out_ptr, M, BLOCK: tl.constexpr):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    km = k < M
    p = tl.load(perm_ptr + k, mask=km, other=0)
    c = tl.arange(0, 4)
    mask2 = km[:, None] & (c[None, :] < 4)
    v = tl.load(unsorted_ptr + c[None, :] * M + p[:, None], mask=mask2, other=-1)
    tl.store(out_ptr + k[:, None] * 4 + c[None, :], v, mask=mask2)


def build_into(cu_seqlens: torch.Tensor, total_tokens: int, config, wl) -> None:
    """Fill ``wl.items`` / ``wl.num_items`` (see the module docstring). No host sync."""
    n = cu_seqlens.numel() - 1
    m = wl.max_items
    dev = cu_seqlens.device
    cnt = torch.empty(n, dtype=torch.int32, device=dev)
    _count_kernel[(triton.cdiv(n, 1024),)](
        cu_seqlens, cnt, n, BM=config.block_m, MERGE=config.merge_short, BLOCK=1024, num_warps=4
    )
    offs = torch.cumsum(cnt, 0, dtype=torch.int32)
    key = torch.empty(m, dtype=cost_key_dtype(total_tokens, config.block_n), device=dev)
    unsorted = torch.empty((4, m), dtype=torch.int32, device=dev)
    _expand_kernel[(triton.cdiv(m, _BLOCK),)](
        cu_seqlens, cnt, offs, key, unsorted, wl.num_items, n, m,
        LOG_N=max(n.bit_length(), 1), BM=config.block_m, BN=config.block_n, CAUSAL=config.causal, MERGE=config.merge_short,
        BLOCK=_BLOCK, num_warps=4,
    )
    perm = torch.sort(key, stable=True).indices
    _gather_kernel[(triton.cdiv(m, _BLOCK),)](perm, unsorted, wl.items, m, BLOCK=_BLOCK, num_warps=4)
