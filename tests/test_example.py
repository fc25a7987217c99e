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
