"""Cost model and schedule simulator: predicted time of an attention call (DESIGN.md §6).

Model
-----
The work of a call is split into **units** = (work item, query head): a persistent CTA processes
one head of one item at a time (heads of one item are adjacent in the queue, so the sorted order
is kept: unit ``u`` is item ``u // num_heads``, head ``u % num_heads``). A unit of ``c`` visible key
tiles takes ``a * c + b`` microseconds on one SM, where ``a`` (us per BLOCK_M x BLOCK_N tile of one
head) and ``b`` (us of fixed per-unit cost: prologue, LSE/O store, atomics, pipeline fill) come
from the calibration table for (kernel path, head_dim, GPU).

- ``static``: units are dealt in snake order over the SMs (one persistent CTA per SM), each SM runs
  its units back to back.
- ``dynamic``: greedy list scheduling: the next unit of the sorted queue goes to the SM that
  becomes free first (ties: lowest SM id) -- what an atomic work counter does.

Predicted time = makespan. The model ignores GQA K/V sharing, L2 locality and launch latency
(seed 001 §6 warns that tile-count models miss these); calibrate (a, b) from measurements of the
kernel itself with :func:`fit_calibration`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.cost import (PASS_FACTORS, attention_flops, document_first_items, fp8_fwd_masked_tiles,
                                        fp8_masked_tile0, lengths_from, visible_pairs)
from flamia_pack.scheduler.policy import POLICIES, choose_policy
from flamia_pack.scheduler.worklist import TileConfig, build_work_list_numba, walked_tiles

#: the most SMs (persistent CTAs) a simulated GPU may have: far above any GPU's (H200: 132), low enough
#: that a typo does not allocate per-SM state for billions
MAX_SMS = 65_536

__all__ = [
    "Calibration",
    "CalibrationTable",
    "Prediction",
    "Schedule",
    "fit_calibration",
    "kernel_path",
    "load_calibration",
    "memory_bytes",
    "predict",
    "simulate_schedule",
]

DEFAULT_CALIBRATION_PATH = Path(__file__).with_name("calibration.json")
PRECISIONS = ("bf16", "fp8")
GPU_SMS = {"H200": 132, "H100": 132}


# ----------------------------------------------------------------------------------------------
# calibration
# ----------------------------------------------------------------------------------------------


def kernel_path(precision: str = "bf16", pass_: str = "fwd_bwd") -> str:
    """Name of a kernel path in the calibration table, e.g. ``"bf16_fwd_bwd"``.

    Raises:
        FlamiaError: unknown precision or pass.
    """
    if precision not in PRECISIONS:
        raise FlamiaError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if pass_ not in PASS_FACTORS:
        raise FlamiaError(f"pass must be one of {tuple(PASS_FACTORS)}, got {pass_!r}")
    return f"{precision}_{pass_}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Per-unit time model ``t_us = a_us_per_tile * tiles + b_us_per_item (+ c_us_per_masked_tile *
    masked tiles) (+ d_us_per_doc where the unit starts a document)`` for one kernel path."""

    kernel_path: str
    """e.g. ``"bf16_fwd_bwd"`` (see :func:`kernel_path`)."""
    head_dim: int
    gpu: str
    a_us_per_tile: float
    """microseconds per BLOCK_M x BLOCK_N key tile of ONE head on one SM."""
    b_us_per_item: float
    """fixed microseconds per unit (item, head) on one SM."""
    block_m: int = 128
    block_n: int = 128
    merge_short: bool = False
    """Whether the kernel's work lists coalesce tiny documents (``TileConfig.merge_short``); a
    prediction without an explicit ``config`` uses this entry's (block_m, block_n, merge_short)."""
    version: str = ""
    source: str = ""
    """how the numbers were obtained (estimate from peers, or measured runs)."""
    measured: bool = False
    """True when fitted to runs of our own kernel on this GPU."""
    c_us_per_masked_tile: float = 0.0
    """microseconds more per key tile the kernel runs through its masked step (the FP8 forward only:
    :func:`~flamia_pack.scheduler.cost.fp8_fwd_masked_tiles`); 0 where the entry does not model it."""
    masked_tile0_max_mean: int = 0
    """with ``c_us_per_masked_tile``: the FP8 forward's ``masked_tile0`` rule the entry was fitted with
    (``gluon_fp8_fwd.MASKED_TILE0_MAX_MEAN``: rows whose mean document length, capacity / documents, is
    at most it run every item's tile 0 masked); 0: never."""
    d_us_per_doc: float = 0.0
    """microseconds more per (document, head), charged to the unit that holds the document's first query
    row (:func:`~flamia_pack.scheduler.cost.document_first_items`; the FP8 forward's entry: what a document
    costs beyond its tiles, e.g. its diagonal's setup and its quantization groups); 0 where not modelled."""

    def __post_init__(self) -> None:
        def number(x) -> bool:  # a real number (not a bool), finite
            return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < float("inf")

        if not (number(self.a_us_per_tile) and number(self.b_us_per_item) and self.a_us_per_tile > 0
                and self.b_us_per_item >= 0):
            raise FlamiaError(f"calibration needs finite numbers a > 0 and b >= 0, got a={self.a_us_per_tile!r}, "
                              f"b={self.b_us_per_item!r}")
        if not (number(self.c_us_per_masked_tile) and self.c_us_per_masked_tile >= 0):
            raise FlamiaError(f"calibration needs a finite c_us_per_masked_tile >= 0, got {self.c_us_per_masked_tile!r}")
        if not (number(self.d_us_per_doc) and self.d_us_per_doc >= 0):
            raise FlamiaError(f"calibration needs a finite d_us_per_doc >= 0, got {self.d_us_per_doc!r}")
        if isinstance(self.masked_tile0_max_mean, bool) or not isinstance(self.masked_tile0_max_mean, int) \
                or self.masked_tile0_max_mean < 0:
            raise FlamiaError(f"calibration needs an integer masked_tile0_max_mean >= 0, got "
                              f"{self.masked_tile0_max_mean!r}")

    def scaled_to(self, config: TileConfig) -> tuple[float, float, float]:
        """(a, b, c) for another tile shape: a and c scale with BLOCK_M * BLOCK_N (an approximation)."""
        f = (config.block_m * config.block_n) / (self.block_m * self.block_n)
        return self.a_us_per_tile * f, self.b_us_per_item, self.c_us_per_masked_tile * f


@dataclass(frozen=True)
class CalibrationTable:
    """All calibrations of one JSON file; :meth:`lookup` picks one."""

    version: str
    entries: tuple[Calibration, ...]
    description: str = ""

    def lookup(self, kernel_path: str, head_dim: int, gpu: str = "H200") -> Calibration:
        """The entry for ``(kernel_path, head_dim, gpu)``.

        Raises:
            FlamiaError: no such entry (the message lists what is available).
        """
        for e in self.entries:
            if e.kernel_path == kernel_path and e.head_dim == int(head_dim) and e.gpu.lower() == str(gpu).lower():
                return e
        have = ", ".join(f"{e.kernel_path}/D{e.head_dim}/{e.gpu}" for e in self.entries)
        raise FlamiaError(f"no calibration for kernel path {kernel_path!r}, head_dim {head_dim}, gpu {gpu!r}; available: {have}")


_CALIBRATION_KEYS = ("kernel_path", "head_dim", "gpu", "a_us_per_tile", "b_us_per_item")
"""Keys every calibration entry must have (the others have defaults)."""


def load_calibration(path: str | Path | None = None) -> CalibrationTable:
    """Read a calibration JSON (default: the shipped ``scheduler/calibration.json``).

    Format: ``{"version": str, "description": str, "entries": [{kernel_path, head_dim, gpu,
    a_us_per_tile, b_us_per_item, block_m, block_n, merge_short, source, measured}, ...]}``.

    Raises:
        FlamiaError: unreadable file (missing, a directory, not UTF-8, not JSON) or malformed
            content (the message names the missing key or the wrong part and the expected format).
    """
    p = Path(path) if path is not None else DEFAULT_CALIBRATION_PATH
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise FlamiaError(f"cannot read calibration {p}: not valid JSON ({exc})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise FlamiaError(f"cannot read calibration {p}: {exc}") from exc
    expected = ('expected {"version": str, "entries": [{' + ", ".join(_CALIBRATION_KEYS) + ', ...}, ...]}')
    if not isinstance(raw, dict):
        raise FlamiaError(f"malformed calibration {p}: the top level is not a JSON object; {expected}")
    for key in ("version", "entries"):
        if key not in raw:
            raise FlamiaError(f"malformed calibration {p}: missing key {key!r}; {expected}")
    if not isinstance(raw["entries"], list):
        raise FlamiaError(f"malformed calibration {p}: 'entries' is not a list; {expected}")
    for i, e in enumerate(raw["entries"]):
        if not isinstance(e, dict):
            raise FlamiaError(f"malformed calibration {p}: entries[{i}] is not a JSON object; {expected}")
        missing = [k for k in _CALIBRATION_KEYS if k not in e]
        if missing:
            raise FlamiaError(f"malformed calibration {p}: entries[{i}] is missing key(s) "
                              f"{', '.join(map(repr, missing))}; {expected}")
    try:
        version = str(raw["version"])
        names = {f.name for f in dataclasses.fields(Calibration)}
        entries = tuple(
            Calibration(**{k: v for k, v in e.items() if k in names}, version=version)
            if "version" not in e
            else Calibration(**{k: v for k, v in e.items() if k in names})
            for e in raw["entries"]
        )
    except (KeyError, TypeError) as exc:
        raise FlamiaError(f"malformed calibration {p}: {exc}; {expected}") from exc
    return CalibrationTable(version=version, entries=entries, description=str(raw.get("description", "")))


# ----------------------------------------------------------------------------------------------
# simulator
# ----------------------------------------------------------------------------------------------


@dataclass
class Schedule:
    """Result of :func:`simulate_schedule`.

    Attributes:
        policy: ``"static"`` or ``"dynamic"``.
        makespan_us: finish time of the last SM.
        busy_fraction: total busy time / (num_sms * makespan), in [0, 1].
        per_sm_busy_us: ``(num_sms,)`` float64 busy time of each SM.
        sm, start_us, end_us, unit: per-unit interval arrays (int32 / float64 / float64 / int64),
            in queue order; None when more than ``max_intervals`` units were simulated.
    """

    policy: str
    num_sms: int
    makespan_us: float
    busy_fraction: float
    per_sm_busy_us: np.ndarray
    sm: np.ndarray | None = None
    start_us: np.ndarray | None = None
    end_us: np.ndarray | None = None
    unit: np.ndarray | None = None

    def intervals(self, limit: int | None = None) -> list[tuple[int, float, float, int]]:
        """``[(sm, start_us, end_us, unit_index), ...]`` for a Gantt chart (first ``limit`` units)."""
        if self.sm is None:
            return []
        n = len(self.sm) if limit is None else min(int(limit), len(self.sm))
        return [(int(self.sm[i]), float(self.start_us[i]), float(self.end_us[i]), int(self.unit[i])) for i in range(n)]

    def to_dict(self, with_intervals: bool = False, limit: int = 20000) -> dict:
        """JSON-serialisable dict: policy, num_sms, makespan_us, busy_fraction, and with
        ``with_intervals`` the first ``limit`` busy intervals ``(sm, start_us, end_us, unit)``."""
        d = {
            "policy": self.policy,
            "num_sms": self.num_sms,
            "makespan_us": self.makespan_us,
            "busy_fraction": self.busy_fraction,
        }
        if with_intervals:
            d["intervals"] = self.intervals(limit)
        return d


_sift_kernel = None


def _get_sift():
    """Min-heap sift-down shared by the dynamic simulators: moves ``(ht[i], hs[i])`` down the
    binary heap of (SM free time, SM id), ordered by time, ties by SM id (numba, compiled lazily)."""
    global _sift_kernel
    if _sift_kernel is None:
        import numba

        @numba.njit(cache=True, nogil=True, inline="always")
        def _sift(ht, hs, i, p):  # pragma: no cover - compiled
            t = ht[i]
            s = hs[i]
            while True:
                l = 2 * i + 1
                if l >= p:
                    break
                c = l
                r = l + 1
                if r < p and (ht[r] < ht[l] or (ht[r] == ht[l] and hs[r] < hs[l])):
                    c = r
                if ht[c] < t or (ht[c] == t and hs[c] < s):
                    ht[i] = ht[c]
                    hs[i] = hs[c]
                    i = c
                else:
                    break
            ht[i] = t
            hs[i] = s

        _sift_kernel = _sift
    return _sift_kernel


_dyn_kernel = None


def _get_dynamic_kernel():
    global _dyn_kernel
    if _dyn_kernel is None:
        import numba

        _sift = _get_sift()

        @numba.njit(cache=True, nogil=True)
        def _dynamic(times, p, keep):  # pragma: no cover - compiled
            n = times.shape[0]
            # binary min-heap of (free_time, sm); ties broken by sm id
            ht = np.zeros(p, np.float64)
            hs = np.arange(p).astype(np.int64)
            busy = np.zeros(p, np.float64)
            nk = n if keep else 0
            sm_out = np.empty(nk, np.int32)
            st_out = np.empty(nk, np.float64)
            en_out = np.empty(nk, np.float64)
            for u in range(n):
                t0 = ht[0]
                s = hs[0]
                t1 = t0 + times[u]
                busy[s] += times[u]
                if keep:
                    sm_out[u] = s
                    st_out[u] = t0
                    en_out[u] = t1
                # replace the root by (t1, s) and sift it down
                ht[0] = t1
                hs[0] = s
                _sift(ht, hs, 0, p)
            makespan = 0.0
            for i in range(p):
                if ht[i] > makespan:
                    makespan = ht[i]
            return makespan, busy, sm_out, st_out, en_out

        _dyn_kernel = _dynamic
    return _dyn_kernel


_fast_kernels = None


def _get_fast_kernels():
    """Interval-free simulators on the ITEM table (the service's fast path): the same per-SM
    busy times as :func:`simulate_schedule` on ``np.repeat(item_costs, h)``, bit for bit (the
    same float additions in the same order per SM), without building the unit arrays.

    - static: the queue in runs of equal unit time; a whole round of P units gives every SM one
      unit (either direction), so rounds are applied as one addition per SM; partial rounds unit
      by unit with the snake position;
    - dynamic: units come in runs of equal time (equal item cost, sorted queue). While the spread
      of SM free times is below the unit time t (``fmin + t > fmax``) the greedy rule gives every
      SM exactly one unit per round of P units, whatever the order inside the round, so whole
      rounds are applied as repeated additions per SM; the rest (``< P`` units of a run, or while
      the spread is large) goes through the same min-heap as ``_dynamic``. Heap ties (equal free
      times) are broken by SM id, as there; the heap is rebuilt after each block of rounds.
    """
    global _fast_kernels
    if _fast_kernels is None:
        import numba

        _sift = _get_sift()

        @numba.njit(cache=True, nogil=True)
        def _static_items(costs, h, p, a, b):  # pragma: no cover - compiled
            busy = np.zeros(p, np.float64)
            pos = 0  # snake position of the next unit inside its round
            odd = False  # direction of the current round
            n = costs.shape[0]
            i = 0
            while i < n:
                j = i
                while j < n and costs[j] == costs[i]:
                    j += 1
                t = a * costs[i] + b
                k = (j - i) * h
                i = j
                while k > 0 and pos != 0:  # finish the current round unit by unit
                    busy[p - 1 - pos if odd else pos] += t
                    k -= 1
                    pos += 1
                    if pos == p:
                        pos = 0
                        odd = not odd
                q = k // p  # whole rounds: one unit per SM each, in either direction
                for _ in range(q):
                    for m in range(p):
                        busy[m] += t
                if q % 2 == 1:
                    odd = not odd
                k -= q * p
                while k > 0:  # start of the next round
                    busy[p - 1 - pos if odd else pos] += t
                    k -= 1
                    pos += 1
            return busy

        @numba.njit(cache=True, nogil=True)
        def _dynamic_items(costs, h, p, a, b):  # pragma: no cover - compiled
            ht = np.zeros(p, np.float64)
            hs = np.arange(p).astype(np.int64)
            fmax = 0.0
            n = costs.shape[0]
            i = 0
            while i < n:
                j = i
                while j < n and costs[j] == costs[i]:
                    j += 1
                t = a * costs[i] + b
                k = (j - i) * h
                i = j
                while k > 0:
                    if k >= p and ht[0] + t > fmax:
                        fmin = ht[0]
                        q = 0
                        while k >= p and fmin + t > fmax:
                            fmin = fmin + t
                            fmax = fmax + t
                            q += 1
                            k -= p
                        for _ in range(q):  # per SM: q additions of t, in order (vectorises over SMs)
                            for m in range(p):
                                ht[m] += t
                        for m in range(p // 2 - 1, -1, -1):
                            _sift(ht, hs, m, p)
                    else:
                        t1 = ht[0] + t
                        if t1 > fmax:
                            fmax = t1
                        ht[0] = t1
                        _sift(ht, hs, 0, p)
                        k -= 1
            busy = np.zeros(p, np.float64)
            for m in range(p):
                busy[hs[m]] = ht[m]
            return busy

        _fast_kernels = (_static_items, _dynamic_items)
    return _fast_kernels


def _simulate_items(item_costs: np.ndarray, h: int, p: int, a: float, b: float, policy: str) -> Schedule:
    """:func:`simulate_schedule` of ``np.repeat(item_costs, h)`` without intervals (fast path)."""
    static_k, dynamic_k = _get_fast_kernels()
    c = np.ascontiguousarray(item_costs, dtype=np.float64)
    busy = (static_k if policy == "static" else dynamic_k)(c, int(h), int(p), float(a), float(b))
    makespan = float(busy.max()) if c.size else 0.0
    total = float(busy.sum())
    return Schedule(policy=policy, num_sms=p, makespan_us=makespan,
                    busy_fraction=total / (p * makespan) if makespan > 0 else 0.0, per_sm_busy_us=busy)


def _snake(n: int, p: int) -> np.ndarray:
    k = np.arange(n, dtype=np.int64)
    r = k // p
    pos = k - r * p
    return np.where(r % 2 == 0, pos, p - 1 - pos)


def simulate_schedule(
    costs: np.ndarray,
    num_sms: int,
    a: float,
    b: float,
    policy: str,
    *,
    max_intervals: int = 1_000_000,
) -> Schedule:
    """Simulate one schedule of the sorted queue and return its makespan and busy intervals.

    Args:
        costs: ``(n_units,)`` visible key tiles of each unit, in queue order (the sorted work
            list, heads innermost: ``np.repeat(items[:, 3], num_heads)``).
        num_sms: P, persistent CTAs (one per SM).
        a: microseconds per tile; b: microseconds per unit.
        policy: ``"static"`` (snake) or ``"dynamic"`` (next unit to the earliest-free SM).
        max_intervals: keep per-unit intervals only up to this many units (memory).

    Returns:
        :class:`Schedule`. Invariants: ``makespan >= sum(t) / P`` and ``>= max(t)``; with
        P = 1 both policies give ``sum(t)``.

    Raises:
        FlamiaError: unknown policy, P outside ``[1, MAX_SMS]``, negative costs or a/b.
    """
    if policy not in POLICIES:
        raise FlamiaError(f"policy must be one of {POLICIES}, got {policy!r}")
    p = int(num_sms)
    if not 1 <= p <= MAX_SMS:
        raise FlamiaError(f"num_sms must be in [1, {MAX_SMS:,}] (SMs / persistent CTAs of one GPU), got {num_sms}")
    if a < 0 or b < 0:
        raise FlamiaError(f"a and b must be >= 0, got {a}, {b}")
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    if c.size and c.min() < 0:
        raise FlamiaError("costs must be >= 0")
    n = c.size
    times = a * c + b
    keep = n <= max_intervals
    if n == 0:
        return Schedule(policy, p, 0.0, 0.0, np.zeros(p), np.zeros(0, np.int32), np.zeros(0), np.zeros(0),
                        np.zeros(0, np.int64))
    if policy == "static":
        sm = _snake(n, p)
        busy = np.bincount(sm, weights=times, minlength=p)
        makespan = float(busy.max())
        if keep:
            order = np.argsort(sm, kind="stable")
            cs = np.cumsum(times[order])
            grp_start = np.concatenate([[0.0], np.cumsum(np.bincount(sm, weights=times, minlength=p))[:-1]])
            end_sorted = cs - grp_start[sm[order]]
            end = np.empty(n)
            end[order] = end_sorted
            start = end - times
            sm_arr = sm.astype(np.int32)
        else:
            sm_arr = start = end = None
    else:
        makespan, busy, sm_arr, start, end = _get_dynamic_kernel()(times, p, keep)
        makespan = float(makespan)
        if not keep:
            sm_arr = start = end = None
    frac = float(times.sum() / (p * makespan)) if makespan > 0 else 0.0
    return Schedule(
        policy=policy,
        num_sms=p,
        makespan_us=makespan,
        busy_fraction=frac,
        per_sm_busy_us=np.asarray(busy, dtype=np.float64),
        sm=sm_arr,
        start_us=start,
        end_us=end,
        unit=np.arange(n, dtype=np.int64) if keep else None,
    )


# ----------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------


def memory_bytes(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, pass_: str = "fwd_bwd") -> int:
    """Bytes of the call's own tensors for ``tokens`` tokens (WORKLOADS.md S2 convention).

    BF16 (2 B): q, o (and dO, dq for a backward) with ``num_heads`` heads; k, v (and dk, dv) with
    ``num_kv_heads`` heads; fp32 (4 B) lse per (token, query head). FP8 copies and workspaces are
    not counted (they are per-kernel choices).
    """
    t, h, hk, d = int(tokens), int(num_heads), int(num_kv_heads), int(head_dim)
    fwd = 2 * t * d * (2 * h + 2 * hk) + 4 * t * h
    if pass_ == "fwd":
        return fwd
    return fwd + 2 * t * d * (2 * h + 2 * hk)


# ----------------------------------------------------------------------------------------------
# prediction
# ----------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    """What :func:`predict` knows about one packed row (all numbers for ONE call of ``pass_``)."""

    docs: int
    tokens: int
    capacity: int
    max_len: int
    mean_len: float
    pairs: int
    flops: float
    items: int
    tiles: int
    """visible key tiles summed over items, per head (multiply by num_heads for all heads)."""
    units: int
    """items * num_heads: what the simulator schedules."""
    policy: str
    reason: str
    static_ms: float
    dynamic_ms: float
    predicted_ms: float
    """time under the chosen policy."""
    predicted_tflops: float
    memory_packed_bytes: int
    memory_padded_bytes: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    precision: str
    pass_: str
    gpu: str
    num_sms: int
    block_m: int
    block_n: int
    merge_short: bool
    kernel_path: str
    a_us_per_tile: float
    b_us_per_item: float
    calibration_version: str
    calibration_source: str
    calibration_measured: bool
    schedules: dict[str, Schedule] = field(default_factory=dict, repr=False)
    c_us_per_masked_tile: float = 0.0
    """the entry's masked-tile term, scaled to the prediction's tiles (0: none)."""
    masked_tile0: bool = False
    """with ``c_us_per_masked_tile``: whether the FP8 forward's ``masked_tile0`` rule applies to this row."""
    d_us_per_doc: float = 0.0
    """the entry's per-(document, head) term (0: none)."""

    def to_dict(self, with_intervals: bool = False, limit: int = 20000) -> dict:
        """JSON-ready dict (schedules summarised; intervals only if asked)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "schedules"}
        d["schedules"] = {k: s.to_dict(with_intervals, limit) for k, s in self.schedules.items()}
        return d


def cost_tiles(items: np.ndarray, cu: np.ndarray, cfg: TileConfig, a: float, c: float = 0.0,
               masked_tile0: bool = False, d: float = 0.0) -> np.ndarray:
    """Each item's time in tile units, the simulator's cost: the walked tiles
    (:func:`~flamia_pack.scheduler.worklist.walked_tiles`), plus ``c / a`` per tile the FP8 forward runs
    masked (:func:`~flamia_pack.scheduler.cost.fp8_fwd_masked_tiles`) where the entry has ``c > 0``, plus
    ``d / a`` per document the item starts (:func:`~flamia_pack.scheduler.cost.document_first_items`) where
    ``d > 0``. int64 walked tiles without those terms, else float64."""
    walk = walked_tiles(items, cu, cfg)
    if c > 0:
        walk = walk + (c / a) * fp8_fwd_masked_tiles(items, cu, cfg, masked_tile0=masked_tile0)
    if d > 0:
        walk = walk + (d / a) * document_first_items(items, cu)
    return walk


def predict(
    seqlens=None,
    *,
    cu_seqlens=None,
    num_heads: int = 16,
    num_kv_heads: int | None = None,
    head_dim: int = 128,
    causal: bool = True,
    precision: str = "bf16",
    capacity: int | None = None,
    gpu: str = "H200",
    config: TileConfig | None = None,
    num_sms: int | None = None,
    pass_: str = "fwd_bwd",
    policy: str | None = None,
    calibration: CalibrationTable | Calibration | None = None,
    max_intervals: int = 1_000_000,
) -> Prediction:
    """Predict cost and time of one attention call on one packed row (DESIGN.md §6).

    Builds the work list (numba host builder, same semantics as the GPU builder), simulates the
    static and the dynamic schedule with the calibrated per-unit time and picks the policy
    (:func:`choose_policy`, or ``policy``).

    Args:
        seqlens: document lengths in row order (1-D ints), or give ``cu_seqlens`` instead.
        cu_seqlens: ``(n_docs + 1,)`` offsets (validated).
        num_heads: query heads H_q; num_kv_heads: K/V heads (default H_q; must divide H_q).
        head_dim: D (64 or 128 in the shipped calibration).
        causal: causal attention (overrides ``config.causal``).
        precision: ``"bf16"`` or ``"fp8"``.
        capacity: row length T the buffers are sized for (default: the tokens); must be >= tokens.
        gpu: calibration key (``"H200"``); num_sms: persistent CTAs, an integer in ``[1, MAX_SMS]`` (default
            from the GPU: 132 on H200).
        config: tile geometry (block_m/block_n/merge_short); default: the calibration entry's
            geometry, i.e. the work lists the calibrated kernel really builds.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"`` (one training call).
        policy: None/"auto" (rule), "static" or "dynamic".
        calibration: a table, one entry, or None for the shipped table.

    Returns:
        :class:`Prediction` with ``schedules = {"static": Schedule, "dynamic": Schedule}``.

    Raises:
        FlamiaError: invalid lengths, zero documents, bad heads/precision/pass/capacity, num_sms
            not an integer >= 1, missing calibration entry.
    """
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer))
                                or not 1 <= num_sms <= MAX_SMS):
        raise FlamiaError(f"num_sms must be an integer in [1, {MAX_SMS:,}] (persistent CTAs, one per SM), got "
                          f"{num_sms!r}")
    if cu_seqlens is not None and seqlens is not None:
        raise FlamiaError("give seqlens or cu_seqlens, not both")
    if cu_seqlens is None and seqlens is None:
        raise FlamiaError("give seqlens or cu_seqlens")
    lens = lengths_from(seqlens, cu_seqlens=cu_seqlens)
    if lens.size == 0:
        raise FlamiaError("no documents: give at least one document length")
    if lens.min() < 1:
        raise FlamiaError(f"document lengths must be >= 1, got {int(lens.min())} at index {int(np.argmin(lens))}")
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer))):
            raise FlamiaError(f"{name} must be an integer, got {val!r}")
    h = int(num_heads)
    hk = h if num_kv_heads is None else int(num_kv_heads)
    if h < 1 or hk < 1 or h % hk:
        raise FlamiaError(f"num_heads ({h}) must be a positive multiple of num_kv_heads ({hk})")
    if int(head_dim) < 1:
        raise FlamiaError(f"head_dim must be >= 1, got {head_dim}")
    path = kernel_path(precision, pass_)
    tokens = int(lens.sum())
    if tokens >= 2**31:
        raise FlamiaError(f"documents total {tokens} tokens; one call holds at most 2**31 - 1 tokens "
                          "(int32 cu_seqlens): split them into several calls")
    cap = tokens if capacity is None else int(capacity)
    if cap < 1:
        raise FlamiaError(f"capacity must be >= 1 token, got {cap}")
    if cap < tokens:
        raise FlamiaError(f"documents total {tokens} tokens, more than capacity {cap}")
    if cap >= 2**31:
        raise FlamiaError(f"capacity {cap} does not fit int32 offsets (at most 2**31 - 1)")
    p = int(num_sms) if num_sms is not None else GPU_SMS.get(str(gpu).upper(), 132)
    if isinstance(calibration, Calibration):
        cal = calibration
    else:
        table = calibration if calibration is not None else load_calibration()
        cal = table.lookup(path, int(head_dim), gpu)
    if config is None:
        config = TileConfig(block_m=cal.block_m, block_n=cal.block_n, merge_short=cal.merge_short)
    cfg = dataclasses.replace(config, causal=bool(causal))
    a, b, c = cal.scaled_to(cfg)

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    items = build_work_list_numba(cu, cfg)
    walk = walked_tiles(items, cu, cfg)  # time unit: the tiles the kernels walk (queue order: the list's)
    mt0 = c > 0 and fp8_masked_tile0(cap, lens.size, cal.masked_tile0_max_mean)
    d = float(cal.d_us_per_doc)
    walk = cost_tiles(items, cu, cfg, a, c, mt0, d)
    if items.shape[0] * h > max_intervals:  # no intervals wanted: item-level fast path, same numbers
        scheds = {pol: _simulate_items(walk, h, p, a, b, pol) for pol in POLICIES}
    else:
        unit_costs = np.repeat(walk.astype(np.float64), h)
        scheds = {pol: simulate_schedule(unit_costs, p, a, b, pol, max_intervals=max_intervals) for pol in POLICIES}
    chosen, reason = choose_policy(lens, bool(causal), policy)
    flops = attention_flops(lens, h, int(head_dim), bool(causal), mode=pass_)
    pred_ms = scheds[chosen].makespan_us / 1e3
    padded_tokens = int(lens.size) * int(lens.max())
    return Prediction(
        docs=int(lens.size),
        tokens=tokens,
        capacity=cap,
        max_len=int(lens.max()),
        mean_len=float(lens.mean()),
        pairs=visible_pairs(lens, bool(causal)),
        flops=flops,
        items=int(items.shape[0]),
        tiles=int(items[:, 3].astype(np.int64).sum()),
        units=int(items.shape[0]) * h,
        policy=chosen,
        reason=reason,
        static_ms=scheds["static"].makespan_us / 1e3,
        dynamic_ms=scheds["dynamic"].makespan_us / 1e3,
        predicted_ms=pred_ms,
        predicted_tflops=flops / (pred_ms * 1e-3) / 1e12 if pred_ms > 0 else 0.0,
        memory_packed_bytes=memory_bytes(cap, h, hk, int(head_dim), pass_),
        memory_padded_bytes=memory_bytes(padded_tokens, h, hk, int(head_dim), pass_),
        num_heads=h,
        num_kv_heads=hk,
        head_dim=int(head_dim),
        causal=bool(causal),
        precision=precision,
        pass_=pass_,
        gpu=str(gpu),
        num_sms=p,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        merge_short=cfg.merge_short,
        kernel_path=path,
        a_us_per_tile=a,
        b_us_per_item=b,
        calibration_version=cal.version,
        calibration_source=cal.source,
        calibration_measured=cal.measured,
        schedules=scheds,
        c_us_per_masked_tile=c,
        masked_tile0=mt0,
        d_us_per_doc=d,
    )


def nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin ||A x - y||^2`` over ``x >= 0`` for an ``A`` of a few columns (k = 2 to 4 here).

    Exact: the optimum is the unconstrained least-squares solution on some subset of the columns (the
    others at 0), so the best non-negative one over all 2^k - 1 subsets (and x = 0) is it. Used by
    :func:`fit_calibration` and the service's refit, so both fit the same way.

    Returns:
        ``np.ndarray`` float64 of shape ``(k,)``.
    """
    k = A.shape[1]
    best, best_r = np.zeros(k), float((y ** 2).sum())
    for mask in range((1 << k) - 1, 0, -1):  # the full set first: it wins ties
        cols = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if sol.min() < 0:
            continue
        v = np.zeros(k)
        v[cols] = sol
        r = float(((A @ v - y) ** 2).sum())
        if r < best_r:
            best, best_r = v, r
    return best


def fit_calibration(samples, *, num_sms: int = 132, config: TileConfig = TileConfig(),
                    masked_tile0_max_mean: int | None = None, doc_term: bool = False) -> tuple[float, ...]:
    """Fit (a, b), with ``masked_tile0_max_mean`` (a, b, c), and with ``doc_term`` a last coefficient d (us
    per document and head), to measured call times.

    Each sample is ``(seqlens, num_heads, measured_us)`` (causal/tiles per ``config``). Uses the
    balanced-load approximation ``t ~= (a * tiles * H + b * items * H [+ c * masked * H]) / P`` (good
    when there are many more units than SMs) and minimises the squared RELATIVE error with a, b, c >= 0.
    ``masked_tile0_max_mean`` (an int >= 0): count the FP8 forward's masked tiles
    (:func:`~flamia_pack.scheduler.cost.fp8_fwd_masked_tiles`, tile 0 masked on rows whose mean
    document length is at most it) as a third term.

    Returns:
        ``(a_us_per_tile, b_us_per_item)``, or ``(a, b, c_us_per_masked_tile)``, each followed by
        ``d_us_per_doc`` with ``doc_term``.

    Raises:
        FlamiaError: fewer than one sample.
    """
    rows, rhs = [], []
    for lens, h, t_us in samples:
        lens = lengths_from(lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        it = build_work_list_numba(cu, config)
        tiles = float(walked_tiles(it, cu, config).sum()) * h / num_sms
        units = float(it.shape[0]) * h / num_sms
        row = [tiles / t_us, units / t_us]
        if masked_tile0_max_mean is not None:
            mt0 = fp8_masked_tile0(int(lens.sum()), lens.size, int(masked_tile0_max_mean))
            masked = float(fp8_fwd_masked_tiles(it, cu, config, masked_tile0=mt0).sum()) * h / num_sms
            row.append(masked / t_us)
        if doc_term:
            row.append(float(document_first_items(it, cu).sum()) * h / num_sms / t_us)
        rows.append(row)
        rhs.append(1.0)
    if not rows:
        raise FlamiaError("fit_calibration needs at least one sample")
    return tuple(float(x) for x in nnls(np.asarray(rows), np.asarray(rhs)))
