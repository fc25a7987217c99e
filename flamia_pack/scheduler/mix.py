"""A length mix -> rows (best-fit-decreasing) -> one predicted attention call over the packed segments.

The one code path behind ``flamia plan`` on a mix longer than ``--capacity`` and the service's
:func:`flamia_pack.service.engine.predict_mix` (DESIGN.md §6, WORKLOADS.md mixes). Nothing here
re-implements packing or the cost model: rows and fill come from :func:`flamia_pack.pack.plan_packing`,
the work list, policy, schedules, FLOPs and memory from :func:`flamia_pack.scheduler.simulate.predict`.

Layout of the predicted call:

- a mix that fits ONE row (all documents together at most ``capacity`` tokens, nothing split or
  dropped) is that row, documents in the order given;
- otherwise the mix is packed with best-fit-decreasing into rows of ``capacity`` tokens
  (``long_docs`` decides what happens to documents longer than a row) and the call runs over the
  packed *segments* of all rows, in row order, as one varlen batch (``cu_seqlens`` of the rows' used
  tokens laid end to end; row padding is not part of the call).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.pack import PackConfig, PackStats, plan_packing
from flamia_pack.scheduler.simulate import Prediction, predict

__all__ = ["LONG_DOCS", "MixPrediction", "pack_mix", "predict_packed_mix"]

LONG_DOCS = ("split", "truncate", "drop", "error")
"""``long_docs`` choices: PackConfig's three, plus ``error`` (refuse a document longer than a row)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixPrediction:
    """A mix, how it packs, and the scheduler's prediction for its attention call."""

    lengths: np.ndarray
    """int64 ``(n_docs,)``: the mix as given (including empty documents)."""
    seqlens: np.ndarray
    """int64 ``(n_segs,)``: segment lengths of the call (all >= 1): the given order for a one-row mix,
    else the packed segments in row order (see the module docstring)."""
    pack: PackStats
    """Rows, fill, splits, drops (:func:`flamia_pack.pack.plan_packing`)."""
    prediction: Prediction
    """:func:`flamia_pack.scheduler.simulate.predict` on ``seqlens``."""


def pack_mix(
    lengths: np.ndarray,
    capacity: int,
    *,
    long_docs: str = "split",
    max_segments: int | None = None,
) -> tuple[np.ndarray, PackStats]:
    """Pack a mix into rows of ``capacity`` tokens with best-fit-decreasing; the call's segments.

    Args:
        lengths: int ``(n_docs,)`` document lengths (>= 0) in the order given.
        capacity: tokens per row (>= 1).
        long_docs: ``split`` / ``truncate`` / ``drop`` (PackConfig.long_docs), or ``error``.
        max_segments: refuse mixes whose split into rows would make more pieces than this
            (None = no limit).

    Returns:
        ``(seqlens, stats)``: int64 ``(n_segs,)`` segment lengths of the call (module docstring) and
        the plan's :class:`~flamia_pack.pack.PackStats` (rows, fill, splits, drops).

    Raises:
        FlamiaError: no tokens; bad capacity / long_docs; a document longer than ``capacity`` with
            ``long_docs="error"``; more than ``max_segments`` pieces; everything dropped.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or int(lengths.sum()) == 0:
        raise FlamiaError("the mix has no tokens: give at least one document of length >= 1")
    cap = int(capacity)
    if cap < 1:
        raise FlamiaError(f"capacity must be >= 1, got {capacity}")
    if long_docs not in LONG_DOCS:
        raise FlamiaError(f"long_docs must be one of {LONG_DOCS}, got {long_docs!r}")
    if long_docs == "error":
        too_long = np.flatnonzero(lengths > cap)
        if too_long.size:
            i = int(too_long[0])
            raise FlamiaError(
                f"document {i} has {int(lengths[i])} tokens, longer than capacity {cap}, and long_docs='error' "
                f"({too_long.size} such documents); use long_docs='split', 'truncate' or 'drop', or a larger capacity"
            )
        long_docs = "split"
    if max_segments is not None and long_docs == "split":
        pieces = int(np.maximum(-(-lengths // cap), (lengths > 0).astype(np.int64)).sum())
        if pieces > max_segments:
            raise FlamiaError(
                f"splitting the mix into rows of {cap} tokens makes {pieces} pieces; this service accepts at most "
                f"{max_segments} (use a larger capacity, or long_docs='truncate' or 'drop')"
            )
    plan = plan_packing(lengths, PackConfig(capacity=cap, algorithm="bfd", long_docs=long_docs))
    if plan.n_segs == 0:
        raise FlamiaError(
            f"nothing left to attend to: long_docs={long_docs!r} dropped all {plan.stats.tokens_dropped} tokens "
            f"(every document is longer than capacity {cap})"
        )
    st = plan.stats
    if st.rows == 1 and st.docs_split == 0 and st.tokens_dropped == 0:
        seqlens = lengths[lengths > 0]  # one row: keep the given order
    else:
        seqlens = plan.seg_len.astype(np.int64)
    return seqlens, st


def predict_packed_mix(
    lengths: np.ndarray,
    *,
    capacity: int,
    long_docs: str = "split",
    max_segments: int | None = None,
    **predict_kwargs,
) -> MixPrediction:
    """Pack the mix (:func:`pack_mix`) and predict the call over its segments (:func:`predict`).

    Args:
        lengths, capacity, long_docs, max_segments: as :func:`pack_mix`.
        **predict_kwargs: passed to :func:`flamia_pack.scheduler.simulate.predict` (num_heads,
            num_kv_heads, head_dim, causal, precision, gpu, config, num_sms, pass_, policy,
            calibration, max_intervals); not ``capacity`` (the call's buffers hold its segments).

    Returns:
        :class:`MixPrediction`.

    Raises:
        FlamiaError: from :func:`pack_mix` or :func:`predict`.
    """
    if "capacity" in predict_kwargs or "seqlens" in predict_kwargs or "cu_seqlens" in predict_kwargs:
        raise TypeError("predict_packed_mix: capacity/seqlens/cu_seqlens are set by the packing, not passed through")
    lengths = np.asarray(lengths, dtype=np.int64)
    seqlens, stats = pack_mix(lengths, capacity, long_docs=long_docs, max_segments=max_segments)
    pred = predict(seqlens, **predict_kwargs)
    return MixPrediction(lengths=lengths, seqlens=seqlens, pack=stats, prediction=pred)
