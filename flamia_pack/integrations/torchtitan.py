"""A drop-in for torchtitan's varlen attention: flamia_pack's packed kernels behind its call.

torchtitan's ``VarlenAttention`` (``torchtitan/models/common/attention.py``) flattens q, k, v to
``(T, N, H)`` and calls ``torch.nn.attention.varlen.varlen_attn(q, k, v, cu_seq_q, cu_seq_k,
max_q, max_k, scale=..., window_size=(-1, 0), ...)`` with the ``VarlenMetadata`` built by
``create_varlen_metadata_for_document(positions)`` (a document starts where ``positions == 0``).
This module gives the same three entry points on :func:`flamia_pack.varlen_attention`:

- :func:`varlen_attn`: ``torch.nn.attention.varlen.varlen_attn``'s signature (same names, order and
  defaults); :func:`patch_torchtitan` installs it where torchtitan's ``VarlenAttention`` looks it up;
- :class:`FlamiaVarlenAttention`: a module with ``VarlenAttention.forward``'s signature
  (``(B, L, N, H)`` q/k/v, ``attention_masks=VarlenMetadata``, ``scale``, ``out_transform``);
- :func:`varlen_metadata_for_document`: ``create_varlen_metadata_for_document(positions)`` without
  torchtitan installed (a :class:`VarlenMetadata` with torchtitan's field names).

Needs only torch (torchtitan itself is optional). Self-attention only: ``cu_seq_k`` must equal
``cu_seq_q``; windows other than causal ``(-1, 0)`` and full ``(-1, -1)``, paged KV
(``block_table``) and ``seqused_k`` are rejected with a :class:`flamia_pack.FlamiaError`.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Optional

import torch

from flamia_pack.errors import FlamiaError, MetadataError

__all__ = ["VarlenMetadata", "varlen_attn", "varlen_metadata_for_document", "FlamiaVarlenAttention",
           "patch_torchtitan"]


class VarlenMetadata(NamedTuple):
    """torchtitan's ``VarlenMetadata`` fields: offsets into the flattened ``B * L`` stream.

    Attributes:
        cu_seq_q, cu_seq_k: int32 ``(S + 1,)`` (the same tensor for self-attention).
        max_q, max_k: longest document (int).
        cu_seq_q_host: the offsets as a tuple of ints, or None.
    """

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int
    cu_seq_q_host: Optional[tuple[int, ...]] = None


def _int(x: Any, name: str) -> int:
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise MetadataError(f"{name} must be an int, got {x!r}")
    return int(x)


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: Optional[float] = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
):
    """``torch.nn.attention.varlen.varlen_attn`` computed by :func:`flamia_pack.varlen_attention`.

    Args:
        query: ``(T, H_q, D)``; key, value: ``(T, H_kv, D)`` (same T: self-attention), one dtype
            (bfloat16 on CUDA, where D must be 64 or 128; the CPU reference also takes fp16/fp32/fp64).
        cu_seq_q: int32/int64 ``(N + 1,)`` document offsets, ``[0, ..., <= T]`` (tokens past the last
            offset are padding: output 0).
        cu_seq_k: None or equal to ``cu_seq_q`` (compared on the device unless it is the same tensor).
        max_q, max_k: the longest document (an upper bound is fine); the larger one is used.
        return_aux: an ``AuxRequest``; with ``lse=True`` the LSE is returned too.
        scale: softmax scale (default ``D ** -0.5``).
        window_size: ``(-1, 0)`` causal or ``(-1, -1)`` full attention inside each document.
        enable_gqa: must be True when ``H_q != H_kv`` (as torch's op requires).
        seqused_k, block_table: must be None (KV-cache decoding is not supported).
        num_splits: accepted and ignored (the kernels do not split the key dimension).

    Returns:
        ``out`` ``(T, H_q, D)`` in query's dtype, or ``(out, lse)`` with ``lse`` float32 ``(H_q, T)``
        (FlashAttention's varlen layout, which torchtitan transposes) if ``return_aux.lse``.

    Raises:
        FlamiaError / MetadataError: the unsupported arguments above, ``cu_seq_k != cu_seq_q``, heads
            that differ without ``enable_gqa``; ``varlen_attention``'s own input errors.
    """
    from flamia_pack import varlen_attention

    if seqused_k is not None or block_table is not None:
        raise FlamiaError("flamia varlen_attn does not support seqused_k / block_table (paged KV-cache decoding)")
    ws = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    if ws == (-1, 0):
        causal = True
    elif ws == (-1, -1):
        causal = False
    else:
        raise FlamiaError(f"window_size must be (-1, 0) (causal) or (-1, -1) (full), got {window_size!r}; "
                          "sliding windows are not supported")
    if not isinstance(cu_seq_q, torch.Tensor):
        raise MetadataError(f"cu_seq_q must be a torch.Tensor, got {type(cu_seq_q).__name__}")
    if cu_seq_k is not None and cu_seq_k is not cu_seq_q:
        if not isinstance(cu_seq_k, torch.Tensor) or cu_seq_k.shape != cu_seq_q.shape or not torch.equal(
                cu_seq_k.to(cu_seq_q), cu_seq_q):
            raise MetadataError("cu_seq_k must equal cu_seq_q: flamia runs self-attention over one set of documents")
    for name, x in (("query", query), ("key", key)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise FlamiaError(f"{name} must be (T, heads, head_dim), got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise FlamiaError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for GQA")
    max_len = max(_int(max_q, "max_q"), _int(max_k, "max_k"))
    want_lse = bool(getattr(return_aux, "lse", False)) if return_aux is not None else False
    return varlen_attention(query, key, value, cu_seq_q, max_len, causal=causal, softmax_scale=scale,
                            return_lse=want_lse)


def varlen_metadata_for_document(positions: torch.Tensor, *, include_host_offsets: bool = False) -> VarlenMetadata:
    """Document offsets from per-token positions ``(B, L)``, as torchtitan's
    ``create_varlen_metadata_for_document``: a document starts wherever ``positions == 0`` and at
    every row start (torchtitan needs ``positions[:, 0] == 0``; a row that starts mid-document, e.g.
    at position 5, is a document of its own here). One device-to-host copy (the maximum).

    Returns:
        :class:`VarlenMetadata` over the flattened ``B * L`` stream (``cu_seq_k`` is ``cu_seq_q``).

    Raises:
        MetadataError: ``positions`` not a 2-D integer tensor.
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.is_floating_point():
        raise MetadataError(f"positions must be a 2-D integer tensor (batch, seq_len), got "
                            f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    B, L = positions.shape
    start = positions == 0
    start[:, 0] = True
    starts = start.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([starts, torch.tensor([B * L], device=positions.device, dtype=starts.dtype)]).to(torch.int32)
    if include_host_offsets:
        host = tuple(int(x) for x in cu.tolist())
        max_len = max((b - a for a, b in zip(host[:-1], host[1:])), default=0)
    else:
        host = None
        max_len = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return VarlenMetadata(cu, cu, max_len, max_len, host)


class FlamiaVarlenAttention(torch.nn.Module):
    """torchtitan's ``VarlenAttention`` module on flamia_pack's kernels.

    Args:
        window_size: ``(-1, 0)`` (causal, torchtitan's default) or ``(-1, -1)``.

    Raises:
        FlamiaError: another window size.
    """

    def __init__(self, window_size: tuple[int, int] = (-1, 0)) -> None:
        super().__init__()
        if tuple(window_size) not in ((-1, 0), (-1, -1)):
            raise FlamiaError(f"window_size must be (-1, 0) or (-1, -1), got {window_size!r}")
        self.window_size = tuple(window_size)

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        scale: Optional[float] = None,
        out_transform: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of ``(B, L, N, H)`` q / k / v (``N_kv`` may divide ``N_q``) over the documents of
        ``attention_masks`` (a ``VarlenMetadata``: ``cu_seq_q``, ``cu_seq_k``, ``max_q``, ``max_k``).

        On CUDA q, k, v are cast to bfloat16 (as torchtitan does); on the CPU they keep their dtype.

        Returns:
            ``(B, L, N_q, H)`` in q's dtype, or ``out_transform(out, lse_BLN)`` when given one (the
            LSE as ``(B, L, N_q)`` float32).

        Raises:
            FlamiaError: ``attention_masks`` without the four fields, mismatched shapes; the errors of
                :func:`varlen_attn`.
        """
        meta = attention_masks
        if not all(hasattr(meta, f) for f in ("cu_seq_q", "cu_seq_k", "max_q", "max_k")):
            raise FlamiaError(f"attention_masks must be a VarlenMetadata (cu_seq_q, cu_seq_k, max_q, max_k), "
                              f"got {type(meta).__name__}")
        if q_BLNH.dim() != 4 or k_BLNH.shape[:2] != q_BLNH.shape[:2] or v_BLNH.shape[:3] != k_BLNH.shape[:3]:
            raise FlamiaError(f"q, k, v must be (B, L, heads, head_dim) with one B and L, got {tuple(q_BLNH.shape)}, "
                              f"{tuple(k_BLNH.shape)}, {tuple(v_BLNH.shape)}")
        B, L, _, D = q_BLNH.shape
        T = B * L
        run = torch.bfloat16 if q_BLNH.device.type == "cuda" else q_BLNH.dtype
        q, k, v = (x.reshape(T, x.shape[2], x.shape[3]).to(run) for x in (q_BLNH, k_BLNH, v_BLNH))
        gqa = q.shape[1] != k.shape[1]
        res = varlen_attn(q, k, v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale=scale,
                          window_size=self.window_size, enable_gqa=gqa,
                          return_aux=_LseRequest() if out_transform is not None else None)
        if out_transform is None:
            return res.view(B, L, -1, v_BLNH.shape[-1]).to(q_BLNH.dtype)
        out, lse = res
        return out_transform(out.view(B, L, -1, v_BLNH.shape[-1]).to(q_BLNH.dtype), lse.transpose(0, 1).reshape(B, L, -1))


class _LseRequest:
    """Stands for ``torch.nn.attention.varlen.AuxRequest(lse=True)`` (read by attribute only)."""

    lse = True


def patch_torchtitan(module: Any = None) -> Callable:
    """Make torchtitan's ``VarlenAttention`` call :func:`varlen_attn` (it looks the name
    ``varlen_attn`` up in its module at call time). Idempotent.

    Args:
        module: the torchtitan module to patch (default ``torchtitan.models.common.attention``).

    Returns:
        The function that was there before; assign it back to undo (``module.varlen_attn = previous``).

    Raises:
        ImportError: torchtitan is not installed (and no module is given).
        FlamiaError: the module has no ``varlen_attn`` (another torchtitan layout).
    """
    if module is None:
        import torchtitan.models.common.attention as module  # noqa: PLC0415
    if not hasattr(module, "varlen_attn"):
        raise FlamiaError(f"{getattr(module, '__name__', module)} has no varlen_attn to replace; this torchtitan "
                          "version is not supported by patch_torchtitan (use FlamiaVarlenAttention)")
    previous = module.varlen_attn
    module.varlen_attn = varlen_attn
    return previous
