"""Forward-only timing probe: is a row's forward GPU-bound or host-bound, and does the config path matter?

Run on the GPU machine (one process, ~30 s):
    ROWS=W7,W3,W1 PYTHONPATH=. python3 benchmarks/fwd_host_probe.py

Why (benchmarks/RESULTS.md, "Session of 2026-11-29 (evening)" run 6): the benchmark timed W7's forward
at 0.68 ms with ``config=None`` while the sweep timed the same kernels (``small_n32r``, passed as
``config=``) at 0.44 ms, and the training call agreed in both. For each row and each way of
choosing the config (``None``: the ``max_seqlen`` rule inside ``varlen_attention``; ``explicit``:
``kernel_config(..., max_seqlen)`` passed in), this prints

- ``bench``: the median of ``triton.testing.do_bench`` as ``bench_attention.py`` measures it
  (``torch.no_grad``, L2 flushed before each call, CUDA events around the call),
- ``graph``: the same call captured in a CUDA graph and replayed (no host work inside the timing),
- ``host``: host microseconds per call when enqueuing 200 calls back to back without a sync,
- ``loop``: wall time per call of those 200 calls including the final sync (GPU-bound when close to
  ``graph``, host-bound when close to ``host``),

first for the forward timed before any training call (as the benchmark does), then again after
one training call. No output files; the table goes to stdout. With ``PROFILE=1`` it also prints a
cProfile of 200 forward calls per row (host time by function); with ``PROFILE=torch`` a
``torch.profiler`` table of the same calls' CPU events (aten ops, CUDA runtime calls) by self time.
With ``SPLIT=1`` it also prints, per row, the host microseconds of each layer of one forward call
on an idle GPU (a sync before each timed call, median of 100): ``varlen_attention``, the custom op
``torch.ops.flamia_pack.varlen_attn_fwd``, ``flash_fwd``, ``gluon_fwd``, the three TMA descriptors,
and the output allocations -- which layer holds the host time (``SPLIT=profile``: and a cProfile of
200 ``gluon_fwd`` calls).
"""
from __future__ import annotations

import os
import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("fwd_host_probe: needs a CUDA GPU (nothing measured)")
        return 0
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_attention as B
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.attention import build_attention_work_list
    from flamia_pack.kernels.config import kernel_config
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    rows = os.environ.get("ROWS", "W7,W3,W1").split(",")
    print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| row | config | phase | bench ms | graph ms | host us/call | loop ms/call |")
    print("|---|---|---|---|---|---|---|")
    for name in rows:
        spec = WORKLOADS[name]
        lengths = workload_lengths(name)
        inp = B.make_inputs(lengths, spec["num_heads"], spec["num_kv_heads"], seed=5)
        ms = inp["max_seqlen"]
        for how in ("None", "explicit"):
            cfg = None if how == "None" else kernel_config(128, True, max_seqlen=ms,
                                                          num_kv_groups=spec["num_heads"] // spec["num_kv_heads"])
            wl = build_attention_work_list(inp["cu"], inp["T"], causal=True, head_dim=128, config=cfg)

            def fwd():
                with torch.no_grad():
                    return varlen_attention(inp["q"], inp["k"], inp["v"], inp["cu"], ms, causal=True,
                                            work_list=wl, config=cfg)

            leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")]

            def train():
                o = varlen_attention(*leaves, inp["cu"], ms, causal=True, work_list=wl, config=cfg)
                o.backward(inp["do"])

            for phase in ("before training", "after training"):
                if phase == "after training":
                    train()
                r = B.host_probe(fwd, rep=60, calls=200)
                print(f"| {name} | {how} | {phase} | {B.host_probe_cells(r)} |", flush=True)
            if os.environ.get("PROFILE") and how == "None":
                B.print_host_profile(fwd, 200, f"{name} forward calls", 25,
                                     mode="torch" if os.environ["PROFILE"] == "torch" else "cprofile")
    if os.environ.get("SPLIT"):
        split(rows)
    return 0


def _idle_us(fn, reps: int = 100) -> float:
    """Median host microseconds of one ``fn()`` started on an idle GPU (synced before each)."""
    import time

    fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def split(rows) -> None:
    """SPLIT=1: host microseconds by layer of one forward call (module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_attention as B
    from flamia_pack.kernels import attention as A
    from flamia_pack.kernels import gluon_attention as G
    from flamia_pack.kernels.flash_fwd import flash_fwd
    from flamia_pack.kernels.config import kernel_config
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    print("| row | layer | host us (idle GPU, median of 100) |")
    print("|---|---|---|")
    for name in rows:
        spec = WORKLOADS[name]
        inp = B.make_inputs(workload_lengths(name), spec["num_heads"], spec["num_kv_heads"], seed=5)
        ms, T = inp["max_seqlen"], inp["T"]
        q, k, v, cu = inp["q"], inp["k"], inp["v"], inp["cu"]
        cfg = kernel_config(128, True, max_seqlen=ms, num_kv_groups=spec["num_heads"] // spec["num_kv_heads"])
        wl = A.build_attention_work_list(cu, T, causal=True, head_dim=128, config=cfg)
        items, num_items = A._check_work_list(wl, True, cfg, q.device, T)
        from flamia_pack.scheduler.worklist import work_list_hints

        mn, dt = work_list_hints(wl)
        bits = A.launch_bits(cfg, mn, dt, T)
        ints = A._op_config_ints(cfg, bits)
        scale = 128 ** -0.5
        layers = {
            "varlen_attention": lambda: A.varlen_attention(q, k, v, cu, ms, causal=True, work_list=wl, config=cfg),
            "torch.ops custom op": lambda: torch.ops.flamia_pack.varlen_attn_fwd(q, k, v, cu, items, num_items, True,
                                                                             scale, ints),
            "flash_fwd": lambda: flash_fwd(q, k, v, cu, items, num_items, causal=True, softmax_scale=scale, config=cfg,
                                           leftover=bool(bits & A.LEFTOVER_FWD), tail=bool(bits & A.PAD_TAIL)),
            "gluon_fwd": lambda: G.gluon_fwd(q, k, v, cu, items, num_items, scale, causal=True,
                                             wl_block_m=cfg.wl_block_m, skip_len=max(1, cfg.fwd_short_len),
                                             persistent=cfg.fwd_gluon_persistent, parts=cfg.fwd_gluon_parts,
                                             block_n=cfg.fwd_gluon_block_n, stages=cfg.fwd_gluon_stages,
                                             pingpong=cfg.fwd_gluon_pingpong, items_whole=cfg.fwd_gluon_items,
                                             head_inner=cfg.fwd_gluon_head_inner, static=cfg.fwd_gluon_static,
                                             part_skip=cfg.fwd_gluon_part_skip),
            "3 TMA descriptors": lambda: (G._descriptor(q, 128), G._descriptor(k, 128), G._descriptor(v, 128)),
            "o, lse, counter allocs": lambda: (torch.empty_like(q), torch.empty((q.shape[1], T), device=q.device),
                                               torch.zeros(1, dtype=torch.int32, device=q.device)),
        }
        if not cfg.fwd_gluon:  # a Triton forward (small_n32r, small_m16): no Gluon layers to time
            for layer in ("gluon_fwd", "3 TMA descriptors"):
                del layers[layer]
        print(f"| {name} | bits={bits} fwd_gluon={cfg.fwd_gluon} | |")
        with torch.no_grad():
            for layer, fn in layers.items():
                print(f"| {name} | {layer} | {_idle_us(fn):.1f} |", flush=True)
            if os.environ.get("SPLIT") == "profile" and "gluon_fwd" in layers:  # where its launch spends host time
                B.print_host_profile(layers["gluon_fwd"], 200, f"{name} gluon_fwd calls", 30)


if __name__ == "__main__":
    raise SystemExit(main())
