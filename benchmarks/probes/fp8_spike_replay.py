"""Replay a spiking step's attention inputs (``train_fp8.py --grad-probe``'s ``spike-step<N>.pt``).

The file holds one layer's ``q, k, v, do`` (``(T, H, D)``), ``cu_seqlens``, ``max_seqlen`` and the run's
``attn`` (``fp8-block`` / ``fp8-token``). This prints, for dQ / dK / dV, the norm and the cosine to exact
float64 attention of: the GPU FP8 kernels (``--repeats`` times: does the answer change between calls?),
the CPU emulation of the same numerics (the kernels' contract: does the contract itself give the
spike?), and exact attention on the FP8 path's dequantized q^, k^, v^ (the part the input rounding
explains). Without a GPU the kernel rows are skipped.

    PYTHONPATH=. python3 benchmarks/probes/fp8_spike_replay.py RUN_DIR/spike-step523.pt [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys

import torch


def _grads(fn, q, k, v, do):
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = fn(*x)
    return [g.detach() for g in torch.autograd.grad(o, x, do.to(o.dtype))]


def _row(name, g, ref):
    cells = []
    for a, b in zip(g, ref):
        a, b = a.double().cpu(), b.double().cpu()
        cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
        cells.append(f"{float(a.norm()):.4g} ({cos:.5f})")
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    try:
        d = torch.load(a.file, map_location="cpu")
        q, k, v, do, cu, ml, attn = (d[n] for n in ("q", "k", "v", "do", "cu_seqlens", "max_seqlen", "attn"))
    except Exception as exc:  # noqa: BLE001 - any unreadable file: one line
        print(f"error: {a.file}: not a spike-step file of train_fp8.py --grad-probe ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})", file=sys.stderr)
        return 2
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.fp8_emulation import fp8_varlen_attention_emulated
    from flamia_pack.kernels.reference import packed_attention_reference

    gran = "token" if attn == "fp8-token" else "block"
    print(f"{a.file}: step {d.get('step')}, layer {d.get('layer')}, {attn}, T={q.shape[0]}, H={q.shape[1]}, "
          f"D={q.shape[2]}, {cu.numel() - 1} documents")

    def exact(x, y, z):
        return packed_attention_reference(x, y, z, cu, causal=True, compute_dtype=torch.float64)

    ref = _grads(exact, q.double(), k.double(), v.double(), do.double())
    print("| path | dQ norm (cos vs exact fp64) | dK | dV |\n|---|---|---|---|")
    _row("exact fp64", ref, ref)
    emu = _grads(lambda x, y, z: fp8_varlen_attention_emulated(x, y, z, cu, ml, scale_granularity=gran),
                 q.float(), k.float(), v.float(), do.float())
    _row("CPU emulation (the contract)", emu, ref)
    # a key mean is invisible to softmax but not to E4M3 (it sets the exponents): on N(0, 1) keys with a
    # common offset of 20 per channel the emulation's dQ falls to cosine 0.65 and recovers to 0.998 with K
    # centred on its document's first 32-token group (causal in "block" mode); NOTES item 18
    kc = k.float().clone()
    n0 = 32 if gran == "block" else 1
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kc[s0:s1] -= kc[s0:min(s1, s0 + n0)].mean(0, keepdim=True)
    kbar = k.float().mean(0)
    ratio = [round(float(kbar[h].norm() / k[:, h].float().norm(dim=-1).pow(2).mean().sqrt()), 3) for h in range(k.shape[1])]
    print(f"(|mean of k| / rms |k| per head: {ratio})")
    emc = _grads(lambda x, y, z: fp8_varlen_attention_emulated(x, y, z, cu, ml, scale_granularity=gran),
                 q.float(), kc, v.float(), do.float())
    _row("CPU emulation, K centred on its first group's mean", emc, ref)
    from flamia_pack.quant import dequantize, quantize_token_blocks

    deq = []
    for t in (q, k, v):
        qt = quantize_token_blocks(t.float(), cu, gran)
        deq.append(dequantize(qt.codes, qt.exponents))
    _row("exact fp64 on q^, k^, v^", _grads(exact, *(x.double() for x in deq), do.double()), ref)
    if torch.cuda.is_available():
        qc, kc, vc, dc, cuc = (t.cuda() for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), do.bfloat16(), cu))
        for i in range(a.repeats):
            g = _grads(lambda x, y, z: varlen_attention(x, y, z, cuc, ml, precision="fp8", scale_granularity=gran,
                                                        causal_dq_scale=gran == "token"), qc, kc, vc, dc)
            _row(f"GPU kernels, call {i + 1}", g, ref)
    else:
        print("(no CUDA: the GPU kernel rows are skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
