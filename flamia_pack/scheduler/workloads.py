"""Document-length mixes of WORKLOADS.md (W1-W9, S1, S2) and the lognormal generator.

One definition used by the benchmarks, the tests, the CLI (``flamia plan --lognormal``) and the
service presets.
"""
from __future__ import annotations

import numpy as np

from flamia_pack.errors import FlamiaError

__all__ = ["WORKLOADS", "lognormal_lengths", "workload_lengths"]


def lognormal_lengths(
    mu: float,
    sigma: float,
    total_tokens: int,
    seed: int = 0,
    *,
    min_len: int = 16,
    max_len: int = 32768,
) -> np.ndarray:
    """Lognormal document lengths filling exactly ``total_tokens`` (WORKLOADS.md W6 / S2).

    Lengths ``round(exp(N(mu, sigma)))`` clipped to ``[min_len, max_len]`` are drawn from
    ``np.random.default_rng(seed)`` in row order until the next one would overflow; that one is
    shortened to fill the row exactly (so the last document may be shorter than ``min_len``).

    Returns:
        int64 array of lengths, sum == total_tokens.

    Raises:
        FlamiaError: total_tokens < 1, sigma < 0, or min_len > max_len.
    """
    t = int(total_tokens)
    if t < 1:
        raise FlamiaError(f"total_tokens must be >= 1, got {total_tokens}")
    if sigma < 0 or not np.isfinite(mu) or not np.isfinite(sigma):
        raise FlamiaError(f"need finite mu and sigma >= 0, got mu={mu}, sigma={sigma}")
    if not 1 <= min_len <= max_len:
        raise FlamiaError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = np.random.default_rng(int(seed))
    out: list[int] = []
    used = 0
    while used < t:
        draws = np.clip(np.rint(rng.lognormal(mu, sigma, size=256)), min_len, max_len).astype(np.int64)
        for x in draws:
            x = int(x)
            if used + x >= t:
                out.append(t - used)
                used = t
                break
            out.append(x)
            used += x
    return np.asarray(out, dtype=np.int64)


def _w2() -> np.ndarray:
    return np.array([8192] + [256] * 224, dtype=np.int64)


def _w9() -> np.ndarray:
    return np.array([32768] + [4096] * 8, dtype=np.int64)


WORKLOADS: dict[str, dict] = {
    "W1": {"lengths": lambda: np.full(16, 4096, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "W2": {"lengths": _w2, "num_heads": 16, "num_kv_heads": 16},
    "W3": {"lengths": lambda: np.full(64, 1024, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "W4": {"lengths": lambda: np.full(1, 65536, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "W5": {"lengths": lambda: np.full(4, 16384, np.int64), "num_heads": 16, "num_kv_heads": 4},
    "W6": {"lengths": lambda: lognormal_lengths(6.5, 1.0, 65536, 0), "num_heads": 16, "num_kv_heads": 16},
    "W7": {"lengths": lambda: np.full(256, 256, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "W8": {"lengths": lambda: np.full(2, 32768, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "W9": {"lengths": _w9, "num_heads": 16, "num_kv_heads": 16},
    "S1": {"lengths": lambda: np.ones(131072, np.int64), "num_heads": 16, "num_kv_heads": 16},
    "S2": {"lengths": lambda: lognormal_lengths(6.5, 1.0, 131072, 1), "num_heads": 16, "num_kv_heads": 16},
}
"""WORKLOADS.md rows: id -> lengths factory (row order), H_q and H_kv (head_dim 128, causal)."""


def workload_lengths(name: str) -> np.ndarray:
    """Lengths (int64, row order) of a WORKLOADS.md row id such as ``"W6"``.

    Raises:
        FlamiaError: unknown id.
    """
    key = name.upper()
    if key not in WORKLOADS:
        raise FlamiaError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[key]["lengths"]()
