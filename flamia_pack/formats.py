"""On-disk format of packed rows: parquet shards + ``manifest.json`` (DESIGN.md §3 "Output").

Layout of an output directory ``OUT``::

    OUT/train-00000.parquet     shard 0: one record per packed row
    OUT/train-00001.parquet     ...
    OUT/manifest.json           written LAST: its presence (and validity) marks OUT complete

Shards are named ``train-NNNNN.parquet`` (not ``shard-*``) so that
``datasets.load_dataset("parquet", data_dir=OUT)`` picks exactly the shards as split ``train``:
``datasets`` matches split names in file names, and would otherwise also try to read
``manifest.json`` as parquet. Temporary and progress files start with ``.`` (hidden), so
``datasets`` ignores them too.

Columns of every shard (one record = one row of :class:`~flamia_pack.pack.PackedRows`):

==============  ==================  =================================================
column          arrow type          content
==============  ==================  =================================================
input_ids       list<int32>         ``capacity`` token ids, ``pad_id`` past num_tokens
position_ids    list<int32>         ``capacity`` positions, restart at 0 per document
cu_seqlens      list<int32>         ``n_docs + 1`` row-local offsets, 0 .. num_tokens
doc_ids         list<int64>         ``n_docs`` source document index per segment
chunk_ids       list<int32>         ``n_docs`` piece index per segment (split docs)
num_tokens      int32               tokens used in the row (``cu_seqlens[-1]``)
==============  ==================  =================================================

The parquet schema metadata key ``flamia_pack`` holds ``{"format_version", "capacity",
"pad_id"}`` as JSON. Compression: zstd; no dictionary encoding; ``DELTA_BINARY_PACKED`` encoding for
the values of ``position_ids``, ``cu_seqlens``, ``doc_ids`` and ``chunk_ids``.

``manifest.json`` (format_version 1) holds: ``format_version``, ``writer``, ``created`` (UTC ISO
8601), ``capacity``, ``algorithm``, ``long_docs``, ``pad_id``, ``tokenizer`` and ``source``
(JSON objects describing the input), ``documents`` {in, packed, split, empty, dropped,
truncated}, ``tokens`` {in, packed, dropped, dropped_reasons}, ``rows``, ``fill`` (tokens packed /
(rows * capacity)), ``columns`` {name: arrow type}, and ``shards``: a list of {file, rows, sha256,
content_key} in row order (``sha256`` of the file's bytes; ``content_key`` a sha256 of the
logical row content, used to resume).

Crash safety (DESIGN.md §3): every file is written to a hidden temp file in the same directory,
flushed, ``fsync``-ed and moved into place with ``os.replace`` (atomic on POSIX), then the
directory is ``fsync``-ed; so no shard is ever torn. ``write_packed`` first records the run's
parameters in ``.flamia-pack-progress.json``, then removes an existing ``manifest.json`` (the
directory is then "incomplete"), writes the shards while recording each finished one in the
progress file, removes stale temp files and shards that are not part of the new output, and
writes ``manifest.json`` last. Re-running after a crash *resumes*: a shard whose file is listed
(in the progress file or an old manifest) with the same ``content_key`` and whose bytes still hash
to the recorded ``sha256`` is kept; every other shard is rewritten. Only one writer per directory
at a time is supported.

No silent replacement: a directory holding a finished pack (``manifest.json``) or a partial one
(the progress file) written with other *parameters* is refused (:class:`FormatError`, naming the
existing pack's parameters) unless the writer is called with ``overwrite=True`` (``flamia pack
--overwrite``); see :func:`check_pack_params`. The parameters are what the manifest records of the
packing: ``capacity``, ``algorithm``, ``long_docs``, ``pad_id``, ``tokenizer`` and ``source``, less
the counts of reading the input (``source``'s ``num_docs`` and invalid-UTF-8 document count). Not
parameters: ``shard_rows`` (the same rows, cut into other files) and the input's content (an input
edited in place under the same path is re-packed). Re-running with the same parameters resumes, or
reuses every shard of a finished pack.

Writers: :func:`write_packed` takes rows already in memory (a ``PackedRows``); :func:`write_plan`
takes a ``PackPlan`` + the flat tokens and materialises one shard of rows at a time into reused
buffers (what ``flamia pack`` uses: row memory is one shard, not the whole output). Both share
the shard loop below and produce byte-identical shards for the same packing.

Test hook: when the environment variable ``FLAMIA_TEST_CRASH_AFTER_SHARDS=N`` is set,
``write_packed``/``write_plan`` call ``os._exit(86)`` right after it has written ``N`` new shards (before the
manifest), to simulate a crash in tests. Never set it otherwise.

Reading: :func:`read_manifest`, :func:`verify` (checksums, missing/extra shards) and
:func:`iter_rows` (per-row dicts of numpy arrays, the same keys and dtypes as
:meth:`PackedRows.row`), :func:`load_packed` (everything back as one ``PackedRows``).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import pathlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from flamia_pack.errors import FlamiaError, FormatError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "COLUMNS",
    "CRASH_ENV",
    "Manifest",
    "ShardInfo",
    "default_shard_rows",
    "check_output_dir",
    "check_pack_params",
    "existing_pack",
    "pack_params",
    "write_packed",
    "write_plan",
    "read_manifest",
    "verify",
    "check_shard_schema",
    "iter_rows",
    "load_packed",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = ".flamia-pack-progress.json"
PROGRESS_EVERY_S = 1.0
"""Seconds between rewrites of the progress file during a write (a crash redoes at most this much)."""
CRASH_ENV = "FLAMIA_TEST_CRASH_AFTER_SHARDS"
SHARD_TEMPLATE = "train-{:05d}.parquet"
_SHARD_RE = re.compile(r"^train-\d{5,}\.parquet$")
_TMP_RE = re.compile(r"^\.(train-\d{5,}\.parquet|manifest\.json|\.flamia-pack-progress\.json)\.tmp-\d+$")
COLUMNS: dict[str, pa.DataType] = {
    "input_ids": pa.list_(pa.int32()),
    "position_ids": pa.list_(pa.int32()),
    "cu_seqlens": pa.list_(pa.int32()),
    "doc_ids": pa.list_(pa.int64()),
    "chunk_ids": pa.list_(pa.int32()),
    "num_tokens": pa.int32(),
}
_COMPRESSION = "zstd"
_TARGET_SHARD_BYTES = 1 << 27  # ~128 MiB of uncompressed input_ids + position_ids per shard
_TARGET_GROUP_BYTES = 1 << 24  # ~16 MiB per parquet row group
_LIST_LIMIT = 2**31 - 1  # list<int32> offsets are int32


# ---------------------------------------------------------------------------------------------
# manifest


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One shard file of an output directory (an entry of ``manifest.json``'s ``shards``)."""

    file: str
    """File name relative to the output directory, e.g. ``train-00000.parquet``."""
    rows: int
    """Packed rows (records) in the file."""
    sha256: str
    """Hex sha256 of the file's bytes."""
    content_key: str
    """Hex sha256 of the logical row content (arrays + capacity/pad_id/compression); resume key."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict."""
        return {"file": self.file, "rows": self.rows, "sha256": self.sha256, "content_key": self.content_key}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Parsed ``manifest.json`` of a packed output directory (see the module docstring).

    ``documents`` has keys in, packed, split, empty, dropped, truncated; ``tokens`` has keys in,
    packed, dropped, dropped_reasons (reason -> tokens). ``tokenizer``/``source`` are free-form
    JSON objects describing the input (e.g. ``{"name": "bytes", "vocab_size": 256}``).
    """

    format_version: int
    capacity: int
    algorithm: Optional[str]
    long_docs: Optional[str]
    pad_id: int
    tokenizer: Any
    source: Any
    documents: dict[str, int]
    tokens: dict[str, Any]
    rows: int
    fill: float
    shards: tuple[ShardInfo, ...]
    columns: dict[str, str] = field(default_factory=lambda: {k: str(v) for k, v in COLUMNS.items()})
    created: str = ""
    writer: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict, keys in the documented order."""
        return {
            "format_version": self.format_version,
            "writer": self.writer,
            "created": self.created,
            "capacity": self.capacity,
            "algorithm": self.algorithm,
            "long_docs": self.long_docs,
            "pad_id": self.pad_id,
            "tokenizer": self.tokenizer,
            "source": self.source,
            "documents": dict(self.documents),
            "tokens": dict(self.tokens),
            "rows": self.rows,
            "fill": self.fill,
            "columns": dict(self.columns),
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "manifest") -> "Manifest":
        """Validate and parse a manifest dict.

        Raises:
            FormatError: not an object, missing or mistyped key, unsupported format_version,
                shard rows not adding up to ``rows``.
        """
        if not isinstance(d, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(d).__name__}")

        def get(key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
            if key not in d:
                raise FormatError(f"{where}: missing key {key!r}")
            v = d[key]
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, types):
                raise FormatError(f"{where}: key {key!r} has the wrong type ({type(v).__name__})")
            return v

        version = get("format_version", int)
        if version != FORMAT_VERSION:
            raise FormatError(f"{where}: format_version {version} is not supported (this flamia_pack reads {FORMAT_VERSION})")
        shards_raw = get("shards", list)
        shards = []
        for i, s in enumerate(shards_raw):
            if not isinstance(s, dict):
                raise FormatError(f"{where}: shards[{i}] is not an object")
            try:
                file, rows, sha, key = s["file"], s["rows"], s["sha256"], s["content_key"]
            except KeyError as e:
                raise FormatError(f"{where}: shards[{i}] misses key {e.args[0]!r}") from None
            if not (isinstance(file, str) and _SHARD_RE.match(file)):
                raise FormatError(f"{where}: shards[{i}].file {file!r} is not a shard name like train-00000.parquet")
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
                raise FormatError(f"{where}: shards[{i}].rows must be an integer >= 0")
            if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                raise FormatError(f"{where}: shards[{i}].sha256 is not a hex sha256")
            shards.append(ShardInfo(file=file, rows=rows, sha256=sha, content_key=str(key)))
        m = cls(
            format_version=version,
            capacity=get("capacity", int),
            algorithm=get("algorithm", str, optional=True),
            long_docs=get("long_docs", str, optional=True),
            pad_id=get("pad_id", int),
            tokenizer=d.get("tokenizer"),
            source=d.get("source"),
            documents=get("documents", dict),
            tokens=get("tokens", dict),
            rows=get("rows", int),
            fill=float(get("fill", (int, float))),
            shards=tuple(shards),
            columns=get("columns", dict),
            created=str(d.get("created", "")),
            writer=str(d.get("writer", "")),
        )
        if m.capacity < 1:
            raise FormatError(f"{where}: capacity must be >= 1, got {m.capacity}")
        if sum(s.rows for s in m.shards) != m.rows:
            raise FormatError(f"{where}: shard rows add up to {sum(s.rows for s in m.shards)}, but rows is {m.rows}")
        return m


# ---------------------------------------------------------------------------------------------
# small file-system helpers


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _fsync_dir(d: pathlib.Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _atomic_target(path: pathlib.Path):
    """Yield a hidden temp path in ``path``'s directory for the caller to write and fsync; on
    success move it into place (``os.replace``) and fsync the directory; on any error (a crash
    included, as far as Python gets to run) remove the temp file and re-raise."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _atomic_write(path: pathlib.Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically: hidden temp file in the same dir, fsync, os.replace."""
    with _atomic_target(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    _atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def _sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# writing


def default_shard_rows(capacity: int) -> int:
    """Rows per shard when ``shard_rows`` is not given: about 128 MiB of uncompressed
    ``input_ids`` + ``position_ids`` per shard (256 rows at capacity 65,536), at least 1."""
    return max(1, _TARGET_SHARD_BYTES // (8 * int(capacity)))


def _check_packed(packed: Any) -> None:
    need = ("capacity", "pad_id", "input_ids", "position_ids", "num_tokens", "doc_offsets",
            "seg_lengths", "doc_ids", "chunk_ids", "stats")
    missing = [k for k in need if not hasattr(packed, k)]
    if missing:
        raise FlamiaError(f"packed must be a PackedRows, got {type(packed).__name__} (missing {', '.join(missing)})")
    n, cap = len(packed.num_tokens), int(packed.capacity)
    for name in ("input_ids", "position_ids"):
        a = getattr(packed, name)
        if a.shape != (n, cap) or a.dtype != np.int32:
            raise FlamiaError(f"packed.{name} must be int32 of shape ({n}, {cap}), got {a.dtype} {a.shape}")
    if packed.doc_offsets.shape != (n + 1,):
        raise FlamiaError(f"packed.doc_offsets must have shape ({n + 1},), got {packed.doc_offsets.shape}")
    n_segs = int(packed.doc_offsets[-1]) if n else 0
    for name in ("seg_lengths", "doc_ids", "chunk_ids"):
        if getattr(packed, name).shape[0] < n_segs:
            raise FlamiaError(f"packed.{name} has {getattr(packed, name).shape[0]} entries, needs {n_segs}")


_NP_DTYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


def _np_to_arrow(values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """Zero-copy arrow view of a 1-D numpy integer array (``from_buffers``: unlike ``pa.array``
    this does not import pandas, which costs ~1 s of CLI start-up)."""
    v = np.ascontiguousarray(values, dtype=_NP_DTYPES[value_type])
    return pa.Array.from_buffers(value_type, v.shape[0], [None, pa.py_buffer(v)])


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(_np_to_arrow(offsets, pa.int32()), _np_to_arrow(values.reshape(-1), value_type))


def _row_cu_seqlens(doc_offsets: np.ndarray, seg_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-local cu_seqlens for rows described by ``doc_offsets`` (already rebased to start at 0).

    Returns (list offsets int64 ``(n_rows + 1,)``, values int32): row r's cu_seqlens is
    ``values[off[r]:off[r + 1]]`` = ``[0, cumsum(seg_lengths of row r)]``.
    """
    n = doc_offsets.shape[0] - 1
    counts = np.diff(doc_offsets) + 1
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    g = np.zeros(seg_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(seg_lengths, out=g[1:])
    row_of = np.repeat(np.arange(n, dtype=np.int64), counts)
    within = np.arange(int(off[-1]), dtype=np.int64) - off[:-1][row_of]
    starts = doc_offsets[:-1][row_of]
    vals = (g[starts + within] - g[starts]).astype(np.int32)
    return off, vals


def _shard_arrays(packed: Any, a: int, b: int) -> dict[str, np.ndarray]:
    """Numpy views/arrays of rows [a, b) (segment arrays rebased)."""
    sa, sb = int(packed.doc_offsets[a]), int(packed.doc_offsets[b])
    return {
        "input_ids": packed.input_ids[a:b],
        "position_ids": packed.position_ids[a:b],
        "num_tokens": np.ascontiguousarray(packed.num_tokens[a:b], dtype=np.int32),
        "doc_offsets": np.asarray(packed.doc_offsets[a : b + 1], dtype=np.int64) - sa,
        "seg_lengths": np.ascontiguousarray(packed.seg_lengths[sa:sb], dtype=np.int32),
        "doc_ids": np.ascontiguousarray(packed.doc_ids[sa:sb], dtype=np.int64),
        "chunk_ids": np.ascontiguousarray(packed.chunk_ids[sa:sb], dtype=np.int32),
    }


def _content_key(arrs: dict[str, np.ndarray], capacity: int, pad_id: int) -> str:
    h = hashlib.sha256()
    header = {"format_version": FORMAT_VERSION, "capacity": capacity, "pad_id": pad_id, "compression": _COMPRESSION,
              "encoding": "plain+delta", "rows": int(arrs["num_tokens"].shape[0])}
    h.update(json.dumps(header).encode())
    for k in ("input_ids", "position_ids", "num_tokens", "doc_offsets", "seg_lengths", "doc_ids", "chunk_ids"):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrs[k]).data)
    return h.hexdigest()


def _shard_table(arrs: dict[str, np.ndarray], capacity: int, pad_id: int) -> pa.Table:
    n = int(arrs["num_tokens"].shape[0])
    row_off = np.arange(n + 1, dtype=np.int64) * capacity
    cu_off, cu_vals = _row_cu_seqlens(arrs["doc_offsets"], arrs["seg_lengths"])
    cols = {
        "input_ids": _list_array(row_off, arrs["input_ids"].reshape(-1), pa.int32()),
        "position_ids": _list_array(row_off, arrs["position_ids"].reshape(-1), pa.int32()),
        "cu_seqlens": _list_array(cu_off, cu_vals, pa.int32()),
        "doc_ids": _list_array(arrs["doc_offsets"], arrs["doc_ids"], pa.int64()),
        "chunk_ids": _list_array(arrs["doc_offsets"], arrs["chunk_ids"], pa.int32()),
        "num_tokens": _np_to_arrow(arrs["num_tokens"], pa.int32()),
    }
    meta = {"flamia_pack": json.dumps({"format_version": FORMAT_VERSION, "capacity": capacity, "pad_id": pad_id})}
    schema = pa.schema([pa.field(k, COLUMNS[k]) for k in COLUMNS], metadata=meta)
    return pa.Table.from_arrays([cols[k] for k in COLUMNS], schema=schema)


def _write_shard_file(table: pa.Table, capacity: int, path: pathlib.Path) -> str:
    """Encode ``table`` as parquet straight into a hidden temp file next to ``path`` (no in-memory
    copy of the encoded shard), fsync it, hash it and move it into place atomically, as
    :func:`_atomic_write` does. Returns the sha256 of the file's bytes."""
    import pyarrow.parquet as pq

    group_rows = max(1, _TARGET_GROUP_BYTES // (8 * capacity))
    # position_ids/cu_seqlens/doc_ids/chunk_ids are runs of +1 steps or sorted: DELTA_BINARY_PACKED
    # shrinks position_ids ~300x (sample: 4.3 MB instead of 8.1 MB per shard with dictionary
    # encoding) and writes ~1.5x faster; input_ids stay PLAIN + zstd (dictionary encoding costs
    # write time and falls back for real vocabularies). Reading speed is unchanged.
    delta = {f"{c}.list.element": "DELTA_BINARY_PACKED" for c in ("position_ids", "cu_seqlens", "doc_ids", "chunk_ids")}
    with _atomic_target(path) as tmp:
        pq.write_table(table, str(tmp), compression=_COMPRESSION, row_group_size=group_rows, use_dictionary=False,
                       column_encoding=delta)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = _sha256_file(tmp)
    return digest


def _is_ours(name: str) -> bool:
    return name in (MANIFEST_NAME, PROGRESS_NAME) or bool(_SHARD_RE.match(name)) or bool(_TMP_RE.match(name))


def _written_by_us(path: pathlib.Path) -> bool:
    """Whether ``path`` (a name :func:`_is_ours` accepts) was written by this module, by its content: a
    shard's parquet schema carries the ``flamia_pack`` metadata key, the manifest / progress file is a
    JSON object with ``format_version`` (and the manifest a ``flamia_pack`` writer). A user's own
    ``train-00000.parquet`` or ``manifest.json`` is not ours, so it is never overwritten or deleted."""
    name = path.name
    if _TMP_RE.match(name):
        return True  # hidden temporary files of an interrupted run (dot-prefixed: never a user's data file)
    if not path.is_file():
        return False
    import pyarrow.parquet as pq

    try:
        if _SHARD_RE.match(name):
            meta = pq.read_schema(path).metadata or {}
            return b"flamia_pack" in meta
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or "format_version" not in d:
            return False
        return name != MANIFEST_NAME or str(d.get("writer", "")).startswith("flamia_pack")
    except (OSError, ValueError, pa.ArrowException):
        return False


def check_output_dir(out_dir: str | os.PathLike[str]) -> None:
    """Check, without creating or changing anything, that ``write_packed`` may write to ``out_dir``:
    it is missing, or a directory holding only files this module writes (hidden files ignored). Files
    named like ours count as ours only if their content says so (:func:`_written_by_us`: a
    ``flamia_pack`` parquet metadata key, a manifest written by flamia_pack) or our own manifest /
    progress file lists them (a damaged shard that a re-run rewrites), so a source folder holding a
    user's ``train-00000.parquet`` is refused as an output directory instead of overwritten.

    Raises:
        FormatError: ``out_dir`` is a file, or holds other (non-hidden) files; those are never
            deleted or overwritten.
    """
    out = pathlib.Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise FormatError(f"output path {out} exists and is not a directory")
    # shards our own manifest / progress file lists are ours even if damaged (a re-run rewrites them);
    # a listing file not written by us lists nothing
    listed = set(_reuse_candidates(out, [n for n in (MANIFEST_NAME, PROGRESS_NAME) if _written_by_us(out / n)]))
    foreign = sorted(p.name for p in out.iterdir()
                     if not p.name.startswith(".") and not (_is_ours(p.name) and (p.name in listed or _written_by_us(p))))
    if foreign:
        raise FormatError(
            f"output directory {out} holds files that flamia pack did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new directory"
        )


def _reuse_candidates(out: pathlib.Path, names=(MANIFEST_NAME, PROGRESS_NAME)) -> dict[str, ShardInfo]:
    """Shards recorded by an earlier run in the listing files ``names`` (old manifest, then progress
    file; later wins)."""
    found: dict[str, ShardInfo] = {}
    for name in names:
        try:
            d = json.loads((out / name).read_text())
            if d.get("format_version") != FORMAT_VERSION:
                continue
            for s in d.get("shards", []):
                info = ShardInfo(file=str(s["file"]), rows=int(s["rows"]), sha256=str(s["sha256"]),
                                 content_key=str(s["content_key"]))
                found[info.file] = info
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # missing or unreadable: nothing to reuse from it
    return found


def _remove(path: pathlib.Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _check_shard_rows(shard_rows: Any, capacity: int) -> int:
    if shard_rows is None:
        shard_rows = default_shard_rows(capacity)
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, (int, np.integer)) or shard_rows < 1:
        raise FlamiaError(f"shard_rows must be an integer >= 1, got {shard_rows!r}")
    shard_rows = int(shard_rows)
    if shard_rows * capacity > _LIST_LIMIT:
        raise FlamiaError(
            f"shard_rows * capacity must be < 2**31 (int32 list offsets), got {shard_rows} * {capacity}; "
            f"use shard_rows <= {_LIST_LIMIT // capacity}"
        )
    return shard_rows


def _check_descriptions(source: Any, tokenizer: Any) -> None:
    try:
        json.dumps({"source": source, "tokenizer": tokenizer})
    except (TypeError, ValueError) as e:
        raise FormatError(f"source/tokenizer descriptions must be JSON-serialisable: {e}") from None


def pack_params(*, capacity: int, algorithm: Optional[str], long_docs: Optional[str], pad_id: int, tokenizer: Any,
                source: Any) -> dict[str, Any]:
    """The parameters that identify a pack (module docstring, "No silent replacement"), as a JSON-like
    dict: the manifest's ``capacity``, ``algorithm``, ``long_docs``, ``pad_id``, ``tokenizer`` and
    ``source``, with the counts of reading dropped from ``source`` (``num_docs``; of ``invalid_utf8``
    only its ``on_invalid`` policy is kept). Works on a manifest's raw values too."""
    src = source
    if isinstance(src, dict):
        src = {k: v for k, v in src.items() if k != "num_docs"}
        if isinstance(src.get("invalid_utf8"), dict):
            src["invalid_utf8"] = {k: v for k, v in src["invalid_utf8"].items() if k != "documents"}
    params = {"capacity": capacity, "algorithm": algorithm, "long_docs": long_docs, "pad_id": pad_id,
              "tokenizer": tokenizer, "source": src}
    try:
        return json.loads(json.dumps(params))  # as the manifest stores them (tuples become lists)
    except (TypeError, ValueError):
        return params  # not JSON-serialisable: _check_descriptions says so


def _comparable(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the input's and tokenizer's ``path`` resolved (``data.parquet`` and
    ``./data.parquet`` are the same input)."""
    out = dict(params)
    for key in ("source", "tokenizer"):
        d = out.get(key)
        if isinstance(d, dict) and isinstance(d.get("path"), str):
            out[key] = dict(d, path=os.path.realpath(d["path"]))
    return out


def _describe_value(key: str, v: Any) -> str:
    if key == "source" and isinstance(v, dict):
        extra = ", ".join(f"{k} {v[k]}" for k in ("column", "split") if v.get(k) is not None)
        return f"{v.get('path')}" + (f" ({extra})" if extra else "")
    if key == "tokenizer" and isinstance(v, dict):
        return str(v.get("path") or v.get("name"))
    return "none" if v is None else str(v)


_PARAM_LABELS = {"capacity": "capacity", "algorithm": "algorithm", "long_docs": "long docs", "pad_id": "pad id",
                 "tokenizer": "tokenizer", "source": "input"}


def existing_pack(out_dir: str | os.PathLike[str]) -> Optional[tuple[str, Optional[dict[str, Any]]]]:
    """What an earlier writer left in ``out_dir``: ``("finished", params)`` for a ``manifest.json``
    written by flamia_pack, ``("partial", params)`` for a progress file (an interrupted run; ``params``
    None if that file predates recorded parameters), None for neither (missing or empty directory).
    ``params`` as :func:`pack_params`. Reads only those two small files."""
    out = pathlib.Path(out_dir)
    for name, kind in ((MANIFEST_NAME, "finished"), (PROGRESS_NAME, "partial")):
        path = out / name
        if not _written_by_us(path):
            continue
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if kind == "finished":
            return kind, pack_params(**{k: d.get(k) for k in _PARAM_LABELS})
        params = d.get("params")
        return kind, pack_params(**params) if isinstance(params, dict) and set(params) == set(_PARAM_LABELS) else None
    return None


def check_pack_params(out_dir: str | os.PathLike[str], params: dict[str, Any], *, overwrite: bool = False,
                      how: str = "pass overwrite=True to replace it, or write to another directory") -> None:
    """Refuse to replace a pack written with other parameters (module docstring, "No silent replacement").

    Passes when ``out_dir`` holds no earlier pack, one with the same ``params`` (a re-run: it resumes
    or reuses), or ``overwrite`` is true. Reads only ``manifest.json`` and the progress file.

    Args:
        out_dir: the output directory.
        params: this run's :func:`pack_params`.
        overwrite: replace a pack of other parameters.
        how: the way out named in the error (``flamia pack`` names its ``--overwrite`` / ``--out``).

    Raises:
        FormatError: one line naming the existing pack's parameters, what differs, and ``how``.
    """
    found = existing_pack(out_dir)
    if found is None or overwrite:
        return
    kind, old = found
    what = ("a finished pack" if kind == "finished" else
            "a partial pack (an interrupted run, no manifest.json yet)")
    if old is None:
        raise FormatError(f"{out_dir} holds {what} whose parameters were not recorded (an older flamia_pack wrote "
                          f"it), so it cannot be resumed safely; {how}")
    a, b = _comparable(old), _comparable(params)
    diff = [k for k in _PARAM_LABELS if a.get(k) != b.get(k)]
    if not diff:
        return
    have = ", ".join(f"{_PARAM_LABELS[k]} {_describe_value(k, old.get(k))}" for k in _PARAM_LABELS)
    def shown(k: str) -> str:  # the short form, or all of it where that does not show the difference
        new = _describe_value(k, params.get(k))
        return new if new != _describe_value(k, old.get(k)) else json.dumps(params.get(k), sort_keys=True)

    want = ", ".join(f"{_PARAM_LABELS[k]} {shown(k)}" for k in diff)
    raise FormatError(f"{out_dir} holds {what} written with other parameters ({have}); this run has {want}. "
                      f"Re-running with the pack's parameters resumes or reuses it; {how}")


def write_packed(
    out_dir: str | os.PathLike[str],
    packed: Any,
    *,
    shard_rows: Optional[int] = None,
    source: Any = None,
    tokenizer: Any = None,
    algorithm: Optional[str] = None,
    long_docs: Optional[str] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    overwrite: bool = False,
) -> Manifest:
    """Write packed rows to ``out_dir`` as parquet shards + ``manifest.json`` (DESIGN.md §3).

    Atomic and resumable; see the module docstring for the layout, columns, crash-safety protocol
    and the ``FLAMIA_TEST_CRASH_AFTER_SHARDS`` test hook. For inputs whose rows do not fit in
    memory at once use :func:`write_plan` (same files, one shard of rows in memory at a time).

    Args:
        out_dir: output directory; created if missing. It may hold an earlier (finished or
            crashed) output of this function with the same parameters (:func:`pack_params`), which
            is resumed / replaced, reusing its matching shards; one of other parameters is an error
            unless ``overwrite``; any other non-hidden file is always an error.
        packed: a :class:`~flamia_pack.pack.PackedRows` (``input_ids``/``position_ids`` int32
            ``(n_rows, capacity)``, segment arrays, ``stats``).
        shard_rows: packed rows per shard file (>= 1; ``shard_rows * capacity < 2**31``);
            default :func:`default_shard_rows` (about 128 MiB uncompressed per shard).
        source: JSON-serialisable description of the input (e.g. ``DocumentSource.info()``).
        tokenizer: JSON-serialisable description of the tokenizer (``DocumentSource.tokenizer_info()``).
        algorithm: packing algorithm used (``"bfd"``/``"concat"``/``"balanced"``); None is recorded as null.
        long_docs: long-document policy used (``"split"``/``"truncate"``/``"drop"``); None -> null.
        progress: called as ``progress(shards_done, n_shards)`` after each shard.
        overwrite: replace an earlier pack in ``out_dir`` written with other parameters (default:
            refuse it, :func:`check_pack_params`).

    Returns:
        The :class:`Manifest` written. Zero rows give one empty shard (so the directory still
        loads with ``datasets``).

    Raises:
        FlamiaError: ``packed`` malformed, bad ``shard_rows``.
        FormatError: ``out_dir`` is a file or holds foreign files, or a pack of other parameters
            (without ``overwrite``); ``source``/``tokenizer`` not JSON-serialisable.
        OSError: the file system fails (disk full, permissions).
    """
    _check_packed(packed)
    capacity, pad_id = int(packed.capacity), int(packed.pad_id)
    shard_rows = _check_shard_rows(shard_rows, capacity)
    _check_descriptions(source, tokenizer)
    return _write_shards(
        pathlib.Path(out_dir), n_rows=len(packed.num_tokens), capacity=capacity, pad_id=pad_id,
        shard_rows=shard_rows, block=lambda a, b: _shard_arrays(packed, a, b), stats=packed.stats,
        source=source, tokenizer=tokenizer, algorithm=algorithm, long_docs=long_docs, progress=progress,
        overwrite=overwrite,
    )


def write_plan(
    out_dir: str | os.PathLike[str],
    plan: Any,
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    config: Any,
    *,
    shard_rows: Optional[int] = None,
    source: Any = None,
    tokenizer: Any = None,
    progress: Optional[Callable[[int, int], None]] = None,
    validate: bool = True,
    overwrite: bool = False,
) -> Manifest:
    """Write a packing plan to ``out_dir``, materialising one shard of rows at a time (DESIGN.md §3).

    The bounded-memory writer behind ``flamia pack``: for every shard the rows are copied with
    :func:`flamia_pack.pack.fill_rows` into two reused ``(shard_rows, capacity)`` int32 buffers,
    encoded and written, so row memory is ``8 * shard_rows * capacity`` bytes (128 MiB by
    default) instead of ``8 * rows * capacity``. The files, manifest, atomicity and resume
    behaviour are exactly those of :func:`write_packed` on ``pack_flat(tokens, doc_offsets,
    config)`` (byte-identical shards).

    Args:
        out_dir: output directory, as for :func:`write_packed`.
        plan: a :class:`~flamia_pack.pack.PackPlan` from ``plan_packing(np.diff(doc_offsets), config)``.
        tokens: 1-D integer array ``(total_tokens,)`` holding every document end to end.
        doc_offsets: int ``(n_docs + 1,)``: document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i + 1]]``
            (e.g. from ``DocumentSource.read_flat``).
        config: the :class:`~flamia_pack.pack.PackConfig` of the plan; its ``algorithm`` and
            ``long_docs`` go into the manifest.
        shard_rows, source, tokenizer, progress, overwrite: as for :func:`write_packed`.
        validate: check every copied token id is in ``[0, 2**31)`` (fused with the copy).

    Returns:
        The :class:`Manifest` written.

    Raises:
        FlamiaError: ``plan``/``config`` of the wrong type or not matching; bad ``shard_rows``;
            shard buffers larger than half the available memory.
        SourceError: a token id out of range (with ``validate``); the output is then left
            incomplete (no manifest).
        FormatError, OSError: as for :func:`write_packed`.
    """
    from flamia_pack.pack import PackConfig, PackPlan, _check_row_memory, fill_rows

    if not isinstance(plan, PackPlan):
        raise FlamiaError(f"plan must be a PackPlan, got {type(plan).__name__}")
    if not isinstance(config, PackConfig):
        raise FlamiaError(f"config must be a PackConfig, got {type(config).__name__}")
    capacity, pad_id = config.capacity, config.pad_id
    if plan.stats.capacity != capacity:
        raise FlamiaError(f"plan was made for capacity {plan.stats.capacity}, config has {capacity}")
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.shape[0] != plan.stats.docs_in + 1:
        raise FlamiaError(f"doc_offsets must have shape ({plan.stats.docs_in + 1},) (the plan's documents + 1), "
                          f"got {offsets.shape}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise FlamiaError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    lengths = np.diff(offsets)
    if offsets.size and (offsets[0] < 0 or offsets[-1] > tokens.shape[0] or (lengths.size and lengths.min() < 0)):
        raise FlamiaError("doc_offsets must be non-decreasing, start >= 0 and end <= len(tokens)")
    if plan.n_segs and not np.all(plan.seg_src_start + plan.seg_len <= lengths[plan.seg_doc]):
        raise FlamiaError("plan does not match doc_offsets (a segment reaches past its document); "
                          "make it with plan_packing(np.diff(doc_offsets), config)")
    shard_rows = _check_shard_rows(shard_rows, capacity)
    _check_descriptions(source, tokenizer)
    n_buf = min(shard_rows, plan.n_rows)
    _check_row_memory(n_buf, capacity)
    ids_buf = np.empty((n_buf, capacity), dtype=np.int32)
    pos_buf = np.empty((n_buf, capacity), dtype=np.int32)

    def block(a: int, b: int) -> dict[str, np.ndarray]:
        rows = fill_rows(plan, tokens, offsets, config, a, b, input_ids=ids_buf, position_ids=pos_buf,
                         validate=validate)
        return _shard_arrays(rows, 0, b - a)

    return _write_shards(
        pathlib.Path(out_dir), n_rows=plan.n_rows, capacity=capacity, pad_id=pad_id, shard_rows=shard_rows,
        block=block, stats=plan.stats, source=source, tokenizer=tokenizer, algorithm=config.algorithm,
        long_docs=config.long_docs, progress=progress, overwrite=overwrite,
    )


def _write_shards(
    out: pathlib.Path,
    *,
    n_rows: int,
    capacity: int,
    pad_id: int,
    shard_rows: int,
    block: Callable[[int, int], dict[str, np.ndarray]],
    stats: Any,
    source: Any,
    tokenizer: Any,
    algorithm: Optional[str],
    long_docs: Optional[str],
    progress: Optional[Callable[[int, int], None]],
    overwrite: bool = False,
) -> Manifest:
    """The crash-safe shard loop shared by :func:`write_packed` and :func:`write_plan`:
    ``block(a, b)`` returns the arrays of rows ``[a, b)`` (see :func:`_shard_arrays`), valid
    until the next call."""
    params = pack_params(capacity=capacity, algorithm=algorithm, long_docs=long_docs, pad_id=pad_id,
                         tokenizer=tokenizer, source=source)
    check_output_dir(out)
    check_pack_params(out, params, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    reuse = _reuse_candidates(out)
    # the run's parameters first, so that an interrupted run is always a partial pack of known parameters
    # (the old manifest's shards stay listed: a crash before the first new shard still reuses them)
    _atomic_write_json(out / PROGRESS_NAME, {"format_version": FORMAT_VERSION, "params": params,
                                             "shards": [s.to_dict() for s in reuse.values()]})
    _remove(out / MANIFEST_NAME)  # from here on the directory is "incomplete"
    for p in out.iterdir():
        if _TMP_RE.match(p.name):
            _remove(p)
    _fsync_dir(out)

    n_shards = max(1, math.ceil(n_rows / shard_rows))
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    shards: list[ShardInfo] = []
    written = 0
    # the progress file lists every shard so far; rewriting (and fsyncing) it after each shard made
    # runs of thousands of small shards quadratic (6,719 shards: 79 of 90 s), so it is rewritten at
    # most every PROGRESS_EVERY_S seconds (and before the crash hook): a crash loses at most that
    # much finished work, which the re-run redoes (shards not listed are rewritten, never trusted)
    last_progress = float("-inf")
    for i in range(n_shards):
        a, b = i * shard_rows, min(n_rows, (i + 1) * shard_rows)
        name = SHARD_TEMPLATE.format(i)
        arrs = block(a, b)
        key = _content_key(arrs, capacity, pad_id)
        old = reuse.get(name)
        path = out / name
        if old is not None and old.content_key == key and old.rows == b - a and path.is_file() and _sha256_file(path) == old.sha256:
            info = old
        else:
            digest = _write_shard_file(_shard_table(arrs, capacity, pad_id), capacity, path)
            info = ShardInfo(file=name, rows=b - a, sha256=digest, content_key=key)
            written += 1
        shards.append(info)
        crash = bool(crash_after) and written >= crash_after
        if crash or time.monotonic() - last_progress >= PROGRESS_EVERY_S:
            _atomic_write_json(out / PROGRESS_NAME, {"format_version": FORMAT_VERSION, "params": params,
                                                     "shards": [s.to_dict() for s in shards]})
            last_progress = time.monotonic()
        if crash:
            os._exit(86)  # test hook, see module docstring
        if progress is not None:
            progress(i + 1, n_shards)

    keep = {s.file for s in shards}
    for p in out.iterdir():
        if _SHARD_RE.match(p.name) and p.name not in keep:
            _remove(p)

    st = stats
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        writer=f"flamia_pack {_version()}",
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        capacity=capacity,
        algorithm=algorithm,
        long_docs=long_docs,
        pad_id=pad_id,
        tokenizer=tokenizer,
        source=source,
        documents={
            "in": int(st.docs_in), "packed": int(st.docs_packed), "split": int(st.docs_split),
            "empty": int(st.docs_empty), "dropped": int(st.docs_dropped), "truncated": int(st.docs_truncated),
        },
        tokens={
            "in": int(st.tokens_in), "packed": int(st.tokens_packed), "dropped": int(st.tokens_dropped),
            "dropped_reasons": {str(k): int(v) for k, v in dict(st.dropped_reasons).items()},
        },
        rows=n_rows,
        fill=float(st.fill),
        shards=tuple(shards),
    )
    _atomic_write_json(out / MANIFEST_NAME, manifest.to_dict())
    _remove(out / PROGRESS_NAME)
    _fsync_dir(out)
    return manifest


def _version() -> str:
    try:
        from flamia_pack import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


# ---------------------------------------------------------------------------------------------
# reading


def read_manifest(out_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``OUT/manifest.json`` (does not touch the shards; see :func:`verify`).

    Raises:
        FormatError: directory or manifest missing (an incomplete output: crashed or still
            running), ``out_dir`` is a file (e.g. one shard instead of its directory), not valid JSON, or not a valid manifest (see :meth:`Manifest.from_dict`).
    """
    out = pathlib.Path(out_dir)
    if not out.is_dir():
        if out.exists():
            raise FormatError(f"{out} is a file, expected a packed directory (manifest.json + train-*.parquet shards "
                              "written by flamia pack)")
        raise FormatError(f"packed directory not found: {out}")
    path = out / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FormatError(
            f"no {MANIFEST_NAME} in {out}: not a flamia pack output, or an incomplete one (crashed or still "
            "running; re-run flamia pack to finish it)"
        ) from None
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e}") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise FormatError(f"{path} is not valid JSON: {e}") from None
    return Manifest.from_dict(d, where=str(path))


def verify(out_dir: str | os.PathLike[str]) -> Manifest:
    """Check that ``out_dir`` is a complete, intact packed output.

    Reads the manifest, checks that every listed shard exists, hashes to its ``sha256``, holds
    the listed number of rows and the manifest's columns with their types (parquet footer), and
    that no unlisted ``train-*.parquet`` file is present (``datasets`` would load it).

    Returns:
        The :class:`Manifest`.

    Raises:
        FormatError: bad/missing manifest, missing shard, checksum mismatch, wrong row count,
            missing or mistyped column or columns other than the manifest's, unlisted shard file.
    """
    out = pathlib.Path(out_dir)
    m = read_manifest(out)
    for s in m.shards:
        p = out / s.file
        if not p.is_file():
            raise FormatError(f"shard {s.file} listed in {out / MANIFEST_NAME} is missing")
        got = _sha256_file(p)
        if got != s.sha256:
            raise FormatError(f"checksum mismatch for shard {p}: sha256 {got[:16]}..., manifest says {s.sha256[:16]}...")
        _check_shard_rows_match(p, _shard_num_rows(out, s, manifest=m), s)
    listed = {s.file for s in m.shards}
    extra = sorted(p.name for p in out.iterdir() if _SHARD_RE.match(p.name) and p.name not in listed)
    if extra:
        raise FormatError(f"{out} holds shard files not listed in its manifest: {', '.join(extra[:3])}")
    return m


def _list_parts(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64, values) of a list array; values zero-copy when possible."""
    offsets = np.asarray(col.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = col.values
    try:
        v = values.to_numpy(zero_copy_only=True)
    except pa.ArrowInvalid:  # pragma: no cover - only with nulls, which we never write
        v = values.to_numpy(zero_copy_only=False)
    return offsets, v


def iter_rows(
    out_dir: str | os.PathLike[str],
    *,
    columns: Optional[Sequence[str]] = None,
    verify_checksums: bool = False,
    batch_rows: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield the packed rows of ``out_dir`` in order, one dict of numpy arrays per row.

    Each dict has the keys and dtypes of :meth:`PackedRows.row`: ``input_ids`` (int32,
    ``(capacity,)``), ``position_ids`` (int32, ``(capacity,)``), ``cu_seqlens`` (int32,
    ``(n_docs + 1,)``), ``doc_ids`` (int64, ``(n_docs,)``), ``chunk_ids`` (int32, ``(n_docs,)``),
    ``num_tokens`` (int32 0-d array) -- restricted to ``columns`` when given. Arrays are
    read-only zero-copy views into pyarrow buffers (copy them to modify or keep past the batch).

    Args:
        out_dir: a complete output directory (its manifest lists the shards in row order).
        columns: subset of :data:`COLUMNS` to read (default all).
        verify_checksums: run :func:`verify` first. Without it every shard's row count and
            schema (parquet footer only, :func:`check_shard_schema`) are still checked against the
            manifest before the first row is yielded.
        batch_rows: rows per parquet read batch (memory: ``batch_rows * capacity * 8`` bytes).

    Raises:
        FormatError: bad manifest, missing or unreadable/corrupt shard, a shard whose row count
            or columns differ from the manifest's or that lacks or mistypes a column (or any
            :func:`verify` error when ``verify_checksums``), unknown column.
    """
    out = pathlib.Path(out_dir)
    m = verify(out) if verify_checksums else read_manifest(out)
    cols = list(COLUMNS) if columns is None else list(columns)
    unknown = [c for c in cols if c not in COLUMNS]
    if unknown:
        raise FormatError(f"unknown column(s) {', '.join(unknown)}; available: {', '.join(COLUMNS)}")
    if not verify_checksums:  # verify() checked the row counts and schemas already
        for s in m.shards:
            _check_shard_rows_match(out / s.file, _shard_num_rows(out, s, cols, m), s)
    for s in m.shards:
        yield from _iter_shard_rows(out, s, cols, batch_rows)


_LIST_FIELD_RE = re.compile(r"(list<)[A-Za-z_][A-Za-z0-9_]*: ")


def check_shard_schema(
    path: str | os.PathLike[str], schema: pa.Schema, *, columns: Optional[Sequence[str]] = None,
    manifest: Optional[Manifest] = None,
) -> None:
    """Check a packed shard's arrow schema before its data is used.

    Args:
        path: the shard (named in the error).
        schema: its arrow schema (parquet footer or a read table).
        columns: the columns the reader needs (default: all of :data:`COLUMNS`); each must be
            present with its :data:`COLUMNS` type.
        manifest: when given, the shard's columns and types must also be the manifest's ``columns``.

    Raises:
        FormatError: naming the shard and the missing or mistyped column(s), or the columns in
            which the shard and the manifest differ.
    """
    need = list(COLUMNS) if columns is None else list(columns)
    have = {f.name: f.type for f in schema}
    missing = [c for c in need if c not in have]
    if missing:
        raise FormatError(f"shard {path} lacks column(s) {', '.join(missing)} (it has: {', '.join(have) or 'none'}); "
                          f"a packed shard holds {', '.join(COLUMNS)}; re-run flamia pack")
    wrong = [f"{c} is {have[c]}, expected {COLUMNS[c]}" for c in need if c in COLUMNS and not have[c].equals(COLUMNS[c])]
    if wrong:
        raise FormatError(f"shard {path} has mistyped column(s): {'; '.join(wrong)}; re-run flamia pack")
    if manifest is not None:
        # list field names ("item", or "element" as parquet stores them) are not part of the type
        got = {k: _LIST_FIELD_RE.sub(r"\1", str(v)) for k, v in have.items()}
        want = {k: _LIST_FIELD_RE.sub(r"\1", str(v)) for k, v in manifest.columns.items()}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))
            names = ", ".join(dict.fromkeys(k for k, _ in diff))
            raise FormatError(f"shard {path} has other columns than its manifest (differing: {names}; shard: "
                              f"{', '.join(f'{k} {v}' for k, v in got.items())}; manifest: "
                              f"{', '.join(f'{k} {v}' for k, v in want.items())}); re-run flamia pack")


def _shard_num_rows(out: pathlib.Path, s: ShardInfo, columns: Optional[Sequence[str]] = None,
                    manifest: Optional[Manifest] = None) -> int:
    """Rows of shard ``s`` from its parquet footer (no data read), after :func:`check_shard_schema`."""
    import pyarrow.parquet as pq

    p = out / s.file
    try:
        meta = pq.read_metadata(p)
        schema = meta.schema.to_arrow_schema()
    except FileNotFoundError:
        raise FormatError(f"shard {s.file} listed in {out / MANIFEST_NAME} is missing") from None
    except (pa.ArrowException, OSError) as e:
        raise FormatError(f"shard {p} is not readable parquet: {_one_line(e)}") from None
    check_shard_schema(p, schema, columns=columns, manifest=manifest)
    return meta.num_rows


def _check_shard_rows_match(p: pathlib.Path, n: int, s: ShardInfo) -> None:
    """The row-count check of :func:`verify` and of the readers that skip the checksums: the shard's
    row count (parquet footer) must be the manifest's (catches a shard replaced by another one)."""
    if n != s.rows:
        raise FormatError(f"shard {p} holds {n} rows, manifest says {s.rows} (the file was replaced or "
                          "rewritten; re-run flamia pack)")


def _iter_shard_rows(out: pathlib.Path, s: ShardInfo, cols: list[str], batch_rows: int) -> Iterator[dict[str, np.ndarray]]:
    import pyarrow.parquet as pq

    p = out / s.file
    try:
        pf = pq.ParquetFile(p)
        batches = pf.iter_batches(batch_size=batch_rows, columns=cols)
    except FileNotFoundError:
        raise FormatError(f"shard {s.file} listed in {out / MANIFEST_NAME} is missing") from None
    except (pa.ArrowException, OSError) as e:
        raise FormatError(f"shard {p} is not readable parquet: {_one_line(e)}") from None
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"shard {p} is corrupt: {_one_line(e)} (run verify() / re-run flamia pack)") from None
        if batch is None:
            return
        parts = {}
        for c in cols:
            col = batch.column(c)
            if c == "num_tokens":
                parts[c] = (None, col.to_numpy(zero_copy_only=False).astype(np.int32, copy=False))
            else:
                parts[c] = _list_parts(col)
        for i in range(batch.num_rows):
            row = {}
            for c in cols:
                off, v = parts[c]
                row[c] = np.asarray(v[i], dtype=np.int32) if off is None else v[off[i] : off[i + 1]]
            yield row


def load_packed(out_dir: str | os.PathLike[str], *, verify_checksums: bool = True):
    """Read a whole output directory back into one :class:`~flamia_pack.pack.PackedRows`.

    Stats are rebuilt from the manifest. Memory: ``rows * capacity * 8`` bytes plus metadata.

    Raises:
        FormatError: as :func:`verify` (when ``verify_checksums``) / :func:`read_manifest`; without
            ``verify_checksums``, a missing or corrupt shard, one whose row count or columns differ
            from the manifest's, or one that lacks or mistypes a column.
    """
    import pyarrow.parquet as pq

    from flamia_pack.pack import PackedRows, PackStats

    out = pathlib.Path(out_dir)
    m = verify(out) if verify_checksums else read_manifest(out)
    tables = []
    for s in m.shards:
        try:
            tables.append(pq.read_table(out / s.file))
        except FileNotFoundError:
            raise FormatError(f"shard {s.file} listed in {out / MANIFEST_NAME} is missing") from None
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"shard {out / s.file} is corrupt: {_one_line(e)}") from None
        check_shard_schema(out / s.file, tables[-1].schema, manifest=m)
        _check_shard_rows_match(out / s.file, tables[-1].num_rows, s)
    table = pa.concat_tables(tables) if tables else None
    cap, n = m.capacity, m.rows

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        arr = table.column(name).combine_chunks()
        return _list_parts(arr)

    if n:
        ids_off, ids = flat("input_ids")
        _, pos = flat("position_ids")
        seg_off, doc_ids = flat("doc_ids")
        _, chunk_ids = flat("chunk_ids")
        cu_off, cu = flat("cu_seqlens")
        base = ids_off[0]
        input_ids = np.array(ids[base : base + n * cap], dtype=np.int32).reshape(n, cap)
        position_ids = np.array(pos[base : base + n * cap], dtype=np.int32).reshape(n, cap)
        doc_ids = np.array(doc_ids[seg_off[0] : seg_off[-1]], dtype=np.int64)
        chunk_ids = np.array(chunk_ids[seg_off[0] : seg_off[-1]], dtype=np.int32)
        doc_offsets = seg_off - seg_off[0]
        # segment lengths from the per-row cu_seqlens: drop each row's leading 0
        d = np.diff(cu[cu_off[0] : cu_off[-1]].astype(np.int64))
        row_first = (cu_off[:-1] - cu_off[0])  # index of each row's leading 0
        keep = np.ones(d.shape[0], dtype=bool)
        keep[row_first[1:] - 1] = False  # the jump from one row's end to the next row's 0
        seg_lengths = d[keep].astype(np.int32)
        num_tokens = table.column("num_tokens").to_numpy().astype(np.int32)
    else:
        input_ids = position_ids = np.zeros((0, cap), dtype=np.int32)
        doc_ids = np.zeros(0, np.int64)
        chunk_ids = seg_lengths = num_tokens = np.zeros(0, np.int32)
        doc_offsets = np.zeros(1, np.int64)
    docs, toks = m.documents, m.tokens
    stats = PackStats(
        docs_in=docs.get("in", 0), docs_packed=docs.get("packed", 0), docs_split=docs.get("split", 0),
        docs_empty=docs.get("empty", 0), docs_dropped=docs.get("dropped", 0),
        docs_truncated=docs.get("truncated", 0), tokens_in=toks.get("in", 0),
        tokens_packed=toks.get("packed", 0), tokens_dropped=toks.get("dropped", 0), rows=n, capacity=cap,
        fill=m.fill, dropped_reasons=dict(toks.get("dropped_reasons", {})),
    )
    return PackedRows(
        capacity=cap, pad_id=m.pad_id, input_ids=input_ids, position_ids=position_ids,
        num_tokens=num_tokens, doc_offsets=np.asarray(doc_offsets, dtype=np.int64),
        seg_lengths=seg_lengths, doc_ids=doc_ids, chunk_ids=chunk_ids, stats=stats,
    )
