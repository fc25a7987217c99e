"""CPU tests of ``varlen_attention(precision="fp8")`` and its host side (``kernels/fp8_attention.py``,
``kernels/quantize.py``'s per-input ``transposed`` flags; issue 27): on the CPU the public op runs the
emulation (``kernels/fp8_emulation.py``), so it must give the emulation's bits, forward and backward;
the errors of bad arguments; the key-tile grid (``_steps`` / ``_segments``) anchored at the 16-token
boundary at or before each document's first token. The GPU kernel is tested in
``test_fp8_attention_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels import varlen_attention
from flamia_pack.kernels.config import AttentionKernelConfig
from flamia_pack.kernels.fp8_attention import FP8Operands, fp8_attention_forward, fp8_quantize
from flamia_pack.kernels.fp8_emulation import TILE_ALIGN, _segments, _steps
from flamia_pack.kernels.fp8_emulation import fp8_attention_forward as emulated_forward
from flamia_pack.kernels.fp8_emulation import fp8_varlen_attention_emulated
from flamia_pack.kernels.quantize import HAS_TRITON, from_wgmma_order, quantize_qkv, to_wgmma_order
from flamia_pack.kernels.reference import packed_attention_reference
from flamia_pack.quant import quantize_token_blocks

# unaligned documents: starts 0, 1, 151, 188, 189, 389 (16-token phases 0, 1, 7, 12, 13, 5), two of
# them longer than a 128-key tile, two 1-token ones; then 9 row-end padding tokens
LENS = [1, 150, 37, 1, 200, 3]
CU = torch.tensor(np.concatenate([[0], np.cumsum(LENS)]), dtype=torch.int32)
N = int(CU[-1])
T = N + 9
MAX_SEQLEN = max(LENS)
H, HKV = 4, 2


def _cos(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _inputs(D, seed, T=T, H=H, Hkv=HKV):
    torch.manual_seed(seed)
    return tuple(torch.randn(T, h, D).bfloat16() for h in (H, Hkv, Hkv, H))  # q, k, v, dO


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float8 codes as their bytes (bitwise comparisons)."""
    return x.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# the public op on the CPU is the emulation, bitwise
# ---------------------------------------------------------------------------------------------


def test_fp8_work_list_on_the_cpu():
    """build_fp8_work_list's FP8WorkList is a WorkList (the CPU path checks and accepts it); without the
    kernels it carries no backward entries; the gradients through it are the emulation's."""
    from flamia_pack.kernels.fp8_attention import FP8WorkList, build_fp8_work_list
    from flamia_pack.scheduler.worklist import WorkList

    q, k, v, do = _inputs(64, seed=11)
    wl = build_fp8_work_list(CU, q.shape[0])
    assert isinstance(wl, FP8WorkList) and isinstance(wl, WorkList) and wl.bwd_entries is None
    assert wl.total_tokens == q.shape[0] and int(wl.num_items[0]) > 0
    a = [t.clone().requires_grad_(True) for t in (q, k, v)]
    varlen_attention(*a, CU, MAX_SEQLEN, precision="fp8", work_list=wl).backward(do)
    b = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fp8_varlen_attention_emulated(*b, CU, MAX_SEQLEN).backward(do)
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)


def test_fp8_work_list_bad_inputs_are_clear_errors():
    import dataclasses

    from flamia_pack.kernels.fp8_attention import build_fp8_work_list

    q, k, v, _ = _inputs(64, seed=12)
    T = q.shape[0]
    for kw in ({"causal": None}, {"causal": "yes"}, {"backward": "no"}, {"validate": 1}):
        with pytest.raises(FlamiaError, match=f"build_fp8_work_list: {next(iter(kw))} must be a bool"):
            build_fp8_work_list(CU, T, **kw)
    wl = build_fp8_work_list(CU, T)
    bad = [(dataclasses.replace(wl, items=wl.items.long()), "items must be a contiguous"),
           (dataclasses.replace(wl, items=wl.items[:, :3]), "items must be a contiguous"),
           (dataclasses.replace(wl, num_items=wl.num_items.float()), "num_items must be a"),
           (dataclasses.replace(wl, bwd_entries="garbage"), "bwd_entries must be None or"),
           ("WL", "work_list must be a flamia_pack.scheduler.worklist.WorkList")]
    for w, msg in bad:
        with pytest.raises(FlamiaError, match=msg):
            varlen_attention(q, k, v, CU, MAX_SEQLEN, precision="fp8", work_list=w)
    with pytest.raises(FlamiaError, match="work_list is an FP8 list"):
        varlen_attention(q, k, v, CU, MAX_SEQLEN, precision="bf16", work_list=wl)


def test_fp8_work_list_of_another_row_is_rejected_on_the_cpu():
    """varlen_attention(precision="fp8", work_list=build_fp8_work_list(<another row's cu_seqlens>, T)) ran
    silently on the CPU (docs/fp8.md: the list is checked); it is an error naming both cu_seqlens, with
    and without gradients, while the row's own list (any tensor with its values) still passes."""
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list

    q, k, v, do = _inputs(64, 0)
    other = torch.tensor([0, 100, 200, N], dtype=torch.int32)  # same T, other documents
    wl = build_fp8_work_list(other, T)
    for grad in (False, True):
        a = [x.clone().requires_grad_(grad) for x in (q, k, v)]
        with pytest.raises(FlamiaError, match=r"work_list was built for cu_seqlens \[0, 100, 200, 392\] \(3 "
                                              r"document\(s\)\) but the call has cu_seqlens \[0, 1, 151, .*"
                                              r"build_fp8_work_list\(cu_seqlens, T\)"):
            varlen_attention(*a, CU, MAX_SEQLEN, precision="fp8", work_list=wl)
    with torch.no_grad():
        ref = varlen_attention(q, k, v, CU, MAX_SEQLEN, precision="fp8")
        got = varlen_attention(q, k, v, CU, MAX_SEQLEN, precision="fp8", work_list=build_fp8_work_list(CU.long(), T))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gran", ["block", "token"])
def test_forward_is_the_emulation_bitwise(gran, causal, D):
    q, k, v, _ = _inputs(D, seed=4 * (gran == "token") + 2 * causal + (D == 64))
    o = varlen_attention(q, k, v, CU, MAX_SEQLEN, causal=causal, precision="fp8", scale_granularity=gran)
    eo, _ = emulated_forward(q, k, v, CU, MAX_SEQLEN, causal=causal, scale_granularity=gran)
    assert o.shape == (T, H, D) and o.dtype == torch.bfloat16 and o.device == q.device
    assert torch.equal(o, eo)
    assert o[N:].abs().max() == 0  # row-end padding
    ref = packed_attention_reference(q, k, v, CU, causal=causal)  # fp32 compute
    c = _cos(o[:N], ref[:N])
    print(f"\nfp8 {gran} causal={causal} D={D}: cos vs fp32 reference {c:.5f}")
    assert c > 0.998, c
    # the 1-token documents attend to themselves only: O = V up to the FP8 round trip
    for t in (0, 188):
        assert _cos(o[t], v[t].repeat_interleave(H // HKV, 0)) > 0.99


@pytest.mark.parametrize("D,gran,causal", [(128, "block", True), (64, "token", False)])
def test_backward_is_the_emulation_bitwise(D, gran, causal):
    q, k, v, do = _inputs(D, seed=40 + D + causal)
    a = [x.clone().requires_grad_(True) for x in (q, k, v)]
    b = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = varlen_attention(*a, CU, MAX_SEQLEN, causal=causal, precision="fp8", scale_granularity=gran)
    eo = fp8_varlen_attention_emulated(*b, CU, MAX_SEQLEN, causal=causal, scale_granularity=gran)
    assert o.requires_grad and torch.equal(o.detach(), eo.detach())
    o.backward(do)
    eo.backward(do)
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    packed_attention_reference(*ref, CU, causal=causal).backward(do.float())
    for name, ga, gb, gr in zip("qkv", (x.grad for x in a), (x.grad for x in b), (x.grad for x in ref)):
        assert ga is not None and ga.dtype == torch.bfloat16 and ga.shape == gb.shape
        assert torch.isfinite(ga).all(), name
        assert torch.equal(ga, gb), name
        assert ga[N:].abs().max() == 0, name  # padding rows get no gradient
        assert _cos(ga, gr) > 0.99, name  # real gradients, not just matching ones (measured ~0.998)


def test_backward_with_only_some_inputs_requiring_grad():
    q, k, v, do = _inputs(64, seed=7)
    kk = k.clone().requires_grad_(True)
    o = varlen_attention(q, kk, v, CU, MAX_SEQLEN, precision="fp8")
    o.backward(do)
    k2 = k.clone().requires_grad_(True)
    fp8_varlen_attention_emulated(q, k2, v, CU, MAX_SEQLEN).backward(do)
    assert torch.equal(kk.grad, k2.grad) and torch.isfinite(kk.grad).all()


@pytest.mark.parametrize("gran", ["block", "token"])
def test_return_lse_under_no_grad_is_the_emulations(gran):
    q, k, v, _ = _inputs(128, seed=11)
    eo, else_ = emulated_forward(q, k, v, CU, MAX_SEQLEN, scale_granularity=gran)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    with torch.no_grad():  # inputs that require grad, as in a training model's eval step
        o, lse = varlen_attention(qg, kg, vg, CU, MAX_SEQLEN, precision="fp8", scale_granularity=gran,
                                  return_lse=True)
    assert not o.requires_grad and lse.dtype == torch.float32 and lse.shape == (H, T)
    assert torch.equal(o, eo) and torch.equal(lse, else_)
    assert torch.isinf(lse[:, N:]).all() and (lse[:, N:] > 0).all()
    assert torch.isfinite(lse[:, :N]).all()


def test_return_lse_with_grad_raises():
    q, k, v, _ = _inputs(64, seed=12)
    q.requires_grad_(True)
    with pytest.raises(FlamiaError, match="return_lse=True with gradients.*no_grad"):
        varlen_attention(q, k, v, CU, MAX_SEQLEN, precision="fp8", return_lse=True)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    (dict(scale_granularity="row"), "scale_granularity must be 'block' or 'token', got 'row'"),
    (dict(config=AttentionKernelConfig()), r"config= picks the BF16 kernels' tiles; precision='fp8'"),
    (dict(causal_dq_scale=1), "causal_dq_scale must be a bool, got 1"),
    (dict(causal_dq_scale="yes"), "causal_dq_scale must be a bool"),
    (dict(causal_dq_scale=None), "causal_dq_scale must be a bool"),
])
def test_bad_fp8_arguments(kw, msg):
    q, k, v, _ = _inputs(64, seed=13, T=40)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    with pytest.raises(FlamiaError, match=msg):
        varlen_attention(q, k, v, cu, 40, precision="fp8", **kw)


def test_bad_head_dim_for_fp8():
    q, k, v, _ = _inputs(32, seed=14, T=40)
    with pytest.raises(FlamiaError, match="head_dim"):
        varlen_attention(q, k, v, torch.tensor([0, 40], dtype=torch.int32), 40, precision="fp8")


def test_prequantized_entry_on_cpu_operands():
    """``fp8_quantize`` works on the CPU (quant.py's bits, V^T = V's codes feature-major); the
    pre-quantized forward on CPU operands says it needs the GPU; a plain tuple is not FP8Operands."""
    torch.manual_seed(15)
    cu = torch.tensor([0, 1, 17, 33, 39], dtype=torch.int32)
    q, k, v = (torch.randn(40, h, 16).bfloat16() for h in (2, 1, 1))
    ops = fp8_quantize(q, k, v, cu, "block")
    assert isinstance(ops, FP8Operands) and ops.granularity == "block"
    for codes, ex, x in ((ops.qc, ops.eq, q), (ops.kc, ops.ek, k)):
        want = quantize_token_blocks(x, cu, "block")
        assert torch.equal(_bits(codes), _bits(want.codes)) and torch.equal(ex, want.exponents)
    want_v = quantize_token_blocks(v, cu, "block")
    assert torch.equal(ops.ev, want_v.exponents)
    assert ops.vt.shape == (1, 16, 48)  # the whole 16-token pitch, in the wgmma order
    assert torch.equal(_bits(from_wgmma_order(ops.vt, 40)), _bits(want_v.codes.permute(1, 2, 0)))
    token_at = to_wgmma_order(torch.arange(48))  # the token each position holds
    assert bool((_bits(ops.vt)[:, :, token_at >= 40] == 0).all())
    with pytest.raises(FlamiaError, match=r"CUDA GPU of compute capability 9\.x \(Hopper\).*got cpu"):
        fp8_attention_forward(ops, cu)
    with pytest.raises(FlamiaError, match="ops must be FP8Operands.*got tuple"):
        fp8_attention_forward(tuple(ops), cu)
    with pytest.raises(FlamiaError, match="ops must be FP8Operands"):
        fp8_attention_forward(q, cu)


# ---------------------------------------------------------------------------------------------
# quantize_qkv: one transposed flag per input
# ---------------------------------------------------------------------------------------------

QCU = torch.tensor([0, 1, 17, 33, 39], dtype=torch.int32)  # unaligned, a 1-token document, 1 padding row


def _qkv_small(seed=16):
    torch.manual_seed(seed)
    return tuple(torch.randn(40, 2, 16).bfloat16() for _ in range(3))


@pytest.mark.parametrize("gran", ["block", "token"])
def test_quantize_qkv_per_input_transposed(gran):
    q, k, v = _qkv_small()
    qq, kq, vq = quantize_qkv(q, k, v, QCU, gran, transposed=(False, False, True))
    assert qq.codes_t is None and kq.codes_t is None
    assert vq.codes_t is not None and vq.codes_t.shape == (2, 16, 40)
    assert torch.equal(_bits(vq.codes_t), _bits(vq.codes.permute(1, 2, 0)))
    if HAS_TRITON:  # the kernel path pads the token pitch to 16 bytes (TMA strides; quantize's docs)
        assert vq.codes_t.stride() == (16 * 48, 48, 1)
    for got, x in ((qq, q), (kq, k), (vq, v)):  # still quant.py's bits
        want = quantize_token_blocks(x, QCU, gran)
        assert torch.equal(_bits(got.codes), _bits(want.codes)) and torch.equal(got.exponents, want.exponents)


def test_wgmma_order_is_the_accumulator_columns_in_operand_order():
    """Position ``4 q + 2 h + r`` of every 16-token block holds token ``8 h + 2 q + r``: the FP8 wgmma
    accumulator's columns of quad lane ``q`` (``8 h + 2 q + r``) land in that lane's A-operand k slots
    (``4 q .. 4 q + 3``); the inverse cuts to T."""
    tok = to_wgmma_order(torch.arange(64))
    for b in range(4):
        for q in range(4):
            for h in range(2):
                for r in range(2):
                    assert int(tok[16 * b + 4 * q + 2 * h + r]) == 16 * b + 8 * h + 2 * q + r
    x = torch.randint(0, 255, (2, 3, 48), dtype=torch.uint8)
    assert torch.equal(from_wgmma_order(to_wgmma_order(x), 37), x[..., :37])
    with pytest.raises(FlamiaError, match="multiple of 16"):
        to_wgmma_order(torch.zeros(40))
    with pytest.raises(FlamiaError, match="multiple of 16 and >= T"):
        from_wgmma_order(torch.zeros(48), 49)
    for bad_t in (40.5, "40", None, True):
        with pytest.raises(FlamiaError, match="T must be an int"):
            from_wgmma_order(torch.zeros(48), bad_t)
    for bad_x in ([1] * 16, torch.tensor(1.0)):
        with pytest.raises(FlamiaError, match="token axis last"):
            to_wgmma_order(bad_x)
        with pytest.raises(FlamiaError, match="token axis last"):
            from_wgmma_order(bad_x, 1)


def test_wgmma_order_needs_the_transposed_copy():
    q, k, v = _qkv_small()
    with pytest.raises(FlamiaError, match="wgmma_order orders the transposed copies"):
        quantize_qkv(q, k, v, QCU, transposed=(True, False, True), wgmma_order=(True, True, False))
    with pytest.raises(FlamiaError, match="wgmma_order orders the transposed copies"):
        quantize_qkv(q, k, v, QCU, wgmma_order=True)
    for bad in ("yes", 1, None):
        with pytest.raises(FlamiaError, match="backward must be a bool"):
            fp8_quantize(q, k, v, QCU, "block", backward=bad)


@pytest.mark.parametrize("store", ["torch", "kernel"])
@pytest.mark.parametrize("gran", ["block", "token"])
def test_quantize_qkv_wgmma_order(gran, store):
    """V^T in the wgmma order (the FP8 forward's operand): the whole 16-token pitch, the token-order
    copy's bits permuted, zeros at the padding tokens' positions; Q^T / K^T of the same launch stay in
    token order (the in-kernel store under Triton's interpreter here, on sm_90 in the GPU tests)."""
    q, k, v = _qkv_small()
    want = quantize_qkv(q, k, v, QCU, gran, transposed=True)
    for tr in ((False, False, True), True):
        got = quantize_qkv(q, k, v, QCU, gran, transposed=tr, wgmma_order=(False, False, True),
                           transposed_store=store, hw_cvt=False if store == "kernel" else None)
        vt = _bits(got[2].codes_t)
        assert vt.shape == (2, 16, 48)
        assert torch.equal(vt, to_wgmma_order(torch.nn.functional.pad(_bits(want[2].codes_t), (0, 8))))
        if tr is True:
            for a, b in zip(got[:2], want[:2]):
                assert torch.equal(_bits(a.codes_t), _bits(b.codes_t))


@pytest.mark.parametrize("transposed", [(True, False), (True, False, True, False), "yes", (1, 0, 1), None])
def test_quantize_qkv_bad_transposed(transposed):
    q, k, v = _qkv_small()
    with pytest.raises(FlamiaError, match="transposed must be a bool"):
        quantize_qkv(q, k, v, QCU, transposed=transposed)


@pytest.mark.parametrize("gran", ["block", "token"])
def test_quantize_qkv_kernel_store_of_one_input(gran):
    """The in-kernel transposed store takes the per-input flags too: V's copy only, its pitch padded
    with zeros, the same bits as the torch copy (Triton's interpreter here; the GPU tests on sm_90)."""
    q, k, v = _qkv_small()
    want = quantize_qkv(q, k, v, QCU, gran, transposed=(False, False, True))
    got = quantize_qkv(q, k, v, QCU, gran, transposed=(False, False, True), transposed_store="kernel", hw_cvt=False)
    assert got[0].codes_t is None and got[1].codes_t is None
    for a, b in zip(got, want):
        assert torch.equal(_bits(a.codes), _bits(b.codes)) and torch.equal(a.exponents, b.exponents)
    assert torch.equal(_bits(got[2].codes_t), _bits(want[2].codes_t))
    if HAS_TRITON:
        assert got[2].codes_t.stride() == (16 * 48, 48, 1)
        assert bool((got[2].codes_t.as_strided((2, 16, 48), (16 * 48, 48, 1))[:, :, 40:].view(torch.uint8) == 0).all())


# ---------------------------------------------------------------------------------------------
# the key-tile grid: anchored at the 16-token boundary at or before each document's first token
# ---------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 700), st.sampled_from([64, 128]), st.integers(0, TILE_ALIGN - 1), st.booleans())
def test_steps_tile_one_document_on_the_grid(L, block_n, phase, causal):
    steps = _steps(L, True, block_n, causal, phase)
    assert steps and steps[0][0] == 0 and steps[-1][1] == L
    for (_, a1, _), (b0, _, _) in zip(steps, steps[1:]):
        assert a1 == b0  # contiguous, increasing
    sizes = [k1 - k0 for k0, k1, _ in steps]
    assert sizes[0] == min(L, block_n - phase)
    assert all(s == block_n for s in sizes[1:-1]) and all(0 < s <= block_n for s in sizes)
    assert len(steps) == -(-(L + phase) // block_n)
    for k0, _, r0 in steps:
        assert r0 == (k0 if causal else 0)
        if k0:
            assert (k0 + phase) % block_n == 0  # on the grid anchored `phase` tokens before the document


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.sampled_from([64, 128]))
def test_segments_split_on_the_grid(lens, short):
    cu = [0, *np.cumsum(lens).tolist()]
    docs = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    segs = _segments(cu, short)
    assert [s[0] for s in segs[1:]] == [s[1] for s in segs[:-1]]  # contiguous
    if docs:  # covers [0, cu[-1]): empty documents hold no tokens
        assert segs[0][0] == 0 and segs[-1][1] == cu[-1]
    else:
        assert segs == []
    starts = set(cu)
    for lo, hi, single in segs:
        assert lo in starts and hi in starts
        inside = [(a, b) for a, b in docs if lo <= a < hi]
        assert all(b <= hi for _, b in inside)  # whole documents only
        # a document that crosses a key-tile boundary of its 16-aligned grid is walked alone
        crossing = [a % TILE_ALIGN + (b - a) > short for a, b in inside]
        if single:
            assert inside == [(lo, hi)] and crossing == [True]
        else:
            assert inside and not any(crossing)


def _shifted_row(lens, pre, seed, D=64):
    """The documents ``lens`` (fixed values) behind a first document of ``pre`` tokens."""
    torch.manual_seed(seed)
    base = [torch.randn(sum(lens), h, D) for h in (H, HKV, HKV)]
    torch.manual_seed(seed + 1)
    head = [torch.randn(pre, h, D) for h in (H, HKV, HKV)]
    x = [torch.cat([a, b]).bfloat16() for a, b in zip(head, base)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(([pre] if pre else []) + lens)]), dtype=torch.int32)
    return x, cu


@pytest.mark.parametrize("gran,causal,block_n", [("block", True, 128), ("token", False, 64)])
def test_grid_is_anchored_at_16_tokens(gran, causal, block_n):
    """Shifting every document by 16 tokens leaves its bits alone (same phase on the 16-token grid);
    by 5 tokens it moves them (another phase: other tile boundaries in the long documents), so the
    grid is neither anchored at the document start nor at the row's block_n grid."""
    lens = [150, 37, 1, 200, 3, 90]
    n = sum(lens)
    out = {}
    for pre in (0, 16, 5):
        x, cu = _shifted_row(lens, pre, seed=21)
        o, lse = emulated_forward(*x, cu, causal=causal, scale_granularity=gran, block_n=block_n)
        out[pre] = (o[pre:pre + n], lse[:, pre:pre + n])
    assert torch.equal(out[16][0], out[0][0]) and torch.equal(out[16][1], out[0][1])
    assert not torch.equal(out[5][0], out[0][0])  # positive control


# ---------------------------------------------------------------------------------------------
# all-zero tokens / groups (quant.py: e = -127) never win the folds' maxima
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gran", ["token", "block"])
def test_all_zero_tokens_do_not_underflow_the_others(gran):
    """A zero dO row (a -100 label) or zero V token / group in a small-magnitude tensor: with the old
    rule (e = 0 for an all-zero group) it won the max that picks the fold's reference (rho_j / r_i) and
    rounded every other term to E4M3 0 (dV cosine 0.85, O cosine 0.83, found by a new-user check)."""
    torch.manual_seed(0)
    T, cu = 600, torch.tensor([0, 250, 251, 600], dtype=torch.int32)
    q, k, v = (torch.randn(T, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn(T, 2, 64) * 1e-3
    do[283:315] = 0  # one whole document-local 32-token group of document 2, and its tokens
    do = do.bfloat16()

    def grads(precision, vv):
        vv = vv.clone().requires_grad_()
        o = varlen_attention(q, k, vv, cu, 349, precision=precision, scale_granularity=gran)
        o.backward(do)
        return o.detach(), vv.grad

    _, dv_ref = grads("bf16", v)
    _, dv = grads("fp8", v)
    assert _cos(dv, dv_ref) > 0.998
    vs = (v.float() * 1e-4)
    vs[283:315] = 0
    vs = vs.bfloat16()
    o_ref = varlen_attention(q, k, vs, cu, 349)
    o = varlen_attention(q, k, vs, cu, 349, precision="fp8", scale_granularity=gran)
    assert _cos(o, o_ref) > 0.998


def test_nan_on_the_cpu_path_names_the_call():
    q = torch.randn(256, 2, 128).bfloat16()
    q[10, 0, 3] = float("nan")
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    with pytest.raises(FlamiaError, match=r"precision='fp8'\) on the CPU runs the FP8 emulation, which needs finite"):
        varlen_attention(q, q, q, cu, 156, precision="fp8", check_finite=False)


# ---------------------------------------------------------------------------------------------
# the Gluon kernel's factor tables, and its fold in float powers of two (gluon_fp8_fwd._fp8_softmax,
# transcribed in torch fp32) against the emulation's integer-exponent fold
# ---------------------------------------------------------------------------------------------


def _gluon_fp8():
    return pytest.importorskip("flamia_pack.kernels.gluon_fp8_fwd", reason="the Gluon FP8 kernel needs triton")


def test_exponent_table_is_float_powers_of_two():
    g = _gluon_fp8()
    e = torch.tensor([[0, 1, 127], [128, 254, 255], [7, 100, 200]], dtype=torch.uint8)  # (T=3, H=3)
    tab = g.exponent_table(e)
    assert tab.dtype == torch.float32 and tab.shape == (3, 16 + g.TABLE_PAD) and tab.is_contiguous()
    want = torch.ldexp(torch.ones(3, 3), e.t().to(torch.int32).clamp(1, 254) - 127)
    assert torch.equal(tab[:, :3], want)
    assert bool((tab[:, 3:] == 1.0).all())
    assert bool(torch.isfinite(tab).all()) and float(tab.min()) == 2.0 ** -126 and float(tab.max()) == 2.0 ** 127


def _kernel_fold(p, b, vis, boost, masked):
    """``_fp8_softmax``'s fold on UE8M0 bytes ``b`` ``(H, n)``: P~ bytes. The kernel forms ``pc = p c`` with
    ``c = 2^boost / r`` inside the exponential (exp2 of the argument minus ``log2 c``: the same value up to
    MUFU's ulps, modelled here as the exact product), then ``P~ = pc f_v``; r_i starts at the floor
    ``2^(boost - FOLD_REF_MIN_OFFSET)``, so a walk's first tile never meets the running floor."""
    from flamia_pack.kernels.constants import FOLD_REF_MIN_OFFSET
    from flamia_pack.kernels.fp8_emulation import pow2

    f = pow2(b.to(torch.int32).clamp(1, 254) - 127)  # exponent_table's entries
    rmin = 2.0 ** (boost - FOLD_REF_MIN_OFFSET)

    def boost_over(r):  # _boost_over: the reciprocal from the exponent field, times 2^boost
        return ((254 << 23) - r.contiguous().view(torch.int32)).view(torch.float32) * 2.0 ** boost

    if masked:
        r_max = torch.where(vis, f[:, None, :], 0.0).amax(-1)
        r = torch.where(r_max > 0, torch.clamp(r_max, min=rmin), torch.full((), rmin))
    else:
        r = torch.clamp(f.amax(-1), min=rmin)[:, None].expand(-1, p.shape[1])
    pt = (p * boost_over(r)[..., None]) * f[:, None, :]
    return pt.to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("boost", [8, 3, 0])
def test_float_fold_is_the_integer_fold(masked, boost):
    """The kernel's fold ``P~ = (p 2^BOOST / r) f_v`` gives the emulation's ``E4M3(p 2^(e_v - r + boost))``
    bits on every visible pair whose V byte is not 0 (all-zero groups: their codes are 0) and whose
    row's reference is not clamped to ``2^(boost - FOLD_REF_MIN_OFFSET)`` (the documented floor), never
    more than ``2^boost``, and exactly 0 on masked pairs (NaN bytes 255 included)."""
    from flamia_pack.kernels.constants import FOLD_REF_MIN_OFFSET
    from flamia_pack.kernels.fp8_emulation import _fold_p, reference_exponent

    _gluon_fp8()
    g = torch.Generator().manual_seed(boost + 10 * masked)
    H, m, n = 3, 64, 128
    b = torch.randint(90, 160, (H, n), generator=g)  # real activations' exponents (e in [-37, 32])
    b[0, :40] = torch.randint(1, 40, (40,), generator=g)  # tiny groups: r near the clamp
    b[1, ::9] = 0  # all-zero groups
    vis = torch.rand(m, n, generator=g) < 0.5 if masked else torch.ones(m, n, dtype=torch.bool)
    if masked:
        vis[:5] = False  # rows that see no key of the tile
        vis[:, :3] = False
        b[2, :3] = 255  # non-finite groups on keys nobody sees
    p = torch.exp2(-torch.rand(H, m, n, generator=g) * 40)
    p[:, :, ::7] = 1.0
    p[:, :, 1::11] = 2.0 ** -125
    p = torch.where(vis, p, 0.0)  # the softmax's masked p are exactly 0
    got = _kernel_fold(p, b, vis, boost, masked)
    e = b.to(torch.int32) - 127
    r_emu, has = reference_exponent(e, vis)
    want = _fold_p(p, e, r_emu, vis, boost).view(torch.uint8)
    vals = got.view(torch.float8_e4m3fn).float()
    assert bool(torch.isfinite(vals).all()) and float(vals.max()) <= 2.0 ** boost  # the range budget
    assert bool((got[:, ~vis] == 0).all())
    lo = boost - FOLD_REF_MIN_OFFSET + 127 + 1  # R = r + 127 above the floor's
    cmp = vis & (b[:, None, :] > 0) & (has & (r_emu + 127 >= lo))[..., None]
    assert int(cmp.sum()) > H * m * n // 8
    assert torch.equal(got[cmp], want[cmp])


def test_float_rescale_is_the_integer_rescale():
    """``_rescale``'s ``alpha * clamp(r_old * 2^(127 - R_new), 2^-126, 2^127)`` is the integer version's
    ``alpha * 2^clamp(R_old - R_new, -126, 127)``, and the final ``r 2^-BOOST`` its ``2^(max(R - BOOST, 1) - 127)``
    (references ``r = 2^(R - 127)`` with ``R >= BOOST + 1``; 2^127, the NaN byte's clamp, has no normal
    reciprocal)."""
    from flamia_pack.kernels.fp8_emulation import pow2

    R = torch.arange(9, 254)
    ro, rn = torch.meshgrid(R, R, indexing="ij")
    alpha = torch.rand(ro.shape, generator=torch.Generator().manual_seed(3))
    f_old, f_new = pow2(ro - 127), pow2(rn - 127)
    inv = ((254 << 23) - f_new.contiguous().view(torch.int32)).view(torch.float32)
    got = alpha * torch.clamp(f_old * inv, 2.0 ** -126, 2.0 ** 127)
    assert torch.equal(got, alpha * pow2(torch.clamp(ro - rn, -126, 127)))
    assert torch.equal(pow2(R - 127) * 2.0 ** -8, pow2(torch.clamp(R - 8, min=1) - 127))


def test_fp8_refuses_what_it_cannot_do_honestly():
    """Double backward (the FP8 backward is not differentiable) raises instead of returning a wrong
    second-order gradient; a NaN reaching the backward is named. ``deterministic=True`` runs (the CPU
    emulation is deterministic: the same gradients bitwise as the default, twice)."""
    from flamia_pack.kernels import varlen_attention

    cu = torch.tensor([0, 100, 200], dtype=torch.int32)
    q, k, v = (torch.randn(200, 2, 64, requires_grad=True) for _ in range(3))
    o = varlen_attention(q, k, v, cu, 100, precision="fp8")
    (g,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    assert g.grad_fn is None  # once differentiable: no graph to differentiate again
    grads = []
    for det in (False, True, True):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        varlen_attention(*x, cu, 100, precision="fp8", deterministic=det).square().sum().backward()
        grads.append([t.grad for t in x])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))
    o = varlen_attention(q, k, v, cu, 100, precision="fp8")
    with pytest.raises(FlamiaError, match="NaN / Inf"):
        o.backward(torch.full_like(o, float("nan")))


def test_fp8_deterministic_turn_counters_cover_every_step_of_every_document():
    """``gluon_fp8_bwd._turn_counters`` (CPU tensors, torch only): each entry's base is the first slot of
    its document, the documents' 64-row steps on the grid floor16(start) + 64 m lie back to back and
    inside the allocation (``T // 64 + 2 n_docs`` slots, no host sync), empty documents included."""
    pytest.importorskip("triton")
    from flamia_pack.kernels.gluon_fp8_bwd import BWD_BLOCK_M, _turn_counters, fp8_bwd_entries

    rng = np.random.default_rng(5)
    for trial in range(20):
        lens = rng.integers(0, 400, rng.integers(1, 30))
        lens[rng.random(lens.size) < 0.2] = 0  # empty documents
        if lens.sum() == 0:
            lens[0] = 1
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        T, H = int(cu[-1]), 3
        ent, n_ent, _ = fp8_bwd_entries(cu, T, causal=bool(trial % 2))
        sem, base = _turn_counters(cu, ent, T, H)
        assert sem.shape[1] == H and sem.dtype == torch.int32 and not sem.any()
        slots, nxt = {}, 0
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if e > s:
                f = s - s % 16
                slots[s] = (nxt, -(-(e - f) // BWD_BLOCK_M))
                nxt += slots[s][1]
        assert nxt <= sem.shape[0]
        for i in range(int(n_ent)):
            b, nb = slots[int(ent[i, 2])]
            assert int(base[i]) == b and b + nb <= sem.shape[0]


@pytest.mark.parametrize("precision, gran", [("bf16", "block"), ("fp8", "block"), ("fp8", "token")])
def test_non_finite_row_end_padding_is_not_read(precision, gran):
    """NaN / Inf in the row-end padding (tokens after cu_seqlens[-1]) is no error on the CPU paths: the
    documents' O and gradients are bitwise those of a clean row, the padding's O and gradients 0; a NaN
    inside a document still raises."""
    from flamia_pack import varlen_attention

    gen = torch.Generator().manual_seed(7)
    T, H, D = 40, 2, 64
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    clean = [torch.randn(T, H, D, generator=gen).to(torch.bfloat16) for _ in range(3)]
    dirty = [x.clone() for x in clean]
    dirty[0][35] = float("nan")
    dirty[1][36] = float("inf")
    dirty[2][30:] = float("nan")
    outs, grads = [], []
    for xs in (clean, dirty):
        leaves = [x.clone().requires_grad_() for x in xs]
        o = varlen_attention(*leaves, cu, 20, precision=precision, scale_granularity=gran)
        o.float().square().sum().backward()
        outs.append(o.detach())
        grads.append([x.grad for x in leaves])
    assert torch.equal(outs[0][:30], outs[1][:30]) and float(outs[1][30:].abs().max()) == 0.0
    for g0, g1 in zip(*grads):
        assert torch.equal(g0[:30], g1[:30]) and float(g1[30:].abs().max()) == 0.0
    inside = [x.clone() for x in clean]
    inside[0][12] = float("nan")
    with pytest.raises(FlamiaError, match="token 12"):
        varlen_attention(*inside, cu, 20, precision=precision, scale_granularity=gran)
