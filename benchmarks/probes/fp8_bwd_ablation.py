"""Which rounding limits the FP8 gradients on peaked inputs: the two-term emulation with one rounding made exact.

    PYTHONPATH=. python3 benchmarks/probes/fp8_bwd_ablation.py [--tokens 4096] [--heads 4] [--gpt-steps 200]

Through the CPU emulation (``fp8_emulation`` / ``fp8_emulation_bwd``, ``qk_terms=2``; the GPU kernels match it to
cosine 0.9996-0.9999, benchmarks/RESULTS.md 2026-12-06 (fourth)), per input the cosine of dQ / dK / dV (and O)
against exact fp64 attention on the same bf16 inputs, for the shipped numerics and with one quantization replaced
by its exact value (patched for the run, restored after):

- ``exact dS``: the dQ and dK payloads ``U 2^-sigma`` unrounded (no E4M3);
- ``exact dO``: dO's codes its exact scaled values (dP, Delta, dV's operand);
- ``exact V``: V's codes exact (the forward's P~V and the backward's dP);
- ``exact P~ fwd``: the forward's folded P~ unrounded (O then equals softmax(S) V exactly: Delta's O);
- ``exact P~ dV``: the backward's dV payload unrounded;
- ``2-term X``: the same operand as an E4M3 code plus the E4M3 code of its residual (what a second FP8 product
  would give a kernel), and combinations joined by ``+`` (``--variants``).

Inputs: 4 documents x ``--tokens``, causal, D 128: N(0, 1) with K channels 5, 17, 40, 99 x 20; the q, k, v of
layers 1 and 3 of ``examples/train_tiny_gpt.py``'s model (``fp8_numerics.gpt_capture``, D 64, 4 heads).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(__file__))

import flamia_pack.kernels.fp8_emulation as F  # noqa: E402
import flamia_pack.kernels.fp8_emulation_bwd as B  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd  # noqa: E402
from flamia_pack.quant import UE8M0_BIAS  # noqa: E402


class _Exact(NamedTuple):
    codes: torch.Tensor
    exponents: torch.Tensor


def _exact(quantizer):
    """A ``quantize_token_blocks`` whose codes are the exact scaled values (same exponents), float32."""
    def q(x, *a, **kw):
        r = quantizer(x, *a, **kw)
        return _Exact(x.float() * torch.exp2(-(r.exponents.float() - UE8M0_BIAS))[..., None], r.exponents)
    return q


def _two_term(quantizer):
    """A ``quantize_token_blocks`` whose codes are code + residual code (``quant.residual_codes``), float32."""
    from flamia_pack.quant import residual_codes

    def q(x, *a, **kw):
        r = quantizer(x, *a, **kw)
        return _Exact(r.codes.float() + residual_codes(x, r).float(), r.exponents)
    return q


def _e4m3_two_term(y: torch.Tensor) -> torch.Tensor:
    """``y`` as an E4M3 code plus the E4M3 code of its residual (float32; no saturation: ``|y| <= 448``)."""
    hi = y.to(torch.float8_e4m3fn).float()
    return hi + (y - hi).to(torch.float8_e4m3fn).float()


@contextlib.contextmanager
def patched(variants: str, v_ptr: int):
    """``variants``: ``"shipped"`` or names joined by ``+`` ("exact X" or "2-term X", X one of dS, dO, V,
    P~ fwd, P~ dV)."""
    saved = (B._encode, B.quantize_token_blocks, F.quantize_token_blocks, F._fold_p, B._fold_p)
    for variant in variants.split("+"):
        kind, what = variant.split(" ", 1) if variant != "shipped" else ("", "")
        if what == "dS":
            B._encode = ((lambda U, sigma: U * F.pow2(-sigma)) if kind == "exact" else
                         (lambda U, sigma: _e4m3_two_term(U * F.pow2(-sigma))))
        elif what == "dO":
            B.quantize_token_blocks = (_exact if kind == "exact" else _two_term)(saved[1])
        elif what == "V":
            alt = (_exact if kind == "exact" else _two_term)(saved[2])
            F.quantize_token_blocks = lambda x, *a, alt=alt, **kw: (alt if x.data_ptr() == v_ptr else saved[2])(
                x, *a, **kw)
        elif what in ("P~ fwd", "P~ dV"):
            def folded(p, e, r, vis, boost, kind=kind):
                d = (e[:, None, :] - r[:, :, None] + boost).clamp(min=-200)
                y = torch.where(vis, p * F.pow2(d), torch.zeros((), dtype=torch.float32))
                return y if kind == "exact" else _e4m3_two_term(y)
            if what == "P~ fwd":
                F._fold_p = folded
            else:
                B._fold_p = folded
        elif variant != "shipped":
            raise ValueError(f"unknown variant {variant!r}")
    try:
        yield
    finally:
        B._encode, B.quantize_token_blocks, F.quantize_token_blocks, F._fold_p, B._fold_p = saved


VARIANTS = ("shipped", "exact dS", "exact dO", "exact V", "exact P~ fwd", "exact P~ dV")


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def row(name, q, k, v, cu, variants=VARIANTS):
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu, return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu, compute_dtype=torch.float64)
    v = v.contiguous()
    for variant in variants:
        with patched(variant, v.data_ptr()):
            o, lse8 = F.fp8_attention_forward(q, k, v, cu, qk_terms=2)
            g = B.fp8_attention_backward(do, q, k, v, o, lse8, cu, qk_terms=2)
        cs = [_cos(o, o_ref)] + [_cos(a, r) for a, r in zip(g, ref)]
        print(f"| {name} | {variant} | " + " | ".join(f"{c:.6f}" for c in cs) + " |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--gpt-steps", type=int, default=200, help="0: no trained-model rows")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list; a variant joins 'exact X' / '2-term X' by '+' (X: dS, dO, V, P~ fwd, P~ dV)")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    print("| input | variant | cos O | cos dQ | cos dK | cos dV |\n|---|---|---|---|---|---|")
    from fp8_numerics import issue_inputs

    for name, q, k, v, cu in issue_inputs(a.heads, ("K ch x20",), a.gpt_steps, (3, 1), tokens=a.tokens):
        row(name, q, k, v, cu, variants)


if __name__ == "__main__":
    main()
