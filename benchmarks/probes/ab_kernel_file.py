"""A/B one source file of the project against other versions of it, in alternating processes (H200).

    PYTHONPATH=. python3 benchmarks/probes/ab_kernel_file.py --file flamia_pack/kernels/gluon_fwd.py \
        --variant old=ab/gluon_fwd_old.py --variant shift=ab/gluon_fwd_shift.py \
        --workloads W1,W4 --rounds 2 --rep 300

For kernel changes that have no config switch (a Triton / Gluon kernel rewritten in place): each round
runs one fresh process per variant -- ``current`` (the file as it is) and every ``--variant NAME=PATH``
copied over ``--file`` -- in the same order, and each process times our op on every workload with
``bench_attention.measure`` (forward and training call, median ms of ``triton.testing.do_bench``, L2
flushed, gradients cleared). The file is restored afterwards (also on error or Ctrl-C). Prints one
line per (round, variant, workload) and a table of medians over the rounds with the ratio
``variant / current`` (> 1: the variant is slower); ``$OUT/ab_kernel_file.json`` holds every number.

Variant files are plain copies placed in the work tree (``git show REV:path > ab/x.py``): the device
machine's copy of the repository has no reliable git history. Same-process A/B is not possible for
jitted kernels whose globals or bodies differ; process-to-process noise on the H200 was 0.3-1.5%
(2026-11-29), so use >= 2 rounds and compare medians.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, torch
sys.path.insert(0, "benchmarks")
import bench_attention as B
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths
out = {}
for n in sys.argv[1].split(","):
    inp = B.make_inputs(workload_lengths(n), WORKLOADS[n]["num_heads"], WORKLOADS[n]["num_kv_heads"], seed=3,
                        device="cuda", head_dim=int(sys.argv[3]))
    out[n] = B.measure("ours", B.ours, inp, rep=int(sys.argv[2]))
    del inp
    torch.cuda.empty_cache()
print("AB_RESULT " + json.dumps(out))
"""


def parse_variant(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; raises ValueError on a malformed spec or a missing file."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--variant must be NAME=PATH, got {text!r}")
    if name == "current":
        raise ValueError("--variant name 'current' is reserved for the file as it is")
    if not os.path.isfile(path):
        raise ValueError(f"--variant {name}: no file {path!r}")
    return name, path


def summarize(runs: dict[str, list[dict]]) -> list[tuple[str, str, str, float, float]]:
    """Median over rounds per (variant, workload, metric) and its ratio to ``current``.

    Args:
        runs: variant -> list (one per round) of ``{workload: {"fwd_ms": .., "train_ms": ..}}``.

    Returns:
        rows ``(variant, workload, metric, median_ms, ratio_vs_current)`` (ratio NaN when current lacks it).
    """
    rows = []
    base: dict[tuple[str, str], float] = {}
    for variant in ["current"] + [v for v in runs if v != "current"]:
        for wl in sorted({w for r in runs.get(variant, []) for w in r}):
            for metric in ("fwd_ms", "train_ms"):
                vals = [r[wl][metric] for r in runs[variant] if wl in r and metric in r[wl]]
                if not vals:
                    continue
                med = statistics.median(vals)
                if variant == "current":
                    base[(wl, metric)] = med
                ref = base.get((wl, metric))
                rows.append((variant, wl, metric, med, med / ref if ref else float("nan")))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True, help="the project file the variants replace")
    ap.add_argument("--variant", action="append", default=[], help="NAME=PATH (repeatable)")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep", type=int, default=150, help="do_bench rep (ms of timed calls per cell)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per process")
    a = ap.parse_args(argv)
    try:
        variants = dict(parse_variant(v) for v in a.variant)
    except ValueError as e:
        ap.error(str(e))
    if not os.path.isfile(a.file):
        ap.error(f"--file {a.file!r} does not exist")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    import torch

    if not torch.cuda.is_available():
        print("ab_kernel_file: needs a CUDA GPU (nothing measured)")
        return 0
    backup = tempfile.NamedTemporaryFile(delete=False, suffix=os.path.basename(a.file))
    backup.close()
    shutil.copyfile(a.file, backup.name)
    runs: dict[str, list[dict]] = {"current": [], **{v: [] for v in variants}}
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ".")}
    try:
        for rnd in range(1, a.rounds + 1):
            for name in runs:
                shutil.copyfile(backup.name if name == "current" else variants[name], a.file)
                try:
                    p = subprocess.run([sys.executable, "-c", _CHILD, a.workloads, str(a.rep), str(a.head_dim)],
                                       capture_output=True, text=True, timeout=a.timeout, env=env)
                except subprocess.TimeoutExpired:
                    print(f"round {rnd} {name}: timed out after {a.timeout:.0f} s", flush=True)
                    continue
                line = [x for x in p.stdout.splitlines() if x.startswith("AB_RESULT ")]
                if p.returncode or not line:
                    print(f"round {rnd} {name}: failed (rc {p.returncode}): {p.stderr.strip()[-800:]}", flush=True)
                    continue
                res = json.loads(line[-1][len("AB_RESULT "):])
                runs[name].append(res)
                for wl, r in res.items():
                    print(f"round {rnd} {name} {wl} {r}", flush=True)
    finally:
        shutil.copyfile(backup.name, a.file)
        os.unlink(backup.name)
    rows = summarize(runs)
    print("\n| variant | workload | metric | median ms | vs current |\n|---|---|---|---|---|")
    for v, wl, m, med, ratio in rows:
        print(f"| {v} | {wl} | {m} | {med:.4f} | {ratio:.4f} |")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "ab_kernel_file.json"), "w") as f:
            json.dump({"file": a.file, "variants": variants, "runs": runs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
