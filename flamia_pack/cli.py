"""The ``flamia`` command line (typer + rich).

Sub-commands (each owned by the module named beside it; this file only wires them):

- ``flamia pack``       pack a dataset into row buffers           (pack.py, formats.py, loaders/)
- ``flamia plan``       work list, policy and predicted time       (scheduler/, _cli_plan.py)
- ``flamia probe-leak`` causal leak probe of an attention path     (kernels/leak.py)
- ``flamia bench``      attention benchmark on the local GPU       (benchmarks/, kernels/)
- ``flamia serve``      the FastAPI cost-prediction service        (service/)

Errors in user input are reported as one red line on stderr and a non-zero exit code
(``FlamiaError`` subclasses), never a traceback.
"""
from __future__ import annotations

import typer
import typer.core

from flamia_pack._cli_plan import (  # helpers of `flamia plan`; no heavy imports
    _plan_fmt_bytes,
    _plan_policy_note,
    _plan_read_lengths_file,
    _plan_read_packed_dir,
    _plan_rows_reason,
)


def _stdout():
    """A rich console for stdout; when stdout is not a terminal (a pipe, a file, a test runner) it is
    200 columns wide instead of rich's default 80, so tables are not cut (headers, verdicts)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200)


class _Command(typer.core.TyperCommand):
    """A command whose ``--help`` flag shows no value label (typer labels it ``<bool>``)."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt


class _Group(typer.core.TyperGroup):
    """The root group: the same ``--help`` as :class:`_Command`, and command-line errors (a bad
    number, an unknown or missing option) as one red line on stderr, exit code 2 (typer would
    print a usage panel); a bare ``flamia`` prints the help, then ``error: a command is required (...)``
    naming the commands, exit code 2."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        import sys

        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except Exception as e:  # click's ClickException / Abort (typer may vendor click: matched by shape)
            if type(e).__name__ == "Abort":
                _error_line("aborted")
                sys.exit(1)
            if not (hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)):
                raise
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `flamia`: the help, then what was missing
                text = e.format_message().strip()  # typer printed its rich help already ("" here); click's is text
                if text:
                    print(text)
                names = ", ".join(self.list_commands(ctx)) if ctx is not None else "see flamia --help"
                _error_line(f"a command is required ({names}); flamia COMMAND --help describes each")
                sys.exit(2)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            _error_line(f"{e.format_message()}{hint}")
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


def _error_line(msg: str) -> None:
    """One red ``error: ...`` line on stderr."""
    from rich.console import Console
    from rich.text import Text

    Console(stderr=True).print(Text(f"error: {' '.join(str(msg).split())}", style="bold red"), soft_wrap=True)


app = typer.Typer(
    name="flamia",
    cls=_Group,
    help="flamia_pack: packed variable-length documents for long-context training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs re-flow to the terminal width
)

# ---- pack ----------------------------------------------------------------------------------
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
    bad = summary["source"].get("invalid_utf8", {}).get("documents", 0)
    table.add_row("documents", f"{d['in']:,} in, {d['packed']:,} packed, {d['split']:,} split, "
                               f"{d['empty']:,} empty, {d['dropped']:,} dropped, {d['truncated']:,} truncated"
                               + (f", {bad:,} with invalid UTF-8 (replaced by U+FFFD)" if bad else ""))
    reasons = ", ".join(f"{k}: {v:,}" for k, v in t["dropped_reasons"].items()) or "none"
    table.add_row("tokens", f"{t['in']:,} in, {t['packed']:,} packed, {t['dropped']:,} dropped ({reasons})")
    table.add_row("rows", f"{summary['rows']:,} x {summary['capacity']:,} tokens "
                          f"({summary['algorithm']}, long docs: {summary['long_docs']})")
    table.add_row("fill", f"{100.0 * summary['fill']:.3f} %")
    sec = summary["seconds"]
    prev = summary.get("previous_output")
    if prev is not None and prev["all_reused"]:  # nothing written: a tokens/s would time only read + plan
        table.add_row("speed", f"reused (no shards written: all {summary['shards']} were already there from an "
                               f"earlier run; {sec['total']:.2f} s: read {sec['read']:.2f}, plan {sec['pack']:.2f}, "
                               f"fill + compare {sec['write']:.2f})")
    else:
        table.add_row("speed", f"{summary['tokens_per_s']:,.0f} tokens/s ({sec['total']:.2f} s: read {sec['read']:.2f}, "
                               f"plan {sec['pack']:.2f}, fill + write {sec['write']:.2f})")
    table.add_row("output", f"{summary['output']} ({summary['shards']} shard(s) + manifest.json)")
    return table


@app.command("pack", cls=_Command)
def pack_cmd(
    source: str = typer.Argument(None, metavar="SOURCE", show_default=False, help="Dataset to pack: a saved HF dataset dir, parquet/jsonl[.gz]/arrow "
                                 "file or dir, or a folder of text files. Default: the bundled sample."),
    out: str = typer.Option(..., "--out", metavar="DIR", help="Output directory (parquet shards + manifest.json)."),
    capacity: int = typer.Option(..., "--capacity", metavar="N", help="Tokens per packed row (>= 1), e.g. 65536."),
    algorithm: str = typer.Option("bfd", "--algorithm", metavar="bfd|concat|balanced", help="bfd (best-fit-decreasing, "
                                  "the default), concat (concatenate, cut at row ends) or balanced (cost-balanced: "
                                  "equalises tokens and sum len^2 across rows)."),
    text_column: str = typer.Option(None, "--text-column", metavar="NAME", help="Column to read (default: input_ids if "
                                    "present, else text); text is tokenized, integer lists are used as ids."),
    tokenizer: str = typer.Option("bytes", "--tokenizer", metavar="bytes|PATH", help="'bytes' (UTF-8 bytes, ids 0..255) or a "
                                  "path to a tokenizer.json."),
    long_docs: str = typer.Option("split", "--long-docs", metavar="split|truncate|drop", help="Documents longer than capacity: split, "
                                  "truncate or drop."),
    shard_rows: int = typer.Option(None, "--shard-rows", metavar="N", help="Packed rows per parquet shard "
                                   "(default: ~128 MiB uncompressed per shard)."),
    pad_id: int = typer.Option(0, "--pad-id", metavar="N", help="Token id (>= 0, inside the tokenizer's vocabulary) written past the last document of a row."),
    on_invalid_utf8: str = typer.Option("replace", "--on-invalid-utf8", metavar="replace|error",
                                        help="Invalid UTF-8 in text for a tokenizer.json: replace (U+FFFD, "
                                        "counted in the summary) or error (stop, naming file, row and byte)."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the summary as JSON on stdout (no table)."),
    overwrite: bool = typer.Option(False, "--overwrite", metavar="", help="Replace a pack in --out written with other "
                                   "parameters (without it, that is an error)."),
) -> None:
    """Pack documents into fixed-capacity rows and write parquet shards + manifest.json.

    Errors in the input (missing file, unknown column, non-integer or negative token ids, corrupt
    parquet, capacity < 1, pad id < 0 or outside the tokenizer's vocabulary, ...) print one red line on stderr and exit with code 2; nothing is
    presented as complete (no manifest.json is written).

    Re-running into the same --out with the same parameters resumes an interrupted run, or reuses
    every shard of a finished one. An --out holding a finished or interrupted pack written with
    other parameters (capacity, algorithm, long docs, pad id, tokenizer, input) is refused with an
    error naming them, unless --overwrite is given; --shard-rows is not such a parameter (the same
    rows, re-sharded). Files that flamia pack did not write are never replaced, even with --overwrite.

    Memory: the tokens once (int32) plus one shard of rows (--shard-rows x capacity x 8 bytes),
    not all rows. In --json, seconds.pack is the planning time and seconds.write the row filling
    plus parquet encoding and writing.
    """
    import json
    import time
    from importlib import resources

    import numpy as np
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
        from flamia_pack.pack import PackConfig, plan_packing

        if capacity < 1:
            fail(f"--capacity must be >= 1 (tokens per row), got {capacity}")
        if shard_rows is not None and shard_rows < 1:
            fail(f"--shard-rows must be >= 1, got {shard_rows}")
        if pad_id < 0:
            fail(f"--pad-id must be >= 0 (a token id), got {pad_id}")
        config = PackConfig(capacity=capacity, algorithm=algorithm, long_docs=long_docs, pad_id=pad_id)
        formats.check_output_dir(out)  # fail before reading the input, not after
        try:  # a finished earlier output here: say what happened to it (reused or replaced)
            previous = formats.read_manifest(out)
        except FlamiaError:
            previous = None
        path = source if source is not None else str(resources.files("flamia_pack") / "data" / "python-stdlib.parquet")
        t0 = time.perf_counter()
        src = open_source(path, text_column=text_column, tokenizer=tokenizer, on_invalid_utf8=on_invalid_utf8)
        vocab = src.tokenizer_info().get("vocab_size")
        if vocab is not None and pad_id >= vocab:
            fail(f"--pad-id {pad_id} is outside the tokenizer's vocabulary (ids 0..{vocab - 1}): an embedding "
                 f"lookup of the padding would index out of range; pick an id < {vocab}")
        # a pack of other parameters in --out: refused before reading the input (and again by the writer)
        formats.check_pack_params(out, formats.pack_params(
            capacity=capacity, algorithm=config.algorithm, long_docs=config.long_docs, pad_id=pad_id,
            tokenizer=src.tokenizer_info(), source=src.info()), overwrite=overwrite,
            how="pass --overwrite to replace it, or choose another --out")
        description = src.description if source is not None else (
            "bundled sample " + src.description.replace(path, "python-stdlib.parquet"))
        with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=json_out or not err.is_terminal) as bar:
            # Bounded memory: the tokens are read into one flat int32 buffer + offsets
            # (no per-document arrays), planned once on the lengths, and rows are materialised
            # one shard at a time into reused buffers by formats.write_plan -- never all rows.
            t_read = bar.add_task("reading + tokenizing", total=src.num_docs)
            tokens, doc_offsets = src.read_flat(progress=lambda n: bar.advance(t_read, n))
            n_docs = doc_offsets.shape[0] - 1
            bar.update(t_read, total=n_docs, completed=n_docs)
            t1 = time.perf_counter()
            t_pack = bar.add_task("planning", total=1)
            plan = plan_packing(np.diff(doc_offsets), config)
            bar.advance(t_pack, 1)
            t2 = time.perf_counter()
            t_write = bar.add_task("filling + writing shards", total=None)
            manifest = formats.write_plan(
                out, plan, tokens, doc_offsets, config, shard_rows=shard_rows, source=src.info(),
                tokenizer=src.tokenizer_info(), overwrite=overwrite,
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
        "nothing_packed": manifest.tokens["packed"] == 0,
    }
    if summary["nothing_packed"]:  # valid input (exit 0), but rows of padding only: say why
        d, t = manifest.documents, manifest.tokens
        if d["in"] == 0:
            why = "the source had no documents"
        elif t["in"] == 0:
            why = f"all {d['in']:,} documents were empty"
        elif t["dropped_reasons"].get("long_doc_drop", 0) == t["in"]:
            why = (f"all {d['in'] - d['empty']:,} non-empty documents were dropped (--long-docs drop, capacity "
                   f"{manifest.capacity:,}: each is longer than a row; --long-docs split or truncate keeps them)")
        else:  # pragma: no cover - split/truncate always pack something of a non-empty document
            why = f"all {t['in']:,} tokens were dropped"
        err.print(Text(f"warning: no tokens were packed: {why}", style="bold yellow"), soft_wrap=True)
    bad_utf8 = manifest.source.get("invalid_utf8", {}).get("documents", 0)
    if bad_utf8:
        err.print(Text(f"warning: {bad_utf8:,} document(s) held invalid UTF-8, decoded with U+FFFD replacement "
                       "characters (--on-invalid-utf8 error stops at the first instead)", style="bold yellow"),
                  soft_wrap=True)
    if previous is not None:
        reused = len({x.sha256 for x in previous.shards} & {x.sha256 for x in manifest.shards})
        summary["previous_output"] = {"rows": previous.rows, "capacity": previous.capacity,
                                      "shards": len(previous.shards), "shards_reused": reused,
                                      # every shard of this output was the earlier run's, none written
                                      "all_reused": {(x.file, x.sha256) for x in manifest.shards}
                                      <= {(x.file, x.sha256) for x in previous.shards}}
        if reused < len(previous.shards) or reused < len(manifest.shards):
            err.print(f"note: {out} held a finished output ({previous.rows:,} rows x {previous.capacity:,}, "
                      f"{len(previous.shards)} shard(s)); {reused} shard(s) were reused, the rest replaced")
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _stdout().print(_pack_summary_table(summary))


# ---- plan ---------------------------------------------------------------------------------
# `flamia plan`: document lengths -> scheduler.predict (work list, policy, simulated time, memory).


@app.command("plan", cls=_Command)
def plan_cmd(
    source: str = typer.Argument(None, metavar="SOURCE", show_default=False,
                                 help="Text file with one document length per line, or a packed dataset "
                                 "directory (manifest.json + parquet shards)."),
    lognormal: tuple[float, float, int] = typer.Option(None, "--lognormal", metavar="MU SIGMA TOKENS",
                                                       show_default=False,
                                                       help="Instead of SOURCE: lognormal lengths (clipped to "
                                                       "[16, 32768]) filling exactly TOKENS tokens."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed for --lognormal (numpy default_rng)."),
    heads: int = typer.Option(16, "--heads", metavar="H", help="Query heads H_q."),
    kv_heads: int = typer.Option(None, "--kv-heads", metavar="H", help="K/V heads H_kv (default: --heads; must divide it)."),
    head_dim: int = typer.Option(128, "--head-dim", metavar="D", help="Head dimension (calibrated: 64, 128)."),
    causal: bool = typer.Option(True, "--causal/--no-causal", metavar="", help="Causal or full attention per document."),
    precision: str = typer.Option("bf16", "--precision", metavar="bf16|fp8", help="Precision of the call."),
    pass_: str = typer.Option("fwd_bwd", "--pass", metavar="PASS", help="fwd, bwd or fwd_bwd (one training call)."),
    capacity: int = typer.Option(None, "--capacity", metavar="N", help="Row capacity in tokens (default: the "
                                 "manifest's, else the tokens). A lengths file or --lognormal mix longer than "
                                 "this is packed into rows and planned as one call over the packed segments."),
    long_docs: str = typer.Option("split", "--long-docs", metavar="MODE", help="When packing into rows: split, "
                                  "truncate or drop documents longer than --capacity, or error."),
    block_m: int = typer.Option(None, "--block-m", metavar="N", help="Queries per work item (power of two, "
                                "16..256; default: the calibrated kernel's, 128)."),
    block_n: int = typer.Option(None, "--block-n", metavar="N", help="Keys per cost tile (power of two >= 16; "
                                "default: the calibration entry's, 64 for bf16)."),
    merge_short: bool = typer.Option(None, "--merge-short/--no-merge-short", metavar="", show_default=False,
                                     help="Coalesce whole short documents inside one BLOCK_M window into one "
                                     "item (default: as the calibrated kernel does)."),
    policy: str = typer.Option("auto", "--policy", metavar="POLICY", help="auto (rule: causal -> dynamic; "
                               "non-causal -> dynamic iff max_len >= 4 x mean_len), static or dynamic."),
    gpu: str = typer.Option("H200", "--gpu", metavar="NAME", help="GPU of the calibration table."),
    num_sms: int = typer.Option(None, "--num-sms", metavar="N", help="SMs / persistent CTAs, >= 1 (default: the "
                                "GPU's, 132)."),
    calibration: str = typer.Option(None, "--calibration", metavar="FILE", help="Calibration JSON (default: the "
                                    "shipped one)."),
    rows_limit: int = typer.Option(None, "--rows", metavar="N", help="Packed directory: plan only the first N rows."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the plan as JSON on stdout."),
) -> None:
    """Plan an attention call: work items, policy, predicted time (static vs dynamic), memory.

    Prints documents, tokens, visible pairs, FLOPs, work items and tiles, the policy and why, the predicted time under both schedules (scheduler/simulate.py; calibration estimate unless measured) and packed vs padded-to-longest memory.

    For a packed directory every row is one call; totals are summed over rows. A lengths file or --lognormal mix longer than --capacity is packed into rows with best-fit-decreasing and planned as one call over the packed segments (the service's prediction; rows and fill are printed). Errors in the input print one red line on stderr and exit with code 2.
    """
    import json

    from rich.console import Console
    from rich.text import Text

    from flamia_pack.errors import FlamiaError

    err = Console(stderr=True)

    def fail(msg: str, code: int = 2) -> None:
        err.print(Text(f"error: {' '.join(str(msg).split())}", style="bold red"), soft_wrap=True)
        raise typer.Exit(code)

    try:
        import os

        from flamia_pack.scheduler import TileConfig, load_calibration, lognormal_lengths, predict

        use_lognormal = lognormal is not None and lognormal[0] is not None
        if use_lognormal == (source is not None):
            fail("give exactly one of SOURCE (lengths file or packed directory) and --lognormal MU SIGMA TOTAL_TOKENS")
        if rows_limit is not None and rows_limit < 1:
            fail(f"--rows must be >= 1, got {rows_limit}")
        from flamia_pack.scheduler.simulate import MAX_SMS

        if num_sms is not None and not 1 <= num_sms <= MAX_SMS:
            fail(f"--num-sms must be in [1, {MAX_SMS:,}] (SMs / persistent CTAs of one GPU), got {num_sms}")
        if seed < 0:
            fail(f"--seed must be >= 0 (numpy default_rng), got {seed}")
        if block_m is not None and not (16 <= block_m <= 256 and block_m & (block_m - 1) == 0):
            fail(f"--block-m must be a power of two in [16, 256] (16, 32, 64, 128 or 256), got {block_m}")
        if block_n is not None and not (block_n >= 16 and block_n & (block_n - 1) == 0):
            fail(f"--block-n must be a power of two >= 16 (16, 32, 64, 128, ...), got {block_n}")
        if heads < 1:
            fail(f"--heads must be >= 1 (query heads H_q), got {heads}")
        if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
            fail(f"--kv-heads must be >= 1 and divide --heads={heads} (H_q a multiple of H_kv: GQA / MQA), "
                 f"got {kv_heads}")
        from flamia_pack.scheduler.mix import LONG_DOCS

        if long_docs not in LONG_DOCS:  # checked even when nothing gets packed (the value would be ignored)
            fail(f"--long-docs must be one of {', '.join(LONG_DOCS)}, got {long_docs!r}")
        man_capacity = None
        if use_lognormal:
            mu, sigma, total = lognormal
            rows = [lognormal_lengths(mu, sigma, total, seed)]
            what = f"lognormal(mu={mu:g}, sigma={sigma:g}) filling {total:,} tokens, seed {seed}"
        elif not os.path.exists(source):
            fail(f"source not found: {source} (SOURCE is a text file with one document length per line or a "
                 "packed dataset directory)")
        elif os.path.isdir(source):
            rows, man_capacity = _plan_read_packed_dir(source, rows_limit)
            what = f"packed dataset {source} ({len(rows):,} row(s))"
        else:
            rows, _ = _plan_read_lengths_file(source)
            what = f"lengths file {source}"
        cap = capacity if capacity is not None else man_capacity
        if man_capacity is not None and cap is not None:  # rows are planned as they are, never re-packed
            fullest = max(range(len(rows)), key=lambda i: int(rows[i].sum()))
            if int(rows[fullest].sum()) > cap:
                fail(f"--capacity {cap:,} is less than a row of packed dataset {source}: row {fullest} holds "
                     f"{int(rows[fullest].sum()):,} tokens (manifest capacity {man_capacity:,}); its rows are "
                     f"planned as they are, so --capacity must be >= {int(rows[fullest].sum()):,} or left out "
                     "(the manifest's)")
        table = load_calibration(calibration)
        config = None  # the calibration entry's geometry = the work lists the kernel really builds
        if precision == "fp8" and (block_m, block_n, merge_short) != (None, None, None):
            fail("--block-m / --block-n / --merge-short do not apply to --precision fp8: each FP8 calibration "
                 "counts its kernel's own work (forward: 128 x 128 tiles; backward and training call: 128-key "
                 "tiles walking 64-row query steps, counted as 128 x 64), without merged items (leave them out)")
        if (block_m, block_n, merge_short) != (None, None, None):
            from flamia_pack.scheduler import kernel_path

            ref = table.lookup(kernel_path(precision, pass_), head_dim, gpu)
            config = TileConfig(block_m=ref.block_m if block_m is None else block_m,
                                block_n=ref.block_n if block_n is None else block_n, causal=causal,
                                merge_short=ref.merge_short if merge_short is None else merge_short)
        kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=causal, precision=precision,
                  gpu=gpu, config=config, num_sms=num_sms, pass_=pass_, policy=policy, calibration=table,
                  max_intervals=0)
        packing = None
        if man_capacity is None and cap is not None and int(rows[0].sum()) > cap:
            # longer than one row: pack into rows and plan one call over the packed segments -- the
            # service's code path (flamia_pack.service.engine.predict_mix), not a copy of it
            from flamia_pack.scheduler.mix import predict_packed_mix

            mp = predict_packed_mix(rows[0], capacity=cap, long_docs=long_docs, **kw)
            preds = [mp.prediction]
            packing = {"rows": mp.pack.rows, "capacity": cap, "fill": mp.pack.fill, "long_docs": long_docs,
                       "documents": int((mp.lengths > 0).sum()), "segments": int(mp.seqlens.size),
                       "docs_split": mp.pack.docs_split, "tokens_dropped": mp.pack.tokens_dropped}
        else:
            preds = [predict(lens, capacity=cap, **kw) for lens in rows]
    except FlamiaError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.strerror or e} ({e.filename})" if getattr(e, "filename", None) else str(e))

    p0 = preds[0]
    tot = lambda k: sum(getattr(p, k) for p in preds)  # noqa: E731
    policies = sorted({p.policy for p in preds})
    summary = {
        "source": what,
        "rows": len(preds),
        "documents": tot("docs"),
        "tokens": tot("tokens"),
        "max_len": max(p.max_len for p in preds),
        "visible_pairs": tot("pairs"),
        "flops": float(tot("flops")),
        "items": tot("items"),
        "tiles_per_head": tot("tiles"),
        "policy": policies[0] if len(policies) == 1 else "mixed",
        "reason": p0.reason if len(preds) == 1 else _plan_rows_reason(preds),
        "static_ms": tot("static_ms"),
        "dynamic_ms": tot("dynamic_ms"),
        "predicted_ms": tot("predicted_ms"),
        "memory_packed_bytes": max(p.memory_packed_bytes for p in preds),
        "memory_padded_bytes": max(p.memory_padded_bytes for p in preds),
        "settings": {
            "num_heads": p0.num_heads, "num_kv_heads": p0.num_kv_heads, "head_dim": p0.head_dim,
            "causal": p0.causal, "precision": p0.precision, "pass": p0.pass_, "capacity": cap,
            "block_m": p0.block_m, "block_n": p0.block_n, "merge_short": p0.merge_short, "gpu": p0.gpu,
            "num_sms": p0.num_sms, "kernel_path": p0.kernel_path, "a_us_per_tile": p0.a_us_per_tile,
            "b_us_per_item": p0.b_us_per_item, "c_us_per_masked_tile": p0.c_us_per_masked_tile,
            "d_us_per_doc": p0.d_us_per_doc,
            "calibration_version": p0.calibration_version,
            "calibration_measured": p0.calibration_measured,
        },
    }
    summary["policy_note"] = _plan_policy_note(summary, policy)
    summary["predicted_tflops"] = summary["flops"] / (summary["predicted_ms"] * 1e-3) / 1e12 if summary["predicted_ms"] else 0.0
    if packing is not None:  # "rows" = packed rows; one call over their segments ("documents" counts segments)
        summary["rows"] = packing["rows"]
        summary["packing"] = packing
    if json_out:
        if len(preds) > 1:
            summary["per_row"] = [p.to_dict() for p in preds]
        typer.echo(json.dumps(summary, indent=2))
        return

    from rich.table import Table

    s = summary["settings"]
    t = Table(title="flamia plan", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("source", what)
    t.add_row("call", f"{s['pass']} {s['precision']}, {'causal' if s['causal'] else 'non-causal'}, "
                      f"H_q {s['num_heads']} / H_kv {s['num_kv_heads']}, D {s['head_dim']}, "
                      f"BLOCK {s['block_m']}x{s['block_n']}{', merge_short' if s['merge_short'] else ''}, "
                      f"{s['gpu']} ({s['num_sms']} SMs)")
    per = f", total over {len(preds):,} rows (each row one call)" if len(preds) > 1 else ""
    # a packed directory holds segments: a document split across rows counts once per piece
    if packing is not None:
        t.add_row("packing", f"{packing['documents']:,} documents -> {packing['rows']:,} rows of {cap:,} tokens "
                             f"(best-fit-decreasing), fill {packing['fill']:.1%}, {packing['docs_split']:,} split, "
                             f"{packing['tokens_dropped']:,} tokens dropped; one call over the packed segments")
    t.add_row("segments (document pieces)" if what.startswith("packed dataset") or packing is not None
              else "documents", f"{summary['documents']:,} (max length {summary['max_len']:,})")
    t.add_row("tokens", f"{summary['tokens']:,}")
    t.add_row("visible pairs", f"{summary['visible_pairs']:,}")
    t.add_row("FLOPs", f"{summary['flops']:.4g}")
    t.add_row("work items", f"{summary['items']:,} ({summary['tiles_per_head']:,} key tiles per head)")
    t.add_row("policy", f"{summary['policy']}: {summary['reason']}")
    t.add_row("predicted", f"static {summary['static_ms']:.3f} ms, dynamic {summary['dynamic_ms']:.3f} ms{per} "
                           f"-> {summary['predicted_ms']:.3f} ms, {summary['predicted_tflops']:.0f} TFLOP/s"
                           + (f" ({summary['policy_note']})" if summary["policy_note"] else ""))
    pk, pd = summary["memory_packed_bytes"], summary["memory_padded_bytes"]
    ratio = f" ({pd / pk:.2f}x)" if pk else ""
    t.add_row("memory", f"packed {_plan_fmt_bytes(pk)}, padded-to-longest {_plan_fmt_bytes(pd)}{ratio}"
                        f"{' (largest row)' if len(preds) > 1 else ''}")
    c_txt = f", c={s['c_us_per_masked_tile']:.3g} us/masked tile" if s["c_us_per_masked_tile"] else ""
    c_txt += f", d={s['d_us_per_doc']:.3g} us/document" if s["d_us_per_doc"] else ""
    t.add_row("calibration", f"{s['kernel_path']} a={s['a_us_per_tile']:.3g} us/tile, b={s['b_us_per_item']:.3g} "
                             f"us/item{c_txt}, {s['calibration_version']}"
                             f"{'' if s['calibration_measured'] else ' (estimate, not measured on this kernel)'}")
    if s["precision"] == "fp8" and s["head_dim"] != 128:
        t.add_row("note", f"the GPU FP8 kernels run head_dim 128 only: varlen_attention(precision='fp8') refuses "
                          f"head_dim {s['head_dim']} on the GPU (the CPU emulation runs it); this predicts a kernel "
                          "that does not exist")
    _stdout().print(t)


# ---- probe-leak ----------------------------------------------------------------------------
# `flamia probe-leak`: kernels/leak.py on the built-in quantize->dequantize->exact-attention paths.


@app.command("probe-leak", cls=_Command)
def probe_leak_cmd(
    path: str = typer.Option("block", "--path", metavar="PATH",
                             help="Built-in attention path to probe (ignored with --all): reference, token, block, "
                                  "tensor, mx (quantize -> dequantize models) or fp8-emu-token, fp8-emu-block (the "
                                  "FP8 kernels' CPU emulation; fp8-emu-token2, fp8-emu-block2 with two-term Q and K, "
                                  "qk_terms=2; fp8-emu-token22, fp8-emu-block22 also two-term P~ and V, pv_terms=2)."),
    all_paths: bool = typer.Option(False, "--all", metavar="", help="Probe every built-in path, one column each."),
    device: str = typer.Option("cpu", "--device", metavar="cpu|cuda", help="Where to run."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print the reports as JSON on stdout (no table)."),
    cu_seqlens: str = typer.Option("0,77,300,333,512", "--cu-seqlens", metavar="0,N1,N2,..",
                                   help="Document boundaries (comma separated, start at 0)."),
    num_heads: int = typer.Option(4, "--num-heads", metavar="H", help="Query heads."),
    num_kv_heads: int = typer.Option(None, "--num-kv-heads", metavar="H_KV", help="Key/value heads (default H)."),
    head_dim: int = typer.Option(64, "--head-dim", metavar="D", help="Head dimension (the fp8-emu paths, "
                                 "like FP8 attention: 64 or 128)."),
    doc: int = typer.Option(None, "--doc", metavar="I", help="Document of the cut (default: the longest)."),
    cut: int = typer.Option(None, "--cut", metavar="C", help="Last unperturbed token (default: mid-document, "
                            "13 tokens into a 32-token group)."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of inputs and perturbations."),
    magnitude: float = typer.Option(64.0, "--magnitude", metavar="X", help="Perturbation scale (inputs are N(0, 1))."),
) -> None:
    """Causal leak probe (docs/DESIGN.md §5): is an attention path causally safe?

    Perturbs q/k/v/dO after a cut inside one document and reports how much O and dQ before the cut
    change (positive control), and whether anything outside a second perturbed document changes
    (negative control, must be 0).

    Verdicts: exact, within-group (only the cut's 32-token scale group moves), prefix-leak,
    cross-document, nondeterministic. Bad options print one red line and exit with code 2.
    """
    import json

    from rich.console import Console
    from rich.text import Text

    from flamia_pack.errors import FlamiaError

    err = Console(stderr=True)
    try:
        from flamia_pack.kernels.leak import PATHS, leak_table, probe_paths

        try:
            cu = [int(t) for t in cu_seqlens.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise FlamiaError(f"--cu-seqlens must be comma-separated integers, got {cu_seqlens!r}") from None
        if device not in ("cpu", "cuda"):
            raise FlamiaError(f"--device must be cpu or cuda, got {device!r}")
        names = list(PATHS) if all_paths else [path]
        reports = probe_paths(names, cu_seqlens=cu, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, doc=doc, cut=cut, seed=seed, device=device,
                              magnitude=magnitude)
    except FlamiaError as e:
        err.print(Text(f"error: {' '.join(str(e).split())}", style="bold red"), soft_wrap=True)
        raise typer.Exit(2)
    if json_out:
        typer.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        _stdout().print(leak_table(reports))

# ---- bench ---------------------------------------------------------------------------------
# `flamia bench`: time the BF16 packed-attention kernels on the local GPU (ours only; the peer
# comparison is benchmarks/bench_attention.py).


@app.command("bench", cls=_Command)
def bench_cmd(
    workloads: str = typer.Option("W1,W6,W7", "--workloads", metavar="W1,W2,..",
                                  help="docs/WORKLOADS.md rows (comma separated); ignored with --lengths."),
    lengths: str = typer.Option(None, "--lengths", metavar="N1,N2,..", help="Custom document lengths of one row."),
    num_heads: int = typer.Option(16, "--num-heads", metavar="H", help="Query heads (with --lengths)."),
    num_kv_heads: int = typer.Option(None, "--num-kv-heads", metavar="H_KV", help="K/V heads (with --lengths; default H)."),
    head_dim: int = typer.Option(128, "--head-dim", metavar="64|128", help="Head dimension."),
    non_causal: bool = typer.Option(False, "--non-causal", metavar="", help="Full attention inside each document."),
    rep: int = typer.Option(100, "--rep", metavar="MS", help="Milliseconds of timed runs per measurement."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print JSON on stdout (no table)."),
) -> None:
    """Time varlen_attention (forward, and forward + backward = one training call) on the local GPU.

    Inputs are fresh N(0, 1) bf16 per row; the work list is built once per row (as a training loop
    does) and its build time is reported too. Times are medians of triton.testing.do_bench (ms);
    TFLOP/s count visible pairs only (scheduler.cost.attention_flops). Needs a CUDA GPU: without
    one, prints one red line and exits with code 2.
    """
    import json

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from flamia_pack.errors import FlamiaError

    err = Console(stderr=True)
    try:
        import numpy as np
        import torch

        if not torch.cuda.is_available():
            raise FlamiaError("flamia bench needs a CUDA GPU (torch.cuda.is_available() is False)")
        try:
            import triton.testing
        except ImportError:
            raise FlamiaError("flamia bench needs triton (it ships with CUDA builds of torch)") from None
        from flamia_pack.kernels import varlen_attention
        from flamia_pack.kernels.attention import build_attention_work_list
        from flamia_pack.scheduler.cost import attention_flops
        from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

        if rep < 1:
            raise FlamiaError(f"--rep must be >= 1, got {rep}")
        rows = []
        if lengths:
            try:
                lens = np.array([int(t) for t in lengths.replace(" ", "").split(",") if t], dtype=np.int64)
            except ValueError:
                raise FlamiaError(f"--lengths must be comma-separated integers, got {lengths!r}") from None
            if lens.size == 0 or lens.min() < 1:
                raise FlamiaError("--lengths needs at least one document, every length >= 1")
            rows.append(("custom", lens, num_heads, num_kv_heads or num_heads))
        else:
            for w in [w.strip().upper() for w in workloads.split(",") if w.strip()]:
                lens = workload_lengths(w)
                rows.append((w, lens, WORKLOADS[w]["num_heads"], WORKLOADS[w]["num_kv_heads"]))
        results = []
        causal = not non_causal
        for name, lens, h, hkv in rows:
            T = int(lens.sum())
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
            q, k, v = (torch.randn((T, x, head_dim), device="cuda", dtype=torch.bfloat16) for x in (h, hkv, hkv))
            do = torch.randn_like(q)
            mx = int(lens.max())
            wl = build_attention_work_list(cu, T, causal=causal, head_dim=head_dim, max_seqlen=mx, num_kv_groups=h // hkv)

            def fwd():
                with torch.no_grad():
                    varlen_attention(q, k, v, cu, mx, causal=causal, work_list=wl)

            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def train():
                varlen_attention(*leaves, cu, mx, causal=causal, work_list=wl).backward(do)

            def build():
                build_attention_work_list(cu, T, causal=causal, head_dim=head_dim, validate=False, max_seqlen=mx,
                                          num_kv_groups=h // hkv)

            t_f = triton.testing.do_bench(fwd, rep=rep, return_mode="median")
            t_t = triton.testing.do_bench(train, rep=rep, grad_to_none=leaves, return_mode="median")
            t_w = triton.testing.do_bench(build, rep=max(10, rep // 4), return_mode="median")
            fl = attention_flops(lens, h, head_dim, causal, mode="fwd")
            results.append({"row": name, "tokens": T, "docs": int(lens.size), "num_heads": h, "num_kv_heads": hkv,
                            "fwd_ms": t_f, "fwd_tflops": fl / t_f / 1e9, "train_ms": t_t,
                            "train_tflops": 3.5 * fl / t_t / 1e9, "worklist_us": t_w * 1e3})
            torch.cuda.empty_cache()
    except FlamiaError as e:
        err.print(Text(f"error: {' '.join(str(e).split())}", style="bold red"), soft_wrap=True)
        raise typer.Exit(2)
    if json_out:
        typer.echo(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=2))
        return
    table = Table(title=f"varlen_attention bf16, D={head_dim}, {'causal' if causal else 'non-causal'}, "
                        f"{torch.cuda.get_device_name()}", title_justify="left")
    for c in ("row", "tokens", "docs", "H/H_kv", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "work list us"):
        table.add_column(c, justify="right")
    for r in results:
        table.add_row(r["row"], str(r["tokens"]), str(r["docs"]), f"{r['num_heads']}/{r['num_kv_heads']}",
                      f"{r['fwd_ms']:.3f}", f"{r['fwd_tflops']:.0f}", f"{r['train_ms']:.3f}",
                      f"{r['train_tflops']:.0f}", f"{r['worklist_us']:.0f}")
    _stdout().print(table)


# ---- serve ---------------------------------------------------------------------------------
# `flamia serve`: uvicorn + flamia_pack.service.app.create_app. FastAPI/uvicorn imported inside.


@app.command("serve", cls=_Command)
def serve_cmd(
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDR", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", metavar="N", min=0, max=65535, help="TCP port (0 = any free port)."),
    db: str = typer.Option(None, "--db", metavar="FILE", help="SQLite file of recorded runs, created if missing; its directory "
                           "must exist (default: $FLAMIA_DB_PATH or ./flamia_runs.db)."),
    calibration: str = typer.Option(None, "--calibration", metavar="FILE", help="Calibration JSON to start from (default: "
                                    "$FLAMIA_CALIBRATION_PATH or the shipped table; never written)."),
    log_level: str = typer.Option("info", "--log-level", metavar="LEVEL", help="uvicorn log level (critical, error, warning, "
                                  "info, debug)."),
) -> None:
    """Run the cost-prediction service (FastAPI): POST /v1/cost:predict, /v1/runs, the HTML page at /.

    Settings come from FLAMIA_* environment variables (see flamia_pack/service/settings.py); --db and
    --calibration override theirs. OpenAPI docs at /docs. Needs the `service` extra (fastapi, uvicorn).

    Bad settings (an invalid FLAMIA_* value, a missing, unreadable or malformed calibration JSON, a
    database path that is a directory, not a SQLite file or in a missing directory) are checked before the server starts and
    print one red line on stderr, exit code 2.
    """
    from rich.console import Console
    from rich.text import Text

    err = Console(stderr=True)

    def fail(msg: str) -> None:
        err.print(Text(f"error: {' '.join(str(msg).split())}", style="bold red"), soft_wrap=True)
        raise typer.Exit(2)

    try:
        import sqlite3

        import uvicorn
        from pydantic import ValidationError

        from flamia_pack.errors import FlamiaError
        from flamia_pack.scheduler.simulate import load_calibration
        from flamia_pack.service.app import create_app
        from flamia_pack.service.settings import Settings
        from flamia_pack.service.store import RunStore
    except ImportError as exc:
        fail(f"the service needs its extra: pip install 'flamia-pack[service]' ({exc})")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        fail(f"--log-level must be one of critical, error, warning, info, debug; got {log_level!r}")
    overrides: dict = {}
    if db is not None:
        overrides["db_path"] = db
    if calibration is not None:
        overrides["calibration_path"] = calibration
    try:
        settings = Settings(**overrides)
        # check what the lifespan will open, so bad files are one line here, not a uvicorn traceback
        if settings.calibration_path is not None and not settings.calibration_path.exists():
            fail(f"calibration file not found: {settings.calibration_path}")
        load_calibration(settings.calibration_path)
        if settings.db_path.is_dir():
            fail(f"database {settings.db_path} is a directory; --db (or FLAMIA_DB_PATH) must name a SQLite "
                 "file (created if missing)")
        if not settings.db_path.parent.is_dir():  # RunStore would create it: a typo made a directory tree
            fail(f"the directory of database {settings.db_path} does not exist ({settings.db_path.parent}); --db "
                 "(or FLAMIA_DB_PATH) must name a SQLite file in an existing directory (the file is created if missing)")
        try:
            RunStore(settings.db_path)
        except sqlite3.Error as exc:
            fail(f"cannot open the run database {settings.db_path}: {exc}; --db (or FLAMIA_DB_PATH) must name a "
                 "SQLite file (created if missing)")
        application = create_app(settings)
        uvicorn.run(application, host=host, port=port, log_level=log_level, lifespan="on")
    except ValidationError as exc:
        fail(f"invalid FLAMIA_* setting: {exc.errors()[0].get('loc')}: {exc.errors()[0].get('msg')}")
    except (FlamiaError, OSError) as exc:
        fail(str(exc))


def main() -> None:
    """Console-script entry point for ``flamia``."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
