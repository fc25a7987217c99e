"""Where a benchmark's forward time goes besides the kernel: L2 flush, host gap, warm or cold L2 (GPU).

    PYTHONPATH=. python3 benchmarks/probes/flush_probe.py --workloads W3,W7 [--config NAME]

``bench_attention.py`` times each call with ``triton.testing.do_bench``: before every call a 256 MB
``zero_()`` flushes L2, then a CUDA event, the call, an event. That time can hold more than the
kernels: the GPU idles between the start event and the first kernel while the host is still in the
call (host-bound), and the flush leaves L2 full of dirty lines and the TLBs cold. For our eager forward
and padded SDPA (cuDNN) on each row, this prints the median milliseconds of

- ``do_bench``: as the benchmark measures (flush by ``zero_``, events around the call);
- ``zero+sleep``: the same flush, then a ~1 ms ``torch.cuda._sleep`` so the host has enqueued the call
  before the start event fires (no host gap inside the timing);
- ``read+sleep``: the flush by reading 256 MB (``sum``: L2 holds clean lines), then the sleep;
- ``warm+sleep``: no flush (the call's own tensors may still be in L2), the sleep,

and the ratio SDPA / ours of each column (> 1: ours faster). A column that moves ours but not SDPA
names the cost the bench adds to our call. Used for RESULTS.md "Session of 2026-11-30 (sixth)".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_attention
import bench_attention as B  # noqa: E402

from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths  # noqa: E402


def _loop_ms(fn, flush, sleep_cycles: int, reps: int) -> float:
    """Median ms between CUDA events around ``fn()``, each run after ``flush()`` (or none) and a
    ``torch.cuda._sleep(sleep_cycles)`` (0: none)."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W3,W7")
    ap.add_argument("--config", default=None, help="a kernels.config NAMED_CONFIGS name (default: the automatic one)")
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("flush_probe: needs a CUDA GPU (nothing measured)")
        return 0
    import triton

    from flamia_pack.kernels.config import candidate_config

    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # do_bench's flush buffer
    sink = torch.empty((), dtype=torch.int64, device="cuda")

    def zero_flush():
        cache.zero_()

    def read_flush():
        torch.sum(cache, dim=0, out=sink)

    cyc = 2_000_000  # ~1 ms of torch.cuda._sleep at the H200's 1,980 MHz: longer than our host path
    cfg = None if a.config is None else candidate_config(a.config, head_dim=B.HEAD_DIM)
    cols = ("do_bench", "zero+sleep", "read+sleep", "warm+sleep")
    print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"config {a.config or 'automatic'}; medians of {a.reps}")
    print("| row | impl | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name in a.workloads.split(","):
        spec = WORKLOADS[name]
        inp = B.make_inputs(workload_lengths(name), spec["num_heads"], spec["num_kv_heads"], seed=3)
        res = {}
        for impl, call in (("ours", B.ours_call(inp, config=cfg)), ("sdpa", B.sdpa_padded_call(inp))):
            if call is None:
                continue

            def fn(call=call):
                with torch.no_grad():
                    return call(inp["q"], inp["k"], inp["v"])

            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            r = {"do_bench": B.time_ms(fn, rep=max(20, a.reps // 2)),
                 "zero+sleep": _loop_ms(fn, zero_flush, cyc, a.reps),
                 "read+sleep": _loop_ms(fn, read_flush, cyc, a.reps),
                 "warm+sleep": _loop_ms(fn, None, cyc, a.reps)}
            res[impl] = r
            print(f"| {name} | {impl} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |", flush=True)
        if len(res) == 2:
            print(f"| {name} | sdpa / ours | " + " | ".join(f"{res['sdpa'][c] / res['ours'][c]:.3f}x" for c in cols)
                  + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
