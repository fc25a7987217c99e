"""Tile decisions shared by every packed-attention kernel (BF16 now, FP8 next): host mirror.

DESIGN.md §6-7. The work list (``flamia_pack.scheduler.worklist``) holds items
``(doc, q_start, q_end, cost)`` of at most ``WL_BM`` queries of one document (or, with
``merge_short``, several whole short documents inside one ``WL_BM`` window: the item is *merged*
iff ``q_end > cu_seqlens[doc + 1]``). A kernel program owns ``B_R`` consecutive **rows** of one
item (queries for the forward and dQ, keys for dK/dV; entry ``e`` of the list is
``(item e // F, part e % F)`` with ``F = WL_BM // B_R``) and walks the **other** side (keys, or
queries) in tiles of ``B_O`` starting at ``o_lo``::

    rows of the program:   [r_start, r_end)
    other side walked:     [o_lo, o_hi) in n_tiles tiles of B_O (tile t = [o_lo + t*B_O, ...))
    mask-free tiles:       u0 <= t < u1   (every (row, other) pair of the tile is visible)
    masked tiles:          t < u0 or t >= u1 (document edge or causal diagonal)

Span of an item: its document ``[cu[doc], cu[doc+1])``, or for a merged item ``[q_start, q_end)``.

Queries side (forward, dQ)::

    o_lo = span_lo;   o_hi = r_end (causal) | span_hi (non-causal)
    u0 = 0;           u1 = (r_start - o_lo + 1) // B_O (causal) | (o_hi - o_lo) // B_O

    causal, one document, B_R = 4 rows, B_O = 2 (x visible, . masked, | tile edge):
        keys ->   d0 d1 | d2 d3 | d4 d5 | d6 d7
        q4        x  x  | x  x  | x  .  |            tiles 0, 1 mask-free (u1 = 2); tile 2 masked
        q5        x  x  | x  x  | x  x  |
        q6 ...

Keys side (dK/dV; causal items are *mirrored* inside their document, item tile i <-> tile
n_tiles(doc) - 1 - i, so that the query-side order sorted by decreasing cost is also sorted by the
key side's cost, with no device sort)::

    o_lo = r_start (causal) | span_lo;   o_hi = span_hi
    u0 = ceil((r_end - 1 - r_start) / B_O) (causal) | 0;   u1 = max(u0, (o_hi - o_lo) // B_O)

Merged items are masked on every tile (u0 = u1 = 0) by per-token document: the document of a token
inside the span is ``#{cu[d] <= token : doc < d}`` (computed in-kernel from at most WL_BM
boundaries), so S1's 131,072 one-token documents run as 1,024 tiles, not 131,072.

A masked tile uses ``visible = (o < o_hi) & same_document & (key <= query if causal)``.
Rows outside ``[r_start, r_end)`` (a short last tile) are computed but never stored.

This module is the numpy mirror used by tests and tools; ``tiles_triton.py`` is the in-kernel
copy (one ``@triton.jit`` function, :func:`program_geometry`, used by all kernels).
"""
from __future__ import annotations

import numpy as np

__all__ = ["program_geometry_host", "tile_visible_host", "visible_host"]


def _cdiv(a, b):
    return -(-a // b)


def program_geometry_host(
    items: np.ndarray,
    cu_seqlens: np.ndarray,
    *,
    wl_block_m: int,
    block_rows: int,
    block_other: int,
    rows_are_keys: bool,
    causal: bool,
) -> dict[str, np.ndarray]:
    """Per-entry tile geometry (numpy mirror of ``tiles_triton.program_geometry``).

    Args:
        items: ``(n_items, 4)`` int work list rows ``(doc, q_start, q_end, cost)`` (valid rows only).
        cu_seqlens: ``(n_docs + 1,)`` ints.
        wl_block_m: the work list's BLOCK_M.
        block_rows: B_R, rows per program (divides ``wl_block_m``).
        block_other: B_O, tile of the walked side.
        rows_are_keys: True for the dK/dV programs.
        causal: causal mask.

    Returns:
        dict of int64 arrays of length ``n_items * (wl_block_m // block_rows)`` (entry order):
        ``r_start, r_end, o_lo, o_hi, n_tiles, u0, u1, merged, doc, span_lo, span_hi``.
        Entries with ``r_start >= r_end`` are empty (a short item's unused parts).
    """
    items = np.asarray(items, dtype=np.int64).reshape(-1, 4)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    f = wl_block_m // block_rows
    it = np.repeat(np.arange(items.shape[0]), f)
    j = np.tile(np.arange(f), items.shape[0])
    doc, qs, qe = items[it, 0], items[it, 1], items[it, 2]
    ds, de = cu[doc], cu[doc + 1]
    merged = qe > de
    span_lo = np.where(merged, qs, ds)
    span_hi = np.where(merged, qe, de)
    base, end = qs, qe
    if rows_are_keys and causal:
        i = (qs - ds) // wl_block_m
        nt = _cdiv(de - ds, wl_block_m)
        mb = ds + (nt - 1 - i) * wl_block_m
        base = np.where(merged, qs, mb)
        end = np.where(merged, qe, np.minimum(mb + wl_block_m, de))
    rs = base + j * block_rows
    re = np.minimum(rs + block_rows, end)
    if rows_are_keys:
        o_lo = rs if causal else span_lo
        o_hi = span_hi
        if causal:
            u0 = _cdiv(np.maximum(re - 1 - rs, 0), block_other)
            u1 = np.maximum(u0, (o_hi - o_lo) // block_other)
        else:
            u0 = np.zeros_like(rs)
            u1 = (o_hi - o_lo) // block_other
    else:
        o_lo = span_lo
        o_hi = re if causal else span_hi
        u0 = np.zeros_like(rs)
        u1 = (rs - o_lo + 1) // block_other if causal else (o_hi - o_lo) // block_other
    n = _cdiv(o_hi - o_lo, block_other)
    u0 = np.where(merged, 0, u0)
    u1 = np.where(merged, 0, u1)
    return {
        "r_start": rs, "r_end": re, "o_lo": o_lo, "o_hi": o_hi, "n_tiles": n, "u0": u0, "u1": u1,
        "merged": merged, "doc": doc, "span_lo": span_lo, "span_hi": span_hi,
    }


def visible_host(cu_seqlens: np.ndarray, query: np.ndarray, key: np.ndarray, causal: bool) -> np.ndarray:
    """Visibility of (query, key) token pairs: same document and (causal) key <= query.

    Tokens at or past ``cu_seqlens[-1]`` belong to no document (never visible).
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    q = np.asarray(query)
    k = np.asarray(key)
    dq = np.searchsorted(cu, q, side="right") - 1
    dk = np.searchsorted(cu, k, side="right") - 1
    ok = (dq == dk) & (q < cu[-1]) & (k < cu[-1])
    if causal:
        ok &= k <= q
    return ok


def tile_visible_host(
    cu_seqlens: np.ndarray,
    *,
    doc: int,
    merged: bool,
    r_pos: np.ndarray,
    o_pos: np.ndarray,
    o_hi: int,
    rows_are_keys: bool,
    causal: bool,
    wl_block_m: int,
) -> np.ndarray:
    """Numpy mirror of ``tiles_triton.tile_visible``: the mask a kernel applies on a masked tile.

    Returns:
        ``(len(r_pos), len(o_pos))`` bool.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    r = np.asarray(r_pos, dtype=np.int64)[:, None]
    o = np.asarray(o_pos, dtype=np.int64)[None, :]
    vis = (r >= 0) & (o < o_hi)
    if causal:
        vis &= (r <= o) if rows_are_keys else (o <= r)
    if merged:
        ends = cu[doc + 1: doc + 1 + wl_block_m]
        rel_r = (ends[None, :] <= r.reshape(-1, 1)).sum(1)
        rel_o = (ends[None, :] <= o.reshape(-1, 1)).sum(1)
        vis &= rel_r[:, None] == rel_o[None, :]
    return vis
