"""Packed-row datasets for training: read packed parquet, or pack a source on the fly (DESIGN.md §2-3).

Two ``torch.utils.data.IterableDataset`` classes, both yielding ONE packed row per item as a dict
of CPU tensors (the layout of DESIGN.md §3 / :meth:`flamia_pack.pack.PackedRows.row`):

=================  =========================  =================================================
key                dtype, shape               meaning
=================  =========================  =================================================
``input_ids``      int32 ``(capacity,)``      token ids; ``pad_id`` past ``num_tokens``
``position_ids``   int32 ``(capacity,)``      position inside the segment (restarts at 0), 0 on padding
``cu_seqlens``     int32 ``(n_docs + 1,)``    row-local segment offsets, ``[0, ..., num_tokens]``
``doc_ids``        int64 ``(n_docs,)``        source document index of every segment
``chunk_ids``      int32 ``(n_docs,)``        piece index of every segment inside its document
``num_tokens``     int32 ``()``               tokens used in the row (the rest is padding)
=================  =========================  =================================================

:class:`PackedDataset` reads a packed output directory (``manifest.json`` + ``shard-*.parquet``,
written by :mod:`flamia_pack.formats`) with pyarrow only (no ``datasets`` import).
:class:`StreamingPackedDataset` packs documents from any source of :func:`open_source` on the
fly with a bounded look-ahead buffer (online best fit, see its docstring).

Exact resume
------------
Both classes implement ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``
protocol), so ``torchdata.stateful_dataloader.StatefulDataLoader`` checkpoints them, workers
included: each DataLoader worker holds its own copy of the dataset, and its ``state_dict`` is the
position of THAT worker's stream. The state is a small dict of plain ints/lists (JSON- and
``torch.save``-able). ``load_state_dict`` followed by ``iter()`` continues exactly where the saved
stream stopped; repeated save -> load -> advance cycles continue from the latest state (never
from the start of the epoch). A state saved after the stream ran to its end resumes at the start
of the next epoch. Resuming needs the same data, seed, shuffle
flag, rank/world size and number of DataLoader workers; a mismatch raises ``FlamiaError``.

Sharding and epochs
-------------------
A *shard* is one (rank, worker) pair: ``shard = rank * num_workers + worker_id`` of
``world_size * num_workers``. The rank and world size are given, else taken from
``torch.distributed`` when it is initialised, else (0, 1); the worker from
``torch.utils.data.get_worker_info()``. Every row (PackedDataset) or document
(StreamingPackedDataset) goes to exactly one shard per epoch.

Epochs: ``set_epoch(epoch)`` selects an epoch (as with ``DistributedSampler``), and a dataset copy
whose iteration runs to the end moves itself to the next epoch (position 0), so the next
``iter()`` gives a new shuffle. Call ``set_epoch`` before each epoch when DataLoader workers are
not persistent (each ``iter()`` then re-creates the workers from the main process's copy, which
only ``set_epoch`` advances); with ``persistent_workers=True`` the workers advance on their own.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from flamia_pack.errors import FlamiaError, FormatError, SourceError

__all__ = ["PackedDataset", "StreamingPackedDataset", "ROW_KEYS"]

#: keys of every item yielded by both datasets.
ROW_KEYS = ("input_ids", "position_ids", "cu_seqlens", "doc_ids", "chunk_ids", "num_tokens")
#: list columns of a packed parquet shard (plus the scalar ``num_tokens``), DESIGN.md §3.
_LIST_COLUMNS = ("input_ids", "position_ids", "cu_seqlens", "doc_ids", "chunk_ids")
_ROW_DTYPES = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "cu_seqlens": np.int32,
    "doc_ids": np.int64,
    "chunk_ids": np.int32,
}
_STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# shared helpers: shard identity, argument checks
# ---------------------------------------------------------------------------------------------
def _check_int(value: Any, name: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FlamiaError(f"{name} must be an integer >= {lo}, got {value!r}")
    if int(value) < lo:
        raise FlamiaError(f"{name} must be an integer >= {lo}, got {value}")
    return int(value)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):  # bool("no") is True: a string would silently shuffle
        raise FlamiaError(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")
    return bool(value)


def _resolve_rank(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world_size): the given values, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise FlamiaError(f"give both rank and world_size or neither (got rank={rank}, world_size={world_size})")
    rank = _check_int(rank, "rank")
    world_size = _check_int(world_size, "world_size", 1)
    if rank >= world_size:
        raise FlamiaError(f"rank must be < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def _shard_identity(rank: Optional[int], world_size: Optional[int]) -> dict[str, int]:
    r, w = _resolve_rank(rank, world_size)
    info = get_worker_info()
    wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
    return {"rank": r, "world_size": w, "worker_id": wid, "num_workers": nw,
            "shard": r * nw + wid, "num_shards": w * nw}


def _no_random_access(ds: Any, index: Any) -> None:
    """``ds[index]`` on an iterable-only dataset: a clear TypeError instead of torch's
    ``NotImplementedError`` from ``Dataset.__getitem__``."""
    raise TypeError(
        f"{type(ds).__name__} is an IterableDataset and has no random access ({type(ds).__name__}[{index!r}]): "
        "iterate it (`for row in ds`, `next(iter(ds))`) or pass it to a DataLoader; for rows by index "
        "of a packed directory use flamia_pack.formats.iter_rows or load_packed(...).row(i)"
    )


def _check_state(state: Any, kind: str, expect: dict[str, Any]) -> None:
    """Raise FlamiaError unless ``state`` is a ``kind`` state whose config entries equal ``expect``."""
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise FlamiaError(f"not a {kind} state_dict (kind={got!r})")
    if state.get("version") != _STATE_VERSION:
        raise FlamiaError(f"{kind} state_dict version {state.get('version')!r} is not supported (expected {_STATE_VERSION})")
    for key, want in expect.items():
        if state.get(key) != want:
            raise FlamiaError(
                f"cannot resume {kind} exactly: the checkpoint has {key}={state.get(key)!r} but this "
                f"dataset/loader has {key}={want!r} (resume with the same data, seed, shuffle, "
                "rank/world size and number of DataLoader workers)"
            )


# ---------------------------------------------------------------------------------------------
# PackedDataset: packed parquet shards -> rows
# ---------------------------------------------------------------------------------------------
def _manifest_field(manifest: Any, name: str) -> Any:
    if isinstance(manifest, dict):
        if name not in manifest:
            raise FormatError(f"manifest.json has no {name!r} field")
        return manifest[name]
    if not hasattr(manifest, name):
        raise FormatError(f"manifest has no {name!r} field")
    return getattr(manifest, name)


def _shard_entries(manifest: Any) -> list[tuple[str, int, Optional[str]]]:
    shards = _manifest_field(manifest, "shards")
    out = []
    for i, s in enumerate(shards):
        get = (lambda k, s=s: s.get(k)) if isinstance(s, dict) else (lambda k, s=s: getattr(s, k, None))
        name, rows = get("file"), get("rows")
        if not isinstance(name, str) or isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise FormatError(f"manifest.json shard entry {i} must have 'file' (str) and 'rows' (int >= 0), got {s!r}")
        out.append((name, rows, get("sha256")))
    return out


class _ParquetRows:
    """Random access to packed rows across parquet shards, by row group, with a small LRU cache.

    Picklable (DataLoader workers): only paths and metadata arrays are pickled; open files and
    decoded row groups are per process.
    """

    def __init__(self, files: list[pathlib.Path], rows: list[int], capacity: int, cache_groups: int):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from flamia_pack.formats import check_shard_schema

        self.files = [str(f) for f in files]
        self.capacity = capacity
        self.cache_groups = cache_groups
        g_file, g_rg, g_rows = [], [], []
        for fi, (f, n_expected) in enumerate(zip(files, rows)):
            try:
                pf = pq.ParquetFile(f)
                meta, schema = pf.metadata, pf.schema_arrow
            except (pa.ArrowException, OSError) as e:
                raise FormatError(f"cannot read packed shard {f}: {' '.join(str(e).split())} (corrupt or not parquet)") from None
            check_shard_schema(f, schema, columns=(*_LIST_COLUMNS, "num_tokens"))  # missing or mistyped columns
            if meta.num_rows != n_expected:
                raise FormatError(f"packed shard {f} has {meta.num_rows} rows but manifest.json says {n_expected}")
            for g in range(meta.num_row_groups):
                g_file.append(fi)
                g_rg.append(g)
                g_rows.append(meta.row_group(g).num_rows)
        self.g_file = np.asarray(g_file, dtype=np.int64)
        self.g_rg = np.asarray(g_rg, dtype=np.int64)
        self.g_start = np.zeros(len(g_rows) + 1, dtype=np.int64)
        np.cumsum(np.asarray(g_rows, dtype=np.int64), out=self.g_start[1:])
        self.num_rows = int(self.g_start[-1])
        self._reset_cache()

    def _reset_cache(self) -> None:
        self._handles: dict[int, Any] = {}
        self._cache: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_handles", None)
        d.pop("_cache", None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._reset_cache()

    @property
    def num_groups(self) -> int:
        return int(self.g_file.shape[0])

    def group_rows(self, g: int) -> tuple[int, int]:
        """Global row range ``[start, end)`` of row group ``g``."""
        return int(self.g_start[g]), int(self.g_start[g + 1])

    def _decode(self, g: int) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fi = int(self.g_file[g])
        path = self.files[fi]
        try:
            pf = self._handles.get(fi)
            if pf is None:
                pf = self._handles[fi] = pq.ParquetFile(path)
            table = pf.read_row_group(int(self.g_rg[g]), columns=[*_LIST_COLUMNS, "num_tokens"])
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot read row group {int(self.g_rg[g])} of packed shard {path}: {' '.join(str(e).split())}") from None
        out: dict[str, Any] = {}
        for name in _LIST_COLUMNS:
            col = table.column(name)
            arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
                raise FormatError(f"column {name!r} of packed shard {path} must be a list column, got {arr.type}")
            out[name] = (arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False),
                         arr.values.to_numpy(zero_copy_only=False))
        out["num_tokens"] = table.column("num_tokens").to_numpy()
        out["path"] = path
        return out

    def group(self, g: int) -> dict[str, Any]:
        hit = self._cache.get(g)
        if hit is not None:
            self._cache.move_to_end(g)
            return hit
        dec = self._decode(g)
        self._cache[g] = dec
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return dec

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index`` (global, manifest order) as a dict of fresh CPU tensors (see module doc)."""
        g = int(np.searchsorted(self.g_start, index, side="right")) - 1
        dec = self.group(g)
        k = index - int(self.g_start[g])
        item: dict[str, torch.Tensor] = {}
        for name in _LIST_COLUMNS:
            offsets, values = dec[name]
            a, b = int(offsets[k]), int(offsets[k + 1])
            item[name] = torch.from_numpy(np.array(values[a:b], dtype=_ROW_DTYPES[name]))
        n = int(dec["num_tokens"][k])
        item["num_tokens"] = torch.tensor(n, dtype=torch.int32)
        cap = self.capacity
        if item["input_ids"].shape[0] != cap or item["position_ids"].shape[0] != cap:
            raise FormatError(
                f"row {index} of packed shard {dec['path']} has {item['input_ids'].shape[0]} input_ids and "
                f"{item['position_ids'].shape[0]} position_ids; manifest capacity is {cap}"
            )
        cu = item["cu_seqlens"]
        nd = cu.shape[0] - 1
        if nd < 0 or int(cu[0]) != 0 or int(cu[-1]) != n or n > cap or item["doc_ids"].shape[0] != nd \
                or item["chunk_ids"].shape[0] != nd:
            raise FormatError(
                f"row {index} of packed shard {dec['path']}: inconsistent varlen metadata (cu_seqlens "
                f"[{int(cu[0]) if nd >= 0 else '-'}..{int(cu[-1]) if nd >= 0 else '-'}], num_tokens {n}, "
                f"{item['doc_ids'].shape[0]} doc_ids, {item['chunk_ids'].shape[0]} chunk_ids, capacity {cap})"
            )
        return item


class PackedDataset(IterableDataset):
    """Rows of a packed output directory (``manifest.json`` + parquet shards), DESIGN.md §2-3.

    Each item is one packed row: a dict of CPU tensors with the keys :data:`ROW_KEYS` (dtypes
    and shapes in the module docstring). Reading uses pyarrow only, row group by row group, with
    a small per-process cache of decoded row groups (``cache_groups``).

    Order: without ``shuffle`` the rows come in manifest order (shard files, then rows). With
    ``shuffle`` the order of epoch ``e`` is a seeded *block shuffle*: the parquet row groups are
    permuted, then the rows inside each row group (``numpy`` ``default_rng((seed, e))``), so that
    each row group is decoded once per epoch (no read amplification). The epoch's order is then
    cut into ``world_size * num_workers`` contiguous balanced slices (sizes differ by at most one),
    one per (rank, worker) shard, so every row is seen exactly once per epoch across ranks and
    workers. Ranks may therefore get one row more than others; use ``len(dataset)`` (rows of this
    rank) to align step counts if needed.

    Args:
        data_dir: packed output directory.
        shuffle: seeded per-epoch block shuffle (see above); default False.
        seed: base seed of the shuffle (int >= 0).
        rank, world_size: this process's data-parallel rank; both or neither. Default: from
            ``torch.distributed`` when initialised, else (0, 1).
        verify: check every shard's sha256 against the manifest once at construction
            (``flamia_pack.formats.verify``; reads all data once). Row counts, columns and the
            presence of every shard are checked in any case.
        cache_groups: decoded row groups kept per process (>= 1).

    Raises:
        FormatError: unreadable or malformed ``manifest.json``, a missing shard, a checksum
            mismatch (``verify=True``), a shard whose row count/columns disagree with the
            manifest; later, while iterating, a corrupt row group or a row with inconsistent
            varlen metadata.
        FlamiaError: bad arguments.
    """

    def __init__(
        self,
        data_dir: Union[str, os.PathLike[str]],
        *,
        shuffle: bool = False,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        verify: bool = True,
        cache_groups: int = 2,
    ) -> None:
        from flamia_pack import formats

        super().__init__()
        self.data_dir = pathlib.Path(data_dir)
        self.shuffle = _check_bool(shuffle, "shuffle")
        verify = _check_bool(verify, "verify")
        self.seed = _check_int(seed, "seed")
        if rank is not None or world_size is not None:
            _resolve_rank(rank, world_size)  # validate now
        self._rank, self._world_size = rank, world_size
        cache_groups = _check_int(cache_groups, "cache_groups", 1)
        manifest = formats.read_manifest(self.data_dir)
        self.manifest = manifest
        self.capacity = _check_manifest_int(manifest, "capacity", 1)
        self.pad_id = int(_manifest_field(manifest, "pad_id"))
        entries = _shard_entries(manifest)
        files = []
        for name, _rows, _sha in entries:
            f = self.data_dir / name
            if not f.is_file():
                raise FormatError(f"missing shard {f} (listed in {self.data_dir / 'manifest.json'}); re-run `flamia pack`")
            files.append(f)
        if verify:
            formats.verify(self.data_dir)
        self._rows = _ParquetRows(files, [r for _, r, _ in entries], self.capacity, cache_groups)
        h = hashlib.sha256(json.dumps([self.capacity, [[n, r, s] for n, r, s in entries]]).encode())
        self.fingerprint = h.hexdigest()[:16]
        self.epoch = 0
        self._position = 0
        self._resume = False

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in the whole directory (all ranks)."""
        return self._rows.num_rows

    def __len__(self) -> int:
        """Rows this rank reads per epoch (all its DataLoader workers together)."""
        r, w = _resolve_rank(self._rank, self._world_size)
        n = self.num_rows
        return (r + 1) * n // w - r * n // w

    def __getitem__(self, index: Any) -> Any:
        """Not supported (iterable-only; ``len`` is the per-rank row count, not an index range).

        Raises:
            TypeError: always; the message says how to read rows.
        """
        _no_random_access(self, index)

    # -- order ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch`` (>= 0): its shuffle order, starting from its first row.

        After :meth:`load_state_dict`, ``set_epoch`` with the checkpoint's epoch keeps the
        pending resume position (so a loop calling ``set_epoch`` every epoch resumes correctly).
        """
        epoch = _check_int(epoch, "epoch")
        if self._resume and epoch == self.epoch:
            return
        self.epoch = epoch
        self._position = 0
        self._resume = False

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global row indices (int64, ``(num_rows,)``) in the order of ``epoch``, all shards together."""
        n = self.num_rows
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        rng = np.random.default_rng((self.seed, int(epoch)))
        parts = []
        for g in rng.permutation(self._rows.num_groups):
            a, b = self._rows.group_rows(int(g))
            parts.append(a + rng.permutation(b - a))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def shard_indices(self, epoch: int, shard: int, num_shards: int) -> np.ndarray:
        """Global row indices of one (rank, worker) shard in ``epoch``: a contiguous balanced slice."""
        order = self.epoch_order(epoch)
        n = order.shape[0]
        return order[shard * n // num_shards:(shard + 1) * n // num_shards]

    # -- iteration and state ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ident = _shard_identity(self._rank, self._world_size)
        idx = self.shard_indices(self.epoch, ident["shard"], ident["num_shards"])
        start = self._position if self._resume else 0
        if start > idx.shape[0]:
            raise FlamiaError(f"resume position {start} is past the end of this shard ({idx.shape[0]} rows)")
        self._resume = False
        self._position = start
        return self._generate(idx, start)

    def _generate(self, idx: np.ndarray, start: int) -> Iterator[dict[str, torch.Tensor]]:
        for j in range(start, idx.shape[0]):
            item = self._rows.row(int(idx[j]))
            self._position = j + 1  # before yielding: a state_dict taken now resumes after this row
            yield item
        self.epoch += 1  # ran to the end: the next iter() is the next epoch
        self._position = 0

    def _config(self) -> dict[str, Any]:
        ident = _shard_identity(self._rank, self._world_size)
        return {"fingerprint": self.fingerprint, "num_rows": self.num_rows, "seed": self.seed,
                "shuffle": self.shuffle, "rank": ident["rank"], "world_size": ident["world_size"],
                "worker_id": ident["worker_id"], "num_workers": ident["num_workers"]}

    def state_dict(self) -> dict[str, Any]:
        """Position of this process's (rank, worker) stream: plain ints/strings.

        Keys: ``kind``, ``version``, ``epoch``, ``position`` (rows of this shard already yielded in
        the epoch) and the configuration checked on load (``fingerprint``, ``num_rows``, ``seed``,
        ``shuffle``, ``rank``, ``world_size``, ``worker_id``, ``num_workers``).
        """
        return {"kind": "PackedDataset", "version": _STATE_VERSION, "epoch": self.epoch,
                "position": self._position, **self._config()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues right after the saved row.

        Raises:
            FlamiaError: not a PackedDataset state, or saved for other data / seed / shuffle /
                rank / world size / worker layout.
        """
        _check_state(state_dict, "PackedDataset", self._config())
        self.epoch = _check_int(state_dict["epoch"], "epoch")
        self._position = _check_int(state_dict["position"], "position")
        self._resume = True


def _check_manifest_int(manifest: Any, name: str, lo: int) -> int:
    v = _manifest_field(manifest, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise FormatError(f"manifest.json field {name!r} must be an integer >= {lo}, got {v!r}")
    return v


# ---------------------------------------------------------------------------------------------
# StreamingPackedDataset: source -> online best fit -> rows
# ---------------------------------------------------------------------------------------------
_LONG_DOCS = ("split", "truncate", "drop")
_COUNTERS = ("docs_read", "docs_mine", "docs_packed", "docs_empty", "docs_split", "docs_truncated",
             "docs_dropped", "tokens_packed", "tokens_dropped", "rows")

Piece = tuple  # (doc, chunk, src_start, length): ints


class StreamingPackedDataset(IterableDataset):
    """Pack a document source into rows on the fly, with a bounded look-ahead buffer (DESIGN.md §3).

    Algorithm (online best fit over a bounded buffer): documents of this shard are cut into
    pieces by ``long_docs`` (``split``: a document longer than ``capacity`` gives full-capacity
    pieces, each emitted at once as its own full row, plus a remainder piece). Every other piece
    goes into the *open row* whose free space is the smallest that still fits it (ties: oldest
    row), or opens a new row. A row that becomes exactly full is emitted at once. The buffer
    holds at most ``buffer_docs`` pieces in open rows: when a new piece makes it overflow, the
    fullest open row is emitted (ties: oldest). At the end of the source the open rows are
    emitted fullest first. A larger buffer gives fuller rows at the cost of memory (at most
    ``buffer_docs`` documents' tokens are held) and of reordering documents by up to that many.
    Fill so far is reported by :attr:`stats` (per process: a DataLoader worker's copy counts its
    own rows).

    With ``shuffle=True`` documents first pass a seeded shuffle buffer of ``buffer_docs``
    documents (``numpy`` ``default_rng((seed, epoch, shard))``; epochs via :meth:`set_epoch`).

    Sharding: document ``i`` of the source belongs to shard ``i % (world_size * num_workers)``
    (see the module docstring), which packs its own rows. Every shard reads the whole source and
    keeps its documents.

    Exact resume: the state holds counters and *references* (document index, chunk, offset,
    length) to the buffered pieces, not tokens; :meth:`load_state_dict` + ``iter()`` re-reads the
    source up to the saved read position to recover the buffered documents (``O(documents read)``
    source reading, no rows are emitted twice). The source must give the same documents in the
    same order every time it is read.

    Items are dicts of CPU tensors with the keys :data:`ROW_KEYS`, laid out like
    :meth:`flamia_pack.pack.PackedRows.row` (``position_ids`` restart at 0 in every segment).

    Args:
        source: a path for :func:`flamia_pack.loaders.sources.open_source` (opened lazily in each
            process), or a sequence of 1-D integer arrays (documents), or a zero-argument callable
            returning an iterable of documents.
        capacity: tokens per row (>= 1).
        buffer_docs: pieces held in open rows (and documents in the shuffle buffer), >= 1.
        seed: seed of the shuffle buffer.
        shuffle: pass documents through the seeded shuffle buffer (default False: source order).
        text_column, tokenizer: passed to ``open_source`` for path sources.
        pad_id: id written past ``num_tokens``.
        long_docs: ``"split"`` (default), ``"truncate"`` or ``"drop"`` (as in ``PackConfig``).
        rank, world_size: as for :class:`PackedDataset`.

    Raises:
        FlamiaError: bad arguments. While iterating: ``SourceError`` for unreadable sources or
            documents that are not 1-D arrays of integer ids in ``[0, 2**31)``.
    """

    def __init__(
        self,
        source: Union[str, os.PathLike[str], Sequence[Any], Callable[[], Iterable[Any]]],
        *,
        capacity: int,
        buffer_docs: int = 1024,
        seed: int = 0,
        shuffle: bool = False,
        text_column: Optional[str] = None,
        tokenizer: str = "bytes",
        pad_id: int = 0,
        long_docs: str = "split",
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if isinstance(source, (str, os.PathLike)):
            p = pathlib.Path(source)
            if not p.exists():
                raise SourceError(f"source not found: {p}")
            self._source: Any = str(p)
        elif callable(source) or isinstance(source, Sequence):
            self._source = source
        else:
            raise FlamiaError(
                f"source must be a path, a sequence of documents or a callable returning documents, got {type(source).__name__}"
            )
        self.capacity = _check_int(capacity, "capacity", 1)
        self.buffer_docs = _check_int(buffer_docs, "buffer_docs", 1)
        self.seed = _check_int(seed, "seed")
        self.shuffle = _check_bool(shuffle, "shuffle")
        self.text_column = text_column
        self.tokenizer = tokenizer
        self.pad_id = int(pad_id)
        if not -(2**31) <= self.pad_id < 2**31:
            raise FlamiaError(f"pad_id must fit int32, got {pad_id}")
        if long_docs not in _LONG_DOCS:
            raise FlamiaError(f"long_docs must be one of {', '.join(_LONG_DOCS)}; got {long_docs!r}")
        self.long_docs = long_docs
        if rank is not None or world_size is not None:
            _resolve_rank(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self.epoch = 0
        self._resume = False
        self._fresh_state()

    # -- state --------------------------------------------------------------------------------
    def _fresh_state(self) -> None:
        self._counters = {k: 0 for k in _COUNTERS}
        self._open: dict[int, list] = {}  # rid -> [used, [pieces]]
        self._buffered = 0  # pieces in open rows
        self._free: list[tuple[int, int]] = []  # sorted (free space, rid) of open rows
        self._ready: collections.deque = collections.deque()  # rows (lists of pieces) to emit
        self._shuffle_buf: list[int] = []
        self._rng_state: Optional[dict] = None
        self._next_rid = 0
        self._finished = False
        self._tokens: dict[int, np.ndarray] = {}
        self._refs: dict[int, int] = {}
        self._rng: Optional[np.random.Generator] = None
        self._epoch_complete = False  # the stream ran to its end; ``epoch`` is already the next one

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_rng"] = None  # rebuilt from _rng_state
        return d

    def __getitem__(self, index: Any) -> Any:
        """Not supported: rows are packed on the fly, in stream order only.

        Raises:
            TypeError: always; the message says how to read rows.
        """
        _no_random_access(self, index)

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch`` (>= 0; seeds the shuffle buffer) and start it from the beginning.

        After :meth:`load_state_dict`, ``set_epoch`` with the checkpoint's epoch keeps the
        pending resume.
        """
        epoch = _check_int(epoch, "epoch")
        if self._resume and epoch == self.epoch:
            return
        self.epoch = epoch
        self._resume = False
        self._fresh_state()

    @property
    def stats(self) -> dict[str, Any]:
        """Counts so far in this process's stream (this epoch; after the stream ran to its end,
        those of the finished epoch until the next ``iter()``), plus the buffer state.

        Keys: the counters ``docs_read`` (source documents read, all shards), ``docs_mine`` (of
        this shard), ``docs_packed``, ``docs_empty``, ``docs_split``, ``docs_truncated``,
        ``docs_dropped``, ``tokens_packed`` (in emitted rows), ``tokens_dropped``, ``rows``
        (emitted); ``capacity``; ``fill`` = tokens_packed / (rows * capacity) (0.0 before the
        first row); ``buffered_docs`` (pieces in open rows), ``held_docs`` (documents whose tokens
        are held: buffered, shuffled or in rows not yet emitted), ``open_rows``, ``buffer_docs``.
        """
        c = dict(self._counters)
        rows = c["rows"]
        c.update(
            capacity=self.capacity,
            fill=(c["tokens_packed"] / (rows * self.capacity)) if rows else 0.0,
            buffered_docs=self._buffered,
            held_docs=len(self._tokens),
            open_rows=len(self._open),
            buffer_docs=self.buffer_docs,
        )
        return c

    def _config(self) -> dict[str, Any]:
        ident = _shard_identity(self._rank, self._world_size)
        return {"capacity": self.capacity, "buffer_docs": self.buffer_docs, "seed": self.seed,
                "shuffle": self.shuffle, "long_docs": self.long_docs, "pad_id": self.pad_id,
                "rank": ident["rank"], "world_size": ident["world_size"],
                "worker_id": ident["worker_id"], "num_workers": ident["num_workers"]}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this process's stream exactly (plain ints and lists).

        Buffered documents are stored as references ``[doc, chunk, src_start, length]``; the
        tokens are re-read from the source on resume.
        """
        if self._epoch_complete:  # the next epoch, not started
            return {"kind": "StreamingPackedDataset", "version": _STATE_VERSION, "epoch": self.epoch,
                    "counters": {k: 0 for k in _COUNTERS}, "open_rows": [], "ready": [], "shuffle_buffer": [],
                    "rng": None, "next_rid": 0, "finished": False, **self._config()}
        if self._rng is not None:
            self._rng_state = self._rng.bit_generator.state
        return {
            "kind": "StreamingPackedDataset", "version": _STATE_VERSION, "epoch": self.epoch,
            "counters": dict(self._counters),
            "open_rows": [[rid, used, [list(p) for p in pieces]] for rid, (used, pieces) in self._open.items()],
            "ready": [[list(p) for p in row] for row in self._ready],
            "shuffle_buffer": list(self._shuffle_buf),
            "rng": _jsonable(self._rng_state),
            "next_rid": self._next_rid,
            "finished": self._finished,
            **self._config(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues right after the saved row.

        Raises:
            FlamiaError: not a StreamingPackedDataset state, or saved with another configuration
                or shard layout.
        """
        _check_state(state_dict, "StreamingPackedDataset", self._config())
        self._fresh_state()
        self.epoch = _check_int(state_dict["epoch"], "epoch")
        self._counters = {k: int(state_dict["counters"][k]) for k in _COUNTERS}
        for rid, used, pieces in state_dict["open_rows"]:
            self._open[int(rid)] = [int(used), [tuple(int(x) for x in p) for p in pieces]]
            self._buffered += len(pieces)
            bisect.insort(self._free, (self.capacity - int(used), int(rid)))
        self._ready = collections.deque([[tuple(int(x) for x in p) for p in row] for row in state_dict["ready"]])
        self._shuffle_buf = [int(d) for d in state_dict["shuffle_buffer"]]
        self._rng_state = state_dict["rng"]
        self._next_rid = int(state_dict["next_rid"])
        self._finished = bool(state_dict["finished"])
        for row in [*self._ready, *(p for _, p in self._open.values())]:
            for piece in row:
                self._refs[piece[0]] = self._refs.get(piece[0], 0) + 1
        self._resume = True

    # -- source ------------------------------------------------------------------------------
    def _documents(self) -> Iterator[Any]:
        src = self._source
        if isinstance(src, str):
            from flamia_pack.loaders.sources import open_source

            return iter(open_source(src, text_column=self.text_column, tokenizer=self.tokenizer))
        if callable(src):
            return iter(src())
        return iter(src)

    @staticmethod
    def _as_doc(doc: Any, index: int) -> np.ndarray:
        arr = np.asarray(doc)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise SourceError(f"document {index} must be a 1-D array of integer token ids, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**31):
            raise SourceError(f"document {index} has token ids outside [0, 2**31): min {int(arr.min())}, max {int(arr.max())}")
        return arr.astype(np.int32, copy=False)

    # -- packing -----------------------------------------------------------------------------
    def _shuffle_rng(self, shard: int) -> np.random.Generator:
        if self._rng is None:
            rng = np.random.default_rng((self.seed, self.epoch, shard))
            if self._rng_state is not None:
                rng.bit_generator.state = self._rng_state
            self._rng = rng
        return self._rng

    def _add_ref(self, doc: int) -> None:
        self._refs[doc] = self._refs.get(doc, 0) + 1

    def _drop_ref(self, doc: int) -> None:
        n = self._refs[doc] - 1
        if n:
            self._refs[doc] = n
        else:
            del self._refs[doc]
            self._tokens.pop(doc, None)

    def _emit_open(self, rid: int) -> None:
        used, pieces = self._open.pop(rid)
        self._free.remove((self.capacity - used, rid))
        self._buffered -= len(pieces)
        self._ready.append(pieces)

    def _place(self, piece: Piece) -> None:
        length = piece[3]
        cap = self.capacity
        i = bisect.bisect_left(self._free, (length, -1))
        if i < len(self._free):
            free, rid = self._free.pop(i)
            row = self._open[rid]
            row[0] += length
            row[1].append(piece)
            self._buffered += 1
            if free == length:  # exactly full: emit now
                del self._open[rid]
                self._buffered -= len(row[1])
                self._ready.append(row[1])
            else:
                bisect.insort(self._free, (free - length, rid))
        else:
            rid = self._next_rid
            self._next_rid += 1
            self._open[rid] = [length, [piece]]
            self._buffered += 1
            bisect.insort(self._free, (cap - length, rid))
        while self._buffered > self.buffer_docs and self._free:
            self._emit_open(self._free[0][1])  # fullest open row (least free space), oldest on ties

    def _pack_doc(self, doc: int) -> None:
        """Cut document ``doc`` into pieces (long_docs policy) and place them."""
        tokens = self._tokens[doc]
        n, cap, c = int(tokens.shape[0]), self.capacity, self._counters
        if n == 0:
            c["docs_empty"] += 1
            self._tokens.pop(doc, None)
            return
        if n > cap and self.long_docs == "drop":
            c["docs_dropped"] += 1
            c["tokens_dropped"] += n
            self._tokens.pop(doc, None)
            return
        c["docs_packed"] += 1
        if n > cap and self.long_docs == "truncate":
            c["docs_truncated"] += 1
            c["tokens_dropped"] += n - cap
            self._add_ref(doc)
            self._ready.append([(doc, 0, 0, cap)])
            return
        if n > cap:
            c["docs_split"] += 1
        chunk = 0
        for start in range(0, n, cap):
            length = min(cap, n - start)
            self._add_ref(doc)
            if length == cap:
                self._ready.append([(doc, chunk, start, cap)])
            else:
                self._place((doc, chunk, start, length))
            chunk += 1

    def _flush(self, shard: int) -> None:
        """End of the source: drain the shuffle buffer, then emit open rows fullest first."""
        if self._shuffle_buf:
            rng = self._shuffle_rng(shard)
            order = [self._shuffle_buf[int(j)] for j in rng.permutation(len(self._shuffle_buf))]
            self._shuffle_buf = []
            for d in order:
                self._pack_doc(d)
        for _, rid in list(self._free):
            self._ready.append(self._open.pop(rid)[1])
        self._free = []
        self._buffered = 0
        self._finished = True

    def _materialise(self, pieces: list[Piece]) -> dict[str, torch.Tensor]:
        cap = self.capacity
        ids = np.full(cap, self.pad_id, dtype=np.int32)
        pos = np.zeros(cap, dtype=np.int32)
        cu = np.zeros(len(pieces) + 1, dtype=np.int32)
        doc_ids = np.empty(len(pieces), dtype=np.int64)
        chunk_ids = np.empty(len(pieces), dtype=np.int32)
        o = 0
        for k, (doc, chunk, start, length) in enumerate(pieces):
            ids[o:o + length] = self._tokens[doc][start:start + length]
            pos[o:o + length] = np.arange(length, dtype=np.int32)
            o += length
            cu[k + 1] = o
            doc_ids[k] = doc
            chunk_ids[k] = chunk
        for doc, *_ in pieces:
            self._drop_ref(doc)
        self._counters["rows"] += 1
        self._counters["tokens_packed"] += o
        return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
                "cu_seqlens": torch.from_numpy(cu), "doc_ids": torch.from_numpy(doc_ids),
                "chunk_ids": torch.from_numpy(chunk_ids), "num_tokens": torch.tensor(o, dtype=torch.int32)}

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ident = _shard_identity(self._rank, self._world_size)
        if not self._resume:
            self._fresh_state()
        self._resume = False
        self._rng = None
        return self._generate(ident["shard"], ident["num_shards"])

    def _generate(self, shard: int, num_shards: int) -> Iterator[dict[str, torch.Tensor]]:
        c = self._counters
        skip = c["docs_read"]
        needed = set(self._refs) | set(self._shuffle_buf)
        docs = self._documents()
        if skip:  # resume: re-read what was read before, keeping the buffered documents
            got = 0
            for i in range(skip):
                doc = next(docs, None)
                if doc is None:
                    raise SourceError(f"cannot resume: the source now has {i} documents, the checkpoint read {skip}")
                if i in needed:
                    self._tokens[i] = self._as_doc(doc, i)
                    got += 1
            if got != len(needed):
                raise SourceError("cannot resume: buffered documents of the checkpoint are missing from the source")
        while True:
            while self._ready:
                item = self._materialise(self._ready.popleft())
                yield item
            if self._finished:
                # ran to the end: the next iter() is the next epoch (stats stay readable until then)
                self.epoch += 1
                self._epoch_complete = True
                return
            doc = next(docs, None)
            if doc is None:
                self._flush(shard)
                continue
            i = c["docs_read"]
            c["docs_read"] = i + 1
            if i % num_shards != shard:
                continue
            c["docs_mine"] += 1
            self._tokens[i] = self._as_doc(doc, i)
            if not self.shuffle:
                self._pack_doc(i)
            elif len(self._shuffle_buf) < self.buffer_docs:
                self._shuffle_buf.append(i)
            else:
                j = int(self._shuffle_rng(shard).integers(len(self._shuffle_buf)))
                out, self._shuffle_buf[j] = self._shuffle_buf[j], i
                self._pack_doc(out)


def _jsonable(x: Any) -> Any:
    """numpy bit-generator state -> plain Python ints/dicts (no numpy scalars)."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    return x
