"""Document sources: read token-id sequences from local datasets (DESIGN.md §2 "sources", §3).

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
JSON lines                ``*.jsonl`` / ``*.ndjson`` / ``*.json`` (one object per line), file or
                          directory; ``pyarrow.json`` (a whole file is parsed at once)
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
  (``add_special_tokens=True``). Binary values and text files are decoded as UTF-8 with
  replacement characters for invalid bytes. A path together with a pre-tokenized column (chosen by
  ``text_column`` or because there is no ``text`` column) raises ``SourceError``: the ids would
  be used as they are and the tokenizer silently ignored.

Null values (a null text or a null id list) become empty documents, which packing counts and skips.

Reading without per-document arrays: :meth:`DocumentSource.iter_flat_batches` yields each batch as
one int32 token buffer + int64 lengths, and :meth:`DocumentSource.read_flat` returns the whole input
as ``(tokens, doc_offsets)`` (Arrow ``ListArray`` layout) for ``plan_packing`` + ``fill_rows``.

Errors: every problem with the input raises :class:`~flamia_pack.errors.SourceError` with one line
saying what was wrong: missing path, unsupported or ambiguous input, unknown column (the available
columns are listed), a column that holds neither text nor integer lists, non-integer or null token
ids, negative ids or ids above the int32 range (with the document index), a corrupt
parquet/json/arrow file, an unreadable tokenizer file. Errors found while iterating (a corrupt
row group in the middle of a file) are raised from the iterator, also as ``SourceError``.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from flamia_pack.errors import SourceError

__all__ = [
    "DocumentSource",
    "ByteTokenizer",
    "HFTokenizer",
    "open_source",
    "load_tokenizer",
    "TEXT_SUFFIXES",
    "DEFAULT_BATCH_ROWS",
]

#: documents per batch handed out by :meth:`DocumentSource.iter_batches` (and read per arrow batch).
DEFAULT_BATCH_ROWS = 1024

PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
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
# tokenizers


class ByteTokenizer:
    """Built-in byte-level tokenizer: token id = UTF-8 byte value (ids 0..255, ``vocab_size`` 256).

    ``encode_arrow`` works on a whole arrow string/binary array at once: one ``uint8 -> int32``
    conversion of the batch's data buffer, then views split at the value offsets.
    """

    name = "bytes"
    vocab_size = 256

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description (goes into ``manifest.json``)."""
        return {"name": self.name, "vocab_size": self.vocab_size}

    def encode_arrow(self, arr: pa.Array) -> list[np.ndarray]:
        """Tokenize a string/large_string/binary/large_binary array -> one int32 array per value."""
        return _split_binary(arr)

    def encode_arrow_flat(self, arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`encode_arrow`, flat: (ids int32 ``(tokens,)``, lengths int64 ``(len(arr),)``)."""
        return _binary_flat(arr)

    def encode_bytes(self, data: list[bytes]) -> list[np.ndarray]:
        """Tokenize raw byte strings (e.g. whole text files) -> one int32 array per item."""
        return [np.frombuffer(b, dtype=np.uint8).astype(np.int32) for b in data]

    def encode_bytes_flat(self, data: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`encode_bytes`, flat: (ids int32, lengths int64 ``(len(data),)``)."""
        lengths = np.fromiter((len(b) for b in data), dtype=np.int64, count=len(data))
        return np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.int32), lengths


class HFTokenizer:
    """An HF ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (never from a hub)."""

    name = "tokenizer.json"

    def __init__(self, path: str | os.PathLike[str]):
        p = pathlib.Path(path)
        if not p.is_file():
            raise SourceError(f"tokenizer file not found: {p} (use --tokenizer bytes or a path to a tokenizer.json)")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - the [data] extra installs it
            raise SourceError("a tokenizer.json needs the 'tokenizers' package (pip install 'flamia-pack[data]')") from e
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a plain Exception on a bad file
            raise SourceError(f"cannot load tokenizer {p}: {_one_line(e)}") from None
        self.path = str(p)
        self.sha256 = hashlib.sha256(p.read_bytes()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description (goes into ``manifest.json``): path, sha256, vocab size."""
        return {"name": self.name, "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size}

    def _encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        encs = self._encode(texts, add_special_tokens=True)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def encode_arrow(self, arr: pa.Array) -> list[np.ndarray]:
        """Tokenize a string/binary arrow array (nulls -> empty documents)."""
        if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
            texts = ["" if b is None else b.decode("utf-8", "replace") for b in arr.to_pylist()]
        else:
            texts = ["" if s is None else s for s in arr.to_pylist()]
        return self._encode_texts(texts)

    def encode_bytes(self, data: list[bytes]) -> list[np.ndarray]:
        """Tokenize raw byte strings, decoded as UTF-8 with replacement characters."""
        return self._encode_texts([b.decode("utf-8", "replace") for b in data])

    def encode_arrow_flat(self, arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_arrow`, flat: (ids int32, lengths int64 ``(len(arr),)``)."""
        return _flatten(self.encode_arrow(arr))

    def encode_bytes_flat(self, data: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_bytes`, flat: (ids int32, lengths int64 ``(len(data),)``)."""
        return _flatten(self.encode_bytes(data))


def load_tokenizer(tokenizer: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> :class:`ByteTokenizer`; anything else is a path to a ``tokenizer.json``.

    Raises:
        SourceError: the file is missing or is not a valid ``tokenizers`` JSON file.
    """
    if str(tokenizer) == "bytes":
        return ByteTokenizer()
    return HFTokenizer(tokenizer)


# ---------------------------------------------------------------------------------------------
# arrow array -> list of int32 documents


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= 300 else s[:297] + "..."


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


def _flatten(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One flat int32 buffer + int64 lengths from a list of 1-D int32 documents."""
    lengths = np.fromiter((d.shape[0] for d in docs), dtype=np.int64, count=len(docs))
    ids = np.concatenate(docs).astype(np.int32, copy=False) if docs else np.zeros(0, np.int32)
    return ids, lengths


def _split_flat(ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """Views of ``ids`` cut at ``cumsum(lengths)``: one 1-D array per document."""
    if lengths.shape[0] == 0:
        return []
    return np.split(ids, np.cumsum(lengths[:-1]))


def _drop_nulls(arr: pa.Array, ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat (ids, lengths) of a list/binary array whose ``ids`` are ``values[offsets[0]:offsets[-1]]``:
    null entries become empty documents (their value range, normally empty, is removed)."""
    lengths = np.diff(offsets)
    if arr.null_count:
        null = ~np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        if lengths[null].any():
            ids = ids[np.repeat(~null, lengths)]
        lengths[null] = 0
    return ids, lengths


def _split_binary(arr: pa.Array) -> list[np.ndarray]:
    """Byte-level ids of every value of a string/binary array (views into one int32 buffer)."""
    return _split_flat(*_binary_flat(arr))


def _binary_flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level ids of a string/binary array as one int32 buffer + int64 lengths (nulls: 0)."""
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        # same memory layout; a cast from (large_)string to (large_)binary is zero-copy
        arr = arr.cast(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    bufs = arr.buffers()
    off_dtype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=off_dtype)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    start, end = int(offsets[0]), int(offsets[-1])
    ids = data[start:end].astype(np.int32)
    return _drop_nulls(arr, ids, offsets)


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
            batch headers, HF datasets, text files, a single JSON lines file), else None (several
            JSON lines files). ``len(source)`` returns it and
            raises ``TypeError`` when it is None.
        batch_rows: documents per batch of :meth:`iter_batches` (arrow inputs may give a batch
            of fewer rows at file/record-batch boundaries).
        split, splits: for a saved HF ``DatasetDict``, the split read and all its splits; else
            None and ``()``.

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
        flat_reader: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]],
        split: Optional[str] = None,
        splits: tuple[str, ...] = (),
    ):
        self.path = path
        self.format = format
        self.column = column
        self.pretokenized = pretokenized
        self.tokenizer = tokenizer
        self.num_docs = num_docs
        self.batch_rows = batch_rows
        self._flat_reader = flat_reader
        self.split = split
        self.splits = tuple(splits)

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
        :func:`flamia_pack.pack.fill_rows` directly (DESIGN.md §3; issue 2 "bounded memory").
        Peak memory is about one copy of the tokens plus one batch: each batch is copied into a
        growing memory map at once and released (see ``_TokenBuffer``).

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


def _wrap_errors(gen: Iterator[pa.Array], what: str) -> Iterator[pa.Array]:
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


def _parquet_arrays(files: list[pathlib.Path], column: str, batch_rows: int) -> Iterator[pa.Array]:
    import pyarrow.parquet as pq

    for f in files:
        def gen(f=f):
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise SourceError(f"column {column!r} not found in {f}; available columns: {', '.join(pf.schema_arrow.names)}")
            for b in pf.iter_batches(batch_size=batch_rows, columns=[column]):
                yield b.column(0)

        yield from _wrap_errors(gen(), f"parquet file {f}")


def _read_json(f: pathlib.Path) -> Optional[pa.Table]:
    import pyarrow.json as pj

    if f.stat().st_size == 0:
        return None
    try:
        return pj.read_json(f)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"cannot parse JSON lines file {f}: {_one_line(e)} (expected one JSON object per line)") from None


def _json_arrays(files: list[pathlib.Path], column: str, batch_rows: int, first: Optional[pa.Table]) -> Iterator[pa.Array]:
    for i, f in enumerate(files):
        table = first if i == 0 else _read_json(f)
        if table is None:
            continue
        if column not in table.column_names:
            raise SourceError(f"column {column!r} not found in {f}; available columns: {', '.join(table.column_names)}")
        col = table.column(column)
        for s in range(0, len(col), batch_rows):
            yield _as_array(col.slice(s, batch_rows))


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


def _arrow_arrays(files: list[pathlib.Path], column: str, batch_rows: int) -> Iterator[pa.Array]:
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
            for b in batches:
                col = b.column(idx)
                for s in range(0, len(col), batch_rows):
                    yield col.slice(s, batch_rows)

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


def _hf_arrays(ds, column: str, batch_rows: int) -> Iterator[pa.Array]:
    for t in ds.select_columns([column]).with_format("arrow").iter(batch_size=batch_rows):
        yield _as_array(t.column(0))


def _text_file_batches(files: list[pathlib.Path], tok, batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for s in range(0, len(files), batch_rows):
        chunk = files[s : s + batch_rows]
        data = []
        for f in chunk:
            try:
                data.append(f.read_bytes())
            except OSError as e:
                raise SourceError(f"cannot read text file {f}: {_one_line(e)}") from None
        yield tok.encode_bytes_flat(data)


def _docs_from_arrays(
    arrays: Iterator[pa.Array], column: str, pretokenized: bool, tok, where: str
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Flat batches ``(ids int32, lengths int64)`` of the column, validated / tokenized."""
    base = 0
    for arr in arrays:
        arr = _as_array(arr)
        if pretokenized:
            if not _is_list_type(arr.type):
                raise SourceError(f"column {column!r} of {where} changes type to {arr.type}; expected a list of integers")
            flat = _token_lists_flat(arr, column, base)
        else:
            if not _is_text_type(arr.type):
                raise SourceError(f"column {column!r} of {where} changes type to {arr.type}; expected text")
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
        "jsonl": [f for f in files if f.suffix.lower() in JSONL_SUFFIXES],
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
        f"no supported files in directory {p} (looked for a saved HF dataset, *.parquet, *.jsonl, *.arrow, "
        f"or text files: {', '.join(sorted(TEXT_SUFFIXES))})"
    )


def _classify_file(p: pathlib.Path) -> str:
    s = p.suffix.lower()
    if s in PARQUET_SUFFIXES:
        return "parquet"
    if s in JSONL_SUFFIXES:
        return "jsonl"
    if s in ARROW_SUFFIXES:
        return "arrow"
    if s in TEXT_SUFFIXES:
        return "text-files"
    raise SourceError(
        f"unsupported file type {p.suffix or '(no suffix)'!r} for {p}; expected .parquet, .jsonl, .json, .arrow "
        "or a text file (.txt, .md, .py, .rst, ...), or a directory of those"
    )


def open_source(
    path: str | os.PathLike[str],
    *,
    text_column: Optional[str] = None,
    tokenizer: str | os.PathLike[str] = "bytes",
    batch_rows: int = DEFAULT_BATCH_ROWS,
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

    Returns:
        DocumentSource: iterating yields 1-D ``np.ndarray`` int32, one per input row/file, in input
        order (sorted paths for directories). Metadata is read eagerly (schema, row counts), the
        data lazily.

    Raises:
        SourceError: missing path, unsupported/ambiguous input, unknown or unsuitable column,
            corrupt file, bad tokenizer file, a tokenizer path given for a pre-tokenized column; later, while iterating: non-integer/null/negative/
            too large ids, corrupt data pages.
    """
    if int(batch_rows) < 1:
        raise SourceError(f"batch_rows must be >= 1, got {batch_rows}")
    batch_rows = int(batch_rows)
    p = pathlib.Path(path)
    if not p.exists():
        raise SourceError(f"source not found: {p}")
    kind, files = _classify_dir(p) if p.is_dir() else (_classify_file(p), [p])
    tok_arg = str(tokenizer)
    where = f"{p}"

    if kind == "text-files":
        if text_column not in (None, "text"):
            raise SourceError(f"--text-column {text_column!r} does not apply to text files (one document per file)")
        tok = load_tokenizer(tok_arg)
        return DocumentSource(
            path=str(path), format=kind, column="text", pretokenized=False, tokenizer=tok,
            num_docs=len(files), batch_rows=batch_rows,
            flat_reader=lambda: _text_file_batches(files, tok, batch_rows),
        )

    # tabular inputs: find schema + row count, choose the column, check its type
    first_json: Optional[pa.Table] = None
    split, splits = None, ()  # a DatasetDict's split read, and all its splits
    if kind == "parquet":
        schema, n0 = _parquet_schema(files[0])
        num_docs: Optional[int] = n0 + sum(_parquet_schema(f)[1] for f in files[1:])
        arrays_fn: Callable[[str], Iterator[pa.Array]] = lambda c: _parquet_arrays(files, c, batch_rows)
    elif kind == "jsonl":
        nonempty = [f for f in files if f.stat().st_size > 0]
        if not nonempty:
            # no documents, as an empty parquet file: zero documents (no schema to check a column against)
            column = text_column or "text"
            tok = load_tokenizer(tok_arg)
            return DocumentSource(path=str(path), format=kind, column=column, pretokenized=False, tokenizer=tok,
                                  num_docs=0, batch_rows=batch_rows, flat_reader=lambda: iter(()))
        files = nonempty
        first_json = _read_json(files[0])
        schema = first_json.schema
        num_docs = first_json.num_rows if len(files) == 1 else None
        arrays_fn = lambda c: _json_arrays(files, c, batch_rows, first_json)
    elif kind == "arrow":
        schema, n0 = _arrow_schema(files[0])
        num_docs = n0 + sum(_arrow_schema(f)[1] for f in files[1:])
        arrays_fn = lambda c: _arrow_arrays(files, c, batch_rows)
    else:  # hf-dataset
        ds, split, splits = _load_hf_dataset(p)
        schema = ds.data.schema
        num_docs = ds.num_rows
        arrays_fn = lambda c: _wrap_errors(_hf_arrays(ds, c, batch_rows), f"HF dataset {p}")
        where = f"HF dataset {p}"

    column = _choose_column(list(schema.names), text_column, tok_arg, where)
    pretokenized = _check_column_type(schema.field(column).type, column, where)
    if pretokenized and tok_arg != "bytes":
        # a tokenizer file would be silently ignored: ids are used as they are
        raise SourceError(
            f"tokenizer {tok_arg} does not apply: column {column!r} of {where} is pre-tokenized (lists of integer "
            "token ids, used as they are); drop --tokenizer, or pick a text column with --text-column NAME"
        )
    tok = None if pretokenized else load_tokenizer(tok_arg)
    return DocumentSource(
        path=str(path), format=kind, column=column, pretokenized=pretokenized, tokenizer=tok,
        num_docs=num_docs, batch_rows=batch_rows,
        flat_reader=lambda: _docs_from_arrays(arrays_fn(column), column, pretokenized, tok, where),
        split=split, splits=splits,
    )
