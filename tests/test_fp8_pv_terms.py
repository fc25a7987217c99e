"""The FP8 emulation's two-term P~ / V mode (``pv_terms=2``: V an E4M3 code plus an E4M3 residual code on the same
exponent, the folded P~ two codes; the forward's P~V from three FP8 products ``lo.V + hi.V_lo + hi.V``, the backward's
dP from ``dO (V + V_lo)^T``): the split, a hand-built one-tile reference under each accumulator model, accuracy against
fp64, the autograd wrapper, causality, errors and the public plumbing (CPU)."""

import pytest
import torch

from flamia_pack import FlamiaError
from flamia_pack.kernels.fp8_emulation import (DEFAULT_BOOST_LOG2, fp8_attention_forward, fp8_varlen_attention_emulated,
                                               mma_model, pow2, qk_scale_f32, scores, split_e4m3)
from flamia_pack.kernels.fp8_emulation_bwd import fp8_attention_backward
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd
from flamia_pack.quant import UE8M0_BIAS, quantize_token_blocks, residual_codes


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _row(seed, lens=(300, 1, 211, 400), outliers=True, heads=(2, 1)):
    """tests/test_fp8_two_term.py's row: N(0, 1) bf16, row-end padding, optionally four K channels x 20."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens) + 3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q = torch.randn((T, heads[0], 128), generator=g).bfloat16()
    k, v = (torch.randn((T, heads[1], 128), generator=g).bfloat16() for _ in range(2))
    if outliers:
        k[:, :, [5, 17, 40, 99]] *= 20
    return q, k, v, cu


def _exact(q, k, v, cu, do):
    qd, kd, vd = (t.double() for t in (q, k, v))
    o, lse = packed_attention_reference(qd, kd, vd, cu, return_lse=True, compute_dtype=torch.float64)
    return [o, *packed_attention_reference_bwd(do.double(), qd, kd, vd, o, lse, cu, compute_dtype=torch.float64)]


def test_split_keeps_about_eight_bits():
    y = torch.cat([torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 256,
                   torch.exp2(-torch.rand(4000, generator=torch.Generator().manual_seed(1)) * 20), torch.zeros(3)])
    hi, lo = split_e4m3(y)
    assert torch.equal(hi, y.to(torch.float8_e4m3fn).float())
    assert torch.equal(lo, (y - hi).to(torch.float8_e4m3fn).float())
    err1, err2 = (y - hi).abs(), (y - hi - lo).abs()
    assert torch.all(err2 <= y * 2.0 ** -8 + 2.0 ** -10)  # 4 + 4 significant bits, E4M3's subnormal floor below
    assert torch.all(err2 <= err1) and float(err2.sum()) < float(err1.sum()) / 12


@pytest.mark.parametrize("acc", ["fp32", "promote14", "mma14"])
def test_one_tile_forward_is_the_three_products_in_order(acc):
    """One document of one key tile, by hand: P~ = hi + lo from the fold, P~V = lo.V + hi.V_lo + hi.V (the residual
    products first; lo.V_lo left out), exact and rounded once ("fp32") or through the truncating MMA model in that
    order ("promote14" / "mma14")."""
    q, k, v, cu = _row(30, lens=(100,), outliers=False, heads=(1, 1))
    q = (q.float() * 3).bfloat16()  # peaked rows: P~'s rounding matters
    (qc, eq), (kc, ek), (vc, ev) = ((z.codes[:100, 0].double(), z.exponents[:100, 0].int() - UE8M0_BIAS)
                                    for z in (quantize_token_blocks(x, cu, "block") for x in (q, k, v)))
    vl = residual_codes(v, quantize_token_blocks(v, cu, "block"))[:100, 0].double()
    s = scores(qc[None], eq[None], kc[None], ek[None], qk_scale_f32(128 ** -0.5))[0]
    vis = torch.ones(100, 100, dtype=torch.bool).tril()
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    l = p.double().sum(-1).float()
    r = ev[None, :].expand(100, 100).masked_fill(~vis, -1000).amax(-1)
    boost = DEFAULT_BOOST_LOG2
    y = torch.where(vis, p * pow2(ev[None, :] - r[:, None] + boost), torch.zeros(()))
    hi, lo = split_e4m3(y)
    if acc == "fp32":
        pv = (lo.double() @ vc + hi.double() @ vl + hi.double() @ vc).float()
    else:
        pv = None if acc == "promote14" else torch.zeros(100, 128)
        for a, b in ((lo, vc), (hi, vl), (hi, vc)):
            pv = mma_model(a, b, pv)
    want = ((pv * pow2(r - boost)[:, None]) / l[:, None]).bfloat16()
    st2, st1 = {}, {}
    got, _ = fp8_attention_forward(q, k, v, cu, pv_terms=2, pv_accumulator=acc, stats=st2)
    assert torch.equal(got[:100, 0], want)
    one, _ = fp8_attention_forward(q, k, v, cu, pv_accumulator=acc, stats=st1)
    assert not torch.equal(got, one)
    assert st2 == st1 and st2["ptilde_max"] == float(hi.max())  # the statistics read hi
    if acc != "fp32":  # the order is part of the contract under the truncating models
        t = None if acc == "promote14" else torch.zeros(100, 128)
        for a, b in ((hi, vc), (hi, vl), (lo, vc)):
            t = mma_model(a, b, t)
        assert not torch.equal(((t * pow2(r - boost)[:, None]) / l[:, None]).bfloat16(), want)


@pytest.mark.parametrize("peaked", [False, True])
def test_two_term_pv_brings_o_dq_dk_closer_to_fp64(peaked):
    """With qk_terms=2, pv_terms=2 moves O, dQ and dK closer to fp64 (outlier K channels; a peaked softmax), dV's
    bits unchanged (its fold and dO keep one term; P comes from S and the LSE, which V does not touch). Measured
    (cos O / dQ / dK, pv_terms 1 -> 2): outliers 0.999606 -> 0.999996, 0.998362 -> 0.998902, 0.998420 -> 0.998875;
    peaked (q x 4) 0.999604 -> 0.999998, 0.998822 -> 0.999237, 0.998493 -> 0.998894."""
    q, k, v, cu = _row(2, outliers=not peaked)
    if peaked:
        q = (q.float() * 4).bfloat16()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = _exact(q, k, v, cu, do)
    got, cos = {}, {}
    for terms in (1, 2):
        o, lse = fp8_attention_forward(q, k, v, cu, qk_terms=2, pv_terms=terms)
        got[terms] = [o, *fp8_attention_backward(do, q, k, v, o, lse, cu, qk_terms=2, pv_terms=terms)]
        cos[terms] = [_cos(a, b) for a, b in zip(got[terms], exact)]
    assert all(cos[2][i] > cos[1][i] + d for i, d in ((0, 3e-4), (1, 3e-4), (2, 3e-4))), cos
    assert cos[2][0] > 0.99999 and cos[2][1] > 0.9986 and cos[2][2] > 0.9986, cos
    assert torch.equal(got[1][3], got[2][3])


@pytest.mark.parametrize("qk_terms", [1, 2])
def test_autograd_wrapper_is_the_forward_and_backward(qk_terms):
    q, k, v, cu = _row(4, lens=(200, 70))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    o, lse = fp8_attention_forward(q, k, v, cu, qk_terms=qk_terms, pv_terms=2)
    grads = fp8_attention_backward(do, q, k, v, o, lse, cu, qk_terms=qk_terms, pv_terms=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    oa = fp8_varlen_attention_emulated(*leaves, cu, qk_terms=qk_terms, pv_terms=2)
    oa.backward(do)
    assert torch.equal(oa, o)
    assert all(torch.equal(x.grad, g) for x, g in zip(leaves, grads))
    assert not torch.equal(o, fp8_attention_forward(q, k, v, cu, qk_terms=qk_terms)[0])  # the mode changes the bits
    one = fp8_attention_backward(do, q, k, v, o, lse, cu, qk_terms=qk_terms)
    assert not torch.equal(grads[0], one[0])  # and so does the backward's dP


def test_two_term_pv_keeps_token_mode_causal():
    q, k, v, cu = _row(6, lens=(500,), outliers=False)
    cut = 233
    k2, v2 = k.clone(), v.clone()
    k2[cut:500] = torch.randn_like(k2[cut:500].float()).bfloat16() * 40
    v2[cut:500] = (torch.randn_like(v2[cut:500].float()) * 300).bfloat16()
    a = fp8_attention_forward(q, k, v, cu, scale_granularity="token", qk_terms=2, pv_terms=2)
    b = fp8_attention_forward(q, k2, v2, cu, scale_granularity="token", qk_terms=2, pv_terms=2)
    assert torch.equal(a[0][:cut], b[0][:cut]) and torch.equal(a[1][:, :cut], b[1][:, :cut])
    assert not torch.equal(a[0][cut:500], b[0][cut:500])


def test_pv_terms_errors():
    from flamia_pack import varlen_attention

    q, k, v, cu = _row(7, lens=(64,))
    do = torch.zeros(q.shape, dtype=torch.bfloat16)
    o, lse = fp8_attention_forward(q, k, v, cu)
    for bad in (0, 3, True, "2", 2.0):
        with pytest.raises(FlamiaError, match="pv_terms must be 1"):
            fp8_attention_forward(q, k, v, cu, pv_terms=bad)
        with pytest.raises(FlamiaError, match="pv_terms must be 1"):
            fp8_attention_backward(do, q, k, v, o, lse, cu, pv_terms=bad)
        with pytest.raises(FlamiaError, match="pv_terms must be 1"):
            fp8_varlen_attention_emulated(q, k, v, cu, pv_terms=bad)
        with pytest.raises(FlamiaError, match="pv_terms must be 1"):
            varlen_attention(q, k, v, cu.to(torch.int32), 64, precision="fp8", pv_terms=bad)
    with pytest.raises(FlamiaError, match="pv_terms=2 applies to precision='fp8'"):
        varlen_attention(q, k, v, cu.to(torch.int32), 64, pv_terms=2)
    quant = tuple(quantize_token_blocks(x, cu, "block") for x in (q, k, v))
    with pytest.raises(FlamiaError, match="pv_terms=2 quantizes v itself"):
        fp8_attention_forward(None, None, None, cu, quantized=quant, pv_terms=2)
    with pytest.raises(FlamiaError, match="pv_terms=2 quantizes v itself"):
        fp8_attention_backward(do, None, None, None, o, lse, cu, quantized=quant, pv_terms=2)


def test_varlen_attention_two_term_pv_on_the_cpu_is_the_emulation():
    """``varlen_attention(precision="fp8", qk_terms=2, pv_terms=2)`` off the GPU runs the emulation (bitwise, forward
    and gradients), closer to fp64 than ``qk_terms=2`` alone."""
    import numpy as np

    from flamia_pack import varlen_attention

    q, k, v, cu = _row(22, lens=(300, 1, 211), heads=(2, 1))
    n = int(cu[-1])
    cu32 = cu.to(torch.int32)
    o = varlen_attention(q, k, v, cu32, 300, precision="fp8", qk_terms=2, pv_terms=2)
    oe, _ = fp8_attention_forward(q, k, v, cu, qk_terms=2, pv_terms=2)
    assert torch.equal(o, oe)
    assert torch.equal(varlen_attention(q, k, v, cu32, 300, precision="fp8", qk_terms=2, pv_terms=np.int64(2)), o)
    ref = packed_attention_reference(q.double(), k.double(), v.double(), cu, compute_dtype=torch.float64)
    o1 = varlen_attention(q, k, v, cu32, 300, precision="fp8", qk_terms=2)
    assert _cos(o[:n], ref[:n]) > _cos(o1[:n], ref[:n])
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).bfloat16()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    varlen_attention(*leaves, cu32, 300, precision="fp8", qk_terms=2, pv_terms=2).backward(do)
    emu = [x.clone().requires_grad_() for x in (q, k, v)]
    fp8_varlen_attention_emulated(*emu, cu32, 300, qk_terms=2, pv_terms=2).backward(do)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, emu))
