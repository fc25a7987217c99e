"""What limits the FP8 forward's accuracy: ablations inside the emulation's arithmetic (CPU only).

The FP8 kernel matches :mod:`flamia_pack.kernels.fp8_emulation` to cosine > 0.9999 on the same
codes, so the emulation's error vs the exact result *is* the kernel's. This probe re-runs the
emulation's forward with each rounding stage switched on or off, on the same packed row, and
compares every variant with the exact reference (:func:`packed_attention_reference` in float64
on the same bf16 inputs).

Stages (module docs of ``fp8_emulation``): the E4M3 codes of Q, K and V (token-block exponents,
``quant.quantize_token_blocks``), and the E4M3 rounding of the folded probabilities
``P~ = E4M3(p * 2^(e_v - r + boost))``. "Not rounded" keeps the *same* exponents and the same
fold and replaces only the rounding: the operand's code is ``x * 2^-e`` unrounded (exact in fp32
for bf16 x) and ``P~`` stays fp32. All the rest is the emulation's arithmetic, unchanged: per
128-key tile online softmax in fp32, ``r_i`` over the visible keys, fp64 products rounded once to
fp32, ``O = bf16(acc / l)``. :func:`ablated_forward` is that forward (its helpers are the
emulation's own functions); with every stage on it equals ``fp8_attention_forward`` bitwise,
which the probe checks on a small row before measuring.

Rows:

* ``N(0,1)``, ``K ch x20`` (``k[:, :, [5, 17, 40, 99]] *= 20``: zero-mean outlier channels) and
  ``K ch +20`` (the same channels ``+= 20``: a shared offset instead; fewer ablations): 4
  documents x 4096 tokens, causal, head_dim 128, bf16 -- the GPU probe's numerics row
  (``fp8_fwd_probe.py``) but with ``--heads`` heads (default 4 instead of 16, for CPU time;
  heads are independent, so this only samples fewer of them);
* ``GPT L<n>``: q, k, v (after RoPE, cast to bf16) entering layer n of the
  ``examples/train_tiny_gpt.py`` model in its default shape (d_model 256, 4 layers, 4 heads:
  head_dim 64, no change needed), trained by the example's own loop on the CPU for
  ``--gpt-steps`` steps on the bundled stdlib sample (512-token rows, 2 rows per step, seed 0),
  captured on a row of 4 sample documents x 4096 tokens (each one's first 4096 bytes). Layer
  ``--gpt-layer`` (default 1, the lowest cosine of the four) gets every ablation, the others only
  ``a``. Positions past 511 are outside what the model was trained on; the point is the
  activations' value distribution (RoPE-rotated q, k with large high-frequency channels).

Ablations (rows of the table): ``a`` full FP8 (``fp8_attention_forward`` itself, block and token
granularity; ``p->0`` is its ``stats["p_zero_fraction"]``, the share of p > 0 whose P~ rounds to
0); ``none``: no rounding stage (the control: the emulation's fp32 arithmetic and bf16 output);
``b`` Q, K, V rounded, P~ fp32; ``c`` only P~ rounded; ``d`` only V; ``e`` only Q and K (``e.q``,
``e.k``: only Q, only K); ``g`` V and P~ (QK^T exact); ``h`` all but K; ``f`` full FP8 with
``boost_log2`` 0 and 4 (8 is ``a``); ``fix``: full FP8 on K minus the mean of its document's first
32 keys (per head and channel, in fp32; it adds ``-q_i . mu`` to every score of row i, so softmax,
hence the reference, is unchanged; rows 0-30 of a document read, through the rounding only,
keys they cannot see: the within-group dependency ``"block"`` exponents already have);
``fix K-k0``: the same with the document's first key as the mean, which every row sees (causal
even under ``"token"``). ``b``-``h`` and ``fix`` use block granularity. For small independent
errors ``1 - cos`` adds up over the stages, so that column gives each stage's share.

What it showed (defaults; the numbers are deterministic): on N(0,1) the four E4M3 roundings cost
about the same each (``1 - cos``: Q 2.9e-4, K 3.0e-4, V 3.6e-4, P~ 2.1e-4, sum 1.16e-3 = full FP8,
cos 0.99884): the 3-bit-mantissa floor, not a scale or underflow effect (block = token, boost 0/4/8
alike). With the x20 K channels the loss is the QK^T stage (K's codes 1.0e-2, Q's 1.3e-3 of the
1.17e-2); P~ underflow (36% of p > 0 round to 0) costs nothing; K mean-smoothing does not help
(zero-mean channels), while on ``+20`` offset channels it restores the N(0,1) floor. The tiny GPT
(layer 1) loses 1.17e-3, 60% of it in K's codes (its RoPE high-frequency channels).

Run (about 5 minutes on 2 CPU cores, 1.5 of them training the GPT; ``--gpt-steps 0`` skips it)::

    PYTHONPATH=. python benchmarks/probes/fp8_numerics.py [--heads 4] [--gpt-steps 200] [--gpt-layer 1]

Prints the check, a line on the trained GPT and its chosen layer, the seconds per row, one
markdown table (row, ablation, cosine, ``1 - cos``, max and 99th percentile over (token, head) of
the relative row error ``|o - ref| / |ref|``, ``p->0``) and the wall time.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import math
import pathlib
import time
from typing import NamedTuple

import torch

from flamia_pack.kernels.fp8_emulation import (
    TILE_ALIGN,
    _doc_local,
    _fold_p,
    _segments,
    _steps,
    exact_mm,
    fp8_attention_forward,
    pow2,
    qk_scale_f32,
    reference_exponent,
    scores,
    visibility,
)
from flamia_pack.kernels.reference import packed_attention_reference
from flamia_pack.quant import UE8M0_BIAS, quantize_token_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTLIER_CHANNELS = [5, 17, 40, 99]
#: ablation -> (round Q, round K, round V, round P~); every other option as the default forward
STAGES = {
    "none": (False, False, False, False),
    "b QKV": (True, True, True, False),
    "c P~": (False, False, False, True),
    "d V": (False, False, True, False),
    "e QK": (True, True, False, False),
    "e.q Q": (True, False, False, False),
    "e.k K": (False, True, False, False),
    "g V,P~": (False, False, True, True),
    "h not K": (True, False, True, True),
}


class Operand(NamedTuple):
    """``(T, H, D)`` float64 codes (E4M3 values, or ``x * 2^-e`` unrounded) and ``(T, H)`` int32 exponents."""

    codes: torch.Tensor
    exps: torch.Tensor


def operand(x: torch.Tensor, cu: torch.Tensor, granularity: str, rounded: bool) -> Operand:
    """The emulation's quantization of ``x`` with (``rounded``) or without the E4M3 rounding of the codes."""
    qz = quantize_token_blocks(x, cu, granularity, validate=False)
    e = qz.exponents.to(torch.int32) - UE8M0_BIAS
    if rounded:
        return Operand(qz.codes.to(torch.float64), e)
    return Operand((x.float() * pow2(-e)[..., None]).double(), e)  # power-of-two scaling: exact


def ablated_forward(q: Operand, k: Operand, v: Operand, cu: list[int], *, round_p: bool = True,
                    block_n: int = 128, boost: int = 8, causal: bool = True,
                    stats: dict | None = None) -> torch.Tensor:
    """``fp8_emulation._forward_impl`` (``pv_accumulator="fp32"``) on prepared operands, with the
    rounding of ``P~`` optional; returns ``O`` ``(T, H, D)`` bf16. Same tiles, same helpers,
    same operation order: with rounded operands and ``round_p`` it is the emulation bitwise."""
    T, H, D = q.codes.shape
    g = H // k.codes.shape[1]
    qk = qk_scale_f32(D ** -0.5)
    o = torch.zeros((T, H, D), dtype=torch.bfloat16)
    n_vis = n_zero = 0

    def heads(op: Operand, lo: int, hi: int, rep: int):
        c, e = op.codes[lo:hi].transpose(0, 1), op.exps[lo:hi].transpose(0, 1)
        if rep > 1:
            c, e = c.repeat_interleave(rep, dim=0), e.repeat_interleave(rep, dim=0)
        return c.contiguous(), e.contiguous()

    for lo, hi, single in _segments(cu, block_n):  # block_m = block_n = 128: min(block_m, block_n)
        L = hi - lo
        doc, dpos = _doc_local(cu, lo, hi)
        (qc, eq), (kc, ek), (vc, ev) = heads(q, lo, hi, 1), heads(k, lo, hi, g), heads(v, lo, hi, g)
        m = torch.full((H, L), -math.inf, dtype=torch.float32)
        l = torch.zeros((H, L), dtype=torch.float32)
        acc = torch.zeros((H, L, D), dtype=torch.float32)
        for k0, k1, r0 in _steps(L, single, block_n, causal, lo % TILE_ALIGN):
            rows, keys = slice(r0, L), slice(k0, k1)
            vis = visibility(doc, dpos, rows, keys, causal)
            s = scores(qc[:, rows], eq[:, rows], kc[:, keys], ek[:, keys], qk).masked_fill(~vis, -math.inf)
            m_old = m[:, rows]
            m_new = torch.maximum(m_old, s.amax(-1))
            finite = torch.isfinite(m_new)
            p = torch.where(vis & finite[..., None], torch.exp2(s - m_new[..., None]), 0.0)
            alpha = torch.where(torch.isfinite(m_old), torch.exp2(m_old - m_new), torch.zeros((), dtype=torch.float32))
            alpha = torch.where(finite, alpha, torch.ones((), dtype=torch.float32))
            l[:, rows] = l[:, rows] * alpha + p.double().sum(-1).float()
            r, _ = reference_exponent(ev[:, keys], vis)
            if round_p:
                ptf = _fold_p(p, ev[:, keys], r, vis, boost).float()
            else:  # the same fold, no E4M3 rounding (a power-of-two factor: exact in fp32)
                d = (ev[:, keys][:, None, :] - r[:, :, None] + boost).clamp(min=-200)
                ptf = torch.where(vis, p * pow2(d), torch.zeros((), dtype=torch.float32))
            if stats is not None:
                n_vis += int((p > 0).sum())
                n_zero += int(((p > 0) & (ptf == 0)).sum())
            pv = exact_mm(ptf, vc[:, keys])
            acc[:, rows] = acc[:, rows] * alpha[..., None] + pv * pow2(r - boost)[..., None]
            m[:, rows] = m_new
        o[lo:hi] = (acc / l[..., None]).to(torch.bfloat16).transpose(0, 1)
    if stats is not None:
        stats["p_zero_fraction"] = n_zero / max(n_vis, 1)
    return o


def metrics(o: torch.Tensor, ref: torch.Tensor, n: int) -> tuple[float, float, float]:
    """Cosine of the flattened O over the first ``n`` tokens; max and 99th percentile of the
    per-(token, head) relative error ``|o - ref| / |ref|``."""
    a, b = o[:n].double(), ref[:n].double()
    cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).flatten()
    return cos, float(rel.max()), float(torch.quantile(rel.float(), 0.99))


def smooth_k(k: torch.Tensor, cu: torch.Tensor, first: int = 32) -> torch.Tensor:
    """fp32 ``k`` minus, per document, head and channel, the mean of the document's first ``first`` keys."""
    out = k.float().clone()
    c = cu.tolist()
    for a, b in itertools.pairwise(c):
        if b > a:
            out[a:b] -= out[a:min(b, a + first)].mean(0, keepdim=True)
    return out


def check(seed: int = 1) -> None:
    """:func:`ablated_forward` with every stage on is ``fp8_attention_forward`` bitwise (small row)."""
    g = torch.Generator().manual_seed(seed)
    lens = [300, 1, 77, 700, 129]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    T = int(cu[-1]) + 9
    q, k, v = (torch.randn((T, 2, 64), generator=g).bfloat16() for _ in range(3))
    for gran in ("block", "token"):
        for boost in (0, 8):
            st_lib, st_abl = {}, {}
            want, _ = fp8_attention_forward(q, k, v, cu, scale_granularity=gran, boost_log2=boost, stats=st_lib)
            ops = [operand(x, cu, gran, True) for x in (q, k, v)]
            got = ablated_forward(*ops, cu.tolist(), boost=boost, stats=st_abl)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)) or st_abl["p_zero_fraction"] != \
                    st_lib["p_zero_fraction"]:
                raise SystemExit(f"check failed ({gran}, boost {boost}): the probe's forward is not the emulation's")
    print("check: ablated_forward with every stage on == fp8_attention_forward bitwise (block/token, boost 0/8)")


def synthetic_rows(H: int, seed: int = 3, tokens: int = 4096):
    """The issues' synthetic inputs, 4 documents x ``tokens``, D 128: ``(name, q, k, v, cu, only)`` for N(0, 1),
    K ch x20 and K ch +20 (``only``: this probe's ablations that row runs, None for all)."""
    g = torch.Generator().manual_seed(seed)
    T = 4 * tokens
    cu = torch.tensor([0, tokens, 2 * tokens, 3 * tokens, 4 * tokens])
    q, k, v = (torch.randn((T, H, 128), generator=g).bfloat16() for _ in range(3))
    k_out, k_off = k.clone(), k.clone()
    k_out[:, :, OUTLIER_CHANNELS] *= 20  # zero-mean outlier channels (the GPU probe's row)
    k_off[:, :, OUTLIER_CHANNELS] += 20  # the same channels with a shared offset instead
    return [("N(0,1)", q, k, v, cu, None), ("K ch x20", q, k_out, v, cu, None),
            ("K ch +20", q, k_off, v, cu, {"a.block", "e QK", "h not K", "fix"})]


def gpt_capture(steps: int):
    """Train ``examples/train_tiny_gpt.py``'s model with its own training loop and capture the
    q, k, v that every layer hands to ``varlen_attention`` on 4 sample documents x 4096 tokens.

    Returns ``([(q, k, v) per layer] in bf16, cu_seqlens)``."""
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", ROOT / "examples" / "train_tiny_gpt.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    made = []

    class Kept(ex.TinyGPT):  # the example's model, kept for the capture after its train() returns
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    ex.TinyGPT = Kept
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        summary = ex.main(["--device", "cpu", "--steps", str(steps), "--capacity", "512", "--batch-rows", "2",
                           "--seed", "0", "--no-progress", "--log-every", str(steps)])
    model = made[0].eval()
    print(f"gpt: trained {summary['steps']} steps in {time.perf_counter() - t0:.0f} s, loss "
          f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (d_model 256, 4 layers, 4 heads, head_dim "
          f"{model.head_dim})")

    from flamia_pack.loaders.sources import open_source
    docs = []
    for d in open_source(ex.SAMPLE):
        if len(d) >= 4096:
            docs.append(torch.as_tensor(d[:4096], dtype=torch.long))
        if len(docs) == 4:
            break
    ids = torch.cat(docs)
    cu = torch.tensor([0, 4096, 8192, 12288, 16384])
    batch = {"input_ids": ids[None], "position_ids": torch.arange(4096).repeat(4)[None], "cu_seqlens": cu,
             "max_seqlen": 4096}
    seen = []
    real = ex.varlen_attention

    def capture(q, k, v, *a, **kw):
        seen.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return real(q, k, v, *a, **kw)

    ex.varlen_attention = capture
    try:
        with torch.no_grad():
            model(batch)
    finally:
        ex.varlen_attention = real
    return [tuple(x.bfloat16() for x in qkv) for qkv in seen], cu


def issue_inputs(heads: int, names, gpt_steps: int, layers, tokens: int = 4096):
    """The issues' inputs a numerics probe walks, as ``(name, q, k, v, cu)``: the :func:`synthetic_rows` named in
    ``names`` (``heads`` heads, 4 documents x ``tokens``), then (``gpt_steps`` > 0) the layers ``layers`` of
    :func:`gpt_capture` as ``GPT L<n>``, in that order (the capture trains only when the synthetic rows are done)."""
    for name, q, k, v, cu, _ in synthetic_rows(heads, tokens=tokens):
        if name in names:
            yield name, q, k, v, cu
    if gpt_steps:
        captured, gcu = gpt_capture(gpt_steps)
        for layer in layers:
            yield (f"GPT L{layer}", *captured[layer], gcu)


def gpt_rows(steps: int, layer: int):
    """The ``GPT L<n>`` rows: every ablation on :func:`gpt_capture`'s layer ``layer``, the full FP8
    forward (block) on the other layers; prints a line of statistics of the chosen layer."""
    layers, cu = gpt_capture(steps)
    q, k, v = layers[layer]
    kf = k.float()
    ch = kf.abs().amax(0)  # (H, D) per-channel amax
    top = ch.topk(4, dim=-1).indices.tolist()
    mean_ratio = float((kf.mean(0).abs() / kf.std(0)).amax())
    print(f"gpt: layer {layer}: |q|max {float(q.abs().max()):.2f} |k|max {float(k.abs().max()):.2f} |v|max "
          f"{float(v.abs().max()):.2f}; K's largest channels per head {top} (RoPE rotates d with "
          f"d + {q.shape[-1] // 2}); largest |channel mean| / channel std of K {mean_ratio:.2f}")
    rows = [(f"GPT L{layer}", q, k, v, cu, None)]
    rows += [(f"GPT L{i}", *qkv, cu, {"a.block"}) for i, qkv in enumerate(layers) if i != layer]
    return rows


def run_row(name, q, k, v, cu, only, table):
    """Every ablation (``only`` None) or those named in ``only`` on one row; appends to ``table``."""
    t0 = time.perf_counter()
    n = int(cu[-1])
    ref = packed_attention_reference(q, k, v, cu, causal=True, compute_dtype=torch.float64)
    cul = cu.tolist()

    def want(key):
        return only is None or key in only

    def add(label, o, pz=None):
        table.append((name, label, *metrics(o, ref, n), pz))

    for gran in ("block", "token"):
        if want("a") or want(f"a.{gran}"):
            st = {}
            o, _ = fp8_attention_forward(q, k, v, cu, scale_granularity=gran, stats=st)
            add(f"a full FP8 ({gran})", o, st["p_zero_fraction"])
    ops = {}
    for label, flags in STAGES.items():
        if want(label):
            for x, t, r in zip("qkv", (q, k, v), flags):
                if (x, r) not in ops:
                    ops[x, r] = operand(t, cu, "block", r)
            add(label, ablated_forward(ops["q", flags[0]], ops["k", flags[1]], ops["v", flags[2]], cul,
                                       round_p=flags[3]))
    for boost in (0, 4) if want("f") else ():
        st = {}
        o, _ = fp8_attention_forward(q, k, v, cu, boost_log2=boost, stats=st)
        add(f"f boost {boost}", o, st["p_zero_fraction"])
    for first, label in ((32, "fix K-mean32"), (1, "fix K-k0")) if want("fix") else ():
        st = {}
        o, _ = fp8_attention_forward(q, smooth_k(k, cu, first), v, cu, stats=st)
        add(label, o, st["p_zero_fraction"])
    print(f"row {name}: {time.perf_counter() - t0:.0f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=4, help="heads of the synthetic 4 x 4096 rows (the GPU probe: 16)")
    ap.add_argument("--gpt-steps", type=int, default=200, help="training steps of the tiny GPT (0: no GPT rows)")
    ap.add_argument("--gpt-layer", type=int, default=1, help="layer that gets every ablation (0-3)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    check()
    rows = synthetic_rows(a.heads)
    if a.gpt_steps > 0:
        rows += gpt_rows(a.gpt_steps, a.gpt_layer)
    table = []
    for row in rows:
        run_row(*row, table)
    print(f"\n4 docs x 4096 tokens, causal; synthetic rows: {a.heads} heads, head_dim 128; "
          f"GPT rows: 4 heads, head_dim 64. Reference: float64 on the same bf16 inputs.\n")
    print("| row | ablation | cos(O, ref) | 1 - cos | row rel err max | p99 | p->0 |")
    print("|---|---|---|---|---|---|---|")
    for name, label, cos, rel, p99, pz in table:
        pzs = "" if pz is None else f"{pz:.3f}"
        print(f"| {name} | {label} | {cos:.6f} | {1 - cos:.2e} | {rel:.3f} | {p99:.4f} | {pzs} |")
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
