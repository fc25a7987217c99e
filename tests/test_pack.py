"""Packing core (flamia_pack/pack.py; DESIGN.md §3, issue 2): invariants and regressions.

Property tests give every input token a distinct id (its global index), so "every token exactly
once, in order inside each piece, or counted as dropped" can be checked exactly from the output.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, SourceError
from flamia_pack.pack import (
    PackConfig,
    PackedRows,
    PackStats,
    _bfd,
    fill_rows,
    pack_documents,
    pack_flat,
    plan_packing,
)
from flamia_pack.varlen import validate_cu_seqlens


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _distinct_docs(lengths):
    """Documents whose tokens are their global index (all distinct, >= 0)."""
    docs, start = [], 0
    for n in lengths:
        docs.append(np.arange(start, start + n, dtype=np.int64))
        start += n
    return docs


def _expected_kept(doc: np.ndarray, cfg: PackConfig) -> np.ndarray:
    if doc.size > cfg.capacity and cfg.long_docs == "truncate":
        return doc[: cfg.capacity]
    if doc.size > cfg.capacity and cfg.long_docs == "drop":
        return doc[:0]
    return doc


def _reference_bfd_used(lengths, cfg: PackConfig) -> list[int]:
    """Sorted tokens-used per row from a plain O(n^2) best-fit-decreasing (pieces per policy).

    Rows with equal free space are interchangeable for every later decision, so the multiset of
    row fills does not depend on how ties between such rows are broken.
    """
    cap = cfg.capacity
    pieces = []
    for n in lengths:
        if n == 0:
            continue
        if n <= cap:
            pieces.append(n)
        elif cfg.long_docs == "split":
            pieces += [cap] * (n // cap) + ([n % cap] if n % cap else [])
        elif cfg.long_docs == "truncate":
            pieces.append(cap)
    free: list[int] = []
    for n in sorted(pieces, reverse=True):
        fits = [i for i, f in enumerate(free) if f >= n]
        if fits:
            i = min(fits, key=lambda i: free[i])
            free[i] -= n
        else:
            free.append(cap - n)
    return sorted(cap - f for f in free)


def _pieces(lengths, cfg: PackConfig) -> list[tuple[int, int]]:
    """(length, doc) of every piece bfd/balanced place, in decreasing length, ties by doc/chunk."""
    cap, out = cfg.capacity, []
    for d, n in enumerate(lengths):
        if n > cap and cfg.long_docs == "drop":
            continue
        if n > cap and cfg.long_docs == "truncate":
            n = cap
        while n > 0:
            out.append((min(n, cap), d))
            n -= min(n, cap)
    return sorted(out, key=lambda t: -t[0])  # stable: ties keep (doc, chunk) order


def _reference_balanced(lengths, cfg: PackConfig) -> list[list[int]]:
    """Documents of each row under ``balanced``, by the definition: start with as many empty rows
    as bfd uses; each piece (decreasing length) goes to the fitting row of least sum(len**2),
    ties by row index; a new row only when none fits."""
    n_rows = len(_reference_bfd_used(lengths, cfg))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    cost, used = [0] * n_rows, [0] * n_rows
    for n, d in _pieces(lengths, cfg):
        fits = [r for r in range(len(rows)) if used[r] + n <= cfg.capacity]
        if fits:
            r = min(fits, key=lambda r: (cost[r], r))
        else:
            rows.append([])
            cost.append(0)
            used.append(0)
            r = len(rows) - 1
        rows[r].append(d)
        cost[r] += n * n
        used[r] += n
    return rows


def check_packed(docs, rows: PackedRows, cfg: PackConfig) -> None:
    """Every invariant of DESIGN.md §3 on one packing result."""
    cap = cfg.capacity
    n_rows = len(rows)
    st_ = rows.stats
    assert rows.input_ids.shape == (n_rows, cap) and rows.input_ids.dtype == np.int32
    assert rows.position_ids.shape == (n_rows, cap) and rows.position_ids.dtype == np.int32
    assert rows.num_tokens.dtype == np.int32 and rows.doc_offsets.dtype == np.int64
    assert rows.seg_lengths.dtype == np.int32 and rows.doc_ids.dtype == np.int64
    assert rows.chunk_ids.dtype == np.int32
    assert rows.doc_offsets[0] == 0 and rows.doc_offsets[-1] == rows.seg_lengths.size
    assert np.all(np.diff(rows.doc_offsets) >= 1), "a row without segments"

    pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
    for r in range(n_rows):
        row = rows.row(r)
        cu = row["cu_seqlens"]
        assert cu.dtype == np.int32
        used = int(row["num_tokens"])
        assert 1 <= used <= cap
        validate_cu_seqlens(cu, total_tokens=used)  # starts at 0, no zero-length segment, ends at used
        ids, pos = row["input_ids"], row["position_ids"]
        assert np.all(ids[used:] == cfg.pad_id) and np.all(pos[used:] == 0)
        for k in range(cu.size - 1):
            a, b = int(cu[k]), int(cu[k + 1])
            np.testing.assert_array_equal(pos[a:b], np.arange(b - a))
            d, c = int(row["doc_ids"][k]), int(row["chunk_ids"][k])
            pieces.setdefault(d, []).append((c, ids[a:b].astype(np.int64)))

    tokens_dropped = 0
    docs_split = docs_truncated = docs_dropped = docs_empty = 0
    for d, doc in enumerate(docs):
        doc = np.asarray(doc, dtype=np.int64)
        kept = _expected_kept(doc, cfg)
        tokens_dropped += doc.size - kept.size
        docs_empty += doc.size == 0
        docs_dropped += doc.size > cap and cfg.long_docs == "drop"
        docs_truncated += doc.size > cap and cfg.long_docs == "truncate"
        got = sorted(pieces.pop(d, []), key=lambda t: t[0])
        if kept.size == 0:
            assert not got, f"document {d} should not appear"
            continue
        assert [c for c, _ in got] == list(range(len(got))), f"chunk ids of document {d}"
        np.testing.assert_array_equal(np.concatenate([t for _, t in got]), kept)
        docs_split += len(got) > 1
        if cfg.algorithm in ("bfd", "balanced"):
            # never split unless longer than capacity; full-capacity pieces, remainder last
            if kept.size <= cap:
                assert len(got) == 1
            else:
                assert all(t.size == cap for _, t in got[:-1])
    assert not pieces, f"unknown document ids {sorted(pieces)}"

    assert st_.docs_in == len(docs)
    assert st_.docs_empty == docs_empty and st_.docs_dropped == docs_dropped
    assert st_.docs_truncated == docs_truncated and st_.docs_split == docs_split
    assert st_.docs_packed == len(docs) - docs_empty - docs_dropped
    total = sum(len(d) for d in docs)
    assert st_.tokens_in == total and st_.tokens_dropped == tokens_dropped
    assert st_.tokens_packed == total - tokens_dropped == int(rows.num_tokens.sum())
    assert st_.tokens_dropped == sum(st_.dropped_reasons.values())
    assert st_.rows == n_rows and st_.capacity == cap
    assert st_.fill == pytest.approx(st_.tokens_packed / (n_rows * cap) if n_rows else 0.0)
    if cfg.algorithm == "concat":
        assert np.all(rows.num_tokens[:-1] == cap), "concat: every row but the last is full"
    if cfg.algorithm == "bfd" and n_rows >= 2:
        # any-fit property: a row was opened only when its first piece fit in no earlier row
        two = np.sort(rows.num_tokens.astype(np.int64))[:2]
        assert two.sum() > cap


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------
_cfg = st.builds(
    lambda cap, alg, ld, pad: PackConfig(capacity=cap, algorithm=alg, long_docs=ld, pad_id=pad),
    st.integers(1, 48),
    st.sampled_from(["bfd", "concat", "balanced"]),
    st.sampled_from(["split", "truncate", "drop"]),
    st.sampled_from([0, 1, 7]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_cfg, data=st.data())
def test_pack_invariants(cfg: PackConfig, data) -> None:
    lengths = data.draw(st.lists(st.integers(0, 3 * cfg.capacity + 2), max_size=40), label="lengths")
    docs = _distinct_docs(lengths)
    as_lists = data.draw(st.booleans(), label="as_lists")
    rows = pack_documents([d.tolist() for d in docs] if as_lists else iter(docs), cfg)
    check_packed(docs, rows, cfg)
    # the plan from lengths alone describes exactly the same layout
    plan = plan_packing(np.array(lengths, dtype=np.int64), cfg)
    np.testing.assert_array_equal(plan.seg_doc, rows.doc_ids)
    np.testing.assert_array_equal(plan.row_used, rows.num_tokens)
    assert plan.stats == rows.stats


@settings(max_examples=150, deadline=None)
@given(cfg=_cfg, data=st.data())
def test_bfd_matches_reference_fill(cfg: PackConfig, data) -> None:
    """Row fills equal those of a plain best-fit-decreasing (a fill multiset, tie-independent)."""
    cfg = PackConfig(capacity=cfg.capacity, long_docs=cfg.long_docs)
    lengths = data.draw(st.lists(st.integers(0, 2 * cfg.capacity), max_size=60), label="lengths")
    plan = plan_packing(np.array(lengths, dtype=np.int64), cfg)
    assert sorted(plan.row_used.tolist()) == _reference_bfd_used(lengths, cfg)


@settings(max_examples=150, deadline=None)
@given(cfg=_cfg, data=st.data())
def test_balanced_matches_reference(cfg: PackConfig, data) -> None:
    """Row by row, the same documents in the same order as the plain definition of ``balanced``."""
    cfg = PackConfig(capacity=cfg.capacity, algorithm="balanced", long_docs=cfg.long_docs)
    lengths = data.draw(st.lists(st.integers(0, 2 * cfg.capacity), max_size=50), label="lengths")
    plan = plan_packing(np.array(lengths, dtype=np.int64), cfg)
    got = [plan.seg_doc[plan.row_offsets[r]:plan.row_offsets[r + 1]].tolist() for r in range(plan.n_rows)]
    assert got == _reference_balanced(lengths, cfg)


def test_balanced_evens_cost_at_bfd_fill() -> None:
    lengths = np.random.default_rng(2).lognormal(6.5, 1.0, 20_000).astype(np.int64)
    costs, rows = {}, {}
    for alg in ("bfd", "balanced"):
        plan = plan_packing(lengths, PackConfig(capacity=65536, algorithm=alg))
        c = np.zeros(plan.n_rows)
        np.add.at(c, plan.seg_row, plan.seg_len.astype(np.float64) ** 2)
        costs[alg], rows[alg] = c, plan.n_rows
    assert rows["balanced"] <= rows["bfd"] + 1
    b, r = costs["bfd"], costs["balanced"]
    assert r.min() / r.mean() > 4 * (b.min() / b.mean())
    assert np.percentile(r, 99) / r.mean() < np.percentile(b, 99) / b.mean()


@settings(max_examples=100, deadline=None)
@given(cap=st.integers(1, 40), data=st.data())
def test_bfd_bucket_index_and_scan_agree(cap: int, data) -> None:
    """The two best-fit-decreasing implementations (bucket bitmap; open-row scan used above
    2**24 tokens of capacity) place pieces in the same order and give identical row fills."""
    piece_len = np.array(data.draw(st.lists(st.integers(1, cap), max_size=80), label="pieces"), dtype=np.int32)
    o1, row1, start1, used1 = _bfd(piece_len, cap, bucket_index=True)
    o2, row2, start2, used2 = _bfd(piece_len, cap, bucket_index=False)
    np.testing.assert_array_equal(o1, o2)
    assert sorted(used1.tolist()) == sorted(used2.tolist())
    for row, start, used in ((row1, start1, used1), (row2, start2, used2)):
        # pieces of a row tile it from 0 without gaps or overlap
        for r in range(used.size):
            sel = np.flatnonzero(row == r)
            spans = sorted(zip(start[sel].tolist(), piece_len[sel].tolist()))
            assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
            assert spans[-1][0] + spans[-1][1] == used[r] <= cap


def test_bfd_huge_capacity_uses_scan() -> None:
    cfg = PackConfig(capacity=2**31 - 1)
    plan = plan_packing(np.array([5, 0, 2**31 - 1, 7, 2**30]), cfg)
    assert plan.stats.rows == 2 and plan.stats.tokens_packed == 2**31 - 1 + 2**30 + 12
    assert sorted(plan.row_used.tolist()) == [2**30 + 12, 2**31 - 1]


@settings(max_examples=100, deadline=None)
@given(cfg=_cfg, data=st.data())
def test_pack_flat_equals_pack_documents(cfg: PackConfig, data) -> None:
    lengths = data.draw(st.lists(st.integers(0, 2 * cfg.capacity), max_size=30), label="lengths")
    docs = _distinct_docs(lengths)
    lead = data.draw(st.integers(0, 3), label="lead")  # a sliced Arrow array: offsets[0] > 0
    flat = np.concatenate([np.full(lead, 99, dtype=np.int32)] + [d.astype(np.int32) for d in docs])
    offsets = lead + np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    a = pack_flat(flat, offsets, cfg)
    b = pack_documents(docs, cfg)
    for name in ("input_ids", "position_ids", "num_tokens", "doc_offsets", "seg_lengths", "doc_ids", "chunk_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    # streaming: the same rows block by block, written into one reused (poisoned) buffer pair
    block = data.draw(st.integers(1, 4), label="block")
    plan = plan_packing(np.diff(offsets), cfg)
    ids_buf = np.full((block, cfg.capacity), -77, dtype=np.int32)
    pos_buf = np.full((block, cfg.capacity), -77, dtype=np.int32)
    for r0 in range(0, plan.n_rows, block):
        r1 = min(r0 + block, plan.n_rows)
        ids_buf.fill(-77)
        pos_buf.fill(-77)
        part = fill_rows(plan, flat, offsets, cfg, r0, r1, input_ids=ids_buf, position_ids=pos_buf)
        assert len(part) == r1 - r0 and np.shares_memory(part.input_ids, ids_buf)
        np.testing.assert_array_equal(part.input_ids, a.input_ids[r0:r1])
        np.testing.assert_array_equal(part.position_ids, a.position_ids[r0:r1])
        for r in range(r1 - r0):
            np.testing.assert_array_equal(part.cu_seqlens(r), a.cu_seqlens(r0 + r))
            np.testing.assert_array_equal(part.row(r)["doc_ids"], a.row(r0 + r)["doc_ids"])


# ---------------------------------------------------------------------------------------------
# regressions from issue 2
# ---------------------------------------------------------------------------------------------
def test_capacity_2k_plus_1_packs_as_tightly() -> None:
    lengths = np.random.default_rng(0).lognormal(6.5, 1.0, 20_000).astype(np.int64)
    r8192 = plan_packing(lengths, PackConfig(capacity=8192)).stats.rows
    r8193 = plan_packing(lengths, PackConfig(capacity=8193)).stats.rows
    assert r8193 <= r8192 * 1.01


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_split_loses_nothing(algorithm: str) -> None:
    docs = _distinct_docs([4, 2, 3, 1])
    cfg = PackConfig(capacity=3, algorithm=algorithm)
    rows = pack_documents(docs, cfg)
    check_packed(docs, rows, cfg)
    assert rows.stats.tokens_packed == 10 and rows.stats.tokens_dropped == 0
    assert rows.stats.rows == 4 and rows.stats.docs_split == 1


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_empty_documents_counted_and_skipped(algorithm: str) -> None:
    docs = [[], [5], np.array([], dtype=np.int64), [6]]
    cfg = PackConfig(capacity=4, algorithm=algorithm)
    rows = pack_documents(docs, cfg)
    check_packed(docs, rows, cfg)
    assert rows.stats.docs_empty == 2 and rows.stats.docs_packed == 2 and len(rows) == 1
    np.testing.assert_array_equal(rows.cu_seqlens(0), [0, 1, 2])
    assert sorted(rows.doc_ids.tolist()) == [1, 3]


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_exactly_full_row_has_no_extra_boundary(algorithm: str) -> None:
    rows = pack_documents([[1, 2, 3], [4, 5]], PackConfig(capacity=5, algorithm=algorithm))
    assert len(rows) == 1
    np.testing.assert_array_equal(rows.cu_seqlens(0), [0, 3, 5])
    np.testing.assert_array_equal(rows.position_ids[0], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(rows.input_ids[0], [1, 2, 3, 4, 5])
    # a document that is exactly capacity long is one segment, not split
    rows = pack_documents([np.arange(5)], PackConfig(capacity=5, algorithm=algorithm))
    np.testing.assert_array_equal(rows.cu_seqlens(0), [0, 5])
    assert rows.stats.docs_split == 0


def test_long_doc_policies_count_dropped_tokens() -> None:
    docs = _distinct_docs([7, 2, 10])
    trunc = pack_documents(docs, PackConfig(capacity=4, long_docs="truncate"))
    assert trunc.stats.dropped_reasons == {"long_doc_truncate": 3 + 6}
    assert trunc.stats.docs_truncated == 2 and trunc.stats.tokens_packed == 10
    drop = pack_documents(docs, PackConfig(capacity=4, long_docs="drop"))
    assert drop.stats.dropped_reasons == {"long_doc_drop": 17}
    assert drop.stats.docs_dropped == 2 and drop.stats.tokens_packed == 2
    split = pack_documents(docs, PackConfig(capacity=4))
    assert split.stats.dropped_reasons == {} and split.stats.tokens_dropped == 0
    # 10 = 4 + 4 + 2: pieces restart positions and carry chunk ids 0, 1, 2
    sel = split.doc_ids == 2
    assert split.chunk_ids[sel].tolist() == [0, 1, 2] or sorted(split.chunk_ids[sel].tolist()) == [0, 1, 2]
    assert sorted(split.seg_lengths[sel].tolist()) == [2, 4, 4]


def test_bfd_fill_lognormal() -> None:
    lengths = np.random.default_rng(1).lognormal(6.5, 1.0, 20_000).astype(np.int64)
    stats = plan_packing(lengths, PackConfig(capacity=65536)).stats
    assert stats.fill >= 0.99
    assert stats.tokens_packed == int(lengths.sum())


def test_all_empty_and_no_documents() -> None:
    for docs in ([], [[], []]):
        rows = pack_documents(docs, PackConfig(capacity=8))
        assert len(rows) == 0 and rows.input_ids.shape == (0, 8)
        assert rows.stats.fill == 0.0 and rows.stats.docs_empty == len(docs)
        assert rows.doc_offsets.tolist() == [0]


def test_stats_to_dict_roundtrip() -> None:
    rows = pack_documents(_distinct_docs([3, 9]), PackConfig(capacity=4, long_docs="truncate"))
    d = rows.stats.to_dict()
    assert PackStats(**d) == rows.stats
    assert d["dropped_reasons"] == {"long_doc_truncate": 5}


def test_row_accessors() -> None:
    rows = pack_documents([[1, 2], [3]], PackConfig(capacity=2, algorithm="concat"))
    assert len(rows) == 2
    np.testing.assert_array_equal(rows.row(-1)["input_ids"], [3, 0])
    with pytest.raises(IndexError):
        rows.row(2)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"capacity": -3},
        {"capacity": 1.5},
        {"capacity": True},
        {"capacity": "8"},
        {"capacity": 2**31},
        {"capacity": 8, "algorithm": "ffd"},
        {"capacity": 8, "long_docs": "keep"},
        {"capacity": 8, "pad_id": 2**31},
        {"capacity": 8, "pad_id": 0.5},
        {"capacity": 8, "pad_id": -1},  # written into input_ids: must be a token id (>= 0)
    ],
)
def test_bad_config(kwargs) -> None:
    with pytest.raises(FlamiaError):
        PackConfig(**kwargs)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = PackConfig(capacity=np.int64(16))
    assert type(cfg.capacity) is int
    with pytest.raises(Exception):
        cfg.capacity = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        PackConfig(16)  # type: ignore[misc]


@pytest.mark.parametrize(
    "docs, match",
    [
        ([[1, 2], [3, -1]], "document 1"),
        ([[1], [2], np.array([2**31], dtype=np.int64)], "document 2"),
        ([[1, 2], [1.5, 2.0]], "document 1"),
        ([np.zeros((2, 2), dtype=np.int64)], "document 0"),
        ([[1], "abc"], "document 1"),
        ([[1], [[1, 2], [3]]], "document 1"),
        ([np.array([1], dtype=np.uint64), np.array([-1], dtype=np.int64)], "document 1"),
        ([np.array([2**40], dtype=np.uint64), np.array([1], dtype=np.int64)], "document 0"),
        ([np.array([1], dtype=np.uint32), np.array([2**31], dtype=np.uint32)], "document 1"),
        ([np.array([3], dtype=np.int8), np.array([4, -2], dtype=np.int8)], "document 1"),
        ([[0], np.array([True])], "document 1"),
    ],
)
def test_bad_tokens(docs, match) -> None:
    with pytest.raises(SourceError, match=match):
        pack_documents(docs, PackConfig(capacity=4))


def test_bad_lengths_and_offsets() -> None:
    cfg = PackConfig(capacity=4)
    with pytest.raises(FlamiaError):
        plan_packing(np.array([1, -2]), cfg)
    with pytest.raises(FlamiaError):
        plan_packing(np.array([1.0, 2.0]), cfg)
    with pytest.raises(FlamiaError):
        plan_packing(np.array([1, 2]), {"capacity": 4})  # type: ignore[arg-type]
    with pytest.raises(SourceError):
        pack_flat(np.arange(4), np.array([0, 3, 2]), cfg)
    with pytest.raises(SourceError):
        pack_flat(np.arange(4), np.array([0, 5]), cfg)
    with pytest.raises(SourceError, match="document 1"):
        pack_flat(np.array([1, 2, -5]), np.array([0, 2, 3]), cfg)


def test_fill_rows_checks_copied_tokens_and_arguments() -> None:
    cfg = PackConfig(capacity=4)
    tokens = np.array([1, 2, 3, 4, -9, 6], dtype=np.int64)
    offsets = np.array([0, 3, 6])
    plan = plan_packing(np.diff(offsets), cfg)
    with pytest.raises(SourceError, match="document 1"):
        fill_rows(plan, tokens, offsets, cfg)
    with pytest.raises(FlamiaError):
        fill_rows(plan, tokens, offsets, cfg, 1, 0)
    with pytest.raises(FlamiaError):
        fill_rows(plan, tokens, offsets, cfg, 0, plan.n_rows + 1)
    with pytest.raises(FlamiaError):
        fill_rows(plan, tokens, offsets, PackConfig(capacity=5))
    with pytest.raises(FlamiaError):
        fill_rows(plan, tokens, offsets, cfg, input_ids=np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(FlamiaError):
        fill_rows(plan, tokens, offsets, cfg, position_ids=np.zeros((2, 8), dtype=np.int32)[:, ::2])


def test_row_buffers_larger_than_memory_raise_clear_error(monkeypatch):
    """capacity 2**31 - 1 on a few tokens was OOM-killed (exit 137) while padding one 8 GiB row;
    now row buffers beyond half the available memory raise FlamiaError before allocating."""
    import flamia_pack.pack as pack_mod

    docs = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)]
    monkeypatch.setattr(pack_mod, "_available_memory_bytes", lambda: 2 * 8 * 1000)  # room for 1,000 tokens
    ok = pack_mod.pack_documents(docs, PackConfig(capacity=1000))
    assert ok.input_ids.shape == (1, 1000) and ok.num_tokens.tolist() == [8]
    with pytest.raises(FlamiaError, match=r"1 row\(s\) x capacity 1001 need .* GiB .*available"):
        pack_mod.pack_documents(docs, PackConfig(capacity=1001))
    # caller-provided buffers allocate nothing, so they are not refused
    cfg = PackConfig(capacity=1001)
    plan = pack_mod.plan_packing(np.array([5, 3]), cfg)
    buf = np.empty((1, 1001), dtype=np.int32), np.empty((1, 1001), dtype=np.int32)
    rows = pack_mod.fill_rows(plan, np.concatenate(docs), np.array([0, 5, 8]), cfg,
                              input_ids=buf[0], position_ids=buf[1])
    assert rows.input_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
