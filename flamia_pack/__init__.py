"""flamia_pack: packed variable-length documents for long-context LLM training.

The public API, re-exported here (nothing is defined in this file). Names resolve lazily
(PEP 562), so ``import flamia_pack`` and the ``flamia`` CLI start without importing torch.

Data flows one way (DESIGN.md §2): sources -> pack -> formats -> loaders -> scheduler -> kernels.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # errors
    "FlamiaError": "flamia_pack.errors",
    "SourceError": "flamia_pack.errors",
    "FormatError": "flamia_pack.errors",
    "MetadataError": "flamia_pack.errors",
    # varlen metadata
    "validate_cu_seqlens": "flamia_pack.varlen",
    "max_seqlen": "flamia_pack.varlen",
    "position_ids_from_cu_seqlens": "flamia_pack.varlen",
    # packing (DESIGN §3)
    "PackConfig": "flamia_pack.pack",
    "PackStats": "flamia_pack.pack",
    "PackPlan": "flamia_pack.pack",
    "PackedRows": "flamia_pack.pack",
    "plan_packing": "flamia_pack.pack",
    "pack_documents": "flamia_pack.pack",
    "pack_flat": "flamia_pack.pack",
    "fill_rows": "flamia_pack.pack",
    # formats
    "write_packed": "flamia_pack.formats",
    "read_manifest": "flamia_pack.formats",
    "verify": "flamia_pack.formats",
    "iter_rows": "flamia_pack.formats",
    # sources and loaders
    "open_source": "flamia_pack.loaders.sources",
    "PackedDataset": "flamia_pack.loaders.dataset",
    "StreamingPackedDataset": "flamia_pack.loaders.dataset",
    "PackedCollator": "flamia_pack.loaders.collate",
    "to_device": "flamia_pack.loaders.collate",
    # FP8 token-block scales (DESIGN §4)
    "scale_groups": "flamia_pack.quant",
    "quantize_token_blocks": "flamia_pack.quant",
    "dequantize": "flamia_pack.quant",
    # scheduler (DESIGN §6)
    "TileConfig": "flamia_pack.scheduler.worklist",
    "WorkList": "flamia_pack.scheduler.worklist",
    "WorkListBuilder": "flamia_pack.scheduler.worklist",
    "build_work_list": "flamia_pack.scheduler.worklist",
    "build_work_list_host": "flamia_pack.scheduler.worklist",
    "choose_policy": "flamia_pack.scheduler.policy",
    "attention_flops": "flamia_pack.scheduler.cost",
    "visible_pairs": "flamia_pack.scheduler.cost",
    "predict": "flamia_pack.scheduler.simulate",
    # kernels (DESIGN §7) and the leak probe (§5)
    "varlen_attention": "flamia_pack.kernels.attention",
    "packed_attention_reference": "flamia_pack.kernels.reference",
    "probe_leak": "flamia_pack.kernels.leak",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flamia_pack' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
