"""FP8 attention backward on the H200 (issue 28): correctness against fp32 and timing, one script.

``--parts check`` runs each case in its own subprocess (a fault or hang is reported per case, not
for the whole run): GPU FP8 gradients (varlen_attention(precision="fp8") + autograd) against the
fp32 reference's, poisoned outputs inside the launcher (unwritten rows stay NaN), NaN containment.
``--parts speed`` times the training call (quantize + forward + backward) and the backward alone for
FP8 and our BF16 in the same process, per WORKLOADS row.

    PYTHONPATH=. python3 benchmarks/probes/fp8_bwd_probe.py --parts check,speed
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import torch

CASES = [
    ([256], 2, 2, True), ([300, 212, 1000], 4, 2, True), ([4096, 4096], 4, 4, True),
    ("s3", 4, 1, True), ([300, 700], 2, 2, False), ([1000, 37, 1, 555], 4, 4, True),
    ("nan", 2, 2, True), ("pad", 4, 2, True),
]


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _inputs(lens, H, Hkv, pad=0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lens)) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((T, h, 128), device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    do = torch.randn((T, H, 128), device="cuda", generator=g).bfloat16()
    return q, k, v, do, cu


def _grads(q, k, v, do, cu, causal, precision):
    from flamia_pack.kernels import varlen_attention

    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = varlen_attention(*x, cu, int((cu[1:] - cu[:-1]).max()), causal=causal, precision=precision)
    o.backward(do)
    return o.detach(), [t.grad for t in x]


def case(i):
    from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd

    lens, H, Hkv, causal = CASES[i]
    pad = 0
    rng = np.random.default_rng(i)
    if lens == "s3":
        lens = [int(x) for x in rng.integers(1, 700, 40)]
    elif lens == "nan":
        lens = [500, 600, 400]
    elif lens == "pad":
        lens, pad = [777, 1500], 100
    q, k, v, do, cu = _inputs(lens, H, Hkv, pad, seed=i)
    o8, g8 = _grads(q, k, v, do, cu, causal, "fp8")
    torch.cuda.synchronize()
    qf, kf, vf = (t.float() for t in (q, k, v))
    o, lse = packed_attention_reference(qf, kf, vf, cu, causal=causal, return_lse=True)
    gr = packed_attention_reference_bwd(do.float(), qf, kf, vf, o, lse, cu, causal=causal)
    _, g16 = _grads(q, k, v, do, cu, causal, "bf16")
    out = [f"case {i} lens={lens if len(lens) < 8 else f'{len(lens)} docs'} H={H}/{Hkv} causal={causal} pad={pad}:"]
    ok = True
    for name, a, r, b in zip(("dq", "dk", "dv"), g8, gr, g16):
        fin = bool(torch.isfinite(a).all())
        c, c16 = _cos(a, r), _cos(b, r)
        nr = float(a.double().norm() / r.double().norm())
        out.append(f"  {name}: finite={fin} cos_fp32={c:.5f} (bf16 {c16:.5f}) norm_ratio={nr:.4f}")
        ok &= fin and c > 0.99
        if pad:
            ok &= bool((a[-pad:] == 0).all())
    out.append(f"  o cos_fp32={_cos(o8, o):.5f}")
    if CASES[i][0] == "nan":  # a NaN in document 1's q must not reach documents 0 and 2
        qn = q.clone()
        qn[700, 0, 3] = float("nan")
        _, gn = _grads(qn, k, v, do, cu, causal, "fp8")
        for name, a, b in zip(("dq", "dk", "dv"), gn, g8):
            keep = torch.ones(a.shape[0], dtype=torch.bool, device="cuda")
            keep[500:1100] = False
            fin = bool(torch.isfinite(a[keep]).all())
            diff = float((a[keep].float() - b[keep].float()).abs().max())
            out.append(f"  nan containment {name}: other docs finite={fin} max|diff|={diff:.3g}")
            ok &= fin and diff < 1e-2
    print("\n".join(out) + f"\n  {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


_MODULE = None


def check():
    fails = 0
    for i in range(len(CASES)):
        try:
            extra = ["--bwd-module", _MODULE] if _MODULE else []
            r = subprocess.run([sys.executable, __file__, "--case", str(i)] + extra, capture_output=True, text=True,
                               timeout=180)
            print(r.stdout.strip() or f"case {i}: no output", flush=True)
            if r.returncode:
                print(f"case {i}: rc={r.returncode}\n{r.stderr[-2500:]}", flush=True)
                fails += 1
            elif "FAIL" in r.stdout:
                fails += 1
        except subprocess.TimeoutExpired:
            print(f"case {i}: TIMEOUT (hang)", flush=True)
            fails += 1
    print(f"check: {len(CASES) - fails}/{len(CASES)} cases pass")


def _use_module(path):
    """Replace ``flamia_pack.kernels.gluon_fp8_bwd`` by the file at ``path`` (an A/B variant)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flamia_pack.kernels.gluon_fp8_bwd", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flamia_pack.kernels.gluon_fp8_bwd"] = mod
    spec.loader.exec_module(mod)


def quantize_do(do, cu):
    """dO's codes in both layouts, as ``fp8_backward`` quantizes it (block granularity)."""
    from flamia_pack.kernels.fp8_backward import quantize_do as _quantize_do

    return _quantize_do(do, cu, "block")


def prepared_backward(q, k, v, do, cu, work_list=None):
    """Everything the FP8 backward kernel reads, made once (block granularity): a dict of ``ops``,
    ``o``, ``lse``, ``d8`` (dO's codes), ``delta``, ``tables`` (q, k, v, dO factor tables) and ``entries``."""
    from flamia_pack.kernels.fp8_attention import fp8_attention_forward, fp8_quantize
    from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta
    from flamia_pack.kernels.gluon_fp8_bwd import fp8_bwd_entries
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    ops = fp8_quantize(q, k, v, cu, "block", backward=True)
    o, lse = fp8_attention_forward(ops, cu, work_list=work_list)
    d8 = quantize_do(do, cu)
    return {"ops": ops, "o": o, "lse": lse, "d8": d8, "delta": fp8_bwd_delta(d8.codes, d8.exponents, o),
            "tables": [exponent_table(ops.eq), ops.ekt, ops.evt, exponent_table(d8.exponents)],
            "entries": fp8_bwd_entries(cu, q.shape[0])}


def _kernel_only(q, k, v, do, cu, dq_acc=None, prepared=None, deterministic=False):
    """The FP8 backward kernel alone on prepared operands (a closure to time; ``dq_acc``: an fp32
    accumulator zeroed before each call, else the launcher allocates one; ``prepared``: a
    :func:`prepared_backward` result to reuse; ``deterministic``: ``gluon_fp8_bwd(deterministic=)``)."""
    from flamia_pack.kernels.gluon_fp8_bwd import gluon_fp8_bwd

    b = prepared_backward(q, k, v, do, cu) if prepared is None else prepared
    ops, d8 = b["ops"], b["d8"]

    def run():
        if dq_acc is not None:
            dq_acc.zero_()
        return gluon_fp8_bwd(ops.qc, ops.kc, ops.vc, ops.qt, ops.kt, d8.codes, d8.codes_t, *b["tables"], b["lse"],
                             b["delta"], cu, 128 ** -0.5, entries=b["entries"], dq_acc=dq_acc,
                             deterministic=deterministic)
    return run


def speed(rows):
    import triton
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.scheduler.cost import attention_flops
    from flamia_pack.scheduler.workloads import workload_lengths

    def ms(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    print("| row | BF16 train ms | FP8 train ms | FP8/BF16 train | BF16 fwd ms | FP8 fwd ms | BF16 bwd ms | FP8 bwd ms |"
          " FP8 bwd kernel ms | kernel TFLOP/s | bwd speedup | kernel vs BF16 bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in rows:
        lens = workload_lengths(w)
        Hkv = 4 if w == "W5" else 16
        q, k, v, do, cu = _inputs(lens, 16, Hkv)
        ml = int(max(lens))
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        res = {}
        for prec in ("bf16", "fp8"):
            def train():
                o = varlen_attention(*x, cu, ml, precision=prec)
                torch.autograd.grad(o, x, do)

            def fwd():
                with torch.no_grad():
                    varlen_attention(*x, cu, ml, precision=prec)
            res[prec] = (ms(train), ms(fwd))
        fl = attention_flops(lens, 16, 128) * 2.5
        (t16, f16), (t8, f8) = res["bf16"], res["fp8"]
        b16, b8 = t16 - f16, t8 - f8
        tk = ms(_kernel_only(q, k, v, do, cu))
        print(f"| {w} | {t16:.3f} | {t8:.3f} | {t16 / t8:.2f}x | {f16:.3f} | {f8:.3f} | {b16:.3f} | {b8:.3f} | "
              f"{tk:.3f} | {fl / tk / 1e9:.0f} | {b16 / b8:.2f}x | {b16 / tk:.2f}x |", flush=True)


def det_speed(rows):
    """The backward kernel alone, default against ``deterministic=True`` (dQ partials in tile order), per
    row; both on the same prepared operands, alternating twice."""
    import triton
    from flamia_pack.scheduler.workloads import workload_lengths

    print("| row | default ms | deterministic ms | deterministic / default |")
    print("|---|---|---|---|")
    for w in rows:
        lens = workload_lengths(w)
        q, k, v, do, cu = _inputs(lens, 16, 4 if w == "W5" else 16)
        prep = prepared_backward(q, k, v, do, cu)
        fns = {d: _kernel_only(q, k, v, do, cu, prepared=prep, deterministic=d) for d in (False, True)}
        t = {False: [], True: []}
        for _ in range(2):
            for d in (False, True):
                t[d].append(float(triton.testing.do_bench(fns[d], warmup=5, rep=60, return_mode="median")))
        a, b = min(t[False]), min(t[True])
        print(f"| {w} | {a:.3f} | {b:.3f} | {b / a:.3f}x |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,speed", help="comma list of check, speed, det")
    ap.add_argument("--rows", default="W1,W2,W3,W4,W5,W6,W7,W8,W9")
    ap.add_argument("--case", type=int, default=None)
    ap.add_argument("--bwd-module", default=None, help="a variant file of gluon_fp8_bwd.py to run instead")
    a = ap.parse_args()
    if a.bwd_module:
        global _MODULE
        _MODULE = a.bwd_module
        _use_module(a.bwd_module)
    if a.case is not None:
        sys.exit(0 if case(a.case) else 1)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    parts = a.parts.split(",")
    if "check" in parts:
        check()
    if "speed" in parts:
        speed(a.rows.split(","))
    if "det" in parts:
        det_speed(a.rows.split(","))


if __name__ == "__main__":
    main()
