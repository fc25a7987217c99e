"""Document-length mixes -> one int64 array of lengths (numpy only, no web imports).

A *mix* is one of three descriptions of the documents a training step will see:

- ``lengths``: the lengths themselves, in row order;
- ``histogram``: ``[(length, count), ...]`` pairs, expanded in the given order;
- ``lognormal``: lengths drawn from ``round(lognormal(mu, sigma))`` clipped to ``[min_len, max_len]``
  with ``numpy.random.default_rng(seed)``, drawn until the next one would overflow
  ``total_tokens``; that last one is shortened so the mix holds exactly ``total_tokens`` tokens
  (the rule of WORKLOADS.md W6).

Every function checks the limits *before* allocating anything proportional to the request, so a
histogram claiming 10^12 documents costs nothing. Semantically impossible mixes raise
:class:`~flamia_pack.errors.FlamiaError` with the reason (the service maps it to HTTP 400).
Zero-length documents are allowed and counted (packing skips them, DESIGN.md §3).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flamia_pack.errors import FlamiaError


@dataclass(frozen=True, kw_only=True, slots=True)
class MixLimits:
    """Per-request bounds (from the service settings)."""

    max_documents: int
    """Most documents (including empty ones) a mix may contain."""
    max_tokens: int
    """Most tokens (sum of lengths) a mix may contain."""

    def __post_init__(self) -> None:
        if self.max_documents < 1 or self.max_tokens < 1:
            raise FlamiaError(f"limits must be >= 1, got {self}")


def _check_totals(documents: int, tokens: int, limits: MixLimits) -> None:
    if documents > limits.max_documents:
        raise FlamiaError(
            f"the mix has {documents} documents; this service accepts at most {limits.max_documents} per request"
        )
    if tokens > limits.max_tokens:
        raise FlamiaError(
            f"the mix has {tokens} tokens; this service accepts at most {limits.max_tokens} per request"
        )


def lengths_from_list(lengths: Sequence[int] | np.ndarray, limits: MixLimits) -> np.ndarray:
    """Validate explicit lengths.

    Args:
        lengths: non-negative ints (a list or any 1-D integer array), in row order.
        limits: request bounds.

    Returns:
        int64 array of shape ``(n_docs,)`` (a copy).

    Raises:
        FlamiaError: too many documents or tokens, or a negative length.
    """
    if len(lengths) > limits.max_documents:
        raise FlamiaError(
            f"the mix has {len(lengths)} documents; this service accepts at most {limits.max_documents} per request"
        )
    try:
        arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    except (OverflowError, ValueError, TypeError) as exc:
        raise FlamiaError(f"lengths must be a list of integers below 2**63: {exc}") from None
    if arr.size and int(arr.min()) < 0:
        raise FlamiaError(f"document lengths must be >= 0, got {int(arr.min())}")
    _check_totals(int(arr.size), int(arr.sum(dtype=np.int64)) if arr.size else 0, limits)
    return arr


def lengths_from_histogram(histogram: Sequence[Sequence[int]], limits: MixLimits) -> np.ndarray:
    """Expand ``[(length, count), ...]`` into lengths (pairs in the given order, each repeated).

    Returns:
        int64 array of shape ``(sum(count),)``.

    Raises:
        FlamiaError: a pair that is not two non-negative ints, or too many documents/tokens
            (checked with Python ints before anything is allocated).
    """
    if len(histogram) > limits.max_documents:
        raise FlamiaError(
            f"the histogram has {len(histogram)} bins; this service accepts at most {limits.max_documents}"
        )
    if not histogram:
        return np.zeros(0, dtype=np.int64)
    try:
        pairs = np.asarray(histogram, dtype=np.int64)
    except (OverflowError, ValueError) as exc:
        raise FlamiaError(f"histogram must be a list of [length, count] integer pairs below 2**63: {exc}") from None
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise FlamiaError(f"histogram must be a list of [length, count] pairs, got shape {pairs.shape}")
    if int(pairs.min()) < 0:
        i = int(np.argmin(pairs.min(axis=1)))
        raise FlamiaError(f"histogram[{i}] = {pairs[i].tolist()}: length and count must be >= 0")
    # Float sums guard the limits without int64 overflow; exact ints are computed once inside them.
    docs_f = float(pairs[:, 1].astype(np.float64).sum())
    tokens_f = float((pairs[:, 0].astype(np.float64) * pairs[:, 1]).sum())
    if docs_f > limits.max_documents or tokens_f > limits.max_tokens:
        _check_totals(int(docs_f), int(tokens_f), limits)
    _check_totals(int(pairs[:, 1].sum()), int((pairs[:, 0] * pairs[:, 1]).sum()), limits)
    return np.repeat(pairs[:, 0], pairs[:, 1])


def lengths_from_lognormal(
    *,
    mu: float,
    sigma: float,
    total_tokens: int,
    seed: int,
    min_len: int,
    max_len: int,
    limits: MixLimits,
) -> np.ndarray:
    """Draw a lognormal mix that holds exactly ``total_tokens`` tokens (WORKLOADS.md W6 rule).

    Lengths are ``clip(rint(rng.lognormal(mu, sigma)), min_len, max_len)`` with
    ``rng = numpy.random.default_rng(seed)``, drawn in order until the running sum reaches
    ``total_tokens``; the last length is shortened to fill exactly. Vectorised (drawn in blocks).

    Returns:
        int64 array of shape ``(n_docs,)`` with ``sum == total_tokens``.

    Raises:
        FlamiaError: non-finite or negative parameters, ``min_len > max_len``, ``total_tokens`` over
            the limit, or a mix that would need more documents than allowed.
    """
    if not (math.isfinite(mu) and math.isfinite(sigma)) or sigma < 0:
        raise FlamiaError(f"lognormal needs finite mu and sigma >= 0, got mu={mu}, sigma={sigma}")
    if min_len < 1 or max_len < min_len:
        raise FlamiaError(f"lognormal needs 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if total_tokens < 1:
        raise FlamiaError(f"total_tokens must be >= 1, got {total_tokens}")
    _check_totals(0, total_tokens, limits)
    # Any mix needs at least total_tokens / max_len documents; refuse early if even that is too many.
    _check_totals(-(-total_tokens // max_len), 0, limits)
    rng = np.random.default_rng(seed)
    chunks: list[np.ndarray] = []
    drawn = 0
    tokens = 0
    while tokens < total_tokens:
        # Block size from the running mean of the clipped draws (a 256-draw pilot first), so a
        # heavy tail clipped at max_len never makes the blocks tiny. Same stream as one-by-one draws.
        need = 256 if drawn == 0 else int(1.25 * (total_tokens - tokens) * drawn / tokens) + 16
        need = min(need, limits.max_documents + 1 - drawn) if drawn <= limits.max_documents else 16
        block = np.clip(np.rint(rng.lognormal(mu, sigma, size=max(need, 1))), min_len, max_len).astype(np.int64)
        chunks.append(block)
        drawn += block.size
        tokens += int(block.sum())
        if drawn > limits.max_documents and tokens < total_tokens:
            raise FlamiaError(
                f"lognormal(mu={mu}, sigma={sigma}) needs more than {limits.max_documents} documents to fill "
                f"{total_tokens} tokens; this service accepts at most {limits.max_documents} per request"
            )
    lengths = np.concatenate(chunks)
    csum = np.cumsum(lengths)
    n = int(np.searchsorted(csum, total_tokens, side="left")) + 1  # first index reaching the total
    lengths = lengths[:n].copy()
    lengths[-1] -= int(csum[n - 1]) - total_tokens
    _check_totals(int(lengths.size), total_tokens, limits)
    return lengths
