"""Exact packed (document-masked) attention in torch: the ground truth for every kernel test.

DESIGN.md §7: "a torch reference (CPU and GPU) defines the exact numerics for tests".
Works on any device; computes in ``compute_dtype`` (float32 by default, float64 for the strictest
checks) and is differentiable through autograd, so it also gives reference gradients.

Masking: query i attends key j iff both lie in the same document of ``cu_seqlens`` and (causal)
``j <= i``. Tokens past ``cu_seqlens[-1]`` (row-end padding) belong to no document: their output
is 0 and their LSE is ``+inf`` (DESIGN.md §4, "invalid query rows get LSE = +inf").
"""
from __future__ import annotations

import math

import torch

from flamia_pack.errors import MetadataError
from flamia_pack.varlen import validate_cu_seqlens


def _chunks(cu: list[int], target: int) -> list[tuple[int, int]]:
    """Group consecutive whole documents into chunks of about ``target`` tokens (long documents
    stand alone), so tiny documents are processed together and long ones by query blocks."""
    out: list[tuple[int, int]] = []
    start = cu[0]
    for i in range(1, len(cu)):
        if cu[i] - start >= target or i == len(cu) - 1:
            out.append((start, cu[i]))
            start = cu[i]
    return out


def packed_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
    block_q: int = 1024,
):
    """Reference packed attention.

    Args:
        q: ``(T, H_q, D)`` any float dtype (cast to ``compute_dtype``).
        k, v: ``(T, H_kv, D)``; ``H_q % H_kv == 0`` (GQA: query head h uses kv head ``h // (H_q // H_kv)``).
        cu_seqlens: ``(n_docs + 1,)`` int32/int64, ``cu_seqlens[-1] <= T`` (tokens after it are padding).
        causal: mask keys after the query (inside the document).
        softmax_scale: defaults to ``D ** -0.5``.
        compute_dtype: float32 (default) or float64.
        return_lse: also return the natural-log LSE, ``(H_q, T)`` float32-or-compute_dtype.
        block_q: query rows per block for long documents (memory ``block_q * doc_len * H``).

    Returns:
        ``o`` of shape ``(T, H_q, D)`` in ``compute_dtype`` (and ``lse`` if requested).

    Raises:
        MetadataError: invalid ``cu_seqlens`` or shapes.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise MetadataError(f"q, k, v must be (T, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
        raise MetadataError(f"k and v must be (T={T}, H_kv, D={D}); got {tuple(k.shape)}, {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hq % Hkv != 0:
        raise MetadataError(f"num_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    cu = validate_cu_seqlens(cu_seqlens).tolist()
    if cu[-1] > T:
        raise MetadataError(f"cu_seqlens[-1]={cu[-1]} exceeds the number of tokens T={T}")
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    g = Hq // Hkv
    qf = q.to(compute_dtype)
    kf = k.to(compute_dtype).repeat_interleave(g, dim=1)
    vf = v.to(compute_dtype).repeat_interleave(g, dim=1)
    o = torch.zeros((T, Hq, D), dtype=compute_dtype, device=q.device)
    lse = torch.full((Hq, T), math.inf, dtype=compute_dtype, device=q.device)
    pos = torch.arange(T, device=q.device)
    doc_of = torch.full((T,), -1, dtype=torch.long, device=q.device)
    if len(cu) > 1:
        cu_t = torch.tensor(cu, device=q.device)
        used = pos[: cu[-1]]
        doc_of[: cu[-1]] = torch.searchsorted(cu_t, used, right=True) - 1
    for c0, c1 in _chunks(cu, block_q):
        for q0 in range(c0, c1, block_q):
            q1 = min(q0 + block_q, c1)
            k1 = q1 if causal else c1
            qs = qf[q0:q1].transpose(0, 1)  # (H, m, D)
            ks = kf[c0:k1].transpose(0, 1)
            vs = vf[c0:k1].transpose(0, 1)
            s = torch.matmul(qs, ks.transpose(1, 2)) * scale  # (H, m, n)
            dq = doc_of[q0:q1, None]
            dk = doc_of[None, c0:k1]
            mask = dq == dk
            if causal:
                mask &= pos[q0:q1, None] >= pos[None, c0:k1]
            s = s.masked_fill(~mask, -math.inf)
            m = torch.logsumexp(s, dim=-1)  # (H, m); every valid row sees at least itself (causal) / its doc
            p = torch.exp(s - m[..., None])
            o[q0:q1] = torch.matmul(p, vs).transpose(0, 1)
            lse[:, q0:q1] = m
    if return_lse:
        return o, lse
    return o
