"""One-shot device script for the BF16 attention kernels (issue 5): tests, variants, benchmark.

    PYTHONPATH=. python3 benchmarks/gpu_attention_check.py [--tests] [--variants] [--bench ARGS] [--leak]

Sections (each guarded, logs under $OUT):
  --tests     pytest tests/test_attention_gpu.py (log: gpu_tests.log)
  --variants  forward / training-call times of tile and schedule variants on a few W rows
              (ours only; variants.md / variants.json) -- how the defaults in kernels/config.py
              were chosen
  --bench     benchmarks/bench_attention.py with the given arguments (bench_attention.md/.json)
  --leak      the causal leak probe (kernels/leak.py) on ours, FlexAttention and varlen_attn
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = os.environ.get("OUT", ".")


def log(msg):
    print(msg, flush=True)


def env_info():
    import triton

    log(f"GPU {torch.cuda.get_device_name()} cap {torch.cuda.get_device_capability()} torch {torch.__version__} "
        f"triton {triton.__version__}")
    try:
        import torch.nn.attention.varlen as m

        log(f"varlen_attn{inspect.signature(m.varlen_attn)}")
    except Exception as e:  # noqa: BLE001
        log(f"varlen_attn unavailable: {e}")


def tests(k=""):
    t0 = time.time()
    with open(os.path.join(OUT, "gpu_tests.log"), "w") as f:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--no-header", "-p", "no:cacheprovider",
                            "tests/test_attention_gpu.py"] + (["-k", k] if k else []), stdout=f, stderr=subprocess.STDOUT, timeout=300)
    with open(os.path.join(OUT, "gpu_tests.log")) as f:
        tail = f.read()[-2500:]
    log(f"--- gpu tests rc={p.returncode} ({time.time() - t0:.0f} s)\n{tail}")


FWD_VARIANTS = {
    "A grid 128x64 w8 s3 (default)": {},
    "B persistent 128x64 w8 s3": {"schedule": "persistent"},
    "C grid 128x128 w8 s2": {"block_n": 128, "num_stages": 2},
    "D grid 128x64 w8 s2": {"num_stages": 2},
}
BWD_VARIANTS = {
    "c3 n1=128 m1=32 w8 s3 (default)": {},
    "c n1=128 m1=32 w8 s2": {"bwd_num_stages": 2},
    "c4 n1=128 m1=32 w8 s4": {"bwd_num_stages": 4},
    "b3 n1=128 m1=64 w8 s3": {"bwd_block_m1": 64},
    "c3s split launches": {"bwd_fused": False},
    "d3 n1=64 m1=32 w8 s3": {"bwd_block_n1": 64},
}


def variants(workloads, kinds=("fwd_ms", "train_ms")):
    import bench_attention as B

    from flamia_pack.kernels.config import kernel_config
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    base = kernel_config(128, True)
    res = {}
    lines = ["| variant | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for kind, table in (("fwd_ms", FWD_VARIANTS), ("train_ms", BWD_VARIANTS)):
        if kind not in kinds:
            continue
        for vname, over in table.items():
            try:
                cfg = dataclasses.replace(base, **over)
            except Exception as e:  # noqa: BLE001
                log(f"{vname}: bad config {e}")
                continue
            cells = []
            for w in workloads:
                spec = WORKLOADS[w]
                inp = B.make_inputs(workload_lengths(w), spec["num_heads"], spec["num_kv_heads"], seed=1)
                r = B.measure("ours", lambda i: B.ours(i, cfg), inp, fwd=kind == "fwd_ms", train=kind == "train_ms",
                              rep=100)
                res.setdefault(vname, {})[w] = r
                if kind in r:
                    fl = B.attention_flops(workload_lengths(w), spec["num_heads"], 128, True, mode="fwd")
                    fl *= 3.5 if kind == "train_ms" else 1.0
                    cells.append(f"{r[kind]:.3f} ({fl / r[kind] / 1e9:.0f})")
                else:
                    cells.append(r.get("error", "?")[:60])
                del inp
            line = f"| {kind[:-3]} {vname} | " + " | ".join(cells) + " |"
            lines.append(line)
            log(line)
    best = {}
    for kind, table in (("fwd_ms", FWD_VARIANTS), ("train_ms", BWD_VARIANTS)):
        scores = {}
        for vname in table:
            rs = res.get(vname, {})
            if all(kind in rs.get(w, {}) for w in workloads):
                # geometric mean of the time relative to the default variant
                ref = res[next(iter(table))]
                scores[vname] = float(torch.tensor([rs[w][kind] / ref[w][kind] for w in workloads]).log().mean().exp())
        if scores:
            pick = min(scores, key=scores.get)
            best.update(table[pick])
            lines.append(f"best {kind[:-3]}: {pick} (geo-mean time vs default {scores[pick]:.3f})")
    res["best_overrides"] = best
    text = "ms (TFLOP/s)\n" + "\n".join(lines)
    with open(os.path.join(OUT, "variants.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, "variants.json"), "w") as f:
        json.dump(res, f, indent=1)
    log(text)
    return best


def leak():
    try:
        from flamia_pack.kernels import leak as L
    except Exception as e:  # noqa: BLE001
        log(f"leak probe unavailable: {e}")
        return
    from flamia_pack.kernels import varlen_attention

    log(f"probe_leak{inspect.signature(L.probe_leak)}")
    fns = {"ours": lambda q, k, v, cu, m: varlen_attention(q, k, v, cu, m, deterministic=True)}
    try:
        from torch.nn.attention import varlen as vm

        fns["varlen_attn"] = lambda q, k, v, cu, m: vm.varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
    except Exception as e:  # noqa: BLE001
        log(f"varlen_attn: {e}")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        cflex = torch.compile(flex_attention, dynamic=False)

        def flex_fn(q, k, v, cu, m):
            T = q.shape[0]
            pos = torch.arange(T, device=q.device, dtype=cu.dtype)
            doc = torch.searchsorted(cu, pos, right=True) - 1

            def mm(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)

            bm = create_block_mask(mm, None, None, T, T, device=q.device)
            o = cflex(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                      block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])
            return o.squeeze(0).transpose(0, 1)

        fns["flex_attention"] = flex_fn
    except Exception as e:  # noqa: BLE001
        log(f"flex: {e}")
    # head_dim 128 with documents > 1,024 tokens: the path the defaults run there (persistent Gluon
    # forward; Gluon dK/dV programs), which the head_dim 64 probe (Triton kernels) does not reach
    long_cu = [0, 700, 1900, 2100, 3000]
    fns["ours (D=128, Gluon)"] = fns["ours"]
    kwargs = {"ours (D=128, Gluon)": {"head_dim": 128, "cu_seqlens": long_cu}}
    reports, lines = [], []
    for name, fn in fns.items():
        try:
            r = L.probe_leak(fn, device="cuda", name=name, **kwargs.get(name, {}))
            reports.append(r)
            lines.append(f"{name}: verdict {r.verdict}; " + ", ".join(f"{k}={v}" for k, v in r.rows()))
        except Exception as e:  # noqa: BLE001
            lines.append(f"{name}: error {type(e).__name__}: {e}")
            traceback.print_exc()
        log(lines[-1])
    if reports:
        from rich.console import Console

        con = Console(width=200, record=True)
        con.print(L.leak_table(reports))
        lines.append(con.export_text())
    with open(os.path.join(OUT, "leak.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--tests-k", default="", help="pytest -k filter for --tests")
    ap.add_argument("--variants", default="")
    ap.add_argument("--bench", default=None,
                    help="arguments for bench_attention.py, e.g. --bench='--no-peers' ('' for defaults); uses the "
                         "best variant found by --variants")
    ap.add_argument("--variant-kinds", default="fwd_ms,train_ms")
    ap.add_argument("--leak", action="store_true")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    env_info()
    state = {"best": {}}

    def do_variants():
        state["best"] = variants([w for w in a.variants.split(",") if w], tuple(a.variant_kinds.split(","))) or {}

    def do_bench():
        import bench_attention

        extra = ["--config", json.dumps(state["best"])] if state["best"] else []
        bench_attention.main(a.bench.split() + extra + ["--out", OUT])

    for name, fn, on in (("tests", lambda: tests(a.tests_k), a.tests), ("variants", do_variants, bool(a.variants)),
                         ("bench", do_bench, a.bench is not None), ("leak", leak, a.leak)):
        if not on:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        log(f"=== {name} done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
