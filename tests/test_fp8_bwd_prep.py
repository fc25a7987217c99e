"""Triton ``fp8_bwd_delta`` (kernels/fp8_bwd_prep.py): Delta = rowsum(dO^ * O) - dLSE of the FP8
backward, in Triton's CPU interpreter (in process, and once under ``TRITON_INTERPRET=1``) against
the fp64 formula and the torch reference; fresh random inputs, NaN-poisoned output."""
from __future__ import annotations

import json

import pytest
import torch

from flamia_pack.errors import FlamiaError
from flamia_pack.quant import quantize_token_blocks

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta, fp8_bwd_delta_reference  # noqa: E402


def make(seed, T, H, D, gran="token", spread=20, dlse=True):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-spread, spread + 1, (T, H, 1), generator=g).float())
    do = (torch.randn(T, H, D, generator=g) * mag).bfloat16()
    do[3] = 0.0  # an all-zero token: e = -127, UE8M0 byte 0 (2^-127 is an fp32 subnormal)
    cu = torch.tensor([0, T // 3, T - 2], dtype=torch.int32)  # two documents, 2 padding rows
    qd = quantize_token_blocks(do, cu, gran)
    o = torch.randn(T, H, D, generator=g).bfloat16()
    dl = torch.randn(H, T, generator=g) if dlse else None
    return qd.codes, qd.exponents, o, dl


def fp64_delta(codes, ebytes, o, dlse):
    dec = codes.double() * torch.exp2(ebytes.double() - 127)[..., None]
    d = (dec * o.double()).sum(-1).T
    return d if dlse is None else d - dlse.double()


def check_close(got, codes, ebytes, o, dlse):
    """|got - fp64| within an fp32 summation bound: D ulps of sum_d |dO^ O| plus one of |dlse|."""
    want = fp64_delta(codes, ebytes, o, dlse)
    dec = codes.double() * torch.exp2(ebytes.double() - 127)[..., None]
    mass = (dec * o.double()).abs().sum(-1).T
    tol = codes.shape[2] * 2.0 ** -23 * mass + (0 if dlse is None else 2.0 ** -23 * dlse.double().abs())
    tol = tol + 1e-37  # fp32 subnormal products of the tiniest exponents
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max err / tol {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("T,H,D,gran,dlse", [
    (130, 3, 64, "token", True),   # 3 blocks of 64 tokens, the last one 2 rows
    (64, 2, 128, "block", False),  # exactly one block
    (77, 1, 48, "token", True),    # D not a power of two: masked features
])
def test_interpreter_matches_fp64_and_torch(T, H, D, gran, dlse):
    codes, eb, o, dl = make(T + D, T, H, D, gran, dlse=dlse)
    out = torch.full((H, T), float("nan"))
    got = fp8_bwd_delta(codes, eb, o, dl, out=out)
    assert got is out and got.shape == (H, T) and got.dtype == torch.float32 and torch.isfinite(got).all()
    check_close(got, codes, eb, o, dl)
    ref = fp8_bwd_delta_reference(codes, eb, o, dl)
    check_close(ref, codes, eb, o, dl)
    fresh = fp8_bwd_delta(codes, eb, o, dl)  # own buffer, same bits
    assert torch.equal(fresh, got)
    # the hardware-cast decode path (GPU default) gives the same bits on finite codes
    assert torch.equal(fp8_bwd_delta(codes, eb, o, dl, int_decode=False), got)


def test_every_finite_code_and_nan_codes():
    """All 254 finite E4M3 codes (subnormals, signed zeros, +-448) decode exactly: one token per code
    with o = 1 on its feature; the NaN codes 0x7F / 0xFF and the UE8M0 NaN byte 255 give NaN."""
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.zeros(256, 1, 16, dtype=torch.uint8)
    codes[:, 0, 5] = byte
    codes = codes.view(torch.float8_e4m3fn)
    eb = torch.full((256, 1), 127, dtype=torch.uint8)
    eb[10] = 255
    o = torch.zeros(256, 1, 16, dtype=torch.bfloat16)
    o[:, 0, 5] = 1.0
    got = fp8_bwd_delta(codes, eb, o)[0]
    want = byte.view(torch.float8_e4m3fn).float()
    nan = (byte & 0x7F) == 0x7F
    nan[10] = True
    assert torch.isnan(got[nan]).all()
    assert torch.equal(got[~nan], want[~nan])
    # UE8M0 bytes 0 (2^-127, subnormal) .. 254 on code 1.0 (0x38)
    codes2 = torch.zeros(255, 1, 16, dtype=torch.uint8)
    codes2[:, 0, 0] = 0x38
    o2 = torch.zeros(255, 1, 16, dtype=torch.bfloat16)
    o2[:, 0, 0] = 1.0
    eb2 = torch.arange(255, dtype=torch.uint8)[:, None]
    got2 = fp8_bwd_delta(codes2.view(torch.float8_e4m3fn), eb2, o2)[0]
    assert torch.equal(got2.double(), torch.exp2(torch.arange(255).double() - 127))


def test_strided_views():
    codes, eb, o, dl = make(5, 70, 4, 64)
    big_c = torch.zeros(70, 8, 64, dtype=torch.uint8)
    big_c[:, 1::2] = codes.view(torch.uint8)
    big_o = torch.zeros(70, 8, 64, dtype=torch.bfloat16)
    big_o[:, ::2] = o
    big_e = torch.zeros(70, 8, dtype=torch.uint8)
    big_e[:, 4:] = eb
    big_l = torch.zeros(4, 2 * 70)
    big_l[:, ::2] = dl
    got = fp8_bwd_delta(big_c[:, 1::2].view(torch.float8_e4m3fn), big_e[:, 4:], big_o[:, ::2], big_l[:, ::2])
    assert torch.equal(got, fp8_bwd_delta(codes, eb, o, dl))


def test_errors():
    codes, eb, o, dl = make(0, 20, 2, 64)
    with pytest.raises(FlamiaError, match="do_codes"):
        fp8_bwd_delta(codes.view(torch.uint8), eb, o)
    with pytest.raises(FlamiaError, match="do_exponents"):
        fp8_bwd_delta(codes, eb[:, :1], o)
    with pytest.raises(FlamiaError, match="o must be"):
        fp8_bwd_delta(codes, eb, o.float())
    with pytest.raises(FlamiaError, match="dlse"):
        fp8_bwd_delta(codes, eb, o, dl.T.contiguous())
    with pytest.raises(FlamiaError, match="out must be"):
        fp8_bwd_delta(codes, eb, o, out=torch.empty(20, 2))
    assert fp8_bwd_delta(codes[:0], eb[:0], o[:0]).shape == (2, 0)


_SCRIPT = r"""
import json, os, torch
assert os.environ["TRITON_INTERPRET"] == "1"
from flamia_pack.kernels.fp8_bwd_prep import fp8_bwd_delta, fp8_bwd_delta_reference
from flamia_pack.quant import quantize_token_blocks
g = torch.Generator().manual_seed(11)
T, H, D = 150, 2, 128
do = torch.randn(T, H, D, generator=g).bfloat16()
qd = quantize_token_blocks(do, torch.tensor([0, 100, 150], dtype=torch.int32), "block")
o = torch.randn(T, H, D, generator=g).bfloat16()
dl = torch.randn(H, T, generator=g)
out = torch.full((H, T), float("nan"))
got = fp8_bwd_delta(qd.codes, qd.exponents, o, dl, out=out)
want = (qd.codes.double() * torch.exp2(qd.exponents.double() - 127)[..., None] * o.double()).sum(-1).T - dl.double()
ref = fp8_bwd_delta_reference(qd.codes, qd.exponents, o, dl)
print("RESULTS " + json.dumps(dict(finite=bool(torch.isfinite(got).all()),
                                   err=float((got.double() - want).abs().max()),
                                   ref_err=float((ref.double() - want).abs().max()),
                                   scale=float(want.abs().max()))))
"""


def test_under_triton_interpret(run_interpreter):
    r = run_interpreter(_SCRIPT)
    print(f"\nTRITON_INTERPRET=1: {json.dumps(r)}")
    assert r["finite"] and r["err"] <= 128 * 2.0 ** -23 * r["scale"] and r["ref_err"] <= 128 * 2.0 ** -23 * r["scale"]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,D,dlse", [(65536 + 37, 8, 128, True), (1000, 3, 64, False), (200, 2, 48, True)])
def test_gpu_matches_fp64_and_both_decoders(T, H, D, dlse):
    codes, eb, o, dl = make(T + H + D, T, H, D, "block", dlse=dlse)
    dev = [x.cuda() if x is not None else None for x in (codes, eb, o, dl)]
    out = torch.full((H, T), float("nan"), device="cuda")
    got = fp8_bwd_delta(*dev, out=out)
    torch.cuda.synchronize()
    assert got is out and torch.isfinite(got).all()
    check_close(got.cpu(), codes, eb, o, dl)
    assert torch.equal(fp8_bwd_delta(*dev, int_decode=True), got)
    check_close(fp8_bwd_delta_reference(*dev).cpu(), codes, eb, o, dl)


@pytest.mark.gpu
def test_gpu_every_code_and_no_host_sync():
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.zeros(256, 1, 16, dtype=torch.uint8)
    codes[:, 0, 5] = byte
    o = torch.zeros(256, 1, 16, dtype=torch.bfloat16)
    o[:, 0, 5] = 1.0
    args = (codes.view(torch.float8_e4m3fn).cuda(), torch.full((256, 1), 127, dtype=torch.uint8).cuda(), o.cuda())
    want = byte.view(torch.float8_e4m3fn).float()
    nan = (byte & 0x7F) == 0x7F
    for intd in (False, True):
        got = fp8_bwd_delta(*args, int_decode=intd)[0].cpu()
        assert torch.isnan(got[nan]).all() and torch.equal(got[~nan], want[~nan])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_bwd_delta(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
