"""flamia_pack.integrations: packed varlen attention inside the training stacks people use.

- :mod:`.transformers`: the ``"flamia"`` attention implementation for Hugging Face transformers
  (``AttentionInterface`` + ``AttentionMaskInterface``; TRL's ``SFTTrainer`` uses it unchanged) and
  a collator adapter from :class:`flamia_pack.PackedCollator` batches to model inputs. Needs
  ``transformers`` (extra ``hf``); importing it registers ``"flamia"``.
- :mod:`.torchtitan`: a drop-in for torchtitan's varlen attention call
  (``varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, ...)``) and its ``VarlenAttention``
  module. Needs only torch.

Nothing is imported here, so ``import flamia_pack.integrations`` works without the optional packages.
See docs/integrations.md for short examples.
"""
from __future__ import annotations

__all__: list[str] = []
