"""The kernels of one eager forward call, ours vs padded SDPA, under ``torch.profiler`` (GPU).

    PYTHONPATH=. python3 benchmarks/probes/fwd_kernel_profile.py --workload W7 --calls 20

For each implementation: ``--calls`` eager forward calls (no L2 flush between them) after a warm-up,
then ``torch.profiler``'s table of CUDA kernels by self time, and a last line with the per-call GPU
time of every kernel together and the ratio SDPA / ours (> 1: ours faster). Used for RESULTS.md
2026-11-30 (fifth) run 4: W7 ours 296.3 us (``_fwd_kernel``) + 0.8 us (the counter's zero fill) vs
cuDNN 257.9 + 0.8 us. Tells the kernels' share of a bench ratio from what ``do_bench`` adds around
them (its per-call L2 flush and events), and which extra launches a call makes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_attention
import bench_attention as B  # noqa: E402

from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="W7")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from torch.profiler import ProfilerActivity, profile

    spec = WORKLOADS[a.workload]
    inp = B.make_inputs(workload_lengths(a.workload), spec["num_heads"], spec["num_kv_heads"], seed=3)
    per_call = {}
    for name, fn in (("ours", B.ours_call(inp)), ("sdpa", B.sdpa_padded_call(inp))):
        if fn is None:
            print(f"== {name}: n/a (documents of unequal length)")
            continue
        with torch.no_grad():
            for _ in range(5):
                fn(inp["q"], inp["k"], inp["v"])
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(a.calls):
                    fn(inp["q"], inp["k"], inp["v"])
                torch.cuda.synchronize()
        events = p.key_averages()
        per_call[name] = sum(e.self_device_time_total for e in events) / a.calls
        print(f"== {name} ({a.workload}, {a.calls} calls)")
        print(events.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
    if len(per_call) == 2:
        print(f"GPU time per call: ours {per_call['ours']:.1f} us, sdpa {per_call['sdpa']:.1f} us, "
              f"sdpa / ours = {per_call['sdpa'] / per_call['ours']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
