"""Packing throughput and fill: flamia_pack vs TRL's ``pack_dataset`` (issue 2, DESIGN.md §3).

Workload (issue 2): ``--docs`` documents (default 1,000,000) with lognormal(mu=6.5, sigma=1.0)
lengths (seeded; ``int(x)``, so about 1.1e9 tokens), capacity 65,536, random token ids.

Measured in one process, best of ``--repeats`` runs after a warm-up (numba compiled first):

- ``plan bfd`` / ``plan concat`` / ``plan balanced``: :func:`flamia_pack.pack.plan_packing` on
  lengths only; the note gives the spread of per-row attention cost ``sum(len**2)``.
- ``pack_flat bfd``: plan + copy of every token into ``(rows, capacity)`` int32 ``input_ids`` and
  ``position_ids`` buffers (padding written), from one flat token buffer with offsets (the Arrow
  layout the loaders hand over).
- ``plan + fill_rows``: the streaming path (a parquet writer or loader): plan once, then copy
  ``--block-rows`` rows at a time into one reused pair of buffers, token ids validated inside the
  copy loop. Memory stays at one block, and it avoids this VM's slow first touch of fresh memory.
- ``pack_documents bfd``: same from a Python list of per-document numpy arrays (``--list-docs``
  of them; includes concatenating the list).
- TRL ``pack_dataset(ds, 65536, strategy="bfd")`` on a ``datasets.Dataset`` holding the same
  tokens as an Arrow ``input_ids`` list column: once with ``map_kwargs={"batch_size": None}``
  (BFD over the whole dataset, the comparable packing) and once with the default map batch
  (1,000 documents per batch: what a user gets by default; worse fill), and ``strategy="bfd_split"``
  (keeps the tail of documents longer than capacity, like our default ``long_docs="split"``; TRL
  ``bfd`` truncates them, shown in the ``dropped`` column). TRL's output is ragged
  Arrow rows with ``seq_lengths`` (no padding written, no ``position_ids``), so per token it does
  less work than ``pack_flat``.

tokens/s = input tokens / wall seconds. fill = packed tokens / (rows * capacity).

Run: ``.venv/bin/python benchmarks/bench_pack.py`` (``make bench-pack`` installs TRL first).
Memory: the full-copy runs need about 3x the token bytes (source + input_ids + position_ids, int32);
when ``MemAvailable`` is short, ``--copy-docs`` is reduced automatically and the table says so.
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import time

import numpy as np

from flamia_pack.pack import PackConfig, fill_rows, pack_documents, pack_flat, plan_packing


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _best(fn, repeats: int) -> tuple[float, float, object]:
    """(best, first) wall seconds of ``repeats`` calls, and the last result. The first call of a big
    copy also pays the page faults of fresh memory, so both are reported."""
    best = first = float("inf")
    out = None
    for i in range(repeats):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        first = dt if i == 0 else first
    return best, first, out


def _cost_spread(plan) -> str:
    """Spread of the per-row attention cost sum(len**2): min, p99 and max over the mean."""
    c = np.zeros(plan.n_rows)
    np.add.at(c, plan.seg_row, plan.seg_len.astype(np.float64) ** 2)
    m = c.mean()
    return f"row sum(len^2)/mean: min {c.min() / m:.3f} p99 {np.percentile(c, 99) / m:.2f} max {c.max() / m:.1f}"


def _trl_pack(tokens: np.ndarray, offsets: np.ndarray, capacity: int, strategy: str, batch_size: int | None):
    import datasets
    import pyarrow as pa
    from trl import pack_dataset

    datasets.disable_caching()
    datasets.disable_progress_bars()
    col = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    ds = datasets.Dataset(pa.table({"input_ids": col}))
    kwargs = {"batch_size": batch_size} if batch_size != 1000 else {}
    t0 = time.perf_counter()
    out = pack_dataset(ds, capacity, strategy=strategy, map_kwargs=kwargs)
    dt = time.perf_counter() - t0
    rows = len(out)
    packed = int(np.asarray(out.data.column("seq_lengths").combine_chunks().flatten()).sum())
    return dt, rows, packed


def _print_table(args, total: int, cap: int, bfd_rows: int, results: list) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# bench_pack: {args.docs:,} docs lognormal(6.5, 1.0) seed {args.seed}, {total:,} tokens, "
          f"capacity {cap:,}; bfd rows {bfd_rows:,} (lower bound ceil(tokens/capacity) = {-(-total // cap):,}); "
          f"commit {commit}")
    print(f"| {'run':<40} | {'docs':>9} | {'tokens in':>13} | {'best s':>7} | {'Mtok/s':>8} | {'first s':>7} "
          f"| {'fill %':>7} | {'dropped':>7} | note")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 15}|{'-' * 9}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 9}|------")
    for name, nd, ntok, sec, first, fill, dropped, note in results:
        print(f"| {name:<40} | {nd:>9,} | {ntok:>13,} | {sec:>7.3f} | {ntok / sec / 1e6:>8.1f} | {first:>7.3f} "
              f"| {100 * fill:>7.3f} | {dropped:>7,} | {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=65_536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-docs", type=int, default=None, help="documents for the full-copy runs (default: all)")
    ap.add_argument("--list-docs", type=int, default=100_000, help="documents for pack_documents(list)")
    ap.add_argument("--trl-docs", type=int, default=None, help="documents for TRL (default: all)")
    ap.add_argument("--block-rows", type=int, default=256, help="rows per fill_rows block (reused buffers)")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="only the lengths-only planning rows")
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = rng.lognormal(6.5, 1.0, args.docs).astype(np.int64)
    offsets = np.zeros(args.docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    cap = args.capacity
    bfd = PackConfig(capacity=cap)
    concat = PackConfig(capacity=cap, algorithm="concat")
    balanced = PackConfig(capacity=cap, algorithm="balanced")

    # warm-up: numba compile / cache load
    w = rng.integers(0, 1000, 64, dtype=np.int32)
    pack_flat(w, np.array([0, 10, 64]), bfd)
    pack_flat(w, np.array([0, 10, 64]), concat)
    pack_documents([w[:3], w[3:9]], bfd)

    # name, docs, tokens in, best seconds, first-call seconds, fill, tokens dropped, note
    results: list[tuple[str, int, int, float, float, float, int, str]] = []

    for cfg in (bfd, concat, balanced):
        t, t1, plan = _best(lambda: plan_packing(lengths, cfg), args.repeats)
        results.append((f"plan {cfg.algorithm} (lengths only)", args.docs, total, t, t1, plan.stats.fill, 0,
                        _cost_spread(plan)))
        if cfg is bfd:
            bfd_rows = plan.stats.rows
        del plan

    if args.plan_only:
        _print_table(args, total, cap, bfd_rows, results)
        return
    n_copy = args.copy_docs or args.docs
    need = 3 * 4 * int(offsets[n_copy]) * 1.15
    note = ""
    if need > _mem_available():
        scale = _mem_available() / need
        n_copy = int(n_copy * scale * 0.9)
        note = f"subset ({n_copy:,} docs: memory)"
    elif n_copy < args.docs:
        note = f"subset ({n_copy:,} docs)"
    copy_tokens = int(offsets[n_copy])
    n_trl = 0 if args.no_trl else min(args.trl_docs or n_copy, args.docs)
    tokens = rng.integers(0, 128_000, int(offsets[max(n_copy, n_trl)]), dtype=np.int32)
    sub_off = offsets[: n_copy + 1]
    t, t1, rows = _best(lambda: pack_flat(tokens, sub_off, bfd), max(1, min(args.repeats, 2)))
    results.append(("pack_flat bfd (plan + copy)", n_copy, copy_tokens, t, t1, rows.stats.fill, 0, note))
    del rows
    gc.collect()
    t, t1, rows = _best(lambda: pack_flat(tokens, sub_off, concat), max(1, min(args.repeats, 2)))
    results.append(("pack_flat concat (plan + copy)", n_copy, copy_tokens, t, t1, rows.stats.fill, 0, note))
    del rows
    gc.collect()

    def stream(cfg: PackConfig, block: int = args.block_rows):
        plan = plan_packing(np.diff(sub_off), cfg)
        ids = np.empty((block, cap), dtype=np.int32)
        pos = np.empty((block, cap), dtype=np.int32)
        for r0 in range(0, plan.n_rows, block):
            fill_rows(plan, tokens, sub_off, cfg, r0, min(r0 + block, plan.n_rows), input_ids=ids, position_ids=pos)
        return plan

    for cfg in (bfd, concat):
        t, t1, plan = _best(lambda: stream(cfg), max(1, min(args.repeats, 2)))
        results.append((f"plan + fill_rows {cfg.algorithm}, {args.block_rows}-row blocks", n_copy, copy_tokens, t, t1,
                        plan.stats.fill, 0, note))
        del plan

    n_list = min(args.list_docs, args.docs)
    views = [tokens[offsets[i]:offsets[i + 1]] for i in range(n_list)]
    t, t1, rows = _best(lambda: pack_documents(views, bfd), max(1, min(args.repeats, 2)))
    results.append(("pack_documents bfd (list of arrays)", n_list, int(offsets[n_list]), t, t1, rows.stats.fill, 0,
                    f"subset ({n_list:,} docs)" if n_list < args.docs else ""))
    del rows
    views.clear()
    gc.collect()

    ours_best = max(r[2] / r[3] for r in results if r[0].startswith(("pack_flat bfd", "plan + fill_rows bfd")))
    trl_rates = []
    if not args.no_trl:
        import trl

        _trl_pack(tokens, offsets[:1001], cap, "bfd", None)  # warm-up (imports, first map)
        tnote = f"subset ({n_trl:,} docs)" if n_trl < args.docs else ""
        for strategy, bs, label in (("bfd", None, "batch_size=None"), ("bfd", 1000, "default batch 1000"),
                                    ("bfd_split", None, "batch_size=None")):
            dt, trows, tpacked = _trl_pack(tokens, offsets[: n_trl + 1], cap, strategy, bs)
            ttok = int(offsets[n_trl])
            results.append((f"TRL {trl.__version__} {strategy}, {label}", n_trl, ttok, dt, dt,
                            tpacked / (trows * cap), ttok - tpacked, tnote))
            trl_rates.append(ttok / dt)
            gc.collect()

    _print_table(args, total, cap, bfd_rows, results)
    if trl_rates:
        flat_first = next(r[2] / r[4] for r in results if r[0].startswith("pack_flat bfd"))
        order = " (TRL bfd batch_size=None, bfd default batch, bfd_split batch_size=None)"
        print("\nbest flamia bfd plan+copy vs TRL (tokens/s ratio): "
              + ", ".join(f"{ours_best / r:.1f}x" for r in trl_rates) + order)
        print("first pack_flat bfd call (fresh output memory) vs TRL: "
              + ", ".join(f"{flat_first / r:.2f}x" for r in trl_rates) + order)


if __name__ == "__main__":
    main()
