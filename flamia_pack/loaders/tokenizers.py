"""Tokenizers of :mod:`flamia_pack.loaders.sources`, and the UTF-8 decoding of text before a tokenizer.

* :class:`ByteTokenizer` (``"bytes"``): one token per byte, ids 0..255. It reads the raw bytes of a
  value, so invalid UTF-8 is packed byte for byte as it is (nothing is decoded).
* :class:`HFTokenizer`: an HF ``tokenizers`` ``tokenizer.json``, batch-encoded with its own
  special-token post-processing. Its input is text, so every value is decoded as UTF-8 first, by
  :func:`decode_utf8` with the source's ``on_invalid_utf8`` policy: ``"replace"`` (each invalid
  byte sequence becomes U+FFFD and the document is counted) or ``"error"`` (a ``SourceError``
  naming the file, the row and the byte offset of the first invalid byte).

The array helpers (arrow string/binary array -> one flat int32 buffer + int64 lengths) live here
too, since the byte tokenizer is made of them.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from flamia_pack.errors import SourceError

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "decode_utf8", "ON_INVALID_UTF8"]

#: accepted values of ``on_invalid_utf8`` (the first is the default).
ON_INVALID_UTF8 = ("replace", "error")


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= 300 else s[:297] + "..."


def check_on_invalid_utf8(value: Any) -> str:
    """``value`` if it is one of :data:`ON_INVALID_UTF8`, else ``SourceError``."""
    if value not in ON_INVALID_UTF8:
        raise SourceError(f"on_invalid_utf8 must be one of {', '.join(ON_INVALID_UTF8)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# arrow string/binary array -> flat int32 ids


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


def _as_binary(arr: pa.Array) -> pa.Array:
    """A string/large_string array as binary/large_binary (same memory layout: zero-copy)."""
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.cast(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    return arr


def _binary_flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level ids of a string/binary array as one int32 buffer + int64 lengths (nulls: 0)."""
    arr = _as_binary(arr)
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


# ---------------------------------------------------------------------------------------------
# UTF-8 decoding for text tokenizers


def decode_utf8(
    arr: pa.Array, on_invalid: str, locate: Callable[[int], str], column: str
) -> tuple[list[str], int]:
    """Decode a string/binary arrow array to Python strings (nulls -> ``""``).

    Valid arrays are checked in one pass (arrow's UTF-8 validation) and converted directly; only an
    array holding invalid UTF-8 is decoded value by value.

    Args:
        on_invalid: ``"replace"``: invalid byte sequences become U+FFFD; ``"error"``: raise.
        locate: ``locate(i)`` describes value ``i`` for the error message (file and row).
        column: the column name (for the error message).

    Returns:
        ``(texts, n_invalid)``: one string per value, and how many values held invalid UTF-8.

    Raises:
        SourceError: with ``on_invalid="error"``, at the first invalid value: where it is (file,
            row), the byte offset inside the value and the byte.
    """
    b = _as_binary(arr)
    s = b.view(pa.large_string() if pa.types.is_large_binary(b.type) else pa.string())
    try:
        s.validate(full=True)
        return ["" if v is None else v for v in s.to_pylist()], 0
    except pa.ArrowInvalid:
        pass
    texts, bad = [], 0
    for i, v in enumerate(b.to_pylist()):
        if v is None:
            texts.append("")
            continue
        try:
            texts.append(v.decode("utf-8"))
        except UnicodeDecodeError as e:
            if on_invalid == "error":
                raise SourceError(invalid_utf8_message(locate(i), column, v, e)) from None
            bad += 1
            texts.append(v.decode("utf-8", "replace"))
    return texts, bad


def invalid_utf8_message(where: str, column: str | None, value: bytes, e: UnicodeDecodeError) -> str:
    """The one-line error for invalid UTF-8 at ``e.start`` of ``value``."""
    col = f", column {column!r}" if column else ""
    return (f"invalid UTF-8 in {where}{col}: byte 0x{value[e.start]:02x} at byte offset {e.start} of the value "
            f"({e.reason}); a tokenizer.json needs text: fix the data, or use --on-invalid-utf8 replace "
            "(on_invalid_utf8='replace') to decode it with U+FFFD replacement characters")


# ---------------------------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """Built-in byte-level tokenizer: token id = byte value (ids 0..255, ``vocab_size`` 256).

    ``encode_arrow_flat`` works on a whole arrow string/binary array at once: one ``uint8 -> int32``
    conversion of the batch's data buffer. The bytes are used as they are (no UTF-8 decoding).
    """

    name = "bytes"
    vocab_size = 256
    decodes_text = False

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description (goes into ``manifest.json``)."""
        return {"name": self.name, "vocab_size": self.vocab_size}

    def encode_arrow_flat(self, arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a string/binary array: (ids int32 ``(tokens,)``, lengths int64 ``(len(arr),)``)."""
        return _binary_flat(arr)

    def encode_bytes_flat(self, data: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize raw byte strings (e.g. whole text files): (ids int32, lengths int64 ``(len(data),)``)."""
        lengths = np.fromiter((len(b) for b in data), dtype=np.int64, count=len(data))
        return np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.int32), lengths


class HFTokenizer:
    """An HF ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (never from a hub).

    It encodes Python strings; the source decodes the values first (:func:`decode_utf8`).
    """

    name = "tokenizer.json"
    decodes_text = True

    def __init__(self, path: str | os.PathLike[str]):
        p = pathlib.Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "not found"
            raise SourceError(f"tokenizer file {what}: {p} (use --tokenizer bytes or a path to a tokenizer.json)")
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

    def encode_texts_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize strings (with special tokens): (ids int32, lengths int64 ``(len(texts),)``)."""
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        encs = self._encode(texts, add_special_tokens=True)
        return _flatten([np.asarray(e.ids, dtype=np.int32) for e in encs])


def load_tokenizer(tokenizer: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> :class:`ByteTokenizer`; anything else is a path to a ``tokenizer.json``.

    Raises:
        SourceError: the file is missing or is not a valid ``tokenizers`` JSON file.
    """
    if str(tokenizer) == "bytes":
        return ByteTokenizer()
    return HFTokenizer(tokenizer)
