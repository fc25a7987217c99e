"""varlen_attention(precision="fp8", qk_rotation="hadamard"): exactness of the rotation, the accuracy it buys on
outlier channels, gradients through it, causal safety unchanged, errors (CPU: the FP8 emulation)."""
import pytest
import torch

from flamia_pack import FlamiaError, varlen_attention
from flamia_pack.kernels.qk_rotation import hadamard_matrix, rotate_qk, rotation_scale_factor
from flamia_pack.kernels.reference import packed_attention_reference, packed_attention_reference_bwd

OUTLIER_CHANNELS = [5, 17, 40, 99]


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _row(seed, lens=(300, 512, 200), heads=(2, 2), outliers=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((T, heads[0], 128), generator=g).bfloat16()
    k, v = (torch.randn((T, heads[1], 128), generator=g).bfloat16() for _ in range(2))
    if outliers:
        k[:, :, OUTLIER_CHANNELS] *= 20
    return q, k, v, cu, max(lens)


@pytest.mark.parametrize("D", [1, 2, 16, 64, 128, 256])
def test_rotation_matrix_is_a_scaled_orthogonal_matrix_with_exact_entries(D):
    m = hadamard_matrix(D)
    f = rotation_scale_factor(D)
    assert torch.equal(m @ m.T * f, torch.eye(D, dtype=torch.float64))  # exact: entries +-2^-s
    assert torch.equal(m, m.T) and f in (0.5, 1.0)
    assert torch.equal(m.bfloat16().double(), m)  # representable in bf16
    assert set(m.abs().unique().tolist()) == {2.0 ** -((D.bit_length() - 1) // 2)}


def test_rotated_scores_times_the_factor_are_the_scores():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn((40, 4, 128), generator=g, dtype=torch.float64), torch.randn((40, 2, 128), generator=g,
                                                                                    dtype=torch.float64)
    qr, kr = rotate_qk(q, k)
    s = torch.einsum("thd,uhd->htu", q[:, :2], k)
    sr = torch.einsum("thd,uhd->htu", qr[:, :2], kr) * rotation_scale_factor(128)
    assert torch.allclose(sr, s, rtol=0, atol=1e-12 * s.abs().max())
    assert not torch.allclose(qr, q)  # it did rotate


def test_bf16_rotation_rounds_once_from_an_exact_product():
    q, k, *_ = _row(1)
    qr, kr = rotate_qk(q, k)
    m = hadamard_matrix(128)
    assert qr.dtype == torch.bfloat16 and qr.shape == q.shape and kr.shape == k.shape
    assert torch.equal(qr, (q.double() @ m).bfloat16())  # fp32 product of bf16 x (+-2^-3) is exact here


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_rotation_improves_the_fp8_forward_on_outlier_channels_and_keeps_n01(granularity):
    """Outlier K channels (x20): 1 - cos(O, exact) falls by at least a quarter with the rotation; N(0, 1): no loss
    beyond 1e-4 (rotation of a Gaussian is a Gaussian)."""
    for outliers in (True, False):
        q, k, v, cu, m = _row(2, outliers=outliers)
        ref = packed_attention_reference(q.double(), k.double(), v.double(), cu.long(), compute_dtype=torch.float64)
        plain = _cos(varlen_attention(q, k, v, cu, m, precision="fp8", scale_granularity=granularity), ref)
        rot = _cos(varlen_attention(q, k, v, cu, m, precision="fp8", scale_granularity=granularity,
                                    qk_rotation="hadamard"), ref)
        if outliers:
            assert 1 - rot < 0.75 * (1 - plain), (plain, rot)
        else:
            assert rot > plain - 1e-4 and rot > 0.998, (plain, rot)


def test_gradients_flow_through_the_rotation():
    """The emulated FP8 backward with the rotation against exact fp64 gradients of the unrotated attention: a
    wrong chain rule (dq' instead of dq' M^T) would give cosines near 0; on outlier channels dK is closer to the
    exact gradient than without the rotation."""
    q, k, v, cu, m = _row(3, lens=(256, 384), outliers=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu.long(), return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu.long(), compute_dtype=torch.float64)
    cos = {}
    for rot in (None, "hadamard"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        varlen_attention(*leaves, cu, m, precision="fp8", qk_rotation=rot).backward(do)
        cos[rot] = [_cos(x.grad, r) for x, r in zip(leaves, ref)]
    assert min(cos["hadamard"]) > 0.98, cos
    assert cos["hadamard"][1] > cos[None][1], cos


def test_token_mode_with_rotation_reads_nothing_after_the_cut():
    """Strict mode: changing K / V at and after a cut inside a document leaves O before the cut bitwise equal, and
    another document's O bitwise equal (block mode too): the rotation mixes channels, never tokens."""
    q, k, v, cu, m = _row(4)
    cut = 300 + 137  # inside the second document
    k2, v2 = k.clone(), v.clone()
    k2[cut:512 + 300] = 50 * torch.randn_like(k2[cut:812].float()).bfloat16()
    v2[cut:812] = -v2[cut:812]
    for gran, keep in (("token", slice(0, cut)), ("block", slice(0, 300))):
        a = varlen_attention(q, k, v, cu, m, precision="fp8", scale_granularity=gran, qk_rotation="hadamard")
        b = varlen_attention(q, k2, v2, cu, m, precision="fp8", scale_granularity=gran, qk_rotation="hadamard")
        assert torch.equal(a[keep], b[keep]), gran
        assert torch.equal(a[812:], b[812:]), gran  # the third document
        assert not torch.equal(a[cut:812], b[cut:812])  # the change is seen where it may be


def test_rotation_errors_are_clear():
    q, k, v, cu, m = _row(5)
    with pytest.raises(FlamiaError, match="qk_rotation applies to precision='fp8'"):
        varlen_attention(q, k, v, cu, m, qk_rotation="hadamard")
    for bad in ("random", "Hadamard", "", True, 1):
        with pytest.raises(FlamiaError, match="qk_rotation must be None, 'none' or 'hadamard'"):
            varlen_attention(q, k, v, cu, m, precision="fp8", qk_rotation=bad)
    with pytest.raises(FlamiaError, match="too small for qk_rotation at head_dim 128"):
        varlen_attention(q, k, v, cu, m, precision="fp8", qk_rotation="hadamard", softmax_scale=2.0 ** -126)
    q64, k64, v64 = (x[..., :64].contiguous() for x in (q, k, v))  # head_dim 64: the scale is kept, so any valid one
    assert varlen_attention(q64, k64, v64, cu, m, precision="fp8", qk_rotation="hadamard", softmax_scale=1.2e-38).shape \
        == q64.shape
    big = torch.full_like(q, 3e38)  # finite bf16, but q M overflows
    with pytest.raises(FlamiaError, match="qk_rotation='hadamard' overflowed"):
        varlen_attention(big, k, v, cu, m, precision="fp8", qk_rotation="hadamard", softmax_scale=1e-37)
    q96, k96, v96 = (x[..., :96].contiguous() for x in (q, k, v))
    with pytest.raises(FlamiaError, match="head_dim"):
        varlen_attention(q96, k96, v96, cu, m, precision="fp8", qk_rotation="hadamard")
    with pytest.raises(FlamiaError, match="power-of-two head_dim"):
        hadamard_matrix(96)
    for a, b_ in ((torch.randn(4, 1, 64), torch.randn(4, 1, 128)), (torch.ones(4, 1, 64, dtype=torch.int32),) * 2,
                  (torch.randn(4, 1, 64).bfloat16(), torch.randn(4, 1, 64)), (torch.randn(4, 64),) * 2):
        with pytest.raises(FlamiaError, match="rotate_qk needs"):
            rotate_qk(a, b_)


def test_none_spelling_and_float16_inputs():
    """``"none"`` is off (the transformers options' spelling); float16 inputs whose rotated entries pass 65,504 are
    rotated into float32 (no overflow; the CPU emulation takes float32) and give the same O as float32 inputs."""
    q, k, v, cu, m = _row(7)
    assert torch.equal(varlen_attention(q, k, v, cu, m, precision="fp8", qk_rotation="none"),
                       varlen_attention(q, k, v, cu, m, precision="fp8"))
    qh, kh, vh = (x.half() for x in (q, k, v))
    qh[: 40] = 5000.0  # a constant row: its first rotated channel is 128 x 5,000 / 8 = 80,000 > 65,504
    assert not torch.isfinite((qh.float() @ hadamard_matrix(128, torch.float32)).half()).all()
    o16 = varlen_attention(qh, kh, vh, cu, m, precision="fp8", qk_rotation="hadamard", softmax_scale=1e-4)
    o32 = varlen_attention(qh.float(), kh.float(), vh.float(), cu, m, precision="fp8", qk_rotation="hadamard",
                           softmax_scale=1e-4)
    assert torch.isfinite(o16).all() and torch.equal(o16, o32)


def test_transformers_options_carry_the_rotation():
    pytest.importorskip("transformers")
    from flamia_pack.integrations.transformers import FlamiaAttentionOptions, _varlen_call_kwargs

    assert "qk_rotation" not in _varlen_call_kwargs(FlamiaAttentionOptions(precision="fp8"))
    assert _varlen_call_kwargs(FlamiaAttentionOptions(precision="fp8", qk_rotation="hadamard"))["qk_rotation"] == \
        "hadamard"
    assert "qk_rotation" not in _varlen_call_kwargs(FlamiaAttentionOptions(precision="bf16", qk_rotation="hadamard"))
    with pytest.raises(FlamiaError, match="qk_rotation must be one of"):
        FlamiaAttentionOptions(qk_rotation=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_gpu_fp8_path_with_rotation_matches_the_emulation_and_beats_no_rotation(heads):
    """The Gluon FP8 forward / backward with ``qk_rotation`` against the CPU emulation with it (same numerics up to
    the matmul's fp32 summation order and MUFU ex2: O cosine > 0.9999, gradients > 0.999), and on outlier channels
    closer to the exact fp64 attention than the GPU path without the rotation (O and dK)."""
    from flamia_pack.kernels.fp8_attention import fp8_kernels_available

    if not fp8_kernels_available("cuda"):
        pytest.skip("the FP8 kernels need sm_90 and triton's Gluon")
    q, k, v, cu, m = _row(6, lens=(700, 1, 300, 1024), heads=heads, outliers=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).bfloat16()
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_ref, lse = packed_attention_reference(qd, kd, vd, cu.long(), return_lse=True, compute_dtype=torch.float64)
    ref = packed_attention_reference_bwd(do.double(), qd, kd, vd, o_ref, lse, cu.long(), compute_dtype=torch.float64)

    def run(device, rot):
        leaves = [t.to(device).clone().requires_grad_() for t in (q, k, v)]
        o = varlen_attention(*leaves, cu.to(device), m, precision="fp8", qk_rotation=rot)
        o.backward(do.to(device))
        return [x.detach().cpu() for x in (o, *(t.grad for t in leaves))]

    gpu, cpu, plain = run("cuda", "hadamard"), run("cpu", "hadamard"), run("cuda", None)
    assert _cos(gpu[0], cpu[0]) > 0.9999
    assert min(_cos(a, b) for a, b in zip(gpu[1:], cpu[1:])) > 0.999
    assert all(torch.isfinite(x).all() for x in gpu)
    assert _cos(gpu[0], o_ref) > _cos(plain[0], o_ref)
    assert _cos(gpu[2], ref[1]) > _cos(plain[2], ref[1])


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("lens, gran", [([300, 1, 77, 130], "block"), ([64, 64], "token"), ([200], "block")])
def test_quantizer_fused_rotation_is_bitwise_the_torch_rotation(lens, gran, device):
    """``quantize_qkv(rotate_qk=True)`` (the GPU path's quantizer; on the CPU in Triton's interpreter) rotates q and k
    inside the kernel, halo rows of straddling groups included: codes (both layouts), exponents bitwise those of
    ``rotate_qk`` (CPU, fp32) then the reference quantizer; V untouched; a NaN token's group gets the non-finite
    exponent byte (255) on every path (the GPU's canonical NaN, 0x7FFFFFFF, must survive the kernel's integer
    rounding to bf16)."""
    from flamia_pack.kernels.quantize import quantize_qkv
    from flamia_pack.quant import UE8M0_NAN, quantize_token_blocks

    g = torch.Generator().manual_seed(len(lens))
    T = sum(lens) + 5  # row-end padding
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((T, 2, 128), generator=g).bfloat16()
    k, v = (torch.randn((T, 1, 128), generator=g).bfloat16() for _ in range(2))
    k[:, :, 5] *= 20
    q[lens[0] // 2, 1, 7] = float("nan")
    got = quantize_qkv(*(x.to(device) for x in (q, k, v)), cu.to(device), gran, transposed=(True, True, True),
                       wgmma_order=(False, False, False), transposed_store="triton", rotate_qk=True,
                       hw_cvt=None if device == "cuda" else False, check_finite=False)
    qr, kr = rotate_qk(q, k)
    for x, o in zip((qr, kr, v), got):
        ref = quantize_token_blocks(x, cu, gran, check_finite=False)
        ok = (ref.exponents != UE8M0_NAN)[..., None].expand(ref.codes.shape)
        assert torch.equal(o.exponents.cpu(), ref.exponents)
        assert torch.equal(o.codes.cpu().view(torch.uint8)[ok], ref.codes.view(torch.uint8)[ok])
        assert torch.equal(o.codes_t.cpu().view(torch.uint8).permute(2, 0, 1)[ok], ref.codes.view(torch.uint8)[ok])
    assert int((got[0].exponents.cpu() == UE8M0_NAN).sum()) >= 1
    with pytest.raises(FlamiaError, match="fused qk rotation takes bfloat16"):
        quantize_qkv(q.float(), k.float(), v.float(), cu, gran, rotate_qk=True)


def test_rotation_overflow_check_reads_the_documents_only():
    """Finite huge values in the row-end padding (never read) are no overflow error; in a document they are."""
    q, k, v, cu, m = _row(8, lens=(40, 24))
    q = torch.cat([q, torch.zeros_like(q[:6])])
    k, v = (torch.cat([x, torch.zeros_like(x[:6])]) for x in (k, v))
    q[66:] = 3e38
    o = varlen_attention(q, k, v, cu, m, precision="fp8", qk_rotation="hadamard")
    assert torch.isfinite(o).all() and torch.equal(o[64:], torch.zeros_like(o[64:]))
    q[10] = 3e38
    with pytest.raises(FlamiaError, match="overflowed"):
        varlen_attention(q, k, v, cu, m, precision="fp8", qk_rotation="hadamard")


def test_quantizer_with_rotation_names_the_non_finite_tensor():
    """``quantize_qkv(rotate_qk=True, check_finite=True)`` (two launches) names the tensor holding a NaN as the one-launch
    path does (``k`` here, with its token and head), once for the three."""
    from flamia_pack.kernels.quantize import quantize_qkv

    q, k, v, cu, _ = _row(12, lens=(64, 40))
    k[50, 0, 3] = float("nan")
    for rot in (False, True):
        with pytest.raises(FlamiaError, match=r"quantize_qkv \(k\).*50"):
            quantize_qkv(q, k, v, cu, "block", rotate_qk=rot, hw_cvt=False)
