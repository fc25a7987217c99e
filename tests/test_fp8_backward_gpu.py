"""GPU tests of the FP8 backward (``gluon_fp8_bwd.py`` through ``varlen_attention(precision="fp8")``).

Gradients from autograd through the GPU FP8 path against the fp32 reference's (fresh random inputs,
W1-W9-like rows scaled down, random S3-style rows with 1-token documents, GQA / MQA, padding rows,
causal and not, both granularities); the launcher allocates dK / dV uninitialised (a row no program
writes stays garbage and fails the comparison), padding rows must be exactly 0. Also: NaN
containment per document (NaN codes in the rows of a neighbour's query steps included), token-mode
causality of dQ (bitwise), CUDA graph capture of the backward, and the errors of bad inputs.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flamia_pack.errors import FlamiaError  # noqa: E402
from flamia_pack.kernels import varlen_attention  # noqa: E402
from flamia_pack.kernels.fp8_attention import fp8_attention_forward, fp8_kernels_available, fp8_quantize  # noqa: E402
from flamia_pack.kernels.fp8_backward import fp8_backward  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
from fp8_bwd_probe import _cos, _inputs  # noqa: E402  (the probe's inputs and cosine)
from fp8_fwd_probe import poison_with_nan_code  # noqa: E402  (a NaN code, not only a NaN input)

_HOPPER = fp8_kernels_available("cuda")
needs_hopper = pytest.mark.skipif(not _HOPPER, reason="the FP8 kernels need sm_90 and triton's Gluon")

_RNG = np.random.default_rng(28)
ROWS = {
    "W1-like 4x512": ([512] * 4, 4, 4, 0),
    "W2-like 1024 + 8x64": ([1024] + [64] * 8, 4, 4, 0),
    "W4-like 1x3000": ([3000], 2, 2, 0),
    "W5-like GQA 2x1024": ([1024] * 2, 8, 2, 0),
    "W6-like unaligned": ([300, 1, 77, 700, 129, 128, 2, 31], 4, 2, 0),
    "W7-like 16x128": ([128] * 16, 2, 2, 0),
    "MQA + padding": ([5, 250, 1, 1, 600], 2, 1, 37),
    **{f"S3 random {i}": ([int(x) for x in _RNG.integers(1, 300, _RNG.integers(1, 60))], 2, 1,
                          int(_RNG.integers(0, 50))) for i in range(3)},
}


def _grads(q, k, v, do, cu, causal=True, gran="block"):
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = varlen_attention(*x, cu, int((cu[1:] - cu[:-1]).max()), causal=causal, precision="fp8",
                         scale_granularity=gran)
    o.backward(do)
    return [t.grad for t in x]


@needs_hopper
@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("gran", ["block", "token"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(name, gran, causal):
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, do, cu = _inputs(lens, H, Hkv, pad, seed=len(name))
    g8 = _grads(q, k, v, do, cu, causal, gran)
    qf, kf, vf = (t.float() for t in (q, k, v))
    o, lse = packed_attention_reference(qf, kf, vf, cu, causal=causal, return_lse=True)
    gr = packed_attention_reference_bwd(do.float(), qf, kf, vf, o, lse, cu, causal=causal)
    for name_g, a, r, floor in zip(("dq", "dk", "dv"), g8, gr, (0.996, 0.996, 0.997)):
        assert torch.isfinite(a).all(), name_g
        c = _cos(a, r)
        assert c > floor, f"{name_g}: cosine {c:.5f} vs fp32"
        ratio = float(a.double().norm() / r.double().norm())
        assert abs(ratio - 1) < 0.02, f"{name_g}: norm ratio {ratio:.4f}"
        if pad:
            assert (a[-pad:] == 0).all(), f"{name_g}: padding rows not 0"


@needs_hopper
@pytest.mark.parametrize("gran", ["block", "token"])
def test_zero_do_rows_give_finite_gradients(gran):
    """dO exactly 0 where a training loss has no target: every document's last token (a key seen only
    by zero-dO queries: the dV fold's reference is 2^-126) and a whole 64-query step of the long
    document (the unmasked fold's reference too), and a step whose dO is 2^-80 x the others'. The
    kernel once overflowed 2^BOOST / rho and the rescale rho_prev / rho there (NaN dV in the last
    token of every 8,192-token training row)."""
    lens = [2048, 33, 1, 700]
    q, k, v, do, cu = _inputs(lens, 2, 2, 0, seed=9)
    do = do.clone()
    ends = (cu[1:] - 1).long()
    do[ends] = 0
    do[1024:1088] = 0
    do[1536:1600] = do[1536:1600] * 2.0 ** -80  # a step 80 binades below the others: the floors bind
    g8 = _grads(q, k, v, do, cu, gran=gran)
    qf, kf, vf = (t.float() for t in (q, k, v))
    o, lse = packed_attention_reference(qf, kf, vf, cu, return_lse=True)
    gr = packed_attention_reference_bwd(do.float(), qf, kf, vf, o, lse, cu)
    for name_g, a, r in zip(("dq", "dk", "dv"), g8, gr):
        assert torch.isfinite(a).all(), f"{name_g}: {int((~torch.isfinite(a)).sum())} non-finite"
        assert _cos(a, r) > 0.996, f"{name_g}: cosine {_cos(a, r):.5f} vs fp32"
    assert (g8[2][ends[-1]] == 0).all()  # the last key sees only its own query, whose dO is 0


@needs_hopper
def test_nan_stays_in_its_document():
    q, k, v, do, cu = _inputs([500, 600, 400], 2, 2, seed=5)
    clean = _grads(q, k, v, do, cu)
    for t in (q, k, v):
        t[700, 0, 3] = float("nan")
    dirty = _grads(q, k, v, do, cu)
    keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep[500:1100] = False
    for a, b in zip(dirty, clean):
        assert torch.isfinite(a[keep]).all()
        torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=2e-3)  # dQ's reduce order varies


def _poison_codes(x, cu, rows):
    """A copy of ``x`` with a NaN code in head 0 at each of ``rows`` (``fp8_fwd_probe.poison_with_nan_code``:
    a NaN input alone gets a finite code from the integer encoder), checked in both layouts of the
    codes the FP8 path makes."""
    from flamia_pack.kernels.quantize import quantize

    x = x.clone()
    for r in rows:
        poison_with_nan_code(x, r, 0)
    q8 = quantize(x, cu, "block", transposed=True, transposed_store="kernel", hw_cvt=False, check_finite=False,
                  validate=False)
    for r in rows:
        assert int(q8.exponents[r, 0]) == 255
        assert torch.isnan(q8.codes[r, 0].float()).any() and torch.isnan(q8.codes_t[0, :, r].float()).any()
    return x


@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("which", ["q", "do"])
def test_nan_codes_in_the_neighbours_step_rows_stay_out(which, causal):
    """NaN codes in Q (or dO) rows that another document's query steps hold: document 1 (tokens 200-349)
    walks the steps 192 + 64 m, so its first step holds document 0's last group (192-199, poisoned at
    197) and its last one document 2's first (350-381, poisoned at 360). dK / dV contract over a step's
    queries: the kernel zeroes those Q^T / dO^T columns only where 2^e_q / 2^e_do marks a non-finite
    group (gluon_fp8_bwd._nonfinite_outside), and must here. Document 1's dQ, dK, dV stay bitwise the
    clean run's (each of its rows gets nonzero dQ partials from its 2 key tiles only: no reduce-order
    effect; the neighbours' programs add exact zeros)."""
    q, k, v, do, cu = _inputs([200, 150, 230], 2, 2, seed=11)
    clean = _grads(q, k, v, do, cu, causal=causal)
    if which == "q":
        q = _poison_codes(q, cu, [197, 360])
    else:
        do = _poison_codes(do, cu, [197, 360])
    dirty = _grads(q, k, v, do, cu, causal=causal)
    for name_g, a, b in zip(("dq", "dk", "dv"), dirty, clean):
        assert torch.equal(a[200:350], b[200:350]), name_g


@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_a_nan_code_in_own_k_stays_out_of_the_neighbours_dq(causal):
    """A NaN code in document 1's own K (token 250 of 200-349) makes its gradients NaN but must not reach
    documents 0 / 2: document 1's first and last query steps hold their rows (192-199, 350-383), whose
    dQ partial rows are 0 x K (0 x NaN = NaN without the kernel's row select). Everything of documents 0
    and 2 stays bitwise the clean run's (their dQ rows get exact zeros from document 1's programs)."""
    q, k, v, do, cu = _inputs([200, 150, 230], 2, 2, seed=12)
    clean = _grads(q, k, v, do, cu, causal=causal)
    k = _poison_codes(k, cu, [250])
    dirty = _grads(q, k, v, do, cu, causal=causal)
    assert not torch.isfinite(dirty[0][200:350]).all()  # the poisoned document's own dQ is NaN
    keep = torch.cat([torch.arange(0, 200), torch.arange(350, 580)]).cuda()
    for name_g, a, b in zip(("dq", "dk", "dv"), dirty, clean):
        assert torch.equal(a[keep], b[keep]), name_g


@needs_hopper
def test_token_mode_dq_before_cut_is_causal():
    """"token" mode: changing q, k, v after a cut (dO fixed) leaves dQ before it bitwise unchanged
    (up to the run-to-run order of the fp32 dQ reduce: compared on a one-key-tile prefix)."""
    q, k, v, do, cu = _inputs([120, 900], 2, 2, seed=6)
    a = _grads(q, k, v, do, cu, gran="token")
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    for t in (q2, k2, v2):
        t[100:120] = torch.randn_like(t[100:120]) * 4
    b = _grads(q2, k2, v2, do, cu, gran="token")
    # rows 0..99 of document 0: one key tile, two partials (one per consumer partition) added to 0 in
    # either order: the same fp32 sum, so bitwise
    assert torch.equal(a[0][:100], b[0][:100])
    # the other document: dK / dV bitwise (one program per key, no atomics); dQ up to its reduce order
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x[120:], y[120:])
    torch.testing.assert_close(a[0][120:], b[0][120:], rtol=0, atol=2e-3)


@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_work_list_carries_the_backward_entries(causal):
    """A prebuilt FP8 work list carries the backward's entries (built once per row, reused by every layer);
    gradients through it equal those of a call that builds its own: dK / dV bitwise, dQ up to its reduce."""
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list
    from flamia_pack.kernels.gluon_fp8_bwd import fp8_bwd_entries

    lens = [300, 1, 77, 700, 129]
    q, k, v, do, cu = _inputs(lens, 4, 2, seed=9)
    wl = build_fp8_work_list(cu, q.shape[0], causal=causal)
    ref = fp8_bwd_entries(cu, q.shape[0], causal=causal)
    assert wl.bwd_entries is not None and wl.bwd_entries[2] == ref[2]
    assert torch.equal(wl.bwd_entries[0], ref[0]) and torch.equal(wl.bwd_entries[1], ref[1])
    assert build_fp8_work_list(cu, q.shape[0], causal=causal, backward=False).bwd_entries is None

    def grads(work_list):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        varlen_attention(*x, cu, 700, causal=causal, precision="fp8", work_list=work_list).backward(do)
        return [t.grad for t in x]

    a, b = grads(wl), grads(None)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=2e-3)


@needs_hopper
def test_training_call_peak_memory():
    """The FP8 training call's peak beyond its own tensors (q, k, v, o, dO, dq, dk, dv bf16, lse, the saved
    codes and exponents) is the fp32 dQ accumulator, ~4 T H_q D bytes: dO's codes are freed before dQ is
    cast (with them alive at the cast the ratio was ~1.29x on S2)."""
    q, k, v, do, cu = _inputs([4096] * 4, 8, 8, seed=12)
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def call():
        varlen_attention(*x, cu, 4096, precision="fp8").backward(do)
        for t in x:
            t.grad = None

    call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    n, T, H = q.numel(), q.shape[0], q.shape[1]
    inputs = 4 * 2 * n  # q, k, v, dO (allocated before the measured call)
    own = 8 * 2 * n + 4 * H * T + 5 * n + 3 * T * H
    ratio = (torch.cuda.max_memory_allocated() - base + inputs) / own
    print(f"FP8 training call peak / own tensors: {ratio:.3f}")
    assert ratio <= 1.22


def _dq_accumulators(q, k, v, do, cu, causal, deterministic, runs, **kw):
    """``runs`` calls of the FP8 backward kernel on one forward's operands: fp32 dQ accumulators (before
    the cast), bf16 dK, dV (the launcher allocates dK / dV uninitialised on each call); ``kw`` goes to
    ``gluon_fp8_bwd``."""
    from flamia_pack.kernels.fp8_backward import quantize_do
    from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta
    from flamia_pack.kernels.gluon_fp8_bwd import gluon_fp8_bwd
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    ops = fp8_quantize(q, k, v, cu, "block", backward=True)
    o, lse = fp8_attention_forward(ops, cu, causal=causal)
    d8 = quantize_do(do, cu, "block")
    delta = fp8_bwd_delta(d8.codes, d8.exponents, o)
    out = []
    for _ in range(runs):
        out.append(gluon_fp8_bwd(ops.qc, ops.kc, ops.vc, ops.qt, ops.kt, d8.codes, d8.codes_t, exponent_table(ops.eq),
                                 ops.ekt, ops.evt, exponent_table(d8.exponents), lse, delta, cu, 128 ** -0.5,
                                 causal=causal, cast_dq=False, deterministic=deterministic, **kw))
    return out


def _bits(x):
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@needs_hopper
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_cold_call_gives_the_same_bits(poison, causal):
    """``gluon_fp8_bwd(cold_call=True)`` (the masked steps' zeroing of other documents' Q^T / dO^T columns
    compiled as a call, the launcher's choice on short-document rows) and ``cold_call=False`` give the
    same bits (``deterministic=True``, so dQ too), also with NaN codes in the neighbours' rows of
    document 1's steps, where the zeroing runs (NaN bits compared as bits)."""
    q, k, v, do, cu = _inputs([200, 150, 230], 2, 2, seed=13)
    if poison:
        q = _poison_codes(q, cu, [197, 360])
    on = _dq_accumulators(q, k, v, do, cu, causal, True, 1, cold_call=True)[0]
    off = _dq_accumulators(q, k, v, do, cu, causal, True, 1, cold_call=False)[0]
    for a, b, what in zip(on, off, ("dq", "dk", "dv")):
        assert torch.equal(_bits(a), _bits(b)), what
    assert torch.isfinite(on[1][200:350]).all() and torch.isfinite(on[0][200:350]).all()


@needs_hopper
@pytest.mark.parametrize("name", ["W4-like 1x3000", "W5-like GQA 2x1024", "W6-like unaligned", "MQA + padding",
                                  "S3 random 0"])
@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_dq_is_bitwise_reproducible(name, causal):
    """``deterministic=True``: the fp32 dQ accumulator is bitwise the same over repeated calls (a
    document's key tiles add their partials in tile order), dK / dV bitwise the default's, and dQ the
    default's up to the order of its fp32 additions. The default's own run-to-run spread is printed
    (the positive control: it is not asserted, an unordered reduce may happen to agree)."""
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, do, cu = _inputs(lens, H, Hkv, pad, seed=11)
    det = _dq_accumulators(q, k, v, do, cu, causal, True, 4)
    free = _dq_accumulators(q, k, v, do, cu, causal, False, 4)
    for run in det[1:]:
        for a, b, what in zip(run, det[0], ("dq", "dk", "dv")):
            assert torch.equal(a, b), f"{what} differs between deterministic calls"
    torch.testing.assert_close(det[0][0], free[0][0], rtol=1e-5, atol=1e-5 * float(free[0][0].abs().max()))
    assert torch.equal(det[0][1], free[0][1]) and torch.equal(det[0][2], free[0][2])
    spread = max(float((r[0] - free[0][0]).abs().max()) for r in free[1:])
    print(f"{name} causal={causal}: default dQ max run-to-run difference {spread:.3e}")


@needs_hopper
def test_deterministic_through_varlen_attention():
    """``varlen_attention(precision="fp8", deterministic=True)`` trains: the same gradients bitwise twice,
    and the fp32 reference's to the default's tolerance."""
    q, k, v, do, cu = _inputs([900, 37, 1500], 4, 2, seed=12)

    def grads():
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        varlen_attention(*x, cu, 1500, precision="fp8", deterministic=True).backward(do)
        return [t.grad for t in x]

    a, b = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    qf, kf, vf = (t.float() for t in (q, k, v))
    o, lse = packed_attention_reference(qf, kf, vf, cu, causal=True, return_lse=True)
    gr = packed_attention_reference_bwd(do.float(), qf, kf, vf, o, lse, cu, causal=True)
    for x, r in zip(a, gr):
        assert _cos(x, r) > 0.996


@needs_hopper
def test_backward_captures_in_a_cuda_graph():
    q, k, v, do, cu = _inputs([700, 300], 4, 2, seed=7)
    ops = fp8_quantize(q, k, v, cu, "block", backward=True)
    o, lse = fp8_attention_forward(ops, cu)
    eager = fp8_backward(do, ops, o, lse, cu, causal=True, softmax_scale=128 ** -0.5)
    fp8_backward(do, ops, o, lse, cu, causal=True, softmax_scale=128 ** -0.5)  # warm-up (compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_backward(do, ops, o, lse, cu, causal=True, softmax_scale=128 ** -0.5)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


@needs_hopper
def test_training_call_under_torch_compile():
    """A model function calling varlen_attention(precision="fp8") compiles with torch.compile (the FP8
    autograd node runs eagerly inside the compiled graph or at a graph break) and gives the eager
    gradients (up to dQ's unordered fp32 reduce)."""
    q, k, v, do, cu = _inputs([700, 300], 4, 2, seed=8)

    def f(q, k, v):
        return varlen_attention(q * 1.0, k, v, cu, 700, precision="fp8").float().square().sum()

    def grads(fn):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        fn(*x).backward()
        return [t.grad for t in x]

    eager = grads(f)
    compiled = grads(torch.compile(f))
    for a, b in zip(compiled, eager):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


@needs_hopper
def test_backward_without_saved_layouts_is_a_clear_error():
    q, k, v, do, cu = _inputs([256], 2, 2)
    ops = fp8_quantize(q, k, v, cu, "block")  # forward-only operands: no Q^T / K^T
    o, lse = fp8_attention_forward(ops, cu)
    with pytest.raises(FlamiaError, match="backward=True"):
        fp8_backward(do, ops, o, lse, cu, causal=True, softmax_scale=128 ** -0.5)
