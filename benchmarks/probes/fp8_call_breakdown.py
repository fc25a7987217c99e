"""Where the FP8 training call's time goes outside the two kernels (issue 27 / 28; NOTES open item 14).

Times every piece of ``varlen_attention(precision="fp8")``'s forward and backward separately on the
GPU (``triton.testing.do_bench`` medians, each piece on inputs prepared once) and prints it next to the
bytes it moves and their HBM floor (4.8 TB/s), then the whole call through autograd and the sum of the
pieces: the rest is host / autograd overhead (launches of a small row are host-bound). Rows: the
WORKLOADS names (H_q 16, D 128; W5 GQA 16/4).

    PYTHONPATH=. python3 benchmarks/probes/fp8_call_breakdown.py [--rows W1,W4,W7]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

HBM = 4.8e12  # H200 HBM3e bytes/s


def _pieces(q, k, v, do, cu):
    """``[(name, bytes, fn)]``: each piece of the FP8 training call on prepared inputs."""
    from fp8_bwd_probe import _kernel_only, prepared_backward, quantize_do

    from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_attention_forward, fp8_quantize
    from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta
    from flamia_pack.kernels.gluon_fp8_bwd import fp8_bwd_entries
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    T, H, D = q.shape
    Hkv = k.shape[1]
    n_q, n_kv = T * H * D, T * Hkv * D
    wl = build_fp8_work_list(cu, T, causal=True, validate=False)
    b = prepared_backward(q, k, v, do, cu, work_list=wl)
    ops, d8 = b["ops"], b["d8"]
    acc = torch.zeros((T, H, D), dtype=torch.float32, device=q.device)

    return [
        ("fwd: work list", 0, lambda: build_fp8_work_list(cu, T, causal=True, validate=False)),
        # reads bf16 q, k, v; writes codes row-major + feature-major for q, k, v (+ V row-major)
        ("fwd: quantize q, k, v (both layouts)", 2 * (n_q + 2 * n_kv) + 2 * (n_q + 2 * n_kv),
         lambda: fp8_quantize(q, k, v, cu, "block", backward=True)),
        ("fwd: kernel", n_q + 2 * n_kv + 2 * n_q, lambda: fp8_attention_forward(ops, cu, work_list=wl)),
        ("bwd: quantize dO (both layouts)", 2 * n_q + 2 * n_q, lambda: quantize_do(do, cu)),
        ("bwd: Delta", n_q + 2 * n_q, lambda: fp8_bwd_delta(d8.codes, d8.exponents, b["o"])),
        ("bwd: factor tables (q, dO)", 0, lambda: (exponent_table(ops.eq), exponent_table(d8.exponents))),
        ("bwd: entries", 0, lambda: fp8_bwd_entries(cu, T)),
        ("bwd: dQ accumulator zeroed", 4 * n_q, lambda: acc.zero_()),
        ("bwd: kernel (incl. zeroing, dQ cast)", 0, _kernel_only(q, k, v, do, cu, dq_acc=acc, prepared=b)),
        ("bwd: dQ cast fp32 -> bf16", 4 * n_q + 2 * n_q, lambda: acc.to(torch.bfloat16)),
    ]


def main(argv=None):
    import triton

    from flamia_pack.kernels import varlen_attention
    from flamia_pack.scheduler.workloads import workload_lengths

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="W1,W4,W7")
    a = ap.parse_args(argv)
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not torch.cuda.is_available() or not fp8_kernels_available("cuda"):
        raise SystemExit("error: fp8_call_breakdown.py times the Gluon FP8 kernels: it needs a CUDA GPU of compute "
                         "capability 9.x")

    def ms(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    print("| row | piece | ms | bytes (GB) | HBM floor ms | floor / time |")
    print("|---|---|---|---|---|---|")
    for w in a.rows.split(","):
        lens = workload_lengths(w)
        H, Hkv = 16, 4 if w == "W5" else 16
        g = torch.Generator(device="cuda").manual_seed(0)
        T = int(sum(lens))
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn((T, h, 128), device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
        do = torch.randn((T, H, 128), device="cuda", generator=g).bfloat16()
        total = 0.0
        for name, nbytes, fn in _pieces(q, k, v, do, cu):
            t = ms(fn)
            if not name.startswith("bwd: dQ") and name != "fwd: work list":  # the kernel's row includes
                total += t  # zeroing and the cast; the list is prebuilt in the whole call below
            floor = nbytes / HBM * 1e3
            print(f"| {w} | {name} | {t:.3f} | {nbytes / 1e9:.3f} | {floor:.3f} | "
                  f"{(floor / t) if nbytes else float('nan'):.2f} |", flush=True)
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        from flamia_pack.kernels.fp8_attention import build_fp8_work_list

        wl = build_fp8_work_list(cu, T, causal=True, validate=False)

        def train():
            o = varlen_attention(*x, cu, int(max(lens)), precision="fp8", work_list=wl)
            torch.autograd.grad(o, x, do)
        whole = ms(train)
        print(f"| {w} | **whole training call (autograd, list prebuilt)** | {whole:.3f} | | | |")
        print(f"| {w} | sum of the pieces (list excluded) | {total:.3f} | | | |", flush=True)


if __name__ == "__main__":
    main()
