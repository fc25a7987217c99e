"""Packed rows -> one training batch for varlen attention, and a sync-free copy to the GPU (DESIGN.md §2-3, §6).

Batch layout ("compacted"; chosen so that ``cu_seqlens`` never describes padding)
-------------------------------------------------------------------------------
A batch of ``B`` packed rows of ``capacity`` tokens is ONE flattened token stream of
``T = B * capacity`` tokens, returned reshaped as ``(B, capacity)``:

* the real tokens of row 0, then of row 1, ... are laid end to end (each row's documents keep
  their order); ``num_real_tokens = sum(num_tokens)``;
* all row-end padding of all rows is moved to the tail ``[num_real_tokens, T)``: ``pad_id``,
  ``position_ids`` 0, ``labels`` ``ignore_index``. These tokens belong to NO document:
  ``cu_seqlens`` ends at ``num_real_tokens``, not at ``T``.

So rows ``[3, 2]`` and ``[3, 2]`` give ``cu_seqlens = [0, 3, 5, 8, 10]`` for any capacity >= 5.
When no row has padding the batch is exactly the stack of the rows. When rows have padding, line
``b`` of the ``(B, capacity)`` tensors is *not* packed row ``b`` (documents may straddle lines);
``row_offsets`` maps packed row ``b`` to ``[row_offsets[b], row_offsets[b + 1])`` of the flattened
stream. Models must therefore treat the batch as one flattened sequence (``x.view(B * capacity,
...)``) with ``cu_seqlens``/``position_ids`` -- which is what varlen attention does anyway.

Attention contract: ``q, k, v`` have ``T = B * capacity`` rows and ``cu_seqlens[-1] =
num_real_tokens <= T``; the op treats tokens past ``cu_seqlens[-1]`` as padding (zero output,
LSE ``+inf``; see :func:`flamia_pack.kernels.reference.packed_attention_reference`). A model
may also slice ``x[:num_real_tokens]`` to skip padding entirely. No padding token is ever a
document, so no attention work (and no work-list item) is spent on padding.

Labels are shifted *within* each segment: ``labels[t] = input_ids[t + 1]`` when ``t + 1`` is in
the same segment of ``cu_seqlens``, else ``ignore_index`` (the last token of every segment, and
every padding token). A segment is a document piece inside one row, so the row start is always
a boundary -- also for a row whose first piece continues a document from an earlier row (``concat``
packing; flamia_pack's packer restarts every piece's ``position_ids`` at 0, other packers may
continue them, e.g. from 5: they are kept as given for RoPE).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import get_worker_info

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.varlen import validate_cu_seqlens

__all__ = ["PackedCollator", "to_device", "cu_seqlens_from_position_ids"]


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised 1-D tensor; in a DataLoader worker it lives in shared memory from the start
    (as ``default_collate`` does), so sending the batch to the main process copies nothing."""
    if get_worker_info() is not None:
        try:
            storage = torch.UntypedStorage._new_shared(n * torch.empty(0, dtype=dtype).element_size())
            return torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))
        except (AttributeError, RuntimeError):  # pragma: no cover - private API moved
            pass
    return torch.empty(n, dtype=dtype)


def cu_seqlens_from_position_ids(position_ids: Any, num_tokens: Optional[int] = None) -> np.ndarray:
    """Row-local ``cu_seqlens`` (int32 ``(n_segments + 1,)``) from one row's ``position_ids``.

    A segment starts at token 0 (the row start is always a boundary, whatever its position id:
    a ``concat`` continuation may start at 5) and wherever ``position_ids[t] != position_ids[t - 1] + 1``
    (a restart). Only the first ``num_tokens`` tokens (default: all) are used; the rest is padding.

    Raises:
        MetadataError: ``position_ids`` not 1-D integers, or ``num_tokens`` out of range.
    """
    pos = _np(position_ids)
    if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
        raise MetadataError(f"position_ids must be a 1-D integer array, got shape {pos.shape} dtype {pos.dtype}")
    n = pos.shape[0] if num_tokens is None else int(num_tokens)
    if not 0 <= n <= pos.shape[0]:
        raise MetadataError(f"num_tokens must be in [0, {pos.shape[0]}], got {n}")
    p = pos[:n].astype(np.int64)
    starts = np.flatnonzero(p[1:] != p[:-1] + 1) + 1
    head = [0] if n else []
    return np.concatenate([head, starts, [n]]).astype(np.int32) if n else np.zeros(1, np.int32)


def _check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise FlamiaError(f"{name} must be an integer in [{lo}, {hi}], got {type(value).__name__} ({value!r})")
    if not lo <= int(value) <= hi:
        raise FlamiaError(f"{name} must be an integer in [{lo}, {hi}], got {int(value)}")
    return int(value)


class PackedCollator:
    """Collate packed rows (items of :class:`PackedDataset`/:class:`StreamingPackedDataset`) into a batch.

    Input: a sequence of ``B >= 1`` row dicts with ``input_ids`` (``(capacity,)``, same capacity
    for all rows) and ``cu_seqlens`` (row-local, int) and ``num_tokens``; ``position_ids``,
    ``doc_ids``, ``chunk_ids`` are used when present. A row without ``cu_seqlens`` gets it from
    ``position_ids`` (:func:`cu_seqlens_from_position_ids`) over its real tokens.

    The real length of a row (its tokens before the row-end padding) is ``num_tokens``; without it,
    ``cu_seqlens[-1]``; without both, it is inferred, so that padding never becomes documents
    or labels (whatever ``position_ids`` hold on the padding: zeros, or a continued count):

    * from an ``attention_mask`` (``(capacity,)``, 1 on the real tokens then 0 on the padding;
      a 0 before a 1 raises ``MetadataError``), when the row has one;
    * else from ``pad_id``: the trailing run of ``pad_id`` tokens is padding. A document whose
      last token is ``pad_id`` (e.g. ``pad_id`` = the EOS id) loses that token; give such rows
      ``num_tokens`` or an ``attention_mask``.

    Output (CPU tensors, see the module docstring for the compacted layout), ``T = B * capacity``:

    ===================  ===================  =====================================================
    key                  dtype, shape         meaning
    ===================  ===================  =====================================================
    ``input_ids``        int64 ``(B, C)``     tokens; real tokens first, ``pad_id`` tail
    ``labels``           int64 ``(B, C)``     next token inside the segment, else ``ignore_index``
    ``position_ids``     int64 ``(B, C)``     as stored in the rows; 0 on padding
    ``cu_seqlens``       int32 ``(S + 1,)``   all S segments of the batch, ``[0, ..., num_real_tokens]``
    ``max_seqlen``       int                  longest segment (0 if none)
    ``num_real_tokens``  int                  ``cu_seqlens[-1]``
    ``num_tokens``       int32 ``(B,)``       real tokens per packed row
    ``row_offsets``      int32 ``(B + 1,)``   packed row b is ``[row_offsets[b], row_offsets[b+1])``
    ``doc_ids``          int64 ``(S,)``       source document of every segment (-1 if unknown)
    ``chunk_ids``        int32 ``(S,)``       piece index of every segment (0 if unknown)
    ``scale_group_id``   int32 ``(T,)``       only with ``scale_groups``: scale group of every token
                                              (-1 on padding), ``flamia_pack.quant.scale_groups``
    ``scale_group_start`` int32 ``(T,)``      only with ``scale_groups``: first token of its group
    ===================  ===================  =====================================================

    Scale-group metadata (FP8 token-block scales, DESIGN.md §4) is off by default here: on CPU it
    costs about as much as the rest of the collation and adds 8 bytes per token to every
    worker -> main process and host -> device copy, while :func:`to_device` (``scale_groups="block"``)
    derives it on the GPU from the copied ``cu_seqlens`` without host sync. Use the collator's
    option for CPU-only pipelines.

    Args:
        pad_id: id of padding tokens in ``input_ids``: a token id, int in ``[0, 2**31 - 1]``
            (usually the dataset's ``pad_id``; ``flamia pack --pad-id`` is >= 0 too).
        ignore_index: label of tokens with no target (the cross-entropy ``ignore_index``; an int).
        scale_groups: ``"block"`` or ``"token"``: add the scale-group keys, computed on the CPU by
            ``flamia_pack.quant.scale_groups`` with that granularity; None (default): leave them
            out (see above; :func:`to_device` can add them on the device).
        validate: check every row's ``cu_seqlens`` (cheap; on by default).

    Raises (from ``__init__``):
        FlamiaError: ``pad_id``/``ignore_index`` not an integer (or out of range), unknown
            ``scale_groups``.

    Raises (from ``__call__``):
        FlamiaError: empty batch, a row that is not a dict, rows of different capacities, missing
            or non-integer ``input_ids``.
        MetadataError: a row's ``cu_seqlens`` not ``[0, ..., num_tokens]`` strictly increasing,
            ``num_tokens`` not one integer or > capacity, an ``attention_mask`` of another shape than
            ``input_ids`` or with a 0 before a 1 (used when a row has neither ``num_tokens`` nor
            ``cu_seqlens``).
    """

    def __init__(self, *, pad_id: int = 0, ignore_index: int = -100, scale_groups: Optional[str] = None,
                 validate: bool = True) -> None:
        self.pad_id = _check_int(pad_id, "pad_id", 0, 2**31 - 1)
        self.ignore_index = _check_int(ignore_index, "ignore_index", -(2**63), 2**63 - 1)
        if scale_groups not in (None, "block", "token"):
            raise FlamiaError(f"scale_groups must be 'block', 'token' or None, got {scale_groups!r}")
        self.scale_groups = scale_groups
        self.validate = bool(validate)

    def __repr__(self) -> str:
        return (f"PackedCollator(pad_id={self.pad_id}, ignore_index={self.ignore_index}, "
                f"scale_groups={self.scale_groups!r})")

    def _row(self, i: int, row: Mapping[str, Any], cap: Optional[int]) -> tuple:
        if not isinstance(row, Mapping):
            raise FlamiaError(f"row {i} of the batch must be a dict of arrays (a packed row), got {type(row).__name__}")
        if "input_ids" not in row:
            raise FlamiaError(f"row {i} of the batch has no 'input_ids' (keys: {', '.join(row)})")
        ids = _np(row["input_ids"])
        if ids.ndim != 1:
            raise FlamiaError(f"row {i}: input_ids must be 1-D (capacity,), got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise FlamiaError(f"row {i}: input_ids must hold integer token ids, got dtype {ids.dtype}")
        c = ids.shape[0]
        if cap is not None and c != cap:
            raise FlamiaError(f"all rows of a batch must have the same capacity; row 0 has {cap}, row {i} has {c}")
        pos = _np(row["position_ids"]) if "position_ids" in row else None
        if "num_tokens" in row:
            nt = _np(row["num_tokens"])
            if nt.size != 1 or nt.dtype.kind not in "iu":
                raise MetadataError(f"row {i}: num_tokens must be one integer, got {nt.dtype} of shape {nt.shape}")
            n = int(nt.reshape(()))
        elif "cu_seqlens" in row:
            n = int(_np(row["cu_seqlens"])[-1])
        else:
            n = self._real_length(i, row, ids)
        if not 0 <= n <= c:
            raise MetadataError(f"row {i}: num_tokens must be in [0, capacity={c}], got {n}")
        if "cu_seqlens" in row:
            cu = _np(row["cu_seqlens"])
            if self.validate:
                cu = validate_cu_seqlens(cu, n, name=f"row {i} cu_seqlens")
            cu = cu.astype(np.int64, copy=False)
        elif pos is not None:
            cu = cu_seqlens_from_position_ids(pos, n).astype(np.int64)
        else:
            raise FlamiaError(f"row {i} has neither 'cu_seqlens' nor 'position_ids'; cannot find document boundaries")
        if pos is None:
            pos = np.zeros(c, np.int64)
            seg = np.searchsorted(cu, np.arange(n), side="right") - 1
            pos[:n] = np.arange(n) - cu[seg]
        if pos.shape != (c,):
            raise FlamiaError(f"row {i}: position_ids must have shape ({c},), got {pos.shape}")
        nseg = cu.shape[0] - 1
        doc = _np(row["doc_ids"]).astype(np.int64) if "doc_ids" in row else np.full(nseg, -1, np.int64)
        chunk = _np(row["chunk_ids"]).astype(np.int32) if "chunk_ids" in row else np.zeros(nseg, np.int32)
        if doc.shape != (nseg,) or chunk.shape != (nseg,):
            raise MetadataError(f"row {i}: doc_ids/chunk_ids must have one entry per segment ({nseg}), got {doc.shape}, {chunk.shape}")
        return ids, pos, n, cu, doc, chunk

    def _real_length(self, i: int, row: Mapping[str, Any], ids: np.ndarray) -> int:
        """Tokens before the row-end padding of a row without ``num_tokens`` and ``cu_seqlens``:
        from its ``attention_mask``, else the trailing run of ``pad_id`` tokens is the padding."""
        if "attention_mask" in row:
            mask = _np(row["attention_mask"])
            if mask.shape != ids.shape:
                raise MetadataError(f"row {i}: attention_mask must have the shape of input_ids {ids.shape}, got {mask.shape}")
            real = mask != 0
            n = int(real.sum())
            if not real[:n].all():
                raise MetadataError(f"row {i}: attention_mask must be 1 on the real tokens then 0 on the row-end "
                                    "padding (it has a 0 before a 1); give the row num_tokens or cu_seqlens")
            return n
        real = np.flatnonzero(ids != self.pad_id)
        return int(real[-1]) + 1 if real.size else 0

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collate ``rows`` (B >= 1 row dicts) into the batch described in the class docstring."""
        if isinstance(rows, Mapping):  # a single row (DataLoader batch_size=None)
            rows = [rows]
        if len(rows) == 0:
            raise FlamiaError("cannot collate an empty batch (0 rows)")
        parsed = []
        cap = None
        for i, row in enumerate(rows):
            p = self._row(i, row, cap)
            cap = p[0].shape[0]
            parsed.append(p)
        B, C = len(parsed), int(cap)
        T = B * C
        ids_t, labels_t, pos_t = _alloc(T, torch.int64), _alloc(T, torch.int64), _alloc(T, torch.int64)
        ids, labels, pos = ids_t.numpy(), labels_t.numpy(), pos_t.numpy()
        cu_parts = [np.zeros(1, np.int64)]
        row_offsets = np.zeros(B + 1, dtype=np.int32)
        num_tokens = np.zeros(B, dtype=np.int32)
        off = 0
        for b, (rid, rpos, n, cu, _, _) in enumerate(parsed):
            ids[off:off + n] = rid[:n]
            pos[off:off + n] = rpos[:n]
            cu_parts.append(cu[1:] + off)
            off += n
            row_offsets[b + 1] = off
            num_tokens[b] = n
        ids[off:] = self.pad_id
        pos[off:] = 0
        cu_flat = np.concatenate(cu_parts)
        if off > 1:
            labels[:off - 1] = ids[1:off]
        labels[max(off - 1, 0):] = self.ignore_index
        if cu_flat.shape[0] > 1:
            labels[cu_flat[1:] - 1] = self.ignore_index  # last token of every segment
        lens = np.diff(cu_flat)
        cu_t = torch.from_numpy(cu_flat.astype(np.int32))
        batch: dict[str, Any] = {
            "input_ids": ids_t.view(B, C),
            "labels": labels_t.view(B, C),
            "position_ids": pos_t.view(B, C),
            "cu_seqlens": cu_t,
            "max_seqlen": int(lens.max()) if lens.size else 0,
            "num_real_tokens": int(off),
            "num_tokens": torch.from_numpy(num_tokens),
            "row_offsets": torch.from_numpy(row_offsets),
            "doc_ids": torch.from_numpy(np.concatenate([p[4] for p in parsed])),
            "chunk_ids": torch.from_numpy(np.concatenate([p[5] for p in parsed]).astype(np.int32)),
        }
        if self.scale_groups is not None:
            sg = _scale_groups(cu_t, T, self.scale_groups)
            if sg is not None:
                batch.update(sg)
        return batch


def _scale_groups(cu_seqlens: torch.Tensor, total_tokens: int, granularity: str) -> Optional[dict[str, torch.Tensor]]:
    """Per-token scale-group metadata from ``flamia_pack.quant.scale_groups`` (DESIGN.md §4),
    as ``{"scale_group_id", "scale_group_start"}`` (int32 ``(T,)``), or None without the quant module."""
    try:
        from flamia_pack.quant import scale_groups
    except ImportError:
        return None
    sg = scale_groups(cu_seqlens, total_tokens, granularity)
    return {"scale_group_id": sg.group_id, "scale_group_start": sg.group_start}


def to_device(
    batch: Mapping[str, Any],
    device: Union[str, torch.device],
    work_list_config: Any = None,
    *,
    scale_groups: Optional[str] = None,
    non_blocking: bool = True,
) -> dict[str, Any]:
    """Copy a collated batch to ``device`` without host synchronisation; optionally build the work list.

    On CUDA every tensor is pinned (skipped when already pinned, e.g. by ``DataLoader(pin_memory=True)``)
    and copied with ``non_blocking=True``, so the copy overlaps the previous step. With
    ``work_list_config`` (a :class:`flamia_pack.scheduler.worklist.TileConfig`) the attention work
    list is built right after the copy, on the device, from the copied ``cu_seqlens`` for
    ``T = input_ids.numel()`` tokens (``build_work_list(..., validate=False)``: fixed sizes, no
    host sync; DESIGN.md §6; its ``min_seqlen`` hint comes from the batch's host ``cu_seqlens``) and
    stored under ``"work_list"``, so a step can call
    ``varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], work_list=batch["work_list"])``
    directly. For the default kernel tiles use
    ``work_list_tile_config(kernel_config(head_dim, causal), causal)`` from
    ``flamia_pack.kernels.config`` (the kernels check that the list's ``block_m`` matches).
    With ``scale_groups`` the FP8 scale-group metadata (``scale_group_id``, ``scale_group_start``,
    int32 ``(T,)``; ``flamia_pack.quant.scale_groups``, DESIGN.md §4) is derived on the device from
    the copied ``cu_seqlens``, also without host sync. Python ints (``max_seqlen``,
    ``num_real_tokens``) are passed through.

    Args:
        batch: output of :class:`PackedCollator`.
        device: target device (``"cuda"``, ``"cpu"``, ...).
        work_list_config: ``TileConfig`` or None (no work list).
        scale_groups: ``"block"``, ``"token"`` or None (default: none added; keys already in the
            batch are copied like any tensor).
        non_blocking: asynchronous copies (CUDA only).

    Returns:
        A new dict with the same keys (plus ``work_list``); the input is not modified.

    Raises:
        FlamiaError: unknown ``scale_groups``, ``work_list_config`` not a ``TileConfig`` (e.g. an
            ``AttentionKernelConfig``: convert it with ``work_list_tile_config``), a ``device`` that is
            not a device, or ``"cuda"`` where no CUDA device is available.
    """
    if scale_groups not in (None, "block", "token"):
        raise FlamiaError(f"scale_groups must be 'block', 'token' or None, got {scale_groups!r}")
    if work_list_config is not None:
        from flamia_pack.scheduler.worklist import TileConfig

        if not isinstance(work_list_config, TileConfig):
            raise FlamiaError(
                f"work_list_config must be a flamia_pack.scheduler.worklist.TileConfig or None, got "
                f"{type(work_list_config).__name__}; for the default kernel tiles pass "
                "work_list_tile_config(kernel_config(head_dim, causal), causal) from flamia_pack.kernels.config"
            )
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise FlamiaError(f"device must be a torch.device or a device string such as 'cuda', 'cuda:0' or "
                          f"'cpu', got {device!r}") from e
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise FlamiaError(f"to_device({str(device)!r}): no CUDA device is available here (torch "
                          f"{torch.__version__}, torch.cuda.is_available() is False); pass 'cpu' or run on a GPU")
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            if cuda and v.device.type == "cpu":
                if not v.is_pinned():
                    v = v.pin_memory()
                out[k] = v.to(device, non_blocking=non_blocking)
            else:
                out[k] = v.to(device)
        else:
            out[k] = v
    if work_list_config is not None:
        from flamia_pack.scheduler.worklist import build_work_list

        total = int(out["input_ids"].numel())
        shortest = covered = None
        host_cu = batch.get("cu_seqlens")
        if isinstance(host_cu, torch.Tensor) and host_cu.device.type == "cpu" and host_cu.numel() > 1:
            # the shortest document, from the host copy the batch still has (no sync): lets the
            # kernels skip their launches for short documents on rows without any (WorkList.min_seqlen);
            # empty segments make no work item and do not count
            lengths = host_cu[1:] - host_cu[:-1]
            lengths = lengths[lengths > 0]
            shortest = int(lengths.min()) if lengths.numel() else None
            covered = int(host_cu[-1])  # == total on rows without row-end padding: no padding fills
        out["work_list"] = build_work_list(out["cu_seqlens"], total, work_list_config, validate=False,
                                           min_seqlen=shortest, doc_tokens=covered)
    if scale_groups is not None:
        sg = _scale_groups(out["cu_seqlens"], int(out["input_ids"].numel()), scale_groups)
        if sg is None:
            raise FlamiaError("scale_groups needs flamia_pack.quant, which is not available")
        out.update(sg)
    return out
