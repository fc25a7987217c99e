"""CPU tests of the Gluon kernels' launchers, gates and Triton hand-off (the kernels themselves:
test_gluon_attention_gpu.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flamia_pack.kernels.config import CANDIDATES, candidate_config

gluon_attention = pytest.importorskip("flamia_pack.kernels.gluon_attention")


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
            gluon_attention.gluon_fwd(q, k, v, cu, items, num, 0.125)
        else:
            getattr(gluon_attention, fn)(q, k, v, do, lse, lse, cu, items, num, 0.125)


def test_shape_rules():
    q, k, v, do = _inputs(H=4, Hkv=3)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        gluon_attention._check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs(D=96)
    with pytest.raises(ValueError, match="64 or 128"):
        gluon_attention._check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="shapes disagree"):
        gluon_attention._check_inputs("x", q, k[:32], v[:32], do)


def test_candidates_that_vary_the_triton_backward_turn_gluon_off():
    on = {n for n, ov in CANDIDATES.items() if candidate_config(n).bwd_gluon}
    assert {"default", "gluon", "gluon_l256"} <= on
    for name in ("bwd_tma", "grid_order", "doc_major", "bwd_m64", "regs_k", "dq_n32", "split_dq128", "small", "triton_bwd"):
        assert not candidate_config(name).bwd_gluon, name


_LEFTOVER_SCRIPT = r"""
import json, sys
from dataclasses import replace
import numpy as np, torch
from flamia_pack.kernels import flash_bwd as B, flash_fwd as Fw, gluon_attention as G
from flamia_pack.kernels.attention import build_attention_work_list
from flamia_pack.kernels.config import AttentionKernelConfig
from flamia_pack.kernels.interpret import patch_triton_interpreter

patch_triton_interpreter()
out = {}
for name, (lengths, pad, min_len, h, hkv, compact, *extra) in json.loads(sys.argv[1]).items():
    small = bool(extra and extra[0])  # bwd_gluon_leftover_small: the leftover launch runs SMALL_TILES
    dqr = bool(len(extra) > 1 and extra[1])  # bwd_gluon_dq_reduce: dQ from the dK/dV kernel's fp32 accumulator
    max_bytes = extra[2] if len(extra) > 2 else 512 << 20  # bwd_dq_reduce_max_bytes (chunks of kv heads)
    torch.manual_seed(3)
    T = sum(lengths) + pad
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, do = (torch.randn(T, h, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, hkv, 64, dtype=torch.bfloat16) for _ in range(2))
    cfg = AttentionKernelConfig(wl_block_m=64 if small else 32, bwd_gluon_leftover_small=small, bwd_gluon_dq_reduce=dqr,
                                bwd_dq_reduce_max_bytes=max_bytes, block_m=32, block_n=16, bwd_block_n1=32, bwd_block_m1=16,
                                bwd_block_m2=32, bwd_block_n2=16, bwd_gluon=True, bwd_gluon_min_len=min_len,
                                bwd_leftover_compact=compact)
    wl = build_attention_work_list(cu, T, config=cfg)
    o, lse = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125, config=cfg)
    truth = B.flash_bwd(do, q, k, v, o, lse, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                        config=replace(cfg, bwd_gluon=False, bwd_gluon_dq_reduce=False))
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

    G.gluon_dkdv = fake_dkdv
    def fake_dq(*a, dq, **kw):
        assert not dqr, "the dQ programs ran although the dK/dV kernel reduces dQ"
        fake((dq, truth[0]))

    G.gluon_dq = fake_dq
    B._gluon_applies = lambda config, *a: config.bwd_gluon
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
    if small:  # the skipped tokens come from the small tiles (another summation order): their own truth
        from flamia_pack.kernels.config import SMALL_TILES
        small_truth = B.flash_bwd(do, q, k, v, o, lse, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                                  config=replace(cfg, **SMALL_TILES))
        for t, ts in zip(truth, small_truth):
            t[skip] = ts[skip]
    order, count, ranks = B.leftover_ranks(wl.items, wl.num_items, cu, min_len, cfg.wl_block_m)
    # the forward's Triton launch for what the Gluon forward skips (merged items, 1-token documents)
    import flamia_pack.kernels.gluon_attention as GF
    fcfg = replace(cfg, fwd_gluon=True)
    o_truth, lse_truth = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125,
                                      config=replace(cfg, fwd_gluon=False))
    own1 = ~skip1
    own1[cu_l[-1]:] = False

    def fake_fwd(*a, o, lse, **kw):
        o.fill_(float("nan")); lse.fill_(float("nan"))
        o[own1] = o_truth[own1]
        lse[:, own1] = lse_truth[:, own1]
        return o, lse

    GF.gluon_fwd = fake_fwd
    Fw.gluon_applies = lambda enabled, *a: enabled
    o_got, lse_got = Fw.flash_fwd(q, k, v, cu, wl.items, wl.num_items, causal=True, softmax_scale=0.125, config=fcfg)
    out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(got, truth)),
                 "fwd_equal": torch.equal(o_got, o_truth) and torch.equal(lse_got, lse_truth),
                 "skipped_tokens": int(skip[: cu_l[-1]].sum()), "count": int(count), "ranks": ranks,
                 "rows": int(wl.num_items), "capacity": wl.items.shape[0], "n_docs": len(lengths),
                 "chunks": chunks}
print("RESULTS " + json.dumps(out))
"""


def test_leftover_launch_fills_exactly_what_gluon_skips(run_interpreter):
    """Interpreter run of flash_bwd's Gluon branch with the Gluon kernels replaced by writers of the
    Triton backward's own results for the tokens they own (NaN elsewhere): the Triton launch for the
    rest -- over the whole list (default) or compacted (``bwd_leftover_compact``, ``leftover_ranks``)
    -- must fill merged items and short documents exactly."""
    import json

    cases = {"merged_and_one_token": ([70, 5, 33, 1, 1, 2, 40, 1], 7, 1, 4, 2, True),
             "min_len_40": ([70, 5, 33, 1, 1, 2, 40, 90], 0, 40, 2, 2, True),
             "no_short_docs": ([64, 96, 40], 3, 1, 2, 1, True),
             "whole_list_launch": ([70, 5, 33, 1, 1, 2, 40, 1], 7, 1, 4, 2, False),
             "small_leftover": ([70, 5, 33, 1, 1, 2, 40, 130], 3, 40, 2, 1, False, True),
             "small_leftover_compact": ([150, 5, 33, 1, 64, 2, 40, 1], 0, 64, 2, 2, True, True),
             "dq_reduce": ([70, 5, 33, 1, 1, 2, 40, 90], 5, 40, 4, 2, False, True, True),
             # accumulator capped at one kv head's (4 * T * 2 * 64 bytes, T = 247): four chunks, one buffer
             "dq_reduce_chunks": ([70, 5, 33, 1, 1, 2, 40, 90], 5, 40, 8, 4, False, True, True, 4 * 247 * 2 * 64)}
    res = run_interpreter(_LEFTOVER_SCRIPT, json.dumps(cases))
    for name, r in res.items():
        assert r["equal"] and r["fwd_equal"], (name, r)
        assert r["count"] <= r["ranks"] <= r["capacity"], (name, r)
    assert res["merged_and_one_token"]["skipped_tokens"] > 0 and res["merged_and_one_token"]["count"] > 0
    assert res["no_short_docs"]["count"] == 0
    assert res["dq_reduce"]["chunks"] == [[0, 2]]
    assert res["dq_reduce_chunks"]["chunks"] == [[0, 1], [1, 1], [2, 1], [3, 1]]
    # min_len 1: at most one leftover row per document, far fewer than the list's rows
    assert res["merged_and_one_token"]["ranks"] <= res["merged_and_one_token"]["n_docs"]


@pytest.mark.parametrize("kind,kw,async_ok,max_spill", [
    ("dkdv", {}, True, 0),                         # shipped (retire-first): async and spill-free
    ("dkdv", {"group": 4}, True, 0),             # spill-free since LSE / Delta are staged in shared memory
    ("dkdv", {"retire_first": False}, False, 64),  # gluon_serial: ptxas serializes its wgmma (NOTES.md)
    ("dkdv", {"retire_first": False, "group": 4}, False, 64),
    ("dkdv", {"head_dim": 64}, True, 0),
    # bwd_gluon_dq_reduce (the long-row default): 76 B of spills until the producer staged each step's
    # LSE / Delta rows in shared memory (2026-11-29 night, third), 0 B since; GQA 72 -> 20 B, 28 B with
    # the dK / dV stores through shared memory (2026-11-30: two more reloads per entry, none per step)
    ("dkdv", {"dq_reduce": True}, True, 0),
    ("dkdv", {"dq_reduce": True, "group": 4}, True, 28),
    ("dkdv", {"dq_reduce": True, "head_dim": 64}, True, 0),
    ("dkdv", {"persistent": True}, True, 0),       # bwd_gluon_persistent (unmeasured): two K/V slots, 197 KB
    ("dkdv", {"persistent": True, "group": 4}, True, 0),
    ("dkdv", {"persistent": True, "dq_reduce": True}, True, 16),
    ("dkdv", {"persistent": True, "head_dim": 64}, True, 0),
    ("dq", {"persistent": True, "stages": 2}, True, 0),  # persistent dQ: two Q/dO slots + 2-deep K/V ring
    ("dq", {"persistent": True, "stages": 2, "group": 4}, True, 0),
    # fwd_gluon_persistent: two Q slots + 2-deep K/V ring; since the one-compare masks (2026-11-30) ptxas
    # keeps two per-thread row offsets on the stack: 8 B stored once, reloaded once per entry (not per tile)
    ("fwd", {"persistent": True}, True, 8),
    ("fwd", {"persistent": True, "causal": False}, True, 0),
    # the two partitions taking turns (fwd_gluon_pingpong, the long-row default since 2026-11-30 (fourth);
    # the row above is small_fwd_pers's kernel): 12 / 4 B as two row offsets above
    ("fwd", {"persistent": True, "pingpong": True}, True, 12),
    ("fwd", {"persistent": True, "pingpong": True, "causal": False}, True, 4),
    ("fwd", {"pingpong": True}, True, 0),
    ("fwd", {"persistent": True, "parts": 1}, True, 0),  # one 8-warp consumer (candidate fwd_parts1)
    # whole 256-row items per claim (fwd_gluon_items, candidate small_fwd_pers_items): as the row above it
    ("fwd", {"persistent": True, "items_whole": True, "wl_block_m": 256}, True, 8),
    ("fwd", {"persistent": True, "items_whole": True, "wl_block_m": 256, "causal": False}, True, 0),
    # ... each partition skipping the tiles all masked for its rows (fwd_gluon_part_skip, candidate
    # small_fwd_pers_items_n64s5_skip); non-causal it compiles to the same SASS as without
    ("fwd", {"persistent": True, "items_whole": True, "wl_block_m": 256, "block_n": 64, "stages": 5, "part_skip": True},
     True, 0),
    # ... dealt by the static snake (fwd_gluon_static, candidate small_fwd_pers_items_n64s5_static)
    ("fwd", {"persistent": True, "items_whole": True, "wl_block_m": 256, "block_n": 64, "stages": 5, "static": True},
     True, 0),
    ("fwd", {"persistent": True, "block_n": 64, "stages": 4}, True, 0),  # candidates fwd_n64s4 (197 KB)
    ("fwd", {"persistent": True, "block_n": 64, "stages": 5}, True, 0),  # fwd_n64s5 (230 KB)
    ("fwd", {"persistent": True, "group": 4, "head_dim": 64}, True, 0),
    ("dq", {}, True, 0),                           # 4 stages (197 KB)
    ("dq", {"stages": 3}, True, 0),
    ("dq", {"group": 4}, True, 0),
    ("fwd", {}, True, 0),
    ("fwd", {"causal": False, "head_dim": 64, "group": 2}, True, 0),
    ("fwd", {"parts": 1}, True, 0),
])
def test_gluon_kernels_compile_for_sm90_on_the_cpu(kind, kw, async_ok, max_spill):
    """Every shipped Gluon kernel compiles for sm_90a without a GPU (triton's bundled ptxas), with the
    register behaviour recorded in benchmarks/NOTES.md: a change that breaks compilation, adds
    spills or serializes a wgmma pipeline that was asynchronous fails here, in CI, before any GPU run."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 6):
        pytest.skip("the kernels are written against triton 3.6's Gluon API")
    try:
        r = gluon_attention.compile_sm90(kind, **kw)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert r["shared"] <= 228 * 1024
    assert r["spill_bytes"] <= max_spill, r["ptxas"]
    if async_ok:
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
        if fn == "gluon_dkdv":
            gluon_attention.gluon_dkdv(x, x, x, x, lse, lse, cu, items, items[0, :1], 0.125, stages=stages)
        elif fn == "gluon_dq":
            gluon_attention.gluon_dq(x, x, x, x, lse, lse, cu, items, items[0, :1], 0.125, stages=stages)
        else:
            gluon_attention.gluon_fwd(x, x, x, cu, items, items[0, :1], 0.125, stages=stages)


def test_loop_local_memory_counts_spill_traffic_per_loop():
    """benchmarks/probes/gluon_compile_report.py's loop scan: local loads / stores counted inside each
    backward branch's body, not elsewhere (a synthetic cuobjdump listing; no compiler needed)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    from gluon_compile_report import loop_local_memory

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


def test_forward_parts_are_validated():
    """``fwd_gluon_parts`` / ``gluon_fwd(parts=)`` accept 1 or 2 consumer partitions, nothing else."""
    from flamia_pack.errors import FlamiaError
    from flamia_pack.kernels.config import AttentionKernelConfig

    assert AttentionKernelConfig().fwd_gluon_parts == 2
    assert AttentionKernelConfig(fwd_gluon_parts=1).fwd_gluon_parts == 1
    for bad in (0, 3, 4, True, 2.0, "2"):
        with pytest.raises(FlamiaError, match="fwd_gluon_parts must be 1 or 2"):
            AttentionKernelConfig(fwd_gluon_parts=bad)


def test_forward_ring_fields_are_validated():
    """``fwd_gluon_block_n`` (64 / 128) and ``fwd_gluon_stages`` (2-5) of the Gluon forward, and their
    product within an sm_90 program's shared memory next to the two 128-row Q slots."""
    from flamia_pack.errors import FlamiaError
    from flamia_pack.kernels.config import AttentionKernelConfig, candidate_config

    c = AttentionKernelConfig()
    assert (c.fwd_gluon_block_n, c.fwd_gluon_stages) == (128, 2)
    for bn, st in ((64, 4), (64, 5), (64, 2), (128, 2)):
        AttentionKernelConfig(fwd_gluon_block_n=bn, fwd_gluon_stages=st)
    for bad in (32, 256, 0, True, 64.0, "64"):
        with pytest.raises(FlamiaError, match="fwd_gluon_block_n must be 64 or 128"):
            AttentionKernelConfig(fwd_gluon_block_n=bad)
    for bad in (1, 6, 0, True, 2.0):
        with pytest.raises(FlamiaError, match=r"fwd_gluon_stages must be an int in \[2, 5\]"):
            AttentionKernelConfig(fwd_gluon_stages=bad)
    for st in (3, 4, 5):  # 128-key tiles: only two slots fit
        with pytest.raises(FlamiaError, match="do not fit in an sm_90 program's shared memory"):
            AttentionKernelConfig(fwd_gluon_block_n=128, fwd_gluon_stages=st)
    n = candidate_config("fwd_n64s4", head_dim=128)
    assert (n.fwd_gluon_block_n, n.fwd_gluon_stages, n.fwd_gluon, n.fwd_gluon_persistent) == (64, 4, True, True)
    w = candidate_config("small_fwd_pers_n64s4", head_dim=128)
    assert (w.fwd_gluon_block_n, w.fwd_gluon_stages, w.bwd_gluon, w.block_n) == (64, 4, False, 32)


def test_gluon_fwd_rejects_bad_partitions_before_touching_the_gpu():
    """``gluon_fwd(parts=)``: 1 or 2 (an int), and each partition a multiple of 64 query rows (wgmma)."""
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    n = torch.ones(1, dtype=torch.int32)
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="parts must be the int 1 or 2"):
            gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, parts=bad)
    with pytest.raises(ValueError, match="multiple of 64 query rows"):
        gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, block_m=64, parts=2)
    with pytest.raises(ValueError, match="parts must be 1 or 2"):
        gluon_attention.compile_sm90("fwd", parts=3)


def test_whole_item_claims_are_validated():
    """``fwd_gluon_items`` / ``gluon_fwd(items_whole=)`` only with the persistent two-partition forward;
    its candidate pairs it with 256-row list items and keeps the Triton backward of ``small_fwd_pers``."""
    from flamia_pack.errors import FlamiaError
    from flamia_pack.kernels.config import AttentionKernelConfig, candidate_config

    assert AttentionKernelConfig().fwd_gluon_items is False
    for bad in (1, "yes", None):
        with pytest.raises(FlamiaError, match="fwd_gluon_items must be bool"):
            AttentionKernelConfig(fwd_gluon_items=bad)
    ok = {"fwd_gluon": True, "fwd_gluon_persistent": True}
    AttentionKernelConfig(fwd_gluon_items=True, **ok)
    for kw in ({"fwd_gluon_persistent": False}, {"fwd_gluon_parts": 1}, {"fwd_gluon": False}):
        with pytest.raises(FlamiaError, match="fwd_gluon_items needs the persistent two-partition Gluon forward"):
            AttentionKernelConfig(fwd_gluon_items=True, **{**ok, **kw})
    c = candidate_config("small_fwd_pers_items", head_dim=128)
    base = candidate_config("small_fwd_pers", head_dim=128)
    assert (c.fwd_gluon_items, c.wl_block_m, c.fwd_gluon_persistent, c.fwd_gluon_pingpong) == (True, 256, True, False)
    assert (c.bwd_gluon, c.bwd_block_n1, c.bwd_block_m2) == (base.bwd_gluon, base.bwd_block_n1, base.bwd_block_m2)
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    n = torch.ones(1, dtype=torch.int32)
    for kw in ({"persistent": False}, {"persistent": True, "parts": 1}):
        with pytest.raises(ValueError, match="items_whole needs persistent=True and parts=2"):
            gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, items_whole=True, **kw)
    with pytest.raises(FlamiaError, match="fwd_gluon_head_inner needs fwd_gluon_items=True"):
        AttentionKernelConfig(fwd_gluon_head_inner=True)
    with pytest.raises(ValueError, match="head_inner needs items_whole=True"):
        gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, persistent=True, head_inner=True)
    with pytest.raises(FlamiaError, match="fwd_gluon_static needs fwd_gluon_items=True"):
        AttentionKernelConfig(fwd_gluon_static=True, **ok)
    with pytest.raises(FlamiaError, match="fwd_gluon_static must be bool"):
        AttentionKernelConfig(fwd_gluon_static=1, fwd_gluon_items=True, **ok)
    with pytest.raises(ValueError, match="static needs items_whole=True"):
        gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, persistent=True, static=True)
    with pytest.raises(FlamiaError, match="fwd_gluon_part_skip needs the whole-item Gluon forward without turns"):
        AttentionKernelConfig(fwd_gluon_part_skip=True, fwd_gluon_items=True, fwd_gluon_pingpong=True, **ok)
    with pytest.raises(FlamiaError, match="fwd_gluon_part_skip needs"):
        AttentionKernelConfig(fwd_gluon_part_skip=True, fwd_gluon_pingpong=False, **ok)
    AttentionKernelConfig(fwd_gluon_part_skip=True, fwd_gluon_items=True, fwd_gluon_pingpong=False, **ok)
    for kw in ({"persistent": True}, {"persistent": True, "items_whole": True, "pingpong": True}):
        with pytest.raises(ValueError, match="part_skip needs items_whole=True and pingpong=False"):
            gluon_attention.gluon_fwd(x, x, x, cu, items, n, 0.1, part_skip=True, **kw)
    sk = candidate_config("small_fwd_pers_items_n64s5_skip", head_dim=128)
    assert sk == dataclasses.replace(candidate_config("small_fwd_pers_items_n64s5", head_dim=128), fwd_gluon_part_skip=True)
    st = candidate_config("small_fwd_pers_items_n64s5_static", head_dim=128)
    assert st == dataclasses.replace(candidate_config("small_fwd_pers_items_n64s5", head_dim=128), fwd_gluon_static=True)
    hi = candidate_config("small_fwd_pers_items_n64s5_hi", head_dim=128)
    assert (hi.fwd_gluon_head_inner, hi.fwd_gluon_block_n, hi.fwd_gluon_stages, hi.wl_block_m) == (True, 64, 5, 256)
