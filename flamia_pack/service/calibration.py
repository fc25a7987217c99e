"""Refit the simulator's (a, b) from recorded runs (``POST /v1/calibration:refit``).

No web imports. Model (``flamia_pack.scheduler.simulate``): one (item, head) unit of ``c`` visible
key tiles takes ``a * c + b`` us on one SM, and a call's time is the schedule's makespan, i.e. the
time of its busiest SM: ``a * T + b * N`` with ``T`` tiles and ``N`` units on that SM. For a fixed
schedule this is linear in (a, b), so the refit alternates:

1. simulate every run's chosen schedule with the current (a, b) (:func:`flamia_pack.scheduler.simulate.predict`)
   and read the busiest SM's ``(T, N)`` (:func:`flamia_pack.service.engine.critical_load`);
2. solve ``min sum_i ((a T_i + b N_i) / m_i - 1)^2`` over ``a > 0, b >= 0`` (relative error, so
   short and long runs weigh alike; two-variable non-negative least squares, exact);

three rounds (the dynamic schedule depends on b / a, so the busiest SM can change). One (a, b)
per calibration key ``(gpu, kernel path, head_dim)``; keys need at least two runs. The result is a
new :class:`~flamia_pack.scheduler.simulate.CalibrationTable` (the old one with those entries
replaced, ``measured=True``) under a new version; it is never written over the shipped file.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.simulate import Calibration, CalibrationTable, nnls, predict

from flamia_pack.service.engine import critical_load, fwd_bwd_path

__all__ = ["EntryFit", "FitRun", "refit", "table_to_json"]

ROUNDS = 3
_A_MIN = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class FitRun:
    """One recorded run as the refit needs it."""

    gpu: str
    precision: str
    head_dim: int
    causal: bool
    num_heads: int
    num_kv_heads: int
    seqlens: np.ndarray
    """int64 segment lengths of the call, packed row order."""
    measured_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryFit:
    """The refit of one calibration key."""

    gpu: str
    kernel_path: str
    precision: str
    head_dim: int
    a_us_per_tile: float
    b_us_per_item: float
    runs: int
    rms_error_pct: float
    """RMS of 100 * (predicted - measured) / measured over the runs, with the new (a, b)."""


def _predict_ms(run: FitRun, cal: Calibration, *, keep: bool):
    return predict(
        run.seqlens,
        num_heads=run.num_heads,
        num_kv_heads=run.num_kv_heads,
        head_dim=run.head_dim,
        causal=run.causal,
        precision=run.precision,
        gpu=run.gpu,
        pass_="fwd_bwd",
        calibration=cal,
        max_intervals=2**62 if keep else 0,
    )


def refit(runs: list[FitRun], table: CalibrationTable, *, version: str) -> tuple[CalibrationTable, list[EntryFit]]:
    """Fit (a, b) per calibration key to ``runs`` and return the new table and the fits.

    Args:
        runs: recorded runs (measured fwd+bwd time of one training call, ms).
        table: the calibration in use (entries not refitted are kept; start values come from it).
        version: the new table's version string.

    Returns:
        ``(new_table, fits)``.

    Raises:
        FlamiaError: no key has at least two runs with a positive measured time.
    """
    groups: dict[tuple[str, str, int], list[FitRun]] = defaultdict(list)
    for r in runs:
        if r.measured_ms > 0 and r.seqlens.size:
            groups[(r.gpu, fwd_bwd_path(r.precision), int(r.head_dim))].append(r)
    usable = {k: v for k, v in groups.items() if len(v) >= 2}
    if not usable:
        have = ", ".join(f"{g}/{p}/D{d}: {len(v)}" for (g, p, d), v in groups.items()) or "none"
        raise FlamiaError(
            f"a refit needs at least 2 recorded runs of one (gpu, kernel path, head_dim); recorded: {have}"
        )
    entries = list(table.entries)
    fits: list[EntryFit] = []
    for (gpu, path, head_dim), grp in sorted(usable.items()):
        try:
            start = table.lookup(path, head_dim, gpu)
        except FlamiaError:
            start = Calibration(kernel_path=path, head_dim=head_dim, gpu=gpu, a_us_per_tile=1.0, b_us_per_item=0.0)
        cal = start
        m_us = np.array([r.measured_ms * 1e3 for r in grp])
        for _ in range(ROUNDS):
            A = np.array([critical_load(r.seqlens, _predict_ms(r, cal, keep=True)) for r in grp])
            x = nnls(A / m_us[:, None], np.ones(len(grp)))
            cal = dataclasses.replace(
                start,
                a_us_per_tile=max(float(x[0]), _A_MIN),
                b_us_per_item=float(x[1]),
                version=version,
                measured=True,
                source=f"refit by the service from {len(grp)} recorded runs (least squares on relative error, "
                f"busiest-SM tiles/units of the chosen schedule)",
            )
        pred = np.array([_predict_ms(r, cal, keep=False).predicted_ms for r in grp])
        rms = float(np.sqrt(np.mean((100.0 * (pred * 1e3 - m_us) / m_us) ** 2)))
        entries = [e for e in entries if not (e.kernel_path == path and e.head_dim == head_dim and e.gpu.lower() == gpu.lower())]
        entries.append(cal)
        fits.append(
            EntryFit(gpu=gpu, kernel_path=path, precision=path.split("_", 1)[0], head_dim=head_dim,
                     a_us_per_tile=cal.a_us_per_tile, b_us_per_item=cal.b_us_per_item, runs=len(grp),
                     rms_error_pct=rms)
        )
    new = CalibrationTable(
        version=version,
        entries=tuple(dataclasses.replace(e, version=version) for e in entries),
        description=(table.description + " | " if table.description else "") + f"refit -> {version}",
    )
    return new, fits


def table_to_json(table: CalibrationTable) -> dict:
    """The table in the ``calibration.json`` format read by :func:`flamia_pack.scheduler.simulate.load_calibration`."""
    return {
        "version": table.version,
        "description": table.description,
        "entries": [dataclasses.asdict(e) for e in table.entries],
    }


def table_from_json(raw: dict) -> CalibrationTable:
    """Inverse of :func:`table_to_json`.

    Raises:
        FlamiaError: malformed content.
    """
    try:
        names = {f.name for f in dataclasses.fields(Calibration)}
        entries = tuple(Calibration(**{k: v for k, v in e.items() if k in names}) for e in raw["entries"])
        return CalibrationTable(version=str(raw["version"]), entries=entries, description=str(raw.get("description", "")))
    except (KeyError, TypeError) as exc:
        raise FlamiaError(f"malformed stored calibration table: {exc}") from exc
