"""Warp-stall samples of one kernel from an Nsight Compute source page (``ncu -i REP --page source --csv
--print-source sass``): the share of each stall reason over the step loops' code, the opcodes behind
each, and the instructions with the most samples.

    python3 benchmarks/probes/ncu_stalls.py fp8src.csv [--top 25]

The step loops are found as execution counts shared by >= 300 instructions; the address ranges
around them are kept (gaps under 400 instructions merged) and every ``NOP`` is dropped (the idle
producer's, benchmarks/NOTES.md). A producer loop inside those ranges stays in: in the FP8 forward
its mbarrier spin is most of the long-scoreboard share, so read that line with the top instructions.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re


def _f(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    try:
        with open(a.csv, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SystemExit(f"error: {a.csv} cannot be read as a CSV ({exc})") from None
    need = ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
    hi = next((i for i, r in enumerate(rows) if all(c in r for c in need)), None)
    if hi is None:
        raise SystemExit(f"error: {a.csv}: no source-page header with the columns {', '.join(need)} (ncu -i REP "
                         "--page source --csv --print-source sass)")
    h, body = rows[hi], [r for r in rows[hi + 1:] if len(r) == len(rows[hi])]
    src, ci, ce = h.index("Source"), h.index("Warp Stall Sampling (All Samples)"), h.index("Instructions Executed")
    # the step loops: execution counts shared by >= 300 instructions (a loop body's hundreds of
    # instructions run equally often); the address ranges around them are what is summed
    counts = collections.Counter(_f(r[ce]) for r in body if _f(r[ce]) > 0)
    steps = {c for c, n in counts.items() if n >= 300}
    idx = [i for i, r in enumerate(body) if _f(r[ce]) in steps]
    if not idx:
        raise SystemExit(f"error: {a.csv}: no step loop found (no execution count shared by >= 300 instructions)")
    ranges = []
    for i in idx:
        if ranges and i - ranges[-1][1] < 400:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    cons = [r for lo, hi_ in ranges for r in body[lo:hi_ + 1] if "NOP" not in r[src]]
    tot = sum(_f(r[ci]) for r in cons)
    allt = sum(_f(r[ci]) for r in body)
    if tot == 0:
        raise SystemExit(f"error: {a.csv}: no stall samples in the step loops' code (was --section SourceCounters "
                         "collected?)")
    print(f"samples: {allt:.0f} in all, {tot:.0f} ({100 * tot / allt:.1f}%) in the step loops' code "
          f"(instruction ranges {[(lo, hi_) for lo, hi_ in ranges]})")
    reasons = [c for c in h if c.startswith("stall_") and "Not Issued" not in c]
    agg = {c: sum(_f(r[h.index(c)]) for r in cons) for c in reasons}
    for c, v in sorted(agg.items(), key=lambda t: -t[1])[:12]:
        k = h.index(c)
        op = collections.Counter()
        for r in cons:
            m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", r[src])
            if m:
                op[m.group(2)] += _f(r[k])
        print(f"{c:24s} {100 * v / tot:5.1f}%  " + ", ".join(f"{o} {100 * n / tot:.1f}" for o, n in op.most_common(5)))
    print("top instructions (share of the step loops' samples, executions):")
    for r in sorted(cons, key=lambda r: -_f(r[ci]))[:a.top]:
        print(f"{100 * _f(r[ci]) / tot:5.1f}%  {r[ce]:>9}  {r[src].strip()[:100]}")


if __name__ == "__main__":
    main()
