"""Document-local attention work lists: host reference, numba builder and the GPU builder.

Implements DESIGN.md §6 / seed 001 §6 (Algorithm 2, lines 01-06).

Item table
----------
A work item is one row of an int32 table with the columns :data:`ITEM_COLUMNS`
``(doc, q_start, q_end, cost)``:

- ``doc``: index of the document in ``cu_seqlens`` (row-local document number);
- ``q_start, q_end``: absolute token offsets in the packed row (``cu_seqlens`` coordinates),
  ``q_end - q_start <= BLOCK_M``; query tiles start at the document start:
  ``q_start = cu_seqlens[doc] + i * BLOCK_M``, ``q_end = min(q_start + BLOCK_M, cu_seqlens[doc + 1])``;
- ``cost``: number of visible key tiles of size ``BLOCK_N`` counted on the ROW's tile grid
  (tile ``t`` holds keys ``[t * BLOCK_N, (t + 1) * BLOCK_N)``), so a document starting at an
  unaligned offset can cost one tile more than an aligned one::

      causal:      keys [doc_start, q_end)     -> tiles  doc_start // BLOCK_N ... (q_end - 1) // BLOCK_N
      non-causal:  keys [doc_start, doc_end)   -> tiles  doc_start // BLOCK_N ... (doc_end - 1) // BLOCK_N

      cost = last_tile - first_tile + 1

Items are sorted by decreasing cost, ties by ``(doc, q_start)`` (ascending). This order is the
dynamic scheduler's queue and the input of the static snake assignment (:func:`static_assignment`).

``merge_short`` (TileConfig option)
-----------------------------------
Many tiny documents make one item each (131,072 one-token documents -> 131,072 items, each a
nearly empty tile). With ``merge_short=True`` every run of consecutive WHOLE documents that lie
entirely inside one ``BLOCK_M``-aligned query window of the row ``[w * BLOCK_M, (w + 1) * BLOCK_M)``
is coalesced into ONE item::

    doc     = index of the first document of the run
    q_start = start of the first document, q_end = end of the last document  (<= BLOCK_M queries)
    cost    = tiles spanned by [q_start, q_end):  (q_end - 1) // BLOCK_N - q_start // BLOCK_N + 1

(the keys visible to a short document lie inside its own range, causal or not). Documents that
cross a window boundary keep their ordinary per-``BLOCK_M`` items. The window rule (rather than a
greedy "fill up to BLOCK_M" scan) is chosen because it is computable in parallel on the GPU and
gives tile-aligned merged items; for S1 (131,072 one-token documents, BLOCK_M = 128) it yields
1,024 items of cost 1. **A kernel consuming a merged item must mask per token by document**: an
item is merged iff ``q_end > cu_seqlens[doc + 1]``; the document of a query/key token is then
``searchsorted(cu_seqlens, token, right=True) - 1`` (or a per-token document-id tensor), and keys
are visible only inside the same document (and ``key <= query`` when causal).

Builders
--------
- :func:`build_work_list_host`: plain, obviously-correct Python (the reference for tests);
- :func:`build_work_list_numba`: the same result from a numba host loop;
- :func:`build_work_list`: torch ops with fixed output sizes (no host sync when
  ``validate=False``, CUDA-graph capturable); the same code runs on CPU tensors, so CPU tests
  compare it to the reference; on CUDA tensors a fused Triton path (``backend="triton"``, the
  default there) does the expansion in one kernel;
- :class:`WorkListBuilder`: fixed buffers + a CUDA graph captured once, for eager callers that
  build one list per packed row (launch overhead, not GPU work, dominates an eager build).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.scheduler.keys import cost_key_dtype
from flamia_pack.varlen import validate_cu_seqlens

__all__ = [
    "check_work_list_tensors",
    "check_work_list_row",
    "ITEM_COLUMNS",
    "TileConfig",
    "WorkList",
    "WorkListBuilder",
    "build_work_list",
    "build_work_list_host",
    "build_work_list_numba",
    "max_work_items",
    "static_assignment",
    "walked_tiles",
    "work_list_to_numpy",
]

ITEM_COLUMNS = ("doc", "q_start", "q_end", "cost")
"""Columns of the int32 item table, in order."""

_MAX_BLOCK_M = 256


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TileConfig:
    """Tile geometry of the attention kernel the work list is built for (DESIGN.md §6)."""

    block_m: int = 128
    """BLOCK_M: queries per work item (power of two, 16 <= block_m <= 256)."""
    block_n: int = 128
    """BLOCK_N: keys per key tile; the cost unit (power of two >= 16)."""
    causal: bool = True
    """Causal attention (keys up to the query) or full attention inside each document."""
    merge_short: bool = False
    """Coalesce consecutive whole documents lying inside one BLOCK_M-aligned window into one item
    (see the module docstring; the kernel must mask per token by document)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not _is_pow2(int(v)) or v < 16:
                raise FlamiaError(f"TileConfig.{name} must be a power of two >= 16, got {v!r}")
        if self.block_m > _MAX_BLOCK_M:
            raise FlamiaError(f"TileConfig.block_m must be <= {_MAX_BLOCK_M}, got {self.block_m}")
        if not isinstance(self.causal, bool) or not isinstance(self.merge_short, bool):
            raise FlamiaError("TileConfig.causal and TileConfig.merge_short must be bool")


# ----------------------------------------------------------------------------------------------
# host reference
# ----------------------------------------------------------------------------------------------


def _tiles(first_key: int, last_key: int, block_n: int) -> int:
    """Number of BLOCK_N tiles of the row grid touched by keys first_key..last_key (inclusive)."""
    return last_key // block_n - first_key // block_n + 1


def build_work_list_host(cu_seqlens, config: TileConfig = TileConfig()) -> np.ndarray:
    """Plain-Python reference work list (the definition the other builders are tested against).

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32/int64 (numpy or torch), validated with
            :func:`flamia_pack.varlen.validate_cu_seqlens` (first 0, strictly increasing).
        config: tile geometry and options (:class:`TileConfig`).

    Returns:
        ``(n_items, 4)`` int32 numpy array, columns :data:`ITEM_COLUMNS`, sorted by decreasing
        cost then ``(doc, q_start)``. ``(0, 4)`` for zero documents.

    Raises:
        MetadataError: invalid ``cu_seqlens``.
    """
    cu = [int(x) for x in validate_cu_seqlens(cu_seqlens)]
    bm, bn = config.block_m, config.block_n
    items: list[tuple[int, int, int, int]] = []
    d = 0
    n = len(cu) - 1
    while d < n:
        s, e = cu[d], cu[d + 1]
        contained = s // bm == (e - 1) // bm
        if config.merge_short and contained:
            # take the run of following documents inside the same aligned window
            last = d
            while last + 1 < n and cu[last + 1] // bm == s // bm and (cu[last + 2] - 1) // bm == s // bm:
                last += 1
            q_end = cu[last + 1]
            items.append((d, s, q_end, _tiles(s, q_end - 1, bn)))
            d = last + 1
            continue
        q = s
        while q < e:
            q_end = min(q + bm, e)
            last_key = q_end - 1 if config.causal else e - 1
            items.append((d, q, q_end, _tiles(s, last_key, bn)))
            q = q_end
        d += 1
    items.sort(key=lambda it: (-it[3], it[0], it[1]))
    return np.array(items, dtype=np.int32).reshape(-1, 4)


# ----------------------------------------------------------------------------------------------
# numba host builder
# ----------------------------------------------------------------------------------------------

_numba_kernel = None


def _get_numba_kernel():
    global _numba_kernel
    if _numba_kernel is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def _expand(cu, bm, bn, causal, merge):  # pragma: no cover - compiled
            n = cu.shape[0] - 1
            # count
            cnt = 0
            d = 0
            while d < n:
                s = cu[d]
                e = cu[d + 1]
                if merge and s // bm == (e - 1) // bm:
                    w = s // bm
                    while d + 1 < n and cu[d + 1] // bm == w and (cu[d + 2] - 1) // bm == w:
                        d += 1
                    cnt += 1
                else:
                    cnt += (e - s + bm - 1) // bm
                d += 1
            out = np.empty((cnt, 4), np.int32)
            k = 0
            d = 0
            while d < n:
                s = cu[d]
                e = cu[d + 1]
                if merge and s // bm == (e - 1) // bm:
                    w = s // bm
                    first = d
                    while d + 1 < n and cu[d + 1] // bm == w and (cu[d + 2] - 1) // bm == w:
                        d += 1
                    q_end = cu[d + 1]
                    out[k, 0] = first
                    out[k, 1] = s
                    out[k, 2] = q_end
                    out[k, 3] = (q_end - 1) // bn - s // bn + 1
                    k += 1
                else:
                    q = s
                    while q < e:
                        q_end = min(q + bm, e)
                        last_key = q_end - 1 if causal else e - 1
                        out[k, 0] = d
                        out[k, 1] = q
                        out[k, 2] = q_end
                        out[k, 3] = last_key // bn - s // bn + 1
                        k += 1
                        q = q_end
                d += 1
            # items are generated in (doc, q_start) order: a stable sort on -cost gives the order.
            # Counting sort (costs are small ints): O(items + max cost), ~40x faster than numba's
            # mergesort on 172k items (the service's fast path); same order as the stable sort.
            mx = 0
            for i in range(cnt):
                if out[i, 3] > mx:
                    mx = out[i, 3]
            start = np.zeros(mx + 2, np.int64)
            for i in range(cnt):
                start[mx - out[i, 3] + 1] += 1
            for v in range(1, mx + 2):
                start[v] += start[v - 1]
            res = np.empty((cnt, 4), np.int32)
            for i in range(cnt):
                j = start[mx - out[i, 3]]
                start[mx - out[i, 3]] += 1
                res[j, 0] = out[i, 0]
                res[j, 1] = out[i, 1]
                res[j, 2] = out[i, 2]
                res[j, 3] = out[i, 3]
            return res

        _numba_kernel = _expand
    return _numba_kernel


def build_work_list_numba(cu_seqlens, config: TileConfig = TileConfig()) -> np.ndarray:
    """Same result as :func:`build_work_list_host`, from a compiled numba loop.

    Args/Returns/Raises: as :func:`build_work_list_host`. The first call compiles (cached on disk).
    """
    cu = validate_cu_seqlens(cu_seqlens)
    if cu[-1] >= 2**31:
        raise MetadataError(f"cu_seqlens[-1]={int(cu[-1])} does not fit the int32 item table")
    return _get_numba_kernel()(cu, config.block_m, config.block_n, config.causal, config.merge_short)


def walked_tiles(items: np.ndarray, cu_seqlens, config: TileConfig = TileConfig()) -> np.ndarray:
    """Key tiles a kernel program really walks for each item (the simulator's time unit).

    The ``cost`` column counts tiles on the ROW's grid (the sort key of DESIGN.md §6), so an
    unaligned document can cost one tile more than the kernels run; the kernels walk tiles of
    ``BLOCK_N`` keys starting at the document start (``kernels/tiles.py``: ``o_lo = span_lo``)::

        non-merged item:  ceil((last_key - doc_start + 1) / BLOCK_N),
                          last_key = q_end - 1 (causal) | doc_end - 1 (non-causal)
        merged item:      ceil((q_end - q_start) / BLOCK_N)

    Args:
        items: ``(n_items, 4)`` int work list rows ``(doc, q_start, q_end, cost)``.
        cu_seqlens: ``(n_docs + 1,)`` ints the list was built from (not re-validated).
        config: the list's tile geometry (``block_n``, ``causal``).

    Returns:
        int64 ``(n_items,)``; equals ``cost`` when every document starts on a ``BLOCK_N`` boundary.
    """
    it = np.asarray(items, dtype=np.int64).reshape(-1, 4)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    doc, qs, qe = it[:, 0], it[:, 1], it[:, 2]
    ds, de = cu[doc], cu[doc + 1]
    merged = qe > de
    lo = np.where(merged, qs, ds)
    hi = np.where(merged | bool(config.causal), qe, de)
    bn = int(config.block_n)
    return (hi - lo + bn - 1) // bn


# ----------------------------------------------------------------------------------------------
# device builder
# ----------------------------------------------------------------------------------------------


@dataclass
class WorkList:
    """A work list on the device, sized statically for CUDA graphs.

    Attributes:
        items: ``(max_items, 4)`` int32 on the device, columns :data:`ITEM_COLUMNS`, sorted by
            decreasing cost then ``(doc, q_start)``; rows ``>= num_items`` are filled with -1.
        num_items: ``(1,)`` int32 on the device: number of valid rows.
        max_items: static row count of ``items``.
        config: the :class:`TileConfig` the list was built for.
        total_tokens: T of the row the list was built for (``varlen_attention`` rejects a list
            built for another T: its items would address rows past the call's tensors); None for a
            list made by hand (not checked).
        min_seqlen: the shortest document of the ``cu_seqlens`` the list was built from, known when
            it was built with ``validate=True`` (which copies ``cu_seqlens`` to the host anyway);
            None otherwise (``validate=False``, :class:`WorkListBuilder`, by hand). With it,
            ``varlen_attention`` skips the kernels' leftover launches for short documents on rows
            that have none (``attention.leftover_bits``). Like the items, it describes that
            ``cu_seqlens`` only; it is read through :func:`work_list_hints`, which drops it once the
            buffers were written in place since the build (a list refreshed for another row).
        doc_tokens: ``cu_seqlens[-1]`` of the build (the tokens in documents), known and trusted as
            ``min_seqlen``; equal to ``total_tokens`` on rows without row-end padding, where
            ``varlen_attention`` skips its padding fills (``attention.launch_bits``).

    A list built from a ``cu_seqlens`` on the CPU also remembers it (a private int64 copy, taken at
    the build, which is on the host anyway): the CPU paths of ``varlen_attention`` reject a call
    whose ``cu_seqlens`` differs (:func:`check_work_list_row`). A list built on a GPU keeps no copy
    (it would cost a host sync), so there a list of another row of the same T is not detected.
    """

    items: torch.Tensor
    num_items: torch.Tensor
    max_items: int
    config: TileConfig = field(default_factory=TileConfig)
    total_tokens: int | None = None
    min_seqlen: int | None = None
    doc_tokens: int | None = None

    def to_numpy(self) -> np.ndarray:
        """Valid rows as a ``(num_items, 4)`` int32 numpy array (syncs; for tests and tools)."""
        return work_list_to_numpy(self)


def check_work_list_tensors(work_list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(items, num_items)`` of a :class:`WorkList` handed to an attention call, after the checks every path
    makes: a WorkList-like object, ``items`` a contiguous ``(max_items, 4)`` int32 tensor, ``num_items`` a
    ``(1,)`` int32 tensor, both on ``device``.

    Raises:
        FlamiaError: naming what is wrong and what is allowed.
    """
    items = getattr(work_list, "items", None)
    num_items = getattr(work_list, "num_items", None)
    if not isinstance(items, torch.Tensor) or not isinstance(num_items, torch.Tensor) or \
            getattr(work_list, "config", None) is None:
        raise FlamiaError("work_list must be a flamia_pack.scheduler.worklist.WorkList (items, num_items, config), "
                          f"got {type(work_list).__name__}")
    if items.dtype != torch.int32 or items.dim() != 2 or items.shape[1] != 4 or not items.is_contiguous():
        raise FlamiaError(f"work_list.items must be a contiguous (max_items, 4) int32 tensor, got "
                          f"{tuple(items.shape)} {items.dtype}")
    if num_items.dtype != torch.int32 or num_items.numel() != 1:
        raise FlamiaError(f"work_list.num_items must be a (1,) int32 tensor, got {tuple(num_items.shape)} "
                          f"{num_items.dtype}")
    if items.device != torch.device(device) or num_items.device != torch.device(device):
        raise FlamiaError(f"work_list must be on {device}, got {items.device}")
    return items, num_items


def work_list_to_numpy(wl: WorkList) -> np.ndarray:
    """Copy the valid rows of ``wl`` to the host: ``(num_items, 4)`` int32 (one sync)."""
    n = int(wl.num_items.to("cpu")[0])
    return wl.items[:n].to("cpu").numpy().copy()


def max_work_items(total_tokens: int, max_docs: int | None = None, config: TileConfig = TileConfig()) -> int:
    """Static upper bound on the number of items for any row of ``total_tokens`` tokens.

    Used to size the work-list buffers (CUDA graphs need fixed sizes).

    Without merging, a document of length L makes ``ceil(L / BLOCK_M) <= L // BLOCK_M + 1`` items,
    so ``n_items <= T // BLOCK_M + n_docs`` and ``n_items <= T`` (one token at least per item).
    With ``merge_short`` there is at most one merged item per aligned window
    (``ceil(T / BLOCK_M)``), and the remaining documents each cross one of the
    ``ceil(T / BLOCK_M) - 1`` window boundaries (a boundary is crossed by one document at most),
    so their items number at most ``T // BLOCK_M + ceil(T / BLOCK_M) - 1``.

    Args:
        total_tokens: T, tokens of the row (or its capacity); >= 0.
        max_docs: upper bound on documents per row, or None (then T).
        config: tile geometry.

    Returns:
        int >= 0.
    """
    t = int(total_tokens)
    if t < 0:
        raise FlamiaError(f"total_tokens must be >= 0, got {total_tokens}")
    bm = config.block_m
    n = t if max_docs is None else min(int(max_docs), t)
    bound = min(t, t // bm + n)
    if config.merge_short:
        windows = -(-t // bm)
        bound = min(bound, windows + t // bm + max(windows - 1, 0))
    return bound


_ARANGE_CACHE: dict = {}


def _arange(m: int, device: torch.device) -> torch.Tensor:
    key = (m, str(device))
    a = _ARANGE_CACHE.get(key)
    if a is None:
        a = torch.arange(m, device=device, dtype=torch.int64)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ARANGE_CACHE[key] = a
    return a


def _expand_torch(cu: torch.Tensor, m: int, config: TileConfig):
    """Unsorted item fields (int64, length m, in (doc, q_start) order) and the item count.

    Fixed shapes; no host sync. Rows >= count hold garbage and are masked by the caller.
    """
    bm, bn = config.block_m, config.block_n
    n = cu.numel() - 1
    starts = cu[:-1]
    ends = cu[1:]
    if config.merge_short:
        w = torch.div(starts, bm, rounding_mode="floor")
        # (ends > starts): empty trailing segments of a padded cu_seqlens buffer make no item
        contained = (w == torch.div(ends - 1, bm, rounding_mode="floor")) & (ends > starts)
        # a contained doc continues its predecessor's run if that one is contained in the same window
        prev_same = torch.zeros_like(contained)
        if n > 1:
            prev_same[1:] = contained[:-1] & (w[:-1] == w[1:])
        run_head = contained & ~prev_same
        cnt = torch.where(contained, run_head.to(torch.int64), torch.div(ends - starts + (bm - 1), bm, rounding_mode="floor"))
    else:
        cnt = torch.div(ends - starts + (bm - 1), bm, rounding_mode="floor")
    offs = torch.cumsum(cnt, 0)  # inclusive
    j = _arange(m, cu.device)
    d = torch.searchsorted(offs, j, right=True).clamp_(max=n - 1)
    total = offs[-1:]
    first = offs[d] - cnt[d]
    s = starts[d]
    e = ends[d]
    qs = s + (j - first) * bm
    valid = j < total
    if config.merge_short:
        # items tile the used part of the row contiguously and in order, so an item ends where
        # the next one starts (the last one at cu[-1]); needed for merged runs.
        qs = torch.where(valid, qs, cu[-1:])
        qe = torch.cat([qs[1:], cu[-1:]])
        first_key = torch.where(contained[d], qs, s)
    else:
        qe = torch.minimum(qs + bm, e)
        first_key = s
    if config.causal or config.merge_short:
        last_key = qe - 1 if config.causal else torch.where(contained[d], qe - 1, e - 1)
    else:
        last_key = e - 1
    cost = torch.div(last_key, bn, rounding_mode="floor") - torch.div(first_key, bn, rounding_mode="floor") + 1
    return d, qs, qe, cost, valid, total


def _host_int(name: str, value, lo: int, hi: int | None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (numpy / torch integer scalars accepted; bool, float,
    str and None rejected), else :class:`MetadataError` naming ``name`` and the allowed range."""
    ok = not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        v = operator.index(value) if ok else None
    except TypeError:
        v = None
    if v is None or v < lo or (hi is not None and v > hi):
        allowed = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise MetadataError(f"{name} must be {allowed}, got {value!r}")
    return int(v)


def cu_seqlens_summary(cu_seqlens: torch.Tensor, total_tokens: int, max_seqlen: int | None = None,
                       name: str = "total_tokens") -> tuple[int | None, int]:
    """Host check of ``cu_seqlens`` against a row of ``total_tokens`` tokens (one copy to the host,
    ``varlen.validate_cu_seqlens``'s rules) and, if given, against ``max_seqlen``.

    Returns:
        ``(shortest, doc_tokens)``: the shortest document's length (None for zero documents) and
        ``cu_seqlens[-1]`` (tokens in documents; the rest of the row is row-end padding).

    Raises:
        MetadataError: invalid ``cu_seqlens``, ``cu_seqlens[-1] > total_tokens``, ``total_tokens >=
            2**31`` (the int32 item table), or ``max_seqlen`` below the longest document.
    """
    arr = validate_cu_seqlens(cu_seqlens)
    if int(arr[-1]) > int(total_tokens):
        raise MetadataError(
            f"cu_seqlens[-1]={int(arr[-1])} exceeds {name}={int(total_tokens)} "
            "(the row length; tokens past cu_seqlens[-1] are row-end padding)"
        )
    if int(total_tokens) >= 2**31:
        raise MetadataError(f"{name}={int(total_tokens)} does not fit the int32 item table")
    if len(arr) == 1:
        return None, int(arr[-1])
    lengths = arr[1:] - arr[:-1]
    if max_seqlen is not None and max_seqlen < int(lengths.max()):
        raise MetadataError(f"max_seqlen={max_seqlen} is smaller than the longest document ({int(lengths.max())})")
    return int(lengths.min()), int(arr[-1])


def build_work_list(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    config: TileConfig = TileConfig(),
    *,
    max_items: int | None = None,
    validate: bool = True,
    out: WorkList | None = None,
    backend: str = "auto",
    min_seqlen: int | None = None,
    doc_tokens: int | None = None,
    max_seqlen: int | None = None,
) -> WorkList:
    """Build the sorted work list on ``cu_seqlens.device`` (DESIGN.md §6, seed 001 Algorithm 2).

    All work runs on the tensor's device with fixed output sizes: with ``validate=False`` there is
    no host synchronisation and the call can be captured in a CUDA graph (pass ``out`` to write
    into fixed buffers, and build ``cu_seqlens`` in a fixed buffer too). CPU tensors take the same
    torch code path, which the tests compare to :func:`build_work_list_host`.

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32 or int64 tensor (row-local offsets, first 0, strictly
            increasing, last <= total_tokens). ``n_docs`` is static (the tensor's shape). For CUDA
            graphs that replay over rows with different document counts, pad the buffer with its
            last value (empty TRAILING segments make no item; accepted with ``validate=False``).
        total_tokens: T, the row length (or capacity) the buffers are sized for; tokens past
            ``cu_seqlens[-1]`` are row-end padding and belong to no item.
        config: :class:`TileConfig`.
        max_items: row count of the output; default :func:`max_work_items(T, n_docs, config)`,
            which can never overflow.
        validate: check ``cu_seqlens`` (one host copy) and, when ``max_items`` is given, that the
            list fits. With False, invalid input gives undefined rows and an overflowing list is
            truncated (``num_items`` still reports the full count).
        out: optional preallocated :class:`WorkList` (same device, ``max_items`` rows) to fill.
        backend: ``"torch"`` (any device), ``"triton"`` (CUDA; fused expansion kernel) or
            ``"auto"`` (triton on CUDA when available, else torch).
        min_seqlen: with ``validate=False``, the shortest non-empty document of ``cu_seqlens`` if the
            caller knows it from a host copy (``loaders.collate.to_device``); it becomes the list's
            ``min_seqlen`` hint. With ``validate=True`` the hint is computed from the check instead.
            Checked without a sync: an int in ``[1, doc_tokens or total_tokens]``. The kernels trust
            it: one larger than the true shortest document skips launches that document needs.
        doc_tokens: likewise, ``cu_seqlens[-1]`` from the caller's host copy (the list's
            ``doc_tokens`` hint), an int in ``[0, total_tokens]``; with ``validate=True`` taken from
            the check. Trusted as ``min_seqlen``: ``doc_tokens == total_tokens`` on a row with padding
            leaves its padding rows of O / LSE and dQ / dK / dV unwritten.
        max_seqlen: with ``validate=True``, also check that no document is longer (the bound the
            list's tile geometry was chosen for, ``attention.build_attention_work_list``); an int
            >= 0 or None (unchecked). Ignored with ``validate=False``.

    Returns:
        :class:`WorkList` (``items`` (max_items, 4) int32, ``num_items`` (1,) int32).

    Raises:
        MetadataError: invalid ``cu_seqlens`` (validate=True; its type, shape and the meta device
            always), the list exceeds ``max_items``, ``total_tokens`` / ``max_items`` / ``min_seqlen``
            / ``doc_tokens`` / ``max_seqlen`` not ints in range (bool, float, str, None rejected; numpy
            ints accepted), a document longer than ``max_seqlen`` (validate=True).
        FlamiaError: unknown backend, ``config`` not a :class:`TileConfig`, or ``out`` of the wrong
            shape/device.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise MetadataError(f"cu_seqlens must be a torch.Tensor for build_work_list, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise MetadataError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise MetadataError(f"cu_seqlens must be 1-D of shape (n_docs + 1,), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type == "meta":
        raise MetadataError("cu_seqlens is on the meta device (no values): pass it on the CPU or a GPU")
    total_tokens = _host_int("total_tokens", total_tokens, 0, 2**31 - 1)
    if max_items is not None:
        max_items = _host_int("max_items", max_items, 0, None)
    if not isinstance(config, TileConfig):
        raise FlamiaError(f"config must be a TileConfig, got {type(config).__name__}")
    if max_seqlen is not None:
        max_seqlen = _host_int("max_seqlen", max_seqlen, 0, None)
    if validate:
        shortest, covered = cu_seqlens_summary(cu_seqlens, total_tokens, max_seqlen)
    else:  # a caller's host-known hints (the kernels trust them: checked here, without a sync)
        covered = None if doc_tokens is None else _host_int("doc_tokens", doc_tokens, 0, total_tokens)
        shortest = None if min_seqlen is None else _host_int("min_seqlen", min_seqlen, 1,
                                                              total_tokens if covered is None else max(covered, 1))
    device = cu_seqlens.device
    n = cu_seqlens.numel() - 1
    m = max_work_items(total_tokens, n, config) if max_items is None else int(max_items)
    if out is not None:
        if out.items.shape != (m, 4) or out.items.device != device or out.items.dtype != torch.int32:
            raise FlamiaError(
                f"out.items must be ({m}, 4) int32 on {device}, got {tuple(out.items.shape)} {out.items.dtype} on {out.items.device}"
            )
        out.config = config
        out.max_items = m
        out.total_tokens = int(total_tokens)
        out.min_seqlen = shortest  # None unless known: a reused buffer never keeps another row's hint
        out.doc_tokens = covered
        wl = out
    else:
        wl = WorkList(
            items=torch.empty((m, 4), dtype=torch.int32, device=device),
            num_items=torch.empty((1,), dtype=torch.int32, device=device),
            max_items=m,
            config=config,
            total_tokens=int(total_tokens),
            min_seqlen=shortest,
            doc_tokens=covered,
        )
    if n == 0 or m == 0:
        wl.items.fill_(-1)
        wl.num_items.zero_()
        if validate and n > 0 and m == 0:
            raise MetadataError(f"work list does not fit max_items={m}")
        return _stamp_hint(wl, cu_seqlens)
    if backend not in ("auto", "torch", "triton"):
        raise FlamiaError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and device.type == "cuda" and _triton_available())
    if use_triton:
        if device.type != "cuda":
            raise FlamiaError("backend='triton' needs a CUDA tensor")
        from flamia_pack.scheduler import _worklist_triton

        try:
            _worklist_triton.build_into(cu_seqlens, int(total_tokens), config, wl)
        except Exception as exc:  # compile/launch failure of the optional fast path
            if backend == "triton":
                raise
            global _TRITON_OK
            _TRITON_OK = False
            warnings.warn(f"Triton work-list builder failed ({exc!r}); using the torch builder", RuntimeWarning)
            _build_torch_into(cu_seqlens, int(total_tokens), config, wl)
    else:
        _build_torch_into(cu_seqlens, int(total_tokens), config, wl)
    if validate and max_items is not None:
        count = int(wl.num_items.to("cpu")[0])
        if count > m:
            raise MetadataError(f"work list has {count} items but max_items={m}; use max_work_items()")
    return _stamp_hint(wl, cu_seqlens)


def _buffer_versions(wl) -> tuple[int, int] | None:
    """The version counters of ``wl.items`` / ``wl.num_items``, or None where they have none (tensors
    made under ``torch.inference_mode``): then nothing is trusted that depends on them."""
    try:
        return wl.items._version, wl.num_items._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def _stamp_hint(wl: WorkList, cu_seqlens: torch.Tensor | None = None) -> WorkList:
    """Record the version counters of ``wl``'s buffers next to its hints, once they are
    written: :func:`work_list_hints` trusts them only while no in-place write (``copy_``, slice
    assignment) has changed them since -- a list refreshed on the device for another row keeps no
    stale hint. A ``cu_seqlens`` on the CPU (the one the list was built from) is remembered too, as
    an int64 copy next to the same counters, for :func:`check_work_list_row` (no copy of a device
    tensor: that would cost a host sync)."""
    versions = _buffer_versions(wl)
    known = wl.min_seqlen is not None or wl.doc_tokens is not None
    # the values too: a hint edited on the object after the build is not trusted either
    wl._hint_versions = (*versions, wl.min_seqlen, wl.doc_tokens) if known and versions is not None else None
    row = None
    if (versions is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        row = (cu_seqlens.detach().to(torch.int64, copy=True), *versions)
    wl._built_from = row
    return wl


def _cu_text(cu: torch.Tensor) -> str:
    """``cu_seqlens`` for an error message: its distinct values (a padded buffer's repeats dropped),
    the middle elided past 8."""
    vals = cu.tolist()
    while len(vals) > 1 and vals[-1] == vals[-2]:
        vals.pop()
    shown = ", ".join(map(str, vals)) if len(vals) <= 8 else \
        ", ".join(map(str, vals[:4])) + ", ..., " + ", ".join(map(str, vals[-3:]))
    return f"[{shown}] ({len(vals) - 1} document(s))"


def check_work_list_row(work_list, cu_seqlens: torch.Tensor, build_hint: str) -> None:
    """Reject a work list built from other ``cu_seqlens`` than the call's, where that costs no host sync.

    Checked when the list was built (:func:`build_work_list`, :class:`WorkListBuilder`, or their
    wrappers ``build_attention_work_list`` / ``build_fp8_work_list``) from a ``cu_seqlens`` on the
    CPU, which the list remembers (an int64 copy), the call's ``cu_seqlens`` is on the CPU too, and
    the list's buffers were not written in place since the build; the comparison then reads host
    memory only. A list built from a padded buffer (the documents' offsets, then the last one
    repeated: empty trailing segments make no item) matches the unpadded ``cu_seqlens``. Not
    checked: lists built on a GPU (their ``cu_seqlens`` stays on the device; comparing it would
    sync), lists made by hand, lists built under ``torch.inference_mode`` (their buffers have no
    version counters to tell an in-place refresh), and calls traced by ``torch.compile``.

    Args:
        work_list: the call's list (after :func:`check_work_list_tensors`).
        cu_seqlens: the call's ``cu_seqlens``, already validated.
        build_hint: the builder call to suggest, e.g. ``"build_fp8_work_list(cu_seqlens, T)"``.

    Raises:
        FlamiaError: the list describes another row's documents (both ``cu_seqlens`` named).
    """
    built = getattr(work_list, "_built_from", None)
    if (built is None or not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.device.type != "cpu"
            or torch.compiler.is_compiling()):
        return
    ref, v_items, v_num = built
    if _buffer_versions(work_list) != (v_items, v_num):
        return  # rewritten in place since the build: which row it describes now is unknown here
    cu = cu_seqlens.detach().to(torch.int64)
    n = cu.numel()
    same = n > 0 and ref.numel() >= n and torch.equal(ref[:n], cu) and bool((ref[n:] == cu[-1]).all())
    if not same:
        raise FlamiaError(
            f"work_list was built for cu_seqlens {_cu_text(ref)} but the call has cu_seqlens {_cu_text(cu)}: its "
            f"items describe another row's documents; build the list from this call's cu_seqlens ({build_hint})")


def work_list_hints(wl) -> tuple[int | None, int | None]:
    """``(wl.min_seqlen, wl.doc_tokens)`` if they still describe the buffers (see :func:`_stamp_hint`),
    else ``(None, None)``.

    Hints set by hand on the object are not trusted; pass them to :func:`build_work_list`
    (``min_seqlen=``, ``doc_tokens=``) instead. CUDA-graph replays and raw kernel writes do not move
    version counters: a list refilled that way must be rebuilt through :func:`build_work_list`
    (``validate=False`` clears the hints), as :class:`WorkListBuilder` does; ``varlen_attention`` also
    ignores hints while a CUDA graph is being captured or under ``torch.compile``, so a captured step
    never bakes one in.
    """
    items, num = getattr(wl, "items", None), getattr(wl, "num_items", None)
    if not isinstance(items, torch.Tensor) or not isinstance(num, torch.Tensor):
        return None, None
    ms, dt = getattr(wl, "min_seqlen", None), getattr(wl, "doc_tokens", None)
    versions = _buffer_versions(wl)
    if versions is None or getattr(wl, "_hint_versions", None) != (*versions, ms, dt):
        return None, None
    return ms, dt


def _build_torch_into(cu_seqlens: torch.Tensor, total_tokens: int, config: TileConfig, wl: WorkList) -> None:
    m = wl.max_items
    cu = cu_seqlens.to(torch.int64)
    d, qs, qe, cost, valid, total = _expand_torch(cu, m, config)
    key = torch.where(valid, -cost, 1).to(cost_key_dtype(total_tokens, config.block_n))
    _, perm = torch.sort(key, stable=True)
    table = torch.stack([d, qs, qe, cost], dim=1).to(torch.int32)
    table = torch.where(valid[:, None], table, -1)
    torch.index_select(table, 0, perm, out=wl.items)
    wl.num_items.copy_(total)


_TRITON_OK: bool | None = None


def _triton_available() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401

            from flamia_pack.scheduler import _worklist_triton  # noqa: F401

            _TRITON_OK = True
        except Exception:  # pragma: no cover - depends on the install
            _TRITON_OK = False
    return _TRITON_OK


class WorkListBuilder:
    """Reusable builder with fixed buffers, captured once in a CUDA graph (eager calls at graph speed).

    For the loop "new packed row -> work list" outside any user CUDA graph. The first call on a
    CUDA device runs the build once (compiles), then captures :func:`build_work_list` into a CUDA
    graph over the builder's own fixed buffers; every call then costs one gather (the input
    ``cu_seqlens`` copied into the fixed ``(max_docs + 1,)`` buffer, padded with its last value:
    empty trailing segments make no item) and one graph replay. On CPU, or while the current
    stream is being captured by the caller, it runs the ops directly on the same buffers.

    The returned :class:`WorkList` is the builder's buffer, overwritten by the next call (like a
    CUDA graph's static outputs): clone ``items`` / ``num_items`` to keep one.

    Args:
        max_docs: largest document count per row (the buffer size).
        total_tokens: T, the row length / capacity (``cu_seqlens[-1] <= T``).
        config: :class:`TileConfig`.
        device: where the buffers live.
        backend: as :func:`build_work_list`.
        use_graph: capture a CUDA graph (default: True on CUDA).

    Raises:
        FlamiaError: ``max_docs < 1``, or (per call) more documents than ``max_docs``.
    """

    _PAD_CACHE = 64

    def __init__(self, max_docs: int, total_tokens: int, config: TileConfig = TileConfig(), *,
                 device: str | torch.device = "cuda", backend: str = "auto", use_graph: bool | None = None):
        if int(max_docs) < 1:
            raise FlamiaError(f"max_docs must be >= 1, got {max_docs}")
        self.max_docs = int(max_docs)
        self.total_tokens = int(total_tokens)
        self.config = config
        self.backend = backend
        self.device = torch.device(device)
        m = max_work_items(self.total_tokens, self.max_docs, config)
        self.cu_seqlens = torch.zeros(self.max_docs + 1, dtype=torch.int32, device=self.device)
        self.work_list = WorkList(
            items=torch.full((m, 4), -1, dtype=torch.int32, device=self.device),
            num_items=torch.zeros(1, dtype=torch.int32, device=self.device),
            max_items=m,
            config=config,
            total_tokens=self.total_tokens,
        )
        self.use_graph = (self.device.type == "cuda") if use_graph is None else bool(use_graph)
        self._graph = None
        self._pad_index: dict[int, torch.Tensor] = {}

    def _index(self, n: int) -> torch.Tensor:
        idx = self._pad_index.get(n)
        if idx is None:
            idx = torch.arange(self.max_docs + 1, device=self.device).clamp_(max=n)
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:
                if len(self._pad_index) >= self._PAD_CACHE:
                    self._pad_index.pop(next(iter(self._pad_index)))
                self._pad_index[n] = idx
        return idx

    def _run(self) -> None:
        build_work_list(self.cu_seqlens, self.total_tokens, self.config, max_items=self.work_list.max_items,
                        validate=False, out=self.work_list, backend=self.backend)

    def __call__(self, cu_seqlens: torch.Tensor, *, validate: bool = False) -> WorkList:
        """Build the list of ``cu_seqlens`` (``(n_docs + 1,)``, n_docs <= max_docs) into the buffers.

        ``validate=True`` checks ``cu_seqlens`` first (one host sync). No host sync otherwise.
        """
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
            raise MetadataError("cu_seqlens must be a 1-D torch.Tensor of shape (n_docs + 1,)")
        n = cu_seqlens.numel() - 1
        if n > self.max_docs:
            raise FlamiaError(f"{n} documents exceed the builder's max_docs={self.max_docs}")
        if n < 0:
            raise MetadataError("cu_seqlens must have at least one element (0)")
        if validate:
            cu_seqlens_summary(cu_seqlens, self.total_tokens)
        src = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        torch.index_select(src, 0, self._index(n), out=self.cu_seqlens)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not self.use_graph or capturing:
            self._run()
            return self.work_list
        if self._graph is None:
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._run()  # compile + warm up outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run()
            self._graph = graph
        self._graph.replay()
        return self.work_list


# ----------------------------------------------------------------------------------------------
# static (snake) assignment
# ----------------------------------------------------------------------------------------------


def static_assignment(items: torch.Tensor | np.ndarray, num_items, num_ctas: int) -> torch.Tensor | np.ndarray:
    """Snake (alternating) assignment of the sorted items over ``num_ctas`` persistent CTAs.

    Item ``k`` of the sorted list goes to CTA ``k % P`` in even rounds (``k // P`` even) and to
    ``P - 1 - k % P`` in odd rounds (seed 001 Algorithm 2 line 06). CTA ``c`` processes its items
    in increasing ``k``. Works on torch tensors (any device, no host sync) and numpy arrays.

    Args:
        items: ``(max_items, 4)`` int32 item table (only its row count is used).
        num_items: ``(1,)`` int32 device tensor or an int: number of valid rows.
        num_ctas: P >= 1.

    Returns:
        ``(max_items,)`` int32 CTA id per item, -1 for rows ``>= num_items`` (same library/device as
        ``items``).
    """
    p = int(num_ctas)
    if p < 1:
        raise FlamiaError(f"num_ctas must be >= 1, got {num_ctas}")
    m = items.shape[0]
    if isinstance(items, torch.Tensor):
        k = torch.arange(m, device=items.device, dtype=torch.int32)
        r = torch.div(k, p, rounding_mode="floor")
        pos = k - r * p
        cta = torch.where((r & 1) == 0, pos, p - 1 - pos)
        if isinstance(num_items, torch.Tensor):
            lim = num_items.to(device=items.device, dtype=torch.int32)
        else:
            lim = torch.tensor([int(num_items)], device=items.device, dtype=torch.int32)
        return torch.where(k < lim, cta, -1).to(torch.int32)
    k = np.arange(m, dtype=np.int64)
    r = k // p
    pos = k % p
    cta = np.where(r % 2 == 0, pos, p - 1 - pos)
    return np.where(k < int(np.asarray(num_items).reshape(-1)[0]), cta, -1).astype(np.int32)
