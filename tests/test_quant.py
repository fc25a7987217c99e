"""Token-block FP8 scales (flamia_pack.quant, DESIGN.md §4): metadata, exponent rule, codes,
document locality, round trip, comparison schemes. CPU; a few GPU checks are marked ``gpu``."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.quant import (
    E4M3_MAX,
    dequantize,
    dequantize_blocks_2d,
    dequantize_mx_features,
    e4m3_rne_bits,
    exponent_from_amax_bits,
    quantize_blocks_2d,
    quantize_mx_features,
    quantize_per_tensor,
    quantize_token_blocks,
    scale_groups,
)

# ---------------------------------------------------------------------------------------------
# helpers: plain-python references
# ---------------------------------------------------------------------------------------------


def py_groups(cu: list[int], T: int, g: int) -> tuple[list[int], list[int]]:
    """(group_id, group_start) per token by walking the documents in python."""
    gid = [-1] * T
    gst = list(range(T))
    n = 0
    for s, e in zip(cu[:-1], cu[1:]):
        for j in range(s, e, g):
            for t in range(j, min(j + g, e)):
                gid[t] = n
                gst[t] = j
            n += 1
    return gid, gst


def cu_from_lens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)


def exp_of(ebyte: torch.Tensor) -> torch.Tensor:
    return ebyte.to(torch.int64) - 127


def codes_u8(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


def random_packed(gen: torch.Generator, lens: list[int], pad: int, H: int, D: int, dtype=torch.float32):
    cu = cu_from_lens(lens)
    T = int(cu[-1]) + pad
    # per-token magnitudes over many binades, so groups have very different exponents
    mag = torch.exp2(torch.randint(-20, 21, (T, H, 1), generator=gen).float())
    x = (torch.randn(T, H, D, generator=gen) * mag).to(dtype)
    return x, cu


lens_st = st.lists(st.integers(min_value=0, max_value=80), min_size=1, max_size=7)


# ---------------------------------------------------------------------------------------------
# scale-group metadata
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(lens=lens_st, pad=st.integers(0, 40), granularity=st.sampled_from(["block", "token"]),
       numpy_input=st.booleans())
def test_scale_groups_match_python(lens, pad, granularity, numpy_input):
    cu = cu_from_lens(lens)
    T = int(cu[-1]) + pad
    g = 32 if granularity == "block" else 1
    arg = cu.numpy() if numpy_input else cu.long()
    sg = scale_groups(arg, T, granularity)
    gid, gst = py_groups(cu.tolist(), T, g)
    assert sg.group_id.dtype == torch.int32 and sg.group_start.dtype == torch.int32
    assert sg.group_id.tolist() == gid
    assert sg.group_start.tolist() == gst


def test_scale_groups_never_span_documents():
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 200, (40,), generator=gen).tolist()
    cu = cu_from_lens(lens)
    T = int(cu[-1]) + 13
    sg = scale_groups(cu, T, "block")
    doc = torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1
    for gid in torch.unique(sg.group_id[sg.group_id >= 0]).tolist():
        toks = torch.nonzero(sg.group_id == gid).flatten()
        assert len(toks) <= 32
        assert (toks[1:] - toks[:-1] == 1).all()  # consecutive
        assert len(set(doc[toks].tolist())) == 1  # one document
        d = int(doc[toks[0]])
        assert (int(toks[0]) - int(cu[d])) % 32 == 0  # starts at doc_start + 32j
        assert (sg.group_start[toks] == toks[0]).all()
    # padding: own singleton groups with id -1
    assert (sg.group_id[int(cu[-1]):] == -1).all()
    assert sg.group_start[int(cu[-1]):].tolist() == list(range(int(cu[-1]), T))


def test_scale_groups_errors():
    with pytest.raises(MetadataError):
        scale_groups(torch.tensor([0, 5, 3], dtype=torch.int32), 10)
    with pytest.raises(MetadataError):
        scale_groups(torch.tensor([1, 5], dtype=torch.int32), 10)
    with pytest.raises(MetadataError):
        scale_groups(torch.tensor([0, 12], dtype=torch.int32), 10)  # past T
    with pytest.raises(MetadataError):
        scale_groups(torch.tensor([0.0, 5.0]), 10)
    with pytest.raises(FlamiaError):
        scale_groups(torch.tensor([0, 5], dtype=torch.int32), 10, "tile")


# ---------------------------------------------------------------------------------------------
# exponent rule
# ---------------------------------------------------------------------------------------------


def _e_of(v: float) -> int:
    bits = torch.tensor([v], dtype=torch.float32).view(torch.int32) & 0x7FFFFFFF
    e, eb = exponent_from_amax_bits(bits)
    assert int(eb) == int(e) + 127
    return int(e)


@pytest.mark.parametrize("k", [-100, -30, -9, -1, 0, 1, 7, 60, 119])
def test_exponent_exact_at_powers_of_two(k):
    edge = 448.0 * 2.0**k  # exactly representable
    assert _e_of(edge) == k  # fits exactly at e = k
    up = float(np.nextafter(np.float32(edge), np.float32(np.inf)))
    assert _e_of(up) == k + 1  # one ulp more must round the exponent up
    down = float(np.nextafter(np.float32(edge), np.float32(0)))
    assert _e_of(down) == k
    assert _e_of(2.0**k) == k - 8  # 2**k / 2**(k-8) = 256 <= 448 < 512


def test_exponent_matches_float64_ceil_log2():
    gen = torch.Generator().manual_seed(0)
    v = torch.exp2(torch.rand(20000, generator=gen, dtype=torch.float64) * 240 - 115).float()
    bits = v.view(torch.int32) & 0x7FFFFFFF
    e, _ = exponent_from_amax_bits(bits)
    want = torch.ceil(torch.log2(v.double() / 448.0)).long().clamp(-127, 127)
    # float64 log2 is trustworthy away from the boundaries; check boundaries exactly instead
    vd = v.double()
    e64 = e.long()
    assert (vd <= 448.0 * torch.exp2(e64.double())).all()
    assert (vd > 448.0 * torch.exp2(e64.double() - 1)).all()
    assert (e64 == want).float().mean() > 0.999


def test_exponent_special_values():
    assert _e_of(0.0) == -127  # all-zero group: the smallest exponent (never wins a maximum)
    assert _e_of(1e-30) == math.ceil(math.log2(1e-30 / 448))
    assert _e_of(1e30) == math.ceil(math.log2(1e30 / 448))
    assert _e_of(1e-40) == -127  # float32 subnormal amax: clamped
    assert _e_of(float(np.finfo(np.float32).max)) == 120
    for bad in (float("inf"), float("nan")):
        bits = torch.tensor([bad]).view(torch.int32) & 0x7FFFFFFF
        e, eb = exponent_from_amax_bits(bits)
        assert int(eb) == 255 and int(e) == 0


# ---------------------------------------------------------------------------------------------
# token-block quantizer
# ---------------------------------------------------------------------------------------------


def _group_amax64(x: torch.Tensor, cu: torch.Tensor, g: int) -> torch.Tensor:
    """float64 amax per token's group and head, by python loops over documents (T, H)."""
    T, H, _ = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    xa = x.double().abs()
    c = cu.tolist()
    for s, e in zip(c[:-1], c[1:]):
        for j in range(s, e, g):
            j1 = min(j + g, e)
            out[j:j1] = xa[j:j1].amax(dim=(0, 2))
    out[c[-1]:] = xa[c[-1]:].amax(dim=2)
    return out


@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exponent_rule_and_no_saturation(granularity, dtype):
    gen = torch.Generator().manual_seed(7)
    x, cu = random_packed(gen, [45, 1, 70, 32, 9], 11, 3, 24, dtype)
    qz = quantize_token_blocks(x, cu, granularity)
    assert qz.codes.dtype == torch.float8_e4m3fn and qz.codes.shape == x.shape
    assert qz.exponents.dtype == torch.uint8 and qz.exponents.shape == x.shape[:2]
    c = qz.codes.float()
    assert torch.isfinite(c).all() and (c.abs() <= E4M3_MAX).all()
    amax = _group_amax64(x, cu, 32 if granularity == "block" else 1)
    e = exp_of(qz.exponents).double()
    nz = amax > 0
    assert (amax <= E4M3_MAX * torch.exp2(e)).all()  # fits
    # the next smaller exponent would saturate at least one element of every non-zero group
    assert (amax[nz] > E4M3_MAX * torch.exp2(e[nz] - 1)).all()
    assert (e[~nz] == 0).all()
    # codes are RNE(x * 2**-e): compare with float64 scaling + torch's cast
    want = (x.double() * torch.exp2(-e)[..., None]).float().to(torch.float8_e4m3fn)
    assert torch.equal(codes_u8(qz.codes), codes_u8(want))


def test_zero_tiny_huge_groups():
    D = 16
    x = torch.zeros(96, 1, D)
    gen = torch.Generator().manual_seed(1)
    x[32:64] = torch.randn(32, 1, D, generator=gen) * 1e-30
    x[64:96] = torch.randn(32, 1, D, generator=gen) * 1e30
    cu = torch.tensor([0, 96], dtype=torch.int32)
    qz = quantize_token_blocks(x, cu)
    e = exp_of(qz.exponents)[:, 0]
    assert (e[:32] == -127).all() and (codes_u8(qz.codes[:32]) == 0).all()  # all-zero: the smallest exponent
    for lo, hi in ((32, 64), (64, 96)):
        amax = x[lo:hi].abs().max().item()
        assert (e[lo:hi] == math.ceil(math.log2(amax / 448.0))).all()
        xh = dequantize(qz.codes[lo:hi], qz.exponents[lo:hi])
        normal = x[lo:hi].abs() * 2.0 ** (-e[lo].item()) >= 2.0**-6
        rel = ((xh - x[lo:hi]).abs() / x[lo:hi].abs())[normal]
        assert rel.max() <= 2.0**-4


def test_subnormal_boundary_cases():
    """E4M3 subnormals: codes k * 2**-9 (k = 1..7); ties go to even (seed 001 §4)."""
    amax = 448.0  # e = 0, scale 1
    vals = [
        (2.0**-9, 1), (2.0**-10, 0), (-(2.0**-10), 0x80), (1.5 * 2.0**-10, 1),
        (3 * 2.0**-10, 2), (5 * 2.0**-10, 2), (7 * 2.0**-10, 4), (15 * 2.0**-10, 8),
        (7 * 2.0**-9, 7), (2.0**-6, 8), (2.0**-11, 0),
        (float(np.nextafter(np.float32(2.0**-10), np.float32(1))), 1),
    ]
    x = torch.tensor([[amax] + [v for v, _ in vals]], dtype=torch.float32)[:, None, :]  # (1, 1, n)
    qz = quantize_token_blocks(x, torch.tensor([0, 1], dtype=torch.int32))
    assert int(qz.exponents) == 127
    got = codes_u8(qz.codes)[0, 0, 1:].tolist()
    assert got == [c for _, c in vals]
    # the same values after a scale change: a group whose exponent grows by one halves the
    # lattice, and at the subnormal boundary the reconstruction changes (seed 001 §4)
    x2 = x.clone()
    x2[0, 0, 0] = 449.0  # e = 1
    q2 = quantize_token_blocks(x2, torch.tensor([0, 1], dtype=torch.int32))
    assert int(q2.exponents) == 128
    r1 = dequantize(qz.codes, qz.exponents)[0, 0, 1]  # 2**-9 exactly
    r2 = dequantize(q2.codes, q2.exponents)[0, 0, 1]  # 2**-9 / 2 = 2**-10: tie -> 0
    assert r1.item() == 2.0**-9 and r2.item() == 0.0


def test_e4m3_integer_encoder_matches_torch_cast():
    allf = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    allf = allf[torch.isfinite(allf)].unique().sort().values
    mids = (allf[1:] + allf[:-1]) / 2
    up = torch.from_numpy(np.nextafter(mids.numpy(), np.float32(np.inf)))
    dn = torch.from_numpy(np.nextafter(mids.numpy(), np.float32(-np.inf)))
    gen = torch.Generator().manual_seed(2)
    rnd = torch.cat([torch.randn(50000, generator=gen) * s for s in (1e-4, 1e-2, 1, 100)]).clamp(-448, 448)
    y = torch.cat([allf, mids, up, dn, rnd, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 448.0, -448.0])])
    y = torch.cat([y, -y])
    assert torch.equal(e4m3_rne_bits(y), y.to(torch.float8_e4m3fn).view(torch.uint8))


def test_non_finite_raises_or_flags():
    x = torch.randn(70, 2, 8)
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[45, 1, 3] = bad
        with pytest.raises(FlamiaError, match="NaN or Inf"):
            quantize_token_blocks(y, cu)
        qz = quantize_token_blocks(y, cu, check_finite=False)
        # only the affected (group, head) carries the NaN exponent 255
        flagged = (qz.exponents == 255).nonzero().tolist()
        assert flagged == [[t, 1] for t in range(40, 70)]
        assert torch.isnan(dequantize(qz.codes, qz.exponents)[40:70, 1]).all()
        ref = quantize_token_blocks(x, cu)
        assert torch.equal(qz.exponents[:40], ref.exponents[:40])
    with pytest.raises(FlamiaError, match="NaN or Inf"):
        quantize_per_tensor(torch.tensor([1.0, float("nan")]))


def test_bad_inputs():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(FlamiaError):
        quantize_token_blocks(torch.randn(4, 8), cu)
    with pytest.raises(FlamiaError):
        quantize_token_blocks(torch.randn(4, 1, 8, dtype=torch.float64), cu)
    with pytest.raises(FlamiaError):
        quantize_token_blocks(torch.randint(0, 3, (4, 1, 8)), cu)
    with pytest.raises(MetadataError):
        quantize_token_blocks(torch.randn(3, 1, 8), cu)
    with pytest.raises(FlamiaError):
        dequantize(torch.zeros(3, 2, dtype=torch.float8_e4m3fn), torch.zeros(2, dtype=torch.uint8))


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        # each was an IndexError / ZeroDivisionError / AttributeError / RuntimeError before
        (lambda x, cu: quantize_token_blocks(x[..., :0], cu), FlamiaError, "D >= 1"),
        (lambda x, cu: quantize_token_blocks(x.numpy(), cu), FlamiaError, "torch.Tensor, got ndarray"),
        (lambda x, cu: quantize_token_blocks(x, None), MetadataError, "int32/int64"),
        (lambda x, cu: quantize_token_blocks(x, [0.0, 4.0]), MetadataError, "int32/int64"),
        (lambda x, cu: dequantize(None, torch.zeros(4, 1, dtype=torch.uint8)), FlamiaError, "codes must be a torch.Tensor"),
        (lambda x, cu: quantize_mx_features(x, 0), FlamiaError, "block must be an int >= 1"),
        (lambda x, cu: quantize_mx_features(x, -1), FlamiaError, "block must be an int >= 1"),
        (lambda x, cu: quantize_mx_features(x[..., :0]), FlamiaError, "D >= 1"),
        (lambda x, cu: dequantize_mx_features(*quantize_mx_features(x, 32), block=16), FlamiaError, "must have shape"),
        (lambda x, cu: dequantize_mx_features(*quantize_mx_features(x, 32), block=0), FlamiaError, "block"),
        (lambda x, cu: quantize_blocks_2d(x, 0), FlamiaError, "block must be an int >= 1"),
        (lambda x, cu: dequantize_blocks_2d(*quantize_blocks_2d(x, 32), block=8), FlamiaError, "must have shape"),
        (lambda x, cu: dequantize_blocks_2d(quantize_blocks_2d(x, 32).codes, None), FlamiaError, "exponents must be"),
    ],
)
def test_bad_inputs_raise_flamia_errors_with_reason(call, exc, msg):
    x = torch.randn(4, 1, 40)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(exc, match=msg):
        call(x, cu)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=2, max_size=6), pad=st.integers(0, 9),
       which=st.integers(0, 5), seed=st.integers(0, 2**31 - 1),
       granularity=st.sampled_from(["block", "token"]), log_factor=st.integers(-30, 30))
def test_document_locality(lens, pad, which, seed, granularity, log_factor):
    """Perturbing any document never changes codes or exponents of another (DESIGN.md §4)."""
    gen = torch.Generator().manual_seed(seed)
    x, cu = random_packed(gen, lens, pad, 2, 8, torch.bfloat16)
    d = which % len(lens)
    s, e = int(cu[d]), int(cu[d + 1])
    y = x.clone()
    y[s:e] = (y[s:e].float() * 2.0**log_factor + torch.randn(e - s, 2, 8, generator=gen) * 3).to(torch.bfloat16)
    a = quantize_token_blocks(x, cu, granularity)
    b = quantize_token_blocks(y, cu, granularity)
    outside = torch.ones(x.shape[0], dtype=torch.bool)
    outside[s:e] = False
    assert torch.equal(codes_u8(a.codes)[outside], codes_u8(b.codes)[outside])
    assert torch.equal(a.exponents[outside], b.exponents[outside])


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1),
       pick=st.integers(0, 10_000))
def test_token_granularity_is_per_token(lens, seed, pick):
    gen = torch.Generator().manual_seed(seed)
    x, cu = random_packed(gen, lens, 3, 2, 8, torch.float32)
    i = pick % x.shape[0]
    y = x.clone()
    y[i] = y[i] * 1e6 + 1.0
    a = quantize_token_blocks(x, cu, "token")
    b = quantize_token_blocks(y, cu, "token")
    other = torch.arange(x.shape[0]) != i
    assert torch.equal(codes_u8(a.codes)[other], codes_u8(b.codes)[other])
    assert torch.equal(a.exponents[other], b.exponents[other])
    assert not torch.equal(a.exponents[i], b.exponents[i])


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_round_trip_relative_error(granularity):
    gen = torch.Generator().manual_seed(5)
    x, cu = random_packed(gen, [100, 37, 64, 3], 6, 4, 32, torch.float32)
    # moderate spread inside a group (2**-2..2**2 per token), wide spread across documents
    x = x / x.abs().amax(dim=2, keepdim=True) * torch.exp2(torch.randint(-2, 3, (x.shape[0], 4, 1), generator=gen).float())
    for d, s in enumerate(torch.randint(-40, 41, (4,), generator=gen).tolist()):
        x[int(cu[d]):int(cu[d + 1])] *= 2.0**s
    qz = quantize_token_blocks(x, cu, granularity)
    xh = dequantize(*qz)
    assert xh.dtype == torch.float32
    scaled = x.abs() * torch.exp2(-exp_of(qz.exponents).float())[..., None]
    normal = scaled >= 2.0**-6  # E4M3 normal range
    assert normal.float().mean() > 0.5
    rel = (xh - x).abs() / x.abs()
    assert rel[normal].max() <= 2.0**-4
    # below the normal range the absolute error is at most half a subnormal step
    step = torch.exp2(exp_of(qz.exponents).double() - 9)[..., None].expand_as(x)
    assert ((xh - x).abs().double() <= step / 2)[~normal].all()


def test_dequantize_is_exact():
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (50, 3, 8), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # drop NaN codes
    codes = codes.view(torch.float8_e4m3fn)
    exps = torch.randint(0, 255, (50, 3), generator=gen, dtype=torch.uint8)
    got = dequantize(codes, exps).double()
    want = codes.double() * torch.exp2(exps.double() - 127)[..., None]
    # float32 cannot hold everything float64 can: compare where want is in float32 normal range
    ok = (want.abs() < 3e38) & ((want.abs() > 1.2e-38) | (want == 0))
    assert torch.equal(got[ok], want[ok])


# ---------------------------------------------------------------------------------------------
# comparison schemes
# ---------------------------------------------------------------------------------------------


def _check_block(xblock: torch.Tensor, ebyte: int, codes: torch.Tensor) -> None:
    amax = xblock.double().abs().max().item()
    e = ebyte - 127
    if amax == 0:
        assert e == -127  # the smallest: an all-zero block never wins a maximum of exponents
    else:
        assert amax <= 448 * 2.0**e and amax > 448 * 2.0 ** (e - 1)
    want = (xblock.double() * 2.0**-e).float().to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))


def test_per_tensor():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, 3, 7, generator=gen) * 1000
    qz = quantize_per_tensor(x)
    assert qz.exponents.shape == ()
    _check_block(x, int(qz.exponents), qz.codes)
    assert (((dequantize(*qz) - x).abs() / x.abs())[x.abs() > x.abs().max() / 2**14] <= 2**-4).all()


@pytest.mark.parametrize("D", [32, 64, 40])
def test_mx_features(D):
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(9, 2, D, generator=gen) * torch.exp2(torch.randint(-8, 8, (9, 2, D), generator=gen).float())
    qz = quantize_mx_features(x, 32)
    nb = -(-D // 32)
    assert qz.exponents.shape == (9, 2, nb)
    for t in range(9):
        for h in range(2):
            for b in range(nb):
                sl = slice(32 * b, min(32 * b + 32, D))
                _check_block(x[t, h, sl], int(qz.exponents[t, h, b]), qz.codes[t, h, sl])
    xh = dequantize_mx_features(*qz, block=32)
    assert xh.shape == x.shape


@pytest.mark.parametrize("M,N", [(64, 64), (70, 33), (5, 100)])
def test_blocks_2d(M, N):
    gen = torch.Generator().manual_seed(M * N)
    x = torch.randn(2, M, N, generator=gen) * torch.exp2(torch.randint(-10, 10, (2, M, N), generator=gen).float())
    qz = quantize_blocks_2d(x, 32)
    mb, nb = -(-M // 32), -(-N // 32)
    assert qz.exponents.shape == (2, mb, nb)
    for b in range(2):
        for i in range(mb):
            for j in range(nb):
                sl = (b, slice(32 * i, 32 * i + 32), slice(32 * j, 32 * j + 32))
                _check_block(x[sl], int(qz.exponents[b, i, j]), qz.codes[sl])
    xh = dequantize_blocks_2d(*qz, block=32)
    # dS reuse (DESIGN.md §4): the transposed tile quantizes to the transposed payload
    qt = quantize_blocks_2d(x.transpose(-1, -2).contiguous(), 32)
    assert torch.equal(qt.codes.view(torch.uint8), qz.codes.transpose(-1, -2).view(torch.uint8))
    assert torch.equal(qt.exponents, qz.exponents.transpose(-1, -2))
    assert xh.shape == x.shape


# ---------------------------------------------------------------------------------------------
# GPU: same numbers on the device, and no host sync in the metadata path
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_reference_on_gpu_matches_cpu_and_does_not_sync():
    gen = torch.Generator().manual_seed(9)
    x, cu = random_packed(gen, [300, 17, 1, 250, 64], 19, 4, 64, torch.bfloat16)
    ref = quantize_token_blocks(x, cu)
    xd, cud = x.cuda(), cu.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sg = scale_groups(cud, x.shape[0], "block")
        got = quantize_token_blocks(xd, cud, group_start=sg.group_start, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.codes.cpu().view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(got.exponents.cpu(), ref.exponents)


def test_nan_error_names_token_and_head():
    x = torch.randn(256, 2, 64)
    x[5, 1, 3] = float("nan")
    with pytest.raises(FlamiaError, match=r"first non-finite element at index \(5, 1, 3\)"):
        quantize_token_blocks(x, torch.tensor([0, 100, 256], dtype=torch.int32))
