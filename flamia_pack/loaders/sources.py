"""Document sources: read token-id sequences from local datasets.

``open_source(path)`` looks at a local path and returns a :class:`DocumentSource`, an iterable of
documents, each a 1-D ``np.ndarray`` of dtype ``int32`` holding token ids ``>= 0``. Nothing is ever
fetched from a hub: only local files are read, and ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are
set in-process before ``datasets`` is used.

Supported inputs (``path`` may be a file or a directory):

========================  ===================================================================
input                     how it is recognised / read
========================  ===================================================================
HF ``datasets`` folder    a directory with ``dataset_info.json``/``state.json`` (a ``Dataset``)
                          or ``dataset_dict.json`` (a ``DatasetDict``: split ``train``, or the
                          only split), as written by ``save_to_disk``; ``datasets.load_from_disk``
parquet                   ``*.parquet`` / ``*.pq`` file, or a directory holding such files
                          (recursively, sorted paths); ``pyarrow.parquet`` in record batches
JSON lines                ``*.jsonl`` / ``*.ndjson`` / ``*.json`` (one object per line), also
                          gzip-compressed (``*.jsonl.gz``, ...), file or directory; streamed in
                          chunks of whole lines, each parsed by ``pyarrow.json``
                          (:mod:`flamia_pack.loaders.jsonl`: no line-length limit below 2 GiB)
arrow                     ``*.arrow`` / ``*.feather`` / ``*.ipc`` (IPC file or stream format,
                          memory-mapped), file or directory
text files                one document per file: a single text file, or a directory of
                          ``TEXT_SUFFIXES`` files (recursively, sorted paths, hidden paths skipped)
========================  ===================================================================

A directory holding data files of more than one kind (e.g. parquet and jsonl) is refused as
ambiguous; text files next to data files (a README.md) are ignored.

Column choice (``text_column``):

* ``None`` (default): ``input_ids`` if present (pre-tokenized), else ``text``. When a
  ``tokenizer.json`` path is given, ``text`` is preferred over ``input_ids``.
* a name: that column. A string/binary column is tokenized; a column of integer lists is used as
  pre-tokenized ids.

Tokenizers (``tokenizer``):

* ``"bytes"`` (default): the built-in byte-level tokenizer, one token per UTF-8 byte, ids 0..255.
  Vectorised over a whole arrow batch (no per-document Python work besides the final split).
* a path to an HF ``tokenizers`` ``tokenizer.json``: ``Tokenizer.from_file``, batch-encoded
  (``encode_batch_fast``) with the tokenizer's own special-token post-processing
  (``add_special_tokens=True``). Values (string or binary columns, text files) are decoded as
  UTF-8 first; invalid UTF-8 follows ``on_invalid_utf8``: ``"replace"`` (default: U+FFFD
  replacement characters, and the document is counted in ``invalid_utf8_docs`` and the
  manifest's ``source.invalid_utf8``) or ``"error"`` (``SourceError`` naming file, row and byte
  offset). A path together with a pre-tokenized column (chosen by ``text_column`` or because
  there is no ``text`` column) raises ``SourceError``: the ids would be used as they are and the
  tokenizer silently ignored.

The tokenizers live in :mod:`flamia_pack.loaders.tokenizers` (re-exported here).

Null values (a null text or a null id list) become empty documents, which packing counts and skips.

Reading without per-document arrays: :meth:`DocumentSource.iter_flat_batches` yields each batch as
one int32 token buffer + int64 lengths, and :meth:`DocumentSource.read_flat` returns the whole input
as ``(tokens, doc_offsets)`` (Arrow ``ListArray`` layout) for ``plan_packing`` + ``fill_rows``.

Errors: every problem with the input raises :class:`~flamia_pack.errors.SourceError` with one line
saying what was wrong: missing path, unsupported or ambiguous input, unknown column (the available
columns are listed), a column that holds neither text nor integer lists, non-integer or null token
ids, negative ids or ids above the int32 range (with the document index), a corrupt
parquet/json/gzip/arrow file, an unreadable tokenizer file, invalid UTF-8 under
``on_invalid_utf8="error"``. Errors found while iterating (a corrupt
row group in the middle of a file) are raised from the iterator, also as ``SourceError``.
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from flamia_pack.errors import SourceError
from flamia_pack.loaders.jsonl import JSONL_SUFFIXES, is_jsonl_path, json_arrays, json_schema, read_type  # noqa: F401
from flamia_pack.loaders.tokenizers import (
    ON_INVALID_UTF8,
    ByteTokenizer,
    HFTokenizer,
    _drop_nulls,
    _one_line,
    _split_flat,
    check_on_invalid_utf8,
    decode_utf8,
    invalid_utf8_message,
    load_tokenizer,
)

__all__ = [
    "DocumentSource",
    "ByteTokenizer",
    "HFTokenizer",
    "open_source",
    "load_tokenizer",
    "TEXT_SUFFIXES",
    "DEFAULT_BATCH_ROWS",
    "ON_INVALID_UTF8",
]

#: documents per batch handed out by :meth:`DocumentSource.iter_batches` (and read per arrow batch).
DEFAULT_BATCH_ROWS = 1024

PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
ARROW_SUFFIXES = frozenset({".arrow", ".feather", ".ipc"})
#: suffixes read as one document per file (a single file, or a folder of text files).
TEXT_SUFFIXES = frozenset(
    {
        ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc",
        ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".html", ".htm",
        ".css", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".xml", ".csv", ".tsv",
    }
)

_INT32_MAX = np.iinfo(np.int32).max


# ---------------------------------------------------------------------------------------------
# arrow array -> flat int32 documents


def _as_array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _is_text_type(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _token_lists_flat(arr: pa.Array, column: str, doc_base: int) -> tuple[np.ndarray, np.ndarray]:
    """A list<integer> array as one validated int32 buffer + int64 lengths (null lists: 0)."""
    t = arr.type
    if not pa.types.is_integer(t.value_type):
        raise SourceError(
            f"column {column!r} must hold integer token ids, got {t} (non-integer tokens); "
            "store ids as lists of integers or point --text-column at a text column"
        )
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        offsets = (np.arange(n + 1, dtype=np.int64) + arr.offset) * size
    else:
        offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    vals = arr.values.slice(start, end - start)
    if vals.null_count:
        pos = int(np.flatnonzero(~np.asarray(vals.is_valid().to_numpy(zero_copy_only=False), bool))[0])
        doc = int(np.searchsorted(offsets, start + pos, side="right") - 1)
        raise SourceError(f"null token id in document {doc_base + doc} of column {column!r}; token ids must be integers >= 0")
    v = vals.to_numpy(zero_copy_only=False)
    if v.size:
        if v.dtype.kind == "i":
            mn = int(v.min())
            if mn < 0:
                pos = int(np.argmax(v < 0))
                doc = int(np.searchsorted(offsets, start + pos, side="right") - 1)
                raise SourceError(
                    f"negative token id {int(v[pos])} in document {doc_base + doc} of column {column!r}; "
                    "token ids must be >= 0"
                )
        mx = int(v.max())
        if mx > _INT32_MAX:
            pos = int(np.argmax(v > _INT32_MAX))
            doc = int(np.searchsorted(offsets, start + pos, side="right") - 1)
            raise SourceError(
                f"token id {mx} in document {doc_base + doc} of column {column!r} does not fit int32 "
                f"(ids must be <= {_INT32_MAX})"
            )
    ids = v.astype(np.int32, copy=False)
    return _drop_nulls(arr, ids, offsets)


class _TokenBuffer:
    """Append-only int32 buffer on an anonymous ``mmap`` that grows in place (``mremap`` on
    Linux), so reading ``T`` tokens peaks at about ``4 T`` bytes plus one batch -- not the ``8 T``
    of collecting batches and concatenating them. Where the map cannot be resized in place it is
    copied into a larger one (the same cost as concatenation)."""

    def __init__(self, capacity_tokens: int = 1 << 22):
        import mmap

        self._mmap = mmap
        self._m = self._new_map(4 * capacity_tokens)
        self.n = 0

    def _new_map(self, nbytes: int):
        # MAP_PRIVATE: a shared anonymous map (Python's default) is a fixed-size shmem object, and
        # touching pages past its original size after mremap raises SIGBUS
        flags = getattr(self._mmap, "MAP_PRIVATE", None)
        return self._mmap.mmap(-1, nbytes) if flags is None else self._mmap.mmap(-1, nbytes, flags=flags)

    def _grow(self, nbytes: int) -> None:
        try:
            self._m.resize(nbytes)
        except (OSError, SystemError, ValueError, BufferError):  # no mremap (e.g. macOS)
            m2 = self._new_map(nbytes)
            np.frombuffer(m2, np.uint8, count=4 * self.n)[:] = np.frombuffer(self._m, np.uint8, count=4 * self.n)
            self._m.close()
            self._m = m2

    def append(self, ids: np.ndarray) -> None:
        k = int(ids.shape[0])
        if k == 0:
            return
        need = 4 * (self.n + k)
        if need > len(self._m):
            self._grow(max(2 * len(self._m), need))
        np.frombuffer(self._m, np.int32, count=k, offset=4 * self.n)[:] = ids
        self.n += k

    def finish(self) -> np.ndarray:
        """The tokens as a writeable int32 array ``(n,)`` backed by the map (trimmed to size)."""
        if self.n == 0:
            self._m.close()
            return np.zeros(0, np.int32)
        if len(self._m) > 4 * self.n:
            try:
                self._m.resize(4 * self.n)
            except (OSError, SystemError, ValueError, BufferError):
                pass  # keep the larger map; the untouched tail is not resident
        return np.frombuffer(self._m, np.int32, count=self.n)


# ---------------------------------------------------------------------------------------------
# the source object


class DocumentSource:
    """An iterable of documents (1-D ``int32`` numpy arrays of token ids >= 0) from one local input.

    Attributes:
        path: the input path as given (str).
        format: ``"hf-dataset"``, ``"parquet"``, ``"jsonl"``, ``"arrow"`` or ``"text-files"``.
        column: the column read (``"text"`` for text files).
        pretokenized: True when ``column`` holds integer ids (no tokenizer applied).
        tokenizer: the :class:`ByteTokenizer`/:class:`HFTokenizer` used, or None when pretokenized.
        num_docs: number of documents when known without parsing the data (parquet metadata, arrow
            batch headers, HF datasets, text files), else None (JSON lines, which are streamed)
            until :meth:`read_flat` has read the whole input. ``len(source)`` returns it and
            raises ``TypeError`` when it is None.
        batch_rows: documents per batch of :meth:`iter_batches` (arrow inputs may give a batch
            of fewer rows at file/record-batch boundaries).
        split, splits: for a saved HF ``DatasetDict``, the split read and all its splits; else
            None and ``()``.
        on_invalid_utf8: ``"replace"`` or ``"error"`` (see :func:`open_source`).
        invalid_utf8_docs: documents of the last read (so far) that held invalid UTF-8 and were
            decoded with replacement characters for a ``tokenizer.json`` (0 for the byte tokenizer).

    Iterating twice reads the input twice. Errors found while reading raise ``SourceError``.
    """

    def __init__(
        self,
        *,
        path: str,
        format: str,
        column: str,
        pretokenized: bool,
        tokenizer: ByteTokenizer | HFTokenizer | None,
        num_docs: Optional[int],
        batch_rows: int,
        flat_reader: Callable[[dict[str, int]], Iterator[tuple[np.ndarray, np.ndarray]]],
        split: Optional[str] = None,
        splits: tuple[str, ...] = (),
        on_invalid_utf8: str = "replace",
    ):
        self.path = path
        self.format = format
        self.column = column
        self.pretokenized = pretokenized
        self.tokenizer = tokenizer
        self.num_docs = num_docs
        self.batch_rows = batch_rows
        self._reader = flat_reader
        self.split = split
        self.splits = tuple(splits)
        self.on_invalid_utf8 = on_invalid_utf8
        self._counts = {"invalid_utf8_docs": 0}

    def _flat_reader(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._counts["invalid_utf8_docs"] = 0  # each read counts afresh
        return self._reader(self._counts)

    @property
    def invalid_utf8_docs(self) -> int:
        """Documents of the last read holding invalid UTF-8 (decoded with U+FFFD replacements)."""
        return self._counts["invalid_utf8_docs"]

    @property
    def description(self) -> str:
        """One human-readable line, e.g. ``parquet data/x.parquet (column 'text', bytes tokenizer)``."""
        how = "pre-tokenized" if self.pretokenized else f"{self.tokenizer_name} tokenizer"
        split = f"split {self.split!r} of {', '.join(self.splits)}; " if self.split is not None else ""
        return f"{self.format} {self.path} ({split}column {self.column!r}, {how})"

    @property
    def tokenizer_name(self) -> str:
        """``"bytes"``, ``"tokenizer.json"`` or ``"pretokenized"``."""
        return "pretokenized" if self.tokenizer is None else self.tokenizer.name

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description of the input (the manifest's ``source``)."""
        info = {"path": self.path, "format": self.format, "column": self.column, "num_docs": self.num_docs}
        if self.tokenizer is not None and self.tokenizer.decodes_text:  # text decoded for a tokenizer.json
            info["invalid_utf8"] = {"on_invalid": self.on_invalid_utf8, "documents": self.invalid_utf8_docs}
        if self.split is not None:  # a DatasetDict: which of its splits was read
            info.update(split=self.split, splits=list(self.splits))
        return info

    def tokenizer_info(self) -> dict[str, Any]:
        """JSON-serialisable description of the tokenizer (the manifest's ``tokenizer``)."""
        if self.tokenizer is None:
            return {"name": "pretokenized", "column": self.column}
        return self.tokenizer.info()

    def iter_batches(self) -> Iterator[list[np.ndarray]]:
        """Yield lists of documents (each a 1-D int32 array), about ``batch_rows`` per list."""
        for ids, lengths in self._flat_reader():
            yield _split_flat(ids, lengths)

    def iter_flat_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield batches as ``(ids, lengths)``: ``ids`` int32 ``(tokens,)`` holds the batch's documents
        end to end, ``lengths`` int64 ``(docs,)`` their token counts (no per-document arrays)."""
        return self._flat_reader()

    def read_flat(self, progress: Optional[Callable[[int], None]] = None) -> tuple[np.ndarray, np.ndarray]:
        """Read every document into one flat token buffer (Arrow ``ListArray`` layout).

        Feeds :func:`flamia_pack.pack.plan_packing` (on ``np.diff(doc_offsets)``) and
        :func:`flamia_pack.pack.fill_rows` directly. Peak memory is about one copy of the tokens
        (4 bytes each) plus one batch: each batch is copied into a growing memory map at once and
        released (see ``_TokenBuffer``). Afterwards :attr:`num_docs` is the number of documents read.

        Args:
            progress: called as ``progress(docs_in_batch)`` after each batch is read.

        Returns:
            ``(tokens, doc_offsets)``: ``tokens`` int32 ``(total_tokens,)``, ids >= 0; ``doc_offsets``
            int64 ``(num_docs + 1,)`` starting at 0, document ``i`` is
            ``tokens[doc_offsets[i]:doc_offsets[i + 1]]``.

        Raises:
            SourceError: as for iteration (corrupt data, bad ids, ...).
        """
        buf = _TokenBuffer()
        lens: list[np.ndarray] = []
        for ids, lengths in self._flat_reader():
            buf.append(ids)  # copied out at once: the batch's arrow buffers are freed right away
            del ids
            lens.append(lengths)
            if progress is not None:
                progress(int(lengths.shape[0]))
        lengths = np.concatenate(lens) if lens else np.zeros(0, np.int64)
        del lens
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = buf.finish()
        pa.default_memory_pool().release_unused()  # give the batches' freed memory back
        self.num_docs = int(lengths.shape[0])
        return tokens, offsets

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.iter_batches():
            yield from batch

    def __len__(self) -> int:
        if self.num_docs is None:
            raise TypeError(f"the number of documents of {self.format} input {self.path} is not known before reading it")
        return self.num_docs

    def __bool__(self) -> bool:  # so `if source:` never calls __len__
        return True

    def __repr__(self) -> str:
        return f"DocumentSource({self.description}, num_docs={self.num_docs})"


# ---------------------------------------------------------------------------------------------
# format back-ends: each yields arrow arrays of the chosen column


def _choose_column(names: list[str], text_column: Optional[str], tokenizer: str, where: str) -> str:
    if text_column is not None:
        if text_column not in names:
            raise SourceError(f"column {text_column!r} not found in {where}; available columns: {', '.join(names) or '(none)'}")
        return text_column
    order = ("text", "input_ids") if str(tokenizer) != "bytes" else ("input_ids", "text")
    for c in order:
        if c in names:
            return c
    raise SourceError(
        f"no 'input_ids' or 'text' column in {where}; available columns: {', '.join(names) or '(none)'} "
        "(choose one with --text-column NAME)"
    )


def _check_column_type(t: pa.DataType, column: str, where: str) -> bool:
    """Return True when the column is pre-tokenized (integer lists), False for text."""
    if _is_text_type(t):
        return False
    if _is_list_type(t):
        if not pa.types.is_integer(t.value_type):
            raise SourceError(
                f"column {column!r} of {where} must hold integer token ids, got {t} (non-integer tokens)"
            )
        return True
    raise SourceError(f"column {column!r} of {where} must hold text (string) or token ids (list of integers), got {t}")


#: what the back-ends yield: an arrow array of the column, and ``locate(i)`` naming value ``i``'s file and row
_Located = tuple[pa.Array, Callable[[int], str]]


def _wrap_errors(gen: Iterator[_Located], what: str) -> Iterator[_Located]:
    """Re-raise arrow/OS errors met while reading as SourceError.

    ``GeneratorExit`` (a partly read source being closed or garbage-collected, possibly at
    interpreter exit when module globals such as ``SourceError`` are already ``None``) passes
    through first, before any clause that looks up a module global.
    """
    try:
        yield from gen
    except GeneratorExit:
        raise
    except SourceError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise SourceError(f"cannot read {what}: {_one_line(e)}") from None


def _parquet_schema(f: pathlib.Path) -> tuple[pa.Schema, int]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        return pf.schema_arrow, int(pf.metadata.num_rows)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"cannot read parquet file {f}: {_one_line(e)} (corrupt or not parquet)") from None


def _rows_of(f: pathlib.Path, base: int) -> Callable[[int], str]:
    return lambda i: f"{f}, row {base + i}"


def _parquet_arrays(files: list[pathlib.Path], column: str, batch_rows: int) -> Iterator[_Located]:
    import pyarrow.parquet as pq

    for f in files:
        def gen(f=f):
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise SourceError(f"column {column!r} not found in {f}; available columns: {', '.join(pf.schema_arrow.names)}")
            base = 0
            for b in pf.iter_batches(batch_size=batch_rows, columns=[column]):
                yield b.column(0), _rows_of(f, base)
                base += b.num_rows

        yield from _wrap_errors(gen(), f"parquet file {f}")


def _open_ipc(f: pathlib.Path):
    src = pa.memory_map(str(f), "r")
    try:
        return pa.ipc.open_file(src)
    except pa.ArrowInvalid:
        src.seek(0)
        return pa.ipc.open_stream(src)


def _arrow_schema(f: pathlib.Path) -> tuple[pa.Schema, int]:
    try:
        r = _open_ipc(f)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"cannot read arrow file {f}: {_one_line(e)} (corrupt or not an arrow IPC file)") from None
    try:  # memory-mapped: counting rows reads batch headers only
        if isinstance(r, pa.ipc.RecordBatchFileReader):
            return r.schema, sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))
        return r.schema, sum(b.num_rows for b in r)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"cannot read arrow file {f}: {_one_line(e)} (corrupt or truncated)") from None


def _arrow_arrays(files: list[pathlib.Path], column: str, batch_rows: int) -> Iterator[_Located]:
    for f in files:
        def gen(f=f):
            r = _open_ipc(f)
            if column not in r.schema.names:
                raise SourceError(f"column {column!r} not found in {f}; available columns: {', '.join(r.schema.names)}")
            idx = r.schema.get_field_index(column)
            batches = (
                (r.get_batch(i) for i in range(r.num_record_batches))
                if isinstance(r, pa.ipc.RecordBatchFileReader)
                else iter(r)
            )
            base = 0
            for b in batches:
                col = b.column(idx)
                for s in range(0, len(col), batch_rows):
                    yield col.slice(s, batch_rows), _rows_of(f, base + s)
                base += b.num_rows

        yield from _wrap_errors(gen(), f"arrow file {f}")


def _set_hf_offline() -> None:
    """Make sure ``datasets``/``huggingface_hub`` never reach a hub from this process."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import sys

    cfg = sys.modules.get("datasets.config")
    if cfg is not None:  # already imported: the env var was read at import time
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            if hasattr(cfg, name):
                setattr(cfg, name, True)


def _load_hf_dataset(p: pathlib.Path):
    """``(dataset, split, splits)``: for a ``DatasetDict`` its split read and all its splits, else ``(ds, None, ())``."""
    _set_hf_offline()
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - the [data] extra installs it
        raise SourceError("reading a saved HF dataset needs the 'datasets' package (pip install 'flamia-pack[data]')") from e
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets raises FileNotFoundError/ValueError/arrow errors
        raise SourceError(f"cannot load HF dataset directory {p}: {_one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if "train" in ds:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise SourceError(f"HF DatasetDict {p} has splits {', '.join(splits)} and no 'train'; save the split to pack on its own")
        return ds[split], split, tuple(splits)
    return ds, None, ()


def _hf_arrays(ds, column: str, batch_rows: int, where: str) -> Iterator[_Located]:
    base = 0
    for t in ds.select_columns([column]).with_format("arrow").iter(batch_size=batch_rows):
        yield _as_array(t.column(0)), (lambda i, base=base: f"{where}, row {base + i}")
        base += t.num_rows


def _text_file_batches(
    files: list[pathlib.Path], tok, batch_rows: int, on_invalid: str, counts: dict[str, int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for s in range(0, len(files), batch_rows):
        chunk = files[s : s + batch_rows]
        data = []
        for f in chunk:
            try:
                data.append(f.read_bytes())
            except OSError as e:
                raise SourceError(f"cannot read text file {f}: {_one_line(e)}") from None
        if not tok.decodes_text:
            yield tok.encode_bytes_flat(data)
            continue
        texts = []
        for f, b in zip(chunk, data):
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError as e:
                if on_invalid == "error":
                    raise SourceError(invalid_utf8_message(f"text file {f}", None, b, e)) from None
                counts["invalid_utf8_docs"] += 1
                texts.append(b.decode("utf-8", "replace"))
        yield tok.encode_texts_flat(texts)


def _docs_from_arrays(
    arrays: Iterator[_Located], column: str, pretokenized: bool, tok, where: str, on_invalid: str,
    counts: dict[str, int],
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Flat batches ``(ids int32, lengths int64)`` of the column, validated / tokenized; documents
    with invalid UTF-8 decoded for a text tokenizer are counted in ``counts["invalid_utf8_docs"]``."""
    base = 0
    for arr, locate in arrays:
        arr = _as_array(arr)
        if pretokenized:
            if not _is_list_type(arr.type):
                raise SourceError(f"column {column!r} of {where} changes type to {arr.type}; expected a list of integers")
            flat = _token_lists_flat(arr, column, base)
        else:
            if not _is_text_type(arr.type):
                raise SourceError(f"column {column!r} of {where} changes type to {arr.type}; expected text")
            if tok.decodes_text:
                texts, bad = decode_utf8(arr, on_invalid, locate, column)
                counts["invalid_utf8_docs"] += bad
                flat = tok.encode_texts_flat(texts)
            else:
                flat = tok.encode_arrow_flat(arr)
        base += int(flat[1].shape[0])
        yield flat


def _data_files(p: pathlib.Path) -> list[pathlib.Path]:
    out = []
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if f.is_file():
            out.append(f)
    return out


def _classify_dir(p: pathlib.Path) -> tuple[str, list[pathlib.Path]]:
    if (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
        return "hf-dataset", []
    files = _data_files(p)
    kinds = {
        "parquet": [f for f in files if f.suffix.lower() in PARQUET_SUFFIXES],
        "jsonl": [f for f in files if is_jsonl_path(f)],
        "arrow": [f for f in files if f.suffix.lower() in ARROW_SUFFIXES],
    }
    found = {k: v for k, v in kinds.items() if v}
    if len(found) > 1:
        desc = ", ".join(f"{len(v)} {k}" for k, v in found.items())
        raise SourceError(f"directory {p} mixes data file kinds ({desc}); point SOURCE at one kind")
    if found:
        (kind, fs), = found.items()
        return kind, fs
    texts = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    if texts:
        return "text-files", texts
    raise SourceError(
        f"no supported files in directory {p} (looked for a saved HF dataset, *.parquet, *.jsonl[.gz], *.arrow, "
        f"or text files: {', '.join(sorted(TEXT_SUFFIXES))})"
    )


def _classify_file(p: pathlib.Path) -> str:
    s = p.suffix.lower()
    if s in PARQUET_SUFFIXES:
        return "parquet"
    if is_jsonl_path(p):
        return "jsonl"
    if s in ARROW_SUFFIXES:
        return "arrow"
    if s in TEXT_SUFFIXES:
        return "text-files"
    raise SourceError(
        f"unsupported file type {p.suffix or '(no suffix)'!r} for {p}; expected .parquet, .jsonl, .json (also .gz), .arrow "
        "or a text file (.txt, .md, .py, .rst, ...), or a directory of those"
    )


def open_source(
    path: str | os.PathLike[str],
    *,
    text_column: Optional[str] = None,
    tokenizer: str | os.PathLike[str] = "bytes",
    batch_rows: int = DEFAULT_BATCH_ROWS,
    on_invalid_utf8: str = "replace",
) -> DocumentSource:
    """Open a local dataset as a :class:`DocumentSource` of int32 token-id documents.

    Args:
        path: a file or directory (see the module docstring for the formats and how a directory
            is recognised).
        text_column: column to read; ``None`` picks ``input_ids`` (pre-tokenized) or ``text``.
            A string column is tokenized, a list-of-integers column is used as ids.
        tokenizer: ``"bytes"`` (UTF-8 bytes, ids 0..255) or a path to a ``tokenizer.json``. A path
            with a pre-tokenized column (integer lists) is an error, never silently ignored.
        batch_rows: documents per batch of :meth:`DocumentSource.iter_batches` (>= 1).
        on_invalid_utf8: for a ``tokenizer.json`` (text is decoded before tokenizing):
            ``"replace"`` (default) decodes invalid byte sequences as U+FFFD and counts the
            documents (:attr:`DocumentSource.invalid_utf8_docs`); ``"error"`` raises
            ``SourceError`` at the first one (file, row, byte offset). The byte tokenizer reads
            the bytes as they are and decodes nothing.

    Returns:
        DocumentSource: iterating yields 1-D ``np.ndarray`` int32, one per input row/file, in input
        order (sorted paths for directories). Metadata is read eagerly (schema, row counts), the
        data lazily.

    Raises:
        SourceError: missing path, unsupported/ambiguous input, unknown or unsuitable column,
            corrupt file, bad tokenizer file, a tokenizer path given for a pre-tokenized column;
            later, while iterating: non-integer/null/negative/too large ids, corrupt data pages,
            invalid UTF-8 with ``on_invalid_utf8="error"``.
    """
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, (int, np.integer)) or int(batch_rows) < 1:
        raise SourceError(f"batch_rows must be an integer >= 1, got {batch_rows!r}")
    batch_rows = int(batch_rows)
    on_invalid = check_on_invalid_utf8(on_invalid_utf8)
    p = pathlib.Path(path)
    if not p.exists():
        raise SourceError(f"source not found: {p}")
    kind, files = _classify_dir(p) if p.is_dir() else (_classify_file(p), [p])
    tok_arg = str(tokenizer)
    where = f"{p}"
    common = dict(path=str(path), format=kind, batch_rows=batch_rows, on_invalid_utf8=on_invalid)

    if kind == "text-files":
        if text_column not in (None, "text"):
            raise SourceError(f"--text-column {text_column!r} does not apply to text files (one document per file)")
        tok = load_tokenizer(tok_arg)
        return DocumentSource(
            column="text", pretokenized=False, tokenizer=tok, num_docs=len(files),
            flat_reader=lambda counts: _text_file_batches(files, tok, batch_rows, on_invalid, counts), **common,
        )

    # tabular inputs: find schema + row count, choose the column, check its type
    split, splits = None, ()  # a DatasetDict's split read, and all its splits
    if kind == "parquet":
        schema, n0 = _parquet_schema(files[0])
        num_docs: Optional[int] = n0 + sum(_parquet_schema(f)[1] for f in files[1:])
        arrays_fn: Callable[[str], Iterator[_Located]] = lambda c: _parquet_arrays(files, c, batch_rows)
    elif kind == "jsonl":
        first = None
        for i, f in enumerate(files):  # the first file with a line gives the columns
            first = json_schema(f)
            if first is not None:
                files = files[i:]
                break
        if first is None:
            # no documents, as an empty parquet file: zero documents (no schema to check a column against)
            tok = load_tokenizer(tok_arg)
            return DocumentSource(column=text_column or "text", pretokenized=False, tokenizer=tok, num_docs=0,
                                  flat_reader=lambda counts: iter(()), **common)
        schema = first
        num_docs = None  # streamed: counted while reading
        arrays_fn = lambda c: _wrap_errors(json_arrays(files, c, schema.field(c).type, batch_rows), f"JSON lines {p}")
    elif kind == "arrow":
        schema, n0 = _arrow_schema(files[0])
        num_docs = n0 + sum(_arrow_schema(f)[1] for f in files[1:])
        arrays_fn = lambda c: _arrow_arrays(files, c, batch_rows)
    else:  # hf-dataset
        ds, split, splits = _load_hf_dataset(p)
        schema = ds.data.schema
        num_docs = ds.num_rows
        where = f"HF dataset {p}"
        arrays_fn = lambda c: _wrap_errors(_hf_arrays(ds, c, batch_rows, where), where)

    column = _choose_column(list(schema.names), text_column, tok_arg, where)
    pretokenized = _check_column_type(read_type(schema.field(column).type) if kind == "jsonl"
                                      else schema.field(column).type, column, where)
    if pretokenized and tok_arg != "bytes":
        # a tokenizer file would be silently ignored: ids are used as they are
        raise SourceError(
            f"tokenizer {tok_arg} does not apply: column {column!r} of {where} is pre-tokenized (lists of integer "
            "token ids, used as they are); drop --tokenizer, or pick a text column with --text-column NAME"
        )
    tok = None if pretokenized else load_tokenizer(tok_arg)
    return DocumentSource(
        column=column, pretokenized=pretokenized, tokenizer=tok, num_docs=num_docs,
        flat_reader=lambda counts: _docs_from_arrays(arrays_fn(column), column, pretokenized, tok, where,
                                                     on_invalid, counts),
        split=split, splits=splits, **common,
    )

