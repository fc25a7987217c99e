"""The work-list builders' sort key (shared by the torch and Triton GPU builders of ``worklist.py`` /
``_worklist_triton.py``, which import it from here rather than from each other)."""
from __future__ import annotations

import torch


def cost_key_dtype(total_tokens: int, block_n: int) -> torch.dtype:
    """The smallest signed dtype holding ``-cost`` of any item of a row of ``total_tokens`` tokens
    with ``block_n``-key tiles (fewer radix-sort passes): int16, else int32."""
    max_cost = total_tokens // block_n + 2
    return torch.int16 if max_cost < 2**15 - 1 else torch.int32
