"""The torchtitan drop-in: ``varlen_attn`` has torch.nn.attention.varlen.varlen_attn's signature and
gives per-document SDPA's output, LSE and gradients; the module / metadata match torchtitan's
(tested against torchtitan itself where it imports, skipped otherwise)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.integrations import torchtitan as ftt

CU = [0, 5, 6, 14, 20]  # documents of 5, 1, 8, 6 tokens in a stream of T = 24 (4 tokens of padding)
T = 24


def qkv(hq=4, hkv=4, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(T, h, d, generator=g, dtype=dtype).requires_grad_(True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def sdpa_per_document(q, k, v, cu, causal, scale=None):
    """(out (T, Hq, D) with zeros past cu[-1], lse (Hq, T) over real tokens) by plain SDPA per document."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(g, 0), vd.repeat_interleave(g, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale).transpose(0, 1))
        s = (qd @ kd.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if causal:
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        lses.append(torch.logsumexp(s, -1))
    pad = q.shape[0] - cu[-1]
    out = torch.cat(outs + [q.new_zeros(pad, q.shape[1], v.shape[-1])])
    return out, torch.cat(lses, -1)


def test_signature_is_torch_varlen_attn():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    ours = inspect.signature(ftt.varlen_attn).parameters
    theirs = inspect.signature(varlen.varlen_attn).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind and ours[name].default == p.default, name


@pytest.mark.parametrize("hq,hkv,window", [(4, 4, (-1, 0)), (4, 2, (-1, 0)), (4, 1, (-1, -1))])
def test_varlen_attn_equals_per_document_sdpa(hq, hkv, window):
    causal = window == (-1, 0)
    q, k, v = qkv(hq, hkv)
    cu = torch.tensor(CU, dtype=torch.int32)
    aux = type("AuxRequest", (), {"lse": True})()
    out, lse = ftt.varlen_attn(q, k, v, cu, cu.clone(), 8, 8, return_aux=aux, scale=0.3, window_size=window,
                               enable_gqa=hq != hkv, num_splits=1)
    assert out.shape == (T, hq, 16) and lse.shape == (hq, T)
    ref_out, ref_lse = sdpa_per_document(q, k, v, CU, causal, scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :CU[-1]], ref_lse, atol=1e-5, rtol=1e-5)
    w = torch.randn(T, hq, 16)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * w).sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


def test_varlen_attn_rejects_what_it_cannot_do():
    q, k, v = qkv()
    cu = torch.tensor(CU, dtype=torch.int32)
    with pytest.raises(FlamiaError, match="window_size"):
        ftt.varlen_attn(q, k, v, cu, cu, 8, 8, window_size=(128, 0))
    with pytest.raises(MetadataError, match="cu_seq_k must equal"):
        ftt.varlen_attn(q, k, v, cu, torch.tensor([0, 4, 6, 14, 20], dtype=torch.int32), 8, 8)
    with pytest.raises(FlamiaError, match="enable_gqa"):
        ftt.varlen_attn(q, k[:, :2], v[:, :2], cu, cu, 8, 8)
    with pytest.raises(FlamiaError, match="block_table"):
        ftt.varlen_attn(q, k, v, cu, cu, 8, 8, block_table=torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(MetadataError, match="max_q"):
        ftt.varlen_attn(q, k, v, cu, cu, 8.0, 8)


def test_metadata_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    m = ftt.varlen_metadata_for_document(pos, include_host_offsets=True)
    assert m.cu_seq_q.tolist() == [0, 3, 5, 6, 10, 12] and m.cu_seq_q.dtype == torch.int32
    assert m.cu_seq_k is m.cu_seq_q and m.max_q == m.max_k == 4 and m.cu_seq_q_host == (0, 3, 5, 6, 10, 12)
    # a row that starts mid-document (a continuation at position 5) starts a document of its own
    assert ftt.varlen_metadata_for_document(torch.tensor([[5, 6, 0, 1]])).cu_seq_q.tolist() == [0, 2, 4]
    with pytest.raises(MetadataError, match="2-D integer"):
        ftt.varlen_metadata_for_document(torch.zeros(4))


def test_module_matches_per_document_sdpa_with_out_transform():
    B, L, N, D = 2, 12, 4, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, L, h, D, generator=g) for h in (N, 2, 2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    meta = ftt.varlen_metadata_for_document(pos)
    attn = ftt.FlamiaVarlenAttention()
    out = attn(q, k, v, attention_masks=meta)
    ref, ref_lse = sdpa_per_document(q.reshape(-1, N, D), k.reshape(-1, 2, D), v.reshape(-1, 2, D),
                                     meta.cu_seq_q.tolist(), causal=True)
    torch.testing.assert_close(out, ref.view(B, L, N, D), atol=1e-5, rtol=1e-5)
    seen = {}

    def keep(o, lse):
        seen["lse"] = lse
        return o * 2

    out2 = attn(q, k, v, attention_masks=meta, out_transform=keep)
    torch.testing.assert_close(out2, 2 * out)
    torch.testing.assert_close(seen["lse"], ref_lse.transpose(0, 1).reshape(B, L, N), atol=1e-5, rtol=1e-5)
    with pytest.raises(FlamiaError, match="VarlenMetadata"):
        attn(q, k, v, attention_masks=None)
    with pytest.raises(FlamiaError, match="window_size"):
        ftt.FlamiaVarlenAttention(window_size=(64, 0))


def test_against_torchtitan_itself():
    """torchtitan's VarlenAttention with varlen_attn patched equals FlamiaVarlenAttention (bf16, as
    torchtitan casts), and its create_varlen_metadata_for_document equals ours."""
    tt = pytest.importorskip("torchtitan.models.common.attention")
    B, L, N, D = 2, 16, 4, 64
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, L, N, D, generator=g) for _ in range(3))
    pos = torch.tensor([list(range(7)) + list(range(9)), list(range(3)) + list(range(13))])
    theirs_meta = tt.create_varlen_metadata_for_document(pos)
    ours_meta = ftt.varlen_metadata_for_document(pos)
    assert theirs_meta.cu_seq_q.tolist() == ours_meta.cu_seq_q.tolist()
    assert (theirs_meta.max_q, theirs_meta.max_k) == (ours_meta.max_q, ours_meta.max_k)
    module = tt.VarlenAttention(tt.VarlenAttention.Config())
    previous = ftt.patch_torchtitan(tt)
    try:
        got = module(q, k, v, attention_masks=theirs_meta)
    finally:
        tt.varlen_attn = previous
    assert got.dtype == torch.float32 and got.shape == (B, L, N, D)
    ref = ftt.FlamiaVarlenAttention()(q.bfloat16(), k.bfloat16(), v.bfloat16(), attention_masks=ours_meta)
    torch.testing.assert_close(got, ref.float(), atol=0, rtol=0)
    ref32, _ = sdpa_per_document(*(x.bfloat16().float().reshape(-1, N, D) for x in (q, k, v)),
                                 ours_meta.cu_seq_q.tolist(), causal=True)
    torch.testing.assert_close(got, ref32.view(B, L, N, D), atol=2e-2, rtol=2e-2)
