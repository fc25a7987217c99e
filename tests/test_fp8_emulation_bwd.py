"""The emulated FP8 backward's contract (kernels/fp8_emulation_bwd.py module docs; DESIGN.md §4-5):
bitwise against a straight-loop transcription of the formulas on the kernel's grid (64-row query
steps and 128-key tiles from ``floor16(doc_start)``), what the query step does and does not change,
the two payloads' fold identities (hypothesis), and a positive control for the dQ payload's
causality. Accuracy against fp64 and the leak tests are in test_fp8_emulation.py."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.constants import REF_FLOOR_LOG2
from flamia_pack.kernels import fp8_emulation_bwd as B
from flamia_pack.kernels.fp8_emulation import (
    LOG2E,
    exact_mm,
    fp8_attention_backward,
    fp8_attention_forward,
    pow2,
    qk_scale_f32,
    scores,
)
from flamia_pack.quant import _abs_bits, exponent_from_amax_bits, quantize_token_blocks

# starts 0, 1, 151, 188, 189, 389, 392 (16-token phases 0, 1, 7, 12, 13, 5, 8): three documents longer
# than a key tile, 1-token ones, short ones that the emulation computes as chunks; 5 padding rows
LENS = [1, 150, 37, 1, 200, 3, 290]
CU = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
N = int(CU[-1])
T = N + 5


def inputs(H, Hkv, D, seed, T=T):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, D, generator=g).bfloat16() for h in (H, Hkv, Hkv, H))  # q, k, v, dO


def rule(amax_of: torch.Tensor, dim: int) -> torch.Tensor:
    """quant.py's exponent of ``max |x|`` along ``dim``."""
    return exponent_from_amax_bits(_abs_bits(amax_of).amax(dim))[0]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).double()


def literal_backward(do, q, k, v, o, lse, cu, gran, *, causal=True, block_m=64, block_n=128, boost=8,
                     dlse=None):
    """The module docs' formulas walked as the kernels walk them, with plain loops: per document
    (grid origin ``f = floor16(start)``), per key tile ``[f + block_n t, ...)`` ascending: for each kv
    head one dK/dV accumulator over the group's query heads, each head's query steps
    ``[f + block_m m, ...)`` ascending; dQ of every row from that tile. No chunks, no shortcuts."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    scale = D ** -0.5
    qk, s32 = qk_scale_f32(scale), torch.tensor(scale, dtype=torch.float32)
    ops = [quantize_token_blocks(x, cu, gran) for x in (q, k, v, do)]
    qc, kc, vc, dc = (op.codes.double() for op in ops)
    eq, ek, ev, edo = (op.exponents.to(torch.int32) - 127 for op in ops)
    delta = ((dc * pow2(edo).double()[..., None]) * o.double()).sum(-1).float()  # (T, H)
    if dlse is not None:
        delta = delta - dlse.float().T
    lse2 = lse.float() * torch.tensor(LOG2E, dtype=torch.float32)
    zero = torch.zeros((), dtype=torch.float32)
    dq = torch.zeros((T, H, D), dtype=torch.bfloat16)
    dk = torch.zeros((T, Hkv, D), dtype=torch.bfloat16)
    dv = torch.zeros((T, Hkv, D), dtype=torch.bfloat16)

    def tile(I, J, h, kh, dq_payload=False):  # P and U of rows I, keys J (one document), query head h
        vis = J[None, :] <= I[:, None] if causal else torch.ones(len(I), len(J), dtype=torch.bool)
        s = scores(qc[I, h][None], eq[I, h][None], kc[J, kh][None], ek[J, kh][None], qk)[0]
        p = torch.where(vis, torch.exp2(s - lse2[h, I][:, None]), zero)
        dp = exact_mm(dc[I, h], vc[J, kh].T) * pow2(edo[I, h])[:, None] * pow2(ev[J, kh])[None, :]
        ds = torch.where(vis, p * (dp - delta[I, h][:, None]), zero)
        if dq_payload:  # dQ = dS K contracts over keys: K's exponent folded in
            return vis, p, ds * pow2(ek[J, kh])[None, :]
        return vis, p, ds * pow2(eq[I, h])[:, None]  # dK = dS^T Q: Q's

    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b <= a:
            continue
        f = a - a % 16
        dq_acc = torch.zeros((H, b - a, D), dtype=torch.float32)
        for t in range(math.ceil((b - f) / block_n)):
            J = torch.arange(max(a, f + block_n * t), min(b, f + block_n * (t + 1)))
            for kh in range(Hkv):
                acc_k = torch.zeros((len(J), D), dtype=torch.float32)
                acc_v = torch.zeros((len(J), D), dtype=torch.float32)
                lowest = -(1 << 20)
                sk_run = torch.full((len(J),), lowest, dtype=torch.int32)  # the references' floors
                r_run = lowest
                for h in range(kh * g, (kh + 1) * g):
                    for m in range(math.ceil((b - f) / block_m)):
                        I = torch.arange(max(a, f + block_m * m), min(b, f + block_m * (m + 1)))
                        if len(I) == 0:
                            continue
                        vis, p, u = tile(I, J, h, kh)
                        sk = rule(u, 0)  # sigma_k(j): over the step's rows
                        normal = _abs_bits(u).amax(0) >= 1 << 23
                        sk = torch.where(normal, torch.maximum(sk, sk_run - REF_FLOOR_LOG2), sk)
                        sk_run = torch.where(normal, torch.maximum(sk_run, sk), sk_run)
                        acc_k += exact_mm(e4m3(u * pow2(-sk)[None, :]).T, qc[I, h]) * pow2(sk)[:, None]
                        big = torch.iinfo(torch.int32).min
                        rho = torch.where(vis, edo[I, h][:, None], big).amax(0)
                        rho = torch.where(vis.any(0), torch.clamp(rho, min=max(r_run - REF_FLOOR_LOG2, boost - 126)), 0)
                        if vis.any():
                            r_run = max(r_run, int(edo[I, h][vis.any(1)].max()))
                        pt = torch.where(vis, p * pow2(edo[I, h][:, None] - rho[None, :] + boost), zero)
                        acc_v += exact_mm(e4m3(pt).T, dc[I, h]) * pow2(rho - boost)[:, None]
                dk[J, kh] = (acc_k * s32).bfloat16()
                dv[J, kh] = acc_v.bfloat16()
            for h in range(H):
                I = torch.arange(a, b)
                _, _, u = tile(I, J, h, h // g, dq_payload=True)
                sq = rule(u, 1)  # sigma_q(i): over the key tile
                part = exact_mm(e4m3(u * pow2(-sq)[:, None]), kc[J, h // g])
                dq_acc[h] += part * (pow2(sq) * s32)[:, None]
        dq[a:b] = dq_acc.transpose(0, 1).bfloat16()
    return dq, dk, dv


@pytest.mark.parametrize("gran,causal,block_m,H,Hkv,dlse", [
    ("block", True, 64, 2, 1, False),
    ("token", True, 64, 2, 2, True),
    ("block", False, 16, 2, 1, False),
])
def test_emulation_is_the_literal_contract_bitwise(gran, causal, block_m, H, Hkv, dlse):
    q, k, v, do = inputs(H, Hkv, 64, seed=block_m + causal)
    o, lse = fp8_attention_forward(q, k, v, CU, causal=causal, scale_granularity=gran)
    dl = torch.randn(H, T, generator=torch.Generator().manual_seed(3)) * 0.1 if dlse else None
    got = fp8_attention_backward(do, q, k, v, o, lse, CU, causal=causal, scale_granularity=gran,
                                 block_m=block_m, dlse=dl)
    want = literal_backward(do, q, k, v, o, lse, CU, gran, causal=causal, block_m=block_m, dlse=dl)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all() and a[:N].abs().max() > 0, name
        bad = (a.float() != b.float()).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} mismatches, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("gran,H,Hkv", [("token", 2, 1), ("block", 2, 2)])
def test_reference_floors_bitwise_on_degenerate_do(gran, H, Hkv):
    """dO exactly 0 on every document's last token (a key seen only by it: rho floored at
    boost - 126) and 2^-80 x dO on one query step of the long document (its dK / dV references 80
    binades below the previous step's: floored at REF_FLOOR_LOG2 below): the emulation still equals
    the transcription bitwise, and every gradient is finite."""
    q, k, v, do = inputs(H, Hkv, 64, seed=11)
    do = do.clone()
    do[(CU[1:] - 1).long()] = 0
    do[512:576] = do[512:576] * 2.0 ** -80
    o, lse = fp8_attention_forward(q, k, v, CU, scale_granularity=gran)
    got = fp8_attention_backward(do, q, k, v, o, lse, CU, scale_granularity=gran)
    want = literal_backward(do, q, k, v, o, lse, CU, gran)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        bad = (a.float() != b.float()).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} mismatches, first at {bad[:4].tolist()}"


def test_query_step_changes_dk_dv_only():
    """dQ's payload is per (row, key tile) and its sum runs over key tiles: the query step cannot
    change it. dK's payload and dV's rho are per (key, query step): they move."""
    q, k, v, do = inputs(2, 2, 64, seed=5)
    o, lse = fp8_attention_forward(q, k, v, CU, scale_granularity="token")
    g = {m: fp8_attention_backward(do, q, k, v, o, lse, CU, scale_granularity="token", block_m=m)
         for m in B.BWD_BLOCK_MS}
    assert B.BWD_BLOCK_M == 64
    for m in B.BWD_BLOCK_MS:
        assert torch.equal(g[m][0], g[64][0])
    assert not torch.equal(g[16][1], g[64][1]) and not torch.equal(g[16][2], g[64][2])
    assert not torch.equal(g[128][2], g[64][2])


def test_grid_is_anchored_at_floor16_of_the_document_start():
    """Prepending 16 tokens (another document) keeps every tile and step of the later documents in
    place relative to them: their gradients are bitwise the same; 8 tokens move the grid."""
    cu = torch.tensor([0, 300, 333], dtype=torch.int32)
    q, k, v, do = inputs(2, 1, 64, seed=6, T=333)
    out = {}
    for shift in (0, 16, 8):
        pad = [torch.randn(shift, *x.shape[1:], generator=torch.Generator().manual_seed(1)).bfloat16()
               for x in (q, k, v, do)]
        xs = [torch.cat([p, x]) for p, x in zip(pad, (q, k, v, do))]
        c = torch.cat([torch.zeros(1, dtype=torch.int32), cu + shift]) if shift else cu
        o, lse = fp8_attention_forward(*xs[:3], c, scale_granularity="block")
        out[shift] = [x[shift:] for x in fp8_attention_backward(xs[3], *xs[:3], o, lse, c, scale_granularity="block")]
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[16]))
    assert not all(torch.equal(a, b) for a, b in zip(out[0], out[8]))


def test_bad_query_step():
    q, k, v, do = inputs(2, 2, 64, seed=0, T=40)
    cu = torch.tensor([0, 40])
    o, lse = fp8_attention_forward(q, k, v, cu)
    for bad in (48, 256, 8, 64.0, True):
        with pytest.raises(FlamiaError, match="block_m"):
            fp8_attention_backward(do, q, k, v, o, lse, cu, block_m=bad)


# ---------------------------------------------------------------------------------------------
# the two payloads (hypothesis)
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(-30, 30), st.floats(0.01, 0.5))
def test_payload_fold_identities(seed, shift, zero_frac):
    """Both payloads: no code saturates or is NaN (|U 2^-sigma| <= 448); decoding a payload and
    dividing out its operand exponent is exactly the E4M3 rounding of dS at the payload's own scale,
    so ``exact(codeq . kc) 2^sigma_q`` = ``sum_j dS^_ij k^_j`` (Uq = dS 2^e_k) and
    ``exact(codek^T . qc) 2^sigma_k`` = ``sum_i dS^_ij q^_i`` (Uk = dS 2^e_q) exactly (fp64); sigma_q
    of row i reads row i only, sigma_k of key j its column only."""
    g = torch.Generator().manual_seed(seed)
    m, n, D = 7, 9, 8
    eq = torch.randint(-12, 4, (1, m), generator=g, dtype=torch.int32)
    ek = torch.randint(-12, 4, (1, n), generator=g, dtype=torch.int32)
    ds = (torch.randn(1, m, n, generator=g) * torch.exp2(torch.randint(-20, 4, (1, m, n), generator=g).float())
          * 2.0 ** shift)
    ds[torch.rand(1, m, n, generator=g) < zero_frac] = 0.0
    ds[0, 0] = 0.0  # an all-zero row
    qc = e4m3(torch.randn(1, m, D, generator=g) * 50)
    kc = e4m3(torch.randn(1, n, D, generator=g) * 50)
    fq, fk = pow2(eq)[..., None], pow2(ek)[:, None, :]
    uq, uk = ds * fk, ds * fq
    sq, sk = B._sigma(uq, -1), B._sigma(uk, -2)
    assert sq.shape == (1, m, 1) and sk.shape == (1, 1, n) and int(sq[0, 0, 0]) == -127
    for u, sig, fold in ((uq, sq, fk), (uk, sk, fq)):
        c = B._encode(u, sig).float()
        assert torch.isfinite(c).all() and float(c.abs().max()) <= 448
        # decode = the E4M3 rounding of dS at the payload's scale, exactly
        scale_ds = pow2(sig).double() / fold.double()
        assert torch.equal(c.double() * scale_ds, e4m3(ds.double() / scale_ds) * scale_ds)
    cq, ck = B._encode(uq, sq).double(), B._encode(uk, sk).double()
    dsq = cq * (pow2(sq).double() / fk.double())
    dsk = ck * (pow2(sk).double() / fq.double())
    kh, qh = kc * pow2(ek).double()[..., None], qc * pow2(eq).double()[..., None]
    assert torch.equal(torch.matmul(cq, kc) * pow2(sq).double(), torch.matmul(dsq, kh))
    assert torch.equal(torch.matmul(ck.transpose(-1, -2), qc) * pow2(sk).transpose(-1, -2).double(),
                       torch.matmul(dsk.transpose(-1, -2), qh))
    # locality: change everything but row i (column j): sigma_q(i) (sigma_k(j)) stays
    for i in range(m):
        w = uq * 1000.0
        w[:, i] = uq[:, i]
        assert torch.equal(B._sigma(w, -1)[:, i], sq[:, i])
    for j in range(n):
        w = uk * 1000.0
        w[:, :, j] = uk[:, :, j]
        assert torch.equal(B._sigma(w, -2)[..., j], sk[..., j])


# ---------------------------------------------------------------------------------------------
# dQ payload causality: the positive control
# ---------------------------------------------------------------------------------------------


def test_shared_dq_payload_exponent_leaks(monkeypatch):
    """Strict mode with the dQ payload's sigma taken over the whole tile (all rows: later queries
    too) instead of per row: rows before the cut move, through E4M3's subnormal floor, when later
    tokens are perturbed. With the per-row sigma they are bitwise unchanged (the probe is able to
    see a leak in this payload, and the contract has none)."""
    cu = torch.tensor([0, 263], dtype=torch.int32)
    q, k, v, do = inputs(2, 2, 64, seed=7, T=263)
    cut = 117
    pert = []
    for i, x in enumerate((q, k, v, do)):
        y = x.clone()
        y[cut + 1:] = (y[cut + 1:].float() + 64 * torch.randn(y[cut + 1:].shape,
                                                            generator=torch.Generator().manual_seed(10 + i))).bfloat16()
        pert.append(y)

    def grads(xs):
        o, lse = fp8_attention_forward(*xs[:3], cu, scale_granularity="token")
        return fp8_attention_backward(xs[3], *xs[:3], o, lse, cu, scale_granularity="token")[0]

    assert torch.equal(grads((q, k, v, do))[:cut + 1], grads(pert)[:cut + 1])
    own = B._sigma
    monkeypatch.setattr(B, "_sigma", lambda U, dim: own(U, (-2, -1)) if dim == -1 else own(U, dim))
    a, b = grads((q, k, v, do)), grads(pert)
    moved = ((a[:cut + 1].float() - b[:cut + 1].float()).abs().amax((1, 2)) > 0).sum()
    print(f"\nshared dQ payload exponent: {int(moved)} rows before the cut moved")
    assert moved > 0


@pytest.mark.parametrize("gran", ["token", "block"])
def test_public_op_with_causal_dq_scale(gran):
    """``varlen_attention(precision="fp8", causal_dq_scale=True)`` on the CPU (the emulation):
    perturbing q, k, v, dO after a cut leaves dQ before it bitwise unchanged in "token" mode and
    moves only the cut's 32-token group in "block" mode; a perturbation of another document moves
    nothing outside it."""
    from flamia_pack.kernels import varlen_attention

    cu = torch.tensor([0, 40, 263, 290], dtype=torch.int32)
    cut, group0 = 117, 104  # the third 32-token group of document [40, 263)
    base = inputs(2, 2, 64, seed=8, T=296)

    def perturbed(lo, hi):
        out = []
        for i, x in enumerate(base):
            y = x.clone()
            y[lo:hi] = (y[lo:hi].float() + 64 * torch.randn(y[lo:hi].shape,
                                                          generator=torch.Generator().manual_seed(i))).bfloat16()
            out.append(y)
        return out

    def grads(xs):
        q, k, v = (x.clone().requires_grad_(True) for x in xs[:3])
        varlen_attention(q, k, v, cu, 223, precision="fp8", scale_granularity=gran,
                         causal_dq_scale=True).backward(xs[3])
        return q.grad, k.grad, v.grad

    g0, g1, g2 = grads(base), grads(perturbed(cut + 1, 263)), grads(perturbed(263, 290))
    moved = ((g0[0][:cut + 1].float() - g1[0][:cut + 1].float()).abs().amax((1, 2)) > 0).nonzero().flatten()
    if gran == "token":
        assert moved.numel() == 0
    else:
        assert moved.numel() > 0 and int(moved.min()) >= group0
    assert not torch.equal(g0[1][40:cut + 1], g1[1][40:cut + 1])  # later queries feed dK (legit)
    for a, b in zip(g0, g2):
        assert torch.equal(a[:263], b[:263]) and torch.equal(a[290:], b[290:])
