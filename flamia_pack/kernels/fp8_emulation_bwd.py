"""CPU emulation of the FP8 attention backward that replicates the forward (issue 28; DESIGN.md
§4-5; paper §3.3; seed 001 §4-5): the numerics contract of the Gluon FP8 backward kernels.
Notation and the exactness of E4M3 products as in :mod:`flamia_pack.kernels.fp8_emulation`
(all arithmetic fp32 unless said otherwise; ``exact`` = the fp64 sum of E4M3 products, exact,
rounded once to fp32)::

    dO -> E4M3 codes dc, exponents e_do(i)     (once, same token-block scheme as Q, K, V)
    Delta_i = fp32( sum_d dO^_id O_id ) - dLSE_i        (fp64 sum of the reconstructed dO and the
                                                         saved bf16 O, rounded once)

Grid. Per document, ``f = floor16(doc_start)`` (row-local token index, ``TILE_ALIGN = 16``).
Key tiles: ``block_n = 128`` keys ``[f + 128 n, f + 128 (n + 1))`` cut to the document (the
forward's key walk, :func:`~flamia_pack.kernels.fp8_emulation._steps`). Query steps (the dK/dV
programs' walk): ``block_m = 64`` rows ``[f + 64 m, f + 64 (m + 1))`` cut to the document; row i is
in step ``m(i) = (i - f) // 64``. ``block_m`` may be 16, 32, 64 or 128 (a multiple of 16 dividing
128). Per (key tile, query step) and pair (i, j), i seeing j (else every term below is 0)::

    s_ij    = scores(...)                 the forward's function on the same codes: bitwise the same S
    P_ij    = exp2(s_ij - fp32(LSE_i * log2 e))          (P from the saved LSE)
    dP_ij   = fp32(dc_i . vc_j) * 2^(e_do(i) + e_v(j))    exact product, exact factors
              (pv_terms=2: fp32(dc_i . (vc_j + vc_lo_j)), two FP8 products, exact and rounded once)
    dS_ij   = fp32( P_ij * fp32(dP_ij - Delta_i) )
    Uq_ij   = dS_ij * 2^e_k(j)        the dQ product's contraction runs over keys: K's exponent folded in
    Uk_ij   = dS_ij * 2^e_q(i)        the dK product's contraction runs over queries: Q's  (masked: 0)

Two payloads, each with quant.py's exponent rule (``ceil(log2(amax / 448))``, -127 for an
all-zero group: no saturation), codes ``E4M3_RNE(U 2^-sigma)``::

    dQ payload  sigma_q(i) = rule( max_j |Uq_ij| over the key tile ),   codeq_ij = E4M3(Uq_ij 2^-sigma_q(i))
    dK payload  sigma_k(j) = rule( max_i |Uk_ij| over the query step ), codek_ij = E4M3(Uk_ij 2^-sigma_k(j))

Why two: Hopper's FP8 wgmma has no block scales and a k = 32 instruction, so a scale that varies
along a product's contraction (a 32 x 32 block) needs one promotion per instruction; a per-row scale
of the product (sigma_q for dS.K, sigma_k for dS^T.Q) needs one per step. Accumulation::

    dQ_i  += exact( sum_j codeq_ij kc_j ) * fp32(2^sigma_q(i) * softmax_scale)
             key tiles ascending;  dQ_i = bf16(acc_i)
    dK_j  += exact( sum_i codek_ij qc_i ) * 2^sigma_k(j)
             one fp32 accumulator per key over the GQA group's query heads (head-major: for each
             head, its query steps ascending);  dK_j = bf16( acc_j * softmax_scale )
    rho_j  = max { e_do(i) : i in the step, i sees j }      (0 when none: then P~v = 0)
    P~v_ij = E4M3_RNE( P_ij * 2^(e_do(i) - rho_j + boost) )
    dV_j  += exact( sum_i P~v_ij dc_i ) * 2^(rho_j - boost)      same head / step order as dK;
             dV_j = bf16(acc_j)

dV cannot reuse the forward's P~ (folded along keys with 2^(e_v(j) - r_i), dV contracts over
queries); the range budget holds as in the forward: P <= 1 (1 + 2^-20) and e_do(i) <= rho_j, so
P~v <= 2^boost <= 256 < 448. ``"token"`` and ``"block"`` differ only in the quantization groups of
q, k, v and dO. The kernel folds dQ's factor into each key tile's partial before an fp32 reduce-add
whose order is not fixed (dQ bits then differ at the fp32-ulp level); everything before the
exponential (codes, exponents, masks, sigma_q, sigma_k, rho) must match bitwise.

Range: each payload carries only the exponent of the operand its product contracts over, so an
all-zero query token or group (e_q = -127) leaves the dQ payload of its row normal (its codes in the
dK payload meet q codes that are 0).

Short documents: the emulation computes a chunk of whole documents that each fit one query step
and one key tile (``fp8_emulation._segments`` with ``min(block_m, block_n)``) as one masked tile
pair; keys see only their own document's rows and the other documents' U and P~v are exact zeros,
so sigma_k, rho and every sum equal the per-(document, step) ones.

Causality of dQ (with dO fixed): dS_ij for visible j <= i reads q_i, k_j, v_j, dO_i, O_i, LSE_i;
sigma_q(i) reads row i's visible keys only; dQ accumulates in fp32 with no data-dependent
accumulator scale. So ``causal_dq_scale`` holds in both modes, and under ``"token"`` dQ_i reads
nothing of later tokens (bitwise; tested). dK_j and dV_j legitimately read every later query.

Diagnostics (``stats``, seed 001 §5 / issue 28): ``ds_zero_fraction`` (visible dS != 0 whose dQ
payload code is 0; paper 0.4%), ``ds_zero_fraction_dk`` (same for the dK payload),
``ds_row_residual`` / ``ds_row_residual_rms`` (signed mean / rms over valid rows of
``sum_j dS^_ij / sum_j |dS_ij|``, dS^ the decoded dQ payload; exactly 0 in exact arithmetic when P
sums to 1 and Delta matches), ``ds_row_residual_prequant_rms`` (same for the fp32 dS before
rounding), ``ptilde_dv_max`` (largest P~v, <= 2^boost).

Positive controls (``mismatch=``): ``"bf16_scores"``: S recomputed from the unquantized q, k in
fp32 instead of the forward's codes -- P no longer matches the saved LSE and the row residual and
the gradient error grow; ``"bf16_delta"``: Delta from the unquantized dO while dP uses its codes --
the row residual grows (tested). A different ``block_n`` in the backward changes nothing of S or P
(every S element is computed alone), only the payload groups and the sums' grouping.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.fp8_emulation import (
    BLOCK,
    DEFAULT_BOOST_LOG2,
    LOG2E,
    _check_options,
    _check_tensor,
    _doc_local,
    _fold_p,
    _heads,
    _heads_lo,
    _on_cpu,
    _prepare,
    TILE_ALIGN,
    _segments,
    _steps,
    exact_mm,
    pow2,
    qk_scale_f32,
    reference_exponent,
    scores,
    visibility,
)
from flamia_pack.kernels.constants import REF_FLOOR_LOG2
from flamia_pack.quant import UE8M0_BIAS, _abs_bits, exponent_from_amax_bits, quantize_token_blocks

__all__ = ["fp8_attention_backward", "MISMATCHES", "BWD_BLOCK_M", "BWD_BLOCK_MS"]

#: Deliberately mismatched backward variants (positive controls only).
MISMATCHES = (None, "bf16_scores", "bf16_delta")
#: Rows of a dK/dV query step (the kernel's), on the grid ``floor16(doc_start) + block_m * m``.
BWD_BLOCK_M = 64
#: Query steps allowed: multiples of TILE_ALIGN that divide the 128-key tile.
BWD_BLOCK_MS = (16, 32, 64, 128)


def _sigma(U: torch.Tensor, dim: int) -> torch.Tensor:
    """quant.py's exponent rule (``ceil(log2(amax / 448))`` from the fp32 bits, -127 for an
    all-zero group) on ``max |U|`` along ``dim`` of ``U`` ``(H, m, n)``, kept as a size-1 dim:
    ``dim=-1`` gives sigma_q ``(H, m, 1)`` (per query row over the key tile), ``dim=-2`` gives
    sigma_k ``(H, 1, n)`` (per key over the query step)."""
    e, _ = exponent_from_amax_bits(_abs_bits(U).amax(dim, keepdim=True))
    return e


def _encode(U: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``U * 2^-sigma`` (RNE; no saturation: ``|U| 2^-sigma <= 448`` by the rule)."""
    return (U * pow2(-sigma)).to(torch.float8_e4m3fn)


def _floor_references(steps: list, g: int, boost: int) -> None:
    """Floor the dK / dV references of one key tile's query steps in place, in the kernel's order
    (per kv head: the GQA group's query heads in turn, each one's steps ascending; head ``h`` is
    group member ``h % g``), as ``gluon_fp8_bwd`` does so its rescaled accumulators cannot overflow:

        sigma_k(j) <- max(sigma_k(j), Sk(j) - REF_FLOOR_LOG2)   where the step's max |Uk_.j| is a
                      normal float (Sk: the largest sigma_k(j) so far)
        rho_j      <- max(rho_j, R - REF_FLOOR_LOG2, boost - 126)   where key j sees a query of the step
                      (R: the largest e_do so far of key j's document's queries that see a key of
                      the tile)

    ``steps``: tuples ``(sel, ia, um, vis_m, sigma_k (H, 1, n), normal (H, 1, n), rho (H, n),
    has_v (n,), e_seen (H, n))``; sigma_k and rho (each step's own tensors) are written in place.
    Both floors bind only on degenerate rows (a step whose dO is 0 or whose dS is 2^64 below an
    earlier step's): elsewhere a no-op."""
    if not steps:
        return
    H = steps[0][4].shape[0]
    hkv = H // g
    n = steps[0][4].shape[-1]
    sk_run = torch.full((hkv, 1, n), -(1 << 20), dtype=torch.int32)
    r_run = torch.full((hkv, n), -(1 << 20), dtype=torch.int32)
    for j in range(g):
        hs = slice(j, None, g)
        for _, _, _, _, sig_k, normal, rho, has_v, e_seen in steps:
            sk = torch.where(normal[hs], torch.maximum(sig_k[hs], sk_run - REF_FLOOR_LOG2), sig_k[hs])
            sk_run = torch.where(normal[hs], torch.maximum(sk_run, sk), sk_run)
            rv = torch.maximum(rho[hs], torch.clamp(r_run - REF_FLOOR_LOG2, min=boost - 126))
            rho[hs] = torch.where(has_v[None, :], rv, rho[hs])
            sig_k[hs] = sk
            r_run = torch.maximum(r_run, e_seen[hs].to(torch.int32))


def _check_bwd_options(scale_granularity, block_m, block_n, boost_log2) -> None:
    _check_options(scale_granularity, BLOCK, block_n, boost_log2)
    if isinstance(block_m, bool) or not isinstance(block_m, numbers.Integral) or int(block_m) not in BWD_BLOCK_MS:
        raise FlamiaError(f"block_m (the backward's query step) must be one of {BWD_BLOCK_MS} (a multiple of "
                          f"{TILE_ALIGN} dividing 128), got {block_m!r}")


def _backward_impl(do, ops, o, lse, cu, T, H, Hkv, D, *, causal, softmax_scale, scale_granularity,
                   block_m, block_n, boost, dlse, stats, bf16_scores, mismatch_delta=False, pv_terms=1):
    qo, ko, vo = ops
    if pv_terms == 2 and vo.codes_lo is None:
        raise FlamiaError("pv_terms=2 needs V's residual codes (_prepare(pv_terms=2))")
    g = H // Hkv
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    qk = qk_scale_f32(scale)
    scale32 = torch.tensor(scale, dtype=torch.float32)
    cu_t = torch.tensor(cu, dtype=torch.long)
    dq_ = quantize_token_blocks(do, cu_t, scale_granularity, validate=False)
    dec = dq_.codes.double() * pow2(dq_.exponents.to(torch.int32) - UE8M0_BIAS).double()[..., None]
    if mismatch_delta:  # positive control: Delta from the unquantized dO, dP from the codes
        dec = do.double()
    delta = (dec * o.double()).sum(-1).float().transpose(0, 1).contiguous()  # (H, T)
    if dlse is not None:
        delta = delta - dlse.float()
    lse2 = lse.float() * torch.tensor(LOG2E, dtype=torch.float32)
    dq = torch.zeros((T, H, D), dtype=torch.bfloat16)
    dk = torch.zeros((T, Hkv, D), dtype=torch.bfloat16)
    dv = torch.zeros((T, Hkv, D), dtype=torch.bfloat16)
    st = dict(vis_nz=0, zero_q=0, zero_k=0, pv_max=0.0, res=[], res_pre=[])
    for lo, hi, single in _segments(cu, min(block_m, block_n)):
        L = hi - lo
        phase = lo % TILE_ALIGN  # a single document's grid starts f = lo - phase
        doc, dpos = _doc_local(cu, lo, hi)
        qc, eq = _heads(qo.codes, qo.exponents, lo, hi, 1)
        kc, ek = _heads(ko.codes, ko.exponents, lo, hi, g)
        vc, ev = _heads(vo.codes, vo.exponents, lo, hi, g)
        dc, edo = _heads(dq_.codes, dq_.exponents, lo, hi, 1)
        qcl, kcl = _heads_lo(qo, lo, hi, 1), _heads_lo(ko, lo, hi, g)  # two-term residuals, or None
        kcp = kc if kcl is None else kc + kcl  # the dQ product's operand (an exact sum of two codes)
        vcp = vc if pv_terms == 1 else vc + _heads_lo(vo, lo, hi, g)  # dP's (pv_terms=2: V's two terms)
        # query step m = (i - f) // block_m of each row; a chunk's documents each fit one step (and
        # each key sees its own document only), so a chunk is one step: the bits are the same
        step = (dpos + phase) // block_m if single else torch.zeros(L, dtype=torch.long)
        dq_acc = torch.zeros((H, L, D), dtype=torch.float32)
        dk_acc = torch.zeros((Hkv, L, D), dtype=torch.float32)
        dv_acc = torch.zeros((Hkv, L, D), dtype=torch.float32)
        res = torch.zeros((H, L), dtype=torch.float64)
        res_pre = torch.zeros((H, L), dtype=torch.float64)
        mass = torch.zeros((H, L), dtype=torch.float64)
        for k0, k1, r0 in _steps(L, single, block_n, causal, phase):
            rows, keys = slice(r0, L), slice(k0, k1)  # rows before r0 see no key of the tile
            vis = visibility(doc, dpos, rows, keys, causal)
            if bf16_scores is None:
                s = scores(qc[:, rows], eq[:, rows], kc[:, keys], ek[:, keys], qk,
                           None if qcl is None else qcl[:, rows], None if kcl is None else kcl[:, keys])
            else:  # positive control: S from the unquantized q, k (does not match the saved LSE)
                qf, kf = bf16_scores
                qs = qf[lo:hi].float().transpose(0, 1)[:, rows]
                ks = kf[lo:hi].float().transpose(0, 1).repeat_interleave(g, 0)[:, keys]
                s = torch.matmul(qs, ks.transpose(-1, -2)) * qk
            p = torch.where(vis, torch.exp2(s - lse2[:, lo:hi][:, rows, None]), torch.zeros((), dtype=torch.float32))
            dp = exact_mm(dc[:, rows], vcp[:, keys].transpose(-1, -2))
            dp = dp * pow2(edo[:, rows])[..., None] * pow2(ev[:, keys])[:, None, :]
            ds = p * (dp - delta[:, lo:hi][:, rows, None])
            ds = torch.where(vis, ds, torch.zeros((), dtype=torch.float32))
            fold_r, fold_c = pow2(eq[:, rows])[..., None], pow2(ek[:, keys])[:, None, :]
            uq, u = ds * fold_c, ds * fold_r  # (H, R, n): the dQ and dK payloads' U; masked pairs exactly 0
            # dQ payload: sigma_q per (row, key tile); the tile's partial scaled by one fp32 factor
            sig_q = _sigma(uq, -1)
            codes_q = _encode(uq, sig_q)
            fac_q = pow2(sig_q) * scale32
            dq_acc[:, rows] += exact_mm(codes_q.float(), kcp[:, keys]) * fac_q
            # dK / dV: per query step of the rows, ascending; one partial per (query head, step)
            parts = []
            srow = step[rows]
            steps = []
            for m in torch.unique(srow).tolist():
                sel = (srow == m).nonzero().flatten()  # tile-relative rows of step m
                ia = sel + r0  # segment-relative
                um, vis_m = u[:, sel], vis[sel]
                rho, has_v = reference_exponent(edo[:, ia], vis_m.transpose(0, 1))  # (H, n), (n,)
                # per key: the step's rows of its document that see a key of the tile (the kernel's
                # program is one document: its running max is one scalar)
                same = vis_m.any(-1)[:, None] & (doc[ia][:, None] == doc[k0:k1][None, :])  # (m, n)
                e_seen = edo[:, ia][:, :, None].masked_fill(~same, -(1 << 20)).amax(1)  # (H, n)
                steps.append((sel, ia, um, vis_m, _sigma(um, -2), _abs_bits(um).amax(-2, keepdim=True) >= 1 << 23,
                              rho, has_v, e_seen))
            _floor_references(steps, g, boost)
            for sel, ia, um, vis_m, sig_k, _, rho, _, _ in steps:
                codes_k = _encode(um, sig_k)
                pk = exact_mm(codes_k.float().transpose(-1, -2), qc[:, ia]) * pow2(sig_k).transpose(-1, -2)
                pvt = _fold_p(p[:, sel].transpose(-1, -2), edo[:, ia], rho, vis_m.transpose(0, 1), boost).float()
                pv = exact_mm(pvt, dc[:, ia]) * pow2(rho - boost)[..., None]
                parts.append((pk, pv))
                st["pv_max"] = max(st["pv_max"], float(pvt.max()) if pvt.numel() else 0.0)
                if stats is not None:
                    nz = vis_m & (ds[:, sel] != 0)
                    st["zero_k"] += int((nz & (codes_k.float() == 0)).sum())
            # one fp32 accumulator per key: the GQA group's query heads (head-major), steps ascending
            acc_k = torch.zeros((Hkv, k1 - k0, D), dtype=torch.float32)
            acc_v = torch.zeros((Hkv, k1 - k0, D), dtype=torch.float32)
            for j in range(g):
                for pk, pv in parts:
                    acc_k += pk[j::g]
                    acc_v += pv[j::g]
            dk_acc[:, keys] = acc_k
            dv_acc[:, keys] = acc_v
            if stats is not None:
                nz = vis & (ds != 0)
                st["vis_nz"] += int(nz.sum())
                st["zero_q"] += int((nz & (codes_q.float() == 0)).sum())
                res[:, rows] += (codes_q.double() * pow2(sig_q).double() / fold_c.double()).sum(-1)
                res_pre[:, rows] += ds.double().sum(-1)
                mass[:, rows] += ds.double().abs().sum(-1)
        if stats is not None:
            ok = mass > 0
            st["res"].append((res[ok] / mass[ok]))
            st["res_pre"].append((res_pre[ok] / mass[ok]))
        dq[lo:hi] = dq_acc.to(torch.bfloat16).transpose(0, 1)
        dk[lo:hi] = (dk_acc * scale32).to(torch.bfloat16).transpose(0, 1)
        dv[lo:hi] = dv_acc.to(torch.bfloat16).transpose(0, 1)
    if stats is not None:
        res = torch.cat(st["res"]) if st["res"] else torch.zeros(1, dtype=torch.float64)
        res_pre = torch.cat(st["res_pre"]) if st["res_pre"] else torch.zeros(1, dtype=torch.float64)
        stats.update(
            ds_zero_fraction=st["zero_q"] / max(st["vis_nz"], 1),
            ds_zero_fraction_dk=st["zero_k"] / max(st["vis_nz"], 1),
            ds_row_residual=float(res.mean()),
            ds_row_residual_rms=float(res.pow(2).mean().sqrt()),
            ds_row_residual_prequant_rms=float(res_pre.pow(2).mean().sqrt()),
            ptilde_dv_max=st["pv_max"],
        )
    return dq, dk, dv


def fp8_attention_backward(
    do: torch.Tensor,
    q: Optional[torch.Tensor],
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens,
    max_seqlen: Optional[int] = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    scale_granularity: str = "block",
    block_m: int = BWD_BLOCK_M,
    block_n: int = 128,
    boost_log2: int = DEFAULT_BOOST_LOG2,
    quantized=None,
    dlse: Optional[torch.Tensor] = None,
    stats: Optional[dict] = None,
    mismatch: Optional[str] = None,
    _kernel_head_dims: bool = True,
    qk_terms: int = 1,
    pv_terms: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Emulated FP8 attention backward (module docs give every formula).

    Args:
        do: ``(T, H, D)`` bfloat16/float16/float32, the gradient of ``o``.
        q, k, v: the forward's inputs (``(T, H, D)``, ``(T, H_kv, D)``), or None with ``quantized``.
        o, lse: the forward's outputs (:func:`~flamia_pack.kernels.fp8_emulation.fp8_attention_forward`):
            ``(T, H, D)`` (bf16) and ``(H, T)`` float32 natural-log LSE.
        cu_seqlens, max_seqlen, causal, softmax_scale, scale_granularity, boost_log2, quantized:
            as the forward (the *same* values for replication).
        block_m: rows of a dK/dV query step, 16, 32, 64 (default, the kernel's) or 128.
        block_n: keys of a key tile (the forward's, default 128; another value changes only the
            payload groups and the sums' grouping, see module docs).
        dlse: optional ``(H, T)`` gradient of ``lse``.
        stats: optional dict, filled with the diagnostics of the module docs.
        mismatch: None, ``"bf16_scores"`` (positive control: needs q, k) or ``"bf16_delta"``.
        qk_terms: the forward's (1 or 2): with 2, S is recomputed from the two-term Q and K and the
            dQ product contracts dS against both of K's terms (``K_hi + K_lo``); dK reads Q's codes only
            (its second term costs the kernel its asynchronous wgmmas and buys < 4e-4 of cosine).
        pv_terms: the forward's (1 or 2): with 2, dP contracts dO against both of V's terms (``V + V_lo``);
            the dV fold P~v keeps one term.

    Returns:
        ``(dq, dk, dv)`` bfloat16 ``(T, H, D)``, ``(T, H_kv, D)``, ``(T, H_kv, D)``; padding rows 0.

    Raises:
        FlamiaError: as the forward, plus ``do`` / ``o`` / ``lse`` of the wrong shape or dtype,
            unknown ``mismatch``, ``block_m`` not in (16, 32, 64, 128); MetadataError: invalid ``cu_seqlens``.
    """
    _check_bwd_options(scale_granularity, block_m, block_n, boost_log2)
    if mismatch not in MISMATCHES:
        raise FlamiaError(f"mismatch must be one of {MISMATCHES}, got {mismatch!r}")
    if mismatch == "bf16_scores" and (q is None or k is None):
        raise FlamiaError("mismatch='bf16_scores' needs the unquantized q and k")
    if quantized is None:
        q, k, v = (x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    cu, ops, T, H, Hkv, D = _prepare(q, k, v, cu_seqlens, max_seqlen, scale_granularity, quantized,
                                     _kernel_head_dims, qk_terms, pv_terms)
    ops = tuple(_on_cpu(x) for x in ops)
    do = _check_tensor("do", do).detach().cpu()
    if tuple(do.shape) != (T, H, D):
        raise FlamiaError(f"do must be (T, H, D) = {(T, H, D)}, got {tuple(do.shape)}")
    if not isinstance(o, torch.Tensor) or tuple(o.shape) != (T, H, D) or not o.is_floating_point():
        raise FlamiaError(f"o must be a float tensor (T, H, D) = {(T, H, D)}, got {getattr(o, 'shape', o)!r}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (H, T) or not lse.is_floating_point():
        raise FlamiaError(f"lse must be a float tensor (H, T) = {(H, T)}, got {getattr(lse, 'shape', lse)!r}")
    if dlse is not None and (not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != (H, T)):
        raise FlamiaError(f"dlse must be (H, T) = {(H, T)}, got {getattr(dlse, 'shape', dlse)!r}")
    bf16_scores = (q.detach().cpu(), k.detach().cpu()) if mismatch == "bf16_scores" else None
    return _backward_impl(do, ops, o.detach().cpu(), lse.detach().cpu(), cu, T, H, Hkv, D, causal=bool(causal),
                          softmax_scale=softmax_scale, scale_granularity=scale_granularity, block_m=block_m,
                          block_n=block_n, boost=int(boost_log2),
                          dlse=None if dlse is None else dlse.detach().cpu(), stats=stats, bf16_scores=bf16_scores,
                          mismatch_delta=mismatch == "bf16_delta", pv_terms=int(pv_terms))
