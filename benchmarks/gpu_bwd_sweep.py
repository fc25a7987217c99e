"""One-call H200 sweep of the attention config candidates (issue 5: the backward gap to FlexAttention).

    PYTHONPATH=. python3 benchmarks/gpu_bwd_sweep.py [--candidates a,b,...] [--workloads W1,W4,W6,W7] [--noncausal]
        [--rep MS] [--passes N] [--budget S] [--graph] [--dry-run]

For each candidate of ``flamia_pack.kernels.config.CANDIDATES`` (``default`` first):

1. correctness on one small random packed row (``kernels/check.py``: O, dQ, dK, dV vs the fp32
   reference, error <= 2x the bf16-torch error + atol, outputs NaN-poisoned, padding rows checked;
   H = 16 like the timed rows so the compiled kernels are shared, GQA is left to the GPU tests);
2. the training call (forward + backward) and, for candidates that change the forward, the forward
   alone: median ms of ``triton.testing.do_bench`` on fresh N(0, 1) bf16 inputs of each workload
   (T = 65,536, H = 16, D = 128, causal; work list built once per row). Candidates are timed
   side by side on the same inputs, in ``--passes`` passes of alternating order (the mean of the
   passes' medians is reported).

With ``--graph`` each forward is also timed as a CUDA-graph replay (``bench_attention.graph_ms``: the
GPU time without the host's, which the eager forward of short-document rows does not always hide).

Prints a table with ratios vs the default (> 1: faster) and writes ``$OUT/bwd_sweep.json`` with
every number, the fastest correct candidate (geometric mean of the training-call ratios over the
workloads), whether it beats the default by >= 5%, and ``recommended`` (that candidate, else
``default``) for ``FLAMIA_ATTN_CONFIG``. Stops timing new cells after ``--budget`` seconds.
``--dry-run`` builds the configs and the work lists on the CPU (no timing); with
``TRITON_INTERPRET=1`` it also runs each candidate's correctness check in the Triton interpreter.
``$OUT/recommended_config.txt`` holds the recommended name alone, for
``FLAMIA_ATTN_CONFIG=$(cat $OUT/recommended_config.txt) python3 -m pytest tests/test_attention_gpu.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FWD_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "schedule", "wl_block_m", "merge_short", "fwd_gluon",
              "fwd_maxnreg", "fwd_short_len", "fwd_gluon_persistent", "fwd_gluon_parts", "fwd_gluon_block_n",
              "fwd_gluon_stages", "fwd_gluon_pingpong", "fwd_gluon_items",
              "fwd_gluon_head_inner", "fwd_gluon_static", "fwd_gluon_part_skip")


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def changes_forward(cfg, base) -> bool:
    return any(getattr(cfg, f) != getattr(base, f) for f in FWD_FIELDS)


def sweep_row(name: str):
    """``(spec, lengths)`` of a WORKLOADS.md id, or of ``U<len>``: a T = 65,536 row of equal documents
    of ``len`` tokens, H = 16 MHA (for locating a tile-set threshold between the workloads' lengths)."""
    import numpy as np
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    if name.startswith("U") and name[1:].isdigit() and 0 < int(name[1:]) <= 65536 and 65536 % int(name[1:]) == 0:
        n = int(name[1:])
        return {"num_heads": 16, "num_kv_heads": 16}, np.full(65536 // n, n, np.int64)
    return WORKLOADS[name], workload_lengths(name)


def check_correct(cfg, seed: int = 3, total: int = 3003, device: str = "cuda", causal: bool = True) -> dict:
    """Correctness of one candidate on a small random packed row (unaligned starts, 5 padding rows).

    H = 16 MHA and T = total + 5 divisible by 16, like the timed rows: the kernels compiled here
    have the same integer specializations (head count, group, divisibility of T-strides) and are
    reused by the timing, so each candidate compiles once. GQA is covered by
    tests/test_attention_gpu.py (run it with FLAMIA_ATTN_CONFIG=<candidate>).
    """
    import numpy as np

    from flamia_pack.kernels.check import compare_with_reference, random_lengths

    lengths = random_lengths(np.random.default_rng(seed), total, 40)
    r = compare_with_reference(lengths, num_heads=16, num_kv_heads=16, head_dim=128, causal=causal, pad=5,
                               device=device, seed=seed, config=cfg)
    return {k: (float(v) if isinstance(v, float) else v) for k, v in r.items()}


def summarize(res: dict, names: list, workloads: list) -> tuple[str, dict]:
    """Markdown table (ms and default/candidate ratios) and the summary dict of a sweep.

    ``res[name]`` holds ``correct`` (bool), ``train_ms`` / ``fwd_ms`` ({workload: ms}); ``names[0]``
    is the default. The fastest candidate is the correct one with the highest geometric mean of
    the training-call ratios over all ``workloads`` (a candidate missing a workload is not ranked).
    """
    d = res[names[0]]
    graph = any(res[n].get("fwd_graph_ms") for n in names)
    gw = workloads if graph else []
    lines = ["| candidate | correct | " + " | ".join(f"train {w} ms (x)" for w in workloads) + " | geo x | "
             + " | ".join(f"fwd {w} ms (x)" for w in workloads) + "".join(f" | fwd graph {w} ms (x)" for w in gw) + " |",
             "|---|---|" + "---|" * (2 * len(workloads) + 1 + len(gw))]
    best, best_geo = None, 0.0
    for n in names:
        r = res[n]
        cells, ratios = [], []
        for w in workloads:
            tm, dm = r.get("train_ms", {}).get(w), d.get("train_ms", {}).get(w)
            if tm and dm:
                ratios.append(dm / tm)
                cells.append(f"{tm:.3f} ({dm / tm:.3f})")
            else:
                cells.append("-")
        geo = float(math.exp(sum(math.log(x) for x in ratios) / len(ratios))) if ratios and len(ratios) == len(workloads) else None
        r["geo_train_speedup_vs_default"] = geo
        fcells = []
        for w in workloads:
            fm, dm = r.get("fwd_ms", {}).get(w), d.get("fwd_ms", {}).get(w)
            fcells.append(f"{fm:.3f} ({dm / fm:.3f})" if fm and dm else "-")
        for w in gw:
            fm, dm = r.get("fwd_graph_ms", {}).get(w), d.get("fwd_graph_ms", {}).get(w)
            fcells.append(f"{fm:.3f} ({dm / fm:.3f})" if fm and dm else "-")
        lines.append(f"| {n} | {r.get('correct')} | " + " | ".join(cells) + f" | {'-' if geo is None else f'{geo:.3f}'} | "
                     + " | ".join(fcells) + " |")
        if r.get("correct") and geo is not None and geo > best_geo:
            best, best_geo = n, geo
    beats = bool(best is not None and best != names[0] and best_geo >= 1.05)
    summary = {"fastest": best, "fastest_geo_speedup_vs_default": best_geo if best else None,
               "beats_default_by_5pct": beats, "recommended": best if beats else "default"}
    return "\n".join(lines), summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", default="all",
                    help="comma list of kernels/config.py CANDIDATES names (default: all; 'default' always runs first)")
    ap.add_argument("--workloads", default="W1,W4,W6,W7")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms of timed calls per cell)")
    ap.add_argument("--passes", type=int, default=2, help="timing passes (alternating candidate order)")
    ap.add_argument("--budget", type=float, default=130.0, help="seconds after which no new cell is timed")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build configs and work lists only")
    ap.add_argument("--graph", action="store_true",
                    help="also time each forward as a CUDA-graph replay (GPU time without the host: the eager "
                         "forward of short-document rows is host-bound for some configs)")
    ap.add_argument("--noncausal", action="store_true",
                    help="time and check the non-causal call (e.g. the Triton forward's static / policy schedules)")
    a = ap.parse_args(argv)
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)

    from flamia_pack.kernels.config import CANDIDATES, candidate_config  # imports torch (after --help)

    names = list(CANDIDATES) if a.candidates == "all" else [n for n in a.candidates.split(",") if n]
    if "default" in names:
        names.remove("default")
    names = ["default"] + names
    causal = not a.noncausal
    cfgs = {n: candidate_config(n, 128, causal) for n in names}
    base = cfgs["default"]
    workloads = [w for w in a.workloads.split(",") if w]

    import numpy as np
    import torch

    from flamia_pack.scheduler.cost import attention_flops
    if a.dry_run or not torch.cuda.is_available():
        from flamia_pack.kernels.attention import build_attention_work_list

        for n, c in cfgs.items():
            diff = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base, f.name)}
            for w in workloads:
                lens = sweep_row(w)[1]
                cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
                wl = build_attention_work_list(cu, int(lens.sum()), causal=causal, head_dim=128, config=c)
                log(f"dry-run {n} {w}: T={int(lens.sum())} items={int(wl.num_items.item())}")
            log(f"dry-run {n}: overrides {diff} forward changed={changes_forward(c, base)}")
            if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels in the Triton interpreter
                r = check_correct(c, total=299, device="cpu", causal=causal)
                log(f"dry-run check {n} (interpreter, 300 tokens): {'OK' if r['ok'] else 'FAIL'}")
        if not a.dry_run:
            log("no CUDA device: dry run only")
        return 0

    import triton

    import bench_attention as B

    log(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
        f"candidates {names}; workloads {workloads}; {'causal' if causal else 'NON-causal'}")
    res: dict = {n: {"config": dataclasses.asdict(c), "fwd_changed": changes_forward(c, base), "train_ms": {}, "fwd_ms": {},
                     "train_runs": {}, "fwd_runs": {}, "fwd_graph_ms": {}, "fwd_graph_runs": {}} for n, c in cfgs.items()}

    # 1. correctness (also compiles the kernels of each candidate)
    for n, c in cfgs.items():
        if n != "default" and time.time() - T0 > 0.75 * a.budget:
            res[n]["correct"] = False
            res[n]["error"] = "skipped: time budget (compilation slower than planned)"
            log(f"check {n}: skipped (time budget)")
            continue
        try:
            r = check_correct(c, causal=causal)
            res[n]["check"] = r
            res[n]["correct"] = bool(r["ok"])
            log(f"check {n}: {'OK' if r['ok'] else 'FAIL'} " + " ".join(
                f"{x}={r[f'err_{x}']:.4g}/{2 * r[f'base_{x}']:.4g}" for x in ("o", "dq", "dk", "dv")))
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result
            res[n]["correct"] = False
            res[n]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"check {n}: ERROR {res[n]['error']}")
            traceback.print_exc()
    live = [n for n in names if res[n]["correct"]]

    # 2. timing: pass after pass over all workloads (a budget cut leaves whole passes), candidates
    #    side by side on the same inputs, alternating their order from pass to pass
    for p in range(a.passes):
        for w in workloads:
            if time.time() - T0 > a.budget:
                log(f"time budget reached: pass {p + 1} stops before {w}")
                break
            spec, lens = sweep_row(w)
            inp = B.make_inputs(lens, spec["num_heads"], spec["num_kv_heads"], seed=11)
            fns = {}
            for n in live:
                try:
                    f, t, leaves = B.ours(inp, cfgs[n], causal)
                    t()
                    torch.cuda.synchronize()
                    fns[n] = (f, t, leaves)
                except Exception as e:  # noqa: BLE001
                    res[n].setdefault("errors", {})[w] = f"{type(e).__name__}: {str(e)[:200]}"
                    log(f"{w} {n}: ERROR {res[n]['errors'][w]}")
            order = list(fns) if p % 2 == 0 else list(reversed(list(fns)))
            for n in order:
                f, t, leaves = fns[n]
                res[n]["train_runs"].setdefault(w, []).append(B.time_ms(t, grad_to_none=leaves, rep=a.rep, warmup=20))
                if n == "default" or res[n]["fwd_changed"]:
                    res[n]["fwd_runs"].setdefault(w, []).append(B.time_ms(f, rep=a.rep, warmup=20))
                    if a.graph:
                        g = B.graph_ms(f, rep=a.rep)
                        if isinstance(g, float):
                            res[n]["fwd_graph_runs"].setdefault(w, []).append(g)
                        else:
                            res[n].setdefault("errors", {})[f"{w} graph"] = g
            for n in fns:
                for key in ("train", "fwd", "fwd_graph"):
                    runs = res[n][f"{key}_runs"].get(w)
                    if runs:
                        res[n][f"{key}_ms"][w] = float(np.mean(runs))
            fl = attention_flops(lens, spec["num_heads"], 128, causal, mode="fwd_bwd")
            log(f"pass {p + 1} {w}: " + ", ".join(
                f"{n} {res[n]['train_runs'][w][-1]:.3f} ms ({fl / res[n]['train_runs'][w][-1] / 1e9:.0f} TF/s)"
                for n in fns if res[n]["train_runs"].get(w)))
            del fns, inp
            torch.cuda.empty_cache()

    # 3. table and summary (raw numbers are written even if the summary fails)
    summary = {"workloads": workloads, "causal": causal, "rep_ms": a.rep, "passes": a.passes, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__}
    text = ""
    try:
        text, s2 = summarize(res, names, workloads)
        summary.update(s2)
        log("ms (ratio = default / candidate, > 1 faster)\n" + text)
        log(f"fastest correct: {summary['fastest']} (geo-mean x{summary['fastest_geo_speedup_vs_default']}) vs default; "
            f"beats default by >= 5%: {summary['beats_default_by_5pct']}; "
            f"recommended FLAMIA_ATTN_CONFIG={summary['recommended']}")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    summary["elapsed_s"] = time.time() - T0
    with open(os.path.join(out_dir, "bwd_sweep.json"), "w") as f:
        json.dump({"summary": summary, "table_md": text, "candidates": res}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bwd_sweep.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "recommended_config.txt"), "w") as f:
        f.write(str(summary.get("recommended", "default")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
