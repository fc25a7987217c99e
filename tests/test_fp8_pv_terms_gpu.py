"""The GPU path of two-term P~ and V (``varlen_attention(precision="fp8", qk_terms=2, pv_terms=2)``): V's residual
codes from the quantizer in both layouts (also on the CPU, in Triton's interpreter), both kernels against the CPU
emulation, accuracy against fp64 over ``qk_terms=2`` alone, NaN containment, determinism and the leak probe."""
import pytest
import torch

from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd
from flamia_pack.quant import quantize_token_blocks, residual_codes

_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _row(seed, lens, heads, D=128, outliers=True, pad=3):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens) + pad
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((T, heads[0], D), generator=g).bfloat16()
    k, v = (torch.randn((T, heads[1], D), generator=g).bfloat16() for _ in range(2))
    if outliers:
        k[:, :, [3, 17, 40, 59]] *= 20
    do = torch.randn(q.shape, generator=g).bfloat16()
    return q, k, v, do, cu


def _kernels_or_skip():
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("gran", ["block", "token"])
def test_quantizer_writes_v_residual_codes_in_both_layouts(gran, device):
    """``quantize_qkv(residual=(.., .., True), residual_transposed=(.., .., True), wgmma_order=(.., .., True))``: V's
    residual codes bitwise ``quant.residual_codes`` (NaN codes in a non-finite group), V_lo^T their feature-major
    copy in the wgmma order (the forward's B operand, as V^T), K_lo^T still in token order."""
    from flamia_pack.kernels.quantize import quantize_qkv, to_wgmma_order

    q, k, v, _, cu = _row(31, lens=(300, 1, 77, 130), heads=(2, 1))
    v[200, 0, 3] = float("inf")
    v[90] = 0
    args = [x.to(device) for x in (q, k, v)]
    qq, kq, vq = quantize_qkv(*args, cu.to(device), gran, transposed=(True, True, True),
                              wgmma_order=(True, False, True), transposed_store="triton", check_finite=False,
                              residual=True, residual_transposed=(False, True, True),
                              hw_cvt=None if device == "cuda" else False)
    T = v.shape[0]
    tp = -(-T // 16) * 16
    want = residual_codes(v, quantize_token_blocks(v, cu, gran, check_finite=False)).view(torch.uint8)
    assert torch.equal(vq.codes_lo.cpu().view(torch.uint8), want)
    assert int((want == 0x7F).sum()) >= 32  # the non-finite group's NaN codes
    vt = torch.nn.functional.pad(want.permute(1, 2, 0), (0, tp - T))
    assert torch.equal(vq.codes_lo_t.cpu().view(torch.uint8), to_wgmma_order(vt))
    assert vq.codes_lo_t.shape == vq.codes_t.shape and vq.codes_lo_t.stride() == vq.codes_t.stride()
    assert torch.equal(kq.codes_lo_t.cpu().view(torch.uint8), kq.codes_lo.cpu().view(torch.uint8).permute(1, 2, 0))


def _grads(q, k, v, do, cu, **kw):
    from flamia_pack import varlen_attention

    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = varlen_attention(*x, cu, int((cu[1:] - cu[:-1]).max()), precision="fp8", qk_terms=2, **kw)
    o.backward(do)
    return [o.detach(), *(t.grad for t in x)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads, D, causal", [((4, 4), 128, True), ((4, 2), 128, True), ((4, 2), 64, True),
                                              ((4, 1), 128, False)])
def test_gpu_pv_terms_match_the_emulation_and_beat_qk_terms_alone(heads, D, causal):
    """``varlen_attention(precision="fp8", qk_terms=2, pv_terms=2)`` on the GPU (the quantizer's V residual codes,
    the forward's three P~V products, the backward's two dP products) against the CPU emulation of the same call
    (O cosine > 0.9999, gradients > 0.999), finite, and closer to exact fp64 attention than ``pv_terms=1`` in O, dQ
    and dK, on unaligned documents with outlier channels, GQA and row-end padding."""
    _kernels_or_skip()
    q, k, v, do, cu = _row(D + heads[1], lens=(700, 1, 300, 1024), heads=heads, D=D, pad=5)
    n = int(cu[-1])
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu.long(), causal=causal, return_lse=True,
                                            compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu.long(), causal=causal,
                                         compute_dtype=torch.float64)
    exact = [o_ref[:n], *(x[:n] for x in ref)]

    def run(device, pv_terms):
        got = _grads(*(t.to(device) for t in (q, k, v, do, cu)), causal=causal, pv_terms=pv_terms)
        return [x.cpu()[:n] for x in got]

    gpu, cpu, one = run("cuda", 2), run("cpu", 2), run("cuda", 1)
    assert all(torch.isfinite(x).all() for x in gpu)
    assert _cos(gpu[0], cpu[0]) > 0.9999
    assert min(_cos(a, b) for a, b in zip(gpu[1:], cpu[1:])) > 0.999
    for i in (0, 1, 2):  # O, dQ, dK
        assert _cos(gpu[i], exact[i]) > _cos(one[i], exact[i]), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pv_terms_nan_stays_in_its_document():
    """A NaN / Inf in one document (so NaN codes in V's residual too, zeroed in the neighbours' tiles) leaves the other
    documents' O bitwise and their gradients (dQ's reduce order aside) as without it."""
    _kernels_or_skip()
    q, k, v, do, cu = (t.cuda() for t in _row(5, lens=(500, 600, 400), heads=(2, 2), outliers=False, pad=0))
    clean = _grads(q, k, v, do, cu, pv_terms=2)
    q[700, 0, 3] = float("nan")
    k[650, 1, 9] = float("nan")
    v[505, 0, 7] = float("inf")  # the group at the document's start: the previous document's last tile reads it
    v[1090, 1, 2] = float("nan")  # and at its end: the next document's first tile
    dirty = _grads(q, k, v, do, cu, pv_terms=2)
    keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep[500:1100] = False
    assert torch.equal(dirty[0][keep], clean[0][keep])
    assert not torch.isfinite(dirty[0][500:1100]).all()
    for a, b in zip(dirty[1:], clean[1:]):
        assert torch.isfinite(a[keep]).all()
        torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gran", ["token", "block"])
def test_gpu_pv_terms_deterministic_and_leak_probe(gran):
    """``deterministic=True`` repeats bitwise; the leak probe (dO fixed): changing q, k, v after a cut inside a
    document leaves O and dQ before it bitwise unchanged in "token" mode, and before the cut's 32-token group in
    "block" mode; the other documents' O, dQ, dK, dV bitwise unchanged in both."""
    _kernels_or_skip()
    q, k, v, do, cu = (t.cuda() for t in _row(9, lens=(500, 600, 400), heads=(2, 2), outliers=False, pad=0))
    cut = 733  # document 1 is [500, 1100); its 32-token group holding the cut starts at 724
    a = _grads(q, k, v, do, cu, pv_terms=2, scale_granularity=gran, deterministic=True)
    again = _grads(q, k, v, do, cu, pv_terms=2, scale_granularity=gran, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[cut:1100] = (torch.randn_like(t[cut:1100].float()) * 4).bfloat16()
    b = _grads(q2, k2, v2, do, cu, pv_terms=2, scale_granularity=gran, deterministic=True)
    safe = cut if gran == "token" else 724
    assert torch.equal(a[0][:safe], b[0][:safe]) and torch.equal(a[1][:safe], b[1][:safe])
    assert not torch.equal(a[0][cut:1100], b[0][cut:1100])
    other = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    other[500:1100] = False
    for x, y in zip(a, b):
        assert torch.equal(x[other], y[other])
