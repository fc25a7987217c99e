"""CPU tests of the packed-attention op (issue 5): validation, the reference fallback, the custom
op under torch.compile, the shared tile decisions (exhaustively), and the Triton kernels run in
the Triton interpreter (``TRITON_INTERPRET=1``, one subprocess) against the fp32 reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels import packed_attention_reference, reference, varlen_attention
from flamia_pack.kernels.attention import build_attention_work_list, kernels_available
from flamia_pack.kernels.config import AttentionKernelConfig, candidate_config, kernel_config
from flamia_pack.kernels.tiles import program_geometry_host, tile_visible_host, visible_host
from flamia_pack.scheduler.worklist import TileConfig, build_work_list_host


def _inputs(lengths, h=4, hkv=2, d=64, pad=0, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q = torch.randn(T, h, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    return q, k, v, cu


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _bad_calls():
    q, k, v, cu = _inputs([5, 7], h=4, hkv=2, d=64)
    yield "q 2-D", (q[:, 0], k, v, cu, 7), {}, FlamiaError, "3-D"
    yield "k/v shapes", (q, k, v[:, :1], cu, 7), {}, FlamiaError, "same shape"
    yield "T mismatch", (q, k[:5], v[:5], cu, 7), {}, FlamiaError, "k/v must be"
    yield "heads", (q[:, :3], k, v, cu, 7), {}, FlamiaError, "multiple of num_kv_heads"
    yield "dtype mix", (q, k.float(), v, cu, 7), {}, FlamiaError, "one dtype"
    yield "int q", (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32), cu, 7), {}, FlamiaError, "dtype"
    yield "stride", (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, 7), {}, FlamiaError, "contiguous"
    yield "cu float", (q, k, v, cu.float(), 7), {}, MetadataError, "int32"
    yield "cu 2-D", (q, k, v, cu[None], 7), {}, MetadataError, "1-D"
    yield "cu start", (q, k, v, cu + 1, 8), {}, MetadataError, "must be 0"
    yield "cu order", (q, k, v, torch.tensor([0, 7, 5, 12], dtype=torch.int32), 7), {}, MetadataError, "non-decreasing|strictly increasing"
    yield "cu empty seg", (q, k, v, torch.tensor([0, 5, 5, 12], dtype=torch.int32), 7), {}, MetadataError, "zero-length"
    yield "cu past T", (q, k, v, torch.tensor([0, 5, 13], dtype=torch.int32), 8), {}, MetadataError, "exceeds"
    yield "max_seqlen", (q, k, v, cu, 6), {}, MetadataError, "max_seqlen"
    yield "max_seqlen type", (q, k, v, cu, 7.0), {}, FlamiaError, "max_seqlen"
    yield "scale", (q, k, v, cu, 7), {"softmax_scale": -1.0}, FlamiaError, "softmax_scale"
    yield "precision", (q, k, v, cu, 7), {"precision": "fp16"}, FlamiaError, "precision"
    yield "fp8 granularity", (q, k, v, cu, 7), {"precision": "fp8", "scale_granularity": "row"}, FlamiaError, "scale_granularity"
    yield "fp8 config", (q, k, v, cu, 7), {"precision": "fp8", "config": candidate_config("default")}, FlamiaError, "config"
    yield "fp8 causal_dq_scale", (q, k, v, cu, 7), {"precision": "fp8", "causal_dq_scale": 1}, FlamiaError, "causal_dq_scale"
    yield "causal type", (q, k, v, cu, 7), {"causal": 1}, FlamiaError, "bool"
    yield "not a tensor", (q.numpy() if q.dtype != torch.bfloat16 else [1], k, v, cu, 7), {}, FlamiaError, "torch.Tensor"
    yield "work_list type", (q, k, v, cu, 7), {"work_list": object()}, FlamiaError, "WorkList"
    # int64 values past int32 must be rejected, not wrapped by the int32 cast (2**32 + 12 -> 12)
    yield "cu int64 wrap", (q, k, v, torch.tensor([0, 5, 2**32 + 12]), 7), {}, MetadataError, "non-decreasing|strictly increasing|exceeds"
    yield "cu int64 past T", (q, k, v, torch.tensor([0, 5, 13]), 8), {}, MetadataError, "exceeds"
    yield "head_dim 0", (q[..., :0], k[..., :0], v[..., :0], cu, 7), {}, FlamiaError, "head_dim"
    yield "config type", (q, k, v, cu, 7), {"config": 5}, FlamiaError, "AttentionKernelConfig"
    yield "scale nan", (q, k, v, cu, 7), {"softmax_scale": float("nan")}, FlamiaError, "softmax_scale"
    yield "scale tensor", (q, k, v, cu, 7), {"softmax_scale": torch.tensor(0.5)}, FlamiaError, "softmax_scale"
    # qk_scale = softmax_scale * log2(e) must be a normal float32 (0 there turned the -inf masks into NaN)
    yield "scale underflow", (q, k, v, cu, 7), {"softmax_scale": 1e-45}, FlamiaError, "normal float32"
    yield "scale overflow", (q, k, v, cu, 7), {"softmax_scale": 1e39}, FlamiaError, "normal float32"
    yield "max_seqlen bool", (q, k, v, cu, True), {}, FlamiaError, "max_seqlen"
    # metadata mistakes are MetadataError (the README's promise), not only its FlamiaError base
    yield "max_seqlen None", (q, k, v, cu, None), {}, MetadataError, "max_seqlen"
    yield "cu list", (q, k, v, [0, 5, 12], 7), {}, MetadataError, "cu_seqlens must be a torch.Tensor"
    yield "cu device", (q, k, v, cu.to("meta"), 7), {}, MetadataError, "cu_seqlens on meta"
    yield "q device", (q.to("meta"), k, v, cu, 7), {}, FlamiaError, "q on meta, k on cpu"


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda c: c[0])
def test_validation_errors(case):
    _, args, kw, exc, msg = case
    with pytest.raises(exc, match=msg):
        varlen_attention(*args, **kw)


def test_numpy_scalars_are_accepted():
    # max_seqlen / softmax_scale often come out of numpy (np.diff(cu).max()); same result as ints
    q, k, v, cu = _inputs([5, 7], h=4, hkv=2, d=64, dtype=torch.float32)
    ref = varlen_attention(q, k, v, cu, 7, softmax_scale=0.25)
    got = varlen_attention(q, k, v, cu, np.int64(7), softmax_scale=np.float32(0.25))
    assert torch.equal(ref, got)
    with pytest.raises(MetadataError, match="max_seqlen"):
        varlen_attention(q, k, v, cu, np.int32(6))
    assert torch.equal(varlen_attention(q, k, v, cu.long(), 7, softmax_scale=0.25), ref)


def test_kernels_available_unknown_device_is_a_flamia_error():
    from flamia_pack.kernels.attention import kernels_available

    assert kernels_available("cpu") in (True, False)
    with pytest.raises(FlamiaError, match="unknown device"):  # was torch's RuntimeError
        kernels_available("gpu0")


def test_work_list_mismatch_is_rejected():
    q, k, v, cu = _inputs([40, 30], d=64)
    wl = build_attention_work_list(cu, q.shape[0], causal=False, head_dim=64)
    with pytest.raises(FlamiaError, match="causal"):
        varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl)
    from flamia_pack.scheduler.worklist import build_work_list

    wl64 = build_work_list(cu, q.shape[0], TileConfig(block_m=64, causal=True))
    with pytest.raises(FlamiaError, match="block_m"):
        varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl64)
    # a list built for a longer row (its items would address tokens past q) and for a shorter one
    cu_long = torch.tensor([0, 40, 128], dtype=torch.int32)
    for other_t, other_cu in ((128, cu_long), (60, torch.tensor([0, 40, 60], dtype=torch.int32))):
        wl_t = build_attention_work_list(other_cu, other_t, causal=True, head_dim=64)
        assert wl_t.total_tokens == other_t
        with pytest.raises(FlamiaError, match=rf"built for a row of T={other_t} tokens but q has T={q.shape[0]}"):
            varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl_t)
    # the matching list passes
    ok = build_attention_work_list(cu, q.shape[0], causal=True, head_dim=64)
    assert ok.total_tokens == q.shape[0]
    varlen_attention(q, k, v, cu, 40, causal=True, work_list=ok)


def test_work_list_of_another_row_of_the_same_t_is_rejected_on_the_cpu():
    """A list built from other cu_seqlens of the same T ran silently on the CPU; the list now remembers a
    CPU cu_seqlens (copied at the build) and the CPU path compares, naming both. The same values in
    another tensor or dtype, and a WorkListBuilder's padded buffer, still pass; a list rewritten in
    place since its build is not checked (it may describe another row now)."""
    from flamia_pack.kernels.config import work_list_tile_config
    from flamia_pack.scheduler.worklist import WorkListBuilder

    q, k, v, cu = _inputs([40, 30], d=64)
    other = torch.tensor([0, 20, 70], dtype=torch.int32)  # same T = 70
    wl = build_attention_work_list(other, q.shape[0], causal=True, head_dim=64)
    msg = (r"work_list was built for cu_seqlens \[0, 20, 70\] \(2 document\(s\)\) but the call has cu_seqlens "
           r"\[0, 40, 70\] \(2 document\(s\)\).*build_attention_work_list")
    for kw in ({}, {"check_finite": False}):
        with pytest.raises(FlamiaError, match=msg):
            varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl, **kw)
    q.requires_grad_()
    with pytest.raises(FlamiaError, match="built for cu_seqlens"):
        varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl)
    q = q.detach()
    with pytest.raises(FlamiaError, match="built for cu_seqlens"):  # another document count
        varlen_attention(q, k, v, cu, 40, work_list=build_attention_work_list(
            torch.tensor([0, 10, 40, 70]), q.shape[0], head_dim=64))
    ref = varlen_attention(q, k, v, cu, 40, causal=True)
    ok = build_attention_work_list(cu.long().clone(), q.shape[0], causal=True, head_dim=64)  # int64, another tensor
    assert torch.equal(varlen_attention(q, k, v, cu, 40, causal=True, work_list=ok), ref)
    builder = WorkListBuilder(8, q.shape[0], work_list_tile_config(kernel_config(64, True), True), device="cpu")
    assert torch.equal(varlen_attention(q, k, v, cu, 40, causal=True, work_list=builder(cu)), ref)
    with pytest.raises(FlamiaError, match=r"built for cu_seqlens \[0, 20, 70\]"):  # the builder's next row
        varlen_attention(q, k, v, cu, 40, causal=True, work_list=builder(other))
    wl.items.copy_(ok.items)  # refreshed in place for this row: no longer known to be other's
    wl.num_items.copy_(ok.num_items)
    assert torch.equal(varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl), ref)


def test_work_list_built_under_inference_mode():
    """build_attention_work_list under torch.inference_mode raised RuntimeError ("Inference tensors do not
    track version counter", from the hint stamp); it builds, and the call uses it."""
    q, k, v, cu = _inputs([40, 30], d=64)
    with torch.inference_mode():
        wl = build_attention_work_list(cu, q.shape[0], causal=True, head_dim=64)
        got = varlen_attention(q, k, v, cu, 40, causal=True, work_list=wl)
    assert torch.equal(got, varlen_attention(q, k, v, cu, 40, causal=True))
    assert wl.to_numpy().shape[0] > 0


def test_cpu_fallback_checks_cu_seqlens_values_with_a_work_list_too():
    """On the CPU fallback a prebuilt work list does not switch the cu_seqlens value checks off (the
    reference reads cu_seqlens itself): int64 values past int32 (which the cast would wrap to a
    valid-looking 70), an end past T and a decreasing entry are errors, not silent answers."""
    q, k, v, cu = _inputs([40, 30], d=64)
    if kernels_available(q.device):
        pytest.skip("the Triton interpreter path trusts a work list's cu_seqlens like the GPU path")
    wl = build_attention_work_list(cu, q.shape[0], causal=True, head_dim=64)
    for bad, needle in ((torch.tensor([0, 40, 2 ** 32 + 70]), "exceeds the number of tokens"),
                        (torch.tensor([0, 40, 90], dtype=torch.int32), "exceeds the number of tokens"),
                        (torch.tensor([0, 50, 40, 70], dtype=torch.int32), "strictly increasing")):
        with pytest.raises(MetadataError, match=needle):
            varlen_attention(q, k, v, bad, 40, causal=True, work_list=wl)
    good = varlen_attention(q, k, v, cu.to(torch.int64), 40, causal=True, work_list=wl)
    assert torch.equal(good, varlen_attention(q, k, v, cu, 40, causal=True))


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_fallback_is_float64_exact_for_float64_inputs(causal):
    """float64 inputs are computed in float64 (LSE too): torch.autograd.gradcheck passes for O and
    LSE w.r.t. q, k, v (GQA, two documents), and for O with a padding row (whose LSE is +inf, where
    finite differences mean nothing)."""
    if kernels_available("cpu"):
        pytest.skip("the Triton interpreter path takes bf16 inputs")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(8, 1, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    full = torch.tensor([0, 3, 8], dtype=torch.int32)
    o, lse = varlen_attention(q, k, v, full, 5, causal=causal, return_lse=True)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    assert torch.autograd.gradcheck(
        lambda a, b, c: varlen_attention(a, b, c, full, 5, causal=causal, return_lse=True), (q, k, v))
    padded = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b, c: varlen_attention(a, b, c, padded, 4, causal=causal), (q, k, v))


def test_config_by_name_gets_a_hint():
    q, k, v, cu = _inputs([40, 30], d=64)
    with pytest.raises(FlamiaError, match=r"candidate_config\('default'\)"):
        varlen_attention(q, k, v, cu, 40, config="default")


def test_config_validation():
    from flamia_pack.kernels.config import TritonFwdConfig

    with pytest.raises(FlamiaError):
        TritonFwdConfig(block_m=96)
    with pytest.raises(FlamiaError):
        AttentionKernelConfig(wl_block_m=64, fwd=TritonFwdConfig(block_m=128))
    with pytest.raises(FlamiaError):
        TritonFwdConfig(schedule="snake")
    with pytest.raises(FlamiaError):
        kernel_config(96)
    cfg = kernel_config(128)
    assert AttentionKernelConfig.from_key(cfg.key()) == cfg


# ---------------------------------------------------------------------------------------------
# reference fallback (CPU) through the custom op
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 1)])
def test_fallback_matches_reference_fwd_bwd(causal, h, hkv):
    lengths, pad = [9, 1, 23, 4], 3
    q, k, v, cu = _inputs(lengths, h=h, hkv=hkv, d=32, pad=pad, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = varlen_attention(*xs, cu, 23, causal=causal, return_lse=True)
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = packed_attention_reference(*ys, cu, causal=causal, compute_dtype=torch.float64, return_lse=True)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dl = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    used = sum(lengths)
    torch.autograd.backward([o, lse[:, :used]], [do, dl[:, :used].float()])
    torch.autograd.backward([o_ref, lse_ref[:, :used]], [do, dl[:, :used]])
    # float32 compute inside the fallback, float64 reference
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:, :used].double(), lse_ref[:, :used], atol=2e-5, rtol=2e-5)
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=5e-5)
    assert (o[used:] == 0).all() and torch.isinf(lse[:, used:]).all()
    assert all((x.grad[used:] == 0).all() for x in xs)


def _naive_doc_attention(q, k, v, cu, causal, scale):
    """Plain float64 softmax attention, one document at a time (GQA by repeating kv heads); padding rows
    get O = 0 and LSE = +inf. Differentiable through autograd: the ground truth for the blocked backward."""
    T, H, D = q.shape
    g = H // k.shape[1]
    os_, lses = [], []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].transpose(0, 1)
        ks = k[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
        sc = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            sc = sc.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)
        os_.append(torch.matmul(torch.exp(sc - lse[..., None]), vs).transpose(0, 1))
        lses.append(lse)
    pad = T - bounds[-1]
    o = torch.cat(os_ + [q.new_zeros((pad, H, D))], dim=0)
    lse = torch.cat(lses + [q.new_full((H, pad), float("inf"))], dim=1)
    return o, lse


@pytest.mark.parametrize("causal", [True, False])
def test_fallback_bwd_query_blocks_match_autograd(monkeypatch, causal):
    """The CPU backward walks each document in query blocks (``reference.REF_BLOCK_BYTES``); lowered here
    so every document spans several blocks, dq/dk/dv (with an LSE gradient, GQA 4/2) must equal torch
    autograd through plain per-document float64 attention."""
    h, hkv, d = 4, 2, 16
    lengths, pad = [40, 1, 75, 9], 3
    monkeypatch.setattr(reference, "REF_BLOCK_BYTES", h * 75 * 8 * 8)  # 8 rows of the 75-token document
    assert reference.reference_block_rows(h, 75, 8) == 8
    assert all(reference.reference_block_rows(h, n, 8) < n for n in (40, 75))  # several blocks each
    q, k, v, cu = _inputs(lengths, h=h, hkv=hkv, d=d, pad=pad, dtype=torch.float64, seed=3)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = varlen_attention(*xs, cu, 75, causal=causal, return_lse=True)
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = _naive_doc_attention(*ys, cu, causal, d ** -0.5)
    g = torch.Generator().manual_seed(4)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dl = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    used = sum(lengths)
    torch.autograd.backward([o, lse[:, :used]], [do, dl[:, :used]])
    torch.autograd.backward([o_ref, lse_ref[:, :used]], [do, dl[:, :used]])
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)
        assert (a.grad[used:] == 0).all()


def test_fallback_bwd_memory_bound(monkeypatch):
    """Per-block score matrices stay under ``reference.REF_BLOCK_BYTES`` even for L=100,000 and H=16, and one
    12,000-token document (H=1, D=8) runs forward+backward with every backward P block under the bound
    (the unblocked backward built 12,000^2 float32 matrices, 576 MB each)."""
    bound = reference.REF_BLOCK_BYTES
    assert bound <= 256 * 2 ** 20
    for H, L, itemsize in ((16, 100_000, 4), (16, 100_000, 8), (1, 100_000, 4), (64, 10 ** 7, 8)):
        rows = reference.reference_block_rows(H, L, itemsize)
        assert 1 <= rows <= L
        assert rows == 1 or H * rows * L * itemsize <= bound
    L = 12_000
    q, k, v, cu = _inputs([L], h=1, hkv=1, d=8, dtype=torch.float32, seed=5)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o = varlen_attention(*xs, cu, L, causal=True)
    sizes = []
    real_exp = torch.exp

    def spy_exp(x, *args, **kwargs):
        sizes.append(x.numel() * x.element_size())
        return real_exp(x, *args, **kwargs)

    monkeypatch.setattr(torch, "exp", spy_exp)
    o.backward(torch.ones_like(o))
    monkeypatch.setattr(torch, "exp", real_exp)
    assert len(sizes) > 1 and max(sizes) <= bound, (len(sizes), max(sizes, default=0))
    assert all(torch.isfinite(x.grad).all() for x in xs)


@pytest.mark.parametrize("prebuilt", [False, True])
def test_fallback_under_torch_compile(prebuilt):
    q, k, v, cu = _inputs([17, 5, 30], h=4, hkv=2, d=64, dtype=torch.float32)
    wl = build_attention_work_list(cu, q.shape[0], head_dim=64) if prebuilt else None

    def f(q, k, v):
        return varlen_attention(q, k, v, cu, 30, causal=True, work_list=wl).square().sum()

    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    # with a prebuilt work list the whole call traces into one graph (no host sync, no break)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=prebuilt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_c = compiled(*xs)
    # the host-side caches are bypassed while tracing (Dynamo warns on lru_cache wrappers)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    out_e = f(*ys)
    out_c.backward()
    out_e.backward()
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad)


def test_eager_function_matches_the_custom_op():
    """Eager calls run the op's bodies through ``_VarlenAttnFn`` (no custom-op dispatch); they must give
    the custom op's O, LSE and gradients bit for bit, also with an LSE gradient and with no grad."""
    from flamia_pack.kernels import attention as A

    q, k, v, cu = _inputs([6, 10, 3], h=4, hkv=2, d=16, dtype=torch.float64)
    items = torch.empty((0, 4), dtype=torch.int32)
    n = torch.zeros((1,), dtype=torch.int32)
    cfg = A._config_to_ints(AttentionKernelConfig())
    do = torch.randn_like(q)
    dlse = torch.randn(4, q.shape[0], dtype=torch.float64)
    results = []
    for via in ("function", "op"):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        args = (*xs, cu.to(torch.int32), items, n, True, 0.3, cfg)
        o, lse = A._VarlenAttnFn.apply(*args) if via == "function" else torch.ops.flamia_pack.varlen_attn_fwd(*args)
        torch.autograd.backward([o, lse], [do, dlse])
        results.append([o.detach(), lse.detach()] + [x.grad for x in xs])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # the public op takes the Function path with grads, the body alone without; the same O either way
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o_grad = varlen_attention(*xs, cu, 10, softmax_scale=0.3)
    with torch.no_grad():
        o_nograd = varlen_attention(q, k, v, cu, 10, softmax_scale=0.3)
    assert o_grad.grad_fn is not None and o_grad.grad_fn.name() == "_VarlenAttnFnBackward"
    assert torch.equal(o_grad.detach(), results[0][0]) and torch.equal(o_nograd, results[0][0])
    # no double backward, as the custom op: an error, never a silently missing second-order term (the
    # kernels' dq / dk / dv have no graph; a reviewer's report, 2026-11-30)
    (gq,) = torch.autograd.grad(o_grad.square().sum(), xs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.square().sum().backward()


def test_dispatch_modes_see_the_custom_op():
    """Under a torch dispatch mode (FakeTensorMode, make_fx's proxy mode, a logging mode) eager calls go
    through the custom op, whose fake implementation tracers rely on, not the Function path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, cu = _inputs([6, 10], h=2, hkv=1, d=16, dtype=torch.float32)
    ref = varlen_attention(q, k, v, cu, 10)
    with Seen() as mode:
        o = varlen_attention(q, k, v, cu, 10)
    assert any("flamia_pack.varlen_attn_fwd" in op for op in mode.ops), mode.ops
    assert torch.equal(o, ref)


def test_custom_op_opcheck():
    q, k, v, cu = _inputs([6, 10], h=2, hkv=1, d=16, dtype=torch.float32)
    items = torch.empty((0, 4), dtype=torch.int32)
    n = torch.zeros((1,), dtype=torch.int32)
    cfg = [int(x) if not isinstance(x, str) else 0 for x in AttentionKernelConfig().key()]
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, items, n, True, 0.25, cfg)
    torch.library.opcheck(torch.ops.flamia_pack.varlen_attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# tile decisions shared by all kernels (numpy mirror; exhaustive coverage check)
# ---------------------------------------------------------------------------------------------


def _check_cover(lengths, pad, causal, merge, wl_bm, b_r, b_o, keys):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T = int(cu[-1]) + pad
    items = build_work_list_host(cu, TileConfig(block_m=wl_bm, block_n=16, causal=causal, merge_short=merge))
    geo = program_geometry_host(items, cu, wl_block_m=wl_bm, block_rows=b_r, block_other=b_o,
                                rows_are_keys=keys, causal=causal)
    cover = np.zeros((T, T), np.int64)  # [query, key]
    rows_seen = np.zeros(T, np.int64)
    for i in range(len(geo["r_start"])):
        rs, re = int(geo["r_start"][i]), int(geo["r_end"][i])
        if rs >= re:
            continue
        assert re - rs <= b_r
        rows = np.arange(rs, re)
        rows_seen[rows] += 1
        o_lo, o_hi, u0, u1 = (int(geo[x][i]) for x in ("o_lo", "o_hi", "u0", "u1"))
        assert 0 <= u0 <= u1 <= max(u0, int(geo["n_tiles"][i]))
        for t in range(int(geo["n_tiles"][i])):
            o = o_lo + t * b_o + np.arange(b_o)
            o = o[o < T]
            qq, kk = (o, rows) if keys else (rows, o)
            truth = visible_host(cu, qq[:, None], kk[None, :], causal)
            truth = truth.T if keys else truth  # (rows, others)
            if u0 <= t < u1:
                assert (o < o_hi).all() and truth.all(), "a mask-free tile holds an invisible pair"
                vis = truth
            else:
                vis = tile_visible_host(cu, doc=int(geo["doc"][i]), merged=bool(geo["merged"][i]), r_pos=rows,
                                        o_pos=o, o_hi=o_hi, rows_are_keys=keys, causal=causal, wl_block_m=wl_bm)
                assert (vis == truth).all(), "the in-kernel mask differs from document/causal visibility"
            if keys:
                cover[np.ix_(o, rows)] += vis.T
            else:
                cover[np.ix_(rows, o)] += vis
    idx = np.arange(T)
    assert (cover == visible_host(cu, idx[:, None], idx[None, :], causal)).all(), "pairs lost or doubled"
    used = int(cu[-1])
    assert (rows_seen[:used] == 1).all() and (rows_seen[used:] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=12),
    pad=st.integers(0, 5),
    causal=st.booleans(),
    merge=st.booleans(),
    shape=st.sampled_from([(32, 32, 16), (32, 16, 16), (32, 32, 8), (64, 32, 16), (16, 16, 16)]),
    keys=st.booleans(),
)
def test_tile_decisions_cover_every_visible_pair_once(lengths, pad, causal, merge, shape, keys):
    wl_bm, b_r, b_o = shape
    _check_cover(lengths, pad, causal, merge, wl_bm, b_r, b_o, keys)


def test_tile_decisions_one_token_documents():
    _check_cover([1] * 70, 3, True, True, 32, 32, 16, False)
    _check_cover([1] * 70, 3, True, True, 32, 16, 16, True)


def test_merged_items_bound_the_program_count():
    # S1 shape scaled down: 4096 one-token documents in 32 merged items of 128, not 4096 items
    cu = np.arange(4097)
    items = build_work_list_host(cu, TileConfig(block_m=128, causal=True, merge_short=True))
    assert len(items) == 32


# ---------------------------------------------------------------------------------------------
# the Triton kernels in the interpreter (one subprocess for all cases)
# ---------------------------------------------------------------------------------------------

_SMALL = {}  # check.small_test_config's arguments
_SPLIT = dict(tile=16, schedule="persistent")

_INTERP_CASES = {
    "gqa_causal_pad_lsegrad": dict(lengths=[70, 5, 33, 1, 1, 2, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                                   causal=True, pad=7, config=_SMALL, with_lse_grad=True),
    "mha_noncausal": dict(lengths=[70, 5, 33, 1, 1, 2, 40], num_heads=2, num_kv_heads=2, head_dim=64,
                          causal=False, pad=3, config=_SMALL),
    "split_items_persistent_mqa": dict(lengths=[50, 3, 1, 1, 20], num_heads=4, num_kv_heads=1, head_dim=64,
                                       causal=True, pad=0, config=_SPLIT),
    "s1_one_token_docs": dict(lengths=[1] * 70, num_heads=2, num_kv_heads=2, head_dim=64, causal=True, pad=5,
                              config=_SMALL),
    "default_tiles_d128": dict(lengths=[130, 7, 200], num_heads=2, num_kv_heads=1, head_dim=128, causal=True, pad=3),
    "random_row_a": dict(lengths="random:0", num_heads=2, num_kv_heads=1, head_dim=64, causal=True, pad=2,
                         config=_SMALL),
    "random_row_b": dict(lengths="random:1", num_heads=2, num_kv_heads=2, head_dim=64, causal=False, pad=0,
                         config=_SMALL),
    # the forward's static snake schedule (DESIGN.md §6), and schedule="policy" resolving to it
    # (non-causal, balanced) or to the atomic counter (causal); units dealt over 8 programs, many rounds
    "static_snake_noncausal_gqa": dict(lengths=[70, 5, 33, 1, 1, 2, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                                       causal=False, pad=3, config={**_SMALL, "schedule": "static"}),
    "policy_static_balanced": dict(lengths=[60, 50, 40, 55, 45], num_heads=2, num_kv_heads=2, head_dim=64,
                                   causal=False, pad=0, config={**_SMALL, "schedule": "policy"}),
    "policy_dynamic_causal": dict(lengths=[70, 5, 33, 1, 1, 2, 40], num_heads=2, num_kv_heads=1, head_dim=64,
                                  causal=True, pad=5, config={**_SMALL, "schedule": "policy"}),
}

_SCRIPT = r"""
import json, sys
import numpy as np
from flamia_pack.kernels.check import compare_with_reference, random_lengths, small_test_config
from flamia_pack.kernels.attention import kernels_available
assert kernels_available("cpu"), "interpreter path not active"
cases = json.loads(sys.argv[1])
out = {}
for name, kw in cases.items():
    kw = dict(kw)
    if isinstance(kw["lengths"], str):
        seed = int(kw["lengths"].split(":")[1])
        kw["lengths"] = random_lengths(np.random.default_rng(seed), 200, 40)
    if "config" in kw:
        kw["config"] = small_test_config(**kw["config"])
    out[name] = compare_with_reference(seed=7, **kw)
print("RESULTS " + json.dumps(out))
"""


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def interp_results(run_interpreter):
    return run_interpreter(_SCRIPT, json.dumps(_INTERP_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_INTERP_CASES))
def test_triton_kernels_in_interpreter(interp_results, case):
    r = interp_results[case]
    bad = {k: r[k] for k in r if k.startswith(("err_", "base_"))}
    assert r["pad_ok"], f"padding rows not zero / +inf: {r}"
    for x in ("o", "dq", "dk", "dv"):
        assert r[f"ok_{x}"], f"{case}: {x} error {r[f'err_{x}']:.4g} > 2 x bf16 baseline {r[f'base_{x}']:.4g} + atol; {bad}"
    assert r["err_lse"] <= 1e-2, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cli_bench_without_gpu_is_one_red_line():
    from typer.testing import CliRunner

    from flamia_pack.cli import app

    r = CliRunner().invoke(app, ["bench", "--workloads", "W7"])
    assert r.exit_code == 2
    assert "needs a CUDA GPU" in r.output and "Traceback" not in r.output


def test_non_finite_inputs_are_rejected_on_the_cpu_path():
    q, k, v, cu = _inputs([40, 30], h=4, hkv=2, d=64, dtype=torch.float32)
    for name, bad in (("q", float("nan")), ("k", float("inf")), ("v", float("-inf"))):
        xs = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        xs[name][33, 1, 5] = bad
        with pytest.raises(FlamiaError, match=rf"{name} holds NaN / Inf \(first at token 33, head 1\)"):
            varlen_attention(xs["q"], xs["k"], xs["v"], cu, 40)
        # opted out: the call runs, the non-finite value stays visible in the output
        o = varlen_attention(xs["q"], xs["k"], xs["v"], cu, 40, check_finite=False)
        assert not bool(torch.isfinite(o).all())
    for bad in ("yes", 1, 0.0):
        with pytest.raises(FlamiaError, match="check_finite must be None, True or False"):
            varlen_attention(q, k, v, cu, 40, check_finite=bad)
    # finite inputs pass with the check forced on
    varlen_attention(q, k, v, cu, 40, check_finite=True)



_NAN_NEIGHBOUR = """
import sys
import torch
from flamia_pack.kernels import varlen_attention
from flamia_pack.kernels.attention import kernels_available
assert kernels_available(torch.device("cpu"))  # the Triton kernels, interpreted
lens, pos, which = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
T = sum(lens)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
xs = [torch.randn(T, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
xs["qkv".index(which)][pos, 0, 3] = float("nan")
xs = [x.requires_grad_() for x in xs]
o = varlen_attention(*xs, cu, max(lens), check_finite=False)
o.backward(torch.ones_like(o))
for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
    print(int(bool(torch.isfinite(o[a:b]).all()) and all(bool(torch.isfinite(x.grad[a:b]).all()) for x in xs)))
"""


def _finite_per_document(lens, pos, which):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _NAN_NEIGHBOUR, ",".join(map(str, lens)), str(pos), which], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return [int(x) for x in r.stdout.split()]


@pytest.mark.slow
def test_nan_in_one_document_stays_in_it_triton_interpreter():
    """Documents of their own items (here 200 and 100 tokens) keep a NaN in q, k or v to themselves:
    forward and all three gradients of the other document stay finite (Triton kernels, interpreted)."""
    for pos, which in ((250, "v"), (250, "k"), (150, "v"), (150, "q")):
        flags = _finite_per_document([200, 100], pos, which)
        assert flags == ([1, 0] if pos >= 200 else [0, 1]), (pos, which, flags)


@pytest.mark.xfail(strict=True, reason="known: short documents merged into one 128-query item (merge_short) share "
                                       "key tiles, so a NaN in one's K or V reaches the others (masked P is 0, "
                                       "0 x NaN = NaN in P V; the additive -1e6 mask keeps a NaN score)")
def test_nan_in_a_merged_short_document_stays_in_it_triton_interpreter():
    assert _finite_per_document([40, 30], 45, "v") == [1, 0]


_POLICY_UNDER_COMPILE = r"""
import torch
from flamia_pack.kernels.attention import build_attention_work_list, kernels_available, varlen_attention
from flamia_pack.kernels.check import small_test_config
assert kernels_available("cpu")
cfg = small_test_config(schedule="policy")
def f(q, k, v, cu, wl):
    return varlen_attention(q, k, v, cu, 40, causal=False, config=cfg, work_list=wl)
cf = torch.compile(f, backend="eager", dynamic=True)
for T in (40, 48):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, 2, 64, generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 10, T], dtype=torch.int32)
    wl = build_attention_work_list(cu, T, causal=False, config=cfg)
    print("DIFF", T, (cf(q, k, v, cu, wl).float() - f(q, k, v, cu, wl).float()).abs().max().item())
"""


@pytest.mark.slow
def test_policy_schedule_under_torch_compile_dynamic_shapes():
    """schedule="policy" resolves while Dynamo traces with symbolic T (no reason string, no int checks) and
    the compiled call equals eager (Triton interpreter)."""
    if not _triton_installed():
        pytest.skip("triton is not installed — interpreter tests need it")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _POLICY_UNDER_COMPILE], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    diffs = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("DIFF ")]
    assert [d[1] for d in diffs] == ["40", "48"] and all(float(d[2]) == 0.0 for d in diffs), r.stdout


_LEFTOVER_SCRIPT = r"""
import json
import torch
from flamia_pack.kernels.attention import build_attention_work_list
from flamia_pack.kernels.config import AttentionKernelConfig
from flamia_pack.kernels.check import small_test_config
from flamia_pack.kernels.flash_fwd import LOG2E, _fwd_kernel
from flamia_pack.kernels.interpret import patch_triton_interpreter
patch_triton_interpreter()
torch.manual_seed(0)
# merged items (runs of short documents), one-token documents and longer ones, GQA, unaligned end padding
lengths = [40, 1, 3, 2, 1, 1, 25, 5, 1, 33, 4, 4, 1]
T, H, HKV, D = sum(lengths) + 3, 4, 2, 64
cfg = small_test_config()
cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
q, k, v = (torch.randn(T, h, D).to(torch.bfloat16) for h in (H, HKV, HKV))
wl = build_attention_work_list(cu, T, causal=True, config=cfg)
def run(sel, hpp):
    o = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((H, T), float("nan"))
    n_entries = wl.items.shape[0] * H
    _fwd_kernel[(n_entries // hpp,)](q, k, v, o, lse, wl.items, wl.num_items, cu, wl.num_items, len(lengths),
        wl.items.shape[0], H, H // HKV, sel, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), lse.stride(0), D ** -0.5 * LOG2E,
        HEAD_DIM=D, BLOCK_M=32, BLOCK_N=16, F=1, WL_BM=32, CAUSAL=True, PERSISTENT=False, HEAD_MAJOR=True,
        STATIC=False, HEADS_PER_PROGRAM=hpp)
    return o.float(), lse
full_o, full_lse = run(0, 1)
out = {}
for hpp in (1, 2, 4):
    o, lse = run(-1, hpp)
    done = ~torch.isnan(lse)
    rows = done.all(0)
    out[hpp] = dict(rows=rows.nonzero().flatten().tolist(), partial=bool((done.any(0) & ~rows).any()),
                    o_equal=bool(torch.equal(o[rows], full_o[rows])), lse_equal=bool(torch.equal(lse[:, rows], full_lse[:, rows])),
                    rest_untouched=bool(torch.isnan(o[~rows]).all()))
print("RESULTS " + json.dumps(out))
"""


@pytest.mark.slow
def test_leftover_launch_heads_per_program_interpreter(run_interpreter):
    """The forward's leftover launch behind the Gluon programs (``HEADS_PER_PROGRAM`` > 1: one program per
    (entry, chunk of heads)) writes exactly the rows of merged items and one-token documents, for every
    head, bitwise as the one-head-per-program launch and the full launch do, and leaves every other row
    untouched (NaN-poisoned). Triton interpreter."""
    r = run_interpreter(_LEFTOVER_SCRIPT)
    lengths = [40, 1, 3, 2, 1, 1, 25, 5, 1, 33, 4, 4, 1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    one_token = {s for s, n in zip(starts, lengths) if n == 1}
    base = r["1"]
    assert one_token <= set(base["rows"]), base  # every one-token document's row is written
    assert not set(range(40)) & set(base["rows"]), base  # the 40-token document is the Gluon programs' work
    for hpp in ("1", "2", "4"):
        x = r[hpp]
        assert x["rows"] == base["rows"] and not x["partial"], (hpp, x)
        assert x["o_equal"] and x["lse_equal"] and x["rest_untouched"], (hpp, x)


_FILL_TAILS_SCRIPT = r"""
import json, math
import torch
from flamia_pack.errors import FlamiaError
from flamia_pack.kernels import flash_fwd
from flamia_pack.kernels.interpret import patch_triton_interpreter
patch_triton_interpreter()
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
class Count:  # counts the launches of the fill kernel (fill_tails looks the module global up at call time)
    def __init__(self, fn):
        self.fn, self.n = fn, 0
    def __getitem__(self, grid):
        self.n += 1
        return self.fn[grid]
count = Count(flash_fwd._fill_tails_kernel)
flash_fwd._fill_tails_kernel = count
def make(spec):
    # spec: (shape, dtype, token_dim, value, strided): a NaN-poisoned tensor; strided (H, T) = a column slice
    shape, dtype, token_dim, value, strided = spec
    dtype = getattr(torch, dtype)
    if strided:
        x = torch.full((shape[0], shape[1] + 9), float("nan"), dtype=dtype)[:, 3:3 + shape[1]]
    else:
        x = torch.full(shape, float("nan"), dtype=dtype)
    return x, value, token_dim
def check(x, value, token_dim, end, before):
    # bitwise: the padding rows (token index >= end) hold value in x's dtype, everything else its old bits
    want = before.clone()
    if token_dim == 0:
        want[end:] = value
    else:
        want[:, end:] = value
    return bool(torch.equal(x.view(_INT[x.dtype]), want.view(_INT[x.dtype])))
out = {}
cases = {
    # one target: (H, T) fp32 lse with +inf, T not a multiple of the 64-row block, ends inside the last block
    "one_lse": ([((3, 70), "float32", 1, math.inf, False)], 50),
    # two: the forward's pair (bf16 (T, H, D) with 0, fp32 (H, T) with +inf), padding across two blocks
    "two_fwd": ([((130, 4, 80), "bfloat16", 0, 0.0, False), ((4, 130), "float32", 1, math.inf, False)], 61),
    # three, mixed dtypes / token dims / values / T (the grid covers the largest T), strided (H, T)
    "three_mixed": ([((70, 2, 16), "float16", 0, 0.0, False), ((5, 200), "float32", 1, math.inf, True),
                     ((150, 3, 48), "bfloat16", 0, -2.5, False)], 33),
    # the backward's three (bf16, 0.0), no padding at all: nothing changes
    "three_no_pad": ([((96, 2, 32), "bfloat16", 0, 0.0, False)] * 3, 96),
    # the backward's three, cu_seqlens[-1] == 0: every row is padding
    "three_all_pad": ([((65, 2, 32), "bfloat16", 0, 0.0, False), ((65, 2, 32), "float16", 0, 0.0, False),
                       ((65, 2, 32), "float32", 0, 0.0, False)], 0),
    # a skipped tensor (T == 0) between two others: the later ones still filled
    "skip_empty": ([((80, 4), "float32", 0, 1.0, False), ((0, 2, 8), "bfloat16", 0, 0.0, False),
                    ((2, 80), "bfloat16", 1, math.inf, False)], 17),
}
for name, (specs, end) in cases.items():
    targets = [make(s) for s in specs]
    befores = [x.clone() for x, _, _ in targets]
    T = max(x.shape[d] for x, _, d in targets)
    cu = torch.tensor([0, end // 2, end], dtype=torch.int32)
    n0 = count.n
    flash_fwd.fill_tails(targets, cu)
    out[name] = dict(ok=[check(x, v, d, end, b) for (x, v, d), b in zip(targets, befores)], launches=count.n - n0)
# one target, and a call with nothing to fill (no launch)
x = torch.full((70, 3), float("nan"), dtype=torch.bfloat16)
b = x.clone()
n0 = count.n
flash_fwd.fill_tails([(x, 0.0, 0)], torch.tensor([0, 40], dtype=torch.int32))
flash_fwd.fill_tails([(torch.empty(0, 4), 0.0, 0), (torch.empty(4, 0), math.inf, 1)], torch.tensor([0, 0], dtype=torch.int32))
out["wrapper"] = dict(ok=[check(x, 0.0, 0, 40, b)], launches=count.n - n0)
try:
    flash_fwd.fill_tails([(x, 0.0, 0)] * 4, torch.tensor([0, 40], dtype=torch.int32))
    out["four_raises"] = False
except FlamiaError:
    out["four_raises"] = True
# one fill launch per forward and one per backward
from flamia_pack.kernels import varlen_attention
from flamia_pack.kernels.config import AttentionKernelConfig
from flamia_pack.kernels.check import small_test_config
for atomic in (False,):
    torch.manual_seed(0)
    T, end = 45, 38
    q, k, v = (torch.randn(T, 2, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 20, end], dtype=torch.int32)
    cfg = small_test_config()
    n0 = count.n
    o = varlen_attention(q, k, v, cu, 20, causal=True, config=cfg)
    n1 = count.n
    o.float().sum().backward()
    pad_ok = bool((o[end:] == 0).all()) and all(bool((g[end:] == 0).all()) for g in (q.grad, k.grad, v.grad))
    out[f"attention_atomic{int(atomic)}"] = dict(fwd=n1 - n0, bwd=count.n - n1, pad_ok=pad_ok)
# a row without row-end padding (cu_seqlens[-1] == T): the call's own cu_seqlens check knows it and no fill
# launches; a work list built without validation carries no hint, so the fills run (and write nothing):
# bitwise the same results
from flamia_pack.kernels.config import work_list_tile_config
from flamia_pack.scheduler.worklist import build_work_list
cfg = small_test_config()
torch.manual_seed(1)
T = 38
xs = [torch.randn(T, 2, 64).to(torch.bfloat16) for _ in range(3)]
cu = torch.tensor([0, 20, T], dtype=torch.int32)
res = {}
for how in ("hint", "no_hint", "validated_list"):
    leaves = [x.clone().requires_grad_() for x in xs]
    wl = None if how == "hint" else build_work_list(cu, T, work_list_tile_config(cfg, True), validate=how != "no_hint")
    n0 = count.n
    o = varlen_attention(*leaves, cu, 20, causal=True, config=cfg, work_list=wl)
    n1 = count.n
    o.float().sum().backward()
    res[how] = dict(launches=[n1 - n0, count.n - n1], t=[o] + [x.grad for x in leaves])
out["no_tail"] = {h: r["launches"] for h, r in res.items()}
out["no_tail_same"] = all(torch.equal(a, b) for h in ("no_hint", "validated_list")
                          for a, b in zip(res["hint"]["t"], res[h]["t"]))
print("RESULTS " + json.dumps(out))
"""


@pytest.mark.slow
def test_fill_tails_one_launch_interpreter(run_interpreter):
    """``fill_tails`` fills, in ONE launch, exactly the row-end padding rows (``>= cu_seqlens[-1]``) of 1-3
    NaN-poisoned tensors of mixed dtypes (bf16 / fp16 / fp32), token dims ((T, ...) and (H, T), strided),
    values (0, +inf, others) and lengths, bitwise, and leaves every other element NaN; no padding changes
    nothing; skipped (empty) tensors launch nothing; 4 targets raise. The forward and the backward (atomic
    dQ or not) each launch the fill kernel once, and not at all on a row the host knows has no padding
    (``attention.PAD_TAIL``). Triton interpreter."""
    r = run_interpreter(_FILL_TAILS_SCRIPT)
    for name, n in (("one_lse", 1), ("two_fwd", 2), ("three_mixed", 3), ("three_no_pad", 3), ("three_all_pad", 3),
                    ("skip_empty", 3)):
        assert r[name]["ok"] == [True] * n and r[name]["launches"] == 1, (name, r[name])
    assert r["wrapper"] == dict(ok=[True], launches=1), r["wrapper"]
    assert r["four_raises"] is True
    for atomic in (0,):
        assert r[f"attention_atomic{atomic}"] == dict(fwd=1, bwd=1, pad_ok=True), (atomic, r[f"attention_atomic{atomic}"])
    # no row-end padding, known on the host (the call's cu_seqlens check, or a validated work list): no fill
    # launch; unknown (a list built without validation): the fills run; the results are bitwise the same
    assert r["no_tail"] == {"hint": [0, 0], "no_hint": [1, 1], "validated_list": [0, 0]}, r["no_tail"]
    assert r["no_tail_same"] is True
