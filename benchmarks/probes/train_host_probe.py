"""Training-call timing probe: is a row's forward + backward GPU-bound or host-bound, ours and padded SDPA?

Run on the GPU machine (one process, ~1 min):
    ROWS=W7,W3,W1 PYTHONPATH=. python3 benchmarks/probes/train_host_probe.py

Why: a forward-only probe (since removed) found W3's *forward* close to host-bound (0.84 ms of GPU time, 0.4-0.9 ms
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

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("train_host_probe: needs a CUDA GPU (nothing measured)")
        return 0
    import triton

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_attention
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
        impls = {"ours": B.ours_call(inp), "sdpa": B.sdpa_padded_call(inp)}
        for impl, call in impls.items():
            if call is None:  # padded SDPA: uniform rows only
                continue
            _fwd, train, leaves = B._fwd_bwd_fns(call, inp)

            # the same call as ``train`` but through autograd.grad (graph-capturable, no accumulation)
            def train_grad(call=call):
                xs = [inp[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
                return torch.autograd.grad(call(*xs), xs, inp["do"])

            r = B.host_probe(train_grad, bench_fn=train, grad_to_none=leaves, rep=100, calls=100)
            print(f"| {name} | {impl} | {B.host_probe_cells(r)} |", flush=True)
            if os.environ.get("PROFILE") and impl == "ours":
                B.print_host_profile(train, 100, f"{name} training calls", 30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
