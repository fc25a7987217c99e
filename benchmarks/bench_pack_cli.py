"""`flamia pack` end to end: wall time and peak RSS on a synthetic pre-tokenized parquet (issue 2).

Writes (once, cached by its parameters) a parquet file with one ``input_ids`` column
(``list<int32>``, random ids in ``[0, 50_000)``), document lengths lognormal(6.5, 1.0) (seed 0)
until ``--tokens`` tokens, then runs ``python -m flamia_pack.cli pack DATA --out OUT --capacity N
--json`` in a subprocess under ``/usr/bin/time -v`` ``--repeats`` times and prints a table: wall
seconds, peak resident set size (``Maximum resident set size``), tokens/s and the command's own
read/pack/write split. ``--code DIR`` runs the ``flamia_pack`` package found in ``DIR`` instead of
this checkout (e.g. an older commit exported with ``git archive``), so two versions are measured
on the same machine and input in one run.

Usage::

    .venv/bin/python benchmarks/bench_pack_cli.py --tokens 50_000_000 --capacity 65536 \\
        --code /tmp/before --code .
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_parquet(path: pathlib.Path, tokens: int, seed: int = 0) -> tuple[int, int]:
    """Write the synthetic input; returns (documents, tokens)."""
    rng = np.random.default_rng(seed)
    lens = []
    total = 0
    while total < tokens:
        chunk = np.maximum(1, rng.lognormal(6.5, 1.0, size=10_000).astype(np.int64))
        lens.append(chunk)
        total += int(chunk.sum())
    lens = np.concatenate(lens)
    lens = lens[: int(np.searchsorted(np.cumsum(lens), tokens)) + 1]
    offsets = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table({"input_ids": col}), tmp, row_group_size=4096)
    os.replace(tmp, path)
    return int(lens.size), int(offsets[-1])


def run_once(code: pathlib.Path, data: pathlib.Path, capacity: int, out: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "flamia_pack.cli", "pack", str(data), "--out", str(out),
           "--capacity", str(capacity), "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(code))
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    parts = [float(x) for x in wall.split(":")]
    secs = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    summary = json.loads(proc.stdout)
    return {"wall_s": secs, "rss_gib": rss_kb * 1024 / 2**30, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-dir", default=tempfile.gettempdir())
    ap.add_argument("--code", action="append", default=None,
                    help="directory holding the flamia_pack package to run (repeatable; default: this checkout)")
    args = ap.parse_args()
    codes = [pathlib.Path(c).resolve() for c in (args.code or [str(ROOT)])]
    data = pathlib.Path(args.data_dir) / f"flamia-bench-ids-{args.tokens}.parquet"
    if not data.exists():
        n_docs, n_tok = make_parquet(data, args.tokens)
        print(f"wrote {data}: {n_docs:,} documents, {n_tok:,} tokens, {data.stat().st_size / 2**20:.0f} MiB")
    md = pq.ParquetFile(data).metadata
    print(f"input {data} ({md.num_rows:,} documents, {data.stat().st_size / 2**20:.0f} MiB), capacity {args.capacity:,}")
    print("| code | run | wall s | peak RSS GiB | Mtok/s (wall) | read s | pack s | write s | rows | fill % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for code in codes:
        for r in range(args.repeats):
            out = pathlib.Path(tempfile.mkdtemp(prefix="flamia-bench-out-"))
            shutil.rmtree(out)
            try:
                res = run_once(code, data, args.capacity, out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            s, sec = res["summary"], res["summary"]["seconds"]
            print(f"| {code} | {r + 1} | {res['wall_s']:.2f} | {res['rss_gib']:.2f} | "
                  f"{s['tokens']['in'] / res['wall_s'] / 1e6:.1f} | {sec['read']:.2f} | {sec['pack']:.2f} | "
                  f"{sec['write']:.2f} | {s['rows']:,} | {100 * s['fill']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
