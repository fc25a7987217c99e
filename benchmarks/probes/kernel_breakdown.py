"""Where one training call's (or forward's) GPU time goes, kernel by kernel, for benchmark rows.

Run on the GPU machine (one process, ~10 s per row):
    ROWS=W2,W3 PYTHONPATH=. python3 benchmarks/probes/kernel_breakdown.py [--mode train|fwd] [--calls 5]

For each row of ``../shared/WORKLOADS.md`` (``flamia_pack.scheduler.workloads``) it builds the row's
inputs and work list as ``bench_attention.py`` does, runs three warm-up calls, then profiles
``--calls`` calls with ``torch.profiler`` (CUPTI kernel records) and prints one table per row: each
kernel's device time per call (us), launches per call and share of the call's summed kernel time.
Kernels of one launch overlap nothing, but kernels on one stream do not overlap each other either,
so the shares add up to the call's GPU busy time (host gaps are not shown: compare the total with
``bench_attention.py``'s wall time for the call). ``FLAMIA_ATTN_CONFIG=<candidate>`` picks a
:data:`flamia_pack.kernels.config.NAMED_CONFIGS` entry as everywhere else.

Why (benchmarks/NOTES.md, "Session of 2026-11-29 (late)"): W2's and W3's training calls are 1.06x the
best packed peer where 1.1x is wanted; before building more, see which launch (Gluon dK/dV, the Triton
launch of short documents, dQ programs, preprocess, the dQ cast) takes the time.

``--cpu-smoke`` runs a tiny row on the CPU (reference path, CPU activity) so the table code is
exercised without a GPU; it measures nothing about the kernels.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch


def kernel_table(events, calls: int, device: bool = True) -> list[tuple[str, float, float, float]]:
    """Aggregate profiler events into ``(name, us per call, launches per call, share)`` rows, largest first.

    Args:
        events: ``torch.profiler.profile(...).events()`` (FunctionEvent list).
        calls: how many calls the profile covered (>= 1).
        device: True: CUDA kernel records (device time); False: top-level CPU ops (CPU self time,
            the ``--cpu-smoke`` path).

    Raises:
        ValueError: ``calls < 1``.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    tot: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)
    for e in events:
        is_dev = e.device_type == torch.autograd.DeviceType.CUDA
        if device != is_dev:
            continue
        us = e.device_time if device else e.self_cpu_time_total
        tot[e.name] += float(us)
        cnt[e.name] += 1
    total = sum(tot.values()) or 1.0
    rows = [(n, t / calls, cnt[n] / calls, t / total) for n, t in tot.items()]
    return sorted(rows, key=lambda r: -r[1])


def _print(name: str, mode: str, rows, top: int, what: str = "kernel time") -> None:
    total = sum(r[1] for r in rows)
    print(f"\n### {name} {mode}: {total:.1f} us of {what} per call")
    print("| kernel | us / call | launches / call | share |")
    print("|---|---|---|---|")
    for n, us, k, share in rows[:top]:
        short = n if len(n) <= 90 else n[:87] + "..."
        print(f"| `{short}` | {us:.1f} | {k:g} | {share * 100:.1f}% |")
    if len(rows) > top:
        rest = sum(r[1] for r in rows[top:])
        print(f"| ({len(rows) - top} more) | {rest:.1f} | | {rest / (total or 1) * 100:.1f}% |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("train", "fwd"), default="train")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error("--calls must be >= 1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_attention
    import bench_attention as B
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    acts = [torch.profiler.ProfilerActivity.CPU]
    if a.cpu_smoke:
        rows = {"smoke": ([60, 4, 100], 2, 1)}
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            print("kernel_breakdown: needs a CUDA GPU (nothing measured); --cpu-smoke exercises the code")
            return 0
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        names = os.environ.get("ROWS", "W2,W3").split(",")
        rows = {n: (workload_lengths(n), WORKLOADS[n]["num_heads"], WORKLOADS[n]["num_kv_heads"]) for n in names}
        device = "cuda"
        print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__}; FLAMIA_ATTN_CONFIG="
              f"{os.environ.get('FLAMIA_ATTN_CONFIG', '') or '(default)'}")
    for name, (lengths, h, hkv) in rows.items():
        inp = B.make_inputs(lengths, h, hkv, seed=3, device=device,
                            head_dim=64 if a.cpu_smoke else B.HEAD_DIM)
        if a.cpu_smoke:
            from flamia_pack.kernels import varlen_attention

            def call(q, k, v, inp=inp):
                return varlen_attention(q, k, v, inp["cu"], inp["max_seqlen"], causal=True)

            fwd, train, leaves = B._fwd_bwd_fns(call, inp)
        else:
            fwd, train, leaves = B.ours(inp)

        def fresh_train(train=train, leaves=leaves):
            for x in leaves:  # as do_bench(grad_to_none=...) in bench_attention: no gradient accumulation
                x.grad = None
            train()

        fn = fresh_train if a.mode == "train" else fwd
        for _ in range(3):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(a.calls):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
        _print(name, a.mode, kernel_table(prof.events(), a.calls, device=device == "cuda"), a.top,
               "kernel time" if device == "cuda" else "CPU op self time (smoke run, not kernels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
