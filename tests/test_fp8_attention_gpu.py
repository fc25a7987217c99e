"""GPU tests of the FP8 forward (``gluon_fp8_fwd.py`` through ``varlen_attention(precision="fp8")``).

The kernel is compared with the CPU emulation on the *same* codes and exponents (``fp8_emulation``:
the numerics contract) and with the fp32 reference: W1-W9-like rows scaled down, random S3-style rows
(1-60 unaligned documents, 1-token ones included), GQA / MQA, padding rows, causal and not, both
granularities. Outputs are NaN-poisoned before each run. Also: NaN containment per document, CUDA
graph capture with a prebuilt list, the errors of bad inputs; the kernel's variants (``pingpong=False``
gives the shipped ping-pong kernel's bits, the default accumulation in the MMA stays within the same
tolerance of the emulation). ``fp8_quantize`` writes V^T in the quantizer for bf16 inputs, so every test here also runs
that store (its own bitwise test: ``test_quantize_triton.py``).
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
from flamia_pack.kernels.fp8_attention import (build_fp8_work_list, fp8_attention_forward,  # noqa: E402
                                               fp8_kernels_available, fp8_quantize)
from flamia_pack.kernels.fp8_emulation import OperandCodes  # noqa: E402
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_forward  # noqa: E402
from flamia_pack.kernels.quantize import from_wgmma_order  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference  # noqa: E402

_HOPPER = fp8_kernels_available("cuda")
needs_hopper = pytest.mark.skipif(not _HOPPER, reason="the FP8 kernels need sm_90 and triton's Gluon")


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
from fp8_fwd_probe import _cos, _row  # noqa: E402  (the probe's inputs and its NaN-poisoned launch)
from fp8_fwd_probe import poison_with_nan_code  # noqa: E402
from fp8_fwd_probe import _kernel as _poisoned_kernel  # noqa: E402


_RNG = np.random.default_rng(27)
ROWS = {
    "W1-like 4x512": ([512] * 4, 4, 4, 0),
    "W2-like 1024 + 8x64": ([1024] + [64] * 8, 4, 4, 0),
    "W5-like GQA 2x1024": ([1024] * 2, 8, 2, 0),
    "W6-like unaligned": ([300, 1, 77, 700, 129, 128, 2, 31], 4, 2, 0),
    "W7-like 16x128": ([128] * 16, 2, 2, 0),
    "MQA + padding": ([5, 250, 1, 1, 600], 2, 1, 37),
    **{f"S3 random {i}": (list(_RNG.integers(1, 300, _RNG.integers(1, 60))), 2, 1, int(_RNG.integers(0, 50)))
       for i in range(4)},
}


@needs_hopper
@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("gran", ["block", "token"])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_matches_emulation_and_reference(name, gran, causal):
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, cu = _row(lens, H, Hkv, pad, seed=len(name))
    ops = fp8_quantize(q, k, v, cu, gran)
    o, lse = _poisoned_kernel(ops, cu, causal)
    vc = from_wgmma_order(ops.vt, ops.qc.shape[0]).permute(2, 0, 1).contiguous()
    quant = tuple(OperandCodes(c.cpu(), e.cpu()) for c, e in ((ops.qc, ops.eq), (ops.kc, ops.ek), (vc, ops.ev)))
    oe, lsee = emulated_forward(None, None, None, cu.cpu(), causal=causal, scale_granularity=gran, quantized=quant)
    n = int(cu[-1])
    assert not o.isnan().any() and not lse.isnan().any()
    assert bool((o[n:] == 0).all()) and bool(torch.isinf(lse[:, n:]).all())
    # kernel vs emulation on the same codes: MUFU exp2 and the tree sums of l differ by ulps, which
    # can move a P~ across an E4M3 rounding boundary (one E4M3 ulp, 2^-3 relative, of one term), and
    # the FP8 MMA accumulates with fewer bits: close as a whole, a few bf16 ulps at worst
    oc = o.float().cpu()[:n]
    cos_emu, d_max = _cos(oc, oe[:n]), float((oc - oe[:n].float()).abs().max())
    d_lse = float((lse[:, :n].cpu() - lsee[:, :n]).abs().max())
    assert cos_emu > 0.9999 and d_max < 0.125 and d_lse < 2e-3, (cos_emu, d_max, d_lse)
    ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=causal)
    assert _cos(o[:n], ref[:n]) > 0.998, _cos(o[:n], ref[:n])


@needs_hopper
@pytest.mark.parametrize("name", ["W6-like unaligned", "MQA + padding", "S3 random 1"])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_variants(name, causal):
    """Ping-pong only reorders the partitions' issue: ``pingpong=False`` gives the same bits, and so does
    ``masked_tile0`` either way (the launcher picks it by the mean document length). The launcher's
    default accumulates P~V in the MMA across tiles: within the tolerance above of the emulation's fp32
    accumulation (per-tile promotion, ``pv_promote=True``, against it: the probe's measurement,
    fp8_fwd_probe.py --variants pp1,promote)."""
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, cu = _row(lens, H, Hkv, pad, seed=len(name) + 1)
    ops = fp8_quantize(q, k, v, cu, "block")
    n = int(cu[-1])
    o1, lse1 = _poisoned_kernel(ops, cu, causal, pv_promote=False)  # accumulating in the MMA, ping-pong
    o0, lse0 = _poisoned_kernel(ops, cu, causal, pingpong=False, pv_promote=False)
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1)
    op, lsep = _poisoned_kernel(ops, cu, causal)  # the launcher's defaults (accumulating in the MMA)
    assert not op.isnan().any() and bool((op[n:] == 0).all())
    for masked in (False, True):  # tile 0 masked or not: the same bits (the mask-free form is exact there)
        om, lsem = _poisoned_kernel(ops, cu, causal, masked_tile0=masked)
        assert torch.equal(om, op) and torch.equal(lsem, lsep), masked
    assert float((lsep[:, :n] - lse1[:, :n]).abs().max()) < 1e-5  # the same softmax: P~V only moves O
    vc = from_wgmma_order(ops.vt, ops.qc.shape[0]).permute(2, 0, 1).contiguous()
    quant = tuple(OperandCodes(c.cpu(), e.cpu()) for c, e in ((ops.qc, ops.eq), (ops.kc, ops.ek), (vc, ops.ev)))
    oe, _ = emulated_forward(None, None, None, cu.cpu(), causal=causal, quantized=quant)
    d_p = float((op.float().cpu()[:n] - oe[:n].float()).abs().max())
    d_1 = float((o1.float().cpu()[:n] - oe[:n].float()).abs().max())
    assert _cos(op.float().cpu()[:n], oe[:n]) > 0.9999 and d_p < 0.125, (d_p, d_1)


@needs_hopper
@pytest.mark.parametrize("kw", [
    {},  # the shipped default: accumulating in the MMA, its rescale bounded by the reference floors
    {"pv_promote": True},
])
def test_a_zero_v_tile_stays_finite(kw):
    """A whole 128-key tile of zero V inside a document drops its fold reference to the zero groups'
    exponent: without the running floor (2^-64 of the row's largest reference) the accumulating kernel's
    rescale 2^(r_old - r_new) ~ 2^110 would overflow (benchmarks/NOTES.md, open question 13)."""
    q, k, v, cu = _row([512], 1, 1, seed=11)
    v[128:256] = 0  # one whole 128-key tile of zero V inside the document
    o, _ = _poisoned_kernel(fp8_quantize(q, k, v, cu, "block"), cu, True, **kw)
    assert bool(torch.isfinite(o).all())
    ref = packed_attention_reference(q.float(), k.float(), v.float(), cu)
    assert _cos(o, ref) > 0.998


@needs_hopper
def test_public_call_and_graph_capture():
    q, k, v, cu = _row([700, 300, 24], 4, 2, pad=8)
    o = varlen_attention(q, k, v, cu, 700, precision="fp8")
    ref = packed_attention_reference(q.float(), k.float(), v.float(), cu)
    assert _cos(o[:1024], ref[:1024]) > 0.998
    wl = build_fp8_work_list(cu, q.shape[0])
    out = torch.empty_like(o)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(varlen_attention(q, k, v, cu, 700, precision="fp8", work_list=wl))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(varlen_attention(q, k, v, cu, 700, precision="fp8", work_list=wl))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o)


@needs_hopper
def test_nan_stays_in_its_document():
    q, k, v, cu = _row([400, 300, 500], 2, 2, seed=9)
    clean = varlen_attention(q, k, v, cu, 500, precision="fp8")
    k[450, 0, 3] = float("nan")
    v[420, 1, 7] = float("inf")
    bad = varlen_attention(q, k, v, cu, 500, precision="fp8")
    keep = torch.cat([torch.arange(0, 400), torch.arange(700, 1200)]).cuda()
    assert torch.equal(bad[keep], clean[keep])
    assert not torch.isfinite(bad[400:700]).all()


@needs_hopper
def test_nan_in_the_neighbours_tile_columns_stays_out():
    """A non-finite V group that another document's key tile holds in its masked columns: document 1's
    first group (tokens 400-431, in document 0's last tile 384-511) and its last (688-699, in the tile
    document 2 starts at 700 reads from 688): the kernel zeroes those columns only where the factor
    table marks such a group, and documents 0 and 2 stay bitwise the clean run's. The poison makes a real
    NaN code (``poison_with_nan_code``: a NaN input alone encodes as a finite code)."""
    from flamia_pack.kernels.fp8_attention import fp8_quantize

    q, k, v, cu = _row([400, 300, 500], 2, 2, seed=10)
    clean = varlen_attention(q, k, v, cu, 500, precision="fp8")
    for t, h in ((401, 0), (695, 1)):
        poison_with_nan_code(v, t, h)
    ops = fp8_quantize(q, k, v, cu)
    for t, h in ((401, 0), (695, 1)):
        assert torch.isnan(from_wgmma_order(ops.vt, 1200)[h, :, t].float()).any(), "the poison did not make a NaN code"
    bad = varlen_attention(q, k, v, cu, 500, precision="fp8")
    keep = torch.cat([torch.arange(0, 400), torch.arange(700, 1200)]).cuda()
    assert torch.equal(bad[keep], clean[keep])


@needs_hopper
def test_token_mode_is_causal_bitwise():
    q, k, v, cu = _row([600, 500], 2, 2, seed=4)
    base = varlen_attention(q, k, v, cu, 600, precision="fp8", scale_granularity="token")
    k2, v2 = k.clone(), v.clone()
    k2[301:600] = torch.randn_like(k2[301:600]) * 50  # the future of document 0 after the cut at 300
    v2[301:600] = torch.randn_like(v2[301:600]) * 50
    moved = varlen_attention(q, k2, v2, cu, 600, precision="fp8", scale_granularity="token")
    assert torch.equal(moved[:301], base[:301]) and torch.equal(moved[600:], base[600:])


@needs_hopper
def test_bad_inputs_are_clear_errors():
    q, k, v, cu = _row([256], 2, 2)
    with pytest.raises(FlamiaError, match=r"head_dim must be one of \(64, 128\)"):
        varlen_attention(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous(), cu, 256,
                         precision="fp8")
    with pytest.raises(FlamiaError, match="bfloat16"):
        varlen_attention(q.half(), k.half(), v.half(), cu, 256, precision="fp8")
    with pytest.raises(FlamiaError, match="work list"):
        from flamia_pack.kernels.attention import build_attention_work_list
        varlen_attention(q, k, v, cu, 256, precision="fp8", work_list=build_attention_work_list(cu, 256))
    ops = fp8_quantize(q.detach(), k, v, cu)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_attention_forward(ops._replace(qc=q.detach()), cu)
