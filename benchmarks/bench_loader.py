"""Loader throughput on CPU: packed parquet -> training batches (issue 6; target >= 5M tokens/s).

Data: the bundled Python-stdlib sample (byte tokenizer), ``--copies`` times (documents repeated
with new indices), packed best-fit-decreasing at ``--capacity`` (default 65,536) and written with
``flamia_pack.formats.write_packed`` (zstd, ~16 MiB row groups) into a temporary directory.

Variants, all measured in this process and run (tokens = real tokens, padding excluded):

- ``PackedDataset`` rows, main process (no DataLoader), sequential and block-shuffled;
- the issue's configuration: ``DataLoader(PackedDataset, num_workers=1, batch_size=1,
  collate_fn=PackedCollator)`` (default: no scale-group metadata on the CPU; ``to_device`` derives
  it on the GPU), and with ``scale_groups="block"`` computed on the CPU in the worker; steady
  state (first batch excluded: worker start-up is reported separately) and end to end;
- ``DataLoader`` with one worker yielding raw rows (no collation: the same work as the HF peer);
- ``StreamingPackedDataset`` packing the sample source on the fly (main process);
- peers: ``flamia_pack.formats.iter_rows`` (the sequential reader of the format) and Hugging Face
  ``datasets`` (``Dataset.from_parquet`` + ``with_format("torch")`` in a ``DataLoader`` with one
  worker, rows only: int32 ``input_ids``/``position_ids`` as stored, no labels, no flattening),
  when installed. The collated batch moves 24 bytes per token (int64 input_ids, labels,
  position_ids) from the worker to the main process, the raw rows 8.

Each variant runs ``--repeat`` times; the table shows the median tokens/s and the ratio to the
``datasets`` peer. Run: ``.venv/bin/python benchmarks/bench_loader.py``.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flamia_pack.formats import iter_rows, write_packed  # noqa: E402
from flamia_pack.loaders import PackedCollator, PackedDataset, StreamingPackedDataset  # noqa: E402
from flamia_pack.loaders.sources import open_source  # noqa: E402
from flamia_pack.pack import PackConfig, pack_documents  # noqa: E402

SAMPLE = ROOT / "flamia_pack" / "data" / "python-stdlib.parquet"


def build(out: pathlib.Path, capacity: int, copies: int) -> tuple[int, int]:
    docs = list(open_source(SAMPLE)) * copies
    packed = pack_documents(docs, PackConfig(capacity=capacity))
    write_packed(out, packed, algorithm="bfd", long_docs="split")
    return len(packed), int(packed.num_tokens.sum())


Result = tuple  # (tokens, t_first or None, tokens after the first batch)


def timed(fn: Callable[[], Result]) -> dict[str, float]:
    """Run ``fn``; end-to-end and steady-state (after the first batch) tokens/s."""
    t0 = time.perf_counter()
    tokens, t_first, steady_tokens = fn()
    t1 = time.perf_counter()
    if t_first is None:
        t_first, steady_tokens = t0, tokens
    return {"s": t1 - t0, "e2e": tokens / (t1 - t0), "steady": steady_tokens / (t1 - t_first)}


def run_rows(ds) -> Result:
    n = 0
    for r in ds:
        n += int(r["num_tokens"])
    return n, None, n


def run_batches(loader, key: str) -> Result:
    n, first, t_first = 0, 0, None
    for b in loader:
        k = int(b[key].sum()) if isinstance(b[key], torch.Tensor) else int(b[key])
        if t_first is None:
            t_first, first = time.perf_counter(), k
        n += k
    return n, t_first, n - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--copies", type=int, default=2, help="repeat the sample this many times")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp) / "packed"
        t = time.perf_counter()
        rows, tokens = build(d, args.capacity, args.copies)
        print(f"packed {rows} rows x {args.capacity} ({tokens / 1e6:.2f}M tokens, fill "
              f"{tokens / rows / args.capacity:.4f}) in {time.perf_counter() - t:.1f} s")

        def loader(scale_groups):
            ds = PackedDataset(d, verify=False, shuffle=True)
            return torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, prefetch_factor=4,
                                               collate_fn=PackedCollator(scale_groups=scale_groups))

        variants: dict[str, Callable[[], tuple[int, float | None]]] = {
            "PackedDataset rows (main process, sequential)": lambda: run_rows(PackedDataset(d, verify=False)),
            "PackedDataset rows (main process, block shuffle)": lambda: run_rows(PackedDataset(d, verify=False, shuffle=True)),
            "DataLoader 1 worker, rows only (like the HF peer)": lambda: run_batches(
                torch.utils.data.DataLoader(PackedDataset(d, verify=False, shuffle=True), batch_size=None,
                                            num_workers=1, prefetch_factor=4), "num_tokens"),
            "DataLoader 1 worker + PackedCollator (default)": lambda: run_batches(loader(None), "num_real_tokens"),
            "DataLoader 1 worker + PackedCollator(scale_groups='block') (CPU scale metadata)": lambda: run_batches(
                loader("block"), "num_real_tokens"),
            "StreamingPackedDataset (packs the sample source on the fly, 1 copy)": lambda: run_rows(
                StreamingPackedDataset(SAMPLE, capacity=args.capacity, buffer_docs=256)),
            "peer: formats.iter_rows (sequential numpy rows)": lambda: run_rows(iter_rows(d)),
        }
        if importlib.util.find_spec("datasets") is not None:
            def hf():
                from datasets import Dataset

                hd = Dataset.from_parquet(sorted(str(p) for p in d.glob("train-*.parquet")))
                hd = hd.with_format("torch")
                dl = torch.utils.data.DataLoader(hd, batch_size=1, num_workers=1, shuffle=True, prefetch_factor=4)
                return run_batches(dl, "num_tokens")

            variants["peer: HF datasets from_parquet + DataLoader 1 worker"] = hf
        else:
            print("(datasets not installed: HF peer skipped)")

        results = {}
        for name, fn in variants.items():
            runs = [timed(fn) for _ in range(args.repeat)]
            results[name] = runs
        peer = results.get("peer: HF datasets from_parquet + DataLoader 1 worker")
        peer_tps = statistics.median(r["steady"] for r in peer) if peer else None

        import os

        print(f"\ncapacity {args.capacity}, {rows} rows, median of {args.repeat} runs; "
              "steady = after the first batch (worker start-up excluded); "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
        print("| variant | end-to-end s | steady M tok/s | end-to-end M tok/s | vs HF datasets |")
        print("|---|---|---|---|---|")
        for name, runs in results.items():
            tot = statistics.median(r["s"] for r in runs)
            tps = statistics.median(r["steady"] for r in runs)
            e2e = statistics.median(r["e2e"] for r in runs)
            ratio = f"{tps / peer_tps:.2f}x" if peer_tps else "-"
            print(f"| {name} | {tot:.2f} | {tps / 1e6:.1f} | {e2e / 1e6:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
