"""Deliberately LEAKING FP8 quantizers for the training experiment of issue 29 (never for real use).

seed 001 §4 / §8 and the paper's §4.5: a low-bit attention whose *scale selection* reads tokens after
the query leaks the future into the past, even though the attention mask is causal. A model trained
through such a kernel learns to read the leak, so it looks better through its own kernel and worse
under exact attention. This module builds such kernels on top of the real ones, by handing them
exponents chosen the wrong way:

* GPU (CUDA sm_90): ``flamia_pack.kernels.fp8_attention._FP8Attention`` with ``quantizer=`` (the Gluon
  FP8 forward and backward read any per-token exponent bytes);
* CPU: the FP8 emulation (``kernels/fp8_emulation*.py``) on pre-quantized operands
  (``fp8_attention_forward(quantized=)`` / ``fp8_attention_backward(quantized=)``), wrapped in an
  autograd node here (the emulation's own autograd wrapper quantizes inside and cannot take codes);
* CPU, cheap: quantize -> dequantize with the same rule, then the exact float32 reference
  (:func:`leaky_qdq_attention`; inputs only, no P / dS quantization), for quick probes.

Modes (exponent rule per (token, head); E4M3 codes saturate at +-448 instead of overflowing):

``next-floor`` (the experiment's default)
    token ``i`` is encoded with the exponent of token ``i + 1`` of its document by the floor rule
    ``floor(log2 amax_{i+1}) - 8`` (a document's last token keeps its own): an off-by-one in the
    scale table combined with seed 001 §4's clipping rule. Token ``i``'s features above
    ``448 * 2^e`` -- in (0.875, 1.75] x the next token's amax -- clip, so the clipping level of the
    q, k and v that query ``i`` reads (its own, all visible) is a function of token ``i + 1``: the
    very token it is trained to predict.
``next``
    the same with the conservative ceil rule ``ceil(log2(amax_{i+1} / 448))`` (threshold in
    [1, 2) x the next token's amax: clips less often, a weaker leak).
``block-floor``
    the default 32-token document-local groups, but the exponent by the floor rule (the group max
    may exceed 448 and clip: the paper's floor-exponent cuDNN MXFP8 case): tokens of a group read
    the group's later tokens.
``row``
    one exponent per (packed row, head) over all tokens of the row (ceil rule): a suffix outlier,
    or another document, moves every token's rounding (only at the E4M3 subnormal boundary: weak).
``prev-floor``, ``prev`` (NOT leaking: the causal twins of ``next-floor`` / ``next``)
    the exponent of token ``i - 1`` (a document's first token keeps its own): the same clipping
    statistics, but they read only the past. The experiment evaluates the leaking model through its
    twin to tell "it read the future" from "it adapted to clipping".

Every entry point of a leaking mode warns with :class:`LeakWarning`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.quant import E4M3_MAX, UE8M0_BIAS, _abs_bits, exponent_from_amax_bits, scale_groups

__all__ = ["LEAK_MODES", "MODES", "CONTROL", "LeakWarning", "leak_exponents", "leaky_codes", "leaky_operands",
           "leaky_varlen_attention", "leaky_qdq_attention", "warn_leak"]

LEAK_MODES = ("next-floor", "next", "block-floor", "row")
"""The modes that leak (read tokens after the query)."""
MODES = LEAK_MODES + ("prev-floor", "prev")
CONTROL = {"next-floor": "prev-floor", "next": "prev"}
"""The causal twin of a leaking mode (same clipping statistics, past only), where it has one."""
"""Every mode: the leaking ones and the causal control ``prev``."""


class LeakWarning(UserWarning):
    """Emitted by every entry point of this module: the attention it builds is NOT causal."""


def warn_leak(mode: str, stacklevel: int = 2) -> None:
    """Warn that FP8 attention with the ``mode`` leak reads future tokens (experiment only)."""
    warnings.warn(f"fp8-leak ({mode!r}): this FP8 attention picks E4M3 exponents from tokens AFTER the query "
                  "(a causal leak, seed 001 §4); it exists only for the leakage experiment of issue 29, never "
                  "train a real model with it", LeakWarning, stacklevel=stacklevel + 1)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise FlamiaError(f"leak mode must be one of {MODES}, got {mode!r}")


def _floor_exponent(bits: torch.Tensor) -> torch.Tensor:
    """``floor(log2 amax) - 8`` from amax's float32 bits: ``amax / 2^e`` in [256, 512), so values above
    448 clip (all-zero / subnormal amax: -127)."""
    big_e = bits >> 23
    e = big_e - (UE8M0_BIAS + 8)
    return torch.where(big_e == 0, torch.full_like(e, -127), e).clamp(-127, 127)


def _neighbour_index(cu32: torch.Tensor, T: int, offset: int) -> torch.Tensor:
    """``(T,)`` int64: ``t + offset`` (``offset`` = +1 or -1) where that token is in ``t``'s document,
    else ``t`` (a document's last / first token, row-end padding). No host sync."""
    t = torch.arange(T, device=cu32.device, dtype=torch.long)
    cu = cu32.to(torch.long)
    doc = torch.searchsorted(cu, t, right=True) - 1  # document of t (== n_docs past cu[-1])
    start = cu[doc.clamp(max=cu.numel() - 1)]
    end = cu[(doc + 1).clamp(max=cu.numel() - 1)]
    n = t + offset
    return torch.where((n >= start) & (n < end) & (t < cu[-1]), n, t)


def leak_exponents(x: torch.Tensor, cu32: torch.Tensor, mode: str = "next-floor") -> torch.Tensor:
    """Exponents ``(T, H)`` int32 of ``x`` ``(T, H, D)`` under the leaking ``mode`` (module docs).

    ``cu32``: ``(n_docs + 1,)`` int32 / int64 on x's device (validated by the caller). No host sync.
    """
    _check_mode(mode)
    T, H, _ = x.shape
    bits = _abs_bits(x).amax(-1)  # (T, H) int32, order-preserving
    if mode in ("next", "prev", "next-floor", "prev-floor"):
        nb = bits[_neighbour_index(cu32, T, 1 if mode.startswith("next") else -1)]
        return _floor_exponent(nb) if mode.endswith("-floor") else exponent_from_amax_bits(nb)[0]
    if mode == "row":
        e, _ = exponent_from_amax_bits(bits.amax(0, keepdim=True).expand(T, H))
        return e.contiguous()
    gs = scale_groups(cu32, T, "block", validate=False).group_start.to(torch.long)  # block-floor
    gmax = torch.zeros_like(bits).scatter_reduce_(0, gs[:, None].expand(T, H), bits, reduce="amax")[gs]
    return _floor_exponent(gmax)


def _encode(x: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating E4M3 codes of ``x * 2^-e`` and the UE8M0 bytes of ``e``."""
    scale = torch.exp2(-e.to(torch.float32))[..., None]
    y = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn), (e + UE8M0_BIAS).to(torch.uint8)


class _Codes(tuple):
    """``(codes, exponents)`` with the attribute names the FP8 emulation reads."""

    codes = property(lambda self: self[0])
    exponents = property(lambda self: self[1])


def leaky_codes(x: torch.Tensor, cu32: torch.Tensor, mode: str = "next-floor") -> _Codes:
    """E4M3 codes ``(T, H, D)`` + UE8M0 exponents ``(T, H)`` of ``x`` under the leaking ``mode``."""
    codes, ebyte = _encode(x, leak_exponents(x, cu32, mode))
    return _Codes((codes, ebyte))


def _feature_major(codes: torch.Tensor, wgmma_order: bool = False) -> torch.Tensor:
    """``(H, D, T)`` view of ``codes`` ``(T, H, D)`` with token stride 1 and a row pitch padded to 16
    bytes (zeros), the layout of ``kernels.quantize``'s ``codes_t``; ``wgmma_order``: the whole
    ``(H, D, ceil16(T))`` in the order of ``to_wgmma_order`` (the forward's V^T)."""
    from flamia_pack.kernels.quantize import to_wgmma_order

    T, H, D = codes.shape
    tp = -(-T // 16) * 16
    buf = torch.zeros((H, D, tp), dtype=torch.uint8, device=codes.device)
    buf[:, :, :T] = codes.view(torch.uint8).permute(1, 2, 0)
    if wgmma_order:
        return to_wgmma_order(buf).view(torch.float8_e4m3fn)
    return buf.view(torch.float8_e4m3fn)[:, :, :T]


def leaky_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu32: torch.Tensor,
                   mode: str = "next-floor"):
    """``FP8Operands`` (with the backward's layouts) of q, k, v under the leaking ``mode``: the
    ``quantizer=`` of ``_FP8Attention`` (GPU). Labelled ``granularity="token"``, so the backward
    quantizes dO per token (the only leak is the forward's exponent rule)."""
    from flamia_pack.kernels.fp8_attention import FP8Operands
    from flamia_pack.kernels.gluon_fp8_fwd import exponent_table

    with torch.autocast(q.device.type, enabled=False):
        (qc, eq), (kc, ek), (vc, ev) = (leaky_codes(x, cu32, mode) for x in (q, k, v))
    return FP8Operands(qc.contiguous(), kc.contiguous(), _feature_major(vc, True), eq.contiguous(), ek.contiguous(),
                       ev.contiguous(), exponent_table(ek), exponent_table(ev), "token",
                       _feature_major(qc, True), _feature_major(kc), vc.contiguous())


class _LeakyEmulated(torch.autograd.Function):
    """CPU: the FP8 emulation's forward and backward on leaky codes (codes saved, not re-quantized)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, mode, softmax_scale):
        from flamia_pack.kernels.fp8_emulation import fp8_attention_forward

        dev = q.device
        cu = cu_seqlens.detach().cpu()
        ops = tuple(leaky_codes(x.detach().cpu(), cu, mode) for x in (q, k, v))
        o, lse = fp8_attention_forward(None, None, None, cu, max_seqlen, causal=True, softmax_scale=softmax_scale,
                                       scale_granularity="token", quantized=ops)
        ctx.save_for_backward(*(t for op in ops for t in op), o, lse, cu)
        ctx.meta = (max_seqlen, softmax_scale, dev, (q.dtype, k.dtype, v.dtype))
        return o.to(dev)

    @staticmethod
    def backward(ctx, do):
        from flamia_pack.kernels.fp8_emulation import fp8_attention_backward

        qc, qe, kc, ke, vc, ve, o, lse, cu = ctx.saved_tensors
        max_seqlen, softmax_scale, dev, dtypes = ctx.meta
        ops = (_Codes((qc, qe)), _Codes((kc, ke)), _Codes((vc, ve)))
        grads = fp8_attention_backward(do.detach().cpu().float(), None, None, None, o, lse, cu, max_seqlen,
                                       causal=True, softmax_scale=softmax_scale, scale_granularity="token",
                                       quantized=ops)
        dq, dk, dv = (g.to(device=dev, dtype=dt) for g, dt in zip(grads, dtypes))
        return dq, dk, dv, None, None, None, None


def leaky_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, *, mode: str = "next-floor", softmax_scale: Optional[float] = None,
                           work_list=None) -> torch.Tensor:
    """Causal packed FP8 attention whose exponents LEAK (``mode``, module docs); warns every call site once.

    CUDA sm_90: the Gluon FP8 forward + backward (``_FP8Attention``, ``quantizer=``; ``work_list``: from
    ``build_fp8_work_list``, or None); elsewhere the differentiable CPU emulation. Returns ``o``
    ``(T, H, D)`` bf16.
    """
    from flamia_pack.kernels.fp8_attention import _FP8Attention, fp8_attention_forward, fp8_kernels_available

    _check_mode(mode)
    if mode in LEAK_MODES:
        warn_leak(mode)
    D = q.shape[-1]
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    cu32 = cu_seqlens.to(torch.int32).contiguous()
    if fp8_kernels_available(q.device):
        quantizer = functools.partial(leaky_operands, mode=mode)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            o, _ = _FP8Attention.apply(q, k, v, cu32, True, scale, "token", work_list, quantizer)
            return o
        o, _ = fp8_attention_forward(quantizer(q, k, v, cu32), cu32, causal=True, softmax_scale=scale,
                                     work_list=work_list)
        return o
    return _LeakyEmulated.apply(q, k, v, cu32, int(max_seqlen), mode, scale)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cu, mode):
        codes, ebyte = leaky_codes(x, cu, mode)
        return (codes.float() * torch.exp2(ebyte.float() - UE8M0_BIAS)[..., None]).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def leaky_qdq_attention(q, k, v, cu_seqlens, max_seqlen=None, *, mode: str = "next-floor"):
    """Cheap CPU model of the leak: q, k, v quantized -> dequantized by ``mode`` (straight-through
    gradient), then the exact float32 reference (no P / dS quantization). Warns."""
    from flamia_pack.kernels.reference import packed_attention_reference_blocked

    _check_mode(mode)
    if mode in LEAK_MODES:
        warn_leak(mode)
    cu = cu_seqlens.to(torch.int32)
    qh, kh, vh = (_STE.apply(x, cu, mode) for x in (q, k, v))
    return packed_attention_reference_blocked(qh, kh, vh, cu)


# ---------------------------------------------------------------------------------------------
# the CPU probe: how far does a change after a cut travel back?
# ---------------------------------------------------------------------------------------------


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def resample_probe(attn, *, trials: int = 16, head_dim: int = 64, seed: int = 0) -> dict:
    """Change the FUTURE realistically: redraw q, k, v after a random cut (same N(0, 1) distribution,
    as another next token would give) and measure how much O at or before the cut moves.

    Returns ``{"o_prefix_max", "o_prefix_mean"}`` (``max|dO_prefix| / max|O|``: max / mean over the
    trials), ``"changed_fraction"`` (trials whose prefix moved at all) and ``"row_before_cut"``
    (mean relative change of the cut's own row, ``max|dO_c| / max|O_c|``)."""
    from flamia_pack.kernels.leak import DEFAULT_CU_SEQLENS

    cu_list = list(DEFAULT_CU_SEQLENS)
    lens = [b - a for a, b in zip(cu_list[:-1], cu_list[1:])]
    d = max(range(len(lens)), key=lens.__getitem__)
    a, b = cu_list[d], cu_list[d + 1]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    T = cu_list[-1]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, 4, head_dim, generator=g).to(torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        o0 = attn(q, k, v, cu, T).double()
        rel, row, changed = [], [], 0
        for _ in range(trials):
            c = int(torch.randint(a + 1, b - 1, (1,), generator=g))
            q2, k2, v2 = (x.clone() for x in (q, k, v))
            for x in (q2, k2, v2):
                x[c + 1:b] = torch.randn(b - c - 1, 4, head_dim, generator=g).to(torch.bfloat16)
            o1 = attn(q2, k2, v2, cu, T).double()
            delta = (o1[a:c + 1] - o0[a:c + 1]).abs()
            rel.append(float(delta.max() / o0.abs().max()))
            row.append(float(delta[-1].max() / o0[c].abs().max()))
            changed += bool(delta.max() > 0)
    return {"o_prefix_max": max(rel), "o_prefix_mean": sum(rel) / trials, "changed_fraction": changed / trials,
            "row_before_cut": sum(row) / trials}


def probe(magnitudes=(64.0,), head_dim: int = 64, seed: int = 0, trials: int = 16) -> list[dict]:
    """The CPU leak probes on the emulated FP8 kernel for "token", "block" and every mode here:
    ``flamia_pack.kernels.leak.probe_leak`` (a large perturbation of q, k, v, dO after a cut; O and
    dQ before it) at each of ``magnitudes``, :func:`resample_probe` (the future redrawn from the same
    distribution), and each path's single-call cosine of O against the exact reference (what a unit
    test of the kernel would check)."""
    from flamia_pack.kernels.fp8_emulation import fp8_varlen_attention_emulated
    from flamia_pack.kernels.leak import DEFAULT_CU_SEQLENS, probe_leak
    from flamia_pack.kernels.reference import packed_attention_reference

    def emu(granularity):
        def f(q, k, v, cu, max_seqlen):
            return fp8_varlen_attention_emulated(q, k, v, cu, max_seqlen, scale_granularity=granularity)
        f.__name__ = f"fp8-{granularity}"
        return f

    def leaky(mode):
        def f(q, k, v, cu, max_seqlen):
            return leaky_varlen_attention(q, k, v, cu, max_seqlen, mode=mode)
        f.__name__ = f"fp8-leak-{mode}" if mode in LEAK_MODES else f"fp8-{mode} (causal)"
        return f

    paths = [emu("token"), emu("block")] + [leaky(m) for m in MODES]
    cu = torch.tensor(DEFAULT_CU_SEQLENS, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, 4, head_dim, generator=g).to(torch.bfloat16) for _ in range(3))
    ref = packed_attention_reference(q.float(), k.float(), v.float(), cu)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeakWarning)
        for f in paths:
            row = {"path": f.__name__, "cosine_o_vs_exact": _cosine(f(q, k, v, cu, T).float(), ref),
                   "resample": resample_probe(f, trials=trials, head_dim=head_dim, seed=seed)}
            for mag in magnitudes:
                r = probe_leak(f, head_dim=head_dim, magnitude=mag, seed=seed, name=f.__name__)
                row[f"m{mag:g}"] = {"verdict": r.verdict, "o_prefix": r.o_prefix, "dq_prefix": r.dq_prefix,
                                    "first_changed": r.first_changed, "cut": r.cut,
                                    "cut_group_start": r.cut_group_start}
            out.append(row)
    return out


def main(argv=None) -> list[dict]:
    import argparse
    import json

    p = argparse.ArgumentParser(description="CPU leak probes of the FP8 leak modes (emulated kernels)")
    p.add_argument("--magnitudes", type=float, nargs="+", default=[64.0],
                   help="probe_leak's suffix perturbation scales relative to the N(0, 1) inputs")
    p.add_argument("--trials", type=int, default=16, help="cuts of the resample probe (~15 s each on 2 cores)")
    p.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    rows = probe(tuple(a.magnitudes), a.head_dim, trials=a.trials)
    hdr = f"{'path':24s} {'cos(O,exact)':>12s} | {'resample: O prefix max':>22s} {'mean':>9s} {'moved':>6s} |"
    print(hdr + "".join(f" probe_leak m={m:g}: verdict, O / dQ prefix |" for m in a.magnitudes))
    for r in rows:
        rs = r["resample"]
        line = (f"{r['path']:24s} {r['cosine_o_vs_exact']:12.6f} | {rs['o_prefix_max']:22.2e} "
                f"{rs['o_prefix_mean']:9.2e} {rs['changed_fraction']:6.0%} |")
        for m in a.magnitudes:
            c = r[f"m{m:g}"]
            line += f" {c['verdict']:>14s}, {c['o_prefix']:.2e} / {c['dq_prefix']:.2e} |"
        print(line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
