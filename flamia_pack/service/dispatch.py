"""Dispatch a real training call (forward + backward) of the attention op and time it.

No FastAPI / pydantic imports: the GPU machine has neither, and a plain script can call
:class:`GpuDispatcher` (or ``python -m flamia_pack.service.dispatch W1 W2 ...``) directly. The
service takes its dispatcher from a FastAPI dependency (``flamia_pack.service.deps.get_dispatcher``)
so CPU tests substitute a fake through ``app.dependency_overrides``.

What is timed (DESIGN.md §8): one training call ``o = varlen_attention(q, k, v, cu_seqlens,
max_seqlen, causal=..., precision=...); o.backward(do)`` on random N(0, 1) BF16 inputs
(``q, do: (T, H_q, D)``, ``k, v: (T, H_kv, D)``), fresh inputs drawn before every timed call (not
timed), ``warmup`` untimed calls first, then the median of ``repeats`` calls measured with CUDA
events, with the host ahead of the GPU (a ~20 ms GPU spin is queued before the start event, so
the whole call is enqueued before the GPU reaches it, as in a training step where attention sits
behind earlier layers); the same call timed from an idle GPU (host launch latency exposed) is
reported beside it as ``isolated_ms``. As in a training loop, the work list is built once before
the timed calls (the loader's ``to_device`` does this per batch) and passed to every call, so the
timing holds the kernels, not the host-side validation and list build. The documents are laid out as the packed segments in row order (``cu_seqlens`` of the
flat token stream of all rows, padding left out), the same layout the scheduler's prediction uses.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flamia_pack.errors import FlamiaError

__all__ = ["Dispatcher", "GpuDispatcher", "Measurement", "RunSpec", "GpuUnavailable"]


class GpuUnavailable(RuntimeError):
    """No usable CUDA device (the service answers 503)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One training call to time."""

    seqlens: np.ndarray
    """int64 ``(n_segs,)``: segment lengths in packed order (all >= 1); T = their sum."""
    num_heads: int
    """Query heads H_q."""
    num_kv_heads: int
    """Key/value heads H_kv (divides H_q)."""
    head_dim: int
    """D, 64 or 128."""
    causal: bool = True
    precision: str = "bf16"
    """``"bf16"`` or ``"fp8"`` (kernel path)."""
    warmup: int = 3
    """Untimed calls before timing."""
    repeats: int = 10
    """Timed calls; the median is reported."""
    seed: int = 0
    """Seed of the random inputs (torch.Generator on the device)."""

    def __post_init__(self) -> None:
        s = np.asarray(self.seqlens)
        if s.ndim != 1 or s.size == 0 or s.dtype.kind not in "iu" or int(s.min()) < 1:
            raise FlamiaError("RunSpec.seqlens must be a non-empty 1-D integer array of lengths >= 1")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise FlamiaError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in (64, 128):
            raise FlamiaError(f"head_dim must be 64 or 128, got {self.head_dim}")
        if self.precision not in ("bf16", "fp8"):
            raise FlamiaError(f"precision must be 'bf16' or 'fp8', got {self.precision!r}")
        if self.warmup < 0 or self.repeats < 1:
            raise FlamiaError(f"need warmup >= 0 and repeats >= 1, got {self.warmup}, {self.repeats}")

    @property
    def total_tokens(self) -> int:
        """T, tokens of the flat packed stream."""
        return int(np.asarray(self.seqlens).sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """Timing of one :class:`RunSpec`."""

    measured_ms: float
    """Median wall time of one training call (ms, CUDA events)."""
    times_ms: tuple[float, ...] = field(default=())
    """Every timed call (ms), in order."""
    device_name: str = ""
    """``torch.cuda.get_device_name()`` or a fake's name."""
    peak_bytes: int = 0
    """Peak allocated device memory during the timed calls (bytes)."""
    isolated_ms: float | None = None
    """Median of the same call timed from an idle GPU (host launch latency exposed), for comparison."""


class Dispatcher(Protocol):
    """What the service needs from a dispatcher."""

    def availability(self) -> tuple[bool, str]:
        """``(available, detail)``: can :meth:`run` be called, and a one-line description."""

    def run(self, spec: RunSpec) -> Measurement:
        """Time one training call. Raises :class:`GpuUnavailable` without a device."""


class GpuDispatcher:
    """Runs :func:`flamia_pack.kernels.attention.varlen_attention` on the local CUDA device.

    Torch and the kernels are imported lazily, on the first :meth:`availability` / :meth:`run`.
    """

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self._checked: tuple[bool, str] | None = None

    def availability(self) -> tuple[bool, str]:
        """See :class:`Dispatcher`. Cached after the first call (the lifespan calls it once)."""
        if self._checked is None:
            try:
                import torch

                if not torch.cuda.is_available():
                    self._checked = (False, "no CUDA device (torch.cuda.is_available() is False)")
                else:
                    name = torch.cuda.get_device_name(torch.device(self.device))
                    try:
                        from flamia_pack.kernels.attention import varlen_attention  # noqa: F401
                    except ImportError as exc:
                        self._checked = (False, f"{name}: attention op not importable ({exc})")
                    else:
                        self._checked = (True, name)
            except Exception as exc:  # a broken driver must not take the service down
                self._checked = (False, f"CUDA check failed: {type(exc).__name__}: {exc}")
        return self._checked

    def run(self, spec: RunSpec) -> Measurement:
        """Time ``spec`` (see the module docstring). Returns a :class:`Measurement`.

        Raises:
            GpuUnavailable: no CUDA device or no attention op.
            FlamiaError: invalid spec (from the op's own validation).
        """
        ok, detail = self.availability()
        if not ok:
            raise GpuUnavailable(detail)
        import torch

        from flamia_pack.kernels.attention import varlen_attention

        dev = torch.device(self.device)
        seqlens = np.asarray(spec.seqlens, dtype=np.int64)
        cu = np.zeros(seqlens.size + 1, dtype=np.int32)
        np.cumsum(seqlens, out=cu[1:])
        cu_t = torch.from_numpy(cu).to(dev)
        max_seqlen = int(seqlens.max())
        T = int(cu[-1])
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        gen = torch.Generator(device=dev)
        gen.manual_seed(int(spec.seed))

        def fresh():
            q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            v = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            do = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
            return q, k, v, do

        # As in training (loaders.collate.to_device): the work list is built once per batch, right
        # after the copy, and the call gets it, so no host sync or list build sits inside the timing.
        work_list = None
        if spec.precision == "bf16":
            from flamia_pack.kernels.attention import build_attention_work_list

            work_list = build_attention_work_list(cu_t, T, causal=spec.causal, head_dim=d, max_seqlen=max_seqlen,
                                                  num_kv_groups=hq // hkv)

        def call(q, k, v, do):
            o = varlen_attention(q, k, v, cu_t, max_seqlen, causal=spec.causal, precision=spec.precision,
                                 work_list=work_list)
            o.backward(do)

        for _ in range(spec.warmup):
            call(*fresh())
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        def timed(host_ahead: bool) -> float:
            args = fresh()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            if host_ahead:
                # Keep the GPU busy (~20 ms spin) so the host enqueues the whole call before the
                # GPU reaches it, as in a training step where attention is queued behind earlier
                # layers: the events then time the call's GPU work, not host launch latency.
                torch.cuda._sleep(40_000_000)
            start.record()
            call(*args)
            end.record()
            end.synchronize()
            del args
            return float(start.elapsed_time(end))

        times = [timed(True) for _ in range(spec.repeats)]
        isolated = [timed(False) for _ in range(spec.repeats)]
        return Measurement(
            measured_ms=float(statistics.median(times)),
            times_ms=tuple(times),
            device_name=detail,
            peak_bytes=int(torch.cuda.max_memory_allocated(dev)),
            isolated_ms=float(statistics.median(isolated)),
        )


def main(argv: list[str] | None = None) -> int:
    """GPU script: predict and time WORKLOADS.md mixes without the web stack.

    ``python -m flamia_pack.service.dispatch [W1,W2,...] [--repeats N] [--warmup N] [--json PATH]
    [--refit]`` prints, per workload, the predicted ms (static, dynamic, chosen policy) from the
    same code as ``POST /v1/runs`` and the measured median of one training call (forward +
    backward), with the error in percent; ``--json`` writes every run (with its segment lengths) to
    a file; ``--refit`` also fits (a, b) to these runs (:func:`flamia_pack.service.calibration.refit`)
    and prints the refitted table and the in-sample errors.
    """
    import argparse
    import json

    from flamia_pack.scheduler.simulate import load_calibration
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths
    from flamia_pack.service.engine import MixParams, critical_load, predict_mix

    ap = argparse.ArgumentParser(prog="python -m flamia_pack.service.dispatch", description=main.__doc__)
    ap.add_argument("workloads", nargs="?", default="W1,W2,W3,W4,W5,W6,W7,W8,W9")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: the shipped one)")
    ap.add_argument("--json", default=None, help="write the runs here (JSON list)")
    ap.add_argument("--refit", action="store_true", help="refit (a, b) to these runs and print the table")
    args = ap.parse_args(argv)

    table = load_calibration(args.calibration)
    disp = GpuDispatcher()
    ok, detail = disp.availability()
    if not ok:
        print(f"no GPU: {detail}")
        return 2
    print(f"device: {detail}; calibration {table.version}; {args.warmup} warm-up + median of {args.repeats}")
    print("| wl | docs | T | items | policy | static ms | dynamic ms | predicted ms | measured ms | error % | "
          "isolated ms | error vs isolated % | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = []
    for name in [w.strip().upper() for w in args.workloads.split(",") if w.strip()]:
        w = WORKLOADS[name]
        lengths = workload_lengths(name)
        params = MixParams(num_heads=w["num_heads"], num_kv_heads=w["num_kv_heads"], head_dim=128, causal=True,
                           precision=args.precision, capacity=max(65_536, int(lengths.sum())))
        mp = predict_mix(lengths, params, calibration=table, max_intervals=2**62)
        p = mp.prediction
        spec = RunSpec(seqlens=mp.seqlens, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                       causal=p.causal, precision=p.precision, warmup=args.warmup, repeats=args.repeats)
        try:
            m = disp.run(spec)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next workload
            print(f"| {name} | run failed: {type(exc).__name__}: {exc} |")
            continue
        err = 100.0 * (p.predicted_ms - m.measured_ms) / m.measured_ms
        iso = m.isolated_ms if m.isolated_ms is not None else float("nan")
        err_iso = 100.0 * (p.predicted_ms - iso) / iso
        print(f"| {name} | {mp.lengths.size} | {p.tokens} | {p.items} | {p.policy} | {p.static_ms:.3f} | "
              f"{p.dynamic_ms:.3f} | {p.predicted_ms:.3f} | {m.measured_ms:.3f} | {err:+.1f} | {iso:.3f} | "
              f"{err_iso:+.1f} | {m.peak_bytes / 1e9:.2f} |", flush=True)
        tiles, units = critical_load(mp.seqlens, p)
        runs.append({"workload": name, "gpu": "H200", "device_name": m.device_name, "precision": p.precision,
                     "head_dim": p.head_dim, "causal": p.causal, "num_heads": p.num_heads,
                     "num_kv_heads": p.num_kv_heads, "predicted_ms": p.predicted_ms, "static_ms": p.static_ms,
                     "dynamic_ms": p.dynamic_ms, "measured_ms": m.measured_ms, "times_ms": list(m.times_ms),
                     "error_pct": err, "isolated_ms": m.isolated_ms, "crit_tiles": tiles, "crit_units": units, "peak_bytes": m.peak_bytes,
                     "calibration_version": p.calibration_version, "seqlens": mp.seqlens.tolist()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    if args.refit and runs:
        from flamia_pack.service.calibration import FitRun, refit, table_to_json

        fits_in = [FitRun(gpu=r["gpu"], precision=r["precision"], head_dim=r["head_dim"], causal=r["causal"],
                          num_heads=r["num_heads"], num_kv_heads=r["num_kv_heads"],
                          seqlens=np.asarray(r["seqlens"], dtype=np.int64), measured_ms=r["measured_ms"])
                   for r in runs]
        new, fits = refit(fits_in, table, version=f"{table.version}+refit-gpu")
        for f_ in fits:
            print(f"refit {f_.kernel_path} D{f_.head_dim} {f_.gpu}: a={f_.a_us_per_tile:.4f} us/tile, "
                  f"b={f_.b_us_per_item:.4f} us/unit, {f_.runs} runs, in-sample RMS error {f_.rms_error_pct:.1f} %")
        print(json.dumps(table_to_json(new), indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
