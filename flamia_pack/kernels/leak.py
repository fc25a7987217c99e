"""Causal leak probe for packed attention (DESIGN.md §5; paper §4.5; seed 001 §4 and §10).

A causal mask says query i reads keys j <= i of its own document. A quantizer whose scale groups
reach past i (a 32-token block, a per-tensor amax) lets later tokens steer how earlier ones are
rounded: a second dependency graph the mask does not describe. The probe measures it for ANY
attention callable ``f(q, k, v, cu_seqlens, max_seqlen) -> o``:

* **positive control**: pick a cut ``c`` inside a document and add a large perturbation
  (``magnitude`` x N(0, 1); large enough to change the 32-token group exponent, which the report
  checks) to q, k, v -- and to dO -- strictly after ``c`` in that document. Run forward + backward
  with the same fixed dO elsewhere and report ``max|dO_prefix| / max|O|`` where the prefix is the
  document's tokens ``[doc_start, c]``, the same for dQ (row-local given fixed dO[<= c]), and for
  dK/dV (informational: queries after ``c`` legitimately feed dK/dV of earlier keys);
* **negative control**: perturb a *different* document entirely; every output and gradient
  outside it must stay bitwise equal;
* **noise floor**: the unperturbed call twice; a non-zero difference means the callable is not
  deterministic and bitwise statements about it are void (use deterministic settings).

Verdicts: ``exact`` (nothing before the cut moved, nothing outside the document moved),
``within-group`` (the prefix moved, but only inside the cut's 32-token group: the documented
"block" default), ``prefix-leak`` (rows before the cut's group moved), ``cross-document`` (the
negative control, or the positive run outside its document, moved), ``nondeterministic``.

Built-in paths (:data:`PATHS`) emulate input quantization in torch: q, k, v are quantized and
dequantized (token blocks, per tensor, or MX features) and fed to the exact float32 reference
(``kernels.reference.packed_attention_reference_blocked``: its backward walks query blocks, so a
long document does not hold O(H * L^2) scores); the incoming gradient dO is encoded with the
same scheme on the way back (DESIGN.md §4: "dO encoded once with the same token-block scheme").
The quantize->dequantize steps are straight-through in the backward (identity Jacobian), so the
backward is the reference backward evaluated at the dequantized inputs. P and dS quantization
and accumulator scales are kernel internals that these paths do not model; probe the kernels
themselves for those (pass them as ``attn_fn``). The ``fp8-emu-*`` paths do model them: they run the
CPU emulation of the FP8 kernels (``kernels/fp8_emulation.py``: codes, P~ fold, dS payloads), and
take the head dims FP8 attention takes (64, 128), like ``varlen_attention(precision="fp8")``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Optional, Sequence

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.reference import packed_attention_reference_blocked
from flamia_pack.quant import (
    GROUP_SIZE,
    dequantize,
    dequantize_mx_features,
    quantize_mx_features,
    quantize_per_tensor,
    quantize_token_blocks,
)
from flamia_pack.varlen import validate_cu_seqlens

AttnFn = Callable[..., torch.Tensor]

#: Packing used by the CLI and the tests: four unaligned documents, lengths 77, 223, 33, 179.
DEFAULT_CU_SEQLENS = (0, 77, 300, 333, 512)

VERDICTS = ("exact", "within-group", "prefix-leak", "cross-document", "nondeterministic")
#: ``probe_leak``'s largest perturbation scale: N(0, 1) inputs times it keep every path's scores finite
MAX_MAGNITUDE = 65536.0
#: ``probe_leak``'s largest row, ``T * num_heads * head_dim`` elements per tensor (256 MiB in float32)
MAX_PROBE_ELEMENTS = 1 << 26


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeakReport:
    """Result of :func:`probe_leak`. Relative changes are ``max|delta| / max|base|`` of the same
    tensor over all tokens (float64 differences; 0.0 means bitwise equal)."""

    path: str
    """Name of the probed callable."""
    cu_seqlens: tuple[int, ...]
    total_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seed: int
    magnitude: float
    device: str
    doc: int
    """Document holding the cut (positive control)."""
    doc_start: int
    doc_end: int
    cut: int
    """Last unperturbed token of ``doc``; tokens ``cut+1 .. doc_end-1`` are perturbed."""
    cut_group_start: int
    """First token of the cut's 32-token scale group (``doc_start + 32 * j``)."""
    exponent_changed: bool
    """Positive-control sanity check: the perturbation changed the 32-token block exponent of
    the cut's group for at least one of q, k, v (else the probe could not see a block leak)."""
    o_prefix: float
    dq_prefix: float
    dk_prefix: float
    dv_prefix: float
    first_changed: Optional[int]
    """First token in ``[doc_start, cut]`` whose O or dQ row changed (None: none did)."""
    outside_positive: float
    """Largest relative change of O, dQ, dK or dV outside ``doc`` in the positive run."""
    neg_doc: Optional[int]
    """Document perturbed by the negative control (None with a single document)."""
    neg_outside: Optional[dict]
    """Relative change outside ``neg_doc`` per tensor (``o``, ``dq``, ``dk``, ``dv``)."""
    noise: float
    """Largest relative difference between two identical unperturbed runs."""

    @property
    def prefix_changed(self) -> bool:
        """True if O or dQ at or before the cut changed (a causal leak inside the document)."""
        return self.o_prefix > 0 or self.dq_prefix > 0

    @property
    def cross_document(self) -> bool:
        """True if anything outside a perturbed document changed (leak across documents)."""
        neg = max(self.neg_outside.values()) if self.neg_outside else 0.0
        return neg > 0 or self.outside_positive > 0

    @property
    def verdict(self) -> str:
        """One of :data:`VERDICTS` (see module docs)."""
        if self.noise > 0:
            return "nondeterministic"
        if self.cross_document:
            return "cross-document"
        if self.prefix_changed:
            if self.first_changed is not None and self.first_changed < self.cut_group_start:
                return "prefix-leak"
            return "within-group"
        return "exact"

    def to_dict(self) -> dict:
        """JSON-ready dict of every field plus ``verdict``."""
        d = dataclasses.asdict(self)
        d["cu_seqlens"] = list(self.cu_seqlens)
        d["verdict"] = self.verdict
        return d

    def rows(self) -> list[tuple[str, str]]:
        """(metric, formatted value) pairs in display order."""
        neg = self.neg_outside or {}

        def f(x: Optional[float]) -> str:
            if x is None:
                return "-"
            return "0 (bitwise)" if x == 0 else f"{x:.3e}"

        return [
            ("verdict", self.verdict),
            ("cut (its group's start)", f"{self.cut} ({self.cut_group_start})"),
            ("document", f"{self.doc} [{self.doc_start}, {self.doc_end})"),
            ("exponent changed (pos. control)", "yes" if self.exponent_changed else "NO"),
            ("O prefix max|ΔO|/max|O|", f(self.o_prefix)),
            ("dQ prefix", f(self.dq_prefix)),
            ("dK prefix (legit. non-zero)", f(self.dk_prefix)),
            ("dV prefix (legit. non-zero)", f(self.dv_prefix)),
            ("first changed token", "-" if self.first_changed is None else str(self.first_changed)),
            ("outside doc (pos. run)", f(self.outside_positive)),
            (f"neg. control: doc {self.neg_doc} -> O" if self.neg_doc is not None
             else "neg. control (needs a second document) -> O", f(neg.get("o"))),
            ("neg. control -> dQ", f(neg.get("dq"))),
            ("neg. control -> dK, dV", f(max(neg["dk"], neg["dv"]) if neg else None)),
            ("noise (repeat run)", f(self.noise)),
        ]

    def to_table(self):
        """A ``rich.table.Table`` with one metric per row."""
        return leak_table([self])


def leak_table(reports: Sequence[LeakReport]):
    """One ``rich.table.Table``: a row per metric, a column per report (path).

    Args:
        reports: at least one :class:`LeakReport`; the title shows the first one's problem
            (cu_seqlens, heads, head_dim, magnitude, seed, device).

    Returns:
        ``rich.table.Table`` (print it with a ``rich.console.Console``).

    Raises:
        FlamiaError: no reports.
    """
    from rich.table import Table

    reports = list(reports)
    if not reports:
        raise FlamiaError("leak_table needs at least one LeakReport")
    r0 = reports[0]
    title = (f"causal leak probe: cu_seqlens={list(r0.cu_seqlens)}, H={r0.num_heads}/{r0.num_kv_heads}, "
             f"D={r0.head_dim}, magnitude={r0.magnitude:g}, seed={r0.seed}, {r0.device}")
    table = Table(title=title, title_justify="left")
    table.add_column("metric", style="bold")
    for r in reports:
        table.add_column(r.path, justify="right")
    styles = {"exact": "green", "within-group": "yellow", "prefix-leak": "red",
              "cross-document": "red", "nondeterministic": "magenta"}
    per = [dict(r.rows()) for r in reports]
    for key, _ in r0.rows():
        vals = [p[key] for p in per]
        if key == "verdict":
            vals = [f"[{styles[v]}]{v}[/]" for v in vals]
        table.add_row(key, *vals)
    return table


# ---------------------------------------------------------------------------------------------
# built-in paths: quantize -> dequantize -> exact attention
# ---------------------------------------------------------------------------------------------


class _QuantDequant(torch.autograd.Function):
    """Forward: ``qdq(x)`` (float32). Backward: straight-through (gradient passed unchanged)."""

    @staticmethod
    def forward(ctx, x, qdq):
        ctx.in_dtype = x.dtype
        return qdq(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.in_dtype), None


class _QuantizeGrad(torch.autograd.Function):
    """Forward: identity. Backward: the incoming gradient dO is replaced by ``qdq(dO)``."""

    @staticmethod
    def forward(ctx, o, qdq):
        ctx.qdq = qdq
        return o.view_as(o)

    @staticmethod
    def backward(ctx, g):
        return ctx.qdq(g).to(g.dtype), None


def _qdq_token(granularity: str):
    def qdq(x, cu):
        return dequantize(*quantize_token_blocks(x, cu, granularity))
    return qdq


def _qdq_tensor(x, cu):
    return dequantize(*quantize_per_tensor(x))


def _qdq_mx(x, cu):
    return dequantize_mx_features(*quantize_mx_features(x, 32), block=32)


def _reference_path(q, k, v, cu_seqlens, max_seqlen):
    # the reference's output with its bounded-memory backward (autograd through the plain reference
    # would keep O(H * L^2) scores per document)
    return packed_attention_reference_blocked(q, k, v, cu_seqlens)


def _make_qdq_path(qdq) -> AttnFn:
    def path(q, k, v, cu_seqlens, max_seqlen):
        qh, kh, vh = (_QuantDequant.apply(t, lambda y: qdq(y, cu_seqlens)) for t in (q, k, v))
        o = packed_attention_reference_blocked(qh, kh, vh, cu_seqlens)
        return _QuantizeGrad.apply(o, lambda g: qdq(g, cu_seqlens))
    return path


def _make_fp8_emulated_path(granularity: str, qk_terms: int = 1, pv_terms: int = 1) -> AttnFn:
    # the emulated FP8 kernel path (kernels/fp8_emulation.py): codes, P / dS folds and
    # accumulation included, not only the input quantization; the FP8 kernels' head dims only
    # (fp8_emulation.HEAD_DIMS, the rule of varlen_attention(precision="fp8")): a verdict for a
    # head_dim that FP8 attention refuses would describe no path a model can run
    def path(q, k, v, cu_seqlens, max_seqlen):
        from flamia_pack.kernels.fp8_emulation import fp8_varlen_attention_emulated

        return fp8_varlen_attention_emulated(q, k, v, cu_seqlens, max_seqlen, scale_granularity=granularity,
                                             qk_terms=qk_terms, pv_terms=pv_terms)
    return path


#: Built-in attention paths, name -> callable ``f(q, k, v, cu_seqlens, max_seqlen) -> o``.
PATHS: dict[str, AttnFn] = {
    "reference": _reference_path,
    "token": _make_qdq_path(_qdq_token("token")),
    "block": _make_qdq_path(_qdq_token("block")),
    "tensor": _make_qdq_path(_qdq_tensor),
    "mx": _make_qdq_path(_qdq_mx),
    "fp8-emu-token": _make_fp8_emulated_path("token"),
    "fp8-emu-block": _make_fp8_emulated_path("block"),
    "fp8-emu-token2": _make_fp8_emulated_path("token", 2),
    "fp8-emu-block2": _make_fp8_emulated_path("block", 2),
    "fp8-emu-token22": _make_fp8_emulated_path("token", 2, 2),
    "fp8-emu-block22": _make_fp8_emulated_path("block", 2, 2),
}

#: :func:`probe_leak`'s default head dimension (also what :func:`probe_paths` checks the FP8 paths' rule on).
DEFAULT_HEAD_DIM = 64

#: Built-in paths that run the FP8 kernels' emulation: head_dim in ``fp8_emulation.HEAD_DIMS`` only,
#: as for ``varlen_attention(precision="fp8")`` (:func:`probe_paths` checks it before running any path).
FP8_PATHS = ("fp8-emu-token", "fp8-emu-block", "fp8-emu-token2", "fp8-emu-block2", "fp8-emu-token22",
             "fp8-emu-block22")

#: What each built-in path is expected to show (asserted in tests/test_leak.py and
#: tests/test_fp8_emulation.py).
EXPECTED = {"reference": "exact", "token": "exact", "block": "within-group",
            "tensor": "cross-document", "mx": "exact", "fp8-emu-token": "exact",
            "fp8-emu-block": "within-group", "fp8-emu-token2": "exact", "fp8-emu-block2": "within-group",
            "fp8-emu-token22": "exact", "fp8-emu-block22": "within-group"}

PATH_HELP = {
    "reference": "exact reference: bf16 inputs, float32 compute",
    "token": "q/k/v/dO per-token E4M3 scales (strict mode)",
    "block": "q/k/v/dO 32-token block E4M3 scales (default)",
    "tensor": "q/k/v/dO one E4M3 scale per tensor",
    "mx": "q/k/v/dO hardware MX-style: 32 features of one token",
    "fp8-emu-token": "emulated FP8 kernel (fp8_emulation.py), per-token scales, strict dS",
    "fp8-emu-block": "emulated FP8 kernel (fp8_emulation.py), 32-token block scales",
    "fp8-emu-token2": "as fp8-emu-token with two-term Q and K (qk_terms=2: residual codes on the same scales)",
    "fp8-emu-block2": "as fp8-emu-block with two-term Q and K (qk_terms=2)",
    "fp8-emu-token22": "as fp8-emu-token2 with two-term P~ and V (pv_terms=2)",
    "fp8-emu-block22": "as fp8-emu-block2 with two-term P~ and V (pv_terms=2)",
}


# ---------------------------------------------------------------------------------------------
# the probe
# ---------------------------------------------------------------------------------------------


def default_cut(doc_start: int, doc_end: int, group_size: int = GROUP_SIZE) -> int:
    """A cut in the middle of a document that is *not* the last token of its scale group, so the
    cut's group holds perturbed tokens after it (what makes a within-group leak visible):
    13 tokens into the group that contains the document's midpoint (clipped to ``doc_end - 2``).

    Args:
        doc_start, doc_end: the document's token range ``[doc_start, doc_end)`` (row offsets,
            ``doc_end - doc_start >= 2`` for a valid cut).
        group_size: scale-group size (32, DESIGN.md §4).

    Returns:
        The cut (int, a row offset in ``[doc_start, doc_end - 2]``); no checks (pure arithmetic).
    """
    n = doc_end - doc_start
    rel = ((n // 2) // group_size) * group_size + min(13, group_size - 2)
    return doc_start + max(0, min(rel, n - 2))


def _rel(delta: torch.Tensor, base_max: float) -> float:
    if delta.numel() == 0:
        return 0.0
    m = float(delta.abs().max())
    if m == 0:
        return 0.0
    return m / base_max if base_max > 0 else math.inf


def probe_leak(
    attn_fn: AttnFn,
    *,
    cu_seqlens: Sequence[int] | torch.Tensor = DEFAULT_CU_SEQLENS,
    total_tokens: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int = DEFAULT_HEAD_DIM,
    doc: int | None = None,
    cut: int | None = None,
    neg_doc: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    magnitude: float = 64.0,
    perturb_do: bool = True,
    name: str | None = None,
) -> LeakReport:
    """Measure how far a suffix perturbation travels through ``attn_fn`` (DESIGN.md §5).

    Args:
        attn_fn: ``f(q, k, v, cu_seqlens, max_seqlen) -> o`` with q ``(T, H, D)``, k/v
            ``(T, H_kv, D)`` in ``dtype`` requiring grad, ``cu_seqlens`` int32 on ``device``,
            ``max_seqlen`` a Python int; ``o`` ``(T, H, D)``, differentiable. Must be deterministic
            for bitwise statements (see ``noise`` in the report).
        cu_seqlens: document boundaries (row-local); tokens past the last one up to
            ``total_tokens`` are padding.
        total_tokens: T (default ``cu_seqlens[-1]``).
        num_heads, num_kv_heads, head_dim: shapes (``num_kv_heads`` defaults to ``num_heads``).
        doc: document of the cut (default: the longest). cut: last unperturbed token, inside
            ``doc`` and before its last token (default :func:`default_cut`).
        neg_doc: document perturbed by the negative control (default: the first other one).
        seed: seeds q, k, v, dO and the perturbations (drawn on the CPU, then moved).
        device: where the tensors live. dtype: input dtype (bf16 default, like training).
        magnitude: perturbation scale relative to the N(0, 1) inputs (64 moves a 32-token
            group's E4M3 exponent by about 6).
        perturb_do: also perturb dO after the cut (and in the negative document).
        name: label in the report (default: the callable's ``__name__``).

    Returns:
        :class:`LeakReport`.

    Raises:
        FlamiaError: ``attn_fn`` not callable; invalid ``cu_seqlens``; ``doc``/``cut``/``neg_doc``
            out of range or not integers; a document too short to cut; ``num_heads``/``head_dim``
            < 1; ``magnitude`` not finite and > 0; ``dtype`` not floating point; an unknown or
            unavailable device; ``attn_fn`` raising (its error is chained), returning something
            other than an ``o`` of shape ``(T, H, D)``, or returning an ``o`` that is not
            differentiable with respect to q, k, v.
    """
    if not callable(attn_fn):
        raise FlamiaError(f"attn_fn must be callable as f(q, k, v, cu_seqlens, max_seqlen) -> o, got "
                          f"{type(attn_fn).__name__}")

    def as_int(name: str, val, allow_none: bool = True):
        if val is None and allow_none:
            return None
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise FlamiaError(f"{name} must be an int, got {val!r}")
        return int(val)

    total_tokens, doc, cut, neg_doc, num_kv_heads = (
        as_int(n, x) for n, x in (("total_tokens", total_tokens), ("doc", doc), ("cut", cut),
                                  ("neg_doc", neg_doc), ("num_kv_heads", num_kv_heads)))
    num_heads, head_dim, seed = (as_int(n, x, False) for n, x in (("num_heads", num_heads),
                                                                  ("head_dim", head_dim), ("seed", seed)))
    if head_dim < 1:
        raise FlamiaError(f"head_dim must be >= 1, got {head_dim}")
    if isinstance(magnitude, bool) or not isinstance(magnitude, numbers.Real) or not (
            math.isfinite(magnitude) and 0 < magnitude <= MAX_MAGNITUDE):
        raise FlamiaError(f"magnitude must be a finite number in (0, {MAX_MAGNITUDE:g}] (the positive control needs "
                          f"a real perturbation of N(0, 1) inputs whose scores stay finite), got {magnitude!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FlamiaError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = list(cu_seqlens)
        if not cu_seqlens:
            raise FlamiaError("probe_leak needs at least one document in cu_seqlens, got an empty sequence")
    cu_list = validate_cu_seqlens(torch.as_tensor(cu_seqlens)).tolist()
    n_docs = len(cu_list) - 1
    if n_docs < 1:
        raise FlamiaError("probe_leak needs at least one document in cu_seqlens")
    T = cu_list[-1] if total_tokens is None else int(total_tokens)
    if T < cu_list[-1]:
        raise FlamiaError(f"total_tokens={T} is smaller than cu_seqlens[-1]={cu_list[-1]}")
    lens = [b - a for a, b in zip(cu_list[:-1], cu_list[1:])]
    if doc is None:
        doc = max(range(n_docs), key=lambda i: lens[i])
    if not 0 <= doc < n_docs:
        raise FlamiaError(f"doc must be in [0, {n_docs}), got {doc}")
    d0, d1 = cu_list[doc], cu_list[doc + 1]
    if d1 - d0 < 2:
        raise FlamiaError(f"document {doc} has {d1 - d0} token(s); the cut needs at least 2")
    if cut is None:
        cut = default_cut(d0, d1)
    if not d0 <= cut <= d1 - 2:
        raise FlamiaError(f"cut must lie in document {doc} before its last token: [{d0}, {d1 - 2}], got {cut}")
    if neg_doc is None:
        neg_doc = next((i for i in range(n_docs) if i != doc and lens[i] > 0), None)
    elif not (0 <= neg_doc < n_docs and neg_doc != doc and lens[neg_doc] > 0):
        raise FlamiaError(f"neg_doc must be another non-empty document than doc={doc}, got {neg_doc}")
    hq = int(num_heads)
    if hq < 1:
        raise FlamiaError(f"num_heads must be >= 1, got {hq}")
    hkv = hq if num_kv_heads is None else int(num_kv_heads)
    if T * hq * head_dim > MAX_PROBE_ELEMENTS:
        raise FlamiaError(f"the probe's row is too large: T * num_heads * head_dim = {T:,} * {hq} * {head_dim} "
                          f"elements, at most {MAX_PROBE_ELEMENTS:,} (a probe is a small experiment: fewer tokens, "
                          "heads or a smaller head_dim)")
    if hq < 1 or hkv < 1 or hq % hkv:
        raise FlamiaError(f"num_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FlamiaError(f"unknown device {device!r} (use 'cpu' or 'cuda'): {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlamiaError("device 'cuda' requested but torch.cuda.is_available() is False")

    gen = torch.Generator().manual_seed(int(seed))
    D = int(head_dim)
    base = {
        "q": torch.randn(T, hq, D, generator=gen),
        "k": torch.randn(T, hkv, D, generator=gen),
        "v": torch.randn(T, hkv, D, generator=gen),
        "do": torch.randn(T, hq, D, generator=gen),
    }

    def perturbed(lo: int, hi: int) -> dict[str, torch.Tensor]:
        out = {}
        for key, t in base.items():
            t = t.clone()
            if key != "do" or perturb_do:
                t[lo:hi] += float(magnitude) * torch.randn(hi - lo, *t.shape[1:], generator=gen)
            out[key] = t
        return out

    pos = perturbed(cut + 1, d1)
    neg = perturbed(cu_list[neg_doc], cu_list[neg_doc + 1]) if neg_doc is not None else None
    cu_dev = torch.tensor(cu_list, dtype=torch.int32, device=device)
    max_seqlen = max(lens)

    def run(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        q, k, v = (inp[key].to(dtype).to(device).requires_grad_(True) for key in ("q", "k", "v"))
        try:
            o = attn_fn(q, k, v, cu_dev, max_seqlen)
        except FlamiaError:
            raise
        except Exception as exc:
            raise FlamiaError(f"attn_fn raised {type(exc).__name__}: {exc} (it is called as "
                              f"f(q, k, v, cu_seqlens, max_seqlen) with q {(T, hq, D)} {dtype})") from exc
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != (T, hq, D):
            raise FlamiaError(f"attn_fn must return o of shape {(T, hq, D)}, got "
                              f"{getattr(o, 'shape', type(o))}")
        if not o.requires_grad:
            raise FlamiaError("attn_fn must return an o that is differentiable with respect to q, k, v "
                              "(it has no grad_fn: detached, or computed under no_grad)")
        # an input o does not depend on gets a zero gradient (materialize_grads), not an error
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), grad_outputs=inp["do"].to(dtype).to(device).to(o.dtype),
                                         allow_unused=True, materialize_grads=True)
        return [t.detach().to("cpu", torch.float64) for t in (o, dq, dk, dv)]

    ref = run(base)
    again = run(base)
    scales = [float(t.abs().max()) if t.numel() else 0.0 for t in ref]
    if not all(math.isfinite(x) for x in scales):
        raise FlamiaError("attn_fn returned NaN/Inf in O or in a gradient for finite N(0, 1) inputs; "
                          "the probe needs a finite baseline")
    noise = max(_rel(a - b, s) for a, b, s in zip(again, ref, scales))

    res_pos = run(pos)
    delta = [a - b for a, b in zip(res_pos, ref)]
    prefix = slice(d0, cut + 1)
    o_prefix, dq_prefix, dk_prefix, dv_prefix = (_rel(dl[prefix], s) for dl, s in zip(delta, scales))
    changed_rows = (delta[0][prefix].abs().amax(dim=(1, 2)) > 0) | (delta[1][prefix].abs().amax(dim=(1, 2)) > 0)
    nz = torch.nonzero(changed_rows).flatten()
    first_changed = d0 + int(nz[0]) if nz.numel() else None
    outside = torch.ones(T, dtype=torch.bool)
    outside[d0:d1] = False
    outside_positive = max(_rel(dl[outside], s) for dl, s in zip(delta, scales))

    neg_outside = None
    if neg is not None:
        res_neg = run(neg)
        keep = torch.ones(T, dtype=torch.bool)
        keep[cu_list[neg_doc]:cu_list[neg_doc + 1]] = False
        neg_outside = {key: _rel((a - b)[keep], s)
                       for key, a, b, s in zip(("o", "dq", "dk", "dv"), res_neg, ref, scales)}

    group_start = d0 + ((cut - d0) // GROUP_SIZE) * GROUP_SIZE
    exponent_changed = False
    cu_cpu = torch.tensor(cu_list, dtype=torch.int32)
    qdtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    for key in ("q", "k", "v"):
        e0 = quantize_token_blocks(base[key].to(qdtype), cu_cpu, "block", check_finite=False).exponents
        e1 = quantize_token_blocks(pos[key].to(qdtype), cu_cpu, "block", check_finite=False).exponents
        exponent_changed |= bool((e0[group_start] != e1[group_start]).any())

    return LeakReport(
        path=name or getattr(attn_fn, "__name__", type(attn_fn).__name__),
        cu_seqlens=tuple(cu_list), total_tokens=T, num_heads=hq, num_kv_heads=hkv, head_dim=D,
        seed=int(seed), magnitude=float(magnitude), device=str(device),
        doc=doc, doc_start=d0, doc_end=d1, cut=cut, cut_group_start=group_start,
        exponent_changed=exponent_changed,
        o_prefix=o_prefix, dq_prefix=dq_prefix, dk_prefix=dk_prefix, dv_prefix=dv_prefix,
        first_changed=first_changed, outside_positive=outside_positive,
        neg_doc=neg_doc, neg_outside=neg_outside, noise=noise,
    )


def probe_paths(names: Sequence[str] | str | None = None, **kwargs) -> list[LeakReport]:
    """Run :func:`probe_leak` on built-in :data:`PATHS` (all by default); kwargs as there.

    Args:
        names: path names (a list, or one name as a string); None = every path in :data:`PATHS`.

    Returns:
        One :class:`LeakReport` per name, in order.

    Raises:
        FlamiaError: unknown path name; a ``head_dim`` outside ``(64, 128)`` with an FP8 path
            (:data:`FP8_PATHS`; checked before any path runs); or what :func:`probe_leak` raises.
    """
    if isinstance(names, str):
        names = [names]
    names = list(PATHS) if names is None else list(names)
    for n in names:
        if n not in PATHS:
            raise FlamiaError(f"unknown path {n!r}; choose from {', '.join(PATHS)}")
    # the FP8 paths' head_dim rule, checked for every name before any path runs
    fp8 = [n for n in names if n in FP8_PATHS]
    head_dim = kwargs.get("head_dim", DEFAULT_HEAD_DIM)
    if fp8 and isinstance(head_dim, numbers.Integral) and not isinstance(head_dim, bool):
        from flamia_pack.kernels.fp8_emulation import HEAD_DIMS

        if int(head_dim) not in HEAD_DIMS:
            others = [n for n in PATHS if n not in FP8_PATHS]
            raise FlamiaError(f"FP8 attention supports head_dim in {HEAD_DIMS}, got {int(head_dim)}: path(s) "
                              f"{', '.join(fp8)} run the FP8 kernels' emulation (the paths {', '.join(others)} "
                              "take any head_dim)")
    return [probe_leak(PATHS[n], name=n, **kwargs) for n in names]
