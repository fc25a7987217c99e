"""GPU tests of the Triton packed-attention kernels (issue 5), skipped without CUDA.

Rule (``flamia_pack.kernels.check``): O, dQ, dK, dV within 2x the error of the same computation
done by torch in bf16, + atol, against the fp32 reference; fresh N(0, 1) inputs; every output
allocated during the call starts as NaN. Shapes: WORKLOADS.md's W rows scaled down to T = 8192,
S1 (one-token documents), S3-style random rows, GQA/MHA, causal/non-causal, D = 64 and 128.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flamia_pack.kernels import varlen_attention
from flamia_pack.kernels.attention import build_attention_work_list
from flamia_pack.kernels.check import compare_with_reference, random_lengths
from flamia_pack.kernels.config import AttentionKernelConfig, TritonFwdConfig
from flamia_pack.scheduler.workloads import lognormal_lengths

pytestmark = pytest.mark.gpu

# WORKLOADS.md rows scaled from T = 65,536 to T = 8,192 (same shapes of mix)
_W_SMALL = {
    "W1": [2048] * 4,
    "W2": [2048] + [256] * 24,
    "W3": [1024] * 8,
    "W4": [8192],
    "W5": [4096] * 2,
    "W6": [int(x) for x in lognormal_lengths(6.5, 1.0, 8192, 0)],
    "W7": [256] * 32,
    "W8": [4096] * 2,
    "W9": [4096] + [512] * 8,
}


def _assert_ok(r, what):
    assert r["ok"], f"{what}: {r}"


@pytest.mark.parametrize("name", sorted(_W_SMALL))
def test_workloads_scaled_down_d128_causal(name):
    hkv = 2 if name == "W5" else 8
    r = compare_with_reference(_W_SMALL[name], num_heads=8, num_kv_heads=hkv, head_dim=128, causal=True,
                               device="cuda", seed=hash(name) % 1000)
    _assert_ok(r, name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 2)])
def test_mha_gqa_causal_noncausal_unaligned(causal, d, h, hkv):
    lengths = [1000, 1, 3, 517, 129, 128, 127, 2049, 64]
    r = compare_with_reference(lengths, num_heads=h, num_kv_heads=hkv, head_dim=d, causal=causal, pad=37,
                               device="cuda", seed=d + h + hkv + causal, with_lse_grad=True)
    _assert_ok(r, f"h={h}/{hkv} d={d} causal={causal}")


@pytest.mark.parametrize("prebuilt", [False, True])
@pytest.mark.parametrize("lengths,pad", [([600, 1300, 700, 2051], 13), ([513] * 5 + [1500], 0), ([129, 4000, 640], 7)])
def test_rows_without_short_documents_skip_the_leftover_launches(lengths, pad, prebuilt):
    """Rows whose shortest document leaves nothing to the Triton launches behind the Gluon forward /
    backward (``attention.leftover_bits``: the forward's for every row here, the backward's for the
    first two) skip those launches; results vs the fp32 reference, outputs NaN-poisoned, with the
    hint from the call's own cu_seqlens check and from a prebuilt (validated) work list. Every row's
    longest document is > 1,024 tokens, so the GQA call runs the Gluon kernels (default config)."""
    r = compare_with_reference(lengths, num_heads=8, num_kv_heads=2, head_dim=128, causal=True, pad=pad,
                               device="cuda", seed=len(lengths) + pad, with_lse_grad=True,
                               prebuilt_work_list=prebuilt)
    _assert_ok(r, f"{lengths} prebuilt={prebuilt}")


@pytest.mark.parametrize("row", range(6))
def test_s3_random_rows(row):
    rng = np.random.default_rng(100 + row)
    T = 8192
    lengths = random_lengths(rng, T - int(rng.integers(0, 200)), 4000)
    pad = T - sum(lengths)
    d = 64 if row % 2 else 128
    hkv = 2 if row % 3 == 0 else 4
    r = compare_with_reference(lengths, num_heads=4, num_kv_heads=hkv, head_dim=d, causal=row % 4 != 3, pad=pad,
                               device="cuda", seed=row)
    _assert_ok(r, f"row {row}: {len(lengths)} docs")


def test_mqa_and_persistent_schedule():
    lengths = [int(x) for x in lognormal_lengths(6.5, 1.0, 8192, 3)]
    cfg = AttentionKernelConfig(fwd=TritonFwdConfig(schedule="persistent"), gluon_fwd=None)
    r = compare_with_reference(lengths, num_heads=4, num_kv_heads=1, head_dim=128, causal=True, device="cuda",
                               config=cfg, seed=5)
    _assert_ok(r, "persistent, MQA")


def test_s1_one_token_documents_attend_only_to_themselves():
    T, H, D = 131072, 4, 128
    cu = torch.arange(T + 1, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((T, H, D), device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn((T, H, D), device="cuda", generator=g, dtype=torch.bfloat16)
    o = varlen_attention(q, k, v, cu, 1)
    o.backward(do)
    assert torch.equal(o, v.detach()), "a one-token document's output must be its own value row"
    assert torch.equal(v.grad, do), "dV of a one-token document is its own dO"
    assert q.grad.abs().max().item() < 1e-2 and k.grad.abs().max().item() < 1e-2  # exactly 0 up to rounding
    wl = build_attention_work_list(cu, T, head_dim=D)
    assert int(wl.num_items.item()) == T // 128, "merged items: one per 128 one-token documents"


def test_deterministic_bitwise():
    lengths = [3000, 17, 900, 4275]
    T = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((T, 8, 128), device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn((T, 2, 128), device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn((T, 2, 128), device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn((T, 8, 128), device="cuda", generator=g, dtype=torch.bfloat16)
    outs = []
    for _ in range(2):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = varlen_attention(*xs, cu, max(lengths), deterministic=True)
        o.backward(do)
        outs.append([o.detach()] + [x.grad for x in xs])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lengths", [[3000, 17, 900, 4275], [256] * 32, [700] * 9])
def test_eager_function_path_equals_the_custom_op(lengths):
    """Eager calls launch the kernels through ``_VarlenAttnFn`` (no custom-op dispatch, 2026-11-30
    (fourth)); the custom op (torch.compile's path) must give the same O, LSE and gradients bit for bit
    (deterministic backward; rows of the three kernel bands)."""
    from flamia_pack.kernels import attention as A
    from flamia_pack.kernels.config import kernel_config

    T = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    q, k, v, do = (torch.randn((T, 8, 128), device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    dlse = torch.randn((8, T), device="cuda", generator=g)
    base = kernel_config(128, True, max_seqlen=max(lengths))
    cfg = base if base.gluon_bwd is None else dataclasses.replace(
        base, gluon_bwd=dataclasses.replace(base.gluon_bwd, dq_reduce=False))
    wl = build_attention_work_list(cu, T, causal=True, head_dim=128, config=cfg)
    ints = A._op_config_ints(cfg, A.LEFTOVER_FWD | A.LEFTOVER_BWD | A.PAD_TAIL)
    outs = []
    for via in (A._VarlenAttnFn.apply, torch.ops.flamia_pack.varlen_attn_fwd):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = via(*xs, cu, wl.items, wl.num_items, True, 128 ** -0.5, ints)
        torch.autograd.backward([o, lse], [do, dlse])
        outs.append([o.detach(), lse.detach()] + [x.grad for x in xs])
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_capture_and_compile(deterministic):
    """A captured training step replays on new inputs and matches eager: bitwise with
    ``deterministic=True``; with the default (dQ by fp32 TMA bulk reduces, whose order varies run to
    run) O, dK, dV bitwise and dQ within one bf16 rounding of the largest |dQ| (stale inputs would
    miss by O(1))."""
    lengths = [1500, 2, 700, 1890]
    T = 4200  # 108 padding tokens
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    wl = build_attention_work_list(cu, T, head_dim=128)
    g = torch.Generator(device="cuda").manual_seed(2)

    def fresh():
        return [torch.randn((T, h, 128), device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 4, 4, 8)]

    static = [x.requires_grad_(i < 3) for i, x in enumerate(fresh())]

    def step():
        for x in static[:3]:
            x.grad = None
        o = varlen_attention(static[0], static[1], static[2], cu, 1890, work_list=wl, deterministic=deterministic)
        o.backward(static[3])
        return o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for x in static[:3]:
        x.grad = None
    with torch.cuda.graph(graph):
        o_static = step()
    new = fresh()
    with torch.no_grad():
        for x, y in zip(static, new):
            x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    xs = [x.clone().requires_grad_() for x in new[:3]]
    o_eager = varlen_attention(*xs, cu, 1890, work_list=wl, deterministic=deterministic)
    o_eager.backward(new[3])
    assert torch.equal(o_static, o_eager)
    for name, a, b in zip(("dq", "dk", "dv"), static[:3], xs):
        if deterministic or name != "dq":
            assert torch.equal(a.grad, b.grad), name
        else:
            err = (a.grad.float() - b.grad.float()).abs().max().item()
            scale = b.grad.float().abs().max().item()
            assert scale > 0 and err <= scale * 2.0 ** -7, (err, scale)
    # torch.compile: the custom op traces into one graph with a prebuilt work list
    compiled = torch.compile(lambda a, b, c: varlen_attention(a, b, c, cu, 1890, work_list=wl), fullgraph=True)
    assert torch.equal(compiled(*[x.detach() for x in new[:3]]), o_eager.detach())


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("into_first", [False, True])
@pytest.mark.parametrize("lengths,d,hkv,deterministic", [
    ([1500, 700], 128, 4, False),   # Gluon forward, dK/dV with the dQ reduce
    ([1500, 700], 128, 4, True),    # Gluon dK/dV without it + Gluon dQ programs
    ([1500, 700], 128, 2, False),   # GQA
    ([1500, 700], 64, 4, False),    # head_dim 64: Triton forward, Gluon backward
    ([1000, 700], 128, 4, False),   # 512 < max_seqlen <= 1024: persistent Gluon dK/dV + dQ programs
    ([300, 200], 128, 4, False),    # max_seqlen <= 512: Triton kernels only
    ([200, 250], 128, 4, False),    # 128 <= max_seqlen <= 256: whole-item forward whose upper consumer
                                    # partition skips the last key tile (only the other one zeroes its rows)
])
def test_nan_in_one_document_stays_in_it(which, into_first, lengths, d, hkv, deterministic):
    """A NaN in one document's q, k or v must leave the other document's output and all three
    gradients finite, and reach its own document's output. ``into_first`` False: the NaN sits a few
    tokens past the first document's unaligned end (inside the first document's last key / query
    tile: TMA boxes are not cut at document ends, so the Gluon kernels must keep those rows out of
    their products); True: a few tokens before that end (the second document must not see it).
    The CPU interpreter test's GPU counterpart, over every kernel family of the defaults."""
    T = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    shapes = {"q": (T, 4, d), "k": (T, hkv, d), "v": (T, hkv, d)}
    xs = [torch.randn(shapes[n], device="cuda", generator=g, dtype=torch.bfloat16) for n in "qkv"]
    end = lengths[0]
    xs["qkv".index(which)][end - 3 if into_first else end + 10, 1, 3] = float("nan")
    xs = [x.requires_grad_() for x in xs]
    o = varlen_attention(*xs, cu, max(lengths), check_finite=False, deterministic=deterministic)
    o.backward(torch.ones_like(o))
    clean, dirty = (slice(end, T), slice(0, end)) if into_first else (slice(0, end), slice(end, T))
    assert bool(torch.isfinite(o[clean]).all()), "output of the other document"
    for name, x in zip("qkv", xs):
        assert bool(torch.isfinite(x.grad[clean]).all()), f"d{name} of the other document"
    assert not bool(torch.isfinite(o[dirty]).all())  # the NaN's own document does see it
