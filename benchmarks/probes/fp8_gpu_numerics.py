"""Numerics of ``varlen_attention(precision="fp8")`` on the GPU, one term against two-term Q and K (``qk_terms``).

    PYTHONPATH=. python3 benchmarks/probes/fp8_gpu_numerics.py [--gpt-steps 200] [--rotation] [--granularity block,token]
        [--pv-terms]

The issues' row (4 documents x 4,096 tokens, causal, 16 heads, D 128; issue 27's O target 0.9990, issue 28's dQ /
dK / dV 0.9980 / 0.9980 / 0.9985): N(0, 1), N(0, 1) with K channels 5, 17, 40, 99 x 20, and (``--gpt-steps`` > 0)
the q, k, v entering layers 1 and 3 of the tiny GPT of ``examples/train_tiny_gpt.py`` trained on the CPU
(``fp8_numerics.gpt_capture``: D 64, 4 heads). Cosine of O / dQ / dK / dV against exact fp64 attention on the same
bf16 inputs (fresh dO), and O's max relative error ``max |O - O_ref| / max |O_ref|`` (per row: over all entries);
the GPU path as users call it (the quantizer, both kernels), each ``--granularity`` ("block" scales by default);
``--rotation`` adds ``qk_rotation="hadamard"`` with two terms, ``--pv-terms`` two-term Q, K, P~ and V (``qk_terms=2,
pv_terms=2``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from flamia_pack import varlen_attention  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd  # noqa: E402

TARGETS = (0.9990, 0.9980, 0.9980, 0.9985)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def row(name, q, k, v, cu, variants, seed=0):
    """One input: the fp64 reference on the GPU, then each ``(label, qk_terms, qk_rotation, granularity, pv_terms)``
    variant's
    cosines and O's max relative error."""
    q, k, v, cu = (t.cuda() for t in (q, k, v, cu))
    do = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu.long(), return_lse=True, compute_dtype=torch.float64)
    ref = [o_ref, *packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu.long(),
                                                  compute_dtype=torch.float64)]
    m = int((cu[1:] - cu[:-1]).max())
    for label, terms, rot, gran, pv in variants:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = varlen_attention(*leaves, cu.to(torch.int32), m, precision="fp8", qk_terms=terms, qk_rotation=rot,
                             scale_granularity=gran, pv_terms=pv)
        o.backward(do)
        cs = [_cos(a, b) for a, b in zip((o.detach(), *(t.grad for t in leaves)), ref)]
        cells = " | ".join(f"**{c:.6f}**" if c >= t else f"{c:.6f}" for c, t in zip(cs, TARGETS))
        rel = float((o.detach().double() - ref[0]).abs().max() / ref[0].abs().max())
        print(f"| {name} | {label} | {cells} | {rel:.2e} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-steps", type=int, default=200, help="0: no trained-model rows")
    ap.add_argument("--rotation", action="store_true", help="also two terms with qk_rotation='hadamard'")
    ap.add_argument("--granularity", default="block", help="comma list of block, token")
    ap.add_argument("--pv-terms", action="store_true", help="also qk_terms=2 with pv_terms=2")
    a = ap.parse_args(argv)
    variants = [(f"{lab}, {g}", t, r, g, pv) for g in a.granularity.split(",") for lab, t, r, pv in
                [("one term", 1, None, 1), ("two terms", 2, None, 1)]
                + ([("two terms + hadamard", 2, "hadamard", 1)] if a.rotation else [])
                + ([("two terms, two-term P~ V", 2, None, 2)] if a.pv_terms else [])]
    print(torch.cuda.get_device_name())
    print("| input | mode | cos O | cos dQ | cos dK | cos dV | O max rel. error |\n|---|---|---|---|---|---|---|")
    from fp8_numerics import issue_inputs

    for name, q, k, v, cu in issue_inputs(16, ("N(0,1)", "K ch x20"), a.gpt_steps, (1, 3)):
        row(name, q, k, v, cu, variants)


if __name__ == "__main__":
    main()
