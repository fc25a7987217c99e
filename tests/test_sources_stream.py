"""JSON lines read streaming (long lines, many chunks, gzip) and invalid UTF-8 under a tokenizer.json:
``open_source`` and ``flamia pack``."""
from __future__ import annotations

import gzip
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flamia_pack import formats
from flamia_pack.cli import app
from flamia_pack.errors import SourceError
from flamia_pack.loaders import jsonl
from flamia_pack.loaders.sources import open_source


@pytest.fixture
def tok(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny WordLevel tokenizer.json trained in-process (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["abc def", "hello world"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tok.json"
    t.save(str(path))
    return path


def _docs(src) -> list[list[int]]:
    tokens, off = src.read_flat()
    return [tokens[off[i]:off[i + 1]].tolist() for i in range(off.shape[0] - 1)]


def _err(*args, **kw) -> str:
    with pytest.raises(SourceError) as e:
        _docs(open_source(*args, **kw))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------------------------------
# streaming JSON lines


@pytest.mark.parametrize("n_chars", [3_000_000, 10_000_000])
def test_long_json_line_packs(tmp_path, n_chars):
    """A line longer than pyarrow's default block (a 3 MB line used to be refused), between short lines."""
    f = tmp_path / "big.jsonl"
    text = "x" * n_chars
    f.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": text}) + "\n" + json.dumps({"text": "bc"}) + "\n")
    src = open_source(f)
    tokens, off = src.read_flat()
    assert np.diff(off).tolist() == [1, n_chars, 2] and src.num_docs == 3
    assert (tokens[1:1 + n_chars] == ord("x")).all()
    res = CliRunner().invoke(app, ["pack", str(f), "--out", str(tmp_path / "o"), "--capacity", "4096", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokens"]["packed"] == n_chars + 3


def test_lines_straddling_parser_blocks(tmp_path):
    """One chunk parsed in several blocks: lines of 0.3-0.7 MB between short ones cross block boundaries."""
    rng = np.random.default_rng(2)
    lengths = [int(rng.choice([5, 300_000, 700_000])) for _ in range(30)]
    f = tmp_path / "mixed.jsonl"
    f.write_text("".join(json.dumps({"text": "z" * n}) + "\n" for n in lengths))
    tokens, off = open_source(f).read_flat()
    assert np.diff(off).tolist() == lengths and (tokens == ord("z")).all()


def test_many_small_chunks_match_whole_file(tmp_path, monkeypatch):
    """Chunks of 64 bytes cut at line ends (lines longer than a chunk, blank lines, CRLF, no final
    newline): the same documents as a one-chunk read, and errors name the right line."""
    rng = np.random.default_rng(1)
    rows = [{"text": "w" * int(rng.integers(0, 300)), "input_ids": rng.integers(0, 9, int(rng.integers(0, 50))).tolist()}
            for _ in range(200)]
    lines = [json.dumps(r) for r in rows]
    f = tmp_path / "d.jsonl"
    f.write_bytes(("\n".join(lines[:50]) + "\n\n\r\n" + "\r\n".join(lines[50:])).encode())
    whole_ids, whole_text = _docs(open_source(f)), _docs(open_source(f, text_column="text"))
    assert whole_ids == [r["input_ids"] for r in rows]
    assert whole_text == [list(r["text"].encode()) for r in rows]
    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 64)
    assert _docs(open_source(f, batch_rows=7)) == whole_ids
    assert _docs(open_source(f, text_column="text", batch_rows=7)) == whole_text
    # a broken line deep in the file: named by its line number (blank lines counted)
    g = tmp_path / "broken.jsonl"
    g.write_text("\n".join(lines[:120]) + "\n\n" + '{"text": broken}\n' + "\n".join(lines[120:]) + "\n")
    msg = _err(g)
    assert "line 122" in msg and "broken.jsonl" in msg
    # a value of another type than on the first lines
    h = tmp_path / "typed.jsonl"
    h.write_text("\n".join(lines[:100]) + "\n" + json.dumps({"input_ids": "not ids"}) + "\n")
    msg = _err(h)
    assert "line 101" in msg and "integer token ids" in msg


def test_memory_does_not_grow_with_file(tmp_path, monkeypatch):
    """Reading holds a few chunks, not the file: the arrow pool never holds much more than a chunk
    while a file of 64 chunks is read."""
    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 1 << 16)
    f = tmp_path / "many.jsonl"
    line = json.dumps({"text": "y" * 200, "meta": {"k": list(range(20))}}) + "\n"
    f.write_text(line * ((64 << 16) // len(line)))
    peak = 0
    pool = pa.default_memory_pool()
    n = 0
    for ids, lengths in open_source(f).iter_flat_batches():
        peak = max(peak, pool.bytes_allocated())
        n += int(lengths.shape[0])
    assert n == (64 << 16) // len(line)
    assert peak < 8 * (1 << 16) + (1 << 20), peak  # a few chunks, far below the 4 MiB file


def test_gzip_jsonl_file_and_directory(tmp_path):
    rows = [{"text": "hello"}, {"text": ""}, {"text": "δ" * 1000}]
    plain = tmp_path / "a.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [list(r["text"].encode()) for r in rows]
    for name in ("b.jsonl.gz", "c.json.gz"):
        with gzip.open(tmp_path / name, "wt") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        src = open_source(tmp_path / name)
        assert src.format == "jsonl" and _docs(src) == expected
    src = open_source(tmp_path)  # a directory of .jsonl and .jsonl.gz files is one JSON lines source
    assert src.format == "jsonl" and _docs(src) == expected * 3
    # a damaged gzip stream: one line naming the file
    raw = (tmp_path / "b.jsonl.gz").read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    assert "cut.jsonl.gz" in _err(cut)
    garbage = tmp_path / "garbage.jsonl.gz"
    garbage.write_bytes(b"not gzip at all\n")
    assert "garbage.jsonl.gz" in _err(garbage)


# ---------------------------------------------------------------------------------------------
# invalid UTF-8 under a tokenizer.json


def _bad_parquet(path: pathlib.Path) -> None:
    """A parquet ``string`` column whose row 1 holds invalid UTF-8 at byte 3."""
    values = [b"abc def", b"abc\xff\xfe def", b"hello"]
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    arr = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))])
    pq.write_table(pa.table({"text": arr}), path)


def test_invalid_utf8_replace_counts_documents(tmp_path, tok):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tok))
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "abc def"}\n{"text": "abc\xff\xfe def"}\n')
    src = open_source(f, tokenizer=tok)
    assert _docs(src) == [ref.encode("abc def").ids, ref.encode("abc\ufffd\ufffd def").ids]
    assert src.invalid_utf8_docs == 1 and src.info()["invalid_utf8"] == {"on_invalid": "replace", "documents": 1}
    p = tmp_path / "bad.parquet"
    _bad_parquet(p)
    src = open_source(p, tokenizer=tok)
    assert len(_docs(src)) == 3 and src.invalid_utf8_docs == 1
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_bytes(b"abc \xc3(")
    src = open_source(tmp_path / "texts", tokenizer=tok)
    assert _docs(src) == [ref.encode("abc \ufffd(").ids] and src.invalid_utf8_docs == 1
    # the byte tokenizer decodes nothing: the bytes are the tokens, nothing counted
    src = open_source(f)
    assert _docs(src)[1] == list(b"abc\xff\xfe def") and "invalid_utf8" not in src.info()


def test_invalid_utf8_error_names_file_row_and_byte(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "abc def"}\n\n{"text": "abc\xff\xfe def"}\n')
    msg = _err(f, tokenizer=tok, on_invalid_utf8="error")
    assert "bad.jsonl, line 3" in msg and "byte offset 3" in msg and "0xff" in msg
    p = tmp_path / "bad.parquet"
    _bad_parquet(p)
    msg = _err(p, tokenizer=tok, on_invalid_utf8="error", batch_rows=1)
    assert "bad.parquet, row 1" in msg and "byte offset 3" in msg
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_bytes(b"abc \xc3(")
    assert "a.txt" in _err(tmp_path / "texts", tokenizer=tok, on_invalid_utf8="error")
    with pytest.raises(SourceError, match="on_invalid_utf8 must be one of replace, error"):
        open_source(f, on_invalid_utf8="ignore")


def test_cli_invalid_utf8(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "abc\xff\xfe def"}\n')
    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["pack", str(f), "--out", str(out), "--capacity", "64", "--tokenizer", str(tok)])
    assert res.exit_code == 0, res.output
    assert "1 with invalid UTF-8" in res.stdout and "warning: 1 document(s) held invalid UTF-8" in res.stderr
    assert formats.read_manifest(out).source["invalid_utf8"] == {"on_invalid": "replace", "documents": 1}
    res = CliRunner().invoke(app, ["pack", str(f), "--out", str(tmp_path / "o2"), "--capacity", "64",
                                   "--tokenizer", str(tok), "--on-invalid-utf8", "error"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "invalid UTF-8 in" in lines[0] and "line 1" in lines[0], res.stderr
