"""The one FLOPs / visible-pairs / tile-count function set of flamia_pack (DESIGN.md §6, STYLE.md 3).

Benchmarks, tests, the CLI and the service all count work through these functions.

Conventions (WORKLOADS.md): FLOPs are counted on visible (query, key) pairs only::

    pairs  = sum_i len_i * (len_i + 1) / 2      causal (a token sees itself and earlier tokens of its document)
           = sum_i len_i ** 2                   non-causal (whole document)
    fwd    = 4 * num_heads * head_dim * pairs   (QK^T and PV, 2 FLOPs per multiply-add)
    bwd    = 2.5 * fwd
    fwd_bwd (one training call) = 3.5 * fwd

``num_heads`` is the number of QUERY heads (GQA shares K/V between heads but not the arithmetic).
"""
from __future__ import annotations

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.worklist import TileConfig, build_work_list_numba

__all__ = ["PASS_FACTORS", "attention_flops", "document_first_items", "fp8_fwd_masked_tiles", "fp8_masked_tile0",
           "lengths_from", "tile_count", "visible_pairs"]

PASS_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
"""FLOPs of each pass relative to the forward (WORKLOADS.md)."""


def lengths_from(seqlens=None, *, cu_seqlens=None) -> np.ndarray:
    """Document lengths as an int64 numpy array from lengths or ``cu_seqlens`` (numpy/torch/list).

    Raises:
        FlamiaError: negative lengths, non-integer values (NaN / Inf included), or not 1-D; the message
            names the first bad value and its index.
    """
    if cu_seqlens is not None:
        from flamia_pack.varlen import validate_cu_seqlens

        return np.diff(validate_cu_seqlens(cu_seqlens))
    if hasattr(seqlens, "detach"):
        seqlens = seqlens.detach().cpu().numpy()
    arr = np.asarray(seqlens)
    if arr.ndim != 1:
        raise FlamiaError(f"seqlens must be 1-D (document lengths), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        try:
            with np.errstate(invalid="ignore"):  # inf % 1 is NaN: reported below, not warned
                bad = np.flatnonzero(~(np.mod(arr, 1) == 0))
        except TypeError:  # strings, objects
            raise FlamiaError(f"seqlens must be integer document lengths, got dtype {arr.dtype}") from None
        if bad.size:
            raise FlamiaError(f"seqlens must be integers (document lengths), got {arr[bad[0]]} at index {bad[0]}")
    arr = arr.astype(np.int64)
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise FlamiaError(f"seqlens must be >= 0 (document lengths), got {arr[neg[0]]} at index {neg[0]}")
    return arr


def visible_pairs(seqlens, causal: bool = True) -> int:
    """Visible (query, key) pairs of a packed row (exact Python int).

    Args:
        seqlens: document lengths, 1-D ints (list / numpy / torch).
        causal: ``sum len*(len+1)/2`` if True, ``sum len^2`` if False.

    Returns:
        int. Example (seed 001 §6): 16 x 4096 -> 134,250,496; 8192 + 224 x 256 -> 40,927,232.
    """
    lens = lengths_from(seqlens)
    if lens.size == 0:
        return 0
    mx = int(lens.max())
    if mx * (mx + 1) * lens.size < 2**62:  # exact in int64
        sq = lens * (lens + 1) // 2 if causal else lens * lens
        return int(sq.sum())
    obj = lens.astype(object)
    return int((obj * (obj + 1) // 2 if causal else obj * obj).sum())


def attention_flops(
    seqlens,
    num_heads: int,
    head_dim: int,
    causal: bool = True,
    backward: bool = False,
    *,
    mode: str | None = None,
) -> float:
    """Attention FLOPs on visible pairs (WORKLOADS.md convention).

    Args:
        seqlens: document lengths.
        num_heads: query heads H_q.
        head_dim: D.
        causal: see :func:`visible_pairs`.
        backward: legacy switch: True -> the backward alone (2.5x forward). Ignored if ``mode``.
        mode: ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"`` (one training call, 3.5x forward).

    Returns:
        float FLOPs. W1 (16 x 4096, H=16, D=128): fwd = 4*16*128*134,250,496 = 1.0998e12,
        fwd_bwd = 3.849e12 (W1's 11.40 ms FlexAttention call -> 338 TFLOP/s).

    Raises:
        FlamiaError: unknown mode, non-positive heads/head_dim.
    """
    if mode is None:
        mode = "bwd" if backward else "fwd"
    if mode not in PASS_FACTORS:
        raise FlamiaError(f"mode must be one of {sorted(PASS_FACTORS)}, got {mode!r}")
    if int(num_heads) < 1 or int(head_dim) < 1:
        raise FlamiaError(f"num_heads and head_dim must be >= 1, got {num_heads}, {head_dim}")
    fwd = 4.0 * int(num_heads) * int(head_dim) * float(visible_pairs(seqlens, causal))
    return fwd * PASS_FACTORS[mode]


def tile_count(cu_seqlens, config: TileConfig = TileConfig()) -> int:
    """Total visible key tiles of the work list (sum of item costs), per head.

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32/int64 (numpy / torch / list).
        config: tile geometry (``causal`` and ``merge_short`` included).

    Returns:
        int: ``sum(cost)`` over :func:`build_work_list_numba` items.
    """
    items = build_work_list_numba(np.asarray(cu_seqlens if not hasattr(cu_seqlens, "detach") else cu_seqlens.detach().cpu().numpy()), config)
    return int(items[:, 3].astype(np.int64).sum())


def fp8_masked_tile0(total_tokens: int, n_docs: int, max_mean: int) -> bool:
    """The FP8 forward launcher's ``masked_tile0`` rule: on where the row's mean document length
    ``total_tokens / n_docs`` is at most ``max_mean`` tokens (``gluon_fp8_fwd.MASKED_TILE0_MAX_MEAN``; 0:
    never). Host-known, so the launch needs no sync; the cost model applies the same rule."""
    return max_mean > 0 and total_tokens <= max_mean * max(int(n_docs), 1)


def document_first_items(items: np.ndarray, cu_seqlens) -> np.ndarray:
    """1 for each work-list item that holds its document's first query row, else 0: where the cost model
    charges a per-document cost (``Calibration.d_us_per_doc``), once per document and head.

    Args:
        items: ``(n_items, 4)`` ints ``(doc, q_start, q_end, cost)``; cu_seqlens: ``(n_docs + 1,)`` ints.

    Returns:
        int64 ``(n_items,)`` of 0 / 1; a merged item (several short documents) counts 1 per document it starts.
    """
    it = np.asarray(items, dtype=np.int64).reshape(-1, 4)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if it.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    # documents whose start row lies in [q_start, q_end) of the item (one, or several for a merged item)
    starts = cu[:-1][cu[1:] > cu[:-1]]
    first = np.searchsorted(starts, it[:, 2], side="left") - np.searchsorted(starts, it[:, 1], side="left")
    return first.astype(np.int64)


def fp8_fwd_masked_tiles(items: np.ndarray, cu_seqlens, config: TileConfig, *, masked_tile0: bool) -> np.ndarray:
    """Key tiles the FP8 forward runs through its masked softmax, per work-list item (the cost model's
    third term, ``Calibration.c_us_per_masked_tile``).

    The kernel's rule (``gluon_common._rows_producer_loop`` with V^T, ``gluon_fp8_fwd._fp8_consume_entry``): an
    item's rows ``[q_start, q_end)`` of document ``[ds, de)`` walk ``n = ceil((hi - lo) / BLOCK_N)`` key
    tiles from ``lo = floor16(ds)`` (``hi = q_end`` causal, ``de`` not); the first ``u1`` are mask-free
    (``(q_start - lo + 1) // BLOCK_N`` causal: wholly at or before the first row; ``(hi - lo) // BLOCK_N``
    not), except tile 0, which is masked when the document starts off the 16-token grid (it holds the
    previous document's keys) or with ``masked_tile0``. Merged items do not occur in the FP8 lists.

    Args:
        items: ``(n_items, 4)`` ints ``(doc, q_start, q_end, cost)``; cu_seqlens: ``(n_docs + 1,)`` ints;
        config: ``block_n`` and ``causal`` of the list; masked_tile0: the launch's ``masked_tile0``.

    Returns:
        int64 ``(n_items,)``: causal at least 1 (the diagonal); non-causal 0 for an aligned item whose
        document ends on the tile grid.
    """
    it = np.asarray(items, dtype=np.int64).reshape(-1, 4)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    doc, qs, qe = it[:, 0], it[:, 1], it[:, 2]
    ds, de = cu[doc], cu[doc + 1]
    ph = ds % 16
    lo = ds - ph
    bn = int(config.block_n)
    hi = qe if config.causal else de
    n = (hi - lo + bn - 1) // bn
    u1 = np.maximum(qs - lo + 1, 0) // bn if config.causal else (hi - lo) // bn
    tile0_masked = (ph > 0) | bool(masked_tile0)
    return n - u1 + ((u1 > 0) & tile0_masked)
