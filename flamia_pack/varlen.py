"""Varlen metadata shared by every layer: validation of ``cu_seqlens`` and derived per-token maps.

Conventions follow FlashAttention's varlen API: ``cu_seqlens`` is a 1-D integer tensor of shape
``(n_docs + 1,)`` with ``cu_seqlens[0] == 0``, non-decreasing (strictly increasing after packing:
packing never emits an empty segment), and ``cu_seqlens[-1] == T`` (tokens used).
``max_seqlen`` is ``max(diff(cu_seqlens))`` as a Python int.

Both numpy arrays and torch tensors (any device) are accepted. Validation of a CUDA tensor reads
it back to the host (one sync); code paths that must stay sync-free (CUDA graphs) call the
GPU builders with ``validate=False`` after validating once.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from flamia_pack.errors import MetadataError

ArrayLike = Union[np.ndarray, torch.Tensor]

_INT_DTYPES_NP = (np.int32, np.int64)
_INT_DTYPES_TORCH = (torch.int32, torch.int64)


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def validate_cu_seqlens(
    cu_seqlens: ArrayLike,
    total_tokens: int | None = None,
    *,
    name: str = "cu_seqlens",
    allow_empty_segments: bool = False,
) -> np.ndarray:
    """Check ``cu_seqlens`` and return it as an int64 numpy array (host copy).

    Args:
        cu_seqlens: shape ``(n_docs + 1,)``, dtype int32 or int64 (numpy or torch, any device).
        total_tokens: if given, ``cu_seqlens[-1]`` must equal it (T, the packed length).
        name: name used in error messages.
        allow_empty_segments: if False (default) every segment must have length >= 1.

    Returns:
        ``np.ndarray`` int64 of shape ``(n_docs + 1,)``.

    Raises:
        MetadataError: wrong rank or dtype, empty, first != 0, decreasing (or zero-length segment
            when not allowed), last != total_tokens.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in _INT_DTYPES_TORCH:
            raise MetadataError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    else:
        cu_seqlens = np.asarray(cu_seqlens)
        if cu_seqlens.dtype.type not in _INT_DTYPES_NP:
            raise MetadataError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    arr = _to_numpy(cu_seqlens).astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise MetadataError(f"{name} must be 1-D of shape (n_docs + 1,), got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise MetadataError(f"{name} must have at least one element (0), got an empty array")
    if arr[0] != 0:
        raise MetadataError(f"{name}[0] must be 0, got {int(arr[0])}")
    d = np.diff(arr)
    if d.size and d.min() < 0:
        i = int(np.argmin(d))
        rule = "non-decreasing" if allow_empty_segments else "strictly increasing (every document >= 1 token)"
        raise MetadataError(
            f"{name} must be {rule}; {name}[{i}]={int(arr[i])} > {name}[{i + 1}]={int(arr[i + 1])}"
        )
    if not allow_empty_segments and d.size and d.min() == 0:
        i = int(np.argmin(d))
        raise MetadataError(f"{name} has a zero-length segment at index {i} ({name}[{i}] == {name}[{i + 1}]); "
                            f"it must be strictly increasing (every document >= 1 token): drop empty documents")
    if total_tokens is not None and int(arr[-1]) != int(total_tokens):
        raise MetadataError(f"{name}[-1] must equal the number of tokens T={int(total_tokens)}, got {int(arr[-1])}")
    return arr


def seqlens(cu_seqlens: ArrayLike) -> ArrayLike:
    """Document lengths ``cu_seqlens[1:] - cu_seqlens[:-1]`` (same type/device as the input).

    ``cu_seqlens`` is NOT checked (no host sync): a decreasing one gives negative lengths. Call
    :func:`validate_cu_seqlens` first on untrusted input.
    """
    return cu_seqlens[1:] - cu_seqlens[:-1]


def max_seqlen(cu_seqlens: ArrayLike | Sequence[int]) -> int:
    """``max(diff(cu_seqlens))`` as a Python int (0 for no documents). Syncs for CUDA tensors.

    Args:
        cu_seqlens: shape ``(n_docs + 1,)``, dtype int32 or int64: a numpy array, a torch tensor
            (any device) or a sequence of Python ints (read with ``np.asarray``).

    Only the dtype and rank are checked; the values are not validated (see
    :func:`validate_cu_seqlens`): a decreasing ``cu_seqlens`` gives a wrong result.

    Raises:
        MetadataError: not integer (float input is rejected, not truncated) or not 1-D.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in _INT_DTYPES_TORCH:
            raise MetadataError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    else:
        arr = np.asarray(cu_seqlens)
        if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        if arr.dtype.type not in _INT_DTYPES_NP:
            raise MetadataError(f"cu_seqlens must be int32 or int64 (integer offsets), got {arr.dtype}")
        cu_seqlens = arr
    if cu_seqlens.ndim != 1:
        raise MetadataError(f"cu_seqlens must be 1-D of shape (n_docs + 1,), got shape {tuple(cu_seqlens.shape)}")
    d = seqlens(cu_seqlens)
    if len(d) == 0:
        return 0
    return int(d.max())


def doc_index_per_token(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Per-token document index, shape ``(T,)`` int32, on ``cu_seqlens.device`` (no host sync).

    Tokens past ``cu_seqlens[-1]`` (row-end padding) get index ``n_docs`` (belongs to no document).
    ``cu_seqlens`` (1-D int32/int64 tensor) is not validated (see :func:`validate_cu_seqlens`).
    """
    pos = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, pos, right=True) - 1).to(torch.int32)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, *, validate: bool = True) -> torch.Tensor:
    """Per-token position inside its document, shape ``(T,)`` int64 (restarts at 0 per document),
    on ``cu_seqlens.device``.

    Padding tokens past ``cu_seqlens[-1]`` continue counting from the last document end
    (``cu_seqlens=[0, 3, 5]``, ``T=7`` gives ``[0, 1, 2, 0, 1, 0, 1]``).

    Args:
        cu_seqlens: 1-D int32/int64 tensor of shape ``(n_docs + 1,)``: first 0, non-decreasing
            (empty segments are allowed; they own no token), ``cu_seqlens[-1] <= total_tokens``.
        total_tokens: T, the number of tokens (int >= 0; tokens past ``cu_seqlens[-1]`` are padding).
        validate: check the values of ``cu_seqlens`` (one host read-back for a CUDA tensor). With
            False the call does no host sync (CUDA-graph capturable) and invalid values give
            undefined positions; type, dtype, rank and ``total_tokens`` are checked in any case.

    Raises:
        MetadataError: ``cu_seqlens`` not a 1-D int32/int64 tensor, ``total_tokens`` not an int
            >= 0; with ``validate``: first != 0, decreasing, or ``cu_seqlens[-1] > total_tokens``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise MetadataError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INT_DTYPES_TORCH:
        raise MetadataError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise MetadataError(f"cu_seqlens must be 1-D of shape (n_docs + 1,), got shape {tuple(cu_seqlens.shape)}")
    if isinstance(total_tokens, (bool, np.bool_)) or not isinstance(total_tokens, (int, np.integer)) or total_tokens < 0:
        raise MetadataError(f"total_tokens must be an integer >= 0, got {total_tokens!r}")
    total_tokens = int(total_tokens)
    if validate:
        arr = validate_cu_seqlens(cu_seqlens, allow_empty_segments=True)
        if int(arr[-1]) > total_tokens:
            raise MetadataError(
                f"cu_seqlens[-1]={int(arr[-1])} exceeds total_tokens={total_tokens} "
                "(tokens past cu_seqlens[-1] are row-end padding; total_tokens must cover every document)"
            )
    doc = doc_index_per_token(cu_seqlens, total_tokens).long()
    starts = cu_seqlens.long()[doc.clamp(max=cu_seqlens.numel() - 1)]
    return torch.arange(total_tokens, device=cu_seqlens.device) - starts
