"""The ``flamia`` command line (typer + rich).

Sub-commands (each owned by the module named beside it; this file only wires them):

- ``flamia pack``       pack a dataset into row buffers           (pack.py, formats.py, loaders/sources.py)
- ``flamia plan``       work list, policy and predicted time       (scheduler/)
- ``flamia probe-leak`` causal leak probe of an attention path     (kernels/leak.py)
- ``flamia bench``      attention benchmark on the local GPU       (benchmarks/, kernels/)
- ``flamia serve``      the FastAPI cost-prediction service        (service/)

Errors in user input are reported as one red line on stderr and a non-zero exit code
(``FlamiaError`` subclasses), never a traceback.
"""
from __future__ import annotations

import typer

app = typer.Typer(
    name="flamia",
    help="flamia_pack: packed variable-length documents for long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# ---- pack (issue: packing) -------------------------------------------------------------------
# `flamia pack`: sources (loaders/sources.py) -> pack.py -> formats.py. Heavy imports stay inside.


@app.callback()
def _flamia_root() -> None:
    """flamia_pack: packed variable-length documents for long-context training."""
    # An explicit callback keeps `flamia` a command group even while only one sub-command is
    # registered (typer would otherwise run that command directly and `flamia pack` would break).


def _pack_summary_table(summary: dict):
    from rich.table import Table

    d, t = summary["documents"], summary["tokens"]
    table = Table(title="flamia pack", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("source", summary["source_description"])
    table.add_row("documents", f"{d['in']:,} in, {d['packed']:,} packed, {d['split']:,} split, "
                               f"{d['empty']:,} empty, {d['dropped']:,} dropped, {d['truncated']:,} truncated")
    reasons = ", ".join(f"{k}: {v:,}" for k, v in t["dropped_reasons"].items()) or "none"
    table.add_row("tokens", f"{t['in']:,} in, {t['packed']:,} packed, {t['dropped']:,} dropped ({reasons})")
    table.add_row("rows", f"{summary['rows']:,} x {summary['capacity']:,} tokens "
                          f"({summary['algorithm']}, long docs: {summary['long_docs']})")
    table.add_row("fill", f"{100.0 * summary['fill']:.3f} %")
    table.add_row("speed", f"{summary['tokens_per_s']:,.0f} tokens/s ({summary['seconds']['total']:.2f} s: "
                           f"read {summary['seconds']['read']:.2f}, pack {summary['seconds']['pack']:.2f}, "
                           f"write {summary['seconds']['write']:.2f})")
    table.add_row("output", f"{summary['output']} ({summary['shards']} shard(s) + manifest.json)")
    return table


@app.command("pack")
def pack_cmd(
    source: str = typer.Argument(None, help="Dataset to pack: a saved HF dataset dir, parquet/jsonl/arrow "
                                 "file or dir, or a folder of text files. Default: the bundled sample."),
    out: str = typer.Option(..., "--out", help="Output directory (parquet shards + manifest.json)."),
    capacity: int = typer.Option(..., "--capacity", help="Tokens per packed row (>= 1), e.g. 65536."),
    algorithm: str = typer.Option("bfd", "--algorithm", help="bfd (best-fit-decreasing) or concat."),
    text_column: str = typer.Option(None, "--text-column", help="Column to read (default: input_ids if "
                                    "present, else text); text is tokenized, integer lists are used as ids."),
    tokenizer: str = typer.Option("bytes", "--tokenizer", help="'bytes' (UTF-8 bytes, ids 0..255) or a "
                                  "path to a tokenizer.json."),
    long_docs: str = typer.Option("split", "--long-docs", help="Documents longer than capacity: split, "
                                  "truncate or drop."),
    shard_rows: int = typer.Option(None, "--shard-rows", help="Packed rows per parquet shard "
                                   "(default: ~128 MiB uncompressed per shard)."),
    pad_id: int = typer.Option(0, "--pad-id", help="Token id written past the last document of a row."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout (no table)."),
) -> None:
    """Pack documents into fixed-capacity rows and write parquet shards + manifest.json.

    Errors in the input (missing file, unknown column, non-integer or negative token ids, corrupt
    parquet, capacity < 1, ...) print one red line on stderr and exit with code 2; nothing is
    presented as complete (no manifest.json is written).
    """
    import json
    import time
    from importlib import resources

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from flamia_pack.errors import FlamiaError

    err = Console(stderr=True)

    def fail(msg: str, code: int = 2) -> None:
        err.print(Text(f"error: {' '.join(str(msg).split())}", style="bold red"), soft_wrap=True)
        raise typer.Exit(code)

    try:
        from flamia_pack import formats
        from flamia_pack.loaders.sources import open_source
        from flamia_pack.pack import PackConfig, pack_documents

        if capacity < 1:
            fail(f"--capacity must be >= 1 (tokens per row), got {capacity}")
        if shard_rows is not None and shard_rows < 1:
            fail(f"--shard-rows must be >= 1, got {shard_rows}")
        config = PackConfig(capacity=capacity, algorithm=algorithm, long_docs=long_docs, pad_id=pad_id)
        path = source if source is not None else str(resources.files("flamia_pack") / "data" / "python-stdlib.parquet")
        t0 = time.perf_counter()
        src = open_source(path, text_column=text_column, tokenizer=tokenizer)
        description = src.description if source is not None else (
            "bundled sample " + src.description.replace(path, "python-stdlib.parquet"))
        with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=json_out or not err.is_terminal) as bar:
            t_read = bar.add_task("reading + tokenizing", total=src.num_docs)
            docs = []
            for batch in src.iter_batches():
                docs.extend(batch)
                bar.advance(t_read, len(batch))
            bar.update(t_read, total=len(docs), completed=len(docs))
            t1 = time.perf_counter()
            t_pack = bar.add_task("packing", total=1)
            packed = pack_documents(docs, config)
            del docs
            bar.advance(t_pack, 1)
            t2 = time.perf_counter()
            t_write = bar.add_task("writing shards", total=None)
            manifest = formats.write_packed(
                out, packed, shard_rows=shard_rows, source=src.info(), tokenizer=src.tokenizer_info(),
                algorithm=algorithm, long_docs=long_docs,
                progress=lambda done, total: bar.update(t_write, completed=done, total=total),
            )
            t3 = time.perf_counter()
    except FlamiaError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.strerror or e} ({e.filename})" if getattr(e, "filename", None) else str(e))
    except KeyboardInterrupt:
        fail("interrupted; the output directory has no manifest.json and is incomplete", code=130)

    summary = {
        "output": out,
        "source": manifest.source,
        "source_description": description,
        "tokenizer": manifest.tokenizer,
        "capacity": manifest.capacity,
        "algorithm": manifest.algorithm,
        "long_docs": manifest.long_docs,
        "pad_id": manifest.pad_id,
        "documents": manifest.documents,
        "tokens": manifest.tokens,
        "rows": manifest.rows,
        "fill": manifest.fill,
        "shards": len(manifest.shards),
        "seconds": {"read": t1 - t0, "pack": t2 - t1, "write": t3 - t2, "total": t3 - t0},
        "tokens_per_s": manifest.tokens["in"] / max(t3 - t0, 1e-9),
    }
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        Console().print(_pack_summary_table(summary))


# ---- plan (issue: work list / scheduler) -----------------------------------------------------
# (section owned by the scheduler work)

# ---- probe-leak (issue: quantizer / leak probe) ----------------------------------------------
# (section owned by the quantizer work)

# ---- bench (issue: kernels) -------------------------------------------------------------------
# (section owned by the kernel work)

# ---- serve (issue: service) -------------------------------------------------------------------
# (section owned by the service work)


def main() -> None:
    """Console-script entry point for ``flamia``."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
