"""Work-list build time (issue 4) and simulated static vs dynamic makespan on WORKLOADS.md rows.

Run on the GPU machine:  PYTHONPATH=. python3 benchmarks/bench_worklist.py [--quick]

1. S1 (131,072 one-token documents, T = 131,072): GPU build time of ``build_work_list`` for the
   torch and the Triton backend, ``merge_short`` off and on, eager (validate=False, no host sync)
   and under CUDA-graph replay; the host reference (plain Python) and the numba builder on the
   same row; ratios. Every GPU result is first checked equal to the numba builder.
2. W1-W9, S2: GPU build time (eager, best backend) and the simulated static vs dynamic makespan
   of one bf16 training call (fwd+bwd) with the shipped calibration.

Timing: CUDA events around each call (the GPU is idle before each call, so an event pair measures
max(host launch time, device time): the latency a caller sees), median of ``--reps`` calls after
warm-up. Host builders: perf_counter, median of several runs. Writes JSON to $OUT (if set).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch

from flamia_pack.scheduler import (
    TileConfig,
    WorkList,
    WorkListBuilder,
    build_work_list,
    build_work_list_host,
    build_work_list_numba,
    max_work_items,
    predict,
    workload_lengths,
)


def _events_median(fn, reps: int, warmup: int = 20) -> float:
    """Median milliseconds of fn() between two CUDA events, GPU idle before each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _host_median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _make_out(cu: torch.Tensor, t: int, cfg: TileConfig) -> WorkList:
    m = max_work_items(t, cu.numel() - 1, cfg)
    return WorkList(items=torch.empty((m, 4), dtype=torch.int32, device=cu.device),
                    num_items=torch.empty(1, dtype=torch.int32, device=cu.device), max_items=m, config=cfg)


def time_gpu_build(cu_host: np.ndarray, cfg: TileConfig, backend: str, reps: int, device: str = "cuda") -> dict:
    t = int(cu_host[-1])
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    ref = build_work_list_numba(cu_host, cfg)
    out = _make_out(cu, t, cfg)
    out.items.fill_(-7)
    build_work_list(cu, t, cfg, validate=False, out=out, backend=backend)
    ok = bool(np.array_equal(out.to_numpy(), ref))
    if device == "cpu":  # --cpu-dry-run: checks the script's logic, numbers mean nothing
        ms = _host_median(lambda: build_work_list(cu, t, cfg, validate=False, out=out, backend=backend), 3)
        return {"backend": backend, "merge_short": cfg.merge_short, "items": int(ref.shape[0]), "max_items": out.max_items,
                "correct": ok, "correct_graph": True, "eager_ms": ms, "validated_ms": ms, "graph_ms": ms}
    eager = _events_median(lambda: build_work_list(cu, t, cfg, validate=False, out=out, backend=backend), reps)
    validated = _events_median(lambda: build_work_list(cu, t, cfg, validate=True, out=out, backend=backend), max(reps // 4, 10), 3)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        build_work_list(cu, t, cfg, validate=False, out=out, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        build_work_list(cu, t, cfg, validate=False, out=out, backend=backend)
    out.items.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    ok_graph = bool(np.array_equal(out.to_numpy(), ref))
    graph = _events_median(g.replay, reps)
    return {"backend": backend, "merge_short": cfg.merge_short, "items": int(ref.shape[0]), "max_items": out.max_items,
            "correct": ok, "correct_graph": ok_graph, "eager_ms": eager, "validated_ms": validated, "graph_ms": graph}


def time_builder(cu_host: np.ndarray, cfg: TileConfig, max_docs: int, total_tokens: int, reps: int, device: str) -> dict:
    """WorkListBuilder: an eager call = gather of cu_seqlens into its buffer + one graph replay."""
    builder = WorkListBuilder(max_docs, total_tokens, cfg, device=device)
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    ref = build_work_list_numba(cu_host, cfg)
    builder(cu)
    builder.work_list.items.fill_(-7)
    ok = bool(np.array_equal(builder(cu).to_numpy(), ref))
    if device == "cpu":
        ms = _host_median(lambda: builder(cu), 3)
    else:
        ms = _events_median(lambda: builder(cu), reps)
    return {"correct": ok, "builder_ms": ms, "max_docs": max_docs}


def launch_floor(reps: int) -> dict:
    """Latency of one tiny kernel (eager and graph): the floor any builder sits on."""
    x = torch.zeros(1024, device="cuda")
    eager = _events_median(lambda: x.add_(1), reps)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    return {"one_kernel_eager_ms": eager, "one_kernel_graph_ms": _events_median(g.replay, reps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the script's logic on CPU (no timing value)")
    args = ap.parse_args()
    reps = 30 if args.quick else args.reps
    dev = "cpu" if args.cpu_dry_run else "cuda"
    assert dev == "cpu" or torch.cuda.is_available(), "needs a CUDA GPU (or --cpu-dry-run)"
    try:
        import triton

        backends = ["torch", "triton"] if dev == "cuda" else ["torch"]
        triton_version = triton.__version__
    except ImportError:
        backends, triton_version = ["torch"], None
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
    except Exception:  # the device machine's copy has no git history
        commit = os.environ.get("FLAMIA_COMMIT", "unknown")
    meta = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "commit": commit, "date": time.strftime("%Y-%m-%d")}
    print(meta)
    res: dict = {"meta": meta, "floor": launch_floor(reps) if dev == "cuda" else {}}
    print("launch floor:", res["floor"])

    # ---- S1
    t = 131072
    cu_s1 = np.arange(t + 1, dtype=np.int64)
    s1 = []
    for merge in (False, True):
        cfg = TileConfig(merge_short=merge)
        host_ms = _host_median(lambda: build_work_list_host(cu_s1, cfg), 3)
        build_work_list_numba(cu_s1, cfg)
        numba_ms = _host_median(lambda: build_work_list_numba(cu_s1, cfg), 20)
        for be in backends:
            r = time_gpu_build(cu_s1, cfg, be, reps, dev)
            if be == backends[-1]:  # the default backend on CUDA
                tb = time_builder(cu_s1, cfg, t, t, reps, dev)
                r["correct"] = r["correct"] and tb["correct"]
                r["builder_ms"] = tb["builder_ms"]
            else:
                r["builder_ms"] = float("nan")
            r.update(host_ms=host_ms, numba_ms=numba_ms, x_host_eager=host_ms / r["eager_ms"],
                     x_host_graph=host_ms / r["graph_ms"], x_numba_eager=numba_ms / r["eager_ms"])
            s1.append(r)
    res["S1"] = s1
    print("\nS1: 131,072 one-token documents (T = 131,072), BLOCK 128x128, causal; ms (median)")
    print("(eager: build_work_list(validate=False); graph: replay of a captured build; builder: WorkListBuilder "
          "call = gather + replay; valid.: validate=True, one host sync)")
    print(f"{'backend':8} {'merge':6} {'items':>7} {'ok':>3} {'eager':>8} {'graph':>8} {'builder':>8} {'valid.':>8} "
          f"{'host ref':>9} {'numba':>8} {'x host':>8} {'x host g':>9} {'x host b':>9} {'x numba':>8}")
    for r in s1:
        print(f"{r['backend']:8} {str(r['merge_short']):6} {r['items']:7d} {'y' if r['correct'] and r['correct_graph'] else 'N':>3} "
              f"{r['eager_ms']:8.4f} {r['graph_ms']:8.4f} {r['builder_ms']:8.4f} {r['validated_ms']:8.3f} {r['host_ms']:9.2f} "
              f"{r['numba_ms']:8.3f} {r['x_host_eager']:8.0f} {r['x_host_graph']:9.0f} {r['host_ms'] / r['builder_ms']:9.0f} "
              f"{r['x_numba_eager']:8.1f}")

    # ---- W1-W9, S2
    rows = []
    for name in ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "S2"):
        lens = workload_lengths(name)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        cfg = TileConfig()
        b = {be: time_gpu_build(cu, cfg, be, max(reps // 2, 20), dev) for be in backends}
        tb = time_builder(cu, cfg, int(cu[-1]) // 16, int(cu[-1]), max(reps // 2, 20), dev)
        b[backends[-1]]["correct"] &= tb["correct"]
        b[backends[-1]]["builder_ms"] = tb["builder_ms"]
        hk = 4 if name == "W5" else 16
        p = predict(lens, num_heads=16, num_kv_heads=hk, pass_="fwd_bwd", max_intervals=0)
        pf = predict(lens, num_heads=16, num_kv_heads=hk, pass_="fwd", max_intervals=0)
        rows.append({"workload": name, "docs": len(lens), "items": p.items, "tiles": p.tiles,
                     "build": b, "fwd_bwd": {"static_ms": p.static_ms, "dynamic_ms": p.dynamic_ms, "policy": p.policy},
                     "fwd": {"static_ms": pf.static_ms, "dynamic_ms": pf.dynamic_ms}})
    res["workloads"] = rows
    print("\nW1-W9, S2: build (eager / graph ms per backend) and simulated makespan (bf16, calibration "
          f"{p.calibration_version}, {p.num_sms} SMs)")
    hdr = " ".join(f"{be + ' eager':>12} {be + ' graph':>12}" for be in backends) + f" {'builder':>8}"
    print(f"{'wl':4} {'docs':>5} {'items':>6} {'tiles':>6} {hdr} {'ok':>3} {'fwd st':>8} {'fwd dyn':>8} {'f+b st':>8} {'f+b dyn':>8} {'st/dyn':>6}")
    for r in rows:
        ok = all(v["correct"] and v["correct_graph"] for v in r["build"].values())
        cols = " ".join(f"{r['build'][be]['eager_ms']:12.4f} {r['build'][be]['graph_ms']:12.4f}" for be in backends)
        cols += f" {r['build'][backends[-1]]['builder_ms']:8.4f}"
        fb = r["fwd_bwd"]
        print(f"{r['workload']:4} {r['docs']:5d} {r['items']:6d} {r['tiles']:6d} {cols} {'y' if ok else 'N':>3} "
              f"{r['fwd']['static_ms']:8.3f} {r['fwd']['dynamic_ms']:8.3f} {fb['static_ms']:8.3f} {fb['dynamic_ms']:8.3f} "
              f"{fb['static_ms'] / fb['dynamic_ms']:6.3f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_worklist.json"), "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in s1 if not (r["correct"] and r["correct_graph"])]
    bad += [r for w in rows for r in w["build"].values() if not (r["correct"] and r["correct_graph"])]
    if bad:
        raise SystemExit(f"MISMATCH vs reference in {len(bad)} case(s)")


if __name__ == "__main__":
    main()
