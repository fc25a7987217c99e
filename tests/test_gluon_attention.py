"""CPU tests of the Gluon kernels' launchers, gates and Triton hand-off, and their sm_90a compilation
(the kernels themselves run in test_gluon_attention_gpu.py)."""
from __future__ import annotations

import pytest
import torch

gluon_fwd_mod = pytest.importorskip("flamia_pack.kernels.gluon_fwd")
from flamia_pack.kernels import gluon_common, gluon_dkdv as gluon_dkdv_mod, gluon_dq as gluon_dq_mod  # noqa: E402

LAUNCHERS = {"gluon_dkdv": gluon_dkdv_mod.gluon_dkdv, "gluon_dq": gluon_dq_mod.gluon_dq,
             "gluon_fwd": gluon_fwd_mod.gluon_fwd}


def _inputs(T=64, H=4, Hkv=2, D=64, dtype=torch.bfloat16):
    q, do = (torch.zeros(T, H, D, dtype=dtype) for _ in range(2))
    k, v = (torch.zeros(T, Hkv, D, dtype=dtype) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("fn", ["gluon_dkdv", "gluon_dq", "gluon_fwd"])
@pytest.mark.parametrize("case,match", [
    ("cpu", "CUDA tensor"),
    ("fp32", "bf16"),
    ("noncontig", "contiguous"),
])
def test_launchers_reject_bad_inputs_before_launch(fn, case, match):
    q, k, v, do = _inputs(dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "noncontig":
        q = torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, ::2]
    lse = torch.zeros(4, 64)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    num = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        if fn == "gluon_fwd":
            LAUNCHERS[fn](q, k, v, cu, items, num, 0.125)
        else:
            LAUNCHERS[fn](q, k, v, do, lse, lse, cu, items, num, 0.125)


def test_shape_rules():
    q, k, v, do = _inputs(H=4, Hkv=3)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        gluon_common.check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs(D=96)
    with pytest.raises(ValueError, match="64 or 128"):
        gluon_common.check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="shapes disagree"):
        gluon_common.check_inputs("x", q, k[:32], v[:32], do)


_LEFTOVER_SCRIPT = r"""
import json, sys
from dataclasses import replace
import numpy as np, torch
from flamia_pack.kernels import flash_bwd as B, flash_fwd as Fw, gluon_dkdv as GK, gluon_dq as GQ, gluon_fwd as GF
from flamia_pack.kernels.attention import build_attention_work_list
from flamia_pack.kernels.config import (AttentionKernelConfig, GluonBwdConfig, GluonFwdConfig, TritonBwdConfig,
                                        TritonFwdConfig)
from flamia_pack.kernels.interpret import patch_triton_interpreter

patch_triton_interpreter()
B.SMALL_BWD = TritonBwdConfig(block_n1=32, block_m1=16, block_m2=32, block_n2=16, num_warps=4)  # scaled to wl 32
out = {}
for name, (lengths, pad, min_len, h, hkv, dqr, max_bytes) in json.loads(sys.argv[1]).items():
    torch.manual_seed(3)
    T = sum(lengths) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, do = (torch.randn(T, h, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, hkv, 64, dtype=torch.bfloat16) for _ in range(2))
    cfg = AttentionKernelConfig(wl_block_m=32, fwd=TritonFwdConfig(block_m=32, block_n=16),
                                bwd=TritonBwdConfig(block_n1=32, block_m1=16, block_m2=32, block_n2=16),
                                gluon_fwd=GluonFwdConfig(),
                                gluon_bwd=GluonBwdConfig(min_len=min_len, dq_reduce=dqr, dq_reduce_max_bytes=max_bytes))
    triton_cfg = replace(cfg, gluon_fwd=None, gluon_bwd=None)
    wl = build_attention_work_list(cu, T, config=cfg)
    o, lse = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125, config=triton_cfg)
    truth = B.flash_bwd(do, q, k, v, o, lse, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                        config=triton_cfg)
    # tokens the Gluon programs skip: merged items and documents of <= min_len tokens
    skip = torch.zeros(T, dtype=torch.bool)
    cu_l = cu.tolist()
    for d, (a, b) in enumerate(zip(cu_l[:-1], cu_l[1:])):
        if b - a <= min_len:
            skip[a:b] = True
    it = wl.items[: int(wl.num_items)].tolist()
    for doc, qs, qe, _ in it:
        if qe > cu_l[doc + 1]:
            skip[qs:qe] = True
    own = ~skip
    own[cu_l[-1]:] = False
    skip1 = torch.zeros(T, dtype=torch.bool)  # the forward skips 1-token documents and merged items
    for d, (a, b) in enumerate(zip(cu_l[:-1], cu_l[1:])):
        if b - a <= 1:
            skip1[a:b] = True
    for doc, qs, qe, _ in it:
        if qe > cu_l[doc + 1]:
            skip1[qs:qe] = True

    def fake(*dst_truth):
        for dst, t in dst_truth:
            dst.fill_(float("nan"))
            dst[own] = t[own]

    chunks = []

    def fake_dkdv(*a, dk, dv, dq_acc=None, kv_head0=0, kv_heads=None, **kw):
        fake((dk, truth[1]), (dv, truth[2]))
        chunks.append((kv_head0, kv_heads))
        if dq_acc is not None:  # the TMA reduces add dQ / softmax_scale of the chunk's heads to the zeroed owned rows
            g = h // hkv
            n = (hkv - kv_head0) if kv_heads is None else kv_heads
            dq_acc[own, : n * g] += truth[0][own][:, kv_head0 * g: (kv_head0 + n) * g].float() / 0.125

    GK.gluon_dkdv = fake_dkdv
    def fake_dq(*a, dq, **kw):
        assert not dqr, "the dQ programs ran although the dK/dV kernel reduces dQ"
        fake((dq, truth[0]))

    GQ.gluon_dq = fake_dq
    B._gluon_applies = lambda config, *a: config.gluon_bwd is not None
    empty = torch.empty

    def poisoned(*a, **kw):  # fresh float buffers start as NaN: the dQ accumulator must be zeroed by flash_bwd
        t = empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        got = B.flash_bwd(do, q, k, v, o, lse, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                          config=cfg)
    finally:
        torch.empty = empty
    # the skipped tokens come from the small tiles (another summation order): their own truth
    small_truth = B.flash_bwd(do, q, k, v, o, lse, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                              config=replace(triton_cfg, bwd=B.SMALL_BWD))
    for t, ts in zip(truth, small_truth):
        t[skip] = ts[skip]
    # the forward's Triton launch for what the Gluon forward skips (merged items, 1-token documents)
    o_truth, lse_truth = o, lse
    own1 = ~skip1
    own1[cu_l[-1]:] = False

    def fake_fwd(*a, o, lse, **kw):
        o.fill_(float("nan")); lse.fill_(float("nan"))
        o[own1] = o_truth[own1]
        lse[:, own1] = lse_truth[:, own1]
        return o, lse

    GF.gluon_fwd = fake_fwd
    Fw.gluon_applies = lambda enabled, *a: enabled
    o_got, lse_got = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125, config=cfg)
    out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(got, truth)),
                 "fwd_equal": torch.equal(o_got, o_truth) and torch.equal(lse_got, lse_truth),
                 "skipped_tokens": int(skip[: cu_l[-1]].sum()), "chunks": chunks}
print("RESULTS " + json.dumps(out))
"""


@pytest.mark.slow
def test_leftover_launch_fills_exactly_what_gluon_skips(run_interpreter):
    """Interpreter run of flash_fwd's / flash_bwd's Gluon branches with the Gluon kernels replaced by
    writers of the Triton kernels' own results for the tokens they own (NaN elsewhere): the Triton
    launch for the rest (merged items, short documents; the backward's on the small tiles) must fill
    exactly those, and the dQ accumulator path (in chunks of kv heads) must give the same dQ."""
    import json

    big = 512 << 20
    cases = {"merged_and_one_token": ([70, 5, 33, 1, 1, 2, 40, 1], 7, 1, 4, 2, False, big),
             "min_len_40": ([70, 5, 33, 1, 1, 2, 40, 90], 0, 40, 2, 2, False, big),
             "no_short_docs": ([64, 96, 40], 3, 1, 2, 1, False, big),
             "dq_reduce": ([70, 5, 33, 1, 1, 2, 40, 90], 5, 40, 4, 2, True, big),
             # accumulator capped at one kv head's (4 * T * 2 * 64 bytes, T = 247): four chunks, one buffer
             "dq_reduce_chunks": ([70, 5, 33, 1, 1, 2, 40, 90], 5, 40, 8, 4, True, 4 * 247 * 2 * 64)}
    res = run_interpreter(_LEFTOVER_SCRIPT, json.dumps(cases))
    for name, r in res.items():
        assert r["equal"] and r["fwd_equal"], (name, r)
    assert res["merged_and_one_token"]["skipped_tokens"] > 0
    assert res["dq_reduce"]["chunks"] == [[0, 2]]
    assert res["dq_reduce_chunks"]["chunks"] == [[0, 1], [1, 1], [2, 1], [3, 1]]


@pytest.mark.parametrize("kind,kw,max_spill", [
    # the kernels the band table ships (GluonFwdConfig / GluonBwdConfig), with their spill bytes: a change
    # that breaks compilation, adds spills or serializes an asynchronous wgmma pipeline fails here
    ("fwd", {"pingpong": True}, 12),                 # default (long rows): two per-thread row offsets
    ("fwd", {"pingpong": True, "causal": False}, 4),
    ("fwd", {"pingpong": True, "group": 4}, 12),     # GQA
    ("fwd", {}, 8),                                  # small_fwd_pers
    ("fwd", {"items_whole": True, "wl_block_m": 256, "block_n": 64, "stages": 5, "part_skip": True}, 0),
    ("dkdv", {"dq_reduce": True}, 0),                # default
    ("dkdv", {"dq_reduce": True, "group": 4}, 28),
    ("dkdv", {"dq_reduce": True, "head_dim": 64}, 0),
    ("dkdv", {}, 0),                                 # deterministic=True
    ("dkdv", {"persistent": True}, 0),               # all_pers_dqp
    ("dq", {}, 0),                                   # deterministic=True
    ("dq", {"persistent": True, "stages": 2}, 0),    # all_pers_dqp
])
def test_gluon_kernels_compile_for_sm90_on_the_cpu(kind, kw, max_spill):
    """Every shipped Gluon kernel compiles for sm_90a without a GPU (triton's bundled ptxas), with the
    register behaviour recorded in benchmarks/NOTES.md: a change that breaks compilation, adds
    spills or serializes a wgmma pipeline that was asynchronous fails here, in CI, before any GPU run."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 6):
        pytest.skip("the kernels are written against triton 3.6's Gluon API")
    try:
        from flamia_pack.kernels.gluon_compile import compile_sm90

        r = compile_sm90(kind, **kw)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert r["shared"] <= 228 * 1024
    assert r["spill_bytes"] <= max_spill, r["ptxas"]
    assert not r["serialized"], r["ptxas"]
    assert "HGMMA" in r["sass"] and "UTMALDG" in r["sass"]


_ROWS_SCRIPT = r"""
import json, sys
import numpy as np, torch, triton
from flamia_pack.kernels import flash_bwd as B
from flamia_pack.kernels.interpret import patch_triton_interpreter

patch_triton_interpreter()
rng = np.random.default_rng(int(sys.argv[1]))
bad = []
for case in range(int(sys.argv[2])):
    n_docs = int(rng.integers(1, 40))
    lengths = rng.choice([0, 1, 3, 16, 40, 41, 64, 65, 200], size=n_docs)
    pad = int(rng.integers(0, 70))
    skip = int(rng.choice([1, 16, 40, 64]))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu[-1]) + pad
    if T == 0:
        continue
    H, acc_heads, h0, D = 2, 3, 1, 64
    n_steps = max(1, n_docs.bit_length() + 1)
    acc = torch.randn(T, acc_heads, D)
    dq = torch.full((T, acc_heads + 1, D), float("nan"), dtype=torch.bfloat16)
    before = acc.clone()
    B._dq_reduce_cast[(triton.cdiv(T, 64), H)](acc, dq, torch.from_numpy(cu), n_docs, skip, n_steps, T, acc_heads, h0,
                                               dq.stride(0), dq.stride(1), 0.5, BLOCK=64, HEAD_DIM=D, ZERO_AFTER=True)
    # the owned rows: documents longer than skip, and padding rows past cu[-1]
    doc_len = np.repeat(lengths, lengths)
    own = np.concatenate([doc_len > skip, np.ones(pad, dtype=bool)])
    own_t = torch.from_numpy(own)
    want = before[:, :H] * 0.5
    # within one bf16 step (the interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest)
    ok = (torch.allclose(dq[own_t][:, h0:h0 + H].float(), want[own_t], rtol=2 ** -7, atol=0)
          and bool(torch.isnan(dq[~own_t].float()).all())           # rows not owned: untouched
          and bool(torch.isnan(dq[:, :h0].float()).all()) and bool(torch.isnan(dq[:, h0 + H:].float()).all())
          and bool((acc[own_t][:, :H] == 0).all())                  # zeroed for the next chunk
          and torch.equal(acc[~own_t], before[~own_t]) and torch.equal(acc[:, H:], before[:, H:]))
    if not ok:
        bad.append({"lengths": lengths.tolist(), "pad": pad, "skip": skip})
print("RESULTS " + json.dumps(bad))
"""


@pytest.mark.slow
def test_dq_reduce_cast_writes_exactly_the_gluon_rows(run_interpreter):
    """Interpreter run of ``flash_bwd._dq_reduce_cast`` (and its ``_gluon_rows`` binary search of
    ``cu_seqlens``) on random rows with empty documents, 1-token documents, lengths at the threshold
    and row padding: it writes ``softmax_scale * acc`` to exactly the rows of documents longer than
    ``skip`` and the padding rows, for the chunk's heads only, zeroes what it read, and leaves every
    other row of dQ and of the accumulator untouched."""
    assert run_interpreter(_ROWS_SCRIPT, "7", "25") == []


@pytest.mark.parametrize("fn", ["gluon_dkdv", "gluon_dq", "gluon_fwd"])
@pytest.mark.parametrize("stages", [1, 0, 2.0, True])
def test_launchers_reject_a_ring_of_fewer_than_two_stages(fn, stages):
    """A one-slot ring hangs every program that walks two tiles (a slot is released only once the
    next one is ready): the launchers refuse it before touching the inputs."""
    x = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    lse = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="stages"):
        if fn == "gluon_fwd":
            LAUNCHERS[fn](x, x, x, cu, items, items[0, :1], 0.125, stages=stages)
        else:
            LAUNCHERS[fn](x, x, x, x, lse, lse, cu, items, items[0, :1], 0.125, stages=stages)


def test_loop_local_memory_counts_spill_traffic_per_loop():
    """The loop scan ``gluon_compile.sass_loops`` (what benchmarks/probes/gluon_compile_report.py prints):
    local loads / stores counted inside each backward branch's body, not elsewhere (a synthetic
    cuobjdump listing; no compiler needed)."""
    from flamia_pack.kernels.gluon_compile import sass_loops

    def loop_local_memory(sass):  # (instructions, LDL, STL, wgmma) per loop
        return [(lp["instructions"], lp["ldl"], lp["stl"], lp["gmma"]) for lp in sass_loops(sass)]

    sass = "\n".join([
        "        /*0000*/                   STL [R1], R2 ;",
        "        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
        "        /*0020*/                   LDL R3, [R1] ;",
        "        /*0030*/                   STL [R1+0x4], R3 ;",
        "        /*0040*/              @P0 BRA 0x10 ;",
        "        /*0050*/                   LDL R5, [R1+0x8] ;",
        "        /*0060*/                   BRA 0x70 ;",  # a forward branch: no loop
        "        /*0070*/                   EXIT ;",
    ])
    assert loop_local_memory(sass) == [(4, 1, 1, 1)]
    assert loop_local_memory("") == []


def test_loop_chains_follow_register_dependencies():
    """``gluon_compile.loop_chains``: a sequential max is a chain of its length, independent maxes are
    not, another op breaks a same-op chain, stores define nothing; the latency path adds up (a
    synthetic listing; no compiler needed)."""
    from flamia_pack.kernels.gluon_compile import loop_chains, sass_loops

    sass = "\n".join([
        "        /*0000*/                   FMNMX R2, R10, R11, !PT ;",
        "        /*0010*/                   FMNMX R2, R2, R12, !PT ;",
        "        /*0020*/                   FMNMX R2, R2, R13, !PT ;",   # chain of 3
        "        /*0030*/                   FMNMX R3, R14, R15, !PT ;",  # independent
        "        /*0040*/                   MUFU.EX2 R4, R2 ;",
        "        /*0050*/                   FADD R5, R4, R3 ;",
        "        /*0060*/                   STS [R5], R2 ;",
        "        /*0070*/              @P0 BRA 0x0 ;",
        "        /*0080*/                   EXIT ;",
    ])
    (loop,) = sass_loops(sass)
    c = loop_chains(sass, loop)
    assert c["FMNMX"] == 3 and c["FADD"] == 1
    assert c["path"] == 3 * 4 + 18 + 4  # three FMNMX, the MUFU, the FADD


def test_gluon_fwd_rejects_bad_options_before_touching_the_gpu():
    """``gluon_fwd``: each of the two partitions a multiple of 64 query rows (wgmma); ``part_skip`` only
    with whole items and no turns."""
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    n = torch.ones(1, dtype=torch.int32)
    fwd = gluon_fwd_mod.gluon_fwd
    with pytest.raises(ValueError, match="multiple of 64 query rows"):
        fwd(x, x, x, cu, items, n, 0.1, block_m=64)
    for kw in ({}, {"items_whole": True, "pingpong": True}):
        with pytest.raises(ValueError, match="part_skip needs items_whole=True and pingpong=False"):
            fwd(x, x, x, cu, items, n, 0.1, part_skip=True, **kw)
