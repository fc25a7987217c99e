"""flamia_pack.loaders: sources -> packed rows -> training batches (DESIGN.md §2).

- :mod:`.sources`: ``open_source`` -- local datasets/parquet/jsonl/text as int32 token documents.
- :mod:`.dataset`: :class:`PackedDataset` (packed parquet directory) and
  :class:`StreamingPackedDataset` (pack on the fly); ``IterableDataset`` s with exact resume.
- :mod:`.collate`: :class:`PackedCollator` (rows -> batch with ``cu_seqlens``/``labels``) and
  :func:`to_device` (pinned, non-blocking copy + GPU work list).

Names are imported lazily, so ``import flamia_pack.loaders.sources`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PackedDataset",
    "StreamingPackedDataset",
    "PackedCollator",
    "to_device",
    "cu_seqlens_from_position_ids",
    "open_source",
]

_WHERE = {
    "PackedDataset": "dataset",
    "StreamingPackedDataset": "dataset",
    "PackedCollator": "collate",
    "to_device": "collate",
    "cu_seqlens_from_position_ids": "collate",
    "open_source": "sources",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'flamia_pack.loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flamia_pack.loaders.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
