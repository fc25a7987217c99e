"""CPU emulation of the FP8 attention path (kernels/fp8_emulation.py, fp8_emulation_bwd.py; issue 27
item 4, issue 28; DESIGN.md §4-5): accuracy against the fp64 reference, the scale-folding identities
(hypothesis), causal safety with positive controls, replication controls, and bad inputs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels.fp8_emulation import (
    _fold_p,
    exact_mm,
    fp8_attention_backward,
    fp8_attention_forward,
    fp8_varlen_attention_emulated,
    pow2,
    qk_scale_f32,
    reference_exponent,
    scores,
)
from flamia_pack.kernels.leak import EXPECTED, probe_paths
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd
from flamia_pack.quant import quantize_token_blocks

# unaligned documents: lengths 1, 76, 223, 1, 32, 267, 50 (none a multiple of 128; 1-token docs),
# then 10 padding rows
CU = torch.tensor([0, 1, 77, 300, 301, 333, 600, 650], dtype=torch.int32)
T = 660
N = int(CU[-1])


def cos(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def inputs(H, Hkv, D, seed=0, outliers=False, T=T):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv, H))
    if outliers:  # a few K channels x 20 (issue 27's outlier-channel input)
        k[..., :4] *= 20
    return tuple(x.bfloat16() for x in (q, k, v, do))


def reference(q, k, v, do, cu=CU):
    o, lse = packed_attention_reference(q, k, v, cu, compute_dtype=torch.float64, return_lse=True)
    dq, dk, dv = packed_attention_reference_bwd(do.double(), q.double(), k.double(), v.double(), o, lse, cu)
    return o, lse, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# accuracy vs fp64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,Hkv,D,gran", [(2, 2, 64, "block"), (4, 2, 128, "block"), (4, 2, 128, "token")])
def test_forward_backward_vs_fp64_random(H, Hkv, D, gran):
    q, k, v, do = inputs(H, Hkv, D)
    ro, rl, rdq, rdk, rdv = reference(q, k, v, do)
    fst, bst = {}, {}
    o, lse = fp8_attention_forward(q, k, v, CU, 267, scale_granularity=gran, stats=fst)
    dq, dk, dv = fp8_attention_backward(do, q, k, v, o, lse, CU, 267, scale_granularity=gran, stats=bst)
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    assert lse.shape == (H, T) and lse.dtype == torch.float32
    c = dict(o=cos(o[:N], ro[:N]), dq=cos(dq, rdq), dk=cos(dk, rdk), dv=cos(dv, rdv))
    lse_err = float((lse[:, :N].double() - rl[:, :N]).abs().max())
    print(f"\nrandom H={H} Hkv={Hkv} D={D} {gran}: cos {c} max|dLSE| {lse_err:.3g} fwd {fst} bwd {bst}")
    # measured (torch 2.13 CPU): O 0.99900 (D 64) / 0.99911 (D 128), dQ 0.99791 / 0.99800,
    # dK 0.99799 / 0.99801, dV 0.99896 / 0.99893; dS zero fraction 5e-5 (dQ payload) / 4e-5 (dK)
    # (E4M3 is a float format: a payload's exponent only decides which small dS entries fall below
    # the subnormal floor, so the per-row / per-key payloads gave the 32 x 32-block one's cosines
    # to 5 digits)
    assert c["o"] >= 0.9989
    assert c["dq"] >= 0.9978 and c["dk"] >= 0.9978 and c["dv"] >= 0.9985
    assert lse_err < 0.15  # worst rows are the 1-token documents (LSE = s_ii, |s_ii| ~ 8-11)
    assert 0.99 < float(dq.double().norm() / rdq.norm()) < 1.01
    # padding rows: o = 0, lse = +inf, zero gradients (as the BF16 reference)
    assert o[N:].abs().max() == 0 and torch.isinf(lse[:, N:]).all() and dq[N:].abs().max() == 0
    # range budget: nothing reached past 2^boost = 256 (< 448)
    assert fst["ptilde_max"] <= 256 and bst["ptilde_dv_max"] <= 256
    assert bst["ds_zero_fraction"] < 1e-3 and bst["ds_zero_fraction_dk"] < 1e-3
    assert abs(bst["ds_row_residual"]) < 2e-3


def test_outlier_channels_and_replication_controls():
    """Outlier K channels: the honest numbers (printed), and the mismatched-backward positive
    controls: Delta from the unquantized dO (the paper's "different incoming-gradient
    representations") multiplies the signed row residual; S recomputed from bf16 q, k instead of
    the forward's codes breaks P against the saved LSE and the gradients blow up."""
    q, k, v, do = inputs(2, 1, 64, seed=1, outliers=True)
    ro, rl, rdq, rdk, rdv = reference(q, k, v, do)
    fst = {}
    o, lse = fp8_attention_forward(q, k, v, CU, stats=fst, _kernel_head_dims=False)
    res = {}
    for mm in (None, "bf16_delta", "bf16_scores"):
        bst = {}
        dq, dk, dv = fp8_attention_backward(do, q, k, v, o, lse, CU, stats=bst, mismatch=mm, _kernel_head_dims=False)
        res[mm] = dict(dq=cos(dq, rdq), dk=cos(dk, rdk), dv=cos(dv, rdv),
                       norm=float(dq.double().norm() / rdq.norm()), **bst)
        print(f"\noutliers mismatch={mm}: {res[mm]}")
    print(f"outliers forward: O cos {cos(o[:N], ro[:N]):.5f} {fst}")
    ok = res[None]
    # measured: O 0.9943, dQ 0.9838, dK 0.9873, dV 0.9941 (below issue 27/28's targets: E4M3's
    # 3-bit mantissa on scores dominated by x20 channels), dS zero fraction 0.34 (dQ payload) /
    # 0.27 (dK payload)
    assert cos(o[:N], ro[:N]) >= 0.993 and ok["dq"] >= 0.98 and ok["dk"] >= 0.98 and ok["dv"] >= 0.99
    assert ok["ds_zero_fraction"] < 0.4 and ok["ds_zero_fraction_dk"] < 0.35
    assert res["bf16_delta"]["ds_row_residual_rms"] >= 1.8 * ok["ds_row_residual_rms"]
    assert res["bf16_scores"]["dq"] < ok["dq"] - 0.05 and res["bf16_scores"]["norm"] > 1.1


def test_delta_mismatch_shows_in_the_row_residual_not_the_cosine():
    """Seed 001 §5: a structured row bias contributes little to a whole-tensor cosine."""
    q, k, v, do = inputs(2, 2, 64, seed=2)
    o, lse = fp8_attention_forward(q, k, v, CU)
    a, b = {}, {}
    fp8_attention_backward(do, q, k, v, o, lse, CU, stats=a)
    fp8_attention_backward(do, q, k, v, o, lse, CU, stats=b, mismatch="bf16_delta")
    print(f"\nrow residual rms matched {a['ds_row_residual_rms']:.4g} vs mismatched {b['ds_row_residual_rms']:.4g}")
    assert b["ds_row_residual_rms"] >= 5 * a["ds_row_residual_rms"]  # measured ~11x


def test_pv_accumulator_models():
    """The modelled 14-bit MMA accumulator (issue 27 item 3) vs fp32 promotion, one long document."""
    cu = torch.tensor([0, 768], dtype=torch.int32)
    q, k, v, _ = inputs(2, 1, 64, seed=3, T=768)
    ro = packed_attention_reference(q, k, v, cu, compute_dtype=torch.float64)
    outs = {a: fp8_attention_forward(q, k, v, cu, pv_accumulator=a)[0] for a in ("fp32", "promote14", "mma14")}
    c = {a: cos(o, ro) for a, o in outs.items()}
    rel = {a: float((o.float() - outs["fp32"].float()).abs().max() / outs["fp32"].float().abs().max())
           for a, o in outs.items()}
    print(f"\npv_accumulator cos vs fp64 {c}; max rel diff to fp32 {rel}")
    assert rel["promote14"] > 0 and rel["mma14"] > 0  # the model does change bits
    # measured: cos 0.9988423 / 0.9988423 / 0.9988422 (a 768-token document: flatter rows than the
    # packed test's), max change 1 bf16 ulp of max|O|: at this model the accumulator choice is free
    assert min(c.values()) >= 0.998 and max(rel.values()) < 0.01
    assert abs(c["mma14"] - c["fp32"]) < 1e-5


@pytest.mark.parametrize("acc", ["fp32", "mma14"])
def test_a_zero_v_tile_stays_finite_and_the_floors_bind_only_on_degenerate_v(acc, monkeypatch):
    """The fold reference's floors (64 binades below the row's largest so far, and boost - 110): a
    document whose keys 128-255 have V = 0 stays finite in the MMA-accumulating model (without the
    running floor the rescale 2^(r_old - r_new) ~ 2^110 overflowed it: the positive control), the
    output is the exact one's; on N(0, 1) V the floors move no bit."""
    import flamia_pack.kernels.fp8_emulation as emu

    cu = torch.tensor([0, 512], dtype=torch.int32)
    q, k, v, _ = inputs(1, 1, 64, seed=11, T=512)
    v[128:256] = 0
    ro = packed_attention_reference(q, k, v, cu, compute_dtype=torch.float64)
    o, _ = fp8_attention_forward(q, k, v, cu, pv_accumulator=acc)
    assert bool(torch.isfinite(o).all()) and cos(o, ro) > 0.998
    monkeypatch.setattr(emu, "REF_FLOOR_LOG2", 1000)  # no running floor: the old contract
    monkeypatch.setattr(emu, "FOLD_REF_MIN_OFFSET", 1000)
    o_old, _ = fp8_attention_forward(q, k, v, cu, pv_accumulator=acc)
    if acc == "mma14":
        assert not bool(torch.isfinite(o_old).all())
    else:
        assert torch.equal(o_old, o)  # per-tile promotion never overflowed; zero codes add 0 either way
    q2, k2, v2, _ = inputs(2, 1, 64, seed=12)
    a = fp8_attention_forward(q2, k2, v2, CU, pv_accumulator=acc)
    monkeypatch.undo()
    b = fp8_attention_forward(q2, k2, v2, CU, pv_accumulator=acc)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_running_floor_drops_only_keys_64_binades_below(monkeypatch):
    """A row whose later V tile is 2^-80 of its first (nonzero): the running floor raises that tile's
    reference, so its P~ round to 0 (the documented edge: they would add ~2^-80 of |O|, invisible in
    bf16, so O keeps its bits); a drop of 2^-40 stays above the floor and folds as without it."""
    import flamia_pack.kernels.fp8_emulation as emu

    cu = torch.tensor([0, 256], dtype=torch.int32)
    q, k, v, _ = inputs(1, 1, 64, seed=13, T=256)
    for drop, binds in ((2.0 ** -40, False), (2.0 ** -80, True)):
        v2 = v.clone()
        v2[128:] = (v[128:].float() * drop).bfloat16()
        st = {}
        o, _ = fp8_attention_forward(q, k, v2, cu, stats=st)
        with monkeypatch.context() as m:
            m.setattr(emu, "REF_FLOOR_LOG2", 1000)
            st_free = {}
            o_free, _ = fp8_attention_forward(q, k, v2, cu, stats=st_free)
        assert torch.equal(o, o_free)
        zeros, zeros_free = st["p_zero_fraction"], st_free["p_zero_fraction"]
        # the second tile holds 8,256 of the 32,896 visible pairs (0.25)
        assert (zeros > zeros_free + 0.2) if binds else (zeros == zeros_free), (drop, zeros, zeros_free)


def test_block_m_does_not_change_the_bits_block_n_does():
    q, k, v, _ = inputs(2, 2, 64, seed=4)
    o128, l128 = fp8_attention_forward(q, k, v, CU)
    o64, l64 = fp8_attention_forward(q, k, v, CU, block_m=64)
    o256, _ = fp8_attention_forward(q, k, v, CU, block_m=256)
    assert torch.equal(o128, o64) and torch.equal(o128, o256) and torch.equal(l128, l64)
    on, _ = fp8_attention_forward(q, k, v, CU, block_n=64)
    assert not torch.equal(o128, on)


def test_prequantized_inputs_and_autograd_match_the_functions():
    q, k, v, do = inputs(4, 2, 64, seed=5)
    ops = tuple(quantize_token_blocks(x, CU, "token") for x in (q, k, v))
    o1, l1 = fp8_attention_forward(q, k, v, CU, scale_granularity="token")
    o2, l2 = fp8_attention_forward(None, None, None, CU, scale_granularity="token", quantized=ops)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    g = fp8_attention_backward(do, None, None, None, o1, l1, CU, scale_granularity="token", quantized=ops)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    o3 = fp8_varlen_attention_emulated(qq, kk, vv, CU, 267, scale_granularity="token")
    assert torch.equal(o3.detach(), o1)
    o3.backward(do)
    for a, b in zip((qq.grad, kk.grad, vv.grad), g):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_noncausal_runs_and_is_close():
    q, k, v, _ = inputs(2, 2, 64, seed=6)
    ro = packed_attention_reference(q, k, v, CU, causal=False, compute_dtype=torch.float64)
    o, _ = fp8_attention_forward(q, k, v, CU, causal=False)
    assert cos(o[:N], ro[:N]) >= 0.9985  # measured 0.99886 (whole-document rows are flatter)


# ---------------------------------------------------------------------------------------------
# scale-folding identities (hypothesis)
# ---------------------------------------------------------------------------------------------

e4m3_values = st.integers(0, 0x7E).map(
    lambda b: float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float()))


@settings(max_examples=40, deadline=None)
@given(st.lists(e4m3_values, min_size=8, max_size=8), st.lists(e4m3_values, min_size=8, max_size=8),
       st.lists(st.booleans(), min_size=8, max_size=8), st.integers(-20, 20), st.integers(-20, 20))
def test_score_factors_fold_in_any_order_and_products_are_exact(a, b, signs, eq, ek):
    """(1) the fp64 product of E4M3 codes is exact (any contraction order gives the same bits);
    (2) power-of-two factors commute with the rounding: folding qk into the row factor is bitwise
    the same as applying the factors one by one."""
    x = torch.tensor(a) * torch.tensor([-1.0 if s else 1.0 for s in signs])
    y = torch.tensor(b)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(eq * 41 + ek))
    d1 = exact_mm(x[None, None, :], y[None, :, None])
    d2 = exact_mm(x[perm][None, None, :], y[perm][None, :, None])
    assert torch.equal(d1, d2)
    from fractions import Fraction
    exact = sum(Fraction(float(u)) * Fraction(float(w)) for u, w in zip(x.tolist(), y.tolist()))
    assert float(d1) == float(torch.tensor(float(exact), dtype=torch.float64).float())
    qk = qk_scale_f32(0.125)
    s = scores(x.double()[None, None, :], torch.tensor([[eq]]), y.double()[None, None, :], torch.tensor([[ek]]), qk)
    alt = (d1 * (pow2(torch.tensor(eq)) * qk)) * pow2(torch.tensor(ek))
    assert torch.equal(s.reshape(()), alt.reshape(()))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 8), st.integers(0, 2 ** 31 - 1))
def test_ptilde_never_exceeds_2_pow_boost_and_unfolds_exactly(boost, seed):
    """Range budget: P~ <= 2^boost <= 256 < 448 for any probabilities in [0, 1], exponents and
    masks; and P~ * 2^(r - e - boost) is the E4M3 rounding of p (fold/unfold of powers of two is
    exact wherever P~ is a normal E4M3 number)."""
    g = torch.Generator().manual_seed(seed)
    H, m, n = 2, 5, 7
    p = torch.rand(H, m, n, generator=g) ** 4
    p[..., 0] = 1.0  # the running max's own key
    e = torch.randint(-30, 30, (H, n), generator=g, dtype=torch.int32)
    vis = torch.rand(m, n, generator=g) < 0.7
    vis[:, 0] = True
    r, has = reference_exponent(e, vis)
    pt = _fold_p(p, e, r, vis, boost).float()
    assert float(pt.max()) <= 2.0 ** boost <= 448
    assert (pt[:, ~vis] == 0).all()
    d = (e[:, None, :] - r[:, :, None] + boost).to(torch.float64)
    normal = vis & (pt >= 2.0 ** -6)
    back = (pt.double() * torch.exp2(-d))[normal]
    direct = (p.double() * torch.exp2(d)).float().to(torch.float8_e4m3fn).double()[normal] * torch.exp2(-d)[normal]
    assert torch.equal(back, direct)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 31 - 1))
def test_reference_exponent_reads_only_visible_keys(seed):
    g = torch.Generator().manual_seed(seed)
    H, m, n = 2, 6, 9
    e = torch.randint(-40, 40, (H, n), generator=g, dtype=torch.int32)
    vis = torch.rand(m, n, generator=g) < 0.5
    vis[:, 0] = True
    r, _ = reference_exponent(e, vis)
    e2 = torch.where(torch.rand(H, n, generator=g) < 0.5, e + torch.randint(1, 60, (H, n), generator=g,
                                                                            dtype=torch.int32), e)
    for i in range(m):  # a change of invisible keys' exponents leaves row i's r_i alone
        e3 = torch.where(vis[i][None, :], e, e2)
        r3, _ = reference_exponent(e3, vis)
        assert torch.equal(r3[:, i], r[:, i])
        assert (r[:, i][:, None] >= e[:, vis[i]]).all()


# ---------------------------------------------------------------------------------------------
# causal safety (DESIGN.md §5) with positive controls
# ---------------------------------------------------------------------------------------------

# a smaller row for the perturbation runs: documents [0, 40), [40, 263), [263, 290), 6 padding rows
CU2 = torch.tensor([0, 40, 263, 290], dtype=torch.int32)
T2 = 296
DOC0, DOC1 = 40, 263
CUT = 40 + 64 + 13  # 13 tokens into the third 32-token group; on the diagonal key tile [40, 168)
GROUP0 = 40 + 64
OTHER = (263, 290)


def _perturb(x, lo, hi, seed, mag=64.0):
    x = x.clone()
    g = torch.Generator().manual_seed(seed)
    x[lo:hi] = (x[lo:hi].float() + mag * torch.randn(hi - lo, *x.shape[1:], generator=g)).to(x.dtype)
    return x


def _run(q, k, v, do, gran, leaky=False):
    o, lse = fp8_attention_forward(q, k, v, CU2, scale_granularity=gran, leaky_reference=leaky)
    if leaky:
        return (o,)
    g = fp8_attention_backward(do, q, k, v, o, lse, CU2, scale_granularity=gran)
    return (o, *g)


@pytest.fixture(scope="module")
def causal_runs():
    q, k, v, do = inputs(2, 2, 64, seed=7, T=T2)
    pert = [_perturb(x, CUT + 1, DOC1, 10 + i) for i, x in enumerate((q, k, v, do))]
    other = [_perturb(x, *OTHER, 20 + i) for i, x in enumerate((q, k, v, do))]
    out = {}
    for gran in ("token", "block"):
        out[gran] = (_run(q, k, v, do, gran), _run(*pert, gran), _run(*other, gran))
    out["leaky"] = (_run(q, k, v, do, "token", True), _run(*pert, "token", True))
    # the positive control really changes the exponents of the cut's group
    e0 = quantize_token_blocks(v, CU2, "block").exponents
    e1 = quantize_token_blocks(pert[2], CU2, "block").exponents
    out["exp_changed"] = bool((e0[GROUP0] != e1[GROUP0]).any())
    return out


def _moved_rows(a, b):
    return ((a.float() - b.float()).abs().amax(dim=(1, 2)) > 0).nonzero().flatten().tolist()


def test_token_mode_is_bitwise_causal(causal_runs):
    (o, dq, dk, dv), (o2, dq2, dk2, dv2), _ = causal_runs["token"]
    assert torch.equal(o[DOC0:CUT + 1], o2[DOC0:CUT + 1])
    assert torch.equal(dq[DOC0:CUT + 1], dq2[DOC0:CUT + 1])
    assert not torch.equal(dk[DOC0:CUT + 1], dk2[DOC0:CUT + 1])  # legit: later queries feed dK
    assert not torch.equal(o[CUT + 1:DOC1], o2[CUT + 1:DOC1])


def test_block_mode_moves_only_the_cuts_group(causal_runs):
    (o, dq, *_), (o2, dq2, *_), _ = causal_runs["block"]
    moved = sorted(set(_moved_rows(o[:CUT + 1], o2[:CUT + 1]) + _moved_rows(dq[:CUT + 1], dq2[:CUT + 1])))
    print(f"\nblock mode: rows <= cut {CUT} that moved: {moved[:5]}... ({len(moved)}), group starts at {GROUP0}")
    assert causal_runs["exp_changed"]
    assert moved and min(moved) >= GROUP0  # the documented within-group dependency, nothing earlier


@pytest.mark.parametrize("gran", ["token", "block"])
def test_other_document_moves_nothing_outside_it(causal_runs, gran):
    base, _, other = causal_runs[gran]
    keep = torch.ones(T2, dtype=torch.bool)
    keep[OTHER[0]:OTHER[1]] = False
    for a, b in zip(base, other):
        assert torch.equal(a[keep], b[keep])


def test_leaky_reference_positive_control(causal_runs):
    """r_i = per-tile max of e_v over all the document's keys of the tile reads future keys on the
    diagonal tile: with per-token exponents (where the visible-key rule is exactly 0) rows before
    the cut move, through the E4M3 subnormal boundary."""
    (o,), (o2,) = causal_runs["leaky"]
    moved = _moved_rows(o[DOC0:CUT + 1], o2[DOC0:CUT + 1])
    rel = float((o[DOC0:CUT + 1].float() - o2[DOC0:CUT + 1].float()).abs().max() / o.float().abs().max())
    print(f"\nleaky reference: {len(moved)} rows before the cut moved, max rel change {rel:.3g}")
    assert moved and rel > 0


def test_leak_probe_paths():
    reports = probe_paths(["fp8-emu-token", "fp8-emu-block"], cu_seqlens=(0, 40, 140, 150, 230),
                          total_tokens=236, num_heads=2, head_dim=64, seed=3)
    for r in reports:
        print(f"\n{r.path}: {r.verdict} O {r.o_prefix:.3g} dQ {r.dq_prefix:.3g}")
        assert r.verdict == EXPECTED[r.path] and r.exponent_changed and r.noise == 0.0
        assert r.dk_prefix > 0 and r.dv_prefix > 0  # what tests/test_leak.py asserts of every path
    assert reports[0].o_prefix == 0.0 and reports[0].dq_prefix == 0.0


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    (dict(scale_granularity="row"), "scale_granularity"),
    (dict(boost_log2=9), "boost_log2"),
    (dict(boost_log2=-1), "boost_log2"),
    (dict(boost_log2=2.5), "boost_log2"),
    (dict(block_n=48), "multiple of 32"),
    (dict(block_m=512), "block_m"),
    (dict(pv_accumulator="fp16"), "pv_accumulator"),
])
def test_bad_options(kw, msg):
    q, k, v, _ = inputs(2, 2, 64, T=40)
    with pytest.raises(FlamiaError, match=msg):
        fp8_attention_forward(q, k, v, torch.tensor([0, 40]), **kw)


def test_bad_inputs():
    cu = torch.tensor([0, 40], dtype=torch.int32)
    q, k, v, do = inputs(2, 2, 64, T=40)
    with pytest.raises(FlamiaError, match="head_dim"):
        fp8_attention_forward(*(x[..., :32] for x in (q, k, v)), cu)
    with pytest.raises(FlamiaError, match="float64"):
        fp8_attention_forward(q.double(), k, v, cu)
    with pytest.raises(FlamiaError, match="torch.Tensor"):
        fp8_attention_forward([1.0], k, v, cu)
    with pytest.raises(FlamiaError, match="multiple of num_kv_heads"):
        fp8_attention_forward(torch.cat([q, q[:, :1]], 1), k, v, cu)
    with pytest.raises(MetadataError):
        fp8_attention_forward(q, k, v, torch.tensor([0, 50]))
    with pytest.raises(MetadataError, match="max_seqlen"):
        fp8_attention_forward(q, k, v, cu, 10)
    bad = quantize_token_blocks(q, cu)
    bad = bad._replace(exponents=torch.full_like(bad.exponents, 255))
    ok = quantize_token_blocks(k, cu)
    with pytest.raises(FlamiaError, match="NaN"):
        fp8_attention_forward(None, None, None, cu, quantized=(bad, ok, ok))
    with pytest.raises(FlamiaError, match="quantized"):
        fp8_attention_forward(None, None, None, cu, quantized=(q, k, v))
    with pytest.raises(FlamiaError, match="non-finite|NaN"):
        fp8_attention_forward(torch.full_like(q, math.nan), k, v, cu)
    o, lse = fp8_attention_forward(q, k, v, cu)
    with pytest.raises(FlamiaError, match="mismatch"):
        fp8_attention_backward(do, q, k, v, o, lse, cu, mismatch="other")
    with pytest.raises(FlamiaError, match="lse"):
        fp8_attention_backward(do, q, k, v, o, lse.T, cu)
    with pytest.raises(FlamiaError, match="do must be"):
        fp8_attention_backward(do[:, :1], q, k, v, o, lse, cu)


def test_fp8_numerics_probe_forward():
    """benchmarks/probes/fp8_numerics.py: its ablated forward with every rounding on is the emulation
    bitwise (the probe's own check); with none it is the float64 reference up to the bf16 output;
    the K smoothing leaves the reference unchanged (a per-row score shift)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    import fp8_numerics as N

    N.check()
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 200, 201, 530])
    q, k, v = (torch.randn((530, 2, 64), generator=g).bfloat16() for _ in range(3))
    ref = packed_attention_reference(q, k, v, cu, compute_dtype=torch.float64)
    exact = N.ablated_forward(*(N.operand(x, cu, "block", False) for x in (q, k, v)), cu.tolist(), round_p=False)
    assert bool(((exact.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all())  # one bf16 ulp at most
    cos, rel_max, _ = N.metrics(exact, ref, 530)
    assert cos > 0.99999 and rel_max < 0.01
    smoothed = packed_attention_reference(q, N.smooth_k(k, cu), v, cu, compute_dtype=torch.float64)
    assert float((smoothed - ref).abs().max()) < 1e-5  # smooth_k rounds k - mu to fp32
