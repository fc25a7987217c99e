"""GPU check of the leaking FP8 quantizer of issue 29 (``examples/fp8_leak.py``) against the emulation.

Part ``synthetic``: random rows (several documents, row-end padding), operands from
``fp8_leak.leaky_operands`` (modes ``next-floor``, ``prev-floor``) and from the real quantizer
(``token``); the Gluon FP8 forward and backward on the H200 against the CPU emulation on the *same*
codes: non-finite counts, cosine and max |difference| of O, dQ, dK, dV.

Part ``train``: ``examples/train_fp8.py --attn fp8-leak`` for a few steps with every attention call
checked (inputs, O, dO, dQ / dK / dV finite); the first call with a non-finite output is re-run
through the emulation on the same operands and described (which tokens, which documents, the codes'
and exponents' ranges).

    PYTHONPATH=. python benchmarks/probes/fp8_leak_gpu.py [--parts synthetic,train] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import fp8_leak  # noqa: E402
from flamia_pack.kernels.fp8_attention import fp8_attention_forward, fp8_quantize  # noqa: E402
from flamia_pack.kernels.fp8_backward import fp8_backward  # noqa: E402
from flamia_pack.kernels.fp8_emulation import fp8_attention_backward as emu_bwd  # noqa: E402
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emu_fwd  # noqa: E402

warnings.simplefilter("ignore", fp8_leak.LeakWarning)


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    m = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[m], b[m]
    return float((a @ b) / (a.norm() * b.norm() + 1e-300))


def _nonfinite(x):
    return int((~torch.isfinite(x.float())).sum())


def _ops(q, k, v, cu, mode):
    if mode in ("token", "block"):
        return fp8_quantize(q, k, v, cu, mode, backward=True)
    return fp8_leak.leaky_operands(q, k, v, cu, mode)


def compare(q, k, v, do, cu, mode, scale=None):
    """GPU forward + backward vs the emulation on the same operands: a dict of diagnostics."""
    T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    ops = _ops(q, k, v, cu, mode)
    o, lse = fp8_attention_forward(ops, cu, causal=True, softmax_scale=scale)
    dq, dk, dv = fp8_backward(do, ops, o, lse, cu, causal=True, softmax_scale=scale)
    torch.cuda.synchronize()
    codes = [(ops.qc, ops.eq), (ops.kc, ops.ek), (ops.vc, ops.ev)]
    quantized = tuple(fp8_leak._Codes((c.cpu(), e.cpu())) for c, e in codes)
    cuc = cu.cpu()
    eo, else_ = emu_fwd(None, None, None, cuc, None, causal=True, softmax_scale=scale, scale_granularity="token",
                        quantized=quantized)
    # the emulated backward from the GPU's own O / LSE (isolates the backward) and from its own
    edq, edk, edv = emu_bwd(do.cpu().float(), None, None, None, o.cpu(), lse.cpu(), cuc, None, causal=True,
                            softmax_scale=scale, scale_granularity="token", quantized=quantized)
    row = {"mode": mode, "T": T, "docs": int(cu.numel() - 1),
           "e_bytes": {n: [int(e.min()), int(e.max())] for n, e in zip("qkv", (ops.eq, ops.ek, ops.ev))},
           "code_amax": {n: float(c.float().abs().max()) for n, c in zip("qkv", (ops.qc, ops.kc, ops.vc))}}
    for name, g, e in (("o", o, eo), ("lse", lse, else_), ("dq", dq, edq), ("dk", dk, edk), ("dv", dv, edv)):
        g = g.float().cpu()
        e = e.float()
        fin = torch.isfinite(g) & torch.isfinite(e)
        row[name] = {"gpu_nonfinite": _nonfinite(g), "emu_nonfinite": _nonfinite(e), "cos": _cos(g, e),
                     "max_abs_diff": float((g[fin] - e[fin]).abs().max()) if fin.any() else None}
        if _nonfinite(g) and g.dim() == 3:
            bad = (~torch.isfinite(g)).any(-1)  # (T, H)
            toks = bad.any(-1).nonzero().flatten()
            docs = torch.searchsorted(cuc.long(), toks, right=True) - 1
            row[name]["bad_tokens_first"] = toks[:10].tolist()
            row[name]["bad_tokens_n"] = int(toks.numel())
            row[name]["bad_docs"] = sorted(set(docs.tolist()))[:20]
            row[name]["bad_heads"] = bad.any(0).nonzero().flatten().tolist()
    return row


def synthetic(out):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for cu_list, T in (([0, 3000, 5100, 8000], 8192), ([0, 100, 1500, 1501, 4000], 4096)):
        cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(T, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        do = (torch.randn(T, 4, 128, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
        for mode in ("token", "next-floor"):
            r = compare(q, k, v, do, cu, mode)
            r["case"] = f"randn cu={cu_list} T={T}"
            rows.append(r)
            print(json.dumps(r), flush=True)
    (out / "leak_synthetic.json").write_text(json.dumps(rows, indent=1))


def train(out, steps):
    import train_fp8

    captured = {}
    calls = {"n": 0}
    orig = train_fp8.make_attention

    def checked(kind, **kw):
        inner = orig(kind, **kw)
        if kind != "fp8-leak":
            return inner

        def attn(q, k, v, batch):
            calls["n"] += 1
            n = calls["n"]
            o = inner(q, k, v, batch)
            bad_in = [_nonfinite(x) for x in (q, k, v)]
            if "first" not in captured and (any(bad_in) or _nonfinite(o)):
                captured["first"] = {"call": n, "where": "forward", "nonfinite_in": bad_in, "o": _nonfinite(o)}
                captured["tensors"] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), None,
                                       batch["cu_seqlens"].clone())
            if o.requires_grad:
                saved = (q.detach().clone(), k.detach().clone(), v.detach().clone())

                def on_do(gr, n=n, saved=saved, cu=batch["cu_seqlens"].clone()):
                    if "first" not in captured and _nonfinite(gr):
                        captured["first"] = {"call": n, "where": "dO into attention", "do": _nonfinite(gr)}
                    elif "first" not in captured:
                        # run the backward ourselves on the same operands to see whether it is the kernel
                        ops = fp8_leak.leaky_operands(*saved, cu.to(torch.int32), "next-floor")
                        o2, lse2 = fp8_attention_forward(ops, cu.to(torch.int32), causal=True)
                        grads = fp8_backward(gr.contiguous(), ops, o2, lse2, cu.to(torch.int32), causal=True,
                                             softmax_scale=saved[0].shape[-1] ** -0.5)
                        nf = [_nonfinite(x) for x in grads]
                        if any(nf):
                            captured["first"] = {"call": n, "where": "backward kernel", "grads_nonfinite": nf}
                            captured["tensors"] = (*saved, gr.detach().clone(), cu.clone())
                    return gr
                o.register_hook(on_do)
            return o
        attn.__name__ = kind
        return attn

    train_fp8.make_attention = checked
    args = train_fp8.parse_args(["--attn", "fp8-leak", "--steps", str(steps), "--eval-every", "100000",
                                 "--val-rows", "2", "--log-every", "1", "--out", str(out / "leak-train"),
                                 "--verbose"])
    try:
        summary = train_fp8.train(args)
    except Exception as exc:  # report and keep going to the capture
        summary = {"error": repr(exc)[:500]}
    res = {"calls": calls["n"], "first": captured.get("first"), "summary_keys": sorted(summary)[:40]}
    losses = [json.loads(x) for x in (out / "leak-train" / "log.jsonl").read_text().splitlines()] \
        if (out / "leak-train" / "log.jsonl").exists() else []
    res["log"] = [{k: r.get(k) for k in ("step", "loss", "grad_norm")} for r in losses if "loss" in r][:40]
    if "tensors" in captured:
        q, k, v, do, cu = captured["tensors"]
        if do is None:
            do = (torch.randn_like(q.float()) * 1e-3).to(torch.bfloat16)
        cu32 = cu.to(torch.int32)
        res["capture_stats"] = {n: {"amax": float(x.float().abs().max()), "rms": float(x.float().pow(2).mean().sqrt())}
                                for n, x in zip("qkv", (q, k, v))}
        res["capture_cu"] = cu.tolist()[:50]
        res["capture_compare"] = [compare(q, k, v, do, cu32, m) for m in ("next-floor", "token")]
    print(json.dumps(res, indent=1, default=str), flush=True)
    (out / "leak_train.json").write_text(json.dumps(res, indent=1, default=str))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="synthetic,train")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not torch.cuda.is_available() or not fp8_kernels_available("cuda"):
        raise SystemExit("error: fp8_leak_gpu.py compares the Gluon FP8 kernels with the emulation: it needs a "
                         "CUDA GPU of compute capability 9.x (the CPU probes: python examples/fp8_leak.py)")
    torch.set_num_threads(os.cpu_count() or 1)
    out = pathlib.Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    if "synthetic" in parts:
        synthetic(out)
    if "train" in parts:
        train(out, a.steps)


if __name__ == "__main__":
    main()
