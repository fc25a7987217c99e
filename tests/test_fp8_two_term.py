"""The FP8 emulation's two-term Q / K mode (``qk_terms=2``: each of Q and K an E4M3 code plus an E4M3 residual code
on the same exponent; S from three FP8 products): residual codes, exact scores, accuracy against fp64, the
autograd wrapper, causality, errors (CPU)."""
import dataclasses

import pytest
import torch

from flamia_pack import FlamiaError
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward, fp8_varlen_attention_emulated, scores
from flamia_pack.kernels.fp8_emulation_bwd import fp8_attention_backward
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd
from flamia_pack.quant import UE8M0_BIAS, quantize_token_blocks, residual_codes


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _row(seed, lens=(300, 1, 211, 400), outliers=True, heads=(2, 1)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens) + 3  # row-end padding
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q = torch.randn((T, heads[0], 128), generator=g).bfloat16()
    k, v = (torch.randn((T, heads[1], 128), generator=g).bfloat16() for _ in range(2))
    if outliers:
        k[:, :, [5, 17, 40, 99]] *= 20
    return q, k, v, cu


def test_residual_codes_capture_what_the_codes_leave_out():
    q, k, _, cu = _row(0)
    qz = quantize_token_blocks(k, cu, "block")
    lo = residual_codes(k, qz)
    y = k.double() * torch.exp2(-(qz.exponents.double() - UE8M0_BIAS))[..., None]
    hi = qz.codes.double()
    err1, err2 = (y - hi).abs(), (y - hi - lo.double()).abs()
    assert lo.dtype == torch.float8_e4m3fn and lo.shape == k.shape
    assert float(lo.double().abs().max()) <= 16.0  # half a code ulp at the top binade
    assert torch.all(err2 <= err1) and float(err2.sum()) < float(err1.sum()) / 8
    # the residual is the E4M3 rounding of an exact difference: its own error is at most half its ulp
    assert torch.all(err2 <= (y - hi).abs() * 2.0 ** -4 + 2.0 ** -10)
    bad = k.clone()
    bad[7, 0, 3] = float("nan")
    qb = quantize_token_blocks(bad, cu, "block", check_finite=False)
    assert torch.isnan(residual_codes(bad, qb)[7].float()).all()  # the NaN group's residual is NaN


def test_two_term_scores_are_the_three_products_rounded_once():
    g = torch.Generator().manual_seed(1)
    q, k = ((torch.randn((1, 40, 128), generator=g) * 30).to(torch.float8_e4m3fn).double() for _ in range(2))
    ql, kl = (torch.randn((1, 40, 128), generator=g).to(torch.float8_e4m3fn).double() for _ in range(2))
    e = torch.zeros((1, 40), dtype=torch.int32)
    qk = torch.tensor(0.125, dtype=torch.float32)
    got = scores(q, e, k, e, qk, ql, kl)
    exact = q[0] @ k[0].T + q[0] @ kl[0].T + ql[0] @ k[0].T  # fp64: exact for E4M3 codes
    assert torch.equal(got[0], exact.float() * qk)
    assert torch.equal(scores(q, e, k, e, qk), scores(q, e, k, e, qk, None, None))


@pytest.mark.parametrize("outliers", [False, True])
def test_two_terms_reach_the_issues_cosines_where_one_term_does_not(outliers):
    """Issues 27 / 28 ask cos(O) >= 0.9990 and dQ / dK / dV >= 0.9980 / 0.9980 / 0.9985 against fp32, on N(0, 1)
    and with four K channels x 20. One term misses them (E4M3 rounding of Q and K); two terms meet them here."""
    q, k, v, cu = _row(2, outliers=outliers)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse_ref = packed_attention_reference(qd, kd, vd, cu, return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse_ref, cu, compute_dtype=torch.float64)
    got = {}
    for terms in (1, 2):
        o, lse = fp8_attention_forward(q, k, v, cu, qk_terms=terms)
        grads = fp8_attention_backward(do, q, k, v, o, lse, cu, qk_terms=terms)
        got[terms] = [_cos(o, o_ref)] + [_cos(a, r) for a, r in zip(grads, ref)]
    assert all(x >= t for x, t in zip(got[2], (0.9990, 0.9980, 0.9980, 0.9985))), got
    assert all(b > a for a, b in zip(got[1], got[2])), got
    if outliers:
        assert got[1][0] < 0.9990 and got[1][1] < 0.9980, got  # one term misses there


def test_autograd_wrapper_is_the_forward_and_backward():
    q, k, v, cu = _row(4, lens=(200, 70))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    o, lse = fp8_attention_forward(q, k, v, cu, qk_terms=2)
    grads = fp8_attention_backward(do, q, k, v, o, lse, cu, qk_terms=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    oa = fp8_varlen_attention_emulated(*leaves, cu, qk_terms=2)
    oa.backward(do)
    assert torch.equal(oa, o)
    assert all(torch.equal(x.grad, g) for x, g in zip(leaves, grads))
    assert not torch.equal(o, fp8_attention_forward(q, k, v, cu)[0])  # the mode changes the bits


def test_two_terms_keep_token_mode_causal():
    q, k, v, cu = _row(6, lens=(500,), outliers=False)
    cut = 233
    k2, v2 = k.clone(), v.clone()
    k2[cut:500] = torch.randn_like(k2[cut:500].float()).bfloat16() * 40
    v2[cut:500] = -v2[cut:500]
    a, _ = fp8_attention_forward(q, k, v, cu, scale_granularity="token", qk_terms=2)
    b, _ = fp8_attention_forward(q, k2, v2, cu, scale_granularity="token", qk_terms=2)
    assert torch.equal(a[:cut], b[:cut]) and not torch.equal(a[cut:500], b[cut:500])


def test_two_term_errors():
    q, k, v, cu = _row(7, lens=(64,))
    for bad in (0, 3, True, "2", 2.0):
        with pytest.raises(FlamiaError, match="qk_terms must be 1"):
            fp8_attention_forward(q, k, v, cu, qk_terms=bad)
    quant = tuple(quantize_token_blocks(x, cu, "block") for x in (q, k, v))
    with pytest.raises(FlamiaError, match="not quantized="):
        fp8_attention_forward(None, None, None, cu, quantized=quant, qk_terms=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gran", ["block", "token"])
def test_gpu_forward_kernel_with_two_terms_matches_the_emulation(causal, gran):
    """``gluon_fp8_fwd(qc_lo=, kc_lo=)`` (three FP8 products for S) against the emulation's ``qk_terms=2`` forward on
    unaligned rows with GQA, row-end padding and outlier channels (``fp8_two_term_probe.lse_ok``: O cosine > 0.9999,
    LSE within 1.5x of one term's kernel-to-emulation gap, and closer to fp64 than one term in O and LSE)."""
    import os
    import sys

    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    from fp8_two_term_probe import forward_errors, lse_ok

    q, k, v, cu = (x.cuda() for x in _row(9, lens=(300, 1, 77, 700, 129), heads=(4, 2)))
    r = forward_errors(q, k, v, cu.to(torch.int32), causal, gran)
    assert lse_ok(r), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_backward_kernel_with_two_terms_matches_the_emulation():
    """``gluon_fp8_bwd(qc_lo=, kc_lo=, kt_lo=)`` (S^T three products, the dQ partial two) after the two-term forward
    kernel, against the emulation's ``qk_terms=2`` backward: dQ / dK / dV cosine > 0.999, finite."""
    import os
    import sys

    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    from fp8_two_term_probe import run_backward

    q, k, v, cu = (x.cuda() for x in _row(10, lens=(300, 1, 77, 700, 129), heads=(4, 2)))
    cu = cu.to(torch.int32)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).bfloat16().cuda()
    n = int(cu[-1])
    _, _, dq, dk, dv = run_backward(q, k, v, do, cu, True)
    oe, lsee = fp8_attention_forward(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), qk_terms=2)
    ref = fp8_attention_backward(do.cpu(), q.cpu(), k.cpu(), v.cpu(), oe, lsee, cu.cpu(), qk_terms=2)
    for got, want in zip((dq, dk, dv), ref):
        assert torch.isfinite(got[:n]).all()
        assert _cos(got[:n].cpu(), want[:n]) > 0.999


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("gran, rotate", [("block", False), ("token", False), ("block", True)])
def test_quantizer_writes_the_residual_codes_bitwise(gran, rotate, device):
    """``quantize_qkv(residual=, residual_transposed=)`` (the GPU path's quantizer; on the CPU in Triton's
    interpreter): Q's and K's residual codes bitwise ``quant.residual_codes`` of the reference codes (the hardware
    convert on CUDA, the integer encoder on the CPU), NaN codes in a non-finite group, zero, tiny and outlier rows
    included; K_lo^T the token-order copy; V gets none; the main codes unchanged by the second pass."""
    from flamia_pack.kernels.qk_rotation import rotate_qk
    from flamia_pack.kernels.quantize import quantize_qkv

    q, k, v, cu = _row(21, lens=(300, 1, 77, 130), heads=(2, 1))
    q[40, 1, 7] = float("nan")
    k[200, 0, 3] = float("inf")
    q[90] = 0
    k[10] *= 1e-30  # subnormal residuals
    args = [x.to(device) for x in (q, k, v)]
    qq, kq, vq = quantize_qkv(*args, cu.to(device), gran, transposed=(True, True, True),
                              wgmma_order=(False, False, True), transposed_store="triton", check_finite=False,
                              rotate_qk=rotate, residual=(True, True, False),
                              residual_transposed=(False, True, False), hw_cvt=None if device == "cuda" else False)
    plain = quantize_qkv(*args, cu.to(device), gran, transposed=(True, True, True), wgmma_order=(False, False, True),
                         transposed_store="triton", check_finite=False, rotate_qk=rotate,
                         hw_cvt=None if device == "cuda" else False)
    qr, kr = rotate_qk(q, k) if rotate else (q, k)
    for x, o, p in ((qr, qq, plain[0]), (kr, kq, plain[1])):
        ref = quantize_token_blocks(x, cu, gran, check_finite=False)
        want = residual_codes(x, ref).view(torch.uint8)
        assert torch.equal(o.codes_lo.cpu().view(torch.uint8), want)
        assert torch.equal(o.codes.cpu().view(torch.uint8), p.codes.cpu().view(torch.uint8))
        assert torch.equal(o.codes_t.cpu().view(torch.uint8), p.codes_t.cpu().view(torch.uint8))
    subnormal = ((want & 0x78) == 0) & ((want & 0x07) != 0)  # exponent field 0, mantissa not: E4M3 subnormals
    assert int((want == 0x7F).sum()) >= 128 and int(subnormal.sum()) > 0
    assert torch.equal(kq.codes_lo_t.cpu().view(torch.uint8), kq.codes_lo.cpu().view(torch.uint8).permute(1, 2, 0))
    assert qq.codes_lo_t is None and vq.codes_lo is None and vq.codes_lo_t is None
    with pytest.raises(FlamiaError, match="residual_transposed transposes the residual codes"):
        quantize_qkv(*args, cu.to(device), gran, residual_transposed=True)
    with pytest.raises(FlamiaError, match="not 'kernel'"):
        quantize_qkv(*args, cu.to(device), gran, transposed=True, transposed_store="kernel", residual=True,
                     residual_transposed=True)
    with pytest.raises(FlamiaError, match="residual must be a bool or 3 bools"):
        quantize_qkv(*args, cu.to(device), gran, residual=(True, True))


def test_varlen_attention_two_terms_on_the_cpu_is_the_emulation():
    """``varlen_attention(precision="fp8", qk_terms=2)`` off the GPU runs the emulation's ``qk_terms=2`` (bitwise),
    is closer to fp64 than one term on outlier channels, differentiates, and refuses bad values and BF16."""
    import numpy as np

    from flamia_pack import varlen_attention

    q, k, v, cu = _row(22, lens=(300, 1, 211), heads=(2, 1))
    n = int(cu[-1])
    cu = cu.to(torch.int32)
    o2 = varlen_attention(q, k, v, cu, 300, precision="fp8", qk_terms=2)
    o1 = varlen_attention(q, k, v, cu, 300, precision="fp8")
    oe, _ = fp8_attention_forward(q, k, v, cu, qk_terms=2)
    ref = packed_attention_reference(q.double(), k.double(), v.double(), cu.long(), compute_dtype=torch.float64)
    assert torch.equal(o2, oe)
    assert _cos(o2[:n], ref[:n]) > 0.9995 > _cos(o1[:n], ref[:n])
    assert torch.equal(varlen_attention(q, k, v, cu, 300, precision="fp8", qk_terms=np.int64(2)), o2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    varlen_attention(*leaves, cu, 300, precision="fp8", qk_terms=2, qk_rotation="hadamard").float().sum().backward()
    assert all(torch.isfinite(x.grad).all() and x.grad[:n].abs().sum() > 0 for x in leaves)
    for bad in (0, 3, True, "2", 2.0, None):
        with pytest.raises(FlamiaError, match="qk_terms must be 1"):
            varlen_attention(q, k, v, cu, 300, precision="fp8", qk_terms=bad)
    with pytest.raises(FlamiaError, match="qk_terms=2 applies to precision='fp8'"):
        varlen_attention(q, k, v, cu, 300, qk_terms=2)


@pytest.mark.parametrize("name", ["qk_terms", "pv_terms"])
def test_transformers_options_carry_the_term_counts(name):
    pytest.importorskip("transformers")
    from flamia_pack.integrations.transformers import FlamiaAttentionOptions, _varlen_call_kwargs

    assert name not in _varlen_call_kwargs(FlamiaAttentionOptions(precision="fp8"))
    assert _varlen_call_kwargs(FlamiaAttentionOptions(precision="fp8", **{name: 2}))[name] == 2
    kw = _varlen_call_kwargs(FlamiaAttentionOptions(precision="fp8", qk_terms=2, pv_terms=2))
    assert kw["qk_terms"] == 2 and kw["pv_terms"] == 2
    assert name not in _varlen_call_kwargs(FlamiaAttentionOptions(precision="bf16", **{name: 2}))
    with pytest.raises(FlamiaError, match=f"{name} must be 1"):
        FlamiaAttentionOptions(**{name: 3})
    import json

    import numpy as np

    opts = FlamiaAttentionOptions(precision="fp8", **{name: np.int64(2)})  # stored as a plain int: saves as JSON
    assert type(getattr(opts, name)) is int and json.loads(json.dumps(dataclasses.asdict(opts)))[name] == 2


@pytest.mark.parametrize("name", ["qk_terms", "pv_terms"])
def test_set_options_and_stored_bad_term_counts_name_the_config(name):
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from flamia_pack.integrations.transformers import _CONFIG_ATTR, get_options, set_options

    model = SimpleNamespace(config=SimpleNamespace())
    assert getattr(set_options(model, precision="fp8", **{name: 2}), name) == 2
    assert getattr(model.config, _CONFIG_ATTR)[name] == 2 and getattr(get_options(model), name) == 2
    model = SimpleNamespace(config=SimpleNamespace(**{_CONFIG_ATTR: {name: 2.0}}))
    with pytest.raises(FlamiaError, match=f"config.{_CONFIG_ATTR} holds an invalid option: {name} must be 1"):
        get_options(model)


def test_fp8_emulation_nan_message_does_not_offer_check_finite():
    """On the CPU, precision="fp8" runs the emulation, which needs finite inputs: the NaN error says so instead of
    suggesting ``check_finite=False`` (which would only move the error); BF16 keeps the suggestion."""
    from flamia_pack import varlen_attention

    q, k, v, cu = _row(23, lens=(64, 64), heads=(1, 1))
    q[70, 0, 3] = float("nan")
    with pytest.raises(FlamiaError, match="runs the FP8 emulation, which needs finite inputs"):
        varlen_attention(q, k, v, cu.to(torch.int32), 64, precision="fp8", qk_terms=2)
    with pytest.raises(FlamiaError, match="check_finite=False skips this check"):
        varlen_attention(q, k, v, cu.to(torch.int32), 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads, D, rotation", [((4, 4), 128, None), ((4, 2), 128, None), ((4, 2), 64, None),
                                                ((4, 1), 128, "hadamard")])
def test_gpu_varlen_attention_two_terms_matches_the_emulation_and_beats_one_term(heads, D, rotation):
    """``varlen_attention(precision="fp8", qk_terms=2)`` on the GPU (the quantizer's residual codes, both kernels)
    against the CPU emulation of the same call (O cosine > 0.9999, gradients > 0.999), finite, and on outlier
    channels closer to exact fp64 attention than one term in O, dQ and dK."""
    from flamia_pack import varlen_attention
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")
    lens = (700, 1, 300, 1024)
    g = torch.Generator().manual_seed(D + heads[1])
    T = sum(lens) + 5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((T, heads[0], D), generator=g).bfloat16()
    k, v = (torch.randn((T, heads[1], D), generator=g).bfloat16() for _ in range(2))
    k[:, :, [3, 17, 40, 59]] *= 20
    do = torch.randn(q.shape, generator=g).bfloat16()
    n = int(cu[-1])
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu.long(), return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu.long(), compute_dtype=torch.float64)

    def run(device, terms):
        leaves = [t.to(device).clone().requires_grad_() for t in (q, k, v)]
        o = varlen_attention(*leaves, cu.to(device), max(lens), precision="fp8", qk_terms=terms, qk_rotation=rotation)
        o.backward(do.to(device))
        return [x.detach().cpu()[:n] for x in (o, *(t.grad for t in leaves))]

    gpu, cpu, one = run("cuda", 2), run("cpu", 2), run("cuda", 1)
    assert all(torch.isfinite(x).all() for x in gpu)
    assert _cos(gpu[0], cpu[0]) > 0.9999
    assert min(_cos(a, b) for a, b in zip(gpu[1:], cpu[1:])) > 0.999
    exact = [o_ref[:n], *(x[:n] for x in ref)]
    for i in (0, 1, 2):  # O, dQ, dK
        assert _cos(gpu[i], exact[i]) > _cos(one[i], exact[i]), i


def _gpu_two_term_inputs(lens, H, Hkv, seed):
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    from fp8_bwd_probe import _inputs

    return _inputs(lens, H, Hkv, seed=seed)


def _two_term_grads(q, k, v, do, cu, **kw):
    from flamia_pack import varlen_attention

    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = varlen_attention(*x, cu, int((cu[1:] - cu[:-1]).max()), precision="fp8", qk_terms=2, **kw)
    o.backward(do)
    return [o.detach(), *(t.grad for t in x)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pv_terms", [1, 2])
def test_gpu_two_terms_nan_stays_in_its_document(pv_terms):
    """A NaN / Inf in one document (Q's, K's and V's codes, so NaN residual codes too) leaves the other documents'
    O bitwise and their gradients (dQ's reduce order aside) as without it, with two terms (``pv_terms=2``: V's
    residual codes too, zeroed in the neighbours' tiles: the groups at the document's start and end)."""
    q, k, v, do, cu = _gpu_two_term_inputs([500, 600, 400], 2, 2, seed=5)
    clean = _two_term_grads(q, k, v, do, cu, pv_terms=pv_terms)
    q[700, 0, 3] = float("nan")
    k[650, 1, 9] = float("nan")
    v[720, 0, 7] = float("inf")
    v[505, 0, 7] = float("inf")  # the previous document's last tile reads this group's columns
    v[1090, 1, 2] = float("nan")  # and the next document's first tile this one's
    dirty = _two_term_grads(q, k, v, do, cu, pv_terms=pv_terms)
    keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep[500:1100] = False
    assert torch.equal(dirty[0][keep], clean[0][keep])
    assert not torch.isfinite(dirty[0][500:1100]).all()
    for a, b in zip(dirty[1:], clean[1:]):
        assert torch.isfinite(a[keep]).all()
        torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_terms_capture_in_cuda_graphs():
    """With two terms the public forward call (prebuilt work list) and the backward on saved codes capture in CUDA
    graphs: replays give the eager bits (forward) and the eager gradients up to dQ's reduce order."""
    from flamia_pack import varlen_attention
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_attention_forward, fp8_quantize
    from flamia_pack.kernels.fp8_backward import fp8_backward

    q, k, v, do, cu = _gpu_two_term_inputs([700, 300, 24], 4, 2, seed=7)
    wl = build_fp8_work_list(cu, q.shape[0])
    o = varlen_attention(q, k, v, cu, 700, precision="fp8", qk_terms=2, work_list=wl)
    out = torch.empty_like(o)
    s = torch.cuda.Stream()  # warm-up on a side stream, as torch's graph capture asks
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(varlen_attention(q, k, v, cu, 700, precision="fp8", qk_terms=2, work_list=wl))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(varlen_attention(q, k, v, cu, 700, precision="fp8", qk_terms=2, work_list=wl))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o)

    ops = fp8_quantize(q, k, v, cu, "block", backward=True, qk_terms=2)
    assert ops.qc_lo is not None and ops.kc_lo is not None and ops.kt_lo is not None
    o2, lse = fp8_attention_forward(ops, cu, work_list=wl)
    assert torch.equal(o2, o)
    kw = dict(causal=True, softmax_scale=128 ** -0.5, entries=wl.bwd_entries)
    eager = fp8_backward(do, ops, o2, lse, cu, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = fp8_backward(do, ops, o2, lse, cu, **kw)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(grads, eager):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_terms_deterministic_and_under_torch_compile():
    """``deterministic=True`` with two terms repeats bitwise; a function calling it compiles with torch.compile and
    gives the eager gradients."""
    from flamia_pack import varlen_attention

    q, k, v, do, cu = _gpu_two_term_inputs([700, 300], 4, 2, seed=8)
    a = _two_term_grads(q, k, v, do, cu, deterministic=True)
    b = _two_term_grads(q, k, v, do, cu, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    def f(q, k, v):
        return varlen_attention(q * 1.0, k, v, cu, 700, precision="fp8", qk_terms=2).float().square().sum()

    def grads(fn):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        fn(*x).backward()
        return [t.grad for t in x]

    for x, y in zip(grads(torch.compile(f)), grads(f)):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gran", ["token", "block"])
@pytest.mark.parametrize("pv_terms", [1, 2])
def test_gpu_two_terms_leak_probe(gran, pv_terms):
    """Issue 27 / 28's leak probe on the GPU path with two terms (and ``pv_terms=2``: P~ and V too; deterministic
    dQ, repeated bitwise; dO fixed): changing q, k, v after a cut inside a document leaves O and dQ before it bitwise
    unchanged in "token" mode, and before the cut's 32-token group in "block" mode; the other documents' O, dQ, dK,
    dV bitwise unchanged in both."""
    q, k, v, do, cu = _gpu_two_term_inputs([500, 600, 400], 2, 2, seed=9)
    cut = 733  # document 1 is [500, 1100); its 32-token group holding the cut starts at 724
    a = _two_term_grads(q, k, v, do, cu, scale_granularity=gran, deterministic=True, pv_terms=pv_terms)
    again = _two_term_grads(q, k, v, do, cu, scale_granularity=gran, deterministic=True, pv_terms=pv_terms)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[cut:1100] = (torch.randn_like(t[cut:1100].float()) * 4).bfloat16()
    b = _two_term_grads(q2, k2, v2, do, cu, scale_granularity=gran, deterministic=True, pv_terms=pv_terms)
    safe = cut if gran == "token" else 724
    assert torch.equal(a[0][:safe], b[0][:safe]) and torch.equal(a[1][:safe], b[1][:safe])
    assert not torch.equal(a[0][cut:1100], b[0][cut:1100])  # the change reached the rows it may reach
    other = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    other[500:1100] = False
    for x, y in zip(a, b):
        assert torch.equal(x[other], y[other])
