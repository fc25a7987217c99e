"""The torch reference against a naive per-document loop (float64), MHA and GQA, causal and not."""
from __future__ import annotations

import math

import pytest
import torch

from flamia_pack.errors import MetadataError
from flamia_pack.kernels.reference import packed_attention_reference


def naive(q, k, v, cu, causal, scale):
    T, Hq, D = q.shape
    g = Hq // k.shape[1]
    o = torch.zeros_like(q)
    lse = torch.full((Hq, T), math.inf, dtype=q.dtype)
    for s0, s1 in zip(cu[:-1], cu[1:]):
        for h in range(Hq):
            qq, kk, vv = q[s0:s1, h], k[s0:s1, h // g], v[s0:s1, h // g]
            s = qq @ kk.T * scale
            if causal:
                s = s + torch.triu(torch.full_like(s, -math.inf), diagonal=1)
            o[s0:s1, h] = torch.softmax(s, -1) @ vv
            lse[h, s0:s1] = torch.logsumexp(s, -1)
    return o, lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_naive(causal, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv + causal)
    lens = [1, 113, 7, 203, 2, 64]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1] + 5  # row-end padding belongs to no document
    D = 16
    q = torch.randn(T, hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    o, lse = packed_attention_reference(
        q, k, v, torch.tensor(cu, dtype=torch.int32), causal=causal,
        compute_dtype=torch.float64, return_lse=True, block_q=50,
    )
    o_ref, lse_ref = naive(q, k, v, cu, causal, D ** -0.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    assert torch.all(o[cu[-1]:] == 0) and torch.all(torch.isinf(lse[:, cu[-1]:]))


def test_reference_is_differentiable():
    q = torch.randn(20, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    f = lambda q, k, v: packed_attention_reference(q, k, v, cu, compute_dtype=torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_reference_rejects_bad_metadata():
    q = torch.randn(10, 2, 8)
    with pytest.raises(MetadataError, match="cu_seqlens\\[-1\\]"):
        packed_attention_reference(q, q, q, torch.tensor([0, 11], dtype=torch.int32))
    with pytest.raises(MetadataError, match="multiple of num_kv_heads"):
        packed_attention_reference(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), torch.tensor([0, 10]))
    with pytest.raises(MetadataError, match="int32 or int64"):
        packed_attention_reference(q, q, q, torch.tensor([0.0, 10.0]))


@pytest.mark.parametrize("causal", [True, False])
def test_blocked_reference_gradients_equal_autograd(monkeypatch, causal):
    """packed_attention_reference_blocked: same output as the reference, and its bounded-memory backward
    (forced to several query blocks per document) gives autograd's dq, dk, dv (float64, GQA 4/2,
    row-end padding with zero gradients)."""
    from flamia_pack.kernels import reference

    monkeypatch.setattr(reference, "REF_BLOCK_BYTES", 4 * 50 * 8 * 7)  # 7 rows of the 50-token document
    g = torch.Generator().manual_seed(11)
    lengths, pad, H, Hkv, D = [50, 3, 1, 29], 4, 4, 2, 16
    T = sum(lengths) + pad
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    base = [torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv)]
    do = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    a = [x.clone().requires_grad_() for x in base]
    b = [x.clone().requires_grad_() for x in base]
    o_a = reference.packed_attention_reference_blocked(*a, cu, causal=causal, compute_dtype=torch.float64)
    o_b = packed_attention_reference(*b, cu, causal=causal, compute_dtype=torch.float64)
    torch.testing.assert_close(o_a, o_b, atol=0, rtol=0)
    o_a.backward(do)
    o_b.backward(do)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-11, rtol=1e-11)
        assert (x.grad[sum(lengths):] == 0).all()


def test_reference_forward_blocks_bounded_by_bytes(monkeypatch):
    """The forward's query blocks shrink so a block's (H, rows, L) scores stay under REF_BLOCK_BYTES;
    rows are independent, so any blocking gives the same values (up to BLAS summation order)."""
    from flamia_pack.kernels import reference

    g = torch.Generator().manual_seed(5)
    T, H, D = 300, 2, 8
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    cu = torch.tensor([0, 260, 300], dtype=torch.int32)
    o1, l1 = packed_attention_reference(q, k, v, cu, return_lse=True)
    assert reference.reference_block_rows(H, 260, 4) == 260  # default: one block per document
    monkeypatch.setattr(reference, "REF_BLOCK_BYTES", H * 260 * 4 * 16)  # 16 rows per block
    calls = []
    real = torch.matmul

    def spy(a, b, *args, **kw):
        out = real(a, b, *args, **kw)
        calls.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch, "matmul", spy)
    o2, l2 = packed_attention_reference(q, k, v, cu, return_lse=True)
    monkeypatch.setattr(torch, "matmul", real)
    assert max(calls) <= H * 260 * 4 * 16 and len(calls) > 2 * (260 // 16)
    torch.testing.assert_close(o2, o1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-6)


def test_blocked_reference_backward_uses_compute_dtype():
    """float32 inputs with compute_dtype=float64: the blocked backward computes in float64 too (its
    gradients match float64 autograd far below float32 rounding)."""
    from flamia_pack.kernels import reference

    g = torch.Generator().manual_seed(2)
    T, H, D = 70, 2, 8
    base = [torch.randn(T, H, D, generator=g) for _ in range(3)]
    cu = torch.tensor([0, 45, 70], dtype=torch.int32)
    a = [x.clone().requires_grad_() for x in base]
    b = [x.double().requires_grad_() for x in base]
    reference.packed_attention_reference_blocked(*a, cu, compute_dtype=torch.float64).sum().backward()
    packed_attention_reference(*b, cu, compute_dtype=torch.float64).sum().backward()
    for x, y in zip(a, b):
        assert x.grad.dtype == torch.float32
        torch.testing.assert_close(x.grad, y.grad.float(), atol=1e-9, rtol=2.4e-7)  # <= 2 float32 ulps
