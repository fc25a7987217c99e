"""CPU emulation of the FP8 attention backward that replicates the forward (issue 28; DESIGN.md
§4-5; paper §3.3; seed 001 §4-5). Notation, tiles and the exactness of E4M3 products as in
:mod:`flamia_pack.kernels.fp8_emulation` (fp32 unless said otherwise)::

    dO -> E4M3 codes dc, exponents e_do(i)     (once, same token-block scheme as Q, K, V)
    Delta_i = fp32( sum_d dO^_id O_id ) - dLSE_i        (fp64 sum of the reconstructed dO and the
                                                         saved bf16 O, rounded once)
    per key tile (the forward's block_n grid) and every row that sees it:
    s_ij    = scores(...)                 the forward's function on the same codes: bitwise the same S
    P_ij    = exp2(s_ij - fp32(LSE_i * log2 e))   visible pairs, else 0    (P from the saved LSE)
    dP_ij   = fp32(dc_i . vc_j) * 2^(e_do(i) + e_v(j))        exact product, exact factors
    dS_ij   = fp32( P_ij * fp32(dP_ij - Delta_i) )
    U_ij    = dS_ij * 2^(e_q(i) + e_k(j))                     (exact: the fold of both row/column
                                                               factors, DESIGN.md §4)
    U -> E4M3 with one power-of-two exponent sigma per 32 x 32 block of the document's grid
         (sigma = ceil(log2(amax / 448)), quant.py's rule: no saturation):  U^ = code * 2^sigma
    "token" (strict): the dQ payload instead has one sigma per (query row, key tile), so dQ_i
         reads nothing from later queries; dK keeps the 32 x 32 payload (dK_j legitimately reads
         every later query, DESIGN.md §5)
    dQ_i   += fp32( sum_j U^_ij kc_j )              (fp64 tile product, rounded once per tile)
    dK_j   += fp32( sum_i U^_ij qc_i )              per query tile of block_m rows, ascending
    dV_j   += fp32( sum_i P~v_ij dc_i ) * 2^(rho_j - boost)      per query tile, ascending, with
    P~v_ij  = E4M3_RNE( P_ij * 2^(e_do(i) - rho_j + boost) ),  rho_j = max{ e_do(i): i in the query
              tile, i sees j }   (the transpose of the forward's fold: dV contracts over queries,
              so the forward's P~ -- folded along keys with 2^(e_v(j) - r_i) -- cannot serve dV; the
              same range budget holds: P <= 1 (1 + 2^-20) and e_do(i) <= rho_j)
    final:  dQ = bf16(fp32(acc * 2^-e_q) * scale),  dK = bf16(fp32(sum_g acc_g * 2^-e_k) * scale),
            dV = bf16(sum_g acc_g)   (GQA: the group's query heads summed in fp32, ascending)

Why the fold serves both products: within a 32 x 32 block of the "block" mode e_q and e_k are
constant (the scale groups are the same document-local 32-token grid), so ``U`` and ``dS`` differ
by one power of two there and ``dQ_i = scale * 2^-e_q(i) * sum_j U^_ij kc_j`` and
``dK_j = scale * 2^-e_k(j) * sum_i U^_ij qc_i`` divide out a row-constant factor afterwards. A
128-key tile has 4 blocks along the dQ contraction, so a kernel issues one k = 32 FP8 wgmma per
block and scales each by ``2^sigma`` (or promotes per block); the emulation forms the whole tile
in fp64 and rounds once (the per-block promotion differs at the fp32-ulp level).

Causality of dQ (with dO fixed, "token"): dS_ij for visible j <= i reads q_i, k_j, v_j, dO_i, O_i,
LSE_i; the strict payload's sigma reads row i only; dQ accumulates in fp32 with no data-dependent
accumulator scale, so there is no sequence-wide dependency and ``causal_dq_scale`` is satisfied
trivially (issue 28 item 4). Tested bitwise.

Diagnostics (``stats``, seed 001 §5 / issue 28): ``ds_zero_fraction`` (visible dS != 0 whose dQ
payload code is 0; paper 0.4%), ``ds_zero_fraction_dk`` (same for the 32 x 32 payload),
``ds_row_residual`` / ``ds_row_residual_rms`` (signed mean / rms over valid rows of
``sum_j dS^_ij / sum_j |dS_ij|``, the decoded dQ payload; exactly 0 in exact arithmetic when P
sums to 1 and Delta matches), ``ds_row_residual_prequant_rms`` (same for the fp32 dS before
rounding), ``ptilde_dv_max`` (largest P~v, <= 2^boost).

Positive control (``mismatch="bf16_scores"``): S recomputed from the unquantized q, k in fp32
instead of the forward's codes -- P no longer matches the saved LSE and the row residual and the
gradient error grow (tested). A different ``block_n`` in the backward changes nothing of S or P
here (every S element is computed alone), only the dV fold's grouping; see tests for the numbers.
"""
from __future__ import annotations

from typing import Optional

import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.fp8_emulation import (
    BLOCK,
    DEFAULT_BOOST_LOG2,
    LOG2E,
    OperandCodes,
    _check_options,
    _check_tensor,
    _doc_local,
    _fold_p,
    _heads,
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
from flamia_pack.quant import UE8M0_BIAS, _abs_bits, exponent_from_amax_bits, quantize_token_blocks

__all__ = ["fp8_attention_backward", "MISMATCHES"]

#: Deliberately mismatched backward variants (positive controls only).
MISMATCHES = (None, "bf16_scores", "bf16_delta")


def _sigma_blocks(U: torch.Tensor, rb: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """Exponent per (row block, column block) of ``U`` ``(H, m, n)``, gathered back to ``(H, m, n)``.

    ``rb`` ``(m,)`` / ``cb`` ``(n,)``: consecutive block indices (0..). The exponent rule is
    quant.py's (``ceil(log2(amax / 448))`` from the fp32 bits, 0 for an all-zero block)."""
    H, m, n = U.shape
    nrb, ncb = int(rb.max()) + 1, int(cb.max()) + 1
    idx = (rb[:, None] * ncb + cb[None, :]).reshape(-1)
    bits = _abs_bits(U).reshape(H, -1)
    amax = torch.zeros((H, nrb * ncb), dtype=torch.int32).scatter_reduce_(
        1, idx[None, :].expand(H, -1), bits, reduce="amax")
    e, _ = exponent_from_amax_bits(amax)
    return e.gather(1, idx[None, :].expand(H, -1)).reshape(H, m, n)


def _sigma_rows(U: torch.Tensor) -> torch.Tensor:
    """Strict mode: one exponent per query row of the tile, ``(H, m, 1)``."""
    e, _ = exponent_from_amax_bits(_abs_bits(U).amax(-1, keepdim=True))
    return e


def _encode(U: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``U * 2^-sigma`` and their decoded values ``code * 2^sigma`` in fp64."""
    codes = (U * pow2(-sigma)).to(torch.float8_e4m3fn)
    return codes, codes.double() * pow2(sigma).double()


def _backward_impl(do, ops, o, lse, cu, T, H, Hkv, D, *, causal, softmax_scale, scale_granularity,
                   block_m, block_n, boost, dlse, stats, bf16_scores, mismatch_delta=False):
    qo, ko, vo = ops
    g = H // Hkv
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    qk = qk_scale_f32(scale)
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
    strict = scale_granularity == "token"
    for lo, hi, single in _segments(cu, min(block_m, block_n)):
        L = hi - lo
        doc, dpos = _doc_local(cu, lo, hi)
        qc, eq = _heads(qo.codes, qo.exponents, lo, hi, 1)
        kc, ek = _heads(ko.codes, ko.exponents, lo, hi, g)
        vc, ev = _heads(vo.codes, vo.exponents, lo, hi, g)
        dc, edo = _heads(dq_.codes, dq_.exponents, lo, hi, 1)
        blk = doc * (L + 1) + dpos // BLOCK
        blk = torch.unique(blk, return_inverse=True)[1]  # consecutive 32-block ids of the segment
        qt = dpos // block_m  # query tile of each row (single-document segments)
        dq_acc = torch.zeros((H, L, D), dtype=torch.float32)
        dk_acc = torch.zeros((H, L, D), dtype=torch.float32)
        dv_acc = torch.zeros((H, L, D), dtype=torch.float32)
        res = torch.zeros((H, L), dtype=torch.float64)
        res_pre = torch.zeros((H, L), dtype=torch.float64)
        mass = torch.zeros((H, L), dtype=torch.float64)
        for k0, k1, r0 in _steps(L, single, block_n, causal, lo % TILE_ALIGN):
            if single and causal:
                r0 = (r0 // block_m) * block_m  # whole query tiles (rows before k0 see nothing)
            rows, keys = slice(r0, L), slice(k0, k1)
            vis = visibility(doc, dpos, rows, keys, causal)
            if bf16_scores is None:
                s = scores(qc[:, rows], eq[:, rows], kc[:, keys], ek[:, keys], qk)
            else:  # positive control: S from the unquantized q, k (does not match the saved LSE)
                qf, kf = bf16_scores
                qs = qf[lo:hi].float().transpose(0, 1)[:, rows]
                ks = kf[lo:hi].float().transpose(0, 1).repeat_interleave(g, 0)[:, keys]
                s = torch.matmul(qs, ks.transpose(-1, -2)) * qk
            p = torch.where(vis, torch.exp2(s - lse2[:, lo:hi][:, rows, None]), torch.zeros((), dtype=torch.float32))
            dp = exact_mm(dc[:, rows], vc[:, keys].transpose(-1, -2))
            dp = dp * pow2(edo[:, rows])[..., None] * pow2(ev[:, keys])[:, None, :]
            ds = p * (dp - delta[:, lo:hi][:, rows, None])
            ds = torch.where(vis, ds, torch.zeros((), dtype=torch.float32))
            fold_r, fold_c = pow2(eq[:, rows])[..., None], pow2(ek[:, keys])[:, None, :]
            u = ds * fold_r * fold_c
            # the 32 x 32 payload (dK in both modes, dQ in "block")
            sig_b = _sigma_blocks(u, blk[rows], blk[keys])
            codes_b, ub = _encode(u, sig_b)
            if strict:
                sig_r = _sigma_rows(u)
                codes_q, uq = _encode(u, sig_r)
            else:
                codes_q, uq = codes_b, ub
            dq_acc[:, rows] += torch.matmul(uq, kc[:, keys]).float()
            # dK, dV: per query tile of the rows, ascending (the dK/dV programs walk query tiles)
            # (a chunk of short documents: each key's own document is its one query tile, so all
            # rows at once give the same sums -- the other documents add exact zeros)
            tiles = qt[rows] if single else torch.zeros(L, dtype=torch.long)
            for t in torch.unique(tiles).tolist():
                sel = (tiles == t).nonzero().flatten() + r0
                vis_t = vis[sel - r0]
                dk_acc[:, keys] += torch.matmul(ub[:, sel - r0].transpose(-1, -2), qc[:, sel]).float()
                # dV fold: rho_j = max e_do over the tile's rows that see key j
                rho, has = reference_exponent(edo[:, sel], vis_t.transpose(0, 1))  # (H, n)
                pvt = _fold_p(p[:, sel - r0].transpose(-1, -2), edo[:, sel], rho, vis_t.transpose(0, 1), boost)
                pvf = pvt.float()
                st["pv_max"] = max(st["pv_max"], float(pvf.max()) if pvf.numel() else 0.0)
                dv_acc[:, keys] += exact_mm(pvf, dc[:, sel]) * pow2(rho - boost)[..., None]
            if stats is not None:
                nz = vis & (ds != 0)
                st["vis_nz"] += int(nz.sum())
                st["zero_q"] += int((nz & (codes_q.float() == 0)).sum())
                st["zero_k"] += int((nz & (codes_b.float() == 0)).sum())
                unf = (fold_r * fold_c).double()
                res[:, rows] += (uq / unf).sum(-1)
                res_pre[:, rows] += ds.double().sum(-1)
                mass[:, rows] += ds.double().abs().sum(-1)
        if stats is not None:
            ok = mass > 0
            st["res"].append((res[ok] / mass[ok]))
            st["res_pre"].append((res_pre[ok] / mass[ok]))
        dq[lo:hi] = ((dq_acc * pow2(-eq)[..., None]) * scale).to(torch.bfloat16).transpose(0, 1)
        dkh = dk_acc * pow2(-ek)[..., None]
        dkg, dvg = dkh[0::g].clone(), dv_acc[0::g].clone()
        for j in range(1, g):  # the group's query heads, ascending, in fp32
            dkg += dkh[j::g]
            dvg += dv_acc[j::g]
        dk[lo:hi] = (dkg * scale).to(torch.bfloat16).transpose(0, 1)
        dv[lo:hi] = dvg.to(torch.bfloat16).transpose(0, 1)
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
    block_m: int = 128,
    block_n: int = 128,
    boost_log2: int = DEFAULT_BOOST_LOG2,
    quantized=None,
    dlse: Optional[torch.Tensor] = None,
    stats: Optional[dict] = None,
    mismatch: Optional[str] = None,
    _kernel_head_dims: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Emulated FP8 attention backward (module docs give every formula).

    Args:
        do: ``(T, H, D)`` bfloat16/float16/float32, the gradient of ``o``.
        q, k, v: the forward's inputs (``(T, H, D)``, ``(T, H_kv, D)``), or None with ``quantized``.
        o, lse: the forward's outputs (:func:`~flamia_pack.kernels.fp8_emulation.fp8_attention_forward`):
            ``(T, H, D)`` (bf16) and ``(H, T)`` float32 natural-log LSE.
        cu_seqlens, max_seqlen, causal, softmax_scale, scale_granularity, block_m, block_n,
            boost_log2, quantized: as the forward (the *same* values for replication; ``block_n``
            may differ, see module docs).
        dlse: optional ``(H, T)`` gradient of ``lse``.
        stats: optional dict, filled with the diagnostics of the module docs.
        mismatch: None, or ``"bf16_scores"`` (positive control: needs q, k).

    Returns:
        ``(dq, dk, dv)`` bfloat16 ``(T, H, D)``, ``(T, H_kv, D)``, ``(T, H_kv, D)``; padding rows 0.

    Raises:
        FlamiaError: as the forward, plus ``do`` / ``o`` / ``lse`` of the wrong shape or dtype,
            unknown ``mismatch``; MetadataError: invalid ``cu_seqlens``.
    """
    _check_options(scale_granularity, block_m, block_n, boost_log2)
    if mismatch not in MISMATCHES:
        raise FlamiaError(f"mismatch must be one of {MISMATCHES}, got {mismatch!r}")
    if mismatch == "bf16_scores" and (q is None or k is None):
        raise FlamiaError("mismatch='bf16_scores' needs the unquantized q and k")
    if quantized is None:
        q, k, v = (x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    cu, ops, T, H, Hkv, D = _prepare(q, k, v, cu_seqlens, max_seqlen, scale_granularity, quantized,
                                     _kernel_head_dims)
    ops = tuple(OperandCodes(x.codes.cpu(), x.exponents.cpu()) for x in ops)
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
                          mismatch_delta=mismatch == "bf16_delta")
