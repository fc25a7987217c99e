"""flamia_pack.kernels: packed (document-masked) attention (DESIGN.md §7).

``varlen_attention`` is the only public door (autograd, torch.compile and CUDA-graph friendly);
``packed_attention_reference`` is the exact torch ground truth the kernels are tested against.
"""
from flamia_pack.kernels.attention import varlen_attention
from flamia_pack.kernels.reference import packed_attention_reference

__all__ = ["varlen_attention", "packed_attention_reference"]
