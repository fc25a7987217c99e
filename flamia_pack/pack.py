"""Packing documents into fixed-capacity row buffers ("unaligned packed rows"), DESIGN.md §3.

A *row* holds ``capacity`` tokens. Documents (token-id sequences) are laid end to end inside a row
at arbitrary offsets, with no padding between them; unused capacity exists only at the row's end,
is filled with ``pad_id`` and belongs to no document. A *segment* is one piece of one document
placed in one row; a document longer than ``capacity`` becomes several segments ("chunks") under
``long_docs="split"``, and ``algorithm="concat"`` also cuts documents at row ends.

Two stages, both numba host loops (no per-token or per-document Python loop on the hot path):

1. :func:`plan_packing` works on document *lengths* only and returns a :class:`PackPlan`: for
   every segment its source document, chunk index, source offset, length, row and row offset.
2. :func:`pack_documents` / :func:`pack_flat` copy tokens into ``(n_rows, capacity)`` buffers
   following a plan and return :class:`PackedRows`, with FlashAttention-style varlen metadata
   per row (``cu_seqlens`` int32, row-local; ``position_ids`` restarting at 0 in every segment).
   :func:`fill_rows` does the copy for a block of rows (optionally into reused buffers), so a
   writer or loader can stream a large plan shard by shard.

Algorithms
----------
``bfd`` (default) -- best-fit-decreasing. Pieces are sorted by decreasing length (counting sort,
ties by document index then chunk index, so the result is deterministic) and each goes to the
open row whose free space is the *smallest* one that still fits it; a new row is opened when none
fits. Open rows are kept in buckets indexed by free space ``1 .. capacity-1`` and a 64-ary
hierarchical bitmap over the buckets finds "smallest non-empty bucket >= length" in
``O(log_64 capacity)`` word operations, so planning is ``O(n log capacity)`` time. Memory for
the bucket index is ``O(capacity)`` *virtual* (pages are touched only where rows live). A
document is never split unless it is longer than ``capacity``; a split document's full-capacity
pieces fill one row each and its remainder piece is packed like any other document. (Above
``2**24`` tokens of capacity the open rows are scanned instead: rows are then few.)

``balanced`` -- cost-balanced packing (DESIGN.md §3): the same pieces and the same number of rows
``R`` as ``bfd`` to start with, but each piece, in decreasing length order, goes to the row with
the smallest attention cost ``sum(len**2)`` so far among the rows it fits in (ties: lowest row
index); a new row is opened only when it fits in none. The first ``R`` pieces therefore take one
row each (longest-processing-time first), and the rest even out ``sum(len**2)`` while filling the
rows. Two heaps (eligible rows by cost; rows too full for the current piece by free space, released
as pieces get shorter) make it ``O(n log n)``. On lognormal(6.5, 1) lengths at capacity 65,536 it
keeps BFD's row count while the cheapest row's cost rises from ~1% to ~90% of the mean and the
99th percentile drops from ~5-6x to ~2.5-3x the mean (rows holding one document of about
``capacity`` tokens cannot be balanced).

``concat`` -- concatenate all documents in order and cut at every multiple of ``capacity``; a
document crossing a row end is split there (chunks 0, 1, 2, ... in order). Every row but the last
is exactly full.

Long documents (longer than ``capacity``) are handled by ``long_docs`` *before* the algorithm
runs: ``split`` (default) keeps every token, ``truncate`` keeps the first ``capacity`` tokens and
counts the rest as dropped (reason ``"long_doc_truncate"``), ``drop`` drops the whole document
(reason ``"long_doc_drop"``). Empty documents are counted (``docs_empty``) and skipped. Every
input token therefore appears exactly once in the output, in source order inside its segment, or
is counted in ``PackStats.tokens_dropped`` with a reason.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numba
import numpy as np

from flamia_pack.errors import FlamiaError, SourceError

__all__ = [
    "ALGORITHMS",
    "LONG_DOC_POLICIES",
    "PackConfig",
    "PackPlan",
    "PackStats",
    "PackedRows",
    "fill_rows",
    "pack_documents",
    "pack_flat",
    "plan_packing",
]

ALGORITHMS = ("bfd", "concat", "balanced")
LONG_DOC_POLICIES = ("split", "truncate", "drop")
MAX_CAPACITY = 2**31 - 1  # cu_seqlens / position_ids / row offsets are int32
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_TOKEN_LIMIT = 2**31  # token ids must be in [0, 2**31) so they fit int32 input_ids

# policy / algorithm codes passed to the numba kernels
_POLICY_CODE = {"split": 0, "truncate": 1, "drop": 2}


# ---------------------------------------------------------------------------------------------
# configuration and results
# ---------------------------------------------------------------------------------------------
def _as_int(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise FlamiaError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise FlamiaError(f"{name} must be an integer, got {type(value).__name__} ({value!r})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    """How documents are packed into rows (DESIGN.md §3). Validated on construction.

    Raises:
        FlamiaError: ``capacity`` not an integer in ``[1, 2**31 - 1]``; unknown ``algorithm`` or
            ``long_docs``; ``pad_id`` not an integer in [0, 2**31 - 1].
    """

    capacity: int
    """Tokens per row (the row buffer length), ``1 <= capacity <= 2**31 - 1``. E.g. 65536."""
    algorithm: str = "bfd"
    """``"bfd"`` (best-fit-decreasing; the default), ``"concat"`` (concatenate, cut at row ends) or
    ``"balanced"`` (rows with even attention cost ``sum(len**2)``; same row count as bfd where it can)."""
    long_docs: str = "split"
    """Documents longer than ``capacity``: ``"split"`` into pieces (chunks 0, 1, ...),
    ``"truncate"`` to the first ``capacity`` tokens, or ``"drop"``. Dropped tokens are counted."""
    pad_id: int = 0
    """Token id written past the last document of a row (int32 range)."""

    def __post_init__(self) -> None:
        cap = _as_int(self.capacity, "capacity")
        if not 1 <= cap <= MAX_CAPACITY:
            raise FlamiaError(f"capacity must be in [1, {MAX_CAPACITY}] tokens, got {cap}")
        object.__setattr__(self, "capacity", cap)
        if self.algorithm not in ALGORITHMS:
            raise FlamiaError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {self.algorithm!r}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise FlamiaError(
                f"long_docs must be one of {', '.join(LONG_DOC_POLICIES)}; got {self.long_docs!r}"
            )
        pad = _as_int(self.pad_id, "pad_id")
        if not 0 <= pad <= _INT32_MAX:
            raise FlamiaError(f"pad_id must be a token id in [0, {_INT32_MAX}] (ids are non-negative int32), got {pad}")
        object.__setattr__(self, "pad_id", pad)


@dataclass
class PackStats:
    """Counts describing one packing run. All integers except ``fill``.

    ``docs_in = docs_packed + docs_empty + docs_dropped``; ``tokens_in = tokens_packed +
    tokens_dropped``; ``tokens_dropped = sum(dropped_reasons.values())``; ``fill =
    tokens_packed / (rows * capacity)`` (0.0 when there are no rows). ``docs_split`` counts packed
    documents that became more than one segment; ``docs_truncated`` counts documents cut to
    ``capacity`` (they are also in ``docs_packed``). ``dropped_reasons`` maps a reason
    (``"long_doc_drop"``, ``"long_doc_truncate"``) to the number of tokens dropped for it; only
    reasons that occurred are present.
    """

    docs_in: int = 0
    docs_packed: int = 0
    docs_split: int = 0
    docs_empty: int = 0
    docs_dropped: int = 0
    docs_truncated: int = 0
    tokens_in: int = 0
    tokens_packed: int = 0
    tokens_dropped: int = 0
    rows: int = 0
    capacity: int = 0
    fill: float = 0.0
    dropped_reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict of every field (``dropped_reasons`` copied)."""
        return asdict(self)


@dataclass(frozen=True)
class PackPlan:
    """Lengths-only packing result: one entry per segment, grouped by row (DESIGN.md §3).

    Segment arrays have shape ``(n_segs,)`` and are ordered by row, then by offset inside the row:
    segments of row ``r`` are ``[row_offsets[r], row_offsets[r + 1])``.

    Attributes:
        seg_doc: int64, source document index.
        seg_chunk: int32, index of the piece inside its document (0, 1, 2, ... when split).
        seg_src_start: int64, offset of the piece inside its source document (tokens).
        seg_len: int32, piece length in tokens (always >= 1).
        seg_row: int64, row index.
        seg_row_start: int32, offset of the piece inside its row (tokens).
        row_offsets: int64, shape ``(n_rows + 1,)``.
        row_used: int32, shape ``(n_rows,)``, tokens used per row (``<= capacity``).
        stats: counts, see :class:`PackStats`.
    """

    seg_doc: np.ndarray
    seg_chunk: np.ndarray
    seg_src_start: np.ndarray
    seg_len: np.ndarray
    seg_row: np.ndarray
    seg_row_start: np.ndarray
    row_offsets: np.ndarray
    row_used: np.ndarray
    stats: PackStats

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return int(self.row_used.shape[0])

    @property
    def n_segs(self) -> int:
        """Number of segments (pieces of documents placed in rows)."""
        return int(self.seg_len.shape[0])


@dataclass(frozen=True)
class PackedRows:
    """Packed row buffers with varlen metadata (DESIGN.md §3), as numpy arrays.

    Attributes:
        capacity: tokens per row.
        pad_id: id written past ``num_tokens[r]`` in each row.
        input_ids: int32 ``(n_rows, capacity)``; ``pad_id`` past ``num_tokens[r]``.
        position_ids: int32 ``(n_rows, capacity)``; restart at 0 in every segment; 0 for padding.
        num_tokens: int32 ``(n_rows,)``, tokens used per row.
        doc_offsets: int64 ``(n_rows + 1,)``; the segments of row ``r`` are
            ``[doc_offsets[r], doc_offsets[r + 1])`` in the flat arrays below.
        seg_lengths: int32 ``(n_segs,)`` segment lengths, in row order then row offset.
        doc_ids: int64 ``(n_segs,)`` source document index of each segment.
        chunk_ids: int32 ``(n_segs,)`` piece index of each segment inside its document.
        stats: counts, see :class:`PackStats`.
    """

    capacity: int
    pad_id: int
    input_ids: np.ndarray
    position_ids: np.ndarray
    num_tokens: np.ndarray
    doc_offsets: np.ndarray
    seg_lengths: np.ndarray
    doc_ids: np.ndarray
    chunk_ids: np.ndarray
    stats: PackStats

    def __len__(self) -> int:
        return int(self.num_tokens.shape[0])

    def _check_row(self, r: int) -> int:
        n = len(self)
        r = operator.index(r)
        if r < 0:
            r += n
        if not 0 <= r < n:
            raise IndexError(f"row index out of range: {r} (rows: {n})")
        return r

    def cu_seqlens(self, r: int) -> np.ndarray:
        """Row-local ``cu_seqlens`` of row ``r``: int32 ``(n_docs_r + 1,)``, ``[0, ..., num_tokens[r]]``.

        Raises:
            IndexError: ``r`` out of range (negative indices count from the end).
        """
        r = self._check_row(r)
        a, b = int(self.doc_offsets[r]), int(self.doc_offsets[r + 1])
        cu = np.zeros(b - a + 1, dtype=np.int32)
        np.cumsum(self.seg_lengths[a:b], out=cu[1:])
        return cu

    def row(self, r: int) -> dict[str, np.ndarray]:
        """Everything about row ``r`` as a dict of numpy arrays (views where possible).

        Keys: ``input_ids`` (int32, ``(capacity,)``), ``position_ids`` (int32, ``(capacity,)``),
        ``cu_seqlens`` (int32, ``(n_docs_r + 1,)``), ``doc_ids`` (int64, ``(n_docs_r,)``),
        ``chunk_ids`` (int32, ``(n_docs_r,)``), ``num_tokens`` (int32 0-d array).

        Raises:
            IndexError: ``r`` out of range.
        """
        r = self._check_row(r)
        a, b = int(self.doc_offsets[r]), int(self.doc_offsets[r + 1])
        return {
            "input_ids": self.input_ids[r],
            "position_ids": self.position_ids[r],
            "cu_seqlens": self.cu_seqlens(r),
            "doc_ids": self.doc_ids[a:b],
            "chunk_ids": self.chunk_ids[a:b],
            "num_tokens": np.asarray(self.num_tokens[r], dtype=np.int32),
        }


# ---------------------------------------------------------------------------------------------
# numba kernels: long-document policy -> pieces
# ---------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _make_pieces(lengths, capacity, policy):  # pragma: no cover - compiled
    """Pieces in (doc, chunk) order after the long-document policy.

    Returns (piece_doc int64, piece_chunk int32, piece_src int64, piece_len int32, counters int64[6])
    with counters = [docs_empty, docs_dropped, docs_truncated, docs_split, tok_drop, tok_trunc].
    """
    n = lengths.shape[0]
    counters = np.zeros(6, dtype=np.int64)
    n_pieces = 0
    for i in range(n):
        L = lengths[i]
        if L == 0:
            counters[0] += 1
        elif L <= capacity:
            n_pieces += 1
        elif policy == 0:  # split
            n_pieces += (L + capacity - 1) // capacity
            counters[3] += 1
        elif policy == 1:  # truncate
            n_pieces += 1
            counters[2] += 1
            counters[5] += L - capacity
        else:  # drop
            counters[1] += 1
            counters[4] += L
    piece_doc = np.empty(n_pieces, dtype=np.int64)
    piece_chunk = np.empty(n_pieces, dtype=np.int32)
    piece_src = np.empty(n_pieces, dtype=np.int64)
    piece_len = np.empty(n_pieces, dtype=np.int32)
    k = 0
    for i in range(n):
        L = lengths[i]
        if L == 0:
            continue
        if L <= capacity:
            piece_doc[k] = i
            piece_chunk[k] = 0
            piece_src[k] = 0
            piece_len[k] = L
            k += 1
        elif policy == 0:
            c = 0
            s = 0
            while s < L:
                take = min(capacity, L - s)
                piece_doc[k] = i
                piece_chunk[k] = c
                piece_src[k] = s
                piece_len[k] = take
                k += 1
                c += 1
                s += take
        elif policy == 1:
            piece_doc[k] = i
            piece_chunk[k] = 0
            piece_src[k] = 0
            piece_len[k] = capacity
            k += 1
    return piece_doc, piece_chunk, piece_src, piece_len, counters


# ---------------------------------------------------------------------------------------------
# numba kernels: best-fit-decreasing with a 64-ary bitmap over free-space buckets
# ---------------------------------------------------------------------------------------------
_DEBRUIJN64 = 0x03F79D71B4CB0A89
_DEBRUIJN_TABLE = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4,
     62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33, 30, 24, 18, 12, 5,
     63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11,
     46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)


@numba.njit(cache=True, inline="always")
def _ctz(x, table):  # pragma: no cover - compiled
    """Index of the lowest set bit of a non-zero int64 word (de Bruijn multiplication)."""
    return table[(((x & -x) * _DEBRUIJN64) >> 58) & 63]


@numba.njit(cache=True, inline="always")
def _bm_find_next(bits, lvl_off, lvl_len, n_lvl, x, table):  # pragma: no cover - compiled
    """Smallest set index >= x in the hierarchical bitmap, or -1."""
    i = x
    lvl = 0
    while lvl < n_lvl:
        w = i >> 6
        if w >= lvl_len[lvl]:
            return -1
        word = bits[lvl_off[lvl] + w] & (np.int64(-1) << (i & 63))
        if word != 0:
            i = (w << 6) + _ctz(word, table)
            while lvl > 0:
                lvl -= 1
                i = (i << 6) + _ctz(bits[lvl_off[lvl] + i], table)
            return i
        i = w + 1
        lvl += 1
    return -1


@numba.njit(cache=True, inline="always")
def _bm_set(bits, lvl_off, n_lvl, x):  # pragma: no cover - compiled
    for lvl in range(n_lvl):
        w = x >> 6
        j = lvl_off[lvl] + w
        old = bits[j]
        bits[j] = old | (np.int64(1) << (x & 63))
        if old != 0:
            return
        x = w


@numba.njit(cache=True, inline="always")
def _bm_clear(bits, lvl_off, n_lvl, x):  # pragma: no cover - compiled
    for lvl in range(n_lvl):
        w = x >> 6
        j = lvl_off[lvl] + w
        new = bits[j] & ~(np.int64(1) << (x & 63))
        bits[j] = new
        if new != 0:
            return
        x = w


@numba.njit(cache=True, inline="always")
def _bucket_nonempty(bits, x):  # pragma: no cover - compiled
    """Whether bucket ``x`` is non-empty (level-0 bit)."""
    return (bits[x >> 6] >> (x & 63)) & 1 != 0


@numba.njit(cache=True, nogil=True)
def _sort_desc(piece_len, capacity):  # pragma: no cover - compiled
    """Stable counting sort of piece indices by decreasing length (lengths in [1, capacity])."""
    n = piece_len.shape[0]
    counts = np.zeros(capacity + 2, dtype=np.int64)
    for k in range(n):
        counts[capacity - piece_len[k] + 1] += 1
    for v in range(1, capacity + 2):
        counts[v] += counts[v - 1]
    order = np.empty(n, dtype=np.int64)
    for k in range(n):
        b = capacity - piece_len[k]
        order[counts[b]] = k
        counts[b] += 1
    return order


@numba.njit(cache=True, nogil=True)
def _bfd_assign(piece_len, order, capacity, table):  # pragma: no cover - compiled
    """Best-fit-decreasing placement of pieces taken in ``order``.

    Returns (piece_row int64, piece_row_start int32, row_used int32[n_rows]).
    """
    n = piece_len.shape[0]
    # hierarchical bitmap over bucket indices 0..capacity (bucket f = open rows with free space f)
    n_lvl = 0
    size = capacity + 1
    lvl_len = np.empty(8, dtype=np.int64)
    lvl_off = np.empty(8, dtype=np.int64)
    total = 0
    while True:
        words = (size + 63) >> 6
        lvl_len[n_lvl] = words
        lvl_off[n_lvl] = total
        total += words
        n_lvl += 1
        if words == 1:
            break
        size = words
    bits = np.zeros(total, dtype=np.int64)
    head = np.empty(capacity + 1, dtype=np.int64)  # valid only where the bucket's bit is set
    nxt = np.empty(n, dtype=np.int64)  # per row: next row in the same bucket
    piece_row = np.empty(n, dtype=np.int64)
    piece_row_start = np.empty(n, dtype=np.int32)
    row_used = np.empty(n, dtype=np.int32)
    min_len = capacity
    for k in range(n):
        if piece_len[k] < min_len:
            min_len = piece_len[k]
    n_rows = 0
    for t in range(n):
        k = order[t]
        L = piece_len[k]
        f = _bm_find_next(bits, lvl_off, lvl_len, n_lvl, L, table)
        if f < 0:
            r = n_rows
            n_rows += 1
            free = capacity
        else:
            r = head[f]
            h = nxt[r]
            head[f] = h
            if h < 0:
                _bm_clear(bits, lvl_off, n_lvl, f)
            free = f
        used = capacity - free
        piece_row[k] = r
        piece_row_start[k] = used
        nf = free - L
        row_used[r] = used + L
        if nf >= min_len:  # rows with less free space than the smallest piece can take nothing more
            if _bucket_nonempty(bits, nf):
                nxt[r] = head[nf]
            else:
                nxt[r] = -1
                _bm_set(bits, lvl_off, n_lvl, nf)
            head[nf] = r
    return piece_row, piece_row_start, row_used[:n_rows].copy()


# ---------------------------------------------------------------------------------------------
# numba kernels: concat
# ---------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _bfd_assign_scan(piece_len, order, capacity):  # pragma: no cover - compiled
    """Best-fit-decreasing by scanning the open rows: O(n * open rows) time, O(n) memory.

    Used for very large capacities, where the number of rows (tokens / capacity) is small and an
    O(capacity) bucket index would be wasteful. Ties: the lowest row index. Same return as
    :func:`_bfd_assign`.
    """
    n = piece_len.shape[0]
    piece_row = np.empty(n, dtype=np.int64)
    piece_row_start = np.empty(n, dtype=np.int32)
    row_used = np.empty(n, dtype=np.int32)
    open_row = np.empty(n, dtype=np.int64)  # rows that can still take the smallest piece
    open_free = np.empty(n, dtype=np.int64)
    n_open = 0
    min_len = capacity
    for k in range(n):
        if piece_len[k] < min_len:
            min_len = piece_len[k]
    n_rows = 0
    for t in range(n):
        k = order[t]
        L = piece_len[k]
        best = -1
        for i in range(n_open):
            f = open_free[i]
            if f >= L and (best < 0 or f < open_free[best] or (f == open_free[best] and open_row[i] < open_row[best])):
                best = i
        if best < 0:
            r = n_rows
            n_rows += 1
            free = capacity
            if capacity - L >= min_len:
                open_row[n_open] = r
                open_free[n_open] = capacity - L
                n_open += 1
        else:
            r = open_row[best]
            free = open_free[best]
            if free - L >= min_len:
                open_free[best] = free - L
            else:  # swap-remove: the row can take nothing more
                n_open -= 1
                open_row[best] = open_row[n_open]
                open_free[best] = open_free[n_open]
        piece_row[k] = r
        piece_row_start[k] = capacity - free
        row_used[r] = capacity - free + L
    return piece_row, piece_row_start, row_used[:n_rows].copy()


# Above this capacity bfd sorts with numpy and scans open rows instead of a bucket index of
# O(capacity) memory (2**24 tokens: 128 MiB of bucket heads, at most; rows are then few).
_BUCKET_INDEX_MAX_CAPACITY = 2**24


def _bfd(piece_len: np.ndarray, capacity: int, bucket_index: bool | None = None):
    """Best-fit-decreasing over pieces: (order, piece_row, piece_row_start, row_used)."""
    if bucket_index is None:
        bucket_index = capacity <= _BUCKET_INDEX_MAX_CAPACITY
    if bucket_index:
        order = _sort_desc(piece_len, capacity)
        row, start, used = _bfd_assign(piece_len, order, capacity, _DEBRUIJN_TABLE)
    else:
        order = np.argsort(-piece_len.astype(np.int64), kind="stable")
        row, start, used = _bfd_assign_scan(piece_len, order, capacity)
    return order, row, start, used


@numba.njit(cache=True, inline="always")
def _heap_less(key, a, b):  # pragma: no cover - compiled
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@numba.njit(cache=True)
def _heap_push(heap, size, key, x):  # pragma: no cover - compiled
    """Push row ``x`` on a binary min-heap of rows ordered by (key[row], row); returns the new size."""
    i = size
    heap[i] = x
    while i > 0:
        p = (i - 1) >> 1
        if _heap_less(key, heap[i], heap[p]):
            t = heap[i]
            heap[i] = heap[p]
            heap[p] = t
            i = p
        else:
            break
    return size + 1


@numba.njit(cache=True)
def _heap_pop(heap, size, key):  # pragma: no cover - compiled
    """Pop the smallest row; returns (row, new size)."""
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _heap_less(key, heap[c + 1], heap[c]):
            c += 1
        if _heap_less(key, heap[c], heap[i]):
            t = heap[i]
            heap[i] = heap[c]
            heap[c] = t
            i = c
        else:
            break
    return top, size


@numba.njit(cache=True, nogil=True)
def _balanced_assign(piece_len, order, capacity, n_rows0):  # pragma: no cover - compiled
    """Cost-balanced placement: each piece (in ``order``) to the fitting row with the least
    sum(len**2), ties by row index, starting from ``n_rows0`` empty rows. Same return as
    :func:`_bfd_assign`.

    Invariant: ``elig`` holds every live row whose free space fits the current piece (pieces only
    get shorter, so a row stays eligible until it is popped); ``park`` holds live rows too full
    for it, keyed by -free, and releases them as the pieces shrink. Rows that cannot take the
    smallest piece are dropped from both.
    """
    n = piece_len.shape[0]
    max_rows = n + n_rows0
    cost = np.zeros(max_rows, dtype=np.int64)
    negfree = np.empty(max_rows, dtype=np.int64)
    used = np.zeros(max_rows, dtype=np.int32)
    elig = np.empty(max_rows, dtype=np.int64)
    park = np.empty(max_rows, dtype=np.int64)
    n_elig = 0
    n_park = 0
    piece_row = np.empty(n, dtype=np.int64)
    piece_row_start = np.empty(n, dtype=np.int32)
    min_len = np.int64(capacity)
    for k in range(n):
        if piece_len[k] < min_len:
            min_len = piece_len[k]
    for r in range(n_rows0):
        negfree[r] = -capacity
        n_elig = _heap_push(elig, n_elig, cost, r)
    n_rows = n_rows0
    for t in range(n):
        k = order[t]
        L = np.int64(piece_len[k])
        while n_park > 0 and -negfree[park[0]] >= L:
            r, n_park = _heap_pop(park, n_park, negfree)
            n_elig = _heap_push(elig, n_elig, cost, r)
        if n_elig > 0:
            r, n_elig = _heap_pop(elig, n_elig, cost)
        else:
            r = n_rows
            n_rows += 1
            negfree[r] = -capacity
        piece_row[k] = r
        piece_row_start[k] = used[r]
        used[r] += L
        cost[r] += L * L
        negfree[r] += L
        f = -negfree[r]
        if f >= min_len:
            if f >= L:
                n_elig = _heap_push(elig, n_elig, cost, r)
            else:
                n_park = _heap_push(park, n_park, negfree, r)
    return piece_row, piece_row_start, used[:n_rows].copy()


@numba.njit(cache=True, nogil=True)
def _concat_assign(piece_doc, piece_len, capacity):  # pragma: no cover - compiled
    """Concatenate pieces in order and cut at row ends.

    Pieces here are whole (policy-applied) documents. Returns segment arrays (in row order) and
    row_used: (seg_doc, seg_chunk, seg_src, seg_len, seg_row, seg_row_start, row_used, n_split).
    """
    n = piece_len.shape[0]
    tot = np.int64(0)
    for k in range(n):
        tot += piece_len[k]
    n_rows = (tot + capacity - 1) // capacity
    max_segs = n + n_rows
    seg_doc = np.empty(max_segs, dtype=np.int64)
    seg_chunk = np.empty(max_segs, dtype=np.int32)
    seg_src = np.empty(max_segs, dtype=np.int64)
    seg_len = np.empty(max_segs, dtype=np.int32)
    seg_row = np.empty(max_segs, dtype=np.int64)
    seg_row_start = np.empty(max_segs, dtype=np.int32)
    row_used = np.empty(n_rows, dtype=np.int32)
    row = 0
    used = 0
    s = 0
    n_split = 0
    for k in range(n):
        L = np.int64(piece_len[k])
        off = np.int64(0)
        c = 0
        while off < L:
            take = min(L - off, capacity - used)
            seg_doc[s] = piece_doc[k]
            seg_chunk[s] = c
            seg_src[s] = off
            seg_len[s] = take
            seg_row[s] = row
            seg_row_start[s] = used
            s += 1
            c += 1
            off += take
            used += take
            if used == capacity:
                row_used[row] = capacity
                row += 1
                used = 0
        if c > 1:
            n_split += 1
    if used > 0:
        row_used[row] = used
    return (seg_doc[:s], seg_chunk[:s], seg_src[:s], seg_len[:s], seg_row[:s], seg_row_start[:s],
            row_used, n_split)


@numba.njit(cache=True, nogil=True)
def _group_by_row(piece_row, order, n_rows):  # pragma: no cover - compiled
    """Counting sort of pieces by row, stable in placement ``order`` (so by offset inside a row).

    Returns (perm int64, row_offsets int64).
    """
    n = piece_row.shape[0]
    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    for k in range(n):
        row_offsets[piece_row[k] + 1] += 1
    for r in range(n_rows):
        row_offsets[r + 1] += row_offsets[r]
    fill = row_offsets[:-1].copy()
    perm = np.empty(n, dtype=np.int64)
    for t in range(n):
        k = order[t]
        r = piece_row[k]
        perm[fill[r]] = k
        fill[r] += 1
    return perm, row_offsets


# ---------------------------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------------------------
def _check_lengths(lengths: object) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise FlamiaError(f"lengths must be a 1-D array of document lengths, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise FlamiaError(f"lengths must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise FlamiaError(f"lengths must be >= 0; document {i} has length {int(arr[i])}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise FlamiaError(f"document {i} has an impossible length {int(arr[i])}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def plan_packing(lengths: np.ndarray, config: PackConfig) -> PackPlan:
    """Plan how documents of the given lengths are packed into rows (lengths only, no tokens).

    Implements DESIGN.md §3: ``bfd`` best-fit-decreasing with an ``O(log capacity)``
    free-space index, ``concat``, or cost-``balanced`` (see the module docstring); the ``long_docs`` policy applied first; empty documents
    counted and skipped; no zero-length segment; no padding between documents.

    Args:
        lengths: integer array ``(n_docs,)``, each ``>= 0`` (tokens per document).
        config: a :class:`PackConfig`.

    Returns:
        :class:`PackPlan` with segments grouped by row (int64/int32 arrays as documented there).

    Raises:
        FlamiaError: ``lengths`` not a 1-D integer array, or a negative length.
    """
    if not isinstance(config, PackConfig):
        raise FlamiaError(f"config must be a PackConfig, got {type(config).__name__}")
    lens = _check_lengths(lengths)
    cap = config.capacity
    policy = _POLICY_CODE[config.long_docs]
    piece_doc, piece_chunk, piece_src, piece_len, counters = _make_pieces(lens, cap, policy)
    docs_empty, docs_dropped, docs_truncated, _, tok_drop, tok_trunc = (int(c) for c in counters)

    if config.algorithm in ("bfd", "balanced"):
        order, piece_row, piece_row_start, row_used = _bfd(piece_len, cap)
        if config.algorithm == "balanced":
            piece_row, piece_row_start, row_used = _balanced_assign(piece_len, order, cap, row_used.shape[0])
        n_rows = int(row_used.shape[0])
        perm, row_offsets = _group_by_row(piece_row, order, n_rows)
        seg_doc = piece_doc[perm]
        seg_chunk = piece_chunk[perm]
        seg_src = piece_src[perm]
        seg_len = piece_len[perm]
        seg_row = piece_row[perm]
        seg_row_start = piece_row_start[perm]
        docs_split = int(counters[3])
    else:
        # pieces are whole documents here (split happens at row ends); long docs under "split"
        # are cut like everything else, so recompute pieces from the policy-applied lengths.
        if policy == 0:
            doc_ids = np.flatnonzero(lens > 0).astype(np.int64)
            doc_len = lens[doc_ids]
        else:
            # truncate/drop produced at most one piece per document
            doc_ids = piece_doc
            doc_len = piece_len.astype(np.int64)
        (seg_doc, seg_chunk, seg_src, seg_len, seg_row, seg_row_start, row_used,
         docs_split) = _concat_assign(doc_ids, doc_len, cap)
        n_rows = int(row_used.shape[0])
        row_offsets = np.searchsorted(seg_row, np.arange(n_rows + 1, dtype=np.int64)).astype(np.int64)
        docs_split = int(docs_split)

    tokens_in = int(lens.sum())
    tokens_dropped = tok_drop + tok_trunc
    tokens_packed = tokens_in - tokens_dropped
    reasons: dict[str, int] = {}
    if tok_drop:
        reasons["long_doc_drop"] = tok_drop
    if tok_trunc:
        reasons["long_doc_truncate"] = tok_trunc
    stats = PackStats(
        docs_in=int(lens.shape[0]),
        docs_packed=int(lens.shape[0]) - docs_empty - docs_dropped,
        docs_split=docs_split,
        docs_empty=docs_empty,
        docs_dropped=docs_dropped,
        docs_truncated=docs_truncated,
        tokens_in=tokens_in,
        tokens_packed=tokens_packed,
        tokens_dropped=tokens_dropped,
        rows=n_rows,
        capacity=cap,
        fill=(tokens_packed / (n_rows * cap)) if n_rows else 0.0,
        dropped_reasons=reasons,
    )
    return PackPlan(
        seg_doc=seg_doc,
        seg_chunk=seg_chunk,
        seg_src_start=seg_src,
        seg_len=seg_len,
        seg_row=seg_row,
        seg_row_start=seg_row_start,
        row_offsets=row_offsets,
        row_used=row_used,
        stats=stats,
    )


# ---------------------------------------------------------------------------------------------
# copying tokens into rows
# ---------------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _fill_rows(tokens, doc_starts, seg_doc, seg_src, seg_len, seg_row_start, row_offsets, row_used,
               capacity, pad_id, r0, r1, input_ids, position_ids, check):  # pragma: no cover - compiled
    """Copy the segments of rows ``[r0, r1)`` into ``input_ids[r - r0]``, write positions 0..len-1
    and the row-end padding. With ``check``, returns the flat index of the first source token
    outside ``[0, 2**31)`` (rows are then incomplete), else -1.

    The inner loops run over 1-D slices with a non-negative loop index, so LLVM vectorises them
    (indexing the 2-D arrays with a computed offset was about 4x slower: wraparound checks).
    """
    for r in range(r0, r1):
        o = r - r0
        for s in range(row_offsets[r], row_offsets[r + 1]):
            src = doc_starts[seg_doc[s]] + seg_src[s]
            dst = np.int64(seg_row_start[s])
            L = np.int64(seg_len[s])
            out_ids = input_ids[o, dst:dst + L]
            out_pos = position_ids[o, dst:dst + L]
            inp = tokens[src:src + L]
            if check:
                lo = inp.min()
                hi = inp.max()
                if lo < 0 or hi >= 2147483648:
                    for j in range(L):
                        if inp[j] < 0 or inp[j] >= 2147483648:
                            return src + j
            for j in range(L):
                out_ids[j] = inp[j]
            for j in range(L):
                out_pos[j] = j
        u = np.int64(row_used[r])
        out_ids = input_ids[o, u:]
        out_pos = position_ids[o, u:]
        for j in range(capacity - u):
            out_ids[j] = pad_id
            out_pos[j] = 0
    return -1


@numba.njit(cache=True, nogil=True)
def _first_bad_token(tokens):  # pragma: no cover - compiled
    """Index of the first token outside [0, 2**31), or -1."""
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if t < 0 or t >= 2147483648:
            return i
    return -1


def _bad_token_error(tokens: np.ndarray, doc_offsets: np.ndarray, bad: int) -> SourceError:
    doc = int(np.searchsorted(doc_offsets, bad, side="right")) - 1
    return SourceError(
        f"document {doc}: token id {int(tokens[bad])} at position {bad - int(doc_offsets[doc])} "
        f"is out of range; token ids must be integers in [0, 2**31)"
    )


def _available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_row_memory(n: int, capacity: int) -> None:
    """Refuse row buffers that cannot fit in memory instead of being killed by the OOM killer.

    The two int32 buffers take ``8 * n * capacity`` bytes and are written in full (padding);
    writing them to parquet needs about as much again, so at most half the available memory is
    allowed. Raises FlamiaError naming the size, e.g. for ``--capacity 2147483647``.
    """
    need = 8 * n * capacity
    avail = _available_memory_bytes()
    if avail is not None and need > avail // 2:
        gib = 2.0**30
        raise FlamiaError(
            f"{n} row(s) x capacity {capacity} need {need / gib:.1f} GiB of row buffers (int32 input_ids + "
            f"position_ids, padding included), more than half of the {avail / gib:.1f} GiB available; "
            "use a smaller capacity, or materialise rows block by block with plan_packing + fill_rows")


def _out_buffer(buf: np.ndarray | None, n: int, capacity: int, name: str) -> np.ndarray:
    if buf is None:
        return np.empty((n, capacity), dtype=np.int32)
    if (not isinstance(buf, np.ndarray) or buf.dtype != np.int32 or buf.ndim != 2 or buf.shape[1] != capacity
            or buf.shape[0] < n or not buf.flags.c_contiguous or not buf.flags.writeable):
        got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
        raise FlamiaError(f"{name} must be a writeable C-contiguous int32 array of shape (>= {n}, {capacity}), got {got}")
    return buf[:n]


def fill_rows(
    plan: PackPlan,
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    config: PackConfig,
    start: int = 0,
    stop: int | None = None,
    *,
    input_ids: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    validate: bool = True,
) -> PackedRows:
    """Copy the tokens of rows ``[start, stop)`` of a plan into row buffers (DESIGN.md §3).

    The streaming half of packing: plan once from lengths (:func:`plan_packing`), then materialise
    rows block by block (e.g. one parquet shard or one training batch at a time), optionally into
    reused buffers, so memory stays at one block instead of ``rows * capacity``.

    Args:
        plan: from :func:`plan_packing` on ``np.diff(doc_offsets)`` with the same ``config``.
        tokens: 1-D integer array holding every document: document ``i`` is
            ``tokens[doc_offsets[i]:doc_offsets[i + 1]]`` (Arrow ``ListArray`` layout).
        doc_offsets: int ``(n_docs + 1,)``, as given to :func:`pack_flat`.
        config: the :class:`PackConfig` the plan was made with (``capacity``, ``pad_id``).
        start, stop: row range (``stop`` defaults to ``plan.n_rows``).
        input_ids, position_ids: optional C-contiguous int32 buffers of shape
            ``(>= stop - start, capacity)`` to write into (the first ``stop - start`` rows are used).
        validate: check that every *copied* token id is in ``[0, 2**31)`` (fused with the copy).

    Returns:
        :class:`PackedRows` for those rows: ``doc_offsets`` rebased to 0; ``stats`` is the whole
        plan's (``stats.rows`` counts every row of the plan, not only this block).

    Raises:
        SourceError: a copied token id out of range (names the document), when ``validate``.
        FlamiaError: bad row range, buffers, or a plan/config capacity mismatch; row buffers to
            allocate (``8 * rows * capacity`` bytes) larger than half the available memory.
    """
    cap = config.capacity
    if plan.stats.capacity != cap:
        raise FlamiaError(f"plan was made for capacity {plan.stats.capacity}, config has {cap}")
    n_rows = plan.n_rows
    stop = n_rows if stop is None else operator.index(stop)
    start = operator.index(start)
    if not 0 <= start <= stop <= n_rows:
        raise FlamiaError(f"row range [{start}, {stop}) is not inside [0, {n_rows})")
    tokens = np.ascontiguousarray(tokens)
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    n = stop - start
    if input_ids is None or position_ids is None:
        _check_row_memory(n, cap)
    ids = _out_buffer(input_ids, n, cap, "input_ids")
    pos = _out_buffer(position_ids, n, cap, "position_ids")
    if tokens.size == 0:
        tokens = np.zeros(0, dtype=np.int32)
    bad = _fill_rows(tokens, offsets[:-1], plan.seg_doc, plan.seg_src_start, plan.seg_len, plan.seg_row_start,
                     plan.row_offsets, plan.row_used, cap, np.int32(config.pad_id), start, stop, ids, pos,
                     bool(validate))
    if bad >= 0:
        raise _bad_token_error(tokens, offsets, int(bad))
    a, b = int(plan.row_offsets[start]), int(plan.row_offsets[stop])
    return PackedRows(
        capacity=cap,
        pad_id=config.pad_id,
        input_ids=ids,
        position_ids=pos,
        num_tokens=plan.row_used[start:stop],
        doc_offsets=plan.row_offsets[start:stop + 1] - a,
        seg_lengths=plan.seg_len[a:b],
        doc_ids=plan.seg_doc[a:b],
        chunk_ids=plan.seg_chunk[a:b],
        stats=plan.stats,
    )


def _validate_flat_tokens(tokens: np.ndarray, doc_offsets: np.ndarray) -> None:
    if tokens.size == 0:
        return
    if tokens.dtype.itemsize < 4 and tokens.dtype.kind == "u":
        return  # uint8/uint16 are always in range
    narrow = tokens.dtype.itemsize < 4 or tokens.dtype == np.int32  # cannot exceed 2**31 - 1
    if int(tokens.min()) >= 0 and (narrow or int(tokens.max()) < _TOKEN_LIMIT):
        return
    bad = int(_first_bad_token(tokens))
    if bad >= 0:
        raise _bad_token_error(tokens, doc_offsets, bad)


def pack_flat(tokens: np.ndarray, doc_offsets: np.ndarray, config: PackConfig) -> PackedRows:
    """Pack documents given as one flat token buffer plus offsets (Arrow ``ListArray`` layout).

    Document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i + 1]]``. This is the zero-copy entry
    point for Arrow/HF ``datasets`` list columns (``values`` + ``offsets``); see
    :func:`pack_documents` for the semantics (DESIGN.md §3).

    Args:
        tokens: 1-D integer array ``(total_tokens,)``, ids in ``[0, 2**31)``.
        doc_offsets: 1-D integer array ``(n_docs + 1,)``, non-decreasing, ``doc_offsets[-1] <=
            len(tokens)`` (``doc_offsets[0]`` may be > 0, e.g. a sliced Arrow array).
        config: a :class:`PackConfig`.

    Returns:
        :class:`PackedRows`.

    Raises:
        SourceError: tokens not a 1-D integer array, a token id outside ``[0, 2**31)`` (the
            message names the document index), or malformed ``doc_offsets``.
    """
    if not isinstance(config, PackConfig):
        raise FlamiaError(f"config must be a PackConfig, got {type(config).__name__}")
    tokens = np.asarray(tokens)
    offsets = np.asarray(doc_offsets)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise SourceError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    if offsets.ndim != 1 or offsets.size == 0 or (offsets.dtype.kind not in "iu"):
        raise SourceError(f"doc_offsets must be a 1-D integer array of shape (n_docs + 1,), got {offsets.shape} {offsets.dtype}")
    offsets = offsets.astype(np.int64, copy=False)
    lengths = np.diff(offsets)
    if offsets[0] < 0 or (lengths.size and lengths.min() < 0) or offsets[-1] > tokens.shape[0]:
        raise SourceError("doc_offsets must be non-decreasing, start >= 0 and end <= len(tokens)")
    if tokens.size == 0:
        tokens = np.zeros(0, dtype=np.int32)
    # validate only the referenced span
    lo, hi = int(offsets[0]), int(offsets[-1])
    span = tokens[lo:hi]
    _validate_flat_tokens(span, offsets - lo)
    plan = plan_packing(lengths, config)
    return fill_rows(plan, tokens, offsets, config, validate=False)


def _materialise(docs: object) -> list[np.ndarray]:
    out = []
    for i, d in enumerate(docs):
        if type(d) is not np.ndarray:
            if isinstance(d, (str, bytes)):
                raise SourceError(f"document {i}: expected a sequence of token ids, got {type(d).__name__}")
            try:
                d = np.asarray(d)
            except (ValueError, TypeError) as e:
                raise SourceError(f"document {i}: not a flat sequence of integer token ids ({e})") from None
        out.append(d)
    return out


def _bad_doc(arrs: list[np.ndarray]) -> None:
    """Raise a SourceError naming the first document that is not a 1-D integer array."""
    for i, a in enumerate(arrs):
        if a.ndim != 1:
            raise SourceError(f"document {i}: token ids must be a 1-D sequence, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":  # bool is rejected too: not a token id
            raise SourceError(f"document {i}: token ids must be integers, got dtype {a.dtype}")


def pack_documents(docs: Sequence[np.ndarray] | Iterable[Sequence[int]], config: PackConfig) -> PackedRows:
    """Pack token-id sequences into fixed-capacity rows (DESIGN.md §3).

    Builds a :class:`PackPlan` from the document lengths (:func:`plan_packing`), then copies the
    tokens into the rows with a numba loop (no per-token Python loop).

    Args:
        docs: a sequence or iterable of documents, each a 1-D numpy integer array or a sequence of
            Python ints (token ids in ``[0, 2**31)``). Consumed once.
        config: a :class:`PackConfig` (capacity, algorithm, long_docs policy, pad_id).

    Returns:
        :class:`PackedRows`: ``input_ids``/``position_ids`` int32 ``(n_rows, capacity)``, per-row
        ``num_tokens``, flat per-segment ``seg_lengths``/``doc_ids``/``chunk_ids`` with
        ``doc_offsets``, and :class:`PackStats`.

    Raises:
        SourceError: a document that is not a flat sequence of integers, or a token id outside
            ``[0, 2**31)``; the message names the document index.
        FlamiaError: ``config`` is not a :class:`PackConfig`; the rows
            (``8 * rows * capacity`` bytes) would not fit in half the available memory.
    """
    if not isinstance(config, PackConfig):
        raise FlamiaError(f"config must be a PackConfig, got {type(config).__name__}")
    arrs = _materialise(docs)
    n = len(arrs)
    lengths = np.fromiter((a.size if a.ndim == 1 else -1 for a in arrs), dtype=np.int64, count=n)
    if n and lengths.min() < 0:
        _bad_doc(arrs)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    nonempty = [a for a in arrs if a.size]
    if {a.dtype.kind for a in nonempty} - {"i", "u"}:  # bool/float/str/object: name the document
        _bad_doc(arrs)
    if nonempty:
        try:
            flat = np.concatenate(nonempty)
        except (ValueError, TypeError):
            _bad_doc(arrs)
            raise
        if flat.dtype.kind not in "iu":
            _bad_doc(arrs)
            # every document is an integer array, but uint64 mixed with signed ints promoted to
            # float64: range-check the uint64 ones, then concatenate as int64
            for i, a in enumerate(arrs):
                if a.dtype == np.uint64 and a.size and int(a.max()) >= _TOKEN_LIMIT:
                    raise SourceError(f"document {i}: token id {int(a.max())} is out of range; "
                                      "token ids must be integers in [0, 2**31)")
            flat = np.concatenate([a.astype(np.int64) for a in nonempty])
    else:
        flat = np.zeros(0, dtype=np.int32)
    _validate_flat_tokens(flat, offsets)
    plan = plan_packing(lengths, config)
    return fill_rows(plan, flat, offsets, config, validate=False)
