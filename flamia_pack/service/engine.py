"""The service's bridge to the packer and the scheduler: a length mix -> packing + prediction.

No web imports (a GPU script can use it next to :mod:`flamia_pack.service.dispatch`). Nothing here
re-implements the cost model: rows and fill come from :func:`flamia_pack.pack.plan_packing`, the
work list, policy, both simulated schedules, FLOPs and memory from
:func:`flamia_pack.scheduler.simulate.predict` -- the code behind ``flamia plan``.

Layout of the predicted (and dispatched) call:

- a mix that fits ONE row (all documents together at most ``capacity`` tokens, nothing split or
  dropped) is that row, documents in the order given -- exactly what ``flamia plan`` predicts for
  the same lengths, and the row order WORKLOADS.md defines its mixes in;
- otherwise the mix is packed with best-fit-decreasing into rows of ``capacity`` tokens
  (``long_docs`` decides what happens to documents longer than a row) and the call runs over the
  packed *segments* of all rows, in row order, as one varlen batch (``cu_seqlens`` of the rows' used
  tokens laid end to end; row padding is not part of the call).

Rows needed and fill always come from the best-fit-decreasing plan. The packing + prediction itself is
:func:`flamia_pack.scheduler.mix.predict_packed_mix`, shared with ``flamia plan --capacity``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.mix import LONG_DOCS as _LONG_DOCS
from flamia_pack.scheduler.mix import MixPrediction, predict_packed_mix
from flamia_pack.scheduler.simulate import (
    CalibrationTable,
    Prediction,
    cost_tiles,
    kernel_path,
)
from flamia_pack.scheduler.worklist import TileConfig, build_work_list_numba

__all__ = ["MixParams", "MixPrediction", "critical_load", "fwd_bwd_path", "predict_mix", "unit_costs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MixParams:
    """Attention shape and packing options of a prediction (defaults: WORKLOADS.md)."""

    num_heads: int = 16
    """Query heads H_q."""
    num_kv_heads: int | None = None
    """K/V heads H_kv (None = H_q); must divide H_q."""
    head_dim: int = 128
    """D (64 or 128)."""
    causal: bool = True
    precision: str = "bf16"
    """``"bf16"`` or ``"fp8"``."""
    capacity: int = 65_536
    """Tokens per packed row."""
    long_docs: str = "split"
    """``split`` / ``truncate`` / ``drop`` (PackConfig.long_docs), or ``error``: refuse the mix."""
    gpu: str = "H200"
    """Calibration key."""
    policy: str = "auto"
    """``auto`` (the rule), ``static`` or ``dynamic``."""

    def __post_init__(self) -> None:
        h = int(self.num_heads)
        hk = h if self.num_kv_heads is None else int(self.num_kv_heads)
        if h < 1 or hk < 1 or h % hk:
            raise FlamiaError(
                f"num_heads ({h}) must be a positive multiple of num_kv_heads ({hk}): "
                "every K/V head serves the same number of query heads"
            )
        if self.long_docs not in _LONG_DOCS:
            raise FlamiaError(f"long_docs must be one of {_LONG_DOCS}, got {self.long_docs!r}")
        if int(self.capacity) < 1:
            raise FlamiaError(f"capacity must be >= 1, got {self.capacity}")

    @property
    def kv_heads(self) -> int:
        """H_kv with the default applied."""
        return int(self.num_heads if self.num_kv_heads is None else self.num_kv_heads)


def predict_mix(
    lengths: np.ndarray,
    params: MixParams,
    *,
    calibration: CalibrationTable | None = None,
    max_intervals: int = 0,
    max_segments: int | None = None,
) -> MixPrediction:
    """Pack the mix and predict its attention call (one training call, forward + backward).

    Args:
        lengths: int64 ``(n_docs,)`` document lengths (>= 0) in the order given.
        params: shape and options.
        calibration: table to use (None = the shipped one).
        max_intervals: keep per-unit schedule intervals (for a Gantt chart) only when the call has
            at most this many (item, head) units; 0 = never (fastest).
        max_segments: refuse mixes whose split into rows would make more pieces than this (a tiny
            capacity can turn a few long documents into millions of one-row pieces); None = no limit.

    Returns:
        :class:`MixPrediction`.

    Raises:
        FlamiaError: the mix is impossible: no tokens; a document longer than ``capacity`` with
            ``long_docs="error"``; everything dropped; heads not divisible; no calibration for
            (precision, head_dim, gpu); more than ``max_segments`` pieces.
    """
    return predict_packed_mix(
        lengths,
        capacity=int(params.capacity),
        long_docs=params.long_docs,
        max_segments=max_segments,
        num_heads=int(params.num_heads),
        num_kv_heads=params.kv_heads,
        head_dim=int(params.head_dim),
        causal=bool(params.causal),
        precision=params.precision,
        gpu=params.gpu,
        pass_="fwd_bwd",
        policy=None if params.policy == "auto" else params.policy,
        calibration=calibration,
        max_intervals=int(max_intervals),
    )


def unit_costs(seqlens: np.ndarray, pred: Prediction) -> np.ndarray:
    """Walked key tiles of every (item, head) unit in queue order (what the simulator schedules:
    :func:`flamia_pack.scheduler.simulate.cost_tiles`: walked tiles, plus the FP8 forward's masked-tile
    and per-document terms in tile units where the prediction's entry has them).

    Rebuilds the work list with the prediction's tile geometry
    (:func:`flamia_pack.scheduler.worklist.build_work_list_numba`, the builder ``predict`` uses).

    Returns:
        float64 ``(items * num_heads,)``; unit ``u`` is item ``u // num_heads``.
    """
    cu = np.zeros(np.asarray(seqlens).size + 1, dtype=np.int64)
    np.cumsum(seqlens, out=cu[1:])
    cfg = TileConfig(block_m=pred.block_m, block_n=pred.block_n, causal=pred.causal, merge_short=pred.merge_short)
    items = build_work_list_numba(cu, cfg)
    walk = cost_tiles(items, cu, cfg, pred.a_us_per_tile, pred.c_us_per_masked_tile, pred.masked_tile0,
                      pred.d_us_per_doc)
    return np.repeat(walk.astype(np.float64), pred.num_heads)


def critical_load(seqlens: np.ndarray, pred: Prediction) -> tuple[float, float]:
    """Visible tiles and units run by the busiest SM of the chosen schedule.

    Under the simulator's model that SM's time is ``a * tiles + b * units`` (us), i.e. the
    predicted makespan; recorded with every run so a refit can solve for ``(a, b)``.

    Args:
        seqlens: the call's segment lengths (as in :class:`MixPrediction`).
        pred: its prediction, made with ``max_intervals`` >= its units (intervals kept).

    Returns:
        ``(tiles, units)`` as floats.

    Raises:
        FlamiaError: the prediction kept no intervals.
    """
    sched = pred.schedules[pred.policy]
    if sched.sm is None or sched.unit is None:
        raise FlamiaError("critical_load needs a prediction made with intervals kept (max_intervals >= units)")
    unit_cost = unit_costs(seqlens, pred)[np.asarray(sched.unit)]
    p = int(sched.num_sms)
    sm = np.asarray(sched.sm, dtype=np.int64)
    tiles = np.bincount(sm, weights=unit_cost, minlength=p)
    units = np.bincount(sm, minlength=p).astype(np.float64)
    busiest = int(np.argmax(sched.per_sm_busy_us))
    return float(tiles[busiest]), float(units[busiest])


def fwd_bwd_path(precision: str) -> str:
    """Calibration kernel path of one training call (``"<precision>_fwd_bwd"``)."""
    return kernel_path(precision, "fwd_bwd")
