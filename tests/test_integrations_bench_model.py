"""benchmarks/bench_model.py --smoke: the end-to-end model benchmark runs on the CPU, and "flamia" on
packed rows and "sdpa" on padded batches of the same documents give the same first-step loss."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("transformers")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"


def test_bench_model_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_model", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--smoke", "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["results"] == out["results"]
    res = {r["impl"]: r for r in out["results"]}
    assert set(res) == {"flamia", "flamia_fp8", "sdpa"}
    assert res["flamia_fp8"]["status"] in ("ok", "unavailable")  # the smoke model's head_dim 16 is not an FP8 one
    res.pop("flamia_fp8")
    assert all(r["status"] == "ok" for r in res.values())
    for r in res.values():
        assert r["tokens_per_s"] > 0 and 0 < r["attention_share"] <= 1 and r["capacity"] == 256
    assert res["flamia"]["first_loss"] == pytest.approx(res["sdpa"]["first_loss"], rel=1e-5)
    assert res["sdpa"]["slots_per_real_token"] >= 1 and res["flamia"]["slots_per_real_token"] >= 1


def test_padded_micro_batches_hold_the_packed_documents():
    spec = importlib.util.spec_from_file_location("bench_model", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch = bench.packed_batches(64, 2, 1, 8, max_doc_len=20)[0]
    micro = bench.padded_micro_batches(batch, 64)
    cu = batch["cu_seqlens"].tolist()
    flat_ids, flat_labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    lines = [(mb["input_ids"][i], mb["labels"][i], mb["attention_mask"][i]) for mb in micro for i in range(len(mb["input_ids"]))]
    assert len(lines) == len(cu) - 1
    for (a, b), (ids, lab, m) in zip(zip(cu[:-1], cu[1:]), lines):
        n = int(m.sum())
        assert n == b - a and m[:n].all() and (lab[n:] == -100).all()
        assert ids[:n].tolist() == flat_ids[a:b].tolist() and lab[:n].tolist() == flat_labels[a:b].tolist()
    assert all(mb["input_ids"].numel() <= 64 for mb in micro)
