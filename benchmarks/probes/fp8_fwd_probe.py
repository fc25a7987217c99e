"""FP8 forward probe (issue 27), one device call: the kernel against the CPU emulation (same codes) and
the fp32 reference on small rows, the numerics targets on 4 x 4096, and the speed of the FP8 forward
(with and without quantization), the quantizer and our BF16 forward, same process, on W1-W9.

    PYTHONPATH=. python benchmarks/probes/fp8_fwd_probe.py [--parts check,numerics,speed,quant] [--rows W1,W4]
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from flamia_pack.kernels.fp8_attention import FP8_BLOCK_M, build_fp8_work_list, fp8_attention_forward, fp8_quantize
from flamia_pack.kernels.fp8_emulation import OperandCodes
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_forward
from flamia_pack.kernels.gluon_fp8_fwd import gluon_fp8_fwd
from flamia_pack.kernels.reference import packed_attention_reference


def _row(lengths, H, Hkv, pad=0, seed=0, outlier=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lengths)) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((T, h, 128), device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    if outlier:
        k[:, :, [5, 17, 40, 99]] *= 20
    return q, k, v, cu


def _kernel(ops, cu, causal=True):
    T, H, D = ops.qc.shape
    wl = build_fp8_work_list(cu, T, causal=causal)
    o = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    lse = torch.full((H, T), float("nan"), dtype=torch.float32, device="cuda")
    from flamia_pack.kernels.flash_fwd import fill_tails
    gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items, D ** -0.5,
                  causal=causal, wl_block_m=FP8_BLOCK_M, skip_len=0, o=o, lse=lse)
    fill_tails([(o, 0.0, 0), (lse, math.inf, 1)], cu)
    return o, lse


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def check():
    rng = np.random.default_rng(0)
    rows = [([300, 1, 77, 700, 129, 128], 4, 2, 0), ([1024, 1024], 4, 4, 0), ([5, 250, 1, 1, 600], 2, 1, 37),
            (list(rng.integers(1, 400, 24)), 4, 1, 0)]
    worst = 0.0
    for i, (lens, H, Hkv, pad) in enumerate(rows):
        for gran in ("block", "token"):
            for causal in (True, False):
                q, k, v, cu = _row(lens, H, Hkv, pad, seed=i)
                ops = fp8_quantize(q, k, v, cu, gran)
                o, lse = _kernel(ops, cu, causal)
                torch.cuda.synchronize()
                vc = ops.vt.permute(2, 0, 1).contiguous()
                quant = tuple(OperandCodes(c.cpu(), e.cpu()) for c, e in ((ops.qc, ops.eq), (ops.kc, ops.ek), (vc, ops.ev)))
                oe, lsee = emulated_forward(None, None, None, cu.cpu(), causal=causal, scale_granularity=gran,
                                            quantized=quant)
                ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=causal)
                n = int(cu[-1])
                d_emu = float((o.float().cpu() - oe.float()).abs().max())
                dl = float((lse.cpu()[:, :n] - lsee[:, :n]).abs().max())
                worst = max(worst, d_emu)
                print(f"check row{i} H{H}/{Hkv} {gran:5s} causal={causal!s:5s}: |O-emu| max {d_emu:.3e}  |LSE-emu| "
                      f"{dl:.2e}  cos(O, fp32) {_cos(o[:n], ref[:n]):.5f}  emu {_cos(oe[:n], ref[:n].cpu()):.5f}  "
                      f"nan {bool(o.isnan().any())}  pad ok {bool((o[n:] == 0).all()) and bool(torch.isinf(lse[:, n:]).all())}")
    # NaN containment: document 1 of 3 gets NaN K and V; the others are bitwise the clean run's
    q, k, v, cu = _row([400, 300, 500], 2, 2, 0, seed=9)
    o_clean, _ = _kernel(fp8_quantize(q, k, v, cu, "block"), cu)
    k2, v2 = k.clone(), v.clone()
    k2[450, 0, 3] = float("nan")
    v2[420, 1, 7] = float("inf")
    o_bad, _ = _kernel(fp8_quantize(q, k2, v2, cu, "block"), cu)
    keep = torch.cat([torch.arange(0, 400), torch.arange(700, 1200)]).cuda()
    print("nan containment: other documents bitwise equal:", bool(torch.equal(o_bad[keep], o_clean[keep])),
          " the NaN document non-finite:", bool((~torch.isfinite(o_bad[400:700])).any()))
    print(f"check worst |O - emulation| {worst:.3e}")


def numerics():
    for name, outlier in (("N(0,1)", False), ("K channels x20", True)):
        q, k, v, cu = _row([4096] * 4, 16, 16, outlier=outlier, seed=3)
        ref = packed_attention_reference(q.float(), k.float(), v.float(), cu, causal=True)
        from flamia_pack.kernels import varlen_attention
        ob = varlen_attention(q, k, v, cu, 4096)
        for gran in ("block", "token"):
            o, _ = _kernel(fp8_quantize(q, k, v, cu, gran), cu)
            rel = ((o.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max()
            print(f"numerics 4x4096 H16 D128 {name:15s} {gran:5s}: cos(O, fp32) {_cos(o, ref):.5f} max row rel err "
                  f"{float(rel):.4f} | bf16 kernel cos {_cos(ob, ref):.5f}")


def speed(rows):
    import triton
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.attention import build_attention_work_list
    from flamia_pack.scheduler.cost import attention_flops
    from flamia_pack.scheduler.workloads import workload_lengths

    def ms(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    print("| row | BF16 fwd ms | FP8 fwd+quant ms | FP8 kernel ms | quant ms | FP8 kernel TFLOP/s | fp8+q / bf16 | kernel / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for w in rows:
        lens = workload_lengths(w)
        Hkv = 4 if w == "W5" else 16
        q, k, v, cu = _row(lens, 16, Hkv)
        T = q.shape[0]
        wl16 = build_attention_work_list(cu, T, max_seqlen=int(max(lens)), num_kv_groups=16 // Hkv)
        wl8 = build_fp8_work_list(cu, T)
        ops = fp8_quantize(q, k, v, cu, "block")
        with torch.no_grad():
            t16 = ms(lambda: varlen_attention(q, k, v, cu, int(max(lens)), work_list=wl16))
            t8q = ms(lambda: fp8_attention_forward(fp8_quantize(q, k, v, cu, "block"), cu, work_list=wl8))
            t8 = ms(lambda: fp8_attention_forward(ops, cu, work_list=wl8))
            tq = ms(lambda: fp8_quantize(q, k, v, cu, "block"))
        fl = attention_flops(lens, 16, 128)
        print(f"| {w} | {t16:.3f} | {t8q:.3f} | {t8:.3f} | {tq:.3f} | {fl / t8 / 1e9:.0f} | {t16 / t8q:.2f}x | "
              f"{t16 / t8:.2f}x |")


def quant():
    import triton
    from flamia_pack.kernels.quantize import quantize_qkv
    q, k, v, cu = _row([4096] * 16, 16, 16)
    ref = quantize_qkv(q, k, v, cu, "block", transposed=True, validate=False)
    for hw in (True, False):
        for gran in ("block", "token"):
            ref = quantize_qkv(q, k, v, cu, gran, transposed=True, validate=False)
            got = quantize_qkv(q, k, v, cu, gran, transposed=True, transposed_store="kernel", hw_cvt=hw, validate=False)
            same = all(torch.equal(a.codes_t.view(torch.uint8), b.codes_t.view(torch.uint8)) for a, b in zip(ref, got))
            t_k = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=True, transposed_store="kernel",
                                                               hw_cvt=hw, validate=False, check_finite=False))
            t_t = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=True, validate=False,
                                                               check_finite=False))
            t_v = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, transposed=(False, False, True),
                                                               validate=False, check_finite=False))
            t_n = triton.testing.do_bench(lambda: quantize_qkv(q, k, v, cu, gran, validate=False, check_finite=False))
            x = torch.empty_like(q)
            t_c = triton.testing.do_bench(lambda: (x.copy_(q), x.copy_(k), x.copy_(v)))
            print(f"quant W1 {gran:5s} hw_cvt={hw!s:5s}: in-kernel transposed bitwise={same}  ms: kernel-T(all) {t_k:.3f} "
                  f"torch-T(all) {t_t:.3f} torch-T(V) {t_v:.3f} no-T {t_n:.3f} | bf16 copy of q,k,v {t_c:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,numerics,speed,quant")
    ap.add_argument("--rows", default="W1,W2,W3,W4,W5,W6,W7,W8,W9")
    a = ap.parse_args()
    parts = a.parts.split(",")
    print(torch.cuda.get_device_name(), torch.__version__)
    if "check" in parts:
        check()
    if "numerics" in parts:
        numerics()
    if "speed" in parts:
        speed(a.rows.split(","))
    if "quant" in parts:
        quant()


if __name__ == "__main__":
    main()
