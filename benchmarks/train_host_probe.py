"""Training-call timing probe: is a row's forward + backward GPU-bound or host-bound, ours and padded SDPA?

Run on the GPU machine (one process, ~1 min):
    ROWS=W7,W3,W1 PYTHONPATH=. python3 benchmarks/train_host_probe.py

Why: ``fwd_host_probe.py`` found W3's *forward* close to host-bound (0.84 ms of GPU time, 0.4-0.9 ms
of host time per call). The training call adds a second custom op (the backward) and the autograd
engine, and the short-document rows (W3, W7) are where we miss padded SDPA. For each row and each
implementation (``ours``: ``varlen_attention`` with a work list built once, as ``bench_attention.py``
times it; ``sdpa``: padded SDPA where the row is uniform) this prints

- ``bench``: the median of ``triton.testing.do_bench`` as ``bench_attention.py`` measures it (L2
  flushed before each call, grads set to None),
- ``graph``: ``torch.autograd.grad`` of the same call captured in a CUDA graph and replayed (the
  GPU time with no host work in between),
- ``host``: host microseconds per call when enqueuing 100 calls back to back without a sync,
- ``loop``: wall time per call of those 100 calls including the final sync.

``bench`` well above ``graph`` with ``host`` near ``bench`` means the host is the bottleneck.
With ``PROFILE=1`` it also prints a cProfile (top 30 by own time) of 100 of our training calls.
"""
from __future__ import annotations

import os
import sys
import time

import torch


def _probe(name, impl, train_grad, bench_fn, leaves, B, triton):
    bench_fn()
    torch.cuda.synchronize()
    bench = B.time_ms(bench_fn, grad_to_none=leaves, rep=100)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            train_grad()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            train_grad()
        graph = f"{float(triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode='median')):.3f}"
        del g
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
        graph = f"capture failed ({type(exc).__name__})"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        train_grad()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"| {name} | {impl} | {bench:.3f} | {graph} | {(t1 - t0) / 100 * 1e6:.0f} | "
          f"{(t2 - t0) / 100 * 1e3:.3f} |", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("train_host_probe: needs a CUDA GPU (nothing measured)")
        return 0
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_attention as B
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    rows = os.environ.get("ROWS", "W7,W3,W1").split(",")
    print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| row | impl | bench ms | graph ms | host us/call | loop ms/call |")
    print("|---|---|---|---|---|---|")
    for name in rows:
        spec = WORKLOADS[name]
        lengths = workload_lengths(name)
        inp = B.make_inputs(lengths, spec["num_heads"], spec["num_kv_heads"], seed=5)
        impls = {"ours": B.ours}
        if len(set(int(x) for x in lengths)) == 1:
            impls["sdpa"] = B.sdpa_padded
        for impl, make in impls.items():
            made = make(inp)
            _fwd, train, leaves = made[:3]
            # the same call as ``train`` but through autograd.grad (graph-capturable, no accumulation)
            call = _call_of(impl, inp, B)

            def train_grad(call=call):
                xs = [x.detach().requires_grad_(True) for x in call["leaves"]]
                o = call["fn"](*xs)
                return torch.autograd.grad(o, xs, call["do"])

            _probe(name, impl, train_grad, train, leaves, B, triton)
            if os.environ.get("PROFILE") and impl == "ours":
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    train()
                prof.disable()
                torch.cuda.synchronize()
                print(f"host profile of 100 {name} training calls (PROFILE=1), top 30 by own time:")
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


def _call_of(impl, inp, B):
    """The bare call ``fn(q, k, v) -> o`` with its inputs in the layout it takes, and its dO."""
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.attention import build_attention_work_list

    if impl == "ours":
        wl = build_attention_work_list(inp["cu"], inp["T"], causal=True, head_dim=B.HEAD_DIM)

        def fn(q, k, v):
            return varlen_attention(q, k, v, inp["cu"], inp["max_seqlen"], causal=True, work_list=wl)

        return {"fn": fn, "leaves": [inp[n] for n in ("q", "k", "v")], "do": inp["do"]}
    # padded SDPA: the same views as bench_attention.sdpa_padded (uniform rows only)
    lens = inp["lengths"]
    nb, L = len(lens), int(lens[0])
    gqa = inp["q"].shape[1] != inp["k"].shape[1]
    F = torch.nn.functional

    def view(x):
        return x.view(nb, L, x.shape[1], x.shape[2]).transpose(1, 2)

    def fn(q, k, v):
        o = F.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=True, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(nb * L, q.shape[1], q.shape[2])

    return {"fn": fn, "leaves": [inp[n] for n in ("q", "k", "v")], "do": inp["do"]}

if __name__ == "__main__":
    raise SystemExit(main())
