"""examples/train_tiny_gpt.py: a few CPU steps through the whole loader -> attention path (issue 6)."""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", ROOT / "examples" / "train_tiny_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_gpt_trains_on_cpu(example, tmp_path):
    out = tmp_path / "summary.json"
    s = example.main([
        "--device", "cpu", "--steps", "8", "--capacity", "256", "--batch-rows", "2", "--layers", "2",
        "--d-model", "64", "--heads", "2", "--lr", "1e-2", "--buffer-docs", "16", "--log-every", "2",
        "--warmup-steps", "1", "--no-progress", "--json", str(out),
    ])
    assert s == json.loads(out.read_text())
    losses = s["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.3  # starts at chance level for a byte vocabulary
    assert sum(losses[-2:]) / 2 < losses[0] - 0.2  # and learns
    assert s["tokens"] > 0 and s["tokens_per_s"] > 0 and s["data_wait_ms_mean"] >= 0
    assert s["attention"] == "varlen_attention (torch reference)"


def test_example_rejects_bad_steps(example):
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "0"])


def test_packed_input_with_a_larger_vocabulary_is_refused(example, tmp_path):
    """A `flamia pack --tokenizer` output has ids >= 256: a clear exit, not an embedding index error."""
    import numpy as np

    from flamia_pack import formats
    from flamia_pack.pack import PackConfig, pack_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(5, 60, size=20)]
    common = dict(shard_rows=4, source={"path": "test", "format": "synthetic"})
    big, small = tmp_path / "big", tmp_path / "small"
    formats.write_packed(big, pack_documents(docs, PackConfig(capacity=128)),
                         tokenizer={"name": "word", "vocab_size": 1000}, **common)
    with pytest.raises(SystemExit, match="vocab_size 1000"):
        example.main(["--device", "cpu", "--steps", "1", "--packed", str(big), "--no-progress"])
    docs = [d % 256 for d in docs]
    formats.write_packed(small, pack_documents(docs, PackConfig(capacity=128)),
                         tokenizer={"name": "bytes", "vocab_size": 256}, **common)
    s = example.main(["--device", "cpu", "--steps", "2", "--packed", str(small), "--layers", "1", "--d-model", "32",
                      "--heads", "2", "--warmup-steps", "1", "--no-progress"])
    assert s["capacity"] == 128 and len(s["losses"]) == 2


def test_pretokenized_source_with_ids_past_the_byte_vocabulary_exits_clearly(example, tmp_path):
    """A pre-tokenized --source with ids >= 256 crashed with an embedding IndexError (regression)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, size=int(n)).astype(np.int32) for n in rng.integers(20, 80, size=12)]
    big = [d.copy() for d in docs]
    big[5][3] = 300  # one id past the byte vocabulary
    small_src, big_src = tmp_path / "small.parquet", tmp_path / "big.parquet"
    for path, ds in ((small_src, docs), (big_src, big)):
        pq.write_table(pa.table({"input_ids": pa.array([d.tolist() for d in ds], pa.list_(pa.int32()))}), path)
    common = ["--device", "cpu", "--capacity", "1024", "--batch-rows", "1", "--layers", "1", "--d-model", "32",
              "--heads", "2", "--warmup-steps", "1", "--no-progress"]
    with pytest.raises(SystemExit, match=r"token id 300 is outside .*byte vocabulary") as e:
        example.main(["--source", str(big_src), "--steps", "1", *common])
    assert str(big_src) in str(e.value)
    s = example.main(["--source", str(small_src), "--steps", "2", *common])  # ids 0..255 of the same layout train
    assert len(s["losses"]) == 2 and s["tokens"] > 0


def test_packed_uses_the_manifest_pad_id(example, tmp_path):
    """The batch's padding tail holds the dataset's pad_id (was always 0); one outside the vocabulary is refused."""
    import argparse

    import numpy as np

    from flamia_pack import formats
    from flamia_pack.pack import PackConfig, pack_documents

    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 200, size=int(n)) for n in rng.integers(5, 50, size=15)]
    common = dict(shard_rows=4, source={"path": "test", "format": "synthetic"},
                  tokenizer={"name": "bytes", "vocab_size": 256})
    seven, bad = tmp_path / "seven", tmp_path / "bad"
    formats.write_packed(seven, pack_documents(docs, PackConfig(capacity=128, pad_id=251)), **common)
    args = argparse.Namespace(packed=seven, seed=0, batch_rows=3, workers=0)
    ds, loader, cap = example.make_loader(args, False)
    assert cap == 128 and ds.pad_id == 251
    pads = 0
    for batch in loader:
        flat = batch["input_ids"].reshape(-1)
        tail = flat[int(batch["num_real_tokens"]):]
        assert bool((tail == 251).all())
        pads += tail.numel()
    assert pads > 0  # some batch really had padding
    formats.write_packed(bad, pack_documents(docs, PackConfig(capacity=128, pad_id=300)), **common)
    with pytest.raises(SystemExit, match="pad_id is 300"):
        example.main(["--device", "cpu", "--steps", "1", "--packed", str(bad), "--no-progress"])


def test_model_options_have_help(example, capsys):
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for opt in ("--layers LAYERS transformer blocks", "--d-model D_MODEL model width", "--lr LR peak AdamW",
                "--seed SEED seed of"):
        assert opt in out, opt


@pytest.mark.parametrize("argv,match", [
    (["--d-model", "100", "--heads", "3"], "multiple of --heads"),
    (["--device", "tpu"], "--device must be"),
    (["--packed", "no/such/dir"], "no manifest.json"),
])
def test_bad_arguments_are_one_line_errors(example, capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        example.parse_args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_cuda_device_without_cuda_is_a_clear_error(example, capsys, monkeypatch):
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        example.parse_args(["--device", "cuda"])
    assert "no usable CUDA device" in capsys.readouterr().err
