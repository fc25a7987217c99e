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
