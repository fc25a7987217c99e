"""Server-rendered SVG pictures of the service page (matplotlib, Agg/SVG backends, no pyplot).

- :func:`length_histogram_svg`: documents per log2 length bin (and their share of tokens);
- :func:`gantt_svg`: per-SM timeline of one simulated schedule (static or dynamic), each bar one
  work item coloured by its cost in key tiles; at most ``max_sms`` SM lanes are drawn (evenly
  sampled, always including the busiest) and at most ``max_bars_per_sm`` bars per lane
  (consecutive items merged above that), so the SVG stays small for 131,072-document mixes;
- :func:`history_svg`: predicted vs measured ms of recorded runs with the ±10 % band.

Rendering holds a module lock: matplotlib's global state (rcParams, font cache) is not thread-safe
and FastAPI runs sync work in a thread pool. Text is kept as text (``svg.fonttype = none``) and the
SVG ids are salted deterministically, so the same input gives the same bytes.
"""
from __future__ import annotations

import io
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg", force=False)

import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["ScheduleView", "gantt_svg", "history_svg", "length_histogram_svg", "sample_lanes"]

_LOCK = threading.Lock()
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.DOTALL)
_RC = {"svg.fonttype": "none", "svg.hashsalt": "flamia", "font.size": 9, "axes.titlesize": 10}


def _render(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", dpi=150, metadata={"Date": None})
    svg = buf.getvalue()
    # drop the XML prolog / DOCTYPE and the RDF metadata block so the SVG inlines small and clean
    i = svg.find("<svg")
    svg = svg[i:] if i >= 0 else svg
    return _METADATA.sub("", svg)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleView:
    """One simulated schedule, flattened to per-item arrays (all shape ``(n_items,)``).

    Attributes:
        name: ``"static"`` or ``"dynamic"``.
        sm: int, SM (persistent CTA slot) that ran the item, in ``[0, num_sms)``.
        start_ms, end_ms: float, item start / end time (ms).
        cost: int, visible key tiles of the item.
        num_sms: SMs of the simulated GPU.
        makespan_ms: the schedule's predicted time (ms).
        units: (item, head) units of the schedule (default ``len(sm)``).
        busy_only: the arrays hold one bar per SM (its total busy time), not units: drawn in one
            colour without a cost scale.
        note: a second title line.
    """

    name: str
    sm: np.ndarray
    start_ms: np.ndarray
    end_ms: np.ndarray
    cost: np.ndarray
    num_sms: int
    makespan_ms: float
    units: int | None = None
    busy_only: bool = False
    note: str = ""


def sample_lanes(busy_ms: np.ndarray, max_sms: int) -> np.ndarray:
    """SM indices to draw: all if ``len(busy_ms) <= max_sms``, else ``max_sms`` evenly spaced ones
    with the busiest SM (the one that sets the makespan) always included. Sorted ascending."""
    n = int(busy_ms.shape[0])
    if n <= max_sms:
        return np.arange(n)
    lanes = np.unique(np.linspace(0, n - 1, max_sms).round().astype(np.int64))
    busiest = int(np.argmax(busy_ms))
    if busiest not in lanes:
        lanes[np.argmin(np.abs(lanes - busiest))] = busiest
        lanes = np.unique(lanes)
    return lanes


def _merge_bars(start: np.ndarray, end: np.ndarray, cost: np.ndarray, max_bars: int):
    """Merge consecutive (time-ordered) bars of one lane into at most ``max_bars`` groups.
    Returns (start, end, mean cost) per group."""
    n = start.shape[0]
    if n <= max_bars:
        return start, end, cost.astype(np.float64)
    edges = np.linspace(0, n, max_bars + 1).round().astype(np.int64)
    lo, hi = edges[:-1], edges[1:] - 1
    sums = np.add.reduceat(cost.astype(np.float64), lo)
    return start[lo], end[hi], sums / (hi - lo + 1)


def gantt_svg(
    view: ScheduleView,
    *,
    max_sms: int = 64,
    max_bars_per_sm: int = 48,
    xmax_ms: float | None = None,
    rasterize_above: int = 400,
) -> str:
    """Per-SM Gantt chart of one schedule as an inline ``<svg>`` string.

    Args:
        view: the schedule (see :class:`ScheduleView`).
        max_sms: most SM lanes drawn (evenly sampled, busiest included).
        max_bars_per_sm: most bars per lane; consecutive items are merged above it.
        xmax_ms: common x-axis end (so static and dynamic charts compare); default the makespan.
        rasterize_above: draw the bars as an embedded bitmap (150 dpi) when there are more than this
            many (keeps the SVG around 100 KB instead of ~0.5 MB for 3,000 bars).

    Returns:
        str, an ``<svg ...>...</svg>`` element (no XML prolog).
    """
    sm = np.asarray(view.sm, dtype=np.int64)
    start = np.asarray(view.start_ms, dtype=np.float64)
    end = np.asarray(view.end_ms, dtype=np.float64)
    cost = np.asarray(view.cost, dtype=np.int64)
    num_sms = max(int(view.num_sms), int(sm.max()) + 1 if sm.size else 1)
    busy = np.zeros(num_sms)
    if sm.size:
        np.maximum.at(busy, sm, end)
    lanes = sample_lanes(busy, max_sms)
    order = np.lexsort((start, sm))
    sm_s, st_s, en_s, co_s = sm[order], start[order], end[order], cost[order]
    bounds = np.searchsorted(sm_s, np.concatenate([lanes, lanes + 1]))
    lo_b, hi_b = bounds[: lanes.size], bounds[lanes.size :]
    polys = []
    colors = []
    for row, (lo, hi) in enumerate(zip(lo_b, hi_b)):
        if hi <= lo:
            continue
        s, e, c = _merge_bars(st_s[lo:hi], en_s[lo:hi], co_s[lo:hi], max_bars_per_sm)
        y0, y1 = row - 0.4, row + 0.4
        for a, b in zip(s, e):
            polys.append(((a, y0), (b, y0), (b, y1), (a, y1)))
        colors.append(c)
    cvals = np.concatenate(colors) if colors else np.zeros(0)
    xmax = float(xmax_ms) if xmax_ms else max(float(view.makespan_ms), float(end.max()) if end.size else 1.0)
    height = 1.2 + 0.09 * lanes.size
    with _LOCK, matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, min(max(height, 2.2), 4.2)))
        ax = fig.add_subplot()
        if polys and view.busy_only:
            coll = PolyCollection(polys, facecolors="#4c72b0", linewidths=0)
            coll.set_rasterized(len(polys) > rasterize_above)
            ax.add_collection(coll)
        elif polys:
            coll = PolyCollection(polys, array=cvals, cmap="viridis", linewidths=0)
            # many bars: embed them as one bitmap inside the SVG (axes and text stay vector)
            coll.set_rasterized(len(polys) > rasterize_above)
            coll.set_clim(float(cost.min()), max(float(cost.max()), float(cost.min()) + 1))
            ax.add_collection(coll)
            cb = fig.colorbar(coll, ax=ax, pad=0.01, fraction=0.04)
            cb.set_label("item cost (key tiles)")
        ax.axvline(view.makespan_ms, color="#c0392b", lw=1.2)
        ax.text(view.makespan_ms, -0.9, f" {view.makespan_ms:.3f} ms", color="#c0392b", va="bottom", ha="left")
        ax.set_xlim(0, xmax * 1.04)
        ax.set_ylim(lanes.size - 0.5, -1.0)
        step = max(1, lanes.size // 8)
        ax.set_yticks(np.arange(0, lanes.size, step))
        ax.set_yticklabels([str(int(x)) for x in lanes[::step]])
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("SM")
        shown = f"{lanes.size} of {num_sms} SMs" if lanes.size < num_sms else f"{num_sms} SMs"
        units = view.units if view.units is not None else sm.size
        title = f"{view.name} schedule: {units:,} (item, head) units on {shown}"
        ax.set_title(title + (f"\n{view.note}" if view.note else ""))
        fig.tight_layout()
        return _render(fig)


def length_histogram_svg(lengths: np.ndarray, *, capacity: int | None = None) -> str:
    """Documents per power-of-two length bin, with each bin's share of tokens on a second axis.

    Args:
        lengths: int ``(n_docs,)`` document lengths (zeros are left out).
        capacity: row capacity, drawn as a vertical line when given.

    Returns:
        str, an inline ``<svg>`` element.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    lens = lens[lens > 0]
    with _LOCK, matplotlib.rc_context(_RC):
        fig = Figure(figsize=(7.5, 2.6))
        ax = fig.add_subplot()
        if lens.size:
            top = int(np.ceil(np.log2(max(int(lens.max()), 2)))) + 1
            edges = 2.0 ** np.arange(0, top + 1)
            counts, _ = np.histogram(lens, bins=edges)
            tokens, _ = np.histogram(lens, bins=edges, weights=lens.astype(np.float64))
            centers = np.sqrt(edges[:-1] * edges[1:])
            ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4c72b0", alpha=0.85, label="documents")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log" if counts.max() > 50 else "linear")
            ax2 = ax.twinx()
            ax2.plot(centers, 100.0 * tokens / tokens.sum(), "o-", color="#dd8452", ms=3, lw=1.2, label="% of tokens")
            ax2.set_ylabel("% of tokens")
            ax2.set_ylim(0, 105)
            if capacity:
                ax.axvline(capacity, color="#555", ls="--", lw=1)
                ax.text(capacity, ax.get_ylim()[1], " capacity", va="top", ha="left", color="#555")
        ax.set_xlabel("document length (tokens, log2 bins)")
        ax.set_ylabel("documents")
        ax.set_title(f"length mix: {lens.size} documents, {int(lens.sum())} tokens")
        fig.tight_layout()
        return _render(fig)


def history_svg(predicted_ms: Sequence[float], measured_ms: Sequence[float], labels: Sequence[str] = ()) -> str:
    """Predicted vs measured ms of recorded runs (log-log), the y = x line and a ±10 % band.

    Returns:
        str, an inline ``<svg>`` element ("no runs recorded yet" when empty).
    """
    p = np.asarray(predicted_ms, dtype=np.float64)
    m = np.asarray(measured_ms, dtype=np.float64)
    with _LOCK, matplotlib.rc_context(_RC):
        fig = Figure(figsize=(4.6, 3.6))
        ax = fig.add_subplot()
        ok = (p > 0) & (m > 0)
        if ok.any():
            lo = float(min(p[ok].min(), m[ok].min())) / 1.5
            hi = float(max(p[ok].max(), m[ok].max())) * 1.5
            xs = np.geomspace(lo, hi, 50)
            ax.fill_between(xs, xs * 0.9, xs * 1.1, color="#dddddd", label="±10 %")
            ax.plot(xs, xs, color="#888", lw=1)
            ax.scatter(m[ok], p[ok], s=16, color="#4c72b0", zorder=3, label="runs")
            for x, y, t in zip(m[ok], p[ok], list(labels)[: int(ok.sum())] if labels else []):
                ax.annotate(t, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.legend(loc="upper left", frameon=False)
        else:
            ax.text(0.5, 0.5, "no runs recorded yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted (ms)")
        ax.set_title(f"predicted vs measured ({int(ok.sum())} runs)")
        fig.tight_layout()
        return _render(fig)
