"""A/B on the GPU: the attention call with the validated (trimmed) work list vs the static-bound one.

    PYTHONPATH=. python3 benchmarks/worklist_trim_ab.py [--workloads W7,W3,W1,S1] [--rep 60]

``build_attention_work_list(validate=True)`` trims the list to its valid rows; with
``validate=False`` it keeps ``max_work_items(T, n_docs)`` rows, and the kernels launch one program
per row and head that only loads ``num_items`` and exits. Times forward and training call of our
op with both lists on the same inputs, alternating (do_bench medians, ms), and prints the ratio
static / trimmed (> 1: trimming is faster). Outputs of the two are checked bitwise equal.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as B  # noqa: E402

from flamia_pack.kernels import varlen_attention  # noqa: E402
from flamia_pack.kernels.attention import build_attention_work_list  # noqa: E402
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W7,W3,W1,S1")
    ap.add_argument("--rep", type=int, default=60)
    a = ap.parse_args()
    print("| wl | rows static / trimmed | fwd static ms | fwd trimmed ms | x | train static ms | train trimmed ms | x |")
    print("|---|---|---|---|---|---|---|---|")
    for w in a.workloads.split(","):
        spec = WORKLOADS[w]
        inp = B.make_inputs(workload_lengths(w), spec["num_heads"], spec["num_kv_heads"], seed=5)
        lists = {"static": build_attention_work_list(inp["cu"], inp["T"], head_dim=B.HEAD_DIM, validate=False),
                 "trimmed": build_attention_work_list(inp["cu"], inp["T"], head_dim=B.HEAD_DIM)}
        fns, outs = {}, {}
        for name, wl in lists.items():
            def call(q, k, v, wl=wl):
                return varlen_attention(q, k, v, inp["cu"], inp["max_seqlen"], causal=True, work_list=wl)
            fns[name] = B._fwd_bwd_fns(call, inp)
            outs[name] = fns[name][0]()
        assert torch.equal(outs["static"], outs["trimmed"]), w
        res = {n: {"fwd": [], "train": []} for n in fns}
        for p in range(2):
            for name in (list(fns) if p == 0 else list(fns)[::-1]):
                f, t, leaves = fns[name]
                res[name]["fwd"].append(B.time_ms(f, rep=a.rep, warmup=20))
                res[name]["train"].append(B.time_ms(t, grad_to_none=leaves, rep=a.rep, warmup=20))
        m = {n: {k: sum(v) / len(v) for k, v in d.items()} for n, d in res.items()}
        print(f"| {w} | {lists['static'].max_items} / {lists['trimmed'].max_items} | {m['static']['fwd']:.3f} | "
              f"{m['trimmed']['fwd']:.3f} | {m['static']['fwd'] / m['trimmed']['fwd']:.3f} | {m['static']['train']:.3f} | "
              f"{m['trimmed']['train']:.3f} | {m['static']['train'] / m['trimmed']['train']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
