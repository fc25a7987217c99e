"""Numerics of the FP8 backward on the issue's three inputs, through its CPU emulation (CPU only).

The Gluon FP8 backward follows :mod:`flamia_pack.kernels.fp8_emulation_bwd` (its contract, bitwise up
to the fp32 order of the dQ reduce; the GPU gradients' cosines to fp32 equal the emulation's on N(0, 1),
benchmarks/RESULTS.md 2026-12-02), so the emulation's error against exact attention is the kernel's.
Per input: cosine of dQ / dK / dV against the fp64 exact gradients on the same bf16 inputs, the
gradient norm ratios, the dS zero fraction of each payload, the signed row-sum residual of the decoded
dQ payload, and the positive control (S recomputed from the unquantized q, k: P no longer matches the
saved LSE; with two terms S is close to that already, so this one is weak there) and the second control (Delta from
the unquantized dO while dP reads its codes) that must show the residual / norm blow-up. The last two columns split the error: the FP8
backward against exact attention on the forward's dequantized inputs q^, k^, v^ (the backward's own
error), and exact attention on q^, k^, v^ against exact attention on q, k, v (the input quantization's).

Inputs: N(0, 1); N(0, 1) with K channels 5, 17, 40, 99 x 20; the q, k, v entering a layer of the
tiny GPT of ``examples/train_tiny_gpt.py`` trained on the CPU (``fp8_numerics.gpt_capture``, head_dim
64). Rows are shorter than the GPU probe's 4 x 4096 for CPU time (``--tokens``).

    PYTHONPATH=. python3 benchmarks/probes/fp8_bwd_numerics.py --tokens 1024 --heads 2 --gpt-steps 200

``--qk-terms 1,2`` adds the emulation's two-term Q / K mode (``qk_terms=2``) beside the shipped one, ``--pv-terms``
two-term Q, K, P~ and V (``qk_terms=2, pv_terms=2``); the issues' row is ``--tokens 4096 --heads 4`` (about 10 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from flamia_pack.kernels.fp8_emulation import fp8_attention_forward  # noqa: E402
from flamia_pack.kernels.fp8_emulation_bwd import fp8_attention_backward  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd  # noqa: E402
from flamia_pack.quant import quantize_token_blocks, residual_codes  # noqa: E402


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _dequantized(x, cu, gran, two_term=False):
    """float64 ``codes 2^e`` of ``x`` under the FP8 forward's quantization (what its attention sees);
    ``two_term``: ``(codes + residual codes) 2^e`` (``qk_terms=2``'s Q and K)."""
    r = quantize_token_blocks(x, cu, gran)
    c = r.codes.double() + (residual_codes(x, r).double() if two_term else 0.0)
    return c * torch.exp2(r.exponents.double() - 127)[..., None]


def row(name, q, k, v, cu, gran, seed=0, qk_terms=1, pv_terms=1):
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse_ref = packed_attention_reference(qd, kd, vd, cu, return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse_ref, cu, compute_dtype=torch.float64)
    o, lse = fp8_attention_forward(q, k, v, cu, scale_granularity=gran, qk_terms=qk_terms, pv_terms=pv_terms)
    cos_o = _cos(o, o_ref)
    out = []
    for mismatch in (None, "bf16_scores", "bf16_delta"):
        st = {}
        g = fp8_attention_backward(do, q, k, v, o, lse, cu, scale_granularity=gran, stats=st, mismatch=mismatch,
                                   qk_terms=qk_terms, pv_terms=pv_terms)
        cos = [_cos(a, r) for a, r in zip(g, ref)]
        nr = [float(a.double().norm() / r.norm()) for a, r in zip(g, ref)]
        if mismatch is None:
            st["_grads"] = g
        out.append((mismatch, cos, nr, st))
    (_, c, n, st), (_, cc, nc, sc), (_, _, _, sd) = out
    # where the error comes from: exact attention on the forward's dequantized inputs q^, k^, v^
    qh, kh, vh = (_dequantized(t, cu, gran, two)
                  for t, two in ((q, qk_terms == 2), (k, qk_terms == 2), (v, pv_terms == 2)))
    oh, lseh = packed_attention_reference(qh, kh, vh, cu, return_lse=True, compute_dtype=torch.float64)
    refh = packed_attention_reference_bwd(do.double(), qh, kh, vh, oh, lseh, cu, compute_dtype=torch.float64)
    g = out[0][3].pop("_grads")
    vs_hat = " / ".join(f"{_cos(a, r):.5f}" for a, r in zip(g, refh))
    hat_vs_exact = " / ".join(f"{_cos(a, r):.5f}" for a, r in zip(refh, ref))
    mode = f"{gran}{' two-term' if qk_terms == 2 else ''}{' + P~ V' if pv_terms == 2 else ''}"
    print(f"| {name} | {mode} | {cos_o:.6f} | {c[0]:.5f} | {c[1]:.5f} | {c[2]:.5f} | {n[0]:.4f} / {n[1]:.4f} / {n[2]:.4f} | "
          f"{st['ds_zero_fraction']:.2e} / {st['ds_zero_fraction_dk']:.2e} | {st['ds_row_residual']:+.2e} "
          f"(rms {st['ds_row_residual_rms']:.2e}) | control: dQ cos {cc[0]:.4f}, norm {nc[0]:.3f}, residual rms "
          f"{sc['ds_row_residual_rms']:.2e}; bf16 Delta: residual rms {sd['ds_row_residual_rms']:.2e} | {vs_hat} | {hat_vs_exact} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per document (4 documents)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--gpt-steps", type=int, default=200, help="0: no trained-model row")
    ap.add_argument("--gpt-layer", type=int, default=1)
    ap.add_argument("--qk-terms", default="1", help="1, 2 or 1,2: the emulation's qk_terms (2: two-term Q and K)")
    ap.add_argument("--pv-terms", action="store_true", help="also qk_terms=2 with pv_terms=2 (two-term P~ and V)")
    a = ap.parse_args(argv)
    L, H = a.tokens, a.heads
    cu = torch.tensor([0, L, 2 * L, 3 * L, 4 * L])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn((4 * L, H, 128), generator=g).bfloat16() for _ in range(3))
    k_out = k.clone()
    k_out[:, :, [5, 17, 40, 99]] *= 20
    terms = [(int(t), 1) for t in a.qk_terms.split(",")] + ([(2, 2)] if a.pv_terms else [])
    print("| input | mode | cos O | cos dQ | cos dK | cos dV | norm ratio dQ / dK / dV | dS zero fraction dQ / dK payload |"
          " row residual | positive controls (bf16 scores; bf16 Delta) | dQ / dK / dV vs exact on q^, k^, v^ |"
          " exact on q^, k^, v^ vs exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t, pv in terms:
        for gran in ("block", "token"):
            row("N(0,1)", q, k, v, cu, gran, qk_terms=t, pv_terms=pv)
        row("K ch x20", q, k_out, v, cu, "block", qk_terms=t, pv_terms=pv)
    if a.gpt_steps:
        from fp8_numerics import gpt_capture

        layers, gcu = gpt_capture(a.gpt_steps)
        gq, gk, gv = layers[a.gpt_layer]
        n = min(int(gcu[-1]), 4 * L)
        keep = gcu[gcu <= n]
        gcu = torch.cat([keep, torch.tensor([n])]) if int(keep[-1]) < n else keep
        for t, pv in terms:
            row(f"GPT L{a.gpt_layer}", gq[:n], gk[:n], gv[:n], gcu, "block", qk_terms=t, pv_terms=pv)


if __name__ == "__main__":
    main()
