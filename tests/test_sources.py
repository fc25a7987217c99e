"""Tests of flamia_pack.loaders.sources: every input format, both column kinds, both tokenizers,
and one clear SourceError per kind of bad input (DESIGN.md §2 sources, issue 2 item 3)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import SourceError
from flamia_pack.loaders.sources import DocumentSource, open_source

TEXTS = ["hello world", "", "ünïcödé ✓ — 漢字", "the quick brown fox " * 50, "x"]


def byte_ids(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def as_lists(src: DocumentSource) -> list[list[int]]:
    out = []
    for d in src:
        assert isinstance(d, np.ndarray) and d.dtype == np.int32 and d.ndim == 1
        out.append(d.tolist())
    return out


def random_token_docs(rng: np.random.Generator, n: int = 23) -> list[list[int]]:
    return [rng.integers(0, 50_000, size=int(rng.integers(0, 40))).tolist() for _ in range(n)]


@pytest.fixture
def wordlevel_tokenizer(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny WordLevel tokenizer trained in-process (offline) and saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "the quick brown fox", "lazy dog"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------
# formats


def test_parquet_text_file_bytes_tokenizer(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), f)
    src = open_source(f)
    assert src.format == "parquet" and src.column == "text" and not src.pretokenized
    assert src.num_docs == len(TEXTS) == len(src)
    assert src.tokenizer_info() == {"name": "bytes", "vocab_size": 256}
    assert as_lists(src) == [byte_ids(t) for t in TEXTS]
    assert as_lists(src) == [byte_ids(t) for t in TEXTS]  # iterable twice


def test_parquet_directory_sorted_and_batched(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_token_docs(rng, 30)
    (tmp_path / "sub").mkdir()
    # written out of name order; reading must follow sorted paths
    pq.write_table(pa.table({"input_ids": docs[20:]}), tmp_path / "sub" / "c.parquet")
    pq.write_table(pa.table({"input_ids": docs[:7]}), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(pa.table({"input_ids": docs[7:20]}), tmp_path / "b.parquet")
    (tmp_path / "README.md").write_text("ignored next to data files")
    src = open_source(tmp_path, batch_rows=4)
    assert src.pretokenized and src.column == "input_ids" and src.num_docs == 30
    assert src.tokenizer_info()["name"] == "pretokenized"
    batches = list(src.iter_batches())
    assert all(1 <= len(b) <= 4 for b in batches)
    assert [d.tolist() for b in batches for d in b] == docs


@pytest.mark.parametrize(
    "arrow_type",
    [pa.list_(pa.int64()), pa.large_list(pa.int32()), pa.list_(pa.uint16()), pa.list_(pa.int8())],
)
def test_pretokenized_list_types(tmp_path, arrow_type):
    rng = np.random.default_rng(1)
    hi = 100 if arrow_type.value_type == pa.int8() else 60_000
    docs = [rng.integers(0, hi, size=int(rng.integers(0, 20))).tolist() for _ in range(17)]
    docs.append(None)  # a null list is an empty document
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(docs, arrow_type)}), f)
    got = as_lists(open_source(f, batch_rows=5))
    assert got == [d if d is not None else [] for d in docs]


def test_fixed_size_list_arrow_file(tmp_path):
    values = np.arange(24, dtype=np.int32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(values), 4)
    f = tmp_path / "f.arrow"
    with pa.ipc.new_file(str(f), pa.schema([("tokens", arr.type)])) as w:
        w.write_table(pa.table({"tokens": arr}))
    src = open_source(f, text_column="tokens", batch_rows=4)
    assert src.pretokenized and src.num_docs == 6
    assert as_lists(src) == [values[4 * i: 4 * i + 4].tolist() for i in range(6)]


def test_jsonl_text_and_ids_with_missing_values(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"text": "abc", "input_ids": [1, 2]}, {"text": None, "input_ids": []}, {"input_ids": [7]}, {"text": "é"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    by_ids = open_source(f)
    # streamed: the count is known once read_flat has read the file
    assert by_ids.column == "input_ids" and by_ids.num_docs is None
    assert as_lists(by_ids) == [[1, 2], [], [7], []]
    by_ids.read_flat()
    assert by_ids.num_docs == 4
    by_text = open_source(f, text_column="text")
    assert as_lists(by_text) == [byte_ids("abc"), [], [], byte_ids("é")]


def _check_read_flat(src: DocumentSource, expected: list[list[int]]) -> None:
    seen = []
    tokens, offsets = src.read_flat(progress=seen.append)
    assert tokens.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.shape == (len(expected) + 1,) and offsets[0] == 0 and sum(seen) == len(expected)
    assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(expected))] == expected
    assert offsets[-1] == tokens.shape[0] == sum(map(len, expected))
    flat = list(src.iter_flat_batches())
    assert all(ids.dtype == np.int32 and int(lens.sum()) == ids.shape[0] for ids, lens in flat)


def test_read_flat_matches_documents(tmp_path, wordlevel_tokenizer):
    """read_flat / iter_flat_batches give the same documents as iteration, on every back-end,
    with nulls (a null list whose value range is not empty included) and empty batches."""
    rng = np.random.default_rng(3)
    docs = random_token_docs(rng, 41)
    f = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": docs}), f, row_group_size=7)
    src = open_source(f, batch_rows=5)
    _check_read_flat(src, docs)
    assert as_lists(src) == docs
    # a null slot that still spans values [2, 3) must become an empty document, not leak tokens
    arr = pa.ListArray.from_arrays(pa.array([0, 2, 3, 5], pa.int32()), pa.array([1, 2, 9, 4, 5], pa.int32()),
                                   mask=pa.array([False, True, False]))
    g = tmp_path / "nulls.arrow"
    with pa.ipc.new_file(str(g), pa.schema([("input_ids", arr.type)])) as w:
        w.write_table(pa.table({"input_ids": arr}))
    expected = [[1, 2], [], [4, 5]]
    _check_read_flat(open_source(g, batch_rows=2), expected)
    assert as_lists(open_source(g)) == expected
    texts = ["abc", None, "", "δέλτα x", "the lazy dog"]
    h = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts}), h)
    _check_read_flat(open_source(h, batch_rows=2), [byte_ids(t or "") for t in texts])
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(wordlevel_tokenizer))
    _check_read_flat(open_source(h, tokenizer=wordlevel_tokenizer), [ref.encode(t or "").ids for t in texts])
    (tmp_path / "docs").mkdir()
    for name, text in (("b.txt", "second"), ("a.txt", ""), ("c.md", "é!")):
        (tmp_path / "docs" / name).write_text(text)
    _check_read_flat(open_source(tmp_path / "docs", batch_rows=2), [[], byte_ids("second"), byte_ids("é!")])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))}), empty)
    _check_read_flat(open_source(empty), [])
    # an empty JSON lines file is zero documents too (as the empty parquet file), not an error
    (tmp_path / "empty.jsonl").write_text("")
    src = open_source(tmp_path / "empty.jsonl")
    assert src.format == "jsonl" and src.num_docs == 0 and len(src) == 0
    _check_read_flat(src, [])


def test_jsonl_directory(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n{"text": "one more"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    src = open_source(tmp_path)
    assert src.format == "jsonl" and src.num_docs is None
    with pytest.raises(TypeError):
        len(src)
    assert bool(src)
    assert as_lists(src) == [byte_ids("first"), byte_ids("one more"), byte_ids("second")]


@pytest.mark.parametrize("stream", [False, True])
def test_arrow_ipc_file_and_stream(tmp_path, stream):
    table = pa.table({"text": TEXTS})
    f = tmp_path / "d.arrow"
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with opener(str(f), table.schema) as w:
        for b in table.to_batches(max_chunksize=2):
            w.write_batch(b)
    src = open_source(f)
    assert src.format == "arrow" and src.num_docs == len(TEXTS)
    assert as_lists(src) == [byte_ids(t) for t in TEXTS]


def test_hf_save_to_disk_dataset_and_dict(tmp_path):
    import datasets

    rng = np.random.default_rng(2)
    docs = random_token_docs(rng, 12)
    ds = datasets.Dataset.from_dict({"input_ids": docs, "text": [str(i) for i in range(12)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    src = open_source(tmp_path / "ds", batch_rows=5)
    assert src.format == "hf-dataset" and src.num_docs == 12
    assert as_lists(src) == docs
    # a selected/shuffled dataset keeps its order; DatasetDict -> split "train"
    sub = ds.select([5, 1, 9])
    datasets.DatasetDict({"train": sub, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    src2 = open_source(tmp_path / "dd", text_column="text")
    assert as_lists(src2) == [byte_ids("5"), byte_ids("1"), byte_ids("9")]
    # the split used is named (the summary said only "hf-dataset dd"); a plain Dataset has none
    assert (src2.split, src2.splits) == ("train", ("train", "test"))
    assert "(split 'train' of train, test; column 'text'" in src2.description
    assert src2.info()["split"] == "train" and src2.info()["splits"] == ["train", "test"]
    assert src.split is None and "split" not in src.description and "split" not in src.info()
    datasets.DatasetDict({"validation": sub}).save_to_disk(str(tmp_path / "dd1"))
    assert open_source(tmp_path / "dd1").split == "validation"
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_text_folder_one_document_per_file(tmp_path):
    files = {"b.md": "# title\n", "a.txt": "alpha", "sub/z.py": "print('z')\n", "sub/c.rst": "",
             "x.bin": "not text", ".hidden/h.txt": "skip", "sub/.h.txt": "skip"}
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    src = open_source(tmp_path)
    assert src.format == "text-files" and src.num_docs == 4
    order = ["a.txt", "b.md", "sub/c.rst", "sub/z.py"]
    assert as_lists(src) == [byte_ids(files[n]) for n in order]
    single = open_source(tmp_path / "a.txt")
    assert as_lists(single) == [byte_ids("alpha")]


def test_tokenizer_json(tmp_path, wordlevel_tokenizer):
    from tokenizers import Tokenizer

    texts = ["hello world", "the lazy fox", "", "unknown words here"]
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": [[1]] * 4, "text": texts}), f)
    src = open_source(f, tokenizer=wordlevel_tokenizer)
    # an explicit tokenizer prefers the text column over input_ids
    assert src.column == "text" and src.tokenizer_name == "tokenizer.json"
    info = src.tokenizer_info()
    assert info["path"] == str(wordlevel_tokenizer) and len(info["sha256"]) == 64
    ref = Tokenizer.from_file(str(wordlevel_tokenizer))
    assert as_lists(src) == [ref.encode(t).ids for t in texts]
    assert any(len(d) for d in as_lists(src))
    # text files go through the same tokenizer
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("dog fox")
    assert as_lists(open_source(tmp_path / "docs", tokenizer=wordlevel_tokenizer)) == [ref.encode("dog fox").ids]


def test_tokenizer_path_with_pretokenized_column_is_an_error(tmp_path, wordlevel_tokenizer):
    """A tokenizer.json given for a pre-tokenized input_ids column used to be silently ignored."""
    ids_only = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]]}), ids_only)
    with pytest.raises(SourceError, match=r"does not apply: column 'input_ids' .* is pre-tokenized"):
        open_source(ids_only, tokenizer=wordlevel_tokenizer)
    both = tmp_path / "both.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "text": ["dog", "fox"]}), both)
    with pytest.raises(SourceError, match="--text-column"):
        open_source(both, text_column="input_ids", tokenizer=wordlevel_tokenizer)
    # picking the text column uses the tokenizer; the default bytes tokenizer with ids is fine
    assert open_source(both, text_column="text", tokenizer=wordlevel_tokenizer).tokenizer_name == "tokenizer.json"
    assert as_lists(open_source(ids_only)) == [[1, 2], [3]]


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(st.one_of(st.none(), st.text(max_size=40)), max_size=30),
       batch_rows=st.integers(1, 8), large=st.booleans(), start=st.integers(0, 3))
def test_bytes_tokenizer_matches_utf8_property(tmp_path_factory, texts, batch_rows, large, start):
    """Any strings (incl. nulls, sliced arrays, large_string) -> exactly their UTF-8 bytes."""
    arr = pa.array(texts, pa.large_string() if large else pa.string())
    f = tmp_path_factory.mktemp("p") / "t.arrow"
    table = pa.table({"text": arr}).slice(min(start, len(texts)))
    with pa.ipc.new_stream(str(f), table.schema) as w:
        w.write_table(table, max_chunksize=3)
    got = as_lists(open_source(f, batch_rows=batch_rows))
    assert got == [byte_ids(t) if t is not None else [] for t in texts[min(start, len(texts)):]]


# ---------------------------------------------------------------------------------------------
# errors: one SourceError with a clear message


def _err(path, **kw) -> str:
    with pytest.raises(SourceError) as ei:
        src = open_source(path, **kw)
        for _ in src:
            pass
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    assert "not found" in _err(tmp_path / "nope.parquet")


def test_unknown_column_lists_available(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["a"], "meta": [1]}), f)
    msg = _err(f, text_column="text")
    assert "'text'" in msg and "body, meta" in msg
    msg = _err(f)  # nothing to auto-detect
    assert "input_ids" in msg and "body, meta" in msg


@pytest.mark.parametrize("values,needle", [
    (pa.array([[1.0, 2.0]], pa.list_(pa.float64())), "integer"),
    (pa.array([["a", "b"]], pa.list_(pa.string())), "integer"),
    (pa.array([3], pa.int64()), "must hold text"),
])
def test_non_integer_tokens(tmp_path, values, needle):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": values}), f)
    assert needle in _err(f, text_column="input_ids")


def test_non_integer_tokens_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1.5]}\n')
    assert "integer" in _err(f)


def test_negative_ids_name_the_document(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3], [4, -7, 5]]}), f, row_group_size=1)
    msg = _err(f, batch_rows=1)
    assert "-7" in msg and "document 2" in msg and ">= 0" in msg


def test_null_and_too_large_ids(tmp_path):
    f = tmp_path / "n.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, None]], pa.list_(pa.int64()))}), f)
    assert "null token id in document 0" in _err(f)
    g = tmp_path / "big.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[0], [2**31]], pa.list_(pa.int64()))}), g)
    assert "document 1" in _err(g) and "int32" in _err(g)


def test_corrupt_parquet(tmp_path):
    f = tmp_path / "bad.parquet"
    f.write_bytes(b"PAR1 this is not really parquet")
    assert "corrupt" in _err(f) or "cannot read" in _err(f)
    # a real file cut in half: the footer is gone
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": TEXTS * 20}), good)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "cut.parquet" in _err(cut)


def test_corrupt_parquet_data_pages(tmp_path):
    """Valid footer, garbage in the data pages: the error comes while iterating, still one line."""
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["word %d " % i * 30 for i in range(400)]}), good, compression="zstd")
    raw = bytearray(good.read_bytes())
    for i in range(8, len(raw) // 2):
        raw[i] = 0xFF
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(raw))
    assert "bad.parquet" in _err(bad)


def test_corrupt_json(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": broken\n')
    assert "JSON" in _err(f)


def test_unsupported_and_ambiguous_inputs(tmp_path):
    f = tmp_path / "d.xlsx"
    f.write_text("x")
    assert "unsupported file type" in _err(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no supported files" in _err(empty)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.table({"text": ["a"]}), mixed / "a.parquet")
    (mixed / "b.jsonl").write_text('{"text": "b"}\n')
    assert "mixes" in _err(mixed)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("a")
    assert "text files" in _err(tmp_path / "t", text_column="body")


def test_bad_tokenizer_file(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a"]}), f)
    assert "tokenizer file not found" in _err(f, tokenizer=tmp_path / "missing.json")
    bad = tmp_path / "tok.json"
    bad.write_text("{not json")
    assert "cannot load tokenizer" in _err(f, tokenizer=bad)


def test_sample_is_bundled_and_heavy_tailed():
    """The bundled sample exists, is small, has empty docs and docs longer than 65,536 bytes."""
    from importlib import resources

    path = pathlib.Path(str(resources.files("flamia_pack") / "data" / "python-stdlib.parquet"))
    assert path.stat().st_size < 3_000_000
    lengths = np.array([len(d) for d in open_source(path)])
    assert lengths.size == pq.ParquetFile(path).metadata.num_rows
    assert (lengths == 0).any() and (lengths > 65_536).any()
    assert np.percentile(lengths, 99) > 5 * np.median(lengths)


def test_partly_read_source_closes_cleanly_at_interpreter_exit(tmp_path, monkeypatch):
    """Closing a partly read source generator must not evaluate module globals: at interpreter
    exit they may already be None, which printed "Exception ignored ... TypeError: catching
    classes that do not inherit from BaseException" (regression)."""
    import gc
    import sys

    import flamia_pack.loaders.sources as sources

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(50)]}), f, row_group_size=5)
    it = open_source(f, batch_rows=5).iter_batches()
    assert [d.tolist() for d in next(it)] == [byte_ids(f"doc {i}") for i in range(5)]
    # what module teardown does to the globals the except clauses look up
    monkeypatch.setattr(sources, "SourceError", None)
    monkeypatch.setattr(sources, "pa", None)
    it.close()  # the inner generators are finalized here; before the fix they raised TypeError
    del it
    gc.collect()
    assert [repr(u.exc_value) for u in unraisable] == []


def test_token_buffer_grows_in_place_and_keeps_every_token():
    """The read_flat buffer (anonymous private mmap, grown with mremap): appends across many
    growths, including far past the first map's size, read back exactly; empty -> int32 (0,)."""
    from flamia_pack.loaders.sources import _TokenBuffer

    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 2**31 - 1, size=int(n), dtype=np.int64).astype(np.int32)
             for n in rng.integers(0, 5000, size=60)]
    parts.append(np.arange(300_000, dtype=np.int32))  # one append much larger than the map
    buf = _TokenBuffer(capacity_tokens=3)
    for p in parts:
        buf.append(p)
    got = buf.finish()
    assert got.dtype == np.int32 and got.flags.writeable
    np.testing.assert_array_equal(got, np.concatenate(parts))
    empty = _TokenBuffer().finish()
    assert empty.dtype == np.int32 and empty.shape == (0,)
