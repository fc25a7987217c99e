"""PackedDataset / StreamingPackedDataset: order, sharding, exact resume, fill, errors (issue 6)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, FormatError, SourceError
from flamia_pack.formats import iter_rows, write_packed
from flamia_pack.loaders import PackedDataset, StreamingPackedDataset
from flamia_pack.pack import PackConfig, pack_documents

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")

CAP = 128
SAMPLE = "flamia_pack/data/python-stdlib.parquet"


def _docs(seed: int, n: int = 160, hi: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, hi, size=n)  # includes empty and longer-than-capacity documents
    return [rng.integers(0, 50_000, size=int(k), dtype=np.int32) for k in lens]


@pytest.fixture(scope="module")
def docs() -> list[np.ndarray]:
    return _docs(0)


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, docs):
    d = tmp_path_factory.mktemp("packed")
    write_packed(d, pack_documents(docs, PackConfig(capacity=CAP)), shard_rows=9)
    return d


def key(row) -> tuple:
    """Identity of a packed row: its (doc, chunk) segments (each segment exists exactly once)."""
    return tuple(zip(row["doc_ids"].tolist(), row["chunk_ids"].tolist()))


def keys(stream) -> list[tuple]:
    return [key(r) for r in stream]


# ---------------------------------------------------------------------------------------------
# PackedDataset: content and order
# ---------------------------------------------------------------------------------------------
def test_packed_rows_equal_the_written_rows(packed_dir):
    ds = PackedDataset(packed_dir)
    got = list(ds)
    ref = list(iter_rows(packed_dir))
    assert len(got) == len(ref) == ds.num_rows == len(ds) > 20
    for g, r in zip(got, ref):
        assert set(g) == set(r)
        for k in r:
            assert g[k].numpy().dtype == np.asarray(r[k]).dtype, k
            np.testing.assert_array_equal(g[k].numpy(), r[k])
        assert g["input_ids"].shape == (CAP,)


def test_shuffle_is_a_seeded_permutation_per_epoch(packed_dir):
    base = keys(PackedDataset(packed_dir, verify=False))
    a = PackedDataset(packed_dir, shuffle=True, seed=3, verify=False)
    e0 = keys(a)
    a.set_epoch(1)
    e1 = keys(a)
    b = PackedDataset(packed_dir, shuffle=True, seed=3, verify=False)
    assert keys(b) == e0  # same seed, same epoch -> same order
    assert sorted(e0) == sorted(e1) == sorted(base)
    assert e0 != base and e1 != e0
    c = PackedDataset(packed_dir, shuffle=True, seed=4, verify=False)
    assert keys(c) != e0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharding_covers_every_row_once(packed_dir, world_size, num_workers):
    from torch.utils.data import DataLoader

    seen: list[tuple] = []
    for rank in range(world_size):
        ds = PackedDataset(packed_dir, shuffle=True, seed=1, rank=rank, world_size=world_size, verify=False)
        ds.set_epoch(2)
        got = keys(DataLoader(ds, batch_size=None, num_workers=num_workers))
        assert len(got) == len(ds)  # len() is this rank's share
        seen += got
    assert Counter(seen) == Counter(keys(PackedDataset(packed_dir, verify=False)))


def test_rank_from_torch_distributed(packed_dir, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)
    ds = PackedDataset(packed_dir, verify=False)
    ref = PackedDataset(packed_dir, rank=1, world_size=3, verify=False)
    assert keys(ds) == keys(ref) and len(ds) == len(ref) < ds.num_rows


# ---------------------------------------------------------------------------------------------
# exact resume (torchdata StatefulDataLoader, workers included)
# ---------------------------------------------------------------------------------------------
def _make(kind: str, packed_dir, docs):
    if kind == "packed":
        return PackedDataset(packed_dir, shuffle=True, seed=7, verify=False)
    return StreamingPackedDataset(docs, capacity=CAP, buffer_docs=6, shuffle=True, seed=7)


def _take(loader, n: int) -> tuple[list, dict]:
    """First n items of a fresh iteration of ``loader`` (flattened to row keys) and its state."""
    out = []
    it = iter(loader)
    for _ in range(n):
        try:
            b = next(it)
        except StopIteration:
            break
        out.append(_batch_key(b))
    return out, loader.state_dict()


def _batch_key(b):
    if isinstance(b, dict):
        return key(b)
    return tuple(key(r) for r in b)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kind=st.sampled_from(["packed", "streaming"]),
    num_workers=st.sampled_from([0, 1, 2]),
    batched=st.booleans(),
    stops=st.lists(st.integers(0, 40), min_size=1, max_size=2),
)
def test_exact_resume_property(packed_dir, docs, kind, num_workers, batched, stops):
    """Stop at random points, save, load into a NEW loader + dataset, continue; repeated cycles
    must give exactly the uninterrupted stream (no replay, nothing skipped)."""
    kw = dict(batch_size=2, collate_fn=list) if batched else dict(batch_size=None)
    full = [_batch_key(b) for b in StatefulDataLoader(_make(kind, packed_dir, docs), num_workers=num_workers, **kw)]
    assert len(full) > 20
    got: list = []
    state = None
    for n in stops:
        loader = StatefulDataLoader(_make(kind, packed_dir, docs), num_workers=num_workers, **kw)
        if state is not None:
            loader.load_state_dict(state)
        part, state = _take(loader, n)
        got += part
        del loader
    loader = StatefulDataLoader(_make(kind, packed_dir, docs), num_workers=num_workers, **kw)
    loader.load_state_dict(state)
    got += [_batch_key(b) for b in loader]
    assert got == full


@pytest.mark.parametrize("kind", ["packed", "streaming"])
def test_dataset_state_roundtrip_without_loader(packed_dir, docs, kind):
    """The dataset's own state_dict: JSON-able, resumes exactly; a finished epoch moves on."""
    ds = _make(kind, packed_dir, docs)
    ds.set_epoch(3)
    full = keys(ds)
    assert ds.epoch == 4  # ran to the end: the next iter() is the next epoch
    epoch4 = keys(ds)
    assert epoch4 != full  # another epoch, another shuffle
    ds.set_epoch(3)
    it = iter(ds)
    head = [key(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(ds.state_dict()))
    ds2 = _make(kind, packed_dir, docs)
    ds2.load_state_dict(state)
    ds2.set_epoch(3)  # same epoch as the checkpoint: keeps the pending resume
    assert head + keys(ds2) == full
    end_state = json.loads(json.dumps(ds2.state_dict()))
    ds3 = _make(kind, packed_dir, docs)
    ds3.load_state_dict(end_state)  # saved at the end of epoch 3: resumes at the start of epoch 4
    assert keys(ds3) == epoch4


def test_packed_dataset_bool_arguments_must_be_bools(packed_dir):
    """shuffle="yes" (or "no": bool("no") is True) was accepted and silently shuffled."""
    for kw in ({"shuffle": "yes"}, {"shuffle": 1}, {"verify": "no"}):
        (name, value), = kw.items()
        with pytest.raises(FlamiaError, match=f"{name} must be a bool \\(True or False\\), got {value!r}"):
            PackedDataset(packed_dir, **kw)
    assert PackedDataset(packed_dir, shuffle=np.bool_(True), verify=False).shuffle is True


def test_resume_refuses_another_configuration(packed_dir, docs):
    ds = PackedDataset(packed_dir, shuffle=True, seed=1, verify=False)
    state = ds.state_dict()
    with pytest.raises(FlamiaError, match="seed"):
        PackedDataset(packed_dir, shuffle=True, seed=2, verify=False).load_state_dict(state)
    with pytest.raises(FlamiaError, match="world_size"):
        PackedDataset(packed_dir, shuffle=True, seed=1, rank=0, world_size=2, verify=False).load_state_dict(state)
    with pytest.raises(FlamiaError, match="not a StreamingPackedDataset"):
        StreamingPackedDataset(docs, capacity=CAP).load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# StreamingPackedDataset: packing invariants and fill
# ---------------------------------------------------------------------------------------------
def _check_rows_cover_docs(rows, docs, capacity, pad_id=0):
    pieces: dict[int, dict[int, np.ndarray]] = {}
    for r in rows:
        ids, pos, cu, n = r["input_ids"].numpy(), r["position_ids"].numpy(), r["cu_seqlens"].numpy(), int(r["num_tokens"])
        assert ids.shape == (capacity,) and cu[0] == 0 and cu[-1] == n and np.all(np.diff(cu) > 0)
        assert np.all(ids[n:] == pad_id) and np.all(pos[n:] == 0)
        for k, (d, c) in enumerate(zip(r["doc_ids"].tolist(), r["chunk_ids"].tolist())):
            a, b = cu[k], cu[k + 1]
            np.testing.assert_array_equal(pos[a:b], np.arange(b - a))
            assert c not in pieces.setdefault(d, {})
            pieces[d][c] = ids[a:b]
    for i, doc in enumerate(docs):
        if len(doc) == 0:
            assert i not in pieces
            continue
        chunks = pieces.pop(i)
        assert sorted(chunks) == list(range(len(chunks)))
        np.testing.assert_array_equal(np.concatenate([chunks[c] for c in range(len(chunks))]), doc)
    assert not pieces


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("buffer_docs", [1, 4, 64])
def test_streaming_every_token_exactly_once(docs, shuffle, buffer_docs):
    ds = StreamingPackedDataset(docs, capacity=CAP, buffer_docs=buffer_docs, shuffle=shuffle, seed=2, pad_id=7)
    rows = list(ds)
    _check_rows_cover_docs(rows, docs, CAP, pad_id=7)
    s = ds.stats
    assert s["rows"] == len(rows)
    assert s["tokens_packed"] == sum(len(d) for d in docs) == sum(int(r["num_tokens"]) for r in rows)
    assert s["fill"] == pytest.approx(s["tokens_packed"] / (len(rows) * CAP))
    assert s["docs_empty"] == sum(len(d) == 0 for d in docs)
    assert s["docs_split"] == sum(len(d) > CAP for d in docs)


def test_streaming_buffer_is_bounded_and_trades_memory_for_fill(docs):
    fills = {}
    for b in (1, 8, 128):
        ds = StreamingPackedDataset(docs, capacity=CAP, buffer_docs=b)
        peak = held = 0
        for _ in ds:
            peak = max(peak, ds.stats["buffered_docs"])
            held = max(held, ds.stats["held_docs"])
        assert peak <= b
        assert held <= b + 3  # tokens kept only for buffered pieces (+ a split document's rows)
        assert ds.stats["held_docs"] == 0
        fills[b] = ds.stats["fill"]
    assert fills[1] < fills[8] <= fills[128] + 1e-9
    # the offline best-fit-decreasing packer over everything is an upper reference for the fill
    assert fills[128] <= pack_documents(docs, PackConfig(capacity=CAP)).stats.fill + 0.02


def test_streaming_long_doc_policies(docs):
    for policy in ("truncate", "drop"):
        ds = StreamingPackedDataset(docs, capacity=CAP, long_docs=policy)
        rows = list(ds)
        assert all(int(r["num_tokens"]) <= CAP for r in rows)
        ref = pack_documents(docs, PackConfig(capacity=CAP, long_docs=policy)).stats
        assert ds.stats["tokens_packed"] == ref.tokens_packed
        assert ds.stats["tokens_dropped"] == ref.tokens_dropped


@pytest.mark.parametrize("world_size,num_workers", [(2, 0), (1, 2), (2, 2)])
def test_streaming_sharding_covers_every_doc_once(docs, world_size, num_workers):
    from torch.utils.data import DataLoader

    rows = []
    for rank in range(world_size):
        ds = StreamingPackedDataset(docs, capacity=CAP, buffer_docs=8, rank=rank, world_size=world_size)
        rows += list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    _check_rows_cover_docs(rows, docs, CAP)


def test_streaming_reads_the_bundled_sample():
    ds = StreamingPackedDataset(SAMPLE, capacity=4096, buffer_docs=32)
    it = iter(ds)
    rows = [next(it) for _ in range(4)]
    assert all(r["input_ids"].max() < 256 for r in rows)  # byte tokenizer
    assert ds.stats["rows"] == 4 and ds.stats["fill"] > 0.5
    it.close()


def test_streaming_bad_input():
    with pytest.raises(SourceError, match="not found"):
        StreamingPackedDataset("/nonexistent/x.parquet", capacity=8)
    with pytest.raises(FlamiaError, match="capacity"):
        StreamingPackedDataset([[1, 2]], capacity=0)
    with pytest.raises(FlamiaError, match="long_docs"):
        StreamingPackedDataset([[1, 2]], capacity=8, long_docs="wrap")
    with pytest.raises(FlamiaError, match=r"shuffle must be a bool \(True or False\), got 'no' \(str\)"):
        StreamingPackedDataset([[1, 2]], capacity=8, shuffle="no")
    with pytest.raises(SourceError, match="document 1"):
        list(StreamingPackedDataset([[1, 2], [-1]], capacity=8))


# ---------------------------------------------------------------------------------------------
# PackedDataset: broken directories give clear FormatErrors
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def broken_dir(tmp_path, docs):
    write_packed(tmp_path, pack_documents(docs[:60], PackConfig(capacity=CAP)), shard_rows=5)
    return tmp_path


def test_missing_manifest(tmp_path):
    with pytest.raises(FormatError, match="manifest"):
        PackedDataset(tmp_path)


def test_bad_manifest(broken_dir):
    (broken_dir / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        PackedDataset(broken_dir)
    (broken_dir / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(FormatError, match="missing key"):
        PackedDataset(broken_dir)


def test_missing_shard(broken_dir):
    (broken_dir / "train-00001.parquet").unlink()
    with pytest.raises(FormatError, match="missing shard .*train-00001.parquet"):
        PackedDataset(broken_dir, verify=False)


def test_checksum_mismatch(broken_dir):
    p = broken_dir / "train-00000.parquet"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="checksum mismatch .*train-00000.parquet"):
        PackedDataset(broken_dir)


def test_row_count_disagrees_with_manifest(broken_dir):
    m = json.loads((broken_dir / "manifest.json").read_text())
    m["shards"][0]["rows"] += 1
    m["rows"] += 1
    (broken_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="rows"):
        PackedDataset(broken_dir, verify=False)


def test_no_random_access_is_a_clear_type_error(packed_dir):
    """ds[0] raised torch's 'Subclasses of Dataset should implement __getitem__' (regression)."""
    ds = PackedDataset(packed_dir)
    with pytest.raises(TypeError, match=r"PackedDataset is an IterableDataset and has no random access.*iterate it"):
        ds[0]
    with pytest.raises(TypeError, match="StreamingPackedDataset is an IterableDataset"):
        StreamingPackedDataset([[1, 2]], capacity=8)[0]
    assert key(next(iter(ds))) == key(next(iter_rows(packed_dir)))  # iteration is unaffected
