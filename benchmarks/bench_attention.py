"""BF16 packed attention: our kernels vs FlashAttention-4 (sm90), FlexAttention, varlen_attn and padded SDPA.

Run on the GPU machine:
    PYTHONPATH=. python3 benchmarks/bench_attention.py [--workloads W1,W2,...] [--peers fa4,flex,varlen,sdpa]
        [--no-peers] [--out DIR]
Offline calibration fit from a saved run, or its tables again (CPU is enough):
    python benchmarks/bench_attention.py --fit DIR/bench_attention.json
    python benchmarks/bench_attention.py --table DIR/bench_attention.json

Workloads: WORKLOADS.md W1-W9, S1, S2 (one packed row, causal, H_q = 16, D = 128, bf16 N(0, 1)
drawn fresh per workload). For each: forward and training-call (forward + backward) time, median
of ``triton.testing.do_bench`` (CUDA events, L2 flushed before each run), TFLOP/s on visible pairs
(``flamia_pack.scheduler.cost.attention_flops``), and the ratio of the fastest *packed* peer's time
to ours (> 1 means we are faster) and of padded SDPA's time to ours. Our calls use a work list built
once per row (as a training loop does: built with the batch, reused by forward and backward); its
build time is reported separately. S2: peak memory of one training call vs the bytes of the call's
own tensors (q, k, v, o, dO, dq, dk, dv, lse).

Peers: FlashAttention-4's CuTe DSL kernels (``fa4``: ``flash_attn.cute.interface.flash_attn_varlen_func``
on the packed tensors, causal; on Hopper they are FlashAttention-3's design; PyPI ``flash-attn-4``; skipped
with one line when not importable), FlexAttention (``torch.compile``d ``flex_attention`` + ``create_block_mask`` from document ids
and causal), ``torch.nn.attention.varlen.varlen_attn`` (``window_size=(-1, 0)`` = causal; signature
read at run time), ``scaled_dot_product_attention`` on the dense (B, H, L, D) view where all
documents have one length. The packed peers are fa4, flex and varlen. Failures (out of memory, invalid
argument) are reported as such.

``--fp8`` adds, in the same process, our ``precision="fp8"`` call (block, the strict token mode, ``qk_terms=2``), its
forward kernel alone, S2's FP8 peak memory, and, where ``cudnn`` imports and the row's documents have
one length, cuDNN's FP8 attention (``peer_cudnn_fp8.py``: per-tensor scales, batched rows), and the FP8
forward incl. quantization against the HBM floor of the bytes it must move (:func:`fp8_hbm_table`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from flamia_pack.scheduler.cost import attention_flops
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

HEAD_DIM = 128


# ----------------------------------------------------------------------------------------------
# inputs and timing
# ----------------------------------------------------------------------------------------------


def make_inputs(lengths, num_heads, num_kv_heads, head_dim=HEAD_DIM, seed=0, device="cuda"):
    """Fresh N(0, 1) bf16 q, k, v, dO of one packed row and its int32 cu_seqlens."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = int(np.sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)

    def r(h):
        return torch.randn((T, h, head_dim), device=device, generator=g, dtype=torch.bfloat16)

    return {"q": r(num_heads), "k": r(num_kv_heads), "v": r(num_kv_heads), "do": r(num_heads), "cu": cu, "T": T,
            "max_seqlen": int(np.max(lengths)), "lengths": np.asarray(lengths)}


def time_ms(fn, grad_to_none=None, rep=200, warmup=50) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench: CUDA events, L2 flushed each run)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def graph_ms(fn, rep: int = 100) -> float | str:
    """Median milliseconds of ``fn`` captured in a CUDA graph and replayed (``triton.testing.do_bench``
    of the replay: L2 flushed before each, no host work inside the timing -- the GPU time of the call
    even where the eager call is host-bound). ``fn`` must be capturable (no host syncs). Returns a
    string ``"capture failed (...)"`` instead of raising: a probe reports, it does not stop."""
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out = float(triton.testing.do_bench(g.replay, warmup=20, rep=rep, return_mode="median"))
        del g
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
        out = f"capture failed ({type(exc).__name__})"
    torch.cuda.synchronize()
    return out


def host_probe(fn, bench_fn=None, grad_to_none=None, rep: int = 100, calls: int = 100) -> dict:
    """Is ``fn`` GPU-bound or host-bound? (benchmarks/probes/train_host_probe.py)

    Returns ``bench`` (ms, :func:`time_ms` of ``bench_fn``, default ``fn``), ``graph`` (ms of ``fn``
    captured in a CUDA graph and replayed: no host work; a string if capture failed), ``host_us``
    (host microseconds per call enqueueing ``calls`` calls without a sync) and ``loop_ms`` (wall ms per
    call of those calls including the final sync: near ``graph`` when GPU-bound, near ``host_us``
    when host-bound). ``fn`` must be capturable (no host syncs, no gradient accumulation)."""
    bench_fn = fn if bench_fn is None else bench_fn
    bench_fn()
    torch.cuda.synchronize()
    bench = time_ms(bench_fn, grad_to_none=grad_to_none, rep=rep)
    graph = graph_ms(fn, rep=rep)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"bench": bench, "graph": graph, "host_us": (t1 - t0) / calls * 1e6, "loop_ms": (t2 - t0) / calls * 1e3}


def host_probe_cells(r: dict) -> str:
    """The ``bench ms | graph ms | host us/call | loop ms/call`` markdown cells of a :func:`host_probe` result."""
    graph = r["graph"] if isinstance(r["graph"], str) else f"{r['graph']:.3f}"
    return f"{r['bench']:.3f} | {graph} | {r['host_us']:.0f} | {r['loop_ms']:.3f}"


def print_host_profile(fn, calls: int, what: str, top: int, mode: str = "cprofile") -> None:
    """Host profile of ``calls`` calls of ``fn`` (then a sync), the ``top`` entries by own time.

    ``mode="cprofile"``: Python functions (cProfile). ``mode="torch"``: ``torch.profiler`` CPU events
    -- aten ops and CUDA runtime calls (``cudaLaunchKernel``, ``cudaMemsetAsync``, a blocking
    ``cudaStreamSynchronize`` / ``cudaMemcpyAsync``), by self CPU time: what cProfile books as the
    own time of a C-calling frame (RESULTS.md 2026-11-30 (third) run 6: torch's custom-op
    ``backend_impl``, 455 us per W7 forward call)."""
    if mode == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        print(f"host profile of {calls} {what} (PROFILE=torch), top {top} by self CPU time:")
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"host profile of {calls} {what} (PROFILE=1), top {top} by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _leaves(inp, layout=None):
    xs = [inp[n].detach() if layout is None else layout(inp[n].detach()) for n in ("q", "k", "v")]
    return [x.clone().requires_grad_(True) for x in xs]


def _fwd_bwd_fns(call, inp, layout=None, out_layout=None):
    """(forward-only fn, training-call fn, grad leaves) for ``call(q, k, v) -> o``."""
    qf, kf, vf = (inp[n] if layout is None else layout(inp[n]).contiguous() for n in ("q", "k", "v"))
    leaves = _leaves(inp, layout=(None if layout is None else (lambda x: layout(x).contiguous())))
    do = inp["do"] if layout is None else layout(inp["do"]).contiguous()

    def fwd():
        with torch.no_grad():
            return call(qf, kf, vf)

    def train():
        o = call(*leaves)
        o.backward(do)

    return fwd, train, leaves


# ----------------------------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------------------------


def ours_call(inp, config=None, causal: bool = True):
    """The bare call ``(q, k, v) -> o`` of our op, on the packed ``(T, H, D)`` tensors of ``inp``, with a
    work list built once for the row (``causal=False``: the non-causal call, for schedule sweeps)."""
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.attention import build_attention_work_list

    wl = build_attention_work_list(inp["cu"], inp["T"], causal=causal, head_dim=HEAD_DIM, config=config,
                                   max_seqlen=inp["max_seqlen"],
                                   num_kv_groups=inp["q"].shape[1] // inp["k"].shape[1])

    def call(q, k, v):
        return varlen_attention(q, k, v, inp["cu"], inp["max_seqlen"], causal=causal, work_list=wl, config=config)

    return call


def ours(inp, config=None, causal: bool = True):
    """Our op with a work list built once for the row."""
    return _fwd_bwd_fns(ours_call(inp, config, causal), inp)


def ours_fp8(inp, granularity: str = "block", qk_terms: int = 1, pv_terms: int = 1):
    """Our FP8 op (``precision="fp8"``: quantization inside the call) with its work list built once;
    ``granularity="token"``: the strict mode (per-token exponents, ``causal_dq_scale``); ``qk_terms=2``: two-term
    Q and K; ``pv_terms=2``: two-term P~ and V."""
    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list

    wl = build_fp8_work_list(inp["cu"], inp["T"], causal=True, validate=False)

    def call(q, k, v):
        return varlen_attention(q, k, v, inp["cu"], inp["max_seqlen"], precision="fp8", work_list=wl,
                                scale_granularity=granularity, causal_dq_scale=granularity == "token",
                                qk_terms=qk_terms, pv_terms=pv_terms)

    return _fwd_bwd_fns(call, inp)


def ours_fp8_kernel(inp):
    """The FP8 forward kernel alone on pre-quantized operands (``fp8_attention_forward``): forward only."""
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_attention_forward, fp8_quantize

    wl = build_fp8_work_list(inp["cu"], inp["T"], causal=True, validate=False)
    ops = fp8_quantize(inp["q"], inp["k"], inp["v"], inp["cu"])

    def fwd():
        return fp8_attention_forward(ops, inp["cu"], work_list=wl)

    return fwd, None, None


def flex(inp):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not hasattr(flex, "_compiled"):
        flex._compiled = torch.compile(flex_attention, dynamic=False)
    T = inp["T"]
    doc = torch.repeat_interleave(torch.arange(len(inp["lengths"]), device="cuda", dtype=torch.int32),
                                  torch.as_tensor(inp["lengths"], device="cuda"))

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    gqa = inp["q"].shape[1] != inp["k"].shape[1]

    def call(q, k, v):
        return flex._compiled(q, k, v, block_mask=bm, enable_gqa=gqa)

    return _fwd_bwd_fns(call, inp, layout=lambda x: x.transpose(0, 1).unsqueeze(0))


def varlen(inp):
    from torch.nn.attention import varlen as vmod

    fn = vmod.varlen_attn
    params = inspect.signature(fn).parameters
    cu, m = inp["cu"], inp["max_seqlen"]
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kw["is_causal"] = True
    expand = inp["q"].shape[1] // inp["k"].shape[1]

    def call(q, k, v):
        if expand > 1 and getattr(varlen, "_expand", False):
            k, v = k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1)
        return fn(q, k, v, cu, cu, m, m, **kw)

    return _fwd_bwd_fns(call, inp)


def fa4_func():
    """FlashAttention-4's packed varlen entry point; raises ImportError when the package is not installed."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa4(inp):
    """FlashAttention-4 (CuTe DSL; the sm90 kernels on Hopper) on the packed ``(T, H, D)`` tensors, causal, GQA
    native. Its return is ``out`` or ``(out, lse)`` depending on the version: both are handled."""
    fn = fa4_func()
    cu, m = inp["cu"], inp["max_seqlen"]

    def call(q, k, v):
        out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True)
        return out[0] if isinstance(out, (tuple, list)) else out

    return _fwd_bwd_fns(call, inp)


def sdpa_padded_call(inp):
    """The bare call ``(q, k, v) -> o`` of padded SDPA on the packed ``(T, H, D)`` tensors of ``inp``
    (a dense ``(B, H, L, D)`` view), or None where documents differ in length."""
    lens = inp["lengths"]
    if len(set(lens.tolist())) != 1:
        return None
    B, L = len(lens), int(lens[0])
    gqa = inp["q"].shape[1] != inp["k"].shape[1]
    F = torch.nn.functional

    def view(x):
        return x.view(B, L, x.shape[1], x.shape[2]).transpose(1, 2)

    def call(q, k, v):
        o = F.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=True, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(B * L, q.shape[1], q.shape[2])

    return call


def sdpa_padded(inp):
    call = sdpa_padded_call(inp)
    return None if call is None else _fwd_bwd_fns(call, inp)


def cudnn_fp8(inp):
    """cuDNN's FP8 attention (``peer_cudnn_fp8.py``: per-tensor scales, batched rows, E4M3 in and out,
    quantization outside the timed calls) on the row's equal-length documents, or None."""
    lens = inp["lengths"]
    if len(set(lens.tolist())) != 1:
        return None
    B, L = len(lens), int(lens[0])

    def view(x):
        return x.view(B, L, x.shape[1], x.shape[2])

    p = _peer_cudnn_fp8().cudnn_fp8_peer(view(inp["q"]), view(inp["k"]), view(inp["v"]), view(inp["do"]), causal=True)
    return p["fwd"], p["train"], None


PEERS = {"fa4": fa4, "flex": flex, "varlen": varlen, "sdpa": sdpa_padded}
PACKED_PEERS = ("fa4", "flex", "varlen")
PEER_LABELS = {"fa4": "FA4-sm90", "flex": "FlexAttention", "varlen": "varlen_attn", "sdpa": "padded SDPA"}
# peers that need an optional package: name -> the function that imports it
OPTIONAL_PEERS = {"fa4": fa4_func}


def available_peers(peers: list[str]) -> list[str]:
    """``peers`` without the optional ones whose package does not import (one line printed for each)."""
    out = []
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p!r} (known: {', '.join(PEERS)})")
        if p in OPTIONAL_PEERS:
            try:
                OPTIONAL_PEERS[p]()
            except Exception as e:  # noqa: BLE001 - any import failure means: not runnable here
                print(f"peer {p} skipped: {_short_error(e)}", flush=True)
                continue
        out.append(p)
    return out


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower():
        return "out of memory"
    return (type(e).__name__ + ": " + msg)[:120]


def measure(name, make, inp, *, fwd=True, train=True, rep=200):
    """Time one implementation; returns dict with fwd_ms / train_ms or error."""
    res = {}
    try:
        fns = make(inp)
        if fns is None:
            return {"error": "n/a (documents of unequal length)"}
        f, t, leaves = fns
        if fwd:
            f()
            torch.cuda.synchronize()
            res["fwd_ms"] = time_ms(f, rep=rep)
        if train:
            t()
            torch.cuda.synchronize()
            res["train_ms"] = time_ms(t, grad_to_none=leaves, rep=rep)
    except Exception as e:  # noqa: BLE001 - a peer failing is a result
        res["error"] = _short_error(e)
        torch.cuda.synchronize()
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return res


def peak_memory(make, inp, fp8: bool = False) -> dict:
    """Peak bytes allocated by one training call beyond its inputs, plus the own-tensor bytes; ``fp8``:
    the own tensors also count the E4M3 codes the forward saves for the backward (Q, K in both layouts,
    V row-major: 2 T H_q D + 3 T H_kv D bytes) and their exponent bytes (T (H_q + 2 H_kv))."""
    q, k, do = inp["q"], inp["k"], inp["do"]
    T, H, D = q.shape
    own = 2 * (4 * q.numel() + 4 * k.numel()) + 4 * H * T  # bf16 q,o,dO,dq + k,v,dk,dv; fp32 lse
    if fp8:
        own += 2 * q.numel() + 3 * k.numel() + T * (H + 2 * k.shape[1])
    try:
        fns = make(inp)
        _, t, leaves = fns
        t()
        for x in leaves:
            x.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        inputs = sum(x.numel() * x.element_size() for x in leaves) + do.numel() * do.element_size()
        return {"peak_bytes": int(peak + inputs), "own_bytes": int(own)}
    except Exception as e:  # noqa: BLE001
        return {"error": _short_error(e), "own_bytes": int(own)}
    finally:
        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# table
# ----------------------------------------------------------------------------------------------


def _fmt_ms(r, key):
    if "error" in r and key not in r:
        return r["error"]
    return f"{r[key]:.2f}" if key in r else "-"


def markdown(rows) -> str:
    out = []
    for key, label in (("fwd_ms", "forward"), ("train_ms", "training call (fwd+bwd)")):
        out.append(f"\n### {label}: ms (TFLOP/s); ratio = peer time / our time (> 1: we are faster)\n")
        names = ("fa4", "flex", "varlen", "sdpa")
        out.append("| wl | ours | TFLOP/s | " + " | ".join(PEER_LABELS[p] for p in names)
                   + " | vs FA4-sm90 | vs best packed | vs padded SDPA |")
        out.append("|---|" + "---|" * (len(names) + 5))
        for r in rows:
            o = r["impl"].get("ours", {})
            flops = r["flops_fwd"] * (3.5 if key == "train_ms" else 1.0)
            t = o.get(key)
            tf = f"{flops / (t * 1e-3) / 1e12:.0f}" if t else "-"
            peers = {p: r["impl"].get(p, {}) for p in names}
            packed = [peers[p][key] for p in PACKED_PEERS if key in peers[p]]
            best = min(packed) if packed else None

            def ratio(x):
                return f"{x / t:.2f}x" if (t and x) else "-"

            cells = [_fmt_ms(peers[p], key) for p in names]
            out.append(f"| {r['name']} | {_fmt_ms(o, key)} | {tf} | " + " | ".join(cells) + " | "
                       f"{ratio(peers['fa4'].get(key))} | {ratio(best)} | {ratio(peers['sdpa'].get(key))} |")
    mem = [r for r in rows if "memory" in r]
    if mem:
        out.append("\n### peak memory of one training call (GB; own tensors = q,k,v,o,dO,dq,dk,dv,lse)\n")
        out.append("| wl | own tensors | ours peak | ratio | FA4-sm90 peak | ratio | varlen_attn peak | ratio | "
                   "padded-to-longest tokens |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in mem:
            m = r["memory"]
            own = m["ours"]["own_bytes"]

            def cell(x):
                if "peak_bytes" not in x:
                    return x.get("error", "-"), "-"
                return f"{x['peak_bytes'] / 1e9:.2f}", f"{x['peak_bytes'] / own:.2f}x"

            a, ar = cell(m["ours"])
            f4, f4r = cell(m.get("fa4", {}))
            b, br = cell(m.get("varlen", {}))
            out.append(f"| {r['name']} | {own / 1e9:.2f} | {a} | {ar} | {f4} | {f4r} | {b} | {br} | "
                       f"{r['pad_factor']:.1f}x |")
        for r in mem:
            x = r["memory"].get("ours_fp8")
            if x:
                peak = f"{x['peak_bytes'] / 1e9:.2f} GB" if "peak_bytes" in x else x.get("error", "-")
                ratio = f"{x['peak_bytes'] / x['own_bytes']:.2f}x" if "peak_bytes" in x else "-"
                out.append(f"\n{r['name']} precision=\"fp8\": peak {peak}, own tensors incl. the saved FP8 codes "
                           f"{x['own_bytes'] / 1e9:.2f} GB, ratio {ratio} (issue 28 target <= 1.2x)")
    f8 = [r for r in rows if "ours_fp8" in r["impl"]]
    if f8:
        out.append("\n### FP8 (precision=\"fp8\"): ms; ratio = fastest BF16 time of the row (ours, FA4-sm90, "
                   "FlexAttention, varlen_attn, padded SDPA) / FP8 time (> 1: FP8 is faster)\n")
        out.append("| wl | fwd incl. quantization | kernel alone | ratio incl. quant | ratio kernel | fastest BF16 fwd |"
                   " training call | ratio | fastest BF16 training call | vs our BF16 training call |"
                   " strict (token) training call | strict / block | cuDNN FP8 fwd / training call | ours vs cuDNN FP8"
                   " training call | qk_terms=2 fwd / training call | qk_terms=2 ratio fwd / training call |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in f8:
            bf, bt = _fastest_bf16(r, "fwd_ms"), _fastest_bf16(r, "train_ms")
            a, kk = r["impl"]["ours_fp8"], r["impl"].get("ours_fp8_kernel", {})
            tk = r["impl"].get("ours_fp8_token", {})
            cd = r["impl"].get("cudnn_fp8", {})
            t2 = r["impl"].get("ours_fp8_qk2", {})

            def rat(base, x):
                return f"{base / x:.2f}x" if (base and x) else "-"

            ours_t = r["impl"].get("ours", {}).get("train_ms")
            out.append(f"| {r['name']} | {_fmt_ms(a, 'fwd_ms')} | {_fmt_ms(kk, 'fwd_ms')} | "
                       f"{rat(bf, a.get('fwd_ms'))} | {rat(bf, kk.get('fwd_ms'))} | {f'{bf:.2f}' if bf else '-'} | "
                       f"{_fmt_ms(a, 'train_ms')} | {rat(bt, a.get('train_ms'))} | {f'{bt:.2f}' if bt else '-'} | "
                       f"{rat(ours_t, a.get('train_ms'))} | {_fmt_ms(tk, 'train_ms')} | {rat(tk.get('train_ms'), a.get('train_ms'))} | "
                       f"{_fmt_ms(cd, 'fwd_ms')} / {_fmt_ms(cd, 'train_ms')} | {rat(cd.get('train_ms'), a.get('train_ms'))} | "
                       f"{_fmt_ms(t2, 'fwd_ms')} / {_fmt_ms(t2, 'train_ms')} | "
                       f"{rat(bf, t2.get('fwd_ms'))} / {rat(bt, t2.get('train_ms'))} |")
    if f8:
        out.append(fp8_hbm_table(f8))
    wlb = [r for r in rows if "worklist_ms" in r]
    if wlb:
        out.append("\nwork-list build (GPU, validate=False, per row): " +
                   ", ".join(f"{r['name']} {r['worklist_ms'] * 1e3:.0f} us" for r in wlb))
    return "\n".join(out)


def _fastest_bf16(r, key: str):
    """The fastest BF16 time (``"fwd_ms"`` / ``"train_ms"``) of a row over ours and the peers, or None."""
    return min((r["impl"][n][key] for n in ("ours", "fa4", "flex", "varlen", "sdpa")
                if key in r["impl"].get(n, {})), default=None)


#: H200 HBM3e bandwidth (bytes / s), the floor of issue 27's memory-bound rows
HBM_BYTES_PER_S = 4.8e12


def fp8_fwd_min_bytes(T: int, H: int, Hkv: int, D: int = HEAD_DIM) -> tuple[int, int]:
    """The fewest HBM bytes of one ``precision="fp8"`` forward call incl. quantization, as it is built:
    ``(quantization, kernel)``. Quantization reads bf16 Q, K, V and writes their E4M3 codes (1 byte), the
    transposing launch reads V's codes and writes V^T, plus the exponents (a byte per token and head,
    an upper bound for "block") and K's and V's float32 factor tables; the kernel reads Q, K, V^T codes and
    the tables once and writes bf16 O and float32 LSE. L2 hits of re-read tiles are not counted."""
    n = T * (H + 2 * Hkv) * D
    quant = 2 * n + n + 2 * T * Hkv * D + T * (H + 2 * Hkv) + 2 * 4 * T * Hkv
    kernel = n + 2 * 4 * T * Hkv + 2 * T * H * D + 4 * T * H
    return quant, kernel


def fp8_hbm_table(rows) -> str:
    """Issue 27's memory-bound check per row with FP8 times: the fewest bytes of the FP8 forward incl.
    quantization (:func:`fp8_fwd_min_bytes`) and its HBM floor against the measured time, next to the
    BF16 forward's (read q, k, v, write O and LSE) against the fastest BF16 forward of the row."""
    out = ["\n### FP8 forward incl. quantization against the HBM floor (4.8 TB/s; >= 0.9x asked on W3, W7)\n",
           "| wl | bytes quant + kernel (GB) | floor ms | measured ms | floor / measured | BF16 fwd bytes (GB) | "
           "floor / fastest BF16 fwd |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["impl"].get("ours_fp8", {})
        if "fwd_ms" not in a:
            continue
        T, H, Hkv = r["T"], r["H"], r["Hkv"]
        qb, kb = fp8_fwd_min_bytes(T, H, Hkv)
        floor = (qb + kb) / HBM_BYTES_PER_S * 1e3
        b16 = 2 * T * (H + 2 * Hkv) * HEAD_DIM + 2 * T * H * HEAD_DIM + 4 * T * H
        bf = _fastest_bf16(r, "fwd_ms")
        bfr = f"{b16 / HBM_BYTES_PER_S * 1e3 / bf:.2f}x" if bf else "-"
        out.append(f"| {r['name']} | {qb / 1e9:.2f} + {kb / 1e9:.2f} | {floor:.3f} | {a['fwd_ms']:.3f} | "
                   f"{floor / a['fwd_ms']:.2f}x | {b16 / 1e9:.2f} | {bfr} |")
    return "\n".join(out)


def _peer_cudnn_fp8():
    """The ``peer_cudnn_fp8`` module next to this script (imports without ``cudnn``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import peer_cudnn_fp8

    return peer_cudnn_fp8


def run(workloads, peers, rep, out_dir, memory_for=("S2",), config=None, fp8=False):
    rows = []
    cudnn_fp8_ok = fp8 and _peer_cudnn_fp8().cudnn_fp8_available() is None
    for name in workloads:
        spec = WORKLOADS[name]
        lengths = workload_lengths(name)
        H, Hkv = spec["num_heads"], spec["num_kv_heads"]
        inp = make_inputs(lengths, H, Hkv, seed=hash(name) % 10000)
        row = {"name": name, "T": inp["T"], "n_docs": len(lengths), "H": H, "Hkv": Hkv,
               "flops_fwd": attention_flops(lengths, H, HEAD_DIM, True, mode="fwd"), "impl": {},
               "pad_factor": float(len(lengths) * lengths.max() / lengths.sum())}
        t0 = time.time()
        mk = (lambda i: ours(i, config))
        row["impl"]["ours"] = measure("ours", mk, inp, rep=rep)
        from flamia_pack.kernels.attention import build_attention_work_list

        try:
            cu, T = inp["cu"], inp["T"]
            row["worklist_ms"] = time_ms(lambda: build_attention_work_list(cu, T, head_dim=HEAD_DIM, validate=False),
                                         rep=50, warmup=10)
        except Exception as e:  # noqa: BLE001
            row["worklist_error"] = _short_error(e)
        for p in peers:
            row["impl"][p] = measure(p, PEERS[p], inp, rep=rep)
        if fp8:  # in the same process as the BF16 peers (issue 27 / 28)
            row["impl"]["ours_fp8"] = measure("ours_fp8", ours_fp8, inp, rep=rep)
            row["impl"]["ours_fp8_kernel"] = measure("ours_fp8_kernel", ours_fp8_kernel, inp, train=False, rep=rep)
            row["impl"]["ours_fp8_token"] = measure("ours_fp8_token", lambda i: ours_fp8(i, "token"), inp, rep=rep)
            row["impl"]["ours_fp8_qk2"] = measure("ours_fp8_qk2", lambda i: ours_fp8(i, qk_terms=2), inp, rep=rep)
            if cudnn_fp8_ok:
                row["impl"]["cudnn_fp8"] = measure("cudnn_fp8", cudnn_fp8, inp, rep=rep)
        if name in memory_for:
            row["memory"] = {"ours": peak_memory(mk, inp)}
            for p in ("fa4", "varlen"):
                if p in peers:
                    row["memory"][p] = peak_memory(PEERS[p], inp)
            if fp8:
                row["memory"]["ours_fp8"] = peak_memory(ours_fp8, inp, fp8=True)
        row["seconds"] = time.time() - t0
        print(f"[{name}] {json.dumps(row['impl'])} ({row['seconds']:.0f} s)", flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "bench_attention.partial.json"), "w") as f:
            json.dump(rows, f, default=float)
        del inp
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _header() -> str:
    # FLAMIA_BENCH_COMMIT names the commit of a copied work tree (the device machine's copy may carry
    # an older .git, whose HEAD is not the code that ran)
    commit = os.environ.get("FLAMIA_BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except Exception:  # noqa: BLE001
            commit = "?"
    import triton

    return (f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}, commit {commit or '(tree copy)'}, "
            f"command `PYTHONPATH=. python3 benchmarks/bench_attention.py {' '.join(sys.argv[1:])}`")


# ----------------------------------------------------------------------------------------------
# calibration (item time = a * tiles + b, scheduler cost model)
# ----------------------------------------------------------------------------------------------


def fit_and_report(rows) -> tuple[str, dict]:
    """Fit (a, b) at D = 128 from the W rows -- bf16_fwd and bf16_fwd_bwd from our BF16 times, fp8_fwd,
    fp8_fwd_bwd and fp8_bwd from the ``--fp8`` columns where present (each on its shipped entry's
    geometry; fp8_fwd with its masked-tile and per-document terms, ``(a, b, c, d)``) -- and report the
    in-sample errors: ``(markdown, {kernel_path: (a, b) or (a, b, c, d)})``."""
    from flamia_pack.kernels.config import kernel_config, work_list_tile_config
    from flamia_pack.scheduler.simulate import Calibration, fit_calibration, predict

    # cost tiles = the work lists the kernels build (BLOCK_M 128, the forward's 64-key tile, merge_short)
    cfg = work_list_tile_config(kernel_config(HEAD_DIM, True), True)
    lines = ["| wl | pass | measured ms | predicted ms | error % |", "|---|---|---|---|---|"]
    fits = {}
    for key, path in (("fwd_ms", "bf16_fwd"), ("train_ms", "bf16_fwd_bwd")):
        samples = [(workload_lengths(r["name"]), r["H"], r["impl"]["ours"][key] * 1e3) for r in rows
                   if r["name"].startswith("W") and key in r["impl"].get("ours", {})]
        if not samples:
            continue
        a, b = fit_calibration(samples, num_sms=132, config=cfg)
        fits[path] = (a, b)
        cal = Calibration(kernel_path=path, head_dim=HEAD_DIM, gpu="H200", a_us_per_tile=a, b_us_per_item=b,
                          block_m=cfg.block_m, block_n=cfg.block_n, merge_short=cfg.merge_short, measured=True,
                          source="fit (bench_attention.py)")
        for r in rows:
            if not r["name"].startswith("W") or key not in r["impl"].get("ours", {}):
                continue
            # our launch order (decreasing cost, CTAs dispatched in order) is the greedy list
            # schedule the simulator calls "dynamic"
            p = predict(workload_lengths(r["name"]), num_heads=r["H"], num_kv_heads=r["Hkv"], head_dim=HEAD_DIM,
                        causal=True, pass_=path.split("_", 1)[1], policy="dynamic", calibration=cal, config=cfg)
            pred_ms = p.dynamic_ms
            meas = r["impl"]["ours"][key]
            lines.append(f"| {r['name']} | {path} | {meas:.2f} | {pred_ms:.2f} | {100 * (pred_ms - meas) / meas:+.1f} |")
    # FP8 (bench --fp8 rows): each entry on the geometry of its shipped entry (calibration.json documents the
    # units); fp8_bwd = training call - forward incl. quantization, as a call pays it
    from flamia_pack.scheduler.simulate import load_calibration
    from flamia_pack.scheduler.worklist import TileConfig

    table = load_calibration()
    hs = {r["name"]: (r["H"], r["Hkv"]) for r in rows}
    fp8_cols = {"fp8_fwd": lambda x: x["fwd_ms"], "fp8_fwd_bwd": lambda x: x["train_ms"],
                "fp8_bwd": lambda x: x["train_ms"] - x["fwd_ms"]}
    for path, col in fp8_cols.items():
        meas = {r["name"]: col(r["impl"]["ours_fp8"]) for r in rows if r["name"].startswith("W")
                and {"fwd_ms", "train_ms"} <= set(r["impl"].get("ours_fp8", {}))}
        if not meas:
            continue
        old = table.lookup(path, HEAD_DIM, "H200")
        fcfg = TileConfig(block_m=old.block_m, block_n=old.block_n, merge_short=old.merge_short)
        # the forward's entry: (a, b, c, d), the masked tiles counted without the masked_tile0 rule (tile 0
        # masked costs no more than mask-free on these fits) and a per-document term; the others (a, b)
        fwd = path == "fp8_fwd"
        fit = fit_calibration([(workload_lengths(w), hs[w][0], ms * 1e3) for w, ms in meas.items()], num_sms=132,
                              config=fcfg, masked_tile0_max_mean=0 if fwd else None, doc_term=fwd)
        fits[path] = fit
        a, b = fit[:2]
        cal = dataclasses.replace(old, a_us_per_tile=round(a, 4), b_us_per_item=round(b, 4), measured=True,
                                  **({"c_us_per_masked_tile": round(fit[2], 4), "masked_tile0_max_mean": 0,
                                      "d_us_per_doc": round(fit[3], 4)} if fwd else {}))
        for w, ms in meas.items():
            pr = predict(workload_lengths(w), num_heads=hs[w][0], num_kv_heads=hs[w][1], head_dim=HEAD_DIM,
                         causal=True, precision="fp8", pass_=path.split("_", 1)[1], calibration=cal)
            lines.append(f"| {w} | {path} | {ms:.2f} | {pr.predicted_ms:.2f} | "
                         f"{100 * (pr.predicted_ms - ms) / ms:+.1f} |")
    head = "\n".join(f"- {k}: a = {v[0]:.4f} us/tile, b = {v[1]:.4f} us/item"
                     + (f", c = {v[2]:.4f} us/masked tile, d = {v[3]:.4f} us/document" if len(v) > 2 else "")
                     for k, v in fits.items())
    return head + "\n\n" + "\n".join(lines), fits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5,W6,W7,W8,W9,S1,S2")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peers", default="fa4,flex,varlen,sdpa",
                    help="comma-separated: fa4 (skipped when flash_attn.cute is not importable), flex, varlen, sdpa")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of timed runs per measurement)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--config", default=None, help="a kernels.config NAMED_CONFIGS name for our kernels on every row "
                    "(default: the band table's choice per row)")
    ap.add_argument("--fit", default=None, help="fit calibration from a saved bench_attention.json (no GPU)")
    ap.add_argument("--table", default=None, help="print the tables of a saved bench_attention.json (no GPU)")
    ap.add_argument("--fp8", action="store_true", help="also time precision='fp8' (with quantization, the forward "
                    "kernel alone, the training call) against the fastest BF16 implementation of each row")
    args = ap.parse_args(argv)
    saved = args.fit or args.table
    if saved:
        flag = "--fit" if args.fit else "--table"
        try:
            with open(saved) as f:
                data = json.load(f)
            rows = data["rows"]
            if not isinstance(rows, list) or not all(isinstance(r, dict) and "impl" in r for r in rows):
                raise ValueError("'rows' is not a list of benchmark rows")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: {flag} {saved}: not a bench_attention.json of this script ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", file=sys.stderr)
            return 2
        if args.table:
            print(data.get("header", ""))
            print(markdown(rows))
            return 0
        text, fits = fit_and_report(rows)
        if not fits:
            print(f"error: --fit {args.fit}: no W1-W9 rows with our times to fit", file=sys.stderr)
            return 2
        print(text)
        missing = [p for p in ("fp8_fwd", "fp8_fwd_bwd", "fp8_bwd") if p not in fits]
        if missing:
            print(f"(no FP8 columns in this run: {', '.join(missing)} not fitted; run the benchmark with --fp8)")
        return 0
    peers = [] if args.no_peers else available_peers([p.strip() for p in args.peers.split(",") if p.strip()])
    os.makedirs(args.out, exist_ok=True)  # run() writes its partial JSON there after each row
    wls = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    header = _header()
    print(header, flush=True)
    config = None
    if args.config:
        from flamia_pack.kernels.config import candidate_config

        config = candidate_config(args.config, HEAD_DIM, True)
        header += f", config {args.config}"
    rows = run(wls, peers, args.rep, args.out, config=config, fp8=args.fp8)
    table = markdown(rows)
    print(table)
    with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
        f.write(header + "\n" + table + "\n")
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
