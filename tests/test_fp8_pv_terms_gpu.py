"""The GPU path of two-term P~ and V (``varlen_attention(precision="fp8", qk_terms=2, pv_terms=2)``): V's residual
codes from the quantizer in both layouts (also on the CPU, in Triton's interpreter), both kernels against the CPU
emulation, accuracy against fp64 over ``qk_terms=2`` alone (NaN containment, determinism and the leak probe with
``pv_terms=2``: ``test_fp8_two_term.py``'s GPU tests, parametrized)."""
import pytest
import torch

from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd
from flamia_pack.quant import quantize_token_blocks, residual_codes
from test_fp8_two_term import _two_term_grads  # the two-term call with its gradients (tests/ is on the path)

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
        got = _two_term_grads(*(t.to(device) for t in (q, k, v, do, cu)), causal=causal, pv_terms=pv_terms)
        return [x.cpu()[:n] for x in got]

    gpu, cpu, one = run("cuda", 2), run("cpu", 2), run("cuda", 1)
    assert all(torch.isfinite(x).all() for x in gpu)
    assert _cos(gpu[0], cpu[0]) > 0.9999
    assert min(_cos(a, b) for a, b in zip(gpu[1:], cpu[1:])) > 0.999
    for i in (0, 1, 2):  # O, dQ, dK
        assert _cos(gpu[i], exact[i]) > _cos(one[i], exact[i]), i
