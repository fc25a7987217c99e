"""Fused Triton quantizer (flamia_pack.kernels.quantize) bitwise against the torch reference.

CPU: small shapes through Triton's interpreter (skipped when triton is not installed).
GPU (``-m gpu``, H200): compiled kernel on random unaligned packed rows, both input dtypes, both
granularities, the transposed copy, precomputed metadata, the integer encoder, extreme values,
poisoned output memory and a no-host-sync check.
"""
from __future__ import annotations

import pytest
import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.quant import quantize_token_blocks, scale_groups

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from flamia_pack.kernels.quantize import (  # noqa: E402
    _search_steps,
    launch_config,
    quantize,
    quantize_qkv,
)


def packed(gen: torch.Generator, lens: list[int], pad: int, H: int, D: int, dtype, spread: int = 12):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1]) + pad
    mag = torch.exp2(torch.randint(-spread, spread + 1, (T, H, 1), generator=gen).float())
    return (torch.randn(T, H, D, generator=gen) * mag).to(dtype), cu


def assert_same(out, x, cu, granularity, transposed):
    ref = quantize_token_blocks(x.cpu(), cu.cpu(), granularity)
    got_c = out.codes.cpu().view(torch.uint8)
    want_c = ref.codes.view(torch.uint8)
    bad = (got_c != want_c).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} code mismatches, first at {bad[:5].tolist()}"
    bad_e = (out.exponents.cpu() != ref.exponents).nonzero()
    assert bad_e.numel() == 0, f"{bad_e.shape[0]} exponent mismatches, first at {bad_e[:5].tolist()}"
    if transposed:
        T = x.shape[0]
        tp = -(-T // 16) * 16
        assert out.codes_t.shape == (x.shape[1], x.shape[2], T)
        assert out.codes_t.stride() == (x.shape[2] * tp, tp, 1)  # 16-byte aligned row pitch
        got_t = out.codes_t.cpu().view(torch.uint8)
        bad_t = (got_t != want_c.permute(1, 2, 0)).nonzero()
        assert bad_t.numel() == 0, f"{bad_t.shape[0]} codes_t mismatches, first at {bad_t[:5].tolist()}"
    else:
        assert out.codes_t is None


# ---------------------------------------------------------------------------------------------
# CPU (interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,granularity,transposed,block_rows,store",
    [
        (torch.float32, "block", True, 32, "kernel"),
        (torch.bfloat16, "block", False, 64, "torch"),
        (torch.bfloat16, "token", True, 32, "kernel"),
        (torch.bfloat16, "block", True, 32, "torch"),
        (torch.float16, "block", False, 16, "torch"),  # tile smaller than a group: halo on both sides
        (torch.bfloat16, "block", True, 32, "triton"),
        (torch.float32, "token", True, 64, "triton"),
    ],
)
def test_interpreter_bitwise(dtype, granularity, transposed, block_rows, store):
    gen = torch.Generator().manual_seed(block_rows)
    x, cu = packed(gen, [5, 35, 1, 59, 70], 7, 2, 24, dtype, spread=6 if dtype == torch.float16 else 12)
    out = quantize(x, cu, granularity, transposed=transposed, block_rows=block_rows, transposed_store=store)
    assert_same(out, x, cu, granularity, transposed)
    if transposed:  # the pitch padding holds zeros
        full = out.codes_t.view(torch.uint8).as_strided((2, 24, 192), (24 * 192, 192, 1))
        assert (full[:, :, x.shape[0]:] == 0).all()


def test_interpreter_qkv_gqa_views_and_group_start():
    gen = torch.Generator().manual_seed(1)
    lens = [33, 2, 64, 40]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1]) + 3
    qkv = (torch.randn(T, 8, 32, generator=gen) * torch.exp2(torch.randint(-9, 9, (T, 8, 1), generator=gen).float())).bfloat16()
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]  # views with row stride 8 * D
    gs = scale_groups(cu, T).group_start
    outs = quantize_qkv(q, k, v, cu, group_start=gs, transposed=True, block_rows=32)
    for out, x in zip(outs, (q, k, v)):
        assert_same(out, x, cu, "block", True)


def test_interpreter_extremes_and_padding_only():
    # zero, tiny, huge, float32-subnormal and signed-zero groups; documents with empty segments
    x = torch.zeros(80, 1, 16)
    x[10:20] = 1e-30
    x[20:30] = -3e30
    x[30:40, 0, ::2] = 1e-40  # float32 subnormals -> e = -127
    x[40:50] = -0.0
    x[50:] = torch.randn(30, 1, 16) * 1e3
    cu = torch.tensor([0, 10, 10, 25, 50, 72], dtype=torch.int32)  # one empty document, 8 padding rows
    out = quantize(x, cu, "block", block_rows=16)
    assert_same(out, x, cu, "block", False)
    nd = quantize(x, torch.tensor([0], dtype=torch.int32), "block", block_rows=16)  # no documents
    assert_same(nd, x, torch.tensor([0], dtype=torch.int32), "block", False)


def test_interpreter_errors():
    x = torch.randn(20, 2, 8)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    with pytest.raises(FlamiaError):
        quantize_qkv(x, torch.randn(19, 2, 8), x, cu)
    with pytest.raises(FlamiaError):
        quantize_qkv(x, x.double(), x, cu)
    with pytest.raises(FlamiaError):
        quantize(x, cu, block_rows=48)
    with pytest.raises(FlamiaError):
        quantize(x, cu, transposed=True, transposed_store="packed")
    with pytest.raises(FlamiaError, match="hw_cvt"):
        quantize(x, cu, hw_cvt=True)
    with pytest.raises(FlamiaError, match="D >= 1"):  # was a ZeroDivisionError
        quantize(x[..., :0], cu)
    with pytest.raises(FlamiaError, match="torch.Tensor, got ndarray"):
        quantize(x.numpy(), cu)
    with pytest.raises(FlamiaError, match="num_warps"):
        quantize(x, cu, num_warps=3)
    y = x.clone()
    y[3, 1, 2] = float("nan")
    with pytest.raises(FlamiaError, match="NaN or Inf"):
        quantize(y, cu, block_rows=16)
    out = quantize(y, cu, block_rows=16, check_finite=False)
    assert (out.exponents[:, 1] == 255).all() and (out.exponents[:, 0] != 255).all()
    with pytest.raises(FlamiaError, match=r"quantize_qkv \(v\): input contains NaN or Inf .* index \(3, 1, 2\)"):
        quantize_qkv(x, x, y, cu)  # the tensor that holds it is named


def test_launch_helpers():
    assert _search_steps(0) == 0 and _search_steps(1) == 8 and _search_steps(255) == 8
    assert _search_steps(256) == 16 and _search_steps(131072) == 24
    for n in range(1, 300):  # enough steps for a binary search over n + 1 boundaries
        assert 2 ** _search_steps(n) >= n + 1
    for args in ((32, 128), (32, 128, True), (1, 128), (32, 64), (1, 64, True), (32, 256), (32, 128, False, True),
                 (32, 128, False, True, True), (1, 128, False, False, True), (1, 128, False, True)):
        cfg = launch_config(*args)
        assert cfg.block_rows & (cfg.block_rows - 1) == 0 and cfg.block_rows >= 16 and cfg.num_warps in (4, 8)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _poison_allocator(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with 0xFF so unwritten outputs show up."""
    blk = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    del blk


GPU_CASES = [(dt, g, tr, 128) for dt in (torch.bfloat16, torch.float32) for g in ("block", "token")
             for tr in (False, True)] + [(torch.bfloat16, "block", True, 64), (torch.float32, "token", False, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,granularity,transposed,D", GPU_CASES)
def test_gpu_bitwise_random_unaligned(dtype, granularity, transposed, D):
    gen = torch.Generator().manual_seed(D + transposed)
    lens = torch.randint(1, 700, (23,), generator=gen).tolist() + [1, 1, 2, 31, 33]
    x, cu = packed(gen, lens, 77, 3, D, dtype, spread=30)
    _poison_allocator(8 * x.numel())
    out = quantize(x.cuda(), cu.cuda(), granularity, transposed=transposed)
    torch.cuda.synchronize()
    assert_same(out, x, cu, granularity, transposed)


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows,num_warps", [(64, 4), (256, 8)])
def test_gpu_qkv_tiles_metadata_and_encoder(block_rows, num_warps):
    gen = torch.Generator().manual_seed(block_rows * num_warps)
    lens = torch.randint(1, 3000, (9,), generator=gen).tolist()
    q, cu = packed(gen, lens, 5, 8, 128, torch.bfloat16, spread=20)
    k, _ = packed(gen, lens, 5, 2, 128, torch.bfloat16, spread=20)
    v, _ = packed(gen, lens, 5, 2, 128, torch.bfloat16, spread=20)
    qd, kd, vd, cud = q.cuda(), k.cuda(), v.cuda(), cu.cuda()
    gs = scale_groups(cud, q.shape[0]).group_start
    for kwargs in ({}, {"group_start": gs}, {"hw_cvt": False}):
        _poison_allocator(16 * q.numel())
        outs = quantize_qkv(qd, kd, vd, cud, transposed=True, block_rows=block_rows, num_warps=num_warps, **kwargs)
        torch.cuda.synchronize()
        for out, x in zip(outs, (q, k, v)):
            assert_same(out, x, cu, "block", True)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_interpreter_qkv_kernel_store_of_v_only(granularity):
    """``transposed=(False, False, True), transposed_store="kernel"``: only V gets its copy, written by
    its own programs; the codes are the reference's."""
    gen = torch.Generator().manual_seed(31)
    q, cu = packed(gen, [1, 17, 30, 11], 5, 2, 16, torch.bfloat16)
    k, _ = packed(gen, [1, 17, 30, 11], 5, 1, 16, torch.bfloat16)
    v, _ = packed(gen, [1, 17, 30, 11], 5, 1, 16, torch.bfloat16)
    outs = quantize_qkv(q, k, v, cu, granularity, transposed=(False, False, True), transposed_store="kernel",
                        hw_cvt=False, block_rows=16)
    for out, x, t in zip(outs, (q, k, v), (False, False, True)):
        assert_same(out, x, cu, granularity, t)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "token"])
def test_gpu_qkv_kernel_store_of_v_only(granularity):
    """V's transposed copy written in the kernel with the integer encoder, Q and K without one (the
    hardware cvt variant is timed and checked by ``benchmarks/probes/fp8_fwd_probe.py --parts quant``)."""
    hw_cvt = False
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 2000, (13,), generator=gen).tolist() + [1, 2, 31, 33]
    q, cu = packed(gen, lens, 9, 8, 128, torch.bfloat16, spread=20)
    k, _ = packed(gen, lens, 9, 2, 128, torch.bfloat16, spread=20)
    v, _ = packed(gen, lens, 9, 2, 128, torch.bfloat16, spread=20)
    _poison_allocator(16 * q.numel())
    outs = quantize_qkv(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), granularity, transposed=(False, False, True),
                        transposed_store="kernel", hw_cvt=hw_cvt)
    torch.cuda.synchronize()
    for out, x, t in zip(outs, (q, k, v), (False, False, True)):
        assert_same(out, x, cu, granularity, t)


@pytest.mark.gpu
def test_gpu_extremes_and_many_tiny_documents():
    gen = torch.Generator().manual_seed(5)
    T = 4096
    x = torch.randn(T, 2, 128, generator=gen)
    x[100:300] = 0.0
    x[300:500] *= 1e-30
    x[500:700] *= 3e30
    x[700:900, :, ::3] = 1e-40  # float32 subnormal inputs: exposes flush-to-zero if any
    x[900:950] = -0.0
    lens = torch.randint(1, 6, (1500,), generator=gen).tolist()  # many tiny unaligned documents
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    cu = cu[cu <= T - 10]
    for granularity in ("block", "token"):
        out = quantize(x.cuda(), cu.cuda(), granularity, transposed=True)
        assert_same(out, x, cu, granularity, True)


@pytest.mark.gpu
def test_gpu_no_host_sync():
    gen = torch.Generator().manual_seed(8)
    x, cu = packed(gen, [1000, 17, 3000], 31, 4, 128, torch.bfloat16)
    xd, cud = x.cuda(), cu.cuda()
    quantize(xd, cud, check_finite=False)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = quantize(xd, cud, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_same(out, x, cu, "block", False)


def _triton_store_matches_torch(q, k, v, cu, granularity, flags, order):
    ref = quantize_qkv(q, k, v, cu, granularity, transposed=flags, wgmma_order=order, transposed_store="torch")
    got = quantize_qkv(q, k, v, cu, granularity, transposed=flags, wgmma_order=order, transposed_store="triton")
    for a, b in zip(ref, got):
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
        assert torch.equal(a.exponents, b.exponents)
        assert (a.codes_t is None) == (b.codes_t is None)
        if a.codes_t is not None:
            assert a.codes_t.shape == b.codes_t.shape and a.codes_t.stride() == b.codes_t.stride()
            # the whole pitch, the padding's zero codes included
            full = [t.view(torch.uint8).as_strided((t.shape[0], t.shape[1], t.stride(1)), (t.stride(0), t.stride(1), 1))
                    for t in (a.codes_t, b.codes_t)]
            assert torch.equal(full[0], full[1])


@pytest.mark.parametrize("flags,order", [((False, False, True), (False, False, True)),
                                         ((True, True, True), (True, False, True))])
def test_interpreter_triton_transposed_store(flags, order):
    """``transposed_store="triton"`` (what ``fp8_quantize`` / ``quantize_do`` run): the transposing launch
    (int32 words, 4 x 4 byte blocks transposed in registers) gives the torch copy's bits, token order and
    wgmma order, with T off the 16-grid, two token tiles, D not a power of two (D / 4 = 3, 6: masked
    words) and D % 4 != 0 (10: the torch copy stands in)."""
    gen = torch.Generator().manual_seed(41)
    for D, lens, pad in ((16, [1, 17, 30, 11], 5), (24, [1, 17, 30, 11], 5), (12, [40, 3, 97, 1, 2], 6),
                         (10, [5, 9], 2)):
        q, cu = packed(gen, lens, pad, 2, D, torch.bfloat16)
        k, _ = packed(gen, lens, pad, 1, D, torch.bfloat16)
        v, _ = packed(gen, lens, pad, 1, D, torch.bfloat16)
        _triton_store_matches_torch(q, k, v, cu, "block", flags, order)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("granularity", ["block", "token"])
def test_gpu_triton_transposed_store(dtype, granularity):
    """The FP8 path's quantization (hardware convert, then the transposing launch) against the torch copy,
    V only (the forward) and all three (the backward), on random unaligned documents."""
    gen = torch.Generator().manual_seed(19)
    lens = torch.randint(1, 2000, (13,), generator=gen).tolist() + [1, 2, 31, 33]
    q, cu = packed(gen, lens, 9, 8, 128, dtype, spread=20)
    k, _ = packed(gen, lens, 9, 2, 128, dtype, spread=20)
    v, _ = packed(gen, lens, 9, 2, 128, dtype, spread=20)
    _poison_allocator(16 * q.numel())
    for flags, order in (((False, False, True), (False, False, True)), ((True, True, True), (True, False, True))):
        _triton_store_matches_torch(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), granularity, flags, order)
    torch.cuda.synchronize()
