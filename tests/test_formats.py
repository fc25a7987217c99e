"""Tests of flamia_pack.formats: round trip through parquet and HF datasets, manifest contents,
verify() errors, resume/rebuild after a crash (DESIGN.md §3 "Output", issue 2 item 4)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest

from flamia_pack import formats
from flamia_pack.errors import FlamiaError, FormatError, SourceError
from flamia_pack.pack import PackConfig, pack_documents

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW_KEYS = ("input_ids", "position_ids", "cu_seqlens", "doc_ids", "chunk_ids", "num_tokens")


def make_docs(seed: int, n: int = 300, capacity: int = 64) -> list[np.ndarray]:
    """Heavy-tailed random documents: empties, short ones and some longer than ``capacity``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(2.5, 1.2, size=n).astype(np.int64), 4 * capacity)
    lengths[rng.random(n) < 0.05] = 0
    return [rng.integers(0, 32_000, size=int(L)).astype(np.int32) for L in lengths]


def make_packed(seed: int = 0, capacity: int = 64, **cfg):
    return pack_documents(make_docs(seed, capacity=capacity), PackConfig(capacity=capacity, **cfg))


def assert_rows_equal(packed, rows) -> None:
    rows = list(rows)
    assert len(rows) == len(packed)
    for r, row in enumerate(rows):
        ref = packed.row(r)
        for k in ROW_KEYS:
            got = np.asarray(row[k])
            assert got.dtype == ref[k].dtype, (r, k, got.dtype)
            np.testing.assert_array_equal(got, ref[k], err_msg=f"row {r} column {k}")


def write(out, packed, **kw):
    kw.setdefault("source", {"path": "test", "format": "synthetic"})
    kw.setdefault("tokenizer", {"name": "pretokenized"})
    kw.setdefault("algorithm", "bfd")
    kw.setdefault("long_docs", "split")
    return formats.write_packed(out, packed, **kw)


# ---------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_round_trip_datasets_iter_rows_load_packed(tmp_path, algorithm):
    import datasets

    packed = make_packed(seed=1, algorithm=algorithm, pad_id=7)
    out = tmp_path / "out"
    m = write(out, packed, shard_rows=9, algorithm=algorithm)
    assert len(m.shards) == -(-len(packed) // 9) > 2

    ds = datasets.load_dataset("parquet", data_dir=str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.features == datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")), "position_ids": datasets.List(datasets.Value("int32")),
        "cu_seqlens": datasets.List(datasets.Value("int32")), "doc_ids": datasets.List(datasets.Value("int64")),
        "chunk_ids": datasets.List(datasets.Value("int32")), "num_tokens": datasets.Value("int32")})
    table = ds.with_format("arrow")[:]  # arrow keeps int32 (the numpy formatter would upcast to int64)
    assert_rows_equal(packed, ({k: table.column(k)[r].values.to_numpy() if k != "num_tokens"
                                else np.int32(table.column(k)[r].as_py()) for k in ROW_KEYS}
                               for r in range(len(ds))))

    assert_rows_equal(packed, formats.iter_rows(out, verify_checksums=True, batch_rows=4))
    back = formats.load_packed(out)
    for k in ("input_ids", "position_ids", "num_tokens", "doc_offsets", "seg_lengths", "doc_ids", "chunk_ids"):
        a, b = getattr(packed, k), getattr(back, k)
        assert a.dtype == b.dtype, k
        np.testing.assert_array_equal(a, b, err_msg=k)
    assert back.stats.to_dict() == packed.stats.to_dict() | {"fill": pytest.approx(packed.stats.fill)}


def test_iter_rows_column_subset(tmp_path):
    packed = make_packed(seed=2)
    write(tmp_path, packed, shard_rows=5)
    rows = list(formats.iter_rows(tmp_path, columns=["cu_seqlens", "num_tokens"]))
    assert all(set(r) == {"cu_seqlens", "num_tokens"} for r in rows)
    for r, row in enumerate(rows):
        np.testing.assert_array_equal(row["cu_seqlens"], packed.cu_seqlens(r))
        assert int(row["num_tokens"]) == int(packed.num_tokens[r]) == int(row["cu_seqlens"][-1])
    with pytest.raises(FormatError, match="unknown column"):
        next(formats.iter_rows(tmp_path, columns=["labels"]))


def test_manifest_contents(tmp_path):
    packed = make_packed(seed=3, long_docs="truncate")
    m = write(tmp_path, packed, shard_rows=10, long_docs="truncate", tokenizer={"name": "bytes", "vocab_size": 256})
    d = json.loads((tmp_path / "manifest.json").read_text())
    assert d == m.to_dict() and formats.read_manifest(tmp_path) == m
    st = packed.stats
    assert d["format_version"] == formats.FORMAT_VERSION
    assert (d["capacity"], d["algorithm"], d["long_docs"], d["pad_id"]) == (64, "bfd", "truncate", 0)
    assert d["tokenizer"] == {"name": "bytes", "vocab_size": 256}
    assert d["documents"] == {"in": st.docs_in, "packed": st.docs_packed, "split": st.docs_split,
                              "empty": st.docs_empty, "dropped": st.docs_dropped, "truncated": st.docs_truncated}
    assert d["tokens"]["in"] == st.tokens_in and d["tokens"]["dropped"] == st.tokens_dropped > 0
    assert d["tokens"]["dropped_reasons"] == st.dropped_reasons
    assert d["rows"] == len(packed) == sum(s["rows"] for s in d["shards"])
    assert d["fill"] == pytest.approx(packed.num_tokens.sum() / (len(packed) * 64))
    for s in d["shards"]:
        assert s["sha256"] == hashlib.sha256((tmp_path / s["file"]).read_bytes()).hexdigest()
        assert pq.ParquetFile(tmp_path / s["file"]).metadata.num_rows == s["rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([s["file"] for s in d["shards"]] + ["manifest.json"])


def test_zero_rows_gives_one_empty_loadable_shard(tmp_path):
    packed = pack_documents([np.zeros(0, np.int32)] * 3, PackConfig(capacity=16))
    m = write(tmp_path, packed)
    assert m.rows == 0 and len(m.shards) == 1 and m.documents["empty"] == 3
    assert list(formats.iter_rows(tmp_path)) == []
    assert len(formats.load_packed(tmp_path)) == 0


def test_bad_arguments(tmp_path):
    packed = make_packed(seed=4)
    with pytest.raises(FlamiaError, match="shard_rows"):
        write(tmp_path / "a", packed, shard_rows=0)
    with pytest.raises(FlamiaError, match="PackedRows"):
        formats.write_packed(tmp_path / "b", object())
    with pytest.raises(FormatError, match="JSON"):
        write(tmp_path / "c", packed, source={"path": object()})
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FormatError, match="not a directory"):
        write(f, packed)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FormatError, match="did not write"):
        write(foreign, packed)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_user_files_named_like_our_output_are_never_overwritten(tmp_path):
    """A source folder packed into itself (``flamia pack srcd --out srcd``) whose files happen to be
    named ``train-00000.parquet`` / ``manifest.json`` is refused, byte for byte untouched: files count
    as ours by their content (the ``flamia_pack`` parquet metadata, our manifest's writer), not their
    names. Our own earlier output in the same directory is still accepted (re-runs resume)."""
    import pyarrow as pa

    packed = make_packed(seed=6)
    src = tmp_path / "srcd"
    src.mkdir()
    pq.write_table(pa.table({"text": ["def f():\n    return 1\n"] * 3}), src / "train-00000.parquet")
    (src / "manifest.json").write_text('{"mine": 1}')
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for what in ("train-00000.parquet", "manifest.json"):
        only = tmp_path / f"only-{what}"
        only.mkdir()
        (only / what).write_bytes(before[what])
        with pytest.raises(FormatError, match=f"did not write \\({what}\\)"):
            formats.check_output_dir(only)
    with pytest.raises(FormatError, match="did not write"):
        write(src, packed)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    # a JSON manifest from another tool with a format_version key is not ours either
    (src / "manifest.json").write_text('{"format_version": 1, "writer": "other-tool"}')
    with pytest.raises(FormatError, match="manifest.json"):
        formats.check_output_dir(src)
    ours = tmp_path / "ours"
    write(ours, packed, shard_rows=6)
    formats.check_output_dir(ours)  # our own output: accepted
    write(ours, packed, shard_rows=6)


def test_hidden_files_are_ignored_by_the_guard_and_left_untouched(tmp_path):
    """README: hidden files / folders (``.git``, ``.gitignore``) do not make an output directory
    foreign, and writing (and re-writing with other shards) leaves them byte for byte as they were."""
    out = tmp_path / "out"
    (out / ".git" / "objects").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / ".gitignore").write_text("*.parquet\n")
    formats.check_output_dir(out)
    write(out, make_packed(seed=7), shard_rows=6)
    write(out, make_packed(seed=8), shard_rows=4)
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n" and (out / ".git" / "objects").is_dir()
    assert (out / ".gitignore").read_text() == "*.parquet\n"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".git", ".gitignore"]
    formats.verify(out)


# ---------------------------------------------------------------------------------------------
# verify() and read errors


@pytest.fixture
def written(tmp_path):
    packed = make_packed(seed=5)
    write(tmp_path, packed, shard_rows=6)
    return tmp_path, packed


def test_verify_ok(written):
    out, packed = written
    assert formats.verify(out).rows == len(packed)


def test_verify_checksum_mismatch(written):
    out, _ = written
    shard = out / "train-00001.parquet"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="checksum mismatch.*train-00001"):
        formats.verify(out)


def test_corrupt_shard_read_without_verify(written):
    """Readers that skip the checksum still fail with one FormatError, not an arrow error."""
    out, _ = written
    shard = out / "train-00001.parquet"
    raw = bytearray(shard.read_bytes())
    raw[4 : len(raw) // 2] = b"\xff" * (len(raw) // 2 - 4)  # data pages garbage, footer intact
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="train-00001.parquet"):
        list(formats.iter_rows(out))
    with pytest.raises(FormatError, match="train-00001.parquet"):
        formats.load_packed(out, verify_checksums=False)
    with pytest.raises(FormatError, match="checksum"):
        formats.load_packed(out)


def test_verify_missing_and_extra_shard(written):
    out, _ = written
    (out / "train-00002.parquet").rename(out / "train-99999.parquet")
    with pytest.raises(FormatError, match="train-00002.parquet.*missing"):
        formats.verify(out)
    with pytest.raises(FormatError, match="missing"):
        list(formats.iter_rows(out))
    (out / "train-99999.parquet").rename(out / "train-00002.parquet")
    formats.verify(out)
    (out / "train-00500.parquet").write_bytes(b"x")
    with pytest.raises(FormatError, match="not listed"):
        formats.verify(out)


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: "{ not json", "not valid JSON"),
    (lambda d: json.dumps({k: v for k, v in d.items() if k != "capacity"}), "missing key 'capacity'"),
    (lambda d: json.dumps(d | {"format_version": 99}), "format_version 99"),
    (lambda d: json.dumps(d | {"rows": d["rows"] + 1}), "add up"),
    (lambda d: json.dumps(d | {"shards": [{"file": "../x.parquet", "rows": 1, "sha256": "0" * 64, "content_key": ""}]}),
     "not a shard name"),
    (lambda d: json.dumps([1, 2]), "JSON object"),
])
def test_bad_manifest(written, mutate, needle):
    out, _ = written
    d = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(mutate(d))
    with pytest.raises(FormatError, match=needle):
        formats.verify(out)


def test_missing_manifest_means_incomplete(written):
    out, _ = written
    (out / "manifest.json").unlink()
    with pytest.raises(FormatError, match="incomplete"):
        formats.read_manifest(out)
    with pytest.raises(FormatError, match="not found"):
        formats.read_manifest(out / "nope")


# ---------------------------------------------------------------------------------------------
# re-runs: resume, rebuild, cleanup


def test_rerun_same_data_reuses_shards(written):
    out, packed = written
    before = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    m = write(out, packed, shard_rows=6)
    after = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    assert before == after  # nothing rewritten
    formats.verify(out)
    assert_rows_equal(packed, formats.iter_rows(out))
    assert m.rows == len(packed)


def test_rerun_other_data_rebuilds_and_removes_stale(written):
    out, _ = written
    for stale in (".train-00003.parquet.tmp-12345", ".manifest.json.tmp-1", "..flamia-pack-progress.json.tmp-2"):
        (out / stale).write_bytes(b"torn")  # what a crash mid-write leaves behind
    other = make_packed(seed=6, capacity=256)
    with pytest.raises(FormatError, match="other parameters"):  # another capacity: only with overwrite=True
        write(out, other, shard_rows=50)
    m = write(out, other, shard_rows=50, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([s.file for s in m.shards] + ["manifest.json"])
    formats.verify(out)
    assert_rows_equal(other, formats.iter_rows(out))


def test_finished_pack_of_other_parameters_is_not_replaced(written, tmp_path_factory):
    """A finished pack was replaced by a run of other parameters (`flamia pack` after `make demo`); each
    recorded parameter now makes it an error naming the pack's parameters, and nothing in the
    directory changes; the counts of reading (num_docs, invalid UTF-8 documents) and shard_rows are
    not parameters."""
    out, packed = written
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    cases = {
        "capacity 128": dict(packed=make_packed(seed=5, capacity=128)),
        "algorithm concat": dict(algorithm="concat"),
        "long docs drop": dict(long_docs="drop"),
        "pad id 7": dict(packed=make_packed(seed=5, pad_id=7)),
        "tokenizer tok.json": dict(tokenizer={"name": "hf", "path": "tok.json"}),
        "input other": dict(source={"path": "other", "format": "synthetic"}),
    }
    for needle, kw in cases.items():
        with pytest.raises(FormatError) as e:
            write(out, kw.pop("packed", packed), shard_rows=6, **kw)
        msg = str(e.value)
        assert msg.startswith(f"{out} holds a finished pack written with other parameters (capacity 64, "
                              "algorithm bfd, long docs split, pad id 0, tokenizer pretokenized, input test)"), msg
        assert f"this run has {needle}" in msg and "overwrite=True" in msg, msg
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(FormatError, match=r'this run has input \{"format": "synthetic", "invalid_utf8": '):
        write(out, packed, shard_rows=6, source={"path": "test", "format": "synthetic",
                                                 "invalid_utf8": {"on_invalid": "error"}})  # another policy
    # same parameters: reused; the counts of reading and another shard size are not parameters
    write(out, packed, shard_rows=6, source={"path": "test", "format": "synthetic", "num_docs": 3})
    write(out, packed, shard_rows=4)
    assert_rows_equal(packed, formats.iter_rows(out))
    src = {"path": "t", "format": "jsonl", "num_docs": None, "invalid_utf8": {"on_invalid": "replace", "documents": 0}}
    utf8 = tmp_path_factory.mktemp("utf8")
    write(utf8, packed, source=src)
    write(utf8, packed, source=dict(src, num_docs=40, invalid_utf8={"on_invalid": "replace",
                                                                                   "documents": 2}))
    assert formats.existing_pack(out)[0] == "finished"
    assert formats.existing_pack(tmp_path_factory.mktemp("empty")) is None
    assert formats.existing_pack(out / "nothing") is None


def test_partial_pack_records_and_checks_its_parameters(tmp_path):
    """An interrupted run (crash hook, no manifest) is a partial pack whose progress file records the
    run's parameters from the start: a re-run of other parameters is refused, the same one resumes; a
    progress file without parameters (an older writer) is refused too."""
    out = tmp_path / "out"
    code = _DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    env = dict(os.environ, **{formats.CRASH_ENV: "2"})
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 86, proc.stderr
    kind, params = formats.existing_pack(out)
    assert kind == "partial" and params["capacity"] == 64 and params["source"] == {"path": "test", "format": "synthetic"}
    with pytest.raises(FormatError, match=r"holds a partial pack \(an interrupted run, no manifest.json yet\) "
                                          r"written with other parameters \(capacity 64, .*this run has capacity 128"):
        write(out, make_packed(seed=7, capacity=128), shard_rows=4)
    inodes = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    packed = make_packed(seed=7)
    write(out, packed, shard_rows=4)
    assert {n: (out / n).stat().st_ino for n in inodes} == inodes  # resumed
    assert_rows_equal(packed, formats.iter_rows(out))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / formats.PROGRESS_NAME).write_text(json.dumps({"format_version": formats.FORMAT_VERSION, "shards": []}))
    with pytest.raises(FormatError, match="parameters were not recorded"):
        write(legacy, packed)
    write(legacy, packed, overwrite=True)
    formats.verify(legacy)


def test_rerun_rewrites_a_corrupted_shard(written):
    out, packed = written
    (out / "train-00000.parquet").write_bytes(b"garbage")
    write(out, packed, shard_rows=6)
    formats.verify(out)
    assert_rows_equal(packed, formats.iter_rows(out))


_DRIVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from test_formats import make_packed, write
    write(sys.argv[1], make_packed(seed=7), shard_rows=4)
    """
)


def test_crash_hook_then_resume(tmp_path):
    """FLAMIA_TEST_CRASH_AFTER_SHARDS=3 kills the writer after 3 shards; a re-run finishes it."""
    out = tmp_path / "out"
    code = _DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    env = dict(os.environ, **{formats.CRASH_ENV: "3"})
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 86, proc.stderr
    assert not (out / "manifest.json").exists()
    with pytest.raises(FormatError, match="incomplete"):
        formats.verify(out)
    progress = json.loads((out / formats.PROGRESS_NAME).read_text())
    assert [s["file"] for s in progress["shards"]] == ["train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    inodes = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    assert len(inodes) == 3

    packed = make_packed(seed=7)
    write(out, packed, shard_rows=4)
    formats.verify(out)
    assert {n: (out / n).stat().st_ino for n in inodes} == inodes  # resumed, not rewritten
    assert_rows_equal(packed, formats.iter_rows(out))
    assert not (out / formats.PROGRESS_NAME).exists()
    # the resumed output is byte-identical to a clean write
    clean = write(tmp_path / "clean", packed, shard_rows=4)
    assert [s.sha256 for s in clean.shards] == [s.sha256 for s in formats.read_manifest(out).shards]


def test_a_file_path_is_not_called_missing(written):
    """read_manifest / PackedDataset on an existing file said 'packed directory not found'."""
    out, _ = written
    shard = out / "train-00000.parquet"
    with pytest.raises(FormatError, match=r"is a file, expected a packed directory") as e:
        formats.read_manifest(shard)
    assert "not found" not in str(e.value)
    from flamia_pack.loaders.dataset import PackedDataset

    with pytest.raises(FormatError, match=r"is a file, expected a packed directory"):
        PackedDataset(shard)
    with pytest.raises(FormatError, match="packed directory not found"):
        formats.read_manifest(out / "nope")


# ---------------------------------------------------------------------------------------------
# write_plan: one shard of rows in memory at a time, same files as write_packed


def flat_docs(seed: int, capacity: int = 64) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    docs = make_docs(seed, capacity=capacity)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    return docs, np.concatenate(docs), offsets


def write_via_plan(out, seed: int, shard_rows: int, capacity: int = 64, **cfg):
    from flamia_pack.pack import plan_packing

    _, tokens, offsets = flat_docs(seed, capacity)
    config = PackConfig(capacity=capacity, **cfg)
    plan = plan_packing(np.diff(offsets), config)
    return formats.write_plan(out, plan, tokens, offsets, config, shard_rows=shard_rows,
                              source={"path": "test", "format": "synthetic"}, tokenizer={"name": "pretokenized"})


@pytest.mark.parametrize("algorithm", ["bfd", "concat", "balanced"])
def test_write_plan_byte_identical_to_write_packed(tmp_path, algorithm):
    packed = make_packed(seed=11, algorithm=algorithm, pad_id=5)
    ref = write(tmp_path / "ref", packed, shard_rows=7, algorithm=algorithm)
    got = write_via_plan(tmp_path / "plan", seed=11, shard_rows=7, algorithm=algorithm, pad_id=5)
    assert len(got.shards) > 2 and got.shards[-1].rows < 7  # a partial last shard through reused buffers
    assert [s.to_dict() for s in got.shards] == [s.to_dict() for s in ref.shards]
    strip = lambda m: {k: v for k, v in m.to_dict().items() if k != "created"}  # noqa: E731
    assert strip(got) == strip(ref) and got.algorithm == algorithm
    formats.verify(tmp_path / "plan")
    assert_rows_equal(packed, formats.iter_rows(tmp_path / "plan"))


def test_write_plan_row_memory_is_one_shard(tmp_path, monkeypatch):
    """With room for 5 rows, packing everything at once is refused but write_plan with 4-row
    shards writes all the rows (its buffers hold one shard)."""
    import flamia_pack.pack as pack_mod

    monkeypatch.setattr(pack_mod, "_available_memory_bytes", lambda: 2 * 8 * 64 * 5)
    docs, _, _ = flat_docs(3)
    with pytest.raises(FlamiaError, match="available"):
        pack_documents(docs, PackConfig(capacity=64))
    m = write_via_plan(tmp_path / "o", seed=3, shard_rows=4)
    assert m.rows > 5 and len(m.shards) == -(-m.rows // 4)
    with pytest.raises(FlamiaError, match="available"):
        write_via_plan(tmp_path / "o2", seed=3, shard_rows=6)
    assert not (tmp_path / "o2").exists()  # refused before anything was created
    monkeypatch.undo()
    assert_rows_equal(pack_documents(docs, PackConfig(capacity=64)), formats.iter_rows(tmp_path / "o"))


def test_write_plan_bad_arguments(tmp_path):
    from flamia_pack.pack import plan_packing

    _, tokens, offsets = flat_docs(2)
    cfg = PackConfig(capacity=64)
    plan = plan_packing(np.diff(offsets), cfg)
    out = tmp_path / "o"
    with pytest.raises(FlamiaError, match="PackPlan"):
        formats.write_plan(out, "plan", tokens, offsets, cfg)
    with pytest.raises(FlamiaError, match="PackConfig"):
        formats.write_plan(out, plan, tokens, offsets, {"capacity": 64})
    with pytest.raises(FlamiaError, match="capacity"):
        formats.write_plan(out, plan, tokens, offsets, PackConfig(capacity=65))
    with pytest.raises(FlamiaError, match="shape"):
        formats.write_plan(out, plan, tokens, offsets[:-1], cfg)
    with pytest.raises(FlamiaError, match="end <= len"):
        formats.write_plan(out, plan, tokens[:-1], offsets, cfg)
    other = plan_packing(np.diff(offsets)[::-1].copy(), cfg)  # same documents count, other lengths
    with pytest.raises(FlamiaError, match="does not match"):
        formats.write_plan(out, other, tokens, offsets, cfg)
    with pytest.raises(FlamiaError, match="shard_rows"):
        formats.write_plan(out, plan, tokens, offsets, cfg, shard_rows=0)
    assert not out.exists()
    bad = tokens.astype(np.int64)
    bad[int(offsets[3]) + 1] = -7
    with pytest.raises(SourceError, match="token id -7"):
        formats.write_plan(out, plan, bad, offsets, cfg, shard_rows=2)
    with pytest.raises(FormatError, match="incomplete"):
        formats.verify(out)  # never presented as complete
    empty = formats.write_plan(tmp_path / "e", plan_packing(np.zeros(3, np.int64), cfg), np.zeros(0, np.int32),
                               np.zeros(4, np.int64), cfg)
    assert empty.rows == 0 and len(empty.shards) == 1
    formats.verify(tmp_path / "e")


_PLAN_DRIVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from test_formats import write_via_plan
    write_via_plan(sys.argv[1], seed=7, shard_rows=4)
    """
)


def test_write_plan_crash_then_resume(tmp_path):
    """write_plan killed after 3 shards (test hook) leaves no manifest; a re-run keeps those 3
    shards (same inodes) and the result equals a clean write."""
    out = tmp_path / "out"
    code = _PLAN_DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    env = dict(os.environ, **{formats.CRASH_ENV: "3"})
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 86, proc.stderr
    assert not (out / "manifest.json").exists()
    inodes = {p.name: p.stat().st_ino for p in out.glob("train-*.parquet")}
    assert len(inodes) == 3
    m = write_via_plan(out, seed=7, shard_rows=4)
    formats.verify(out)
    assert {n: (out / n).stat().st_ino for n in inodes} == inodes
    clean = write_via_plan(tmp_path / "clean", seed=7, shard_rows=4)
    assert [s.sha256 for s in clean.shards] == [s.sha256 for s in m.shards]
    assert_rows_equal(make_packed(seed=7), formats.iter_rows(out))


def test_replaced_shard_is_caught_without_checksums(written):
    """A shard overwritten by another (copy train-00002 over train-00001) lost rows silently
    when reading with verify_checksums=False (regression): the footer row count is checked."""
    out, packed = written
    shards = formats.read_manifest(out).shards
    last = shards[-1]
    assert last.rows != shards[1].rows  # a short last shard
    (out / "train-00001.parquet").write_bytes((out / last.file).read_bytes())
    with pytest.raises(FormatError, match=rf"train-00001.parquet holds {last.rows} rows, manifest says {shards[1].rows}"):
        next(formats.iter_rows(out))  # before the first row, not after the good shards
    with pytest.raises(FormatError, match="train-00001.parquet holds"):
        formats.load_packed(out, verify_checksums=False)
    with pytest.raises(FormatError, match="checksum mismatch.*train-00001"):
        list(formats.iter_rows(out, verify_checksums=True))
