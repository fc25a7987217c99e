"""Packed shards that lost or mistyped a metadata column: every reader of a packed output raises one
FormatError naming the shard and the column (formats.iter_rows, load_packed, verify, PackedDataset,
`flamia plan`)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flamia_pack import formats
from flamia_pack.cli import app
from flamia_pack.errors import FormatError
from flamia_pack.pack import PackConfig, pack_documents

SHARD = "train-00001.parquet"


@pytest.fixture
def out(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, int(rng.integers(1, 90))).astype(np.int32) for _ in range(60)]
    packed = pack_documents(docs, PackConfig(capacity=64))
    formats.write_packed(tmp_path / "o", packed, shard_rows=8, source={"path": "t"}, tokenizer={"name": "pretokenized"},
                         algorithm="bfd", long_docs="split")
    return tmp_path / "o"


def _rewrite(path, table: pa.Table) -> None:
    """Rewrite a shard as a user with pyarrow would; the manifest's sha256 is left as it was."""
    pq.write_table(table, path)


def _drop(out, column: str) -> None:
    t = pq.read_table(out / SHARD)
    _rewrite(out / SHARD, t.drop_columns([column]))


def _retype(out, column: str, to: pa.DataType) -> None:
    t = pq.read_table(out / SHARD)
    i = t.schema.get_field_index(column)
    _rewrite(out / SHARD, t.set_column(i, column, t.column(column).cast(to)))


def _readers(out):
    from flamia_pack.loaders import PackedDataset

    return {
        "iter_rows": lambda: list(formats.iter_rows(out)),
        "iter_rows subset": lambda: list(formats.iter_rows(out, columns=["cu_seqlens"])),
        "load_packed": lambda: formats.load_packed(out, verify_checksums=False),
        "PackedDataset": lambda: list(PackedDataset(out, verify=False)),
    }


@pytest.mark.parametrize("column", ["cu_seqlens", "position_ids", "doc_ids", "num_tokens"])
def test_missing_column(out, column):
    _drop(out, column)
    for name, read in _readers(out).items():  # a subset without the column: the shard differs from the manifest
        with pytest.raises(FormatError) as e:
            read()
        msg = str(e.value)
        assert SHARD in msg and column in msg, (name, msg)
    with pytest.raises(FormatError, match="checksum"):
        formats.verify(out)


@pytest.mark.parametrize("column,to", [("cu_seqlens", pa.list_(pa.int64())), ("doc_ids", pa.list_(pa.int32())),
                                       ("num_tokens", pa.int64()), ("position_ids", pa.list_(pa.float32()))])
def test_mistyped_column(out, column, to):
    _retype(out, column, to)
    for name, read in _readers(out).items():
        with pytest.raises(FormatError) as e:
            read()
        msg = str(e.value)
        assert SHARD in msg and column in msg, (name, msg)
        assert ("mistyped" if name != "iter_rows subset" or column == "cu_seqlens" else "other columns") in msg


def test_extra_column_differs_from_manifest(out):
    """All needed columns with their types, plus one: the shard is not what the manifest describes."""
    t = pq.read_table(out / SHARD)
    _rewrite(out / SHARD, t.append_column("note", pa.array(["x"] * t.num_rows)))
    for read in (lambda: list(formats.iter_rows(out)), lambda: formats.load_packed(out, verify_checksums=False)):
        with pytest.raises(FormatError, match=f"{SHARD} has other columns than its manifest.*note"):
            read()
    # a shard rewritten unchanged (other bytes, same columns and types) still reads
    good = out / "train-00002.parquet"
    _rewrite(good, pq.read_table(good))
    formats.check_shard_schema(good, pq.read_schema(good), manifest=formats.read_manifest(out))


def test_plan_names_the_shard(out):
    _drop(out, "cu_seqlens")
    res = CliRunner().invoke(app, ["plan", str(out)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and SHARD in lines[0] and "cu_seqlens" in lines[0], res.stderr


def test_manifest_columns_are_checked_by_verify(out):
    """verify(): a manifest edited to list other columns than its shards hold is named."""
    m = json.loads((out / "manifest.json").read_text())
    m["columns"]["input_ids"] = "list<item: int64>"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="other columns than its manifest.*input_ids"):
        formats.verify(out)
