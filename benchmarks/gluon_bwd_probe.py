"""H200 probe: the Gluon dK/dV and dQ programs (kernels/gluon_attention.py) vs the Triton ones, side by side.

    OUT=dir [ROWS=W1,W8,...] PYTHONPATH=. python3 benchmarks/gluon_bwd_probe.py

1. correctness on three small rows (unaligned documents, MHA and GQA): dK, dV, dQ of every Gluon
   variant and of the Triton programs vs the fp32 reference (relative L2 error; outputs poisoned
   with NaN before the timed run's write);
   Also ``bwd_gluon_dq_reduce`` (``gluon_dqr``: dQ, dK, dV vs the reference).
2. per workload: median ms of the Triton dK/dV launch (``flash_bwd._bwd_kernel`` KIND=1), its dQ
   launch (KIND=2), its fused launch (KIND=0) and of each Gluon variant, printed with the ratio
   Triton / Gluon (> 1: Gluon faster), and the shipped Gluon pair (dK/dV + dQ programs) vs the
   dQ-reduce kernel with its accumulator zero + cast. Writes $OUT/gluon_probe.json.
"""
import os, sys, json, time, math, traceback
import numpy as np, torch, triton
from dataclasses import replace
from flamia_pack.kernels import flash_bwd as B, flash_fwd as Fw
from flamia_pack.kernels.config import kernel_config
from flamia_pack.kernels.attention import build_attention_work_list
from flamia_pack.kernels.reference import packed_attention_reference
from flamia_pack.kernels.gluon_attention import gluon_dkdv
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths
T0 = time.time()
def log(m): print(f"[{time.time()-T0:6.1f}s] {m}", flush=True)
OUT = os.environ.get("OUT", "/tmp")
from flamia_pack.kernels.gluon_attention import gluon_dq
# (two-partition consumers, measured 0.79-1.11x on 2026-11-29, were removed from the kernels)
VARIANTS = [dict(block_m=64, stages=2, retire_first=False), dict(block_m=64, stages=2, retire_first=True),
            dict(block_m=64, stages=3, retire_first=True)]
DQ_VARIANTS = [dict(block_m=128, block_n=64, stages=3), dict(block_m=128, block_n=64, stages=4),
               dict(block_m=128, block_n=128, stages=2)]
def vname(v): return "_".join(f"{k[0]}{x}" for k, x in v.items())

def setup(lengths, H, Hkv, D=128, seed=0):
    torch.manual_seed(seed)
    T = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    cfg = kernel_config(D, True, max_seqlen=int(max(lengths)), num_kv_groups=H // Hkv)
    wl = build_attention_work_list(cu, T, config=cfg)
    scale = D ** -0.5
    o, lse = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=scale, config=cfg)
    delta = torch.empty((H, T), dtype=torch.float32, device="cuda")
    B._bwd_preprocess[(triton.cdiv(T, 64), H)](o, do, lse, delta, T, o.stride(0), o.stride(1), do.stride(0), do.stride(1),
                                               delta.stride(0), delta, cu, cu.shape[0] - 1, 0, 1, 0,
                                               HAS_DLSE=False, BLOCK=64, HEAD_DIM=D, ZERO_DQ=False, num_warps=4)
    items = wl.items
    n = int(wl.num_items.item())
    it = items[:n].long()
    merged = bool((it[:, 2] > cu.long()[it[:, 0] + 1]).any())
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, delta=delta, cu=cu, items=items, num_items=wl.num_items,
                cfg=cfg, scale=scale, merged=merged, T=T, H=H, Hkv=Hkv, D=D)

def triton_kind(s, kind):
    q, k, v, do, cfg = s["q"], s["k"], s["v"], s["do"], s["cfg"]
    T, H, D = q.shape; Hkv = k.shape[1]
    dq = torch.empty_like(q); dk = torch.empty_like(k); dv = torch.empty_like(v)
    f1 = cfg.wl_block_m // cfg.bwd_block_n1; f2 = cfg.wl_block_m // cfg.bwd_block_m2
    per_rank = {0: f1 * Hkv + f2 * H, 1: f1 * Hkv, 2: f2 * H}[kind]
    items = s["items"]
    B._bwd_kernel[(items.shape[0] * per_rank,)](
        q, k, v, do, s["lse"], s["delta"], do, s["lse"], dq, dk, dv, s["delta"], None, items, s["num_items"], s["cu"],
        s["cu"].numel() - 1, items.shape[0], H, Hkv, 0, items,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        do.stride(0), do.stride(1),  # O / dLSE: read only with DQ_DELTA, which this probe leaves off
        dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), 0, 0, s["delta"].stride(0),
        float(s["scale"]) * 1.4426950408889634, float(s["scale"]),
        HEAD_DIM=D, BLOCK_M1=cfg.bwd_block_m1, BLOCK_N1=cfg.bwd_block_n1, BLOCK_M2=cfg.bwd_block_m2, BLOCK_N2=cfg.bwd_block_n2,
        F1=f1, F2=f2, WL_BM=cfg.wl_block_m, CAUSAL=True, KIND=kind, MASKED_STAGES=cfg.bwd_masked_stages or cfg.bwd_num_stages,
        USE_TMA=False, HEAD_MAJOR=cfg.bwd_head_major, DQ_ATOMIC=False, DQ_TMA=0, DOC_MAJOR=False,
        GROUP=H // Hkv, REG_OPS=0, num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages)
    return dq, dk, dv

def gl_run(s, var):
    return gluon_dkdv(s["q"], s["k"], s["v"], s["do"], s["lse"], s["delta"], s["cu"], s["items"], s["num_items"],
                      s["scale"], wl_block_m=s["cfg"].wl_block_m, block_n=s["cfg"].bwd_block_n1, **var)

def dq_run(s, var):
    return gluon_dq(s["q"], s["k"], s["v"], s["do"], s["lse"], s["delta"], s["cu"], s["items"], s["num_items"],
                    s["scale"], wl_block_m=s["cfg"].wl_block_m, **var)

def dqr_run(s):
    """bwd_gluon_dq_reduce: zero the fp32 accumulator, dK/dV programs with the dQ reduce, one cast."""
    acc = torch.zeros(s["q"].shape, dtype=torch.float32, device="cuda")
    dk, dv = gl_run(s, dict(retire_first=True, dq_acc=acc))
    dq = torch.empty_like(s["q"])
    torch.mul(acc, s["scale"], out=dq)
    return dq, dk, dv

def pair_run(s):
    """the shipped Gluon backward programs: dK/dV then dQ."""
    dk, dv = gl_run(s, dict(retire_first=True))
    return dq_run(s, {}), dk, dv

def rel(a, b, n):
    a = a[:n].float(); b = b[:n].float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

results = {"correctness": [], "timing": []}
# 1. correctness: small rows with unaligned documents, MHA and GQA, vs the fp32 reference
for (lengths, H, Hkv) in [([300, 129, 1000, 77, 700, 1890], 4, 4), ([513, 2048, 200, 1333], 8, 2), ([4096], 2, 2)]:
    try:
        s = setup(np.array(lengths), H, Hkv, seed=len(lengths))
        n = s["T"]
        qf, kf, vf = (x.detach().float().requires_grad_() for x in (s["q"], s["k"], s["v"]))
        of = packed_attention_reference(qf, kf, vf, s["cu"], causal=True, softmax_scale=s["scale"])
        of.backward(s["do"].float())
        _, tdk, tdv = triton_kind(s, 1)
        tdq, _, _ = triton_kind(s, 2)
        row = {"lengths": lengths, "H": H, "Hkv": Hkv, "merged": s["merged"],
               "triton_dk": rel(tdk, kf.grad, n), "triton_dv": rel(tdv, vf.grad, n), "triton_dq": rel(tdq, qf.grad, n)}
        for var in DQ_VARIANTS:
            dq = torch.full_like(s["q"], float("nan"))
            dq = dq_run(s, dict(var, dq=dq))
            torch.cuda.synchronize()
            row["gluon_dq_" + vname(var)] = (rel(dq, qf.grad, n), bool(torch.isnan(dq[:n]).any()))
        for var in VARIANTS:
            dk, dv = gl_run(s, var)
            dk.fill_(float("nan")); dv.fill_(float("nan"))  # poison, then the real run writes
            dk2, dv2 = gl_run(s, var)
            torch.cuda.synchronize()
            row["gluon_" + vname(var)] = (rel(dk2, kf.grad, n), rel(dv2, vf.grad, n),
                                                               bool(torch.isnan(dk2[:n]).any() or torch.isnan(dv2[:n]).any()))
        dq, dk, dv = dqr_run(s)
        torch.cuda.synchronize()
        row["gluon_dqr"] = (rel(dq, qf.grad, n), rel(dk, kf.grad, n), rel(dv, vf.grad, n),
                            bool(torch.isnan(dq[:n]).any() or torch.isnan(dk[:n]).any()))
        log(json.dumps(row)); results["correctness"].append(row)
    except Exception:
        log("correctness FAILED: " + traceback.format_exc()[-3000:])
# 2. timing
rows = os.environ.get("ROWS", "W1,W8,W5,W9,W2,W6,W4").split(",")
for name in rows:
    try:
        spec = WORKLOADS[name]; lengths = workload_lengths(name)
        s = setup(lengths, spec["num_heads"], spec["num_kv_heads"])
        if s["merged"]:
            log(f"{name}: merged items, skipped"); continue
        _, tdk, tdv = triton_kind(s, 1)
        tdq, _, _ = triton_kind(s, 2)
        r = {"wl": name}
        fns = {"triton_dkdv": lambda: triton_kind(s, 1), "triton_dq": lambda: triton_kind(s, 2), "triton_fused": lambda: triton_kind(s, 0)}
        for var in VARIANTS:
            key = "gluon_" + vname(var)
            dk, dv = gl_run(s, var)
            r[key + "_err_vs_triton"] = (rel(dk, tdk, s["T"]), rel(dv, tdv, s["T"]))
            fns[key] = (lambda var=var: gl_run(s, var))
        for var in DQ_VARIANTS:
            key = "gluon_dq_" + vname(var)
            r[key + "_err_vs_triton"] = rel(dq_run(s, var), tdq, s["T"])
            fns[key] = (lambda var=var: dq_run(s, var))
        dq, _, _ = dqr_run(s)
        r["gluon_dqr_err_vs_triton"] = rel(dq, tdq, s["T"])
        fns["gluon_pair"] = lambda: pair_run(s)
        fns["gluon_dqr"] = lambda: dqr_run(s)
        for key, fn in fns.items():
            r[key] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        log(name + " " + " ".join(f"{k}={v:.3f}ms" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "wl"))
        log(name + " ratios " + " ".join(f"{k}={r['triton_dq' if 'dq' in k else 'triton_dkdv'] / r[k]:.3f}x" for k in fns
                                         if k.startswith("gluon") and k not in ("gluon_pair", "gluon_dqr")))
        log(f"{name} dQ reduce: shipped pair {r['gluon_pair']:.3f} ms, dqr (zero + dK/dV/dQ + cast) {r['gluon_dqr']:.3f} ms "
            f"-> {r['gluon_pair'] / r['gluon_dqr']:.3f}x")
        results["timing"].append(r)
    except Exception:
        log(f"{name} FAILED: " + traceback.format_exc()[-3000:])
json.dump(results, open(os.path.join(OUT, "gluon_probe.json"), "w"), indent=1)
