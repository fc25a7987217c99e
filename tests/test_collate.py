"""PackedCollator and to_device: compacted batch layout, labels inside documents, work list (issue 6)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.loaders import PackedCollator, cu_seqlens_from_position_ids, to_device
from flamia_pack.pack import PackConfig, pack_documents

IGN = -100


def make_row(lengths, capacity, *, pad_id=0, first_pos=0, seed=0, with_cu=True):
    """One packed row with documents of ``lengths`` (random ids >= 1), padded with ``pad_id``."""
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    ids = np.full(capacity, pad_id, np.int32)
    ids[:n] = rng.integers(1, 1000, size=n)
    pos = np.zeros(capacity, np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    for k, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        pos[a:b] = np.arange(b - a) + (first_pos if k == 0 else 0)
    row = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
           "num_tokens": torch.tensor(n, dtype=torch.int32),
           "doc_ids": torch.arange(len(lengths), dtype=torch.int64) + 100 * seed,
           "chunk_ids": torch.zeros(len(lengths), dtype=torch.int32)}
    if with_cu:
        row["cu_seqlens"] = torch.from_numpy(cu)
    return row


def naive_labels(rows, capacity, ignore_index=IGN):
    """Labels by brute force: walk the documents of each row in order (the compacted stream)."""
    out = []
    for r in rows:
        ids = r["input_ids"].tolist()
        cu = r["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            for t in range(a, b):
                out.append(ids[t + 1] if t + 1 < b else ignore_index)
    out += [ignore_index] * (len(rows) * capacity - len(out))
    return out


def test_flat_cu_seqlens_of_the_issue_example():
    rows = [make_row([3, 2], 5, seed=1), make_row([3, 2], 5, seed=2)]
    b = PackedCollator()(rows)
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8, 10]
    assert b["cu_seqlens"].dtype == torch.int32
    assert b["input_ids"].shape == (2, 5) and b["input_ids"].dtype == torch.int64
    assert b["max_seqlen"] == 3 and b["num_real_tokens"] == 10
    # no padding: the batch is exactly the stack of the rows
    assert torch.equal(b["input_ids"], torch.stack([r["input_ids"] for r in rows]).long())
    ids = b["input_ids"].view(-1).tolist()
    assert b["labels"].view(-1).tolist() == [ids[1], ids[2], IGN, ids[4], IGN, ids[6], ids[7], IGN, ids[9], IGN]


def test_row_end_padding_goes_to_the_tail_outside_all_documents():
    rows = [make_row([3, 2], 7, pad_id=9, seed=1), make_row([3, 2], 7, pad_id=9, seed=2)]
    b = PackedCollator(pad_id=9)(rows)
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8, 10]  # padding excluded, never a document
    assert b["num_real_tokens"] == 10 and b["input_ids"].shape == (2, 7)
    flat = b["input_ids"].view(-1)
    assert flat[:5].tolist() == rows[0]["input_ids"][:5].long().tolist()
    assert flat[5:10].tolist() == rows[1]["input_ids"][:5].long().tolist()
    assert flat[10:].tolist() == [9] * 4
    assert b["labels"].view(-1)[9:].tolist() == [IGN] * 5
    assert b["position_ids"].view(-1)[10:].tolist() == [0] * 4
    assert b["row_offsets"].tolist() == [0, 5, 10] and b["num_tokens"].tolist() == [5, 5]
    assert b["doc_ids"].tolist() == [100, 101, 200, 201]


def test_concat_continuation_row_start_is_a_boundary():
    """A row whose first piece continues a document (position_ids start at 5): the row start is a
    boundary, so its first token is never the target of the previous row's last token."""
    r0 = make_row([6], 6, seed=1)  # full row: a document that continues in the next row
    r1 = make_row([3, 2], 6, first_pos=6, seed=2, with_cu=False)  # continuation, then a new document
    b = PackedCollator()([r0, r1])
    assert b["cu_seqlens"].tolist() == [0, 6, 9, 11]  # cu_seqlens of r1 derived from its positions
    ids, labels = b["input_ids"].view(-1).tolist(), b["labels"].view(-1).tolist()
    assert labels == ids[1:6] + [IGN] + ids[7:9] + [IGN] + [ids[10], IGN, IGN]
    assert b["position_ids"].view(-1)[6:11].tolist() == [6, 7, 8, 0, 1]  # kept for RoPE
    assert cu_seqlens_from_position_ids(torch.tensor([5, 6, 7, 0, 1, 0, 0]), 6).tolist() == [0, 3, 5, 6]
    assert cu_seqlens_from_position_ids(torch.tensor([0, 0, 0]), 0).tolist() == [0]


def test_concat_packing_rows_from_the_packer():
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 500, size=int(n), dtype=np.int32) for n in rng.integers(1, 40, size=30)]
    pr = pack_documents(docs, PackConfig(capacity=16, algorithm="concat"))
    rows = [{k: torch.from_numpy(np.asarray(v)) for k, v in pr.row(r).items()} for r in range(len(pr))]
    b = PackedCollator()(rows[:4])
    assert b["labels"].view(-1).tolist() == naive_labels(rows[:4], 16)
    assert b["cu_seqlens"][-1].item() == sum(int(r["num_tokens"]) for r in rows[:4])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=4), min_size=1, max_size=4),
    capacity_extra=st.integers(0, 5),
    pad_id=st.integers(0, 3),
)
def test_labels_never_cross_documents(rows, capacity_extra, pad_id):
    cap = max([sum(r) for r in rows] + [1]) + capacity_extra
    batch_rows = [make_row(r, cap, pad_id=pad_id, seed=i) for i, r in enumerate(rows)]
    b = PackedCollator(pad_id=pad_id)(batch_rows)
    labels = b["labels"].view(-1)
    ids = b["input_ids"].view(-1)
    cu = b["cu_seqlens"].tolist()
    assert labels.tolist() == naive_labels(batch_rows, cap)
    # independent check: every target is the next token of the SAME segment
    seg = np.searchsorted(np.asarray(cu), np.arange(len(ids)), side="right") - 1
    for t in np.flatnonzero(labels.numpy() != IGN):
        assert seg[t] == seg[t + 1] and t + 1 < cu[-1] and labels[t] == ids[t + 1]
    assert cu[-1] == b["num_real_tokens"] == sum(map(sum, rows))
    assert b["max_seqlen"] == max([x for r in rows for x in r] + [0])
    assert np.all(ids.numpy()[cu[-1]:] == pad_id)


def test_scale_group_metadata_on_request():
    quant = pytest.importorskip("flamia_pack.quant")
    rows = [make_row([40, 3], 50, seed=1), make_row([33], 50, seed=2)]
    b = PackedCollator(scale_groups="block")(rows)
    ref = quant.scale_groups(b["cu_seqlens"], 100, "block")
    assert torch.equal(b["scale_group_id"], ref.group_id)
    assert torch.equal(b["scale_group_start"], ref.group_start)
    # groups of 32 tokens restart in every document, never span two; padding (76..99) has none
    assert b["scale_group_id"].tolist() == [0] * 32 + [1] * 8 + [2] * 3 + [3] * 32 + [4] + [-1] * 24
    plain = PackedCollator()(rows)  # off by default; to_device derives it on the device
    assert "scale_group_id" not in plain
    d = to_device(plain, "cpu", scale_groups="token")
    ref_tok = quant.scale_groups(plain["cu_seqlens"], 100, "token")
    assert torch.equal(d["scale_group_id"], ref_tok.group_id) and torch.equal(d["scale_group_start"], ref_tok.group_start)


def test_collate_errors():
    c = PackedCollator()
    with pytest.raises(FlamiaError, match="empty batch"):
        c([])
    with pytest.raises(FlamiaError, match="same capacity"):
        c([make_row([2], 4), make_row([2], 5)])
    bad = make_row([3, 2], 6)
    bad["cu_seqlens"] = torch.tensor([0, 3, 4], dtype=torch.int32)
    with pytest.raises(MetadataError, match="must equal"):
        c([bad])
    bad["cu_seqlens"] = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    with pytest.raises(MetadataError, match="zero-length"):
        c([bad])
    with pytest.raises(FlamiaError, match="scale_groups"):
        PackedCollator(scale_groups="tile")
    with pytest.raises(FlamiaError, match="scale_groups"):
        to_device(c([make_row([2], 4)]), "cpu", scale_groups="tile")


def test_to_device_cpu_builds_the_work_list():
    from flamia_pack.scheduler.worklist import TileConfig, build_work_list_host

    rows = [make_row([300, 17, 100], 512, seed=1), make_row([5, 200], 512, seed=2)]
    b = PackedCollator()(rows)
    cfg = TileConfig(block_m=128, block_n=128)
    d = to_device(b, "cpu", cfg)
    assert set(d) == set(b) | {"work_list"}
    wl = d["work_list"]
    want = build_work_list_host(b["cu_seqlens"].numpy(), cfg)
    np.testing.assert_array_equal(wl.to_numpy(), want)
    assert torch.equal(d["input_ids"], b["input_ids"]) and d["max_seqlen"] == b["max_seqlen"]
    # the shortest segment, from the host cu_seqlens (the kernels' leftover-launch hint)
    lengths = (b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist()
    assert wl.min_seqlen == min(x for x in lengths if x > 0) == 5
    from flamia_pack.scheduler.worklist import work_list_hints

    # stamped: the attention call trusts both; cu_seqlens[-1] == T tells it the row has no padding tail
    assert work_list_hints(wl) == (5, int(b["cu_seqlens"][-1]))


@pytest.mark.gpu
def test_to_device_cuda_is_sync_free():
    from flamia_pack.scheduler.worklist import TileConfig, build_work_list_host

    rows = [make_row([3000, 17, 1000], 8192, seed=1), make_row([5, 2000], 8192, seed=2)]
    b = PackedCollator()(rows)
    cfg = TileConfig()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = to_device(b, "cuda", cfg, scale_groups="block")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert d["input_ids"].is_cuda and d["cu_seqlens"].is_cuda
    np.testing.assert_array_equal(d["work_list"].to_numpy(), build_work_list_host(b["cu_seqlens"].numpy(), cfg))
    assert torch.equal(d["labels"].cpu(), b["labels"])
    assert torch.equal(d["scale_group_id"].cpu(), PackedCollator(scale_groups="block")(rows)["scale_group_id"])
    assert d["work_list"].min_seqlen == 5  # from the host copy, inside the sync-free region


def test_collate_rejects_values_it_used_to_cast_silently():
    """Float input_ids were truncated to int64, num_tokens=5.7 became 5, a 2-element num_tokens
    and a non-dict row raised bare TypeErrors (regression)."""
    def row(**kw):
        r = dict(input_ids=torch.arange(8), cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32), num_tokens=5)
        r.update(kw)
        return r

    c = PackedCollator()
    assert c([row()])["cu_seqlens"].tolist() == [0, 3, 5]
    assert c([row(num_tokens=np.int64(5))])["num_real_tokens"] == 5
    assert c([row(num_tokens=torch.tensor([5]))])["num_real_tokens"] == 5
    with pytest.raises(FlamiaError, match="input_ids must hold integer token ids, got dtype float32"):
        c([row(input_ids=torch.rand(8))])
    with pytest.raises(MetadataError, match="num_tokens must be one integer"):
        c([row(num_tokens=5.7)])
    with pytest.raises(MetadataError, match="num_tokens must be one integer"):
        c([row(num_tokens=torch.tensor([5, 5]))])
    with pytest.raises(FlamiaError, match="row 1 of the batch must be a dict"):
        c([row(), 7])


@pytest.mark.parametrize("bad", ["x", 1.5, None, True, 2**31, -1])
def test_collator_rejects_bad_pad_id(bad):
    """PackedCollator(pad_id='x') raised a raw ValueError from int(); 1.5 became 1 (regression)."""
    with pytest.raises(FlamiaError, match=r"pad_id must be an integer in \[0, 2147483647\]"):
        PackedCollator(pad_id=bad)


def test_collator_pad_id_and_ignore_index_accept_integers():
    c = PackedCollator(pad_id=np.int32(7), ignore_index=-1)
    b = c([make_row([2], 4, pad_id=7)])
    assert b["input_ids"][0, 2:].tolist() == [7, 7]
    assert b["labels"][0, 1:].tolist() == [-1, -1, -1]
    with pytest.raises(FlamiaError, match="ignore_index must be an integer"):
        PackedCollator(ignore_index="-100")


def test_to_device_rejects_a_config_that_is_not_a_tile_config():
    """to_device(batch, 'cpu', object()) raised AttributeError 'block_m' (regression)."""
    from flamia_pack.kernels.config import kernel_config, work_list_tile_config

    b = PackedCollator()([make_row([2, 1], 4)])
    with pytest.raises(FlamiaError, match="work_list_config must be a .*TileConfig or None, got object"):
        to_device(b, "cpu", object())
    kc = kernel_config(128, True)
    with pytest.raises(FlamiaError, match="got AttentionKernelConfig.*work_list_tile_config"):
        to_device(b, "cpu", kc)
    assert "work_list" in to_device(b, "cpu", work_list_tile_config(kc, True))


def test_to_device_rejects_bad_or_missing_devices():
    """A device string that is not a device, or CUDA on a machine without it, is a FlamiaError
    naming the problem (not torch's raw RuntimeError)."""
    from flamia_pack.errors import FlamiaError
    from flamia_pack.loaders.collate import to_device

    batch = {"input_ids": torch.zeros(4, dtype=torch.int64), "max_seqlen": 4}
    with pytest.raises(FlamiaError, match="device string"):
        to_device(batch, "gpu")
    if not torch.cuda.is_available():
        with pytest.raises(FlamiaError, match="no CUDA device is available"):
            to_device(batch, "cuda")
    assert to_device(batch, "cpu")["max_seqlen"] == 4


# ---------------------------------------------------------------------------------------------
# rows with position_ids but no num_tokens: row-end padding is never a document or a label


@pytest.mark.parametrize("pos_kind", ["zeros on padding", "arange"])
def test_padding_without_num_tokens_is_not_documents(pos_kind):
    ids = torch.tensor([11, 12, 13, 14, 15, 16, 0, 0, 0, 0])
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0, 0]) if pos_kind != "arange" else torch.arange(10)
    b = PackedCollator(pad_id=0)([{"input_ids": ids, "position_ids": pos}])
    assert b["cu_seqlens"].tolist() == [0, 6] and b["num_real_tokens"] == 6 and b["max_seqlen"] == 6
    assert b["labels"].view(-1).tolist() == [12, 13, 14, 15, 16] + [-100] * 5  # never the pad id
    assert b["num_tokens"].tolist() == [6] and b["doc_ids"].tolist() == [-1]
    # two documents (position restart) and padding, in a batch with a full row
    ids2 = torch.tensor([1, 2, 3, 4, 5, 0, 0, 0, 0, 0])
    pos2 = torch.tensor([0, 1, 2, 0, 1, 0, 0, 0, 0, 0]) if pos_kind != "arange" else torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5, 6])
    full = {"input_ids": torch.arange(1, 11), "position_ids": torch.arange(10)}
    b = PackedCollator(pad_id=0)([{"input_ids": ids2, "position_ids": pos2}, full])
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 15] and b["num_real_tokens"] == 15


def test_padding_without_num_tokens_from_attention_mask():
    """An attention_mask gives the real length, also when the last real token equals pad_id (EOS)."""
    ids = torch.tensor([11, 12, 2, 2, 2, 2])  # pad_id 2 = EOS: the document ends with one real EOS
    mask = torch.tensor([1, 1, 1, 0, 0, 0])
    c = PackedCollator(pad_id=2)
    b = c([{"input_ids": ids, "position_ids": torch.arange(6), "attention_mask": mask}])
    assert b["cu_seqlens"].tolist() == [0, 3] and b["labels"].view(-1).tolist() == [12, 2] + [-100] * 4
    # without the mask the trailing run of pad_id is padding: the EOS is lost, padding never counted
    b = c([{"input_ids": ids, "position_ids": torch.arange(6)}])
    assert b["cu_seqlens"].tolist() == [0, 2]
    with pytest.raises(MetadataError, match="attention_mask must be 1 on the real tokens then 0"):
        c([{"input_ids": ids, "position_ids": torch.arange(6), "attention_mask": torch.tensor([1, 0, 1, 0, 0, 0])}])
    with pytest.raises(MetadataError, match="attention_mask must have the shape"):
        c([{"input_ids": ids, "position_ids": torch.arange(6), "attention_mask": torch.ones(5)}])
    # all padding: an empty row, no document
    b = c([{"input_ids": torch.full((4,), 2), "position_ids": torch.zeros(4, dtype=torch.long)}])
    assert b["cu_seqlens"].tolist() == [0] and b["num_real_tokens"] == 0
