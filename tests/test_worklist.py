"""Work-list builders (DESIGN.md §6): host reference == numba == torch device builder.

CPU tests run the torch builder on CPU tensors (the same code path as on the GPU); tests marked
``gpu`` compare the CUDA builders (torch and Triton backends, eager and CUDA-graph replay) to the
reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.scheduler.worklist import (
    ITEM_COLUMNS,
    TileConfig,
    WorkList,
    WorkListBuilder,
    build_work_list,
    build_work_list_host,
    build_work_list_numba,
    max_work_items,
    static_assignment,
)

BLOCKS = [16, 32, 64, 128, 256]


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lens, dtype=np.int64))]).astype(np.int64)


def _all_builders(cu: np.ndarray, cfg: TileConfig, total_tokens: int | None = None, dtype=torch.int32):
    ref = build_work_list_host(cu, cfg)
    nb = build_work_list_numba(cu, cfg)
    t = int(cu[-1]) if total_tokens is None else total_tokens
    wl = build_work_list(torch.tensor(cu, dtype=dtype), t, cfg, backend="torch")
    return ref, nb, wl


def _check_invariants(items: np.ndarray, cu: np.ndarray, cfg: TileConfig) -> None:
    """Properties any correct list has, independent of the reference implementation."""
    assert items.dtype == np.int32 and items.shape[1] == len(ITEM_COLUMNS)
    doc, qs, qe, cost = (items[:, i].astype(np.int64) for i in range(4))
    # sorted by decreasing cost, ties by (doc, q_start)
    keys = list(zip(-cost, doc, qs))
    assert keys == sorted(keys)
    assert np.all(qe - qs >= 1) and np.all(qe - qs <= cfg.block_m)
    # every token of the row belongs to exactly one item
    cover = np.zeros(int(cu[-1]), np.int64)
    for a, b in zip(qs, qe):
        cover[a:b] += 1
    assert np.all(cover == 1)
    bn = cfg.block_n
    starts, ends = cu[doc], cu[doc + 1]
    merged = qe > ends
    assert np.all(qs >= starts)
    # merged items: whole documents inside one aligned BLOCK_M window
    if not cfg.merge_short:
        assert not merged.any()
    assert np.all(qs[merged] == starts[merged])
    assert np.all(qs[merged] // cfg.block_m == (qe[merged] - 1) // cfg.block_m)
    # cost = visible key tiles on the row grid
    first_key = np.where(merged, qs, starts)
    last_key = np.where(merged | cfg.causal, qe - 1, ends - 1)
    assert np.array_equal(cost, last_key // bn - first_key // bn + 1)
    # non-merged items start on the document's own BLOCK_M grid
    assert np.all((qs[~merged] - starts[~merged]) % cfg.block_m == 0)


def test_hand_computed_example_unaligned_start_costs_an_extra_tile():
    # doc 0 = [0, 5), doc 1 = [5, 300): doc 1 starts unaligned; BLOCK 128 x 128, causal.
    # doc 1 items: [5,133) keys 5..132 -> tiles 0..1 = 2; [133,261) keys 5..260 -> tiles 0..2 = 3;
    # [261,300) keys 5..299 -> tiles 0..2 = 3.  doc 0: [0,5) -> 1 tile.
    cu = np.array([0, 5, 300])
    expect = np.array([[1, 133, 261, 3], [1, 261, 300, 3], [1, 5, 133, 2], [0, 0, 5, 1]], np.int32)
    ref, nb, wl = _all_builders(cu, TileConfig())
    assert np.array_equal(ref, expect)
    assert np.array_equal(nb, expect)
    assert np.array_equal(wl.to_numpy(), expect)
    # non-causal: every item of doc 1 sees the whole document -> tiles 0..2 = 3
    ref = build_work_list_host(cu, TileConfig(causal=False))
    assert ref[:, 3].tolist() == [3, 3, 3, 1]
    # merge_short: doc 0 lies inside window [0,128) but doc 1 does not -> nothing to merge
    assert np.array_equal(build_work_list_host(cu, TileConfig(merge_short=True)), expect)


def test_merge_short_hand_example():
    # 3 docs of 40 tokens in window [0,128), then a doc crossing 128, then 2 short docs in [256,384)
    lens = [40, 40, 40, 100, 10, 20]  # offsets 0,40,80,120,220,230,250
    cu = _cu(lens)
    cfg = TileConfig(block_m=128, block_n=64, merge_short=True)
    ref, nb, wl = _all_builders(cu, cfg)
    # merged [0,120): tiles 0..1 = 2 ; doc 3 [120,220) crosses 128: own item, causal keys 120..219 ->
    # tiles 1..3 = 3 ; docs 4, 5 [220,230) and [230,250) lie in window [128,256) -> merged: tiles 3..3 = 1
    expect = np.array([[3, 120, 220, 3], [0, 0, 120, 2], [4, 220, 250, 1]], np.int32)
    assert np.array_equal(ref, expect)
    assert np.array_equal(nb, expect)
    assert np.array_equal(wl.to_numpy(), expect)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_random_rows_match_reference(causal, merge):
    rng = np.random.default_rng(1234 + 2 * causal + merge)
    for _ in range(12):
        n = int(rng.integers(1, 400))
        hi = int(rng.choice([2, 50, 700, 5000]))
        lens = rng.integers(1, hi + 1, size=n)
        cfg = TileConfig(
            block_m=int(rng.choice(BLOCKS)), block_n=int(rng.choice(BLOCKS)), causal=causal, merge_short=merge
        )
        cu = _cu(lens)
        slack = int(rng.integers(0, 300))
        ref, nb, wl = _all_builders(cu, cfg, int(cu[-1]) + slack, dtype=rng.choice([torch.int32, torch.int64]))
        _check_invariants(ref, cu, cfg)
        assert np.array_equal(nb, ref)
        assert np.array_equal(wl.to_numpy(), ref)
        assert bool((wl.items[ref.shape[0]:] == -1).all())
        assert wl.max_items == max_work_items(int(cu[-1]) + slack, n, cfg)


@pytest.mark.parametrize("merge", [False, True])
def test_large_rows_match_reference(merge):
    # the range: up to 5,000 documents, lengths up to 70,000, unaligned starts
    rng = np.random.default_rng(7 + merge)
    cases = [rng.integers(1, 40, size=5000), rng.integers(1, 70001, size=12), np.r_[rng.integers(1, 9, 3000), 70000]]
    for lens in cases:
        for causal in (True, False):
            cfg = TileConfig(causal=causal, merge_short=merge)
            cu = _cu(lens)
            ref, nb, wl = _all_builders(cu, cfg)
            _check_invariants(ref, cu, cfg)
            assert np.array_equal(nb, ref)
            assert np.array_equal(wl.to_numpy(), ref)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 600), min_size=1, max_size=40),
    bm=st.sampled_from(BLOCKS),
    bn=st.sampled_from(BLOCKS),
    causal=st.booleans(),
    merge=st.booleans(),
)
def test_property_builders_agree(lens, bm, bn, causal, merge):
    cfg = TileConfig(block_m=bm, block_n=bn, causal=causal, merge_short=merge)
    cu = _cu(lens)
    ref, nb, wl = _all_builders(cu, cfg)
    _check_invariants(ref, cu, cfg)
    assert np.array_equal(nb, ref)
    assert np.array_equal(wl.to_numpy(), ref)
    assert ref.shape[0] <= max_work_items(int(cu[-1]), None, cfg)
    assert ref.shape[0] <= max_work_items(int(cu[-1]), len(lens), cfg)


def test_one_token_documents_merge_short():
    t = 4096
    cu = np.arange(t + 1)
    plain = build_work_list_host(cu, TileConfig())
    assert plain.shape == (t, 4) and np.all(plain[:, 3] == 1)
    assert np.array_equal(plain[:, 0], np.arange(t))  # ties by doc
    cfg = TileConfig(merge_short=True)
    merged = build_work_list_host(cu, cfg)
    assert merged.shape == (t // 128, 4)
    assert np.array_equal(merged[:, 1], np.arange(0, t, 128))
    assert np.array_equal(merged[:, 2], np.arange(128, t + 1, 128))
    assert np.array_equal(merged[:, 0], np.arange(0, t, 128))  # first document of each window
    assert np.all(merged[:, 3] == 1)
    wl = build_work_list(torch.tensor(cu, dtype=torch.int32), t, cfg)
    assert np.array_equal(wl.to_numpy(), merged)


def test_zero_documents():
    cu = np.array([0])
    for cfg in (TileConfig(), TileConfig(merge_short=True)):
        assert build_work_list_host(cu, cfg).shape == (0, 4)
        assert build_work_list_numba(cu, cfg).shape == (0, 4)
        for t in (0, 100):
            wl = build_work_list(torch.tensor(cu, dtype=torch.int32), t, cfg)
            assert int(wl.num_items[0]) == 0
            assert bool((wl.items == -1).all())
            assert wl.to_numpy().shape == (0, 4)


def test_one_document_of_length_one_and_unaligned_tail():
    for cfg in (TileConfig(), TileConfig(causal=False), TileConfig(merge_short=True)):
        ref, nb, wl = _all_builders(np.array([0, 1]), cfg, total_tokens=1)
        assert ref.tolist() == [[0, 0, 1, 1]]
        assert nb.tolist() == ref.tolist() and wl.to_numpy().tolist() == ref.tolist()
    # T = 300 not a multiple of 128: last item is partial; the row has 44 tokens of end padding
    ref, nb, wl = _all_builders(np.array([0, 300]), TileConfig(), total_tokens=344)
    assert ref.tolist() == [[0, 256, 300, 3], [0, 128, 256, 2], [0, 0, 128, 1]]
    assert wl.to_numpy().tolist() == ref.tolist()


@pytest.mark.parametrize(
    "cu,match",
    [
        (np.array([0, 5, 3]), "non-decreasing|strictly increasing"),
        (np.array([1, 5, 9]), r"\[0\] must be 0"),
        (np.array([0.0, 5.0]), "int32 or int64"),
        (np.array([0, 5, 5, 9]), "zero-length"),
        (np.zeros((2, 2), np.int64), "1-D"),
    ],
)
def test_invalid_cu_seqlens_raise(cu, match):
    with pytest.raises(MetadataError, match=match):
        build_work_list_host(cu, TileConfig())
    with pytest.raises(MetadataError, match=match):
        build_work_list_numba(cu, TileConfig())
    with pytest.raises(MetadataError, match=match):
        build_work_list(torch.from_numpy(np.ascontiguousarray(cu)), 100, TileConfig())


def test_last_offset_beyond_total_tokens_raises():
    with pytest.raises(MetadataError, match="exceeds total_tokens"):
        build_work_list(torch.tensor([0, 10, 20], dtype=torch.int32), 19, TileConfig())
    with pytest.raises(MetadataError, match="torch.Tensor"):
        build_work_list(np.array([0, 10]), 10, TileConfig())


def test_too_small_max_items_raises():
    cu = torch.tensor([0, 1000], dtype=torch.int32)
    with pytest.raises(MetadataError, match="max_items"):
        build_work_list(cu, 1000, TileConfig(), max_items=3)


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_m=512), dict(block_m=8), dict(block_n=96), dict(block_m=True), dict(causal=1)],
)
def test_tile_config_validation(kwargs):
    with pytest.raises(FlamiaError):
        TileConfig(**kwargs)


def test_padded_cu_buffer_and_out_reuse():
    """Fixed-size buffers as a CUDA-graph caller uses them: cu padded with its last value, out reused."""
    rng = np.random.default_rng(3)
    n_max, t = 64, 5000
    for merge in (False, True):
        cfg = TileConfig(block_m=64, block_n=32, merge_short=merge)
        m = max_work_items(t, n_max, cfg)
        out = WorkList(
            items=torch.full((m, 4), 7, dtype=torch.int32), num_items=torch.zeros(1, dtype=torch.int32), max_items=m, config=cfg
        )
        for _ in range(5):
            n = int(rng.integers(1, n_max + 1))
            lens = rng.integers(1, t // n_max, size=n)
            cu = _cu(lens)
            buf = np.full(n_max + 1, cu[-1])
            buf[: n + 1] = cu
            wl = build_work_list(torch.tensor(buf, dtype=torch.int32), t, cfg, validate=False, out=out)
            assert wl is out
            ref = build_work_list_host(cu, cfg)
            assert np.array_equal(wl.to_numpy(), ref)
            assert bool((wl.items[len(ref):] == -1).all())


def _check_builder(builder: WorkListBuilder, rng, rows: int, device: str) -> None:
    t, n_max = builder.total_tokens, builder.max_docs
    for i in range(rows):
        n = [0, 1, n_max][i] if i < 3 else int(rng.integers(1, n_max + 1))
        lens = rng.integers(1, t // max(n, 1) + 1, size=n)
        cu = _cu(lens)
        dtype = torch.int64 if i % 2 else torch.int32
        builder.work_list.items.fill_(99)
        wl = builder(torch.tensor(cu, dtype=dtype, device=device), validate=bool(i % 3 == 0))
        ref = build_work_list_host(cu, builder.config)
        assert np.array_equal(wl.to_numpy(), ref)
        assert bool((wl.items[len(ref):] == -1).all())


def test_work_list_builder_cpu():
    rng = np.random.default_rng(8)
    for merge in (False, True):
        builder = WorkListBuilder(50, 3000, TileConfig(block_m=64, merge_short=merge), device="cpu")
        assert not builder.use_graph
        _check_builder(builder, rng, 8, "cpu")
    with pytest.raises(FlamiaError, match="max_docs"):
        builder(torch.arange(52, dtype=torch.int32))
    with pytest.raises(MetadataError):
        builder(torch.tensor([0, 5, 3], dtype=torch.int32), validate=True)


def test_static_assignment_snake():
    m, p = 23, 5
    items = torch.zeros((m, 4), dtype=torch.int32)
    got = static_assignment(items, torch.tensor([17], dtype=torch.int32), p)
    expect = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 4, 3] + [-1] * 6
    assert got.tolist() == expect
    assert static_assignment(items.numpy(), 17, p).tolist() == expect
    # balanced counts: each CTA gets floor or ceil of n / P items
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, p = int(rng.integers(0, 500)), int(rng.integers(1, 140))
        a = static_assignment(np.zeros((n + 3, 4), np.int32), n, p)
        counts = np.bincount(a[a >= 0], minlength=p)
        assert counts.sum() == n and counts.max() - counts.min() <= 1
    with pytest.raises(FlamiaError):
        static_assignment(items, 3, 0)


def test_max_work_items_is_tight_for_one_token_documents():
    t = 1000
    assert max_work_items(t, None, TileConfig()) == t
    assert build_work_list_host(np.arange(t + 1), TileConfig()).shape[0] == t
    assert max_work_items(0, None, TileConfig()) == 0
    with pytest.raises(FlamiaError):
        max_work_items(-1, None, TileConfig())


# ---------------------------------------------------------------------------------------------- GPU


def _random_rows(rng, count):
    for _ in range(count):
        n = int(rng.integers(1, 5001))
        hi = int(rng.choice([1, 8, 200, 4000, 70000]))
        lens = rng.integers(1, hi + 1, size=n)
        if lens.sum() > 2_000_000:
            lens = lens[: max(1, int(2_000_000 // max(1, lens.mean())))]
        yield _cu(lens)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_builder_matches_reference(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    rng = np.random.default_rng(11)
    for cu in list(_random_rows(rng, 10)) + [np.arange(131073), np.array([0, 1]), np.array([0, 65536])]:
        for causal in (True, False):
            for merge in (False, True):
                cfg = TileConfig(block_m=int(rng.choice([64, 128, 256])), block_n=int(rng.choice([64, 128])),
                                 causal=causal, merge_short=merge)
                ref = build_work_list_numba(cu, cfg)
                t = int(cu[-1]) + int(rng.integers(0, 100))
                dcu = torch.tensor(cu, dtype=torch.int32, device="cuda")
                wl = build_work_list(dcu, t, cfg, backend=backend)
                got = wl.to_numpy()
                assert np.array_equal(got, ref), (backend, cfg, len(cu))
                assert bool((wl.items[len(ref):] == -1).all())
    zero = build_work_list(torch.zeros(1, dtype=torch.int32, device="cuda"), 10, TileConfig(), backend=backend)
    assert int(zero.num_items[0]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_builder_cuda_graph_replay(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    rng = np.random.default_rng(5)
    n_max, t = 2048, 65536
    for merge in (False, True):
        cfg = TileConfig(merge_short=merge)
        m = max_work_items(t, n_max, cfg)
        cu_buf = torch.zeros(n_max + 1, dtype=torch.int32, device="cuda")
        cu_buf[1:] = 100
        torch.cumsum(cu_buf, 0, out=cu_buf)
        out = WorkList(items=torch.empty((m, 4), dtype=torch.int32, device="cuda"),
                       num_items=torch.empty(1, dtype=torch.int32, device="cuda"), max_items=m, config=cfg)
        build_work_list(cu_buf, t, cfg, validate=False, out=out, backend=backend)  # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            build_work_list(cu_buf, t, cfg, validate=False, out=out, backend=backend)
        for _ in range(4):
            n = int(rng.integers(1, n_max + 1))
            lens = rng.integers(1, t // n + 1, size=n)
            cu = _cu(lens)
            host = np.full(n_max + 1, cu[-1])
            host[: n + 1] = cu
            cu_buf.copy_(torch.tensor(host, dtype=torch.int32))
            out.items.fill_(123)
            g.replay()
            torch.cuda.synchronize()
            assert np.array_equal(out.to_numpy(), build_work_list_host(cu, cfg))


@pytest.mark.gpu
def test_work_list_builder_cuda_graph():
    rng = np.random.default_rng(9)
    for merge in (False, True):
        builder = WorkListBuilder(1024, 65536, TileConfig(merge_short=merge), device="cuda")
        assert builder.use_graph
        _check_builder(builder, rng, 8, "cuda")
        assert builder._graph is not None


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("merge_short", [True, False])
def test_walked_tiles_are_the_kernels_walk(causal, merge_short):
    """walked_tiles (the simulator's time unit) == the key tiles a forward program of the kernels
    walks (kernels/tiles.py host mirror), on random rows with unaligned documents; equal to the
    cost column when every document starts on a BLOCK_N boundary, never larger."""
    from flamia_pack.kernels.tiles import program_geometry_host
    from flamia_pack.scheduler.worklist import walked_tiles

    rng = np.random.default_rng(7)
    cfg = TileConfig(block_m=128, block_n=64, causal=causal, merge_short=merge_short)
    for _ in range(20):
        lens = rng.integers(1, 700, size=int(rng.integers(1, 40)))
        cu = np.concatenate([[0], np.cumsum(lens)])
        items = build_work_list_numba(cu, cfg)
        w = walked_tiles(items, cu, cfg)
        g = program_geometry_host(items, cu, wl_block_m=128, block_rows=128, block_other=64,
                                  rows_are_keys=False, causal=causal)
        np.testing.assert_array_equal(w, g["n_tiles"])
        assert (w <= items[:, 3]).all() and (w >= 1).all()
        aligned = np.concatenate([[0], np.cumsum(lens * 64)])
        it2 = build_work_list_numba(aligned, cfg)
        np.testing.assert_array_equal(walked_tiles(it2, aligned, cfg), it2[:, 3])


def test_build_work_list_rejects_bad_arguments_and_hints():
    """``build_work_list``'s host arguments and the hints the kernels trust (``min_seqlen``,
    ``doc_tokens``) are checked without a sync: ints in range, numpy ints accepted, bool / float /
    str / None rejected with the name and the allowed range (a fresh user's report, 2026-11-30)."""
    import numpy as np

    from flamia_pack.errors import FlamiaError, MetadataError
    from flamia_pack.scheduler.worklist import TileConfig, build_work_list

    cu = torch.tensor([0, 100, 1000], dtype=torch.int32)
    bad = [({"min_seqlen": "7"}, "min_seqlen"), ({"min_seqlen": float("nan")}, "min_seqlen"),
           ({"min_seqlen": 5000}, "min_seqlen"), ({"min_seqlen": 0}, "min_seqlen"), ({"min_seqlen": True}, "min_seqlen"),
           ({"min_seqlen": 1001, "doc_tokens": 1000}, "min_seqlen"), ({"doc_tokens": True}, "doc_tokens"),
           ({"doc_tokens": 1025}, "doc_tokens"), ({"max_items": -1}, "max_items"), ({"max_items": 2.5}, "max_items")]
    for kw, name in bad:
        with pytest.raises(MetadataError, match=name):
            build_work_list(cu, 1024, validate=False, **kw)
    from flamia_pack.kernels.attention import build_attention_work_list

    for total in (None, 1024.7, "1024", True, -5, "abc"):
        with pytest.raises(MetadataError, match="total_tokens"):
            build_work_list(cu, total, validate=False)
        # the attention wrapper passes it through unconverted (int() turned 20.7 and "20" into 20)
        with pytest.raises(MetadataError, match="total_tokens"):
            build_attention_work_list(cu, total, causal=True, head_dim=128, validate=False)
    with pytest.raises(FlamiaError, match="TileConfig"):
        build_work_list(cu, 1024, {"block_m": 128})
    with pytest.raises(MetadataError, match="meta"):
        build_work_list(torch.zeros(3, dtype=torch.int32, device="meta"), 8)
    wl = build_work_list(cu, np.int64(1024), TileConfig(), validate=False, min_seqlen=np.int64(100),
                         doc_tokens=np.int32(1000))
    assert (wl.total_tokens, wl.min_seqlen, wl.doc_tokens) == (1024, 100, 1000)
    assert all(type(x) is int for x in (wl.total_tokens, wl.min_seqlen, wl.doc_tokens))


def test_build_work_list_checks_max_seqlen_in_its_validation():
    """``build_work_list(max_seqlen=)``: checked against the longest document in the one host copy of
    ``validate=True``, type-checked always, ignored (unchecked against the data) with ``validate=False``."""
    cu = torch.tensor([0, 5, 305, 400], dtype=torch.int32)
    build_work_list(cu, 400, max_seqlen=300)
    with pytest.raises(MetadataError, match="max_seqlen=299 is smaller than the longest document"):
        build_work_list(cu, 400, max_seqlen=299)
    build_work_list(cu, 400, max_seqlen=299, validate=False)
    for bad in (-1, 1.5, True, "300"):
        with pytest.raises(MetadataError, match="max_seqlen"):
            build_work_list(cu, 400, max_seqlen=bad)
