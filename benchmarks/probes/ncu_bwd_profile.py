"""Profile one training call of ours and of FlexAttention under Nsight Compute (H200).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --csv --page details \
        python3 benchmarks/probes/ncu_bwd_profile.py --workload W1

Runs each implementation's training call a few times unprofiled (compilation, autotuning,
caches), then once between ``cudaProfilerStart`` / ``cudaProfilerStop`` so ncu records only that
call's kernels. Prints nothing of its own but the kernel names seen by torch's profiler; compare
the two backward kernels' tensor-pipe utilisation, issue stalls, occupancy and L2 traffic
(benchmarks/NOTES.md).
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
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--impls", default="ours,flex", help="comma list of ours, flex, sdpa (padded; uniform rows)")
    a = ap.parse_args()
    spec = WORKLOADS[a.workload]
    inp = B.make_inputs(workload_lengths(a.workload), spec["num_heads"], spec["num_kv_heads"], seed=3)
    for name in a.impls.split(","):
        _, train, _ = {"ours": B.ours, "flex": B.flex, "sdpa": B.sdpa_padded}[name](inp)
        for _ in range(3):
            train()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        train()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
