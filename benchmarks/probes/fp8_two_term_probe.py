"""The FP8 forward kernel with two-term Q and K (``gluon_fp8_fwd(qc_lo=, kc_lo=)``) on the GPU: correct, and what it costs.

    PYTHONPATH=. python3 benchmarks/probes/fp8_two_term_probe.py [--rows W1,W3,W7] [--rep 100] \
        [--parts check,kernels,call]

1. **check** (unaligned rows, MHA and GQA, causal and not, "block" and "token"): the kernel with the residual codes
   (``quant.residual_codes`` of the forward's own codes, made with torch on the GPU) against the CPU emulation's
   ``qk_terms=2`` forward and both kernels against the fp64 reference (:func:`lse_ok` is the rule: the codes are
   bitwise the same, the rest differs by MUFU ex2 and the MMA's truncated accumulation, as for one term); the
   backward kernel with the same codes (``gluon_fp8_bwd(qc_lo=, kc_lo=, kt_lo=)``) against the emulation's
   ``qk_terms=2`` backward (gradient cosines > 0.999);
2. **time**: ``triton.testing.do_bench`` medians of each kernel alone (the forward; the backward incl. its dQ
   accumulator's allocation and cast), one term against two terms, same process, on the WORKLOADS rows (16 heads,
   D 128), with the forward's TFLOP/s of the one-term product count; timed whether the check passed or not;
3. **call**: ``varlen_attention(precision="fp8")`` with ``qk_terms`` 1 / 2 (and 2 with ``qk_rotation``): the forward
   call and the training call, quantizer included (:func:`call_speed`).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_quantize  # noqa: E402
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated  # noqa: E402
from flamia_pack.kernels.gluon_fp8_fwd import gluon_fp8_fwd  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference  # noqa: E402
from flamia_pack.quant import Quantized, residual_codes  # noqa: E402


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def residuals(q, k, ops):
    """The residual codes of the forward's own Q and K codes (two-term operands), on q's device."""
    return (residual_codes(q, Quantized(ops.qc, ops.eq)).contiguous(),
            residual_codes(k, Quantized(ops.kc, ops.ek)).contiguous())


def run_kernel(q, k, v, cu, causal, gran, two, wl=None):
    ops = fp8_quantize(q, k, v, cu, gran)
    wl = wl or build_fp8_work_list(cu, q.shape[0], causal=causal, validate=False)
    lo = residuals(q, k, ops) if two else (None, None)
    o, lse = gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items,
                           q.shape[2] ** -0.5, causal=causal, skip_len=0, qc_lo=lo[0], kc_lo=lo[1])
    return o, lse, ops, lo, wl


def backward_launch(q, k, v, do, cu, two):
    """The FP8 forward kernel (one or two terms, block granularity, causal) run once, and a closure that launches
    the backward kernel on its outputs: ``(launch, o, lse)``, ``launch() -> (dq, dk, dv)``. dO's codes, Delta and the
    tables as ``fp8_backward`` makes them; K^T's residual codes in K^T's layout."""
    from fp8_bwd_probe import quantize_do

    from flamia_pack.kernels.flash_fwd import fill_tails
    from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta
    from flamia_pack.kernels.gluon_fp8_bwd import fp8_bwd_entries, gluon_fp8_bwd
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    T = q.shape[0]
    ops = fp8_quantize(q, k, v, cu, "block", backward=True)
    wl = build_fp8_work_list(cu, T, causal=True, validate=False)
    qlo, klo = residuals(q, k, ops) if two else (None, None)
    ktlo = None
    if two:
        ktlo = torch.zeros(ops.kt.shape[:2] + (ops.kt.stride(1),), dtype=klo.dtype, device=q.device)[:, :, :T]
        ktlo.copy_(klo.permute(1, 2, 0))
    o, lse = gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items,
                           q.shape[2] ** -0.5, skip_len=0, qc_lo=qlo, kc_lo=klo)
    fill_tails([(o, 0.0, 0), (lse, float("inf"), 1)], cu)
    d8 = quantize_do(do, cu)
    delta = fp8_bwd_delta(d8.codes, d8.exponents, o)
    tables = (exponent_table(ops.eq), ops.ekt, ops.evt, exponent_table(d8.exponents))
    entries = fp8_bwd_entries(cu, T)

    def launch():
        return gluon_fp8_bwd(ops.qc, ops.kc, ops.vc, ops.qt, ops.kt, d8.codes, d8.codes_t, *tables, lse, delta, cu,
                             q.shape[2] ** -0.5, entries=entries, qc_lo=qlo, kc_lo=klo, kt_lo=ktlo)
    return launch, o, lse


def run_backward(q, k, v, do, cu, two):
    """``(o, lse, dq, dk, dv)`` of the FP8 forward and backward kernels, one or two terms (:func:`backward_launch`)."""
    launch, o, lse = backward_launch(q, k, v, do, cu, two)
    return (o, lse, *launch())


def forward_errors(q, k, v, cu, causal, gran) -> dict:
    """The two-term and one-term forward kernels against their emulations and the fp64 reference on one row:
    O cosines (``cos_em`` two-term kernel vs emulation, ``cos2`` / ``cos1`` vs fp64) and max |LSE| differences
    (``dl2`` / ``dl1`` kernel vs its emulation, ``err2`` / ``err1`` vs fp64), over the row's real tokens."""
    n = int(cu[-1])
    o2, lse2, *_ = run_kernel(q, k, v, cu, causal, gran, True)
    o1, lse1, *_ = run_kernel(q, k, v, cu, causal, gran, False)
    args = (q.cpu(), k.cpu(), v.cpu(), cu.cpu())
    oe2, lsee2 = emulated(*args, causal=causal, scale_granularity=gran, qk_terms=2)
    _, lsee1 = emulated(*args, causal=causal, scale_granularity=gran)
    ref, lse_ref = packed_attention_reference(q.double(), k.double(), v.double(), cu.long(), causal=causal,
                                              compute_dtype=torch.float64, return_lse=True)

    def dmax(a, b):
        return float((a[:, :n].double().cpu() - b[:, :n].double().cpu()).abs().max())

    return dict(cos_em=_cos(o2[:n].cpu(), oe2[:n]), cos2=_cos(o2[:n], ref[:n]), cos1=_cos(o1[:n], ref[:n]),
                dl2=dmax(lse2, lsee2), dl1=dmax(lse1, lsee1), err2=dmax(lse2, lse_ref), err1=dmax(lse1, lse_ref),
                finite=bool(torch.isfinite(o2[:n]).all() and torch.isfinite(lse2[:, :n]).all()))


def lse_ok(r: dict) -> bool:
    """The two-term kernel's pass rule: O within 0.9999 of its emulation; its max |LSE| gap to the emulation at most
    1.5x the one-term kernel's gap to its own, or 2e-3 where that is larger (the emulation sums S exactly, the MMA
    truncates its running sum after every k-step, ``fp8_emulation.MMA_ACC_BITS``: both kernels see the same four
    k-steps of ``Q K^T`` at full size; measured 0.7-1.4x); closer to fp64 than one term in O and LSE."""
    return (r["finite"] and r["cos_em"] > 0.9999 and r["dl2"] <= max(2e-3, 1.5 * r["dl1"])
            and r["cos2"] > r["cos1"] and r["err2"] < r["err1"])


def check() -> bool:
    ok = True
    rows = [([300, 1, 77, 700, 129], 4, 2), ([1024] * 2, 4, 4), ([5, 250, 1, 600], 2, 1)]
    for lens, H, Hkv in rows:
        for causal in (True, False):
            for gran in ("block", "token"):
                g = torch.Generator(device="cuda").manual_seed(len(lens))
                T = sum(lens) + 7
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                q = torch.randn((T, H, 128), generator=g, device="cuda").bfloat16()
                k, v = (torch.randn((T, Hkv, 128), generator=g, device="cuda").bfloat16() for _ in range(2))
                k[:, :, [5, 17, 40, 99]] *= 20
                n = int(cu[-1])
                r = forward_errors(q, k, v, cu, causal, gran)
                good = lse_ok(r)
                ok &= good
                print(f"| {lens[:5]} H {H}/{Hkv} | {'causal' if causal else 'full'} | {gran} | kernel vs emulation: O "
                      f"cos {r['cos_em']:.6f}, max |dLSE| two terms {r['dl2']:.1e}, one term {r['dl1']:.1e} | vs fp64: "
                      f"O cos two terms {r['cos2']:.6f}, one term {r['cos1']:.6f}; max |dLSE| two terms "
                      f"{r['err2']:.1e}, one term {r['err1']:.1e} | {'ok' if good else 'FAIL'} |", flush=True)
    from flamia_pack.kernels.fp8_emulation_bwd import fp8_attention_backward

    for lens, H, Hkv in rows:
        g = torch.Generator(device="cuda").manual_seed(7 + len(lens))
        T = sum(lens) + 7
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, do = (torch.randn((T, H, 128), generator=g, device="cuda").bfloat16() for _ in range(2))
        k, v = (torch.randn((T, Hkv, 128), generator=g, device="cuda").bfloat16() for _ in range(2))
        k[:, :, [5, 17, 40, 99]] *= 20
        n = int(cu[-1])
        got = run_backward(q, k, v, do, cu, True)
        oe, lsee = emulated(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), qk_terms=2)
        ge = fp8_attention_backward(do.cpu(), q.cpu(), k.cpu(), v.cpu(), oe, lsee, cu.cpu(), qk_terms=2)
        cs = [_cos(a[:n].cpu(), b[:n]) for a, b in zip(got[2:], ge)]
        good = min(cs) > 0.999 and all(bool(torch.isfinite(x[:n]).all()) for x in got[2:])
        ok &= good
        print(f"| {lens[:5]} H {H}/{Hkv} | backward, kernel vs emulation: dQ / dK / dV cos "
              f"{' / '.join(f'{c:.5f}' for c in cs)} | {'ok' if good else 'FAIL'} |", flush=True)
    return ok


def speed(rows, rep):
    import triton

    import bench_attention as B
    from flamia_pack.scheduler.cost import attention_flops
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    print("| row | forward one term ms | two terms ms | ratio | one term TFLOP/s | backward one term ms | two terms ms | "
          "ratio |\n|---|---|---|---|---|---|---|---|")
    for name in rows:
        inp = B.make_inputs(workload_lengths(name), WORKLOADS[name]["num_heads"], WORKLOADS[name]["num_kv_heads"],
                            seed=3, device="cuda")
        q, k, v, cu = inp["q"], inp["k"], inp["v"], inp["cu"]
        wl = build_fp8_work_list(cu, q.shape[0], causal=True, validate=False)
        ops = fp8_quantize(q, k, v, cu, "block")
        qlo, klo = residuals(q, k, ops)
        t = {}
        for two in (False, True):
            kw = dict(qc_lo=qlo, kc_lo=klo) if two else {}

            def fn(kw=kw):
                return gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items,
                                     q.shape[2] ** -0.5, skip_len=0, **kw)
            fn()
            t[two] = triton.testing.do_bench(fn, rep=rep)
        flops = attention_flops(workload_lengths(name), WORKLOADS[name]["num_heads"], 128)
        tb = {}
        for two in (False, True):
            launch, _, _ = backward_launch(q, k, v, inp["do"], cu, two)
            launch()
            tb[two] = triton.testing.do_bench(launch, rep=rep)
        print(f"| {name} | {t[False]:.3f} | {t[True]:.3f} | {t[True] / t[False]:.3f} | "
              f"{flops / t[False] / 1e9:.0f} | {tb[False]:.3f} | {tb[True]:.3f} | {tb[True] / tb[False]:.3f} |",
              flush=True)
        del inp
        torch.cuda.empty_cache()


def call_speed(rows, rep):
    """``varlen_attention(precision="fp8")`` as users call it, ``qk_terms`` 1 and 2 (and 2 with ``qk_rotation``), same
    process, prebuilt work list: the forward call (no grad; the quantizer included) and the training call (forward +
    backward); medians of ``bench_attention.time_ms``."""
    import bench_attention as B

    from flamia_pack import varlen_attention
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    variants = (("one term", 1, None), ("two terms", 2, None), ("two terms + hadamard", 2, "hadamard"))
    print("| row | " + " | ".join(f"fwd call {v[0]} ms" for v in variants) + " | "
          + " | ".join(f"training call {v[0]} ms" for v in variants) + " | two / one: fwd, training |\n"
          + "|---" * (2 * len(variants) + 2) + "|")
    for name in rows:
        inp = B.make_inputs(workload_lengths(name), WORKLOADS[name]["num_heads"], WORKLOADS[name]["num_kv_heads"],
                            seed=3, device="cuda")
        cu, m = inp["cu"], inp["max_seqlen"]
        wl = build_fp8_work_list(cu, inp["T"], causal=True, validate=False)
        leaves = [inp[x].clone().requires_grad_() for x in ("q", "k", "v")]
        fwd, train = [], []
        for _, terms, rot in variants:
            kw = dict(precision="fp8", qk_terms=terms, qk_rotation=rot, work_list=wl)

            def f(kw=kw):
                with torch.no_grad():
                    return varlen_attention(inp["q"], inp["k"], inp["v"], cu, m, **kw)

            def t(kw=kw):
                varlen_attention(*leaves, cu, m, **kw).backward(inp["do"])

            f()
            t()
            fwd.append(B.time_ms(f, rep=rep))
            train.append(B.time_ms(t, grad_to_none=leaves, rep=rep))
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in fwd + train)
              + f" | {fwd[1] / fwd[0]:.3f}, {train[1] / train[0]:.3f} |", flush=True)
        del inp, leaves
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="W1,W3,W7")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--parts", default="check,kernels,call", help="comma list of check, kernels, call")
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    print(torch.cuda.get_device_name())
    if "check" in parts:
        ok = check()
        print("check:", "all ok" if ok else "FAILED", flush=True)
    if "kernels" in parts:
        speed(a.rows.split(","), a.rep)
    if "call" in parts:
        call_speed(a.rows.split(","), a.rep)


if __name__ == "__main__":
    main()
