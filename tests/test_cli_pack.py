"""Tests of `flamia pack` (issue 2 item 5): JSON/table summary, the bundled sample, one-line
errors with exit code 2 for bad input, and crash safety under SIGKILL (DESIGN.md §3)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flamia_pack import formats
from flamia_pack.cli import app

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAMIA = [sys.executable, "-m", "flamia_pack.cli"]


def run_cli(*args: str):
    return CliRunner().invoke(app, ["pack", *args])


@pytest.fixture
def text_parquet(tmp_path) -> pathlib.Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(0, 60)))) for _ in range(80)]
    f = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), f)
    return f


def test_json_summary_matches_manifest(tmp_path, text_parquet):
    out = tmp_path / "out"
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "128", "--algorithm", "concat",
                  "--shard-rows", "7", "--pad-id", "3", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)  # stdout is JSON only
    m = formats.verify(out)
    assert summary["rows"] == m.rows > 7 and summary["shards"] == len(m.shards) > 1
    assert summary["documents"] == m.documents and summary["tokens"] == m.tokens
    assert (summary["capacity"], summary["algorithm"], summary["pad_id"]) == (128, "concat", 3)
    assert summary["fill"] == m.fill and summary["tokens_per_s"] > 0
    texts = pq.read_table(text_parquet).column("text").to_pylist()
    assert m.documents["in"] == len(texts)
    assert m.tokens["in"] == sum(len(t.encode()) for t in texts) == m.tokens["packed"]
    assert m.tokenizer == {"name": "bytes", "vocab_size": 256}
    assert m.source["path"] == str(text_parquet) and m.source["column"] == "text"


def test_table_summary(tmp_path, text_parquet):
    res = run_cli(str(text_parquet), "--out", str(tmp_path / "o"), "--capacity", "64")
    assert res.exit_code == 0, res.output
    for word in ("documents", "tokens", "rows", "fill", "tokens/s", "output", "dropped", "empty", "split"):
        assert word in res.stdout
    assert not res.stdout.lstrip().startswith("{")


def test_no_source_packs_the_bundled_sample(tmp_path):
    from importlib import resources

    res = run_cli("--out", str(tmp_path / "s"), "--capacity", "65536", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    sample = pathlib.Path(str(resources.files("flamia_pack") / "data" / "python-stdlib.parquet"))
    texts = pq.read_table(sample).column("text").to_pylist()
    assert summary["documents"]["in"] == len(texts)
    assert summary["tokens"]["packed"] == sum(len(t.encode()) for t in texts)
    assert summary["documents"]["split"] > 0 and summary["documents"]["empty"] > 0
    assert summary["fill"] > 0.95
    formats.verify(tmp_path / "s")


def test_long_docs_and_tokenizer_options(tmp_path, text_parquet):
    res = run_cli(str(text_parquet), "--out", str(tmp_path / "t"), "--capacity", "32", "--long-docs", "truncate", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["long_docs"] == "truncate" and s["documents"]["truncated"] > 0
    assert s["tokens"]["dropped"] == s["tokens"]["dropped_reasons"]["long_doc_truncate"] > 0
    assert s["tokens"]["in"] == s["tokens"]["packed"] + s["tokens"]["dropped"]


# ---------------------------------------------------------------------------------------------
# bad input: one red line, exit 2, no traceback, no manifest


def _bad_inputs(tmp_path: pathlib.Path) -> dict[str, tuple[list[str], str]]:
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1.0, 2.0]], pa.list_(pa.float64()))}), floats)
    neg = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, -4]]}), neg)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1" + os.urandom(200))
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["hello"]}), good)
    return {
        "missing file": ([str(tmp_path / "missing.parquet")], "not found"),
        "unknown column": ([str(good), "--text-column", "body"], "available columns: text"),
        "non-integer tokens": ([str(floats)], "integer"),
        "negative ids": ([str(neg)], "negative token id -4"),
        "corrupt parquet": ([str(corrupt)], "corrupt.parquet"),
        "capacity 0": ([str(good), "--capacity", "0"], "--capacity must be >= 1"),
        "capacity negative": ([str(good), "--capacity", "-5"], "--capacity must be >= 1"),
        "bad algorithm": ([str(good), "--algorithm", "first-fit"], "algorithm"),
        "bad long-docs": ([str(good), "--long-docs", "wrap"], "long_docs"),
        "shard rows 0": ([str(good), "--shard-rows", "0"], "--shard-rows"),
        "bad tokenizer": ([str(good), "--tokenizer", str(tmp_path / "tok.json")], "tokenizer file not found"),
        "tokenizer with ids": ([str(neg), "--tokenizer", str(tmp_path / "tok.json")], "is pre-tokenized"),
        # token ids are >= 0; a negative pad id was accepted and written into every row's tail
        "pad id negative": ([str(good), "--pad-id", "-1"], "--pad-id must be >= 0 (a token id), got -1"),
        # the bytes tokenizer has ids 0..255: padding 300 would index past an embedding table
        "pad id outside vocab": ([str(good), "--pad-id", "300"], "--pad-id 300 is outside the tokenizer's vocabulary"),
    }


BAD_CASES = ["missing file", "unknown column", "non-integer tokens", "negative ids", "corrupt parquet",
             "capacity 0", "capacity negative", "bad algorithm", "bad long-docs", "shard rows 0", "bad tokenizer",
             "tokenizer with ids", "pad id negative", "pad id outside vocab"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_one_line_exit_2(tmp_path, case):
    args, needle = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    if "--capacity" not in args:
        args = [*args, "--capacity", "64"]
    res = run_cli(*args, "--out", str(out))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.output and res.stdout == ""
    assert not out.exists()  # nothing written, not even an empty directory


def test_foreign_output_directory_refused_before_reading(tmp_path, text_parquet):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("do not delete")
    res = run_cli(str(tmp_path / "missing.parquet"), "--out", str(out), "--capacity", "64")
    assert res.exit_code == 2 and "did not write" in res.stderr  # reported before the missing input
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "64")
    assert res.exit_code == 2 and "thesis.tex" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_bad_input_real_process_no_traceback(tmp_path):
    args, _ = _bad_inputs(tmp_path)["negative ids"]
    proc = subprocess.run([*FLAMIA, "pack", *args, "--out", str(tmp_path / "o"), "--capacity", "8", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "document 1" in proc.stderr


# ---------------------------------------------------------------------------------------------
# crash safety: SIGKILL mid-write, re-run, complete and correct


def test_sigkill_mid_run_then_rerun(tmp_path):
    """Kill `flamia pack` (bundled sample, 263 shards) once a few shards exist; the killed output
    has no manifest and no torn shard; a re-run completes it and it equals a fresh in-process pack."""
    from flamia_pack.loaders.sources import open_source
    from flamia_pack.pack import PackConfig, pack_documents

    out = tmp_path / "out"
    args = [*FLAMIA, "pack", "--out", str(out), "--capacity", "2048", "--shard-rows", "16", "--json"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "train-00005.parquet").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists(), "killed too late: the run had already finished"
    shards = sorted(out.glob("train-*.parquet"))
    assert 6 <= len(shards) < 263
    for s in shards:  # atomic rename: every shard under its final name is complete
        assert pq.ParquetFile(s).metadata.num_rows == 16

    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    m = formats.verify(out)
    assert json.loads(rerun.stdout)["rows"] == m.rows
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # temp/progress files cleaned up

    from importlib import resources

    sample = str(resources.files("flamia_pack") / "data" / "python-stdlib.parquet")
    packed = pack_documents(list(open_source(sample)), PackConfig(capacity=2048))
    assert m.rows == len(packed)
    for r, row in enumerate(formats.iter_rows(out)):
        ref = packed.row(r)
        for k, v in ref.items():
            assert np.array_equal(row[k], v), f"row {r} {k}"


# ---------------------------------------------------------------------------------------------
# --algorithm balanced is offered and works end to end


def test_help_offers_every_algorithm():
    from flamia_pack.pack import ALGORITHMS

    res = CliRunner().invoke(app, ["pack", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    assert "bfd|concat|balanced" in res.output
    for name in ALGORITHMS:
        assert name in res.output


def test_algorithm_balanced_end_to_end(tmp_path, text_parquet):
    from flamia_pack.loaders.sources import open_source
    from flamia_pack.pack import PackConfig, pack_documents

    out = tmp_path / "bal"
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "96", "--algorithm", "balanced", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    m = formats.verify(out)
    assert s["algorithm"] == m.algorithm == "balanced"
    ref = pack_documents(list(open_source(text_parquet)), PackConfig(capacity=96, algorithm="balanced"))
    bfd = pack_documents(list(open_source(text_parquet)), PackConfig(capacity=96, algorithm="bfd"))
    assert m.rows == len(ref)
    rows = list(formats.iter_rows(out))
    for r, row in enumerate(rows):
        for k, v in ref.row(r).items():
            assert np.array_equal(row[k], v), f"row {r} {k}"
    # really the balanced layout, not bfd's: the per-row sum of len^2 differs somewhere
    cost = lambda p: sorted(int((np.diff(p.row(r)["cu_seqlens"]).astype(np.int64) ** 2).sum()) for r in range(len(p)))  # noqa: E731
    assert cost(ref) != cost(bfd)


def test_plan_on_a_packed_dir_counts_segments_not_documents(tmp_path, text_parquet):
    """`flamia plan OUT` printed the segment count (pieces of split documents) as 'documents'."""
    out = tmp_path / "p"
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "64", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["documents"]["split"] > 0  # so segments > documents
    plan = CliRunner().invoke(app, ["plan", str(out)], env={"COLUMNS": "200", "TERM": "dumb"})
    assert plan.exit_code == 0, plan.output
    line = next(ln for ln in plan.stdout.splitlines() if "segments" in ln or "documents" in ln)
    assert "segments (document pieces)" in line
    n_segs = sum(len(r["doc_ids"]) for r in formats.iter_rows(out))
    assert n_segs > s["documents"]["packed"] and f"{n_segs:,}" in line


def test_pack_holds_one_shard_of_rows_not_all(tmp_path, text_parquet, monkeypatch):
    """`flamia pack` materialises rows shard by shard: with memory for 5 rows of 64 tokens it
    still writes all of them in 4-row shards (it used to build every row at once and fail)."""
    import flamia_pack.pack as pack_mod
    from flamia_pack.loaders.sources import open_source

    docs = list(open_source(text_parquet))
    ref = pack_mod.pack_documents(docs, pack_mod.PackConfig(capacity=64))
    assert len(ref) > 10
    monkeypatch.setattr(pack_mod, "_available_memory_bytes", lambda: 2 * 8 * 64 * 5)
    with pytest.raises(pack_mod.FlamiaError, match="available"):
        pack_mod.pack_documents(docs, pack_mod.PackConfig(capacity=64))
    out = tmp_path / "o"
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "64", "--shard-rows", "4", "--json")
    assert res.exit_code == 0, res.output
    res = run_cli(str(text_parquet), "--out", str(tmp_path / "o6"), "--capacity", "64", "--shard-rows", "6")
    assert res.exit_code == 2 and "available" in res.stderr  # a shard that does not fit is refused cleanly
    m = formats.verify(out)
    assert m.rows == len(ref) and len(m.shards) == -(-len(ref) // 4)
    for r, row in enumerate(formats.iter_rows(out)):
        for k, v in ref.row(r).items():
            assert np.array_equal(row[k], v), f"row {r} {k}"


def test_rerun_says_whether_an_earlier_output_was_reused_or_replaced(tmp_path, text_parquet):
    """A re-run with the same arguments reuses every shard silently; with other parameters and
    --overwrite the finished earlier output is replaced and the CLI says so (stderr note;
    ``previous_output`` in --json)."""
    out = str(tmp_path / "out")
    first = run_cli(str(text_parquet), "--out", out, "--capacity", "128", "--shard-rows", "7", "--json")
    assert first.exit_code == 0 and "previous_output" not in json.loads(first.stdout)
    same = run_cli(str(text_parquet), "--out", out, "--capacity", "128", "--shard-rows", "7", "--json")
    prev = json.loads(same.stdout)["previous_output"]
    assert same.exit_code == 0 and "note:" not in same.stderr
    assert prev["shards_reused"] == prev["shards"] == json.loads(first.stdout)["shards"]
    other = run_cli(str(text_parquet), "--out", out, "--capacity", "64", "--shard-rows", "7", "--json", "--overwrite")
    assert other.exit_code == 0 and "held a finished output" in " ".join(other.stderr.split())
    prev = json.loads(other.stdout)["previous_output"]
    assert prev["capacity"] == 128 and prev["shards_reused"] == 0
    assert formats.verify(out).capacity == 64


def test_nothing_packed_warns_on_stderr_exit_0(tmp_path, text_parquet):
    """Packing nothing (every document dropped, an empty source) exited 0 silently; it still exits 0
    (valid input) but says why on stderr, and --json has ``nothing_packed``."""
    cases = {
        "dropped": ([str(text_parquet), "--capacity", "1", "--long-docs", "drop"],
                    "all documents were dropped (--long-docs drop, capacity 1"),
        "empty source": ([str(tmp_path / "e.jsonl"), "--capacity", "8"], "the source had no documents"),
    }
    (tmp_path / "e.jsonl").write_text("")
    for name, (args, needle) in cases.items():
        res = run_cli(*args, "--out", str(tmp_path / name), "--json")
        assert res.exit_code == 0, res.output
        s = json.loads(res.stdout)
        assert s["nothing_packed"] is True and s["tokens"]["packed"] == 0
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("warning: no tokens were packed: "), res.stderr
        if name == "dropped":
            n = s["documents"]["in"] - s["documents"]["empty"]
            needle = needle.replace("all documents", f"all {n} non-empty documents")
        assert needle in lines[0]
    res = run_cli(str(text_parquet), "--out", str(tmp_path / "ok"), "--capacity", "64", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["nothing_packed"] is False and "warning" not in res.stderr


def test_rerun_reusing_every_shard_says_reused_not_tokens_per_s(tmp_path, text_parquet):
    """A re-run with the same arguments (`make demo` twice) writes nothing: its speed row said a
    meaningless tokens/s; it says "reused" (all_reused in --json's previous_output)."""
    out = str(tmp_path / "out")
    args = [str(text_parquet), "--out", out, "--capacity", "128", "--shard-rows", "7"]
    first = run_cli(*args)
    assert first.exit_code == 0 and "tokens/s" in first.stdout and "reused" not in first.stdout
    again = run_cli(*args)
    speed = next(ln for ln in again.stdout.splitlines() if "speed" in ln)
    assert again.exit_code == 0 and "reused (no shards written" in speed and "tokens/s" not in speed
    assert json.loads(run_cli(*args, "--json").stdout)["previous_output"]["all_reused"] is True
    other = run_cli(*args[:-1], "5", "--json")  # other shard size: shards rewritten
    assert other.exit_code == 0 and json.loads(other.stdout)["previous_output"]["all_reused"] is False
    speed = next(ln for ln in run_cli(*args[:-1], "3").stdout.splitlines() if "speed" in ln)
    assert "tokens/s" in speed


def _one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_finished_pack_of_other_parameters_is_refused_not_replaced(tmp_path, text_parquet):
    """A new user's report: after `make demo` (capacity 65536), `flamia pack --out out/sample-packed
    --capacity 4096` exited 0 and replaced the finished pack. Other parameters are now one error line
    naming the pack's parameters and the ways out, before the documents are read; nothing in --out
    changes.
    The same parameters still reuse it; --overwrite replaces it."""
    out = tmp_path / "out"
    base = [str(text_parquet), "--out", str(out), "--capacity", "128"]
    assert run_cli(*base, "--shard-rows", "7").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other_input = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["x"]}), other_input)
    cases = {
        "capacity 4096": ["--capacity", "4096"],
        "algorithm concat": ["--algorithm", "concat"],
        "long docs drop": ["--long-docs", "drop"],
        "pad id 3": ["--pad-id", "3"],
        f"input {other_input}": [],
    }
    for needle, extra in cases.items():
        args = ([str(other_input), *base[1:]] if needle.startswith("input") else base) + extra
        line = _one_error_line(run_cli(*args, "--shard-rows", "7"))
        assert line.startswith(f"error: {out} holds a finished pack written with other parameters (capacity 128, "
                               f"algorithm bfd, long docs split, pad id 0, tokenizer bytes, input {text_parquet} "
                               "(column text)); this run has "), line
        assert needle in line and "pass --overwrite to replace it, or choose another --out" in line, line
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the check comes before the documents are read (the source is only opened)
    from flamia_pack.loaders.sources import DocumentSource

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DocumentSource, "read_flat", lambda *a, **k: pytest.fail("the documents were read"))
        assert "holds a finished pack" in _one_error_line(run_cli(*base, "--capacity", "4096"))
    # same parameters (also another spelling of the input's path, another --shard-rows): exit 0
    same = run_cli(str(tmp_path / "." / "in.parquet"), *base[1:], "--shard-rows", "7", "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["previous_output"]["all_reused"] is True, same.output
    assert run_cli(*base, "--shard-rows", "5").exit_code == 0
    res = run_cli(*base, "--capacity", "64", "--overwrite", "--json")
    assert res.exit_code == 0, res.output
    assert formats.verify(out).capacity == 64


def test_partial_pack_of_other_parameters_is_refused_same_resumes(tmp_path, text_parquet):
    """An interrupted `flamia pack` (crash hook: no manifest.json) is a partial pack; another --capacity
    is refused (one error line), the same parameters resume it (its shards are kept)."""
    out = tmp_path / "out"
    args = [*FLAMIA, "pack", str(text_parquet), "--out", str(out), "--capacity", "64", "--shard-rows", "4"]
    env = dict(os.environ, **{formats.CRASH_ENV: "2"})
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 86, proc.stderr
    assert not (out / "manifest.json").exists()
    inodes = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    assert len(inodes) == 2
    line = _one_error_line(run_cli(str(text_parquet), "--out", str(out), "--capacity", "128", "--shard-rows", "4"))
    assert "holds a partial pack (an interrupted run, no manifest.json yet) written with other parameters " \
           "(capacity 64," in line and "this run has capacity 128" in line, line
    assert {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")} == inodes
    res = run_cli(str(text_parquet), "--out", str(out), "--capacity", "64", "--shard-rows", "4")
    assert res.exit_code == 0, res.output
    assert {n: (out / n).stat().st_ino for n in inodes} == inodes  # resumed
    assert formats.verify(out).capacity == 64
