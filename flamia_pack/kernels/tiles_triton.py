"""In-kernel tile decisions shared by the packed-attention kernels (Triton side of ``tiles.py``).

Read ``tiles.py`` for the definitions (rows, walked side, mask-free range, merged items); the two
files must stay in step (the CPU tests compare the kernels run under ``TRITON_INTERPRET=1`` with the
reference, and the numpy mirror with exhaustive visibility checks).
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def program_geometry(
    items_ptr, cu_ptr, e, sel,
    F: tl.constexpr, WL_BM: tl.constexpr, B_R: tl.constexpr, B_O: tl.constexpr,
    ROWS_ARE_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Geometry of work-list entry ``e`` (item ``e // F``, part ``e % F``); see tiles.py.

    ``sel`` selects items by document length: 0 = every item; ``L > 0`` = only items of documents
    longer than ``L`` tokens; ``-L`` = only items of documents of at most ``L`` tokens and merged
    items (the Triton launch behind a Gluon kernel). An unselected entry is empty (``rs == re``).
    """
    it = e // F
    j = e % F
    doc = tl.load(items_ptr + it * 4)
    qs = tl.load(items_ptr + it * 4 + 1)
    qe = tl.load(items_ptr + it * 4 + 2)
    ds = tl.load(cu_ptr + doc)
    de = tl.load(cu_ptr + doc + 1)
    merged = qe > de
    span_lo = tl.where(merged, qs, ds)
    span_hi = tl.where(merged, qe, de)
    base = qs
    end = qe
    if ROWS_ARE_KEYS and CAUSAL:
        i = (qs - ds) // WL_BM
        nt = (de - ds + WL_BM - 1) // WL_BM
        mb = ds + (nt - 1 - i) * WL_BM
        base = tl.where(merged, qs, mb)
        end = tl.where(merged, qe, tl.minimum(mb + WL_BM, de))
    rs = base + j * B_R
    re = tl.minimum(rs + B_R, end)
    if sel != 0:
        short = merged | (de - ds <= tl.abs(sel))
        keep = tl.where(sel > 0, ~short, short)
        re = tl.where(keep, re, rs)
    if ROWS_ARE_KEYS:
        o_hi = span_hi
        if CAUSAL:
            o_lo = rs
            u0 = (tl.maximum(re - 1 - rs, 0) + B_O - 1) // B_O
            u1 = tl.maximum(u0, (o_hi - o_lo) // B_O)
        else:
            o_lo = span_lo
            u0 = rs * 0
            u1 = (o_hi - o_lo) // B_O
    else:
        o_lo = span_lo
        u0 = rs * 0
        if CAUSAL:
            o_hi = re
            u1 = tl.maximum(rs - o_lo + 1, 0) // B_O
        else:
            o_hi = span_hi
            u1 = (o_hi - o_lo) // B_O
    n = (tl.maximum(o_hi - o_lo, 0) + B_O - 1) // B_O
    u0 = tl.where(merged, 0, u0)
    u1 = tl.where(merged, 0, u1)
    return rs, re, o_lo, o_hi, n, u0, u1, merged, doc


@triton.jit
def relative_doc(pos, cu_ptr, doc, span_hi, merged):
    """Document of each token position relative to the item's first document (0, 1, ...).

    Only merged items (several whole short documents) have more than one document: for them the
    index is ``#{d > doc : cu[d] <= pos}``, counted over the item's own boundaries (at most WL_BM,
    scalar loads from L1); for every other item it is 0 without touching memory.
    """
    rel = tl.zeros_like(pos)
    if merged:
        d = doc + 1
        e = tl.load(cu_ptr + d)
        while e < span_hi:
            rel += (pos >= e).to(tl.int32)
            d += 1
            e = tl.load(cu_ptr + d)
    return rel


@triton.jit
def tile_visible(r_pos, o_pos, o_hi, r_rel, cu_ptr, doc, merged, ROWS_ARE_KEYS: tl.constexpr, CAUSAL: tl.constexpr):
    """Visibility of a masked tile: ``(rows, others)`` boolean block (tiles.py: masked tiles).

    ``r_rel`` is :func:`relative_doc` of the rows; only merged items compare documents.
    """
    vis = (r_pos[:, None] >= 0) & (o_pos[None, :] < o_hi)
    if CAUSAL:
        if ROWS_ARE_KEYS:
            vis = vis & (r_pos[:, None] <= o_pos[None, :])
        else:
            vis = vis & (o_pos[None, :] <= r_pos[:, None])
    if merged:
        o_rel = relative_doc(o_pos, cu_ptr, doc, o_hi, merged)
        vis = vis & (r_rel[:, None] == o_rel[None, :])
    return vis


@triton.jit
def masked_tile_index(jj, u0, u1):
    """The ``jj``-th masked tile: ``0 .. u0-1`` then ``u1 .. n-1``."""
    return tl.where(jj < u0, jj, jj - u0 + u1)
