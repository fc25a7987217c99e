"""Hadamard rotation of Q and K before FP8 quantization (``varlen_attention(qk_rotation="hadamard")``).

Why: a per-token (or per-32-token) E4M3 scale is set by the token's largest channel, so a few large
channels (outlier channels of K, RoPE's high-frequency pairs in trained models) leave the other
channels with few significant bits, and the error of ``Q K^T`` grows with them. An orthogonal
rotation of the head dimension applied to both Q and K leaves every score unchanged and spreads a
channel's energy over all D channels ("incoherent processing", FlashAttention-3 §3.3), so the
token's scale follows its norm instead of its largest channel (no change on N(0, 1) inputs; what it buys
and costs: benchmarks/RESULTS.md "Session of 2026-12-06 (third)").

What it computes: ``q' = q M``, ``k' = k M`` with ``M = 2^-s H_D`` (``H_D`` the Sylvester Hadamard
matrix of +-1 entries, ``s = floor(log2(D) / 2)``), so ``q' k'^T = 2^(log2(D) - 2s) q k^T`` and the
call's ``softmax_scale`` is divided by that power of two (:func:`rotation_scale_factor`): scores,
softmax, LSE and O are those of the unrotated call up to rounding. ``M``'s entries are exact in
bf16 and the factor is a power of two, so the only new rounding is the product's: summed in fp32 (each
term ``x_d 2^-s`` is exact; the sum of 128 of them is exact unless their binades span more than fp32's
24 bits, which bf16 rows almost never do), rounded once to bf16 (~2^-9 relative, against E4M3's 2^-4);
float16 inputs keep the fp32 product (no 65,504 overflow). Gradients flow through the matmul
(``dq = dq' M^T``; on the GPU path the backward multiplies the bf16 dQ and dK by ``M``).

Causal safety: the rotation mixes the channels of one token of one head, never tokens, so it adds no
dependency between positions; the leak probe's guarantees (``"token"``: bitwise, ``"block"``: the
32-token group) hold unchanged (``tests/test_qk_rotation.py``).

Where it runs: on the GPU FP8 path the quantizer rotates q and k itself (``quantize_qkv(rotate_qk=True)``:
an fp32 ``tl.dot`` a tile, rounded to bf16 by integer ops: the bits of :func:`rotate_qk` then the
quantizer), so the rotated tensors never reach memory; the backward multiplies dQ and dK by ``M`` (two bf16
matmuls, :func:`device_matrix`). The CPU emulation calls :func:`rotate_qk`.
"""
from __future__ import annotations

import torch

from flamia_pack.errors import FlamiaError

#: ``varlen_attention(qk_rotation=)``'s values besides None ("none": off, the transformers options' spelling).
QK_ROTATIONS = ("none", "hadamard")


def _check_head_dim(D: int) -> None:
    if D < 1 or D & (D - 1):
        raise FlamiaError(f"qk_rotation='hadamard' needs a power-of-two head_dim (a Sylvester Hadamard matrix), got "
                          f"{D}")


def hadamard_matrix(D: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The rotation ``M = 2^-floor(log2(D) / 2) H_D``: ``(D, D)``, symmetric, ``M M^T = 2^(log2 D - 2s) I``.

    ``H_D[i, j] = (-1)^popcount(i & j)`` (Sylvester's construction), built with a few integer ops and no
    cache (so ``torch.compile`` traces it as a constant without guarding a cache).

    Raises:
        FlamiaError: ``D`` is not a power of two.
    """
    D = int(D)
    _check_head_dim(D)
    i = torch.arange(D, device=device)
    both = i[:, None] & i[None, :]
    parity = torch.zeros_like(both)
    for b in range(D.bit_length() - 1):
        parity ^= (both >> b) & 1
    return (1 - 2 * parity).to(dtype) * 2.0 ** -((D.bit_length() - 1) // 2)


_DEVICE_MATRICES: dict = {}


def device_matrix(D: int, device) -> torch.Tensor:
    """:func:`hadamard_matrix` in bf16 on ``device`` (exact: entries +-2^-s), what the GPU quantizer and the GPU
    backward multiply by; built once per (D, device). While a CUDA graph is being captured it is built inside
    the graph and not cached (a tensor made during capture holds its values only once the graph replays)."""
    device = torch.device(device)
    key = (int(D), str(device))
    if key in _DEVICE_MATRICES:
        return _DEVICE_MATRICES[key]
    m = hadamard_matrix(D, torch.bfloat16, device).contiguous()
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _DEVICE_MATRICES[key] = m
    return m


def rotation_scale_factor(D: int) -> float:
    """The power of two that ``softmax_scale`` is multiplied by after the rotation: ``2^-(log2 D - 2s)``
    (0.5 for D = 128, 1.0 for D = 64)."""
    _check_head_dim(int(D))
    log2 = int(D).bit_length() - 1
    return 2.0 ** -(log2 - 2 * (log2 // 2))


def rotate_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q M, k M)`` for ``q (T, H_q, D)``, ``k (T, H_kv, D)`` of one floating dtype; differentiable.

    The product runs in float32 for 16-bit inputs and in the input dtype otherwise, then is rounded
    once: to bfloat16 for bfloat16 inputs (what the GPU quantizer reads), kept in float32 for float16
    inputs (a rotated entry can reach ``sum |x| / 8``, beyond float16's 65,504; the CPU emulation takes
    float32). Returns contiguous tensors of the inputs' shapes.

    Raises:
        FlamiaError: not floating tensors of one dtype with the same power-of-two last dim.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        raise FlamiaError(f"rotate_qk takes two tensors, got {type(q).__name__} and {type(k).__name__}")
    if not q.dtype.is_floating_point or q.dtype != k.dtype:
        raise FlamiaError(f"rotate_qk needs q and k of one floating dtype, got {q.dtype} and {k.dtype}")
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1]:
        raise FlamiaError(f"rotate_qk needs q (T, H_q, D) and k (T, H_kv, D) with one D, got {tuple(q.shape)} and "
                          f"{tuple(k.shape)}")
    D = q.shape[-1]
    acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    out = torch.float32 if q.dtype == torch.float16 else q.dtype
    cuda_bf16 = q.device.type == "cuda" and q.dtype == torch.bfloat16
    m = hadamard_matrix(D, q.dtype if cuda_bf16 else acc, q.device)

    def rot(x: torch.Tensor) -> torch.Tensor:
        if cuda_bf16:
            return x @ m  # cuBLAS accumulates the bf16 products in fp32 and rounds once
        return (x.to(acc) @ m).to(out)

    return rot(q), rot(k)
