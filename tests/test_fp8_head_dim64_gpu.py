"""GPU tests of the FP8 path at head_dim 64 (the Gluon FP8 forward and backward compiled with HEAD_DIM 64).

Forward: the kernel against the CPU emulation on the same codes and against the fp32 reference; backward:
the gradients against the fp32 reference's, with the thresholds of the D = 128 tests
(``test_fp8_attention_gpu.py``, ``test_fp8_backward_gpu.py``); rows with unaligned documents, GQA, padding,
causal and not. Outputs are NaN-poisoned (the launchers allocate them uninitialised: a row no program
writes fails the comparison).
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

from flamia_pack.kernels import varlen_attention  # noqa: E402
from flamia_pack.kernels.fp8_attention import fp8_kernels_available, fp8_quantize  # noqa: E402
from flamia_pack.kernels.fp8_emulation import OperandCodes  # noqa: E402
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_forward  # noqa: E402
from flamia_pack.kernels.quantize import from_wgmma_order  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
from fp8_fwd_probe import _cos  # noqa: E402
from fp8_fwd_probe import _kernel as _poisoned_kernel  # noqa: E402  (NaN-poisoned outputs)

needs_hopper = pytest.mark.skipif(not fp8_kernels_available("cuda"), reason="the FP8 kernels need sm_90 and Gluon")

D = 64
ROWS = {
    "4x512": ([512] * 4, 4, 4, 0),
    "GQA 2x700": ([700, 700], 8, 2, 0),
    "unaligned": ([300, 1, 77, 700, 129, 128, 2, 31], 4, 2, 0),
    "MQA + padding": ([5, 250, 1, 1, 600], 2, 1, 37),
}


def _inputs(lens, H, Hkv, pad, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lens)) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((T, h, D), device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    do = torch.randn((T, H, D), device="cuda", generator=g).bfloat16()
    return q, k, v, do, cu


@needs_hopper
@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_emulation_and_reference(name, causal):
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, _, cu = _inputs(lens, H, Hkv, pad, seed=len(name))
    ops = fp8_quantize(q, k, v, cu, "block")
    o, lse = _poisoned_kernel(ops, cu, causal)
    vc = from_wgmma_order(ops.vt, ops.qc.shape[0]).permute(2, 0, 1).contiguous()
    quant = tuple(OperandCodes(c.cpu(), e.cpu()) for c, e in ((ops.qc, ops.eq), (ops.kc, ops.ek), (vc, ops.ev)))
    oe, lsee = emulated_forward(None, None, None, cu.cpu(), causal=causal, scale_granularity="block", quantized=quant)
    n = int(cu[-1])
    assert not o.isnan().any() and not lse.isnan().any()
    oc = o.float().cpu()[:n]
    cos_emu, d_max = _cos(oc, oe[:n]), float((oc - oe[:n].float()).abs().max())
    d_lse = float((lse[:, :n].cpu() - lsee[:, :n]).abs().max())
    assert cos_emu > 0.9999 and d_max < 0.125 and d_lse < 2e-3, (cos_emu, d_max, d_lse)
    ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=causal)
    assert _cos(o[:n], ref[:n]) > 0.998
    if pad:
        assert (o[n:] == 0).all()


@needs_hopper
@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(name, causal):
    lens, H, Hkv, pad = ROWS[name]
    q, k, v, do, cu = _inputs(lens, H, Hkv, pad, seed=3 + len(name))
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    varlen_attention(*x, cu, int(max(lens)), causal=causal, precision="fp8").backward(do)
    qf, kf, vf = (t.float() for t in (q, k, v))
    o, lse = packed_attention_reference(qf, kf, vf, cu, causal=causal, return_lse=True)
    gr = packed_attention_reference_bwd(do.float(), qf, kf, vf, o, lse, cu, causal=causal)
    for what, a, r, floor in zip(("dq", "dk", "dv"), [t.grad for t in x], gr, (0.996, 0.996, 0.997)):
        assert torch.isfinite(a).all(), what
        assert _cos(a, r) > floor, f"{what}: cosine {_cos(a, r):.5f}"
        if pad:
            assert (a[-pad:] == 0).all(), what
