"""Streaming JSON-lines reader of :mod:`flamia_pack.loaders.sources` (plain or gzip-compressed).

A file is read in chunks of about :data:`CHUNK_BYTES` bytes cut at line ends: a chunk holds whole
lines only (a line longer than a chunk makes that chunk as long as the line), and each chunk is
parsed by ``pyarrow.json`` with blocks of at least twice its longest line (a line then straddles
at most one block boundary, which the parser allows), so there is no line-length limit below the
parser's 2 GiB block size. Memory is a few chunks,
whatever the file size. Files ending in ``.gz`` are decompressed on the fly (``gzip``).

Columns and types come from the first chunk of each file (``pyarrow.json`` type inference over
all its lines); every chunk is then parsed with an explicit schema holding only the chosen
column (other fields are skipped, a line without the column gives a null, i.e. an empty
document). Blank lines are skipped.

Errors (``SourceError``, one line): unreadable or corrupt file (also a damaged gzip stream), a
line that is not a JSON object, a value of the chosen column of another type than in the first
chunk -- each naming the file and the line.
"""
from __future__ import annotations

import gzip
import pathlib
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Optional

import numpy as np
import pyarrow as pa

from flamia_pack.errors import SourceError
from flamia_pack.loaders.tokenizers import _one_line

__all__ = ["JSONL_SUFFIXES", "CHUNK_BYTES", "is_jsonl_path", "json_schema", "json_arrays", "read_type"]

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
#: bytes read per chunk (rounded to whole lines).
CHUNK_BYTES = 1 << 24
_MAX_BLOCK = 2**31 - 1  # pyarrow.json's block size is an int32
_ROW_RE = re.compile(r"\bin row (\d+)")


def is_jsonl_path(p: pathlib.Path) -> bool:
    """``*.jsonl`` / ``*.ndjson`` / ``*.json``, optionally followed by ``.gz``."""
    s = [x.lower() for x in p.suffixes]
    if s and s[-1] == ".gz":
        s = s[:-1]
    return bool(s) and s[-1] in JSONL_SUFFIXES


def _open(path: pathlib.Path):
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


def _chunks(path: pathlib.Path, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """``(chunk, first_line)``: whole lines of ``path`` (1-based number of the chunk's first line)."""
    line = 1
    with _open(path) as f:
        parts: list = []  # the incomplete last line so far
        while True:
            data = f.read(chunk_bytes)
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                parts.append(data)
                continue
            view = memoryview(data)
            parts.append(view[: cut + 1])
            chunk = b"".join(parts)
            parts = [view[cut + 1 :]] if cut + 1 < len(data) else []
            if chunk.strip():
                yield chunk, line
            line += chunk.count(b"\n")
        tail = b"".join(parts)
        if tail.strip():
            yield tail, line


def _line_of_row(chunk: bytes, first_line: int, row: int) -> int:
    """File line number of the ``row``-th non-blank line of ``chunk`` (pyarrow skips blank lines)."""
    k = -1
    for i, text in enumerate(chunk.split(b"\n")):
        if text.strip():
            k += 1
            if k == row:
                return first_line + i
    return first_line


def _block_size(chunk: bytes) -> int:
    """A parser block size for ``chunk``: 1 MiB blocks (parsed in parallel) unless a line is longer;
    a line may straddle one block boundary, never two, so a block must hold the longest line."""
    ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
    longest = int(max(np.diff(ends).max(initial=0), ends[0] + 1 if ends.size else 0, len(chunk) - 1 - (ends[-1] if ends.size else -1)))
    return min(max(1 << 20, 2 * longest + 2), max(len(chunk), 1))


def _parse(chunk: bytes, first_line: int, path: pathlib.Path, schema: Optional[pa.Schema],
           expected: str = "") -> pa.Table:
    import pyarrow.json as pj

    if len(chunk) > _MAX_BLOCK:
        raise SourceError(f"cannot parse JSON lines file {path}: line {first_line} is {len(chunk):,} bytes long; "
                          f"a line may hold at most {_MAX_BLOCK:,} bytes")
    ropts = pj.ReadOptions(block_size=_block_size(chunk))
    popts = (pj.ParseOptions() if schema is None
             else pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
    try:
        return pj.read_json(pa.BufferReader(chunk), read_options=ropts, parse_options=popts)
    except (pa.ArrowException, OSError) as e:
        m = _ROW_RE.search(str(e))
        last = first_line + chunk.count(b"\n")
        where = f", line {_line_of_row(chunk, first_line, int(m.group(1)))}" if m else f", lines {first_line}-{last}"
        if not expected:
            expected = ("a field must hold values of one JSON type on every line" if "changed from" in str(e)
                        else "expected one JSON object per line")
        raise SourceError(f"cannot parse JSON lines file {path}{where}: {_one_line(e)} ({expected})") from None


def _reading(path: pathlib.Path, chunks: Iterator[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
    """``chunks`` with read/decompression errors re-raised as ``SourceError``."""
    try:
        yield from chunks
    except GeneratorExit:
        raise
    except (OSError, EOFError, zlib.error) as e:
        kind = "gzip-compressed JSON lines file" if path.suffix.lower() == ".gz" else "JSON lines file"
        raise SourceError(f"cannot read {kind} {path}: {_one_line(e)} (corrupt or truncated)") from None


def json_schema(path: pathlib.Path, chunk_bytes: Optional[int] = None) -> Optional[pa.Schema]:
    """Columns and inferred types of ``path`` from its first chunk; None when it has no lines."""
    for chunk, line in _reading(path, _chunks(path, chunk_bytes or CHUNK_BYTES)):
        return _parse(chunk, line, path, None).schema
    return None


def read_type(t: pa.DataType) -> pa.DataType:
    """The type to parse a column as, from its first chunk's inferred type: all-null values read as
    text, all-empty lists as integer lists (the first chunk had nothing to infer from)."""
    if pa.types.is_null(t):
        return pa.string()
    if pa.types.is_list(t) and pa.types.is_null(t.value_type):
        return pa.list_(pa.int64())
    return t


def json_arrays(
    files: list[pathlib.Path], column: str, value_type: pa.DataType, batch_rows: int,
    chunk_bytes: Optional[int] = None,
) -> Iterator[tuple[pa.Array, Callable[[int], str]]]:
    """Yield ``(array, locate)``: slices of at most ``batch_rows`` values of ``column``, in file order,
    with ``locate(i)`` naming the file and line of value ``i`` of the slice (for error messages).

    ``value_type`` is the column's type in the first file; each file's own first chunk must hold
    the column.
    """
    rtype = read_type(value_type)
    schema = pa.schema([pa.field(column, rtype)])
    expected = (f"column {column!r} must hold "
                + ("lists of integer token ids" if pa.types.is_list(rtype) else "text (a JSON string)")
                + " on every line, as on the first lines")
    for f in files:
        names = None
        for chunk, line in _reading(f, _chunks(f, chunk_bytes or CHUNK_BYTES)):
            if names is None:
                names = _parse(chunk, line, f, None).schema.names
                if column not in names:
                    raise SourceError(f"column {column!r} not found in {f}; available columns: {', '.join(names)}")
            col = _parse(chunk, line, f, schema, expected).column(0)

            def locate(i: int, base: int = 0, chunk: bytes = chunk, line: int = line, f: pathlib.Path = f) -> str:
                return f"{f}, line {_line_of_row(chunk, line, base + i)}"

            for s in range(0, len(col), batch_rows):
                part = col.slice(s, batch_rows)
                arr = part.combine_chunks() if part.num_chunks != 1 else part.chunk(0)
                yield arr, (lambda i, s=s, locate=locate: locate(i, s))
