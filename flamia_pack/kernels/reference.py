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


REF_BLOCK_BYTES = 64 * 1024 * 1024
"""Bytes of one ``(H, rows, L)`` score-sized matrix per query block of :func:`packed_attention_reference`
and :func:`packed_attention_reference_bwd`; the scores / P, dP and dS of a block are each at most this
big, so a document costs O(H * L * D) memory plus this, not O(H * L^2)."""


def reference_block_rows(H: int, L: int, itemsize: int) -> int:
    """Query rows per block of the forward and backward reference for a document of ``L`` tokens and
    ``H`` query heads: the largest count with ``H * rows * L * itemsize <= REF_BLOCK_BYTES`` (at
    least 1, at most L)."""
    per_row = max(1, H * L * itemsize)
    return max(1, min(L, REF_BLOCK_BYTES // per_row))


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
        block_q: at most this many query rows per block; fewer when a block's ``(H, rows, doc_len)``
            scores would pass ``REF_BLOCK_BYTES`` (64 MiB), so memory stays O(H * doc_len * D).

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
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    for c0, c1 in _chunks(cu, block_q):
        # at most block_q rows, and few enough that a block's (H, rows, chunk) scores stay under
        # REF_BLOCK_BYTES (a 100,000-token document: 41 rows at H = 16 instead of 1,024)
        rows = min(block_q, reference_block_rows(Hq, c1 - c0, itemsize))
        for q0 in range(c0, c1, rows):
            q1 = min(q0 + rows, c1)
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


def packed_attention_reference_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    dlse: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact backward of packed attention, per document, in bounded memory.

    FlashAttention-2 (Dao, 2023) Algorithm 2's formulas, as the kernels (``flash_bwd.py``) use them:
    ``P = exp(S * scale - lse)``, ``Delta = rowsum(dO * O) - dLSE``, ``dS = P * (dO V^T - Delta)``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``, ``dV = P^T dO``. Each document is walked in query
    blocks (:func:`reference_block_rows`): a block's P, dP and dS are ``(H, rows, L)`` with
    ``H * rows * L * itemsize <= REF_BLOCK_BYTES`` (64 MiB; causal blocks only see keys up to
    their last row), dK / dV accumulate over the blocks, so memory is O(H * L * D + 64 MiB) per
    document instead of O(H * L^2). GQA: each kv head gets the sum over its query-head group.

    Args:
        do: ``(T, H_q, D)`` gradient of ``o``.
        q, k, v: as :func:`packed_attention_reference`.
        o, lse: its outputs (``return_lse=True``): ``(T, H_q, D)`` and ``(H_q, T)``.
        cu_seqlens: ``(n_docs + 1,)`` int32/int64 (trusted here: validated by the forward).
        causal, softmax_scale: as the forward (``softmax_scale`` None = ``D ** -0.5``).
        dlse: optional ``(H_q, T)`` gradient of ``lse``.
        compute_dtype: float32 or float64; None = float64 for float64 ``q``, else float32.

    Returns:
        ``(dq, dk, dv)`` in q / k / v's dtypes, computed in ``compute_dtype``; rows past
        ``cu_seqlens[-1]`` are zero.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    f32 = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    itemsize = torch.empty((), dtype=f32).element_size()
    dq = torch.zeros((T, H, D), dtype=f32, device=q.device)
    dk = torch.zeros((T, Hkv, D), dtype=f32, device=q.device)
    dv = torch.zeros((T, Hkv, D), dtype=f32, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        L = e - s
        ks = k[s:e].to(f32).repeat_interleave(g, dim=1).transpose(0, 1)  # (H, L, D)
        vs = v[s:e].to(f32).repeat_interleave(g, dim=1).transpose(0, 1)
        dks = torch.zeros((H, L, D), dtype=f32, device=q.device)  # per query head; summed over the group below
        dvs = torch.zeros((H, L, D), dtype=f32, device=q.device)
        rows = reference_block_rows(H, L, itemsize)
        for q0 in range(s, e, rows):
            q1 = min(q0 + rows, e)
            n = (q1 if causal else e) - s  # keys this block can see (causal: up to its last row)
            qb = q[q0:q1].to(f32).transpose(0, 1)  # (H, m, D)
            dob = do[q0:q1].to(f32).transpose(0, 1)
            ob = o[q0:q1].to(f32).transpose(0, 1)
            kb, vb = ks[:, :n], vs[:, :n]
            p = torch.exp(torch.matmul(qb, kb.transpose(1, 2)) * scale - lse[:, q0:q1, None].to(f32))  # (H, m, n)
            if causal:
                p = torch.tril(p, diagonal=q0 - s)  # block row i is document row q0 - s + i
            delta = (dob * ob).sum(-1)
            if dlse is not None:
                delta = delta - dlse[:, q0:q1].to(f32)
            ds = p * (torch.matmul(dob, vb.transpose(1, 2)) - delta[..., None])
            dq[q0:q1] = (torch.matmul(ds, kb) * scale).transpose(0, 1)
            dks[:, :n] += torch.matmul(ds.transpose(1, 2), qb) * scale
            dvs[:, :n] += torch.matmul(p.transpose(1, 2), dob)
            del p, ds
        dk[s:e] = dks.view(Hkv, g, L, D).sum(1).transpose(0, 1)
        dv[s:e] = dvs.view(Hkv, g, L, D).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _BlockedReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, softmax_scale, compute_dtype):
        o, lse = packed_attention_reference(q, k, v, cu_seqlens, causal=causal, softmax_scale=softmax_scale,
                                            compute_dtype=compute_dtype, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.causal, ctx.softmax_scale, ctx.compute_dtype = causal, softmax_scale, compute_dtype
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu = ctx.saved_tensors
        dq, dk, dv = packed_attention_reference_bwd(do, q, k, v, o, lse, cu, causal=ctx.causal,
                                                    softmax_scale=ctx.softmax_scale,
                                                    compute_dtype=ctx.compute_dtype)
        return dq, dk, dv, None, None, None, None


def packed_attention_reference_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`packed_attention_reference`'s output with a bounded-memory backward.

    Autograd through :func:`packed_attention_reference` keeps every query block's scores and
    probabilities for the backward (O(H * L^2) per document: a 100,000-token document needs tens of
    GB); this autograd function saves only q, k, v, o and LSE and computes the gradients with
    :func:`packed_attention_reference_bwd` (query blocks of at most ``REF_BLOCK_BYTES``). Same
    arguments, shapes and errors as :func:`packed_attention_reference` (``return_lse`` not offered);
    gradients flow to q, k and v only.
    """
    return _BlockedReference.apply(q, k, v, cu_seqlens, causal, softmax_scale, compute_dtype)
