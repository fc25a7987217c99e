"""`flamia plan` (cli.py plan section): sources, options, JSON output, one-line errors (exit 2)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from flamia_pack.cli import app
from flamia_pack.scheduler import TileConfig, attention_flops, build_work_list_host, lognormal_lengths, predict, visible_pairs

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["plan", *map(str, args)])


def _json(*args):
    r = _run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_lengths_file_json_matches_library(tmp_path):
    lens = [4096, 300, 1, 77]
    f = tmp_path / "lens.txt"
    f.write_text("# W-like mix\n" + "\n".join(map(str, lens)) + "\n\n")
    d = _json(f, "--heads", 8, "--kv-heads", 2, "--head-dim", 64)
    assert d["documents"] == 4 and d["tokens"] == sum(lens)
    assert d["visible_pairs"] == visible_pairs(lens)
    assert d["flops"] == attention_flops(lens, 8, 64, mode="fwd_bwd")
    cu = np.concatenate([[0], np.cumsum(lens)])
    # default geometry = the calibrated kernel's (bf16 kernels coalesce tiny documents: merge_short)
    items = build_work_list_host(cu, TileConfig(merge_short=True))
    assert d["items"] == len(items) and d["tiles_per_head"] == int(items[:, 3].sum())
    p = predict(lens, num_heads=8, num_kv_heads=2, head_dim=64)
    assert d["static_ms"] == pytest.approx(p.static_ms) and d["dynamic_ms"] == pytest.approx(p.dynamic_ms)
    assert d["policy"] == "dynamic" and "causal" in d["reason"]
    assert d["memory_padded_bytes"] == p.memory_padded_bytes > d["memory_packed_bytes"]


def test_lognormal_table_and_options():
    r = _run("--lognormal", 6.5, 1.0, 65536, "--seed", 3, "--no-causal", "--block-m", 64, "--merge-short")
    assert r.exit_code == 0, r.output
    for word in ("documents", "visible pairs", "FLOPs", "work items", "policy", "static", "dynamic", "padded"):
        assert word in r.stdout
    d = _json("--lognormal", 6.5, 1.0, 65536, "--seed", 3, "--no-causal", "--policy", "static", "--precision", "fp8")
    lens = lognormal_lengths(6.5, 1.0, 65536, 3)
    assert d["documents"] == len(lens) and d["visible_pairs"] == visible_pairs(lens, causal=False)
    assert d["policy"] == "static" and d["predicted_ms"] == d["static_ms"]
    assert d["settings"]["kernel_path"] == "fp8_fwd_bwd"


def test_packed_directory(tmp_path):
    from flamia_pack import formats
    from flamia_pack.pack import PackConfig, pack_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(1, 900, size=40)]
    packed = pack_documents(docs, PackConfig(capacity=2048))
    out = tmp_path / "packed"
    formats.write_packed(out, packed, shard_rows=3)
    d = _json(out)
    rows = [np.diff(r["cu_seqlens"]) for r in formats.iter_rows(out)]
    assert d["rows"] == len(rows) > 1
    assert d["documents"] == sum(len(x) for x in rows) == 40
    assert d["tokens"] == sum(int(x.sum()) for x in rows)
    assert d["settings"]["capacity"] == 2048
    assert len(d["per_row"]) == len(rows)
    assert d["static_ms"] == pytest.approx(sum(predict(x, capacity=2048).static_ms for x in rows))
    assert _json(out, "--rows", 1)["rows"] == 1
    # --capacity below a row: it said "documents total N tokens, more than capacity"; a row is meant
    fullest = max(int(x.sum()) for x in rows)
    r = _run(out, "--capacity", 100)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"--capacity 100 is less than a row of packed dataset {out}" in lines[0]
    assert f"holds {fullest:,} tokens" in lines[0] and "documents total" not in lines[0]
    assert _json(out, "--capacity", fullest)["settings"]["capacity"] == fullest


def test_packed_directory_reason_counts_rows_per_policy(tmp_path):
    """Several rows: the reason says how many rows got each policy (was: every row's reason joined, cut at 500)."""
    from flamia_pack import formats
    from flamia_pack.pack import PackConfig, pack_documents

    rng = np.random.default_rng(1)
    # rows with one long document and short fillers (non-causal: dynamic) and rows of similar short ones (static)
    lens = [2000] * 4 + [int(n) for n in rng.integers(8, 12, size=16)] + [int(n) for n in rng.integers(150, 200, size=60)]
    docs = [rng.integers(0, 1000, size=n) for n in lens]
    out = tmp_path / "packed"
    formats.write_packed(out, pack_documents(docs, PackConfig(capacity=2048)), shard_rows=3)
    d = _json(out, "--no-causal")
    per = d["per_row"]
    policies = sorted({r["policy"] for r in per})
    assert policies == ["dynamic", "static"] and d["policy"] == "mixed"
    parts = []
    for pol in policies:
        rows = [i for i, r in enumerate(per) if r["policy"] == pol]
        parts.append(f"{pol} on {len(rows)} of {len(per)} rows (e.g. row {rows[0]}: {per[rows[0]]['reason']})")
    assert d["reason"] == "; ".join(parts)
    r = _run(out, "--no-causal")
    assert r.exit_code == 0, r.output
    assert "mixed" in r.stdout and "rows (e.g. row" in " ".join(r.stdout.split())


@pytest.mark.parametrize(
    "args,needle",
    [
        ((), "exactly one of"),
        (("--lognormal", 6, 1, -5), "total_tokens"),
        (("LENS", "--block-m", 100), "power of two"),
        (("LENS", "--capacity", 0), "capacity"),
        (("LENS", "--capacity", 150, "--long-docs", "error"), "longer than capacity"),
        (("LENS", "--precision", "fp4"), "precision"),
        (("LENS", "--head-dim", 96), "no calibration"),
        (("LENS", "--policy", "fast"), "policy"),
        (("LENS", "--kv-heads", 5), "multiple"),
        # --heads 0 read "num_heads (0) must be a positive multiple of num_kv_heads (0)"; --long-docs foo
        # passed when nothing got packed (a fresh user's report, 2026-11-30)
        (("LENS", "--heads", 0), "--heads must be >= 1"),
        (("LENS", "--kv-heads", 0), "--kv-heads must be >= 1"),
        (("LENS", "--long-docs", "foo"), "--long-docs must be one of split, truncate, drop, error"),
        (("BAD",), "integer"),
        (("NEG",), ">= 1"),
        (("MISSING",), "source not found: "),  # names what was not found, as `flamia pack` does
        (("EMPTYDIR",), "manifest.json"),
        # --num-sms < 1 crashed in the simulator (ZeroDivisionError / "negative dimensions")
        (("LENS", "--num-sms", 0), "--num-sms must be in [1, 65,536]"),
        (("LENS", "--num-sms", -3), "--num-sms must be in [1, 65,536]"),
        # a new user's report, 2026-12-04: a huge --num-sms was a MemoryError traceback, --seed -1 numpy's
        # ValueError, a length beyond int64 an OverflowError
        (("LENS", "--num-sms", 99999999999), "--num-sms must be in [1, 65,536]"),
        (("--lognormal", 6.5, 1.0, 65536, "--seed", -1), "--seed must be >= 0"),
        (("HUGE",), "document lengths must fit int32 offsets"),
        # --block-m/--block-n 0 silently fell back to the calibrated defaults
        (("LENS", "--block-m", 0), "--block-m must be a power of two in [16, 256]"),
        (("LENS", "--block-m", 512), "--block-m must be a power of two in [16, 256]"),
        (("LENS", "--block-n", 0), "--block-n must be a power of two >= 16"),
        (("LENS", "--block-n", 24), "--block-n must be a power of two >= 16"),
        # a binary file where a lengths text file belongs was a UnicodeDecodeError traceback, rc 1
        (("BINARY",), "not a UTF-8 text file"),
    ],
)
def test_bad_input_one_red_line_exit_2(tmp_path, args, needle):
    (tmp_path / "lens.txt").write_text("100\n200\n")
    (tmp_path / "bad.txt").write_text("100\nabc\n")
    (tmp_path / "neg.txt").write_text("100\n0\n")
    (tmp_path / "huge.txt").write_text("100\n99999999999999999999\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "some.parquet").write_bytes(b"PAR1\x15\x04\x15\xcc\xff\x00" * 64 + b"PAR1")
    sub = {"LENS": tmp_path / "lens.txt", "BAD": tmp_path / "bad.txt", "NEG": tmp_path / "neg.txt",
           "MISSING": tmp_path / "nope.txt", "EMPTYDIR": tmp_path / "empty", "BINARY": tmp_path / "some.parquet",
           "HUGE": tmp_path / "huge.txt"}
    r = _run(*[sub.get(a, a) if isinstance(a, str) else a for a in args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert needle in lines[0]
    assert "Traceback" not in r.output


def test_packed_directory_with_a_deleted_shard(tmp_path):
    """A deleted shard was reported as "cannot read cu_seqlens from X: X" (regression)."""
    from flamia_pack import formats
    from flamia_pack.pack import PackConfig, pack_documents

    docs = [np.arange(n) for n in (5, 9, 3, 7, 2, 8)]
    out = tmp_path / "packed"
    formats.write_packed(out, pack_documents(docs, PackConfig(capacity=10)), shard_rows=1)
    shard = sorted(out.glob("train-*.parquet"))[1]
    shard.unlink()
    r = _run(out)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: shard"), r.output
    assert shard.name in lines[0] and "is missing" in lines[0] and "Traceback" not in r.output


@pytest.mark.parametrize("source", ["file", "lognormal"])
def test_mix_longer_than_capacity_packs_like_the_service(tmp_path, source):
    """A mix over --capacity is packed into rows (BFD) and planned like the service (was refused)."""
    from flamia_pack.service.engine import MixParams, predict_mix

    cap = 4096
    if source == "file":
        lens = np.random.default_rng(11).integers(1, 3000, size=40)
        lens[3] = 9000  # longer than a row: split
        f = tmp_path / "lens.txt"
        f.write_text("\n".join(map(str, lens.tolist())) + "\n")
        args = (f,)
    else:
        lens = lognormal_lengths(6.0, 1.0, 30_000, 5)
        args = ("--lognormal", 6.0, 1.0, 30_000, "--seed", 5)
    d = _json(*args, "--capacity", cap, "--heads", 8, "--kv-heads", 2, "--head-dim", 64)
    mp = predict_mix(lens, MixParams(num_heads=8, num_kv_heads=2, head_dim=64, capacity=cap))
    assert mp.pack.rows > 1 and d["rows"] == mp.pack.rows >= -(-int(lens.sum()) // cap)
    assert d["packing"]["fill"] == pytest.approx(mp.pack.fill) and 0 < d["packing"]["fill"] <= 1
    assert d["packing"]["segments"] == mp.seqlens.size == d["documents"]
    assert d["tokens"] == int(mp.seqlens.sum()) == int(lens.sum())
    p = mp.prediction
    assert (d["items"], d["static_ms"], d["dynamic_ms"]) == (p.items, p.static_ms, p.dynamic_ms)
    assert d["policy"] == p.policy and d["predicted_ms"] == p.predicted_ms
    r = _run(*args, "--capacity", cap)
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert f"{mp.pack.rows} rows of {cap:,} tokens" in text and "fill" in text


def test_note_when_the_rule_picks_the_schedule_predicted_slower(tmp_path):
    """`plan --no-causal` printed "static X ms, dynamic Y ms -> X ms" with Y < X and no word on it: the
    rule (kept) is named and the simulator's faster schedule with it; nothing when --policy is explicit."""
    from flamia_pack.cli import _plan_policy_note

    f = tmp_path / "lens.txt"
    f.write_text("\n".join(map(str, [5131, 4137, 2231, 2531, 423, 694, 230, 1484, 6524, 5230])))
    d = _json(f, "--no-causal")
    assert d["policy"] == "static" and d["dynamic_ms"] < d["static_ms"] == d["predicted_ms"]
    pct = 100 * (d["static_ms"] - d["dynamic_ms"]) / d["static_ms"]
    note = f"rule: non-causal, balanced -> static; the simulator predicts dynamic {pct:.1f}% faster"
    assert d["policy_note"] == note
    r = _run(f, "--no-causal")
    assert r.exit_code == 0 and f"({note})" in " ".join(r.stdout.replace("│", " ").split()), r.stdout
    assert _json(f, "--no-causal", "--policy", "static")["policy_note"] is None
    d = _json(f, "--no-causal", "--policy", "dynamic")
    assert d["predicted_ms"] == min(d["static_ms"], d["dynamic_ms"]) and d["policy_note"] is None
    mixed = {"policy": "mixed", "predicted_ms": 10.0, "static_ms": 11.0, "dynamic_ms": 9.0, "settings": {"causal": False}}
    assert _plan_policy_note(mixed, "auto") == ("rule: static or dynamic per row; the simulator predicts "
                                                 "dynamic on every row 10.0% faster")


def test_plan_fp8_rejects_geometry_overrides(tmp_path):
    """The FP8 kernel has one geometry (128 x 128 tiles, no merged items): a what-if override would
    rescale its measured calibration for tiles it does not run."""
    f = tmp_path / "lens.txt"
    f.write_text("20\n20\n500\n")
    for flag in (["--merge-short"], ["--block-n", "64"], ["--block-m", "64"]):
        r = _run(f, "--precision", "fp8", "--pass", "fwd", *flag)
        assert r.exit_code == 2 and "do not apply to --precision fp8" in r.output, (flag, r.output)


@pytest.mark.parametrize("pass_, path, measured_ms, rel", [("bwd", "fp8_bwd", 8.339, 0.02),
                                                          ("fwd_bwd", "fp8_fwd_bwd", 10.757, 0.035)])
def test_plan_fp8_backward_and_training_call_from_the_measured_entry(tmp_path, pass_, path, measured_ms, rel):
    """`plan --precision fp8` predicts the FP8 backward / training call from the entries fitted to the committed
    bench_attention.py --fp8 run (RESULTS.md "Session of 2026-12-06 (third)", 8654e79, W1 measured 8.339 / 10.757 ms), on their
    geometry; it said "no GPU FP8 backward exists yet"."""
    from flamia_pack.scheduler import load_calibration, workload_lengths

    f = tmp_path / "w1.txt"
    f.write_text("\n".join(map(str, workload_lengths("W1"))) + "\n")
    d = _json(f, "--precision", "fp8", "--pass", pass_)
    cal = load_calibration().lookup(path, 128, "H200")
    s = d["settings"]
    assert s["kernel_path"] == path and s["calibration_measured"] is True
    assert (s["a_us_per_tile"], s["b_us_per_item"], s["block_m"], s["block_n"], s["merge_short"]) == \
        (cal.a_us_per_tile, cal.b_us_per_item, 128, 64, False)
    p = predict(workload_lengths("W1"), precision="fp8", pass_=pass_)
    assert d["predicted_ms"] == pytest.approx(p.predicted_ms) and d["policy"] == "dynamic"
    assert d["predicted_ms"] == pytest.approx(measured_ms, rel=rel)  # W1 as measured, within the fit's error
    r = _run(f, "--precision", "fp8", "--pass", pass_)
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.replace("│", " ").split())
    assert path in text and "estimate" not in text and "no GPU FP8 backward" not in text


def test_plan_fp8_head_dim_64_says_the_gpu_kernels_do_not_run_it(tmp_path):
    """`plan --precision fp8 --head-dim 64` prints its estimate with a note that the GPU FP8 kernels run
    head_dim 128 only; at 128 there is no such note."""
    f = tmp_path / "lens.txt"
    f.write_text("4096\n4096\n")
    r = _run(f, "--precision", "fp8", "--head-dim", "64")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.replace("│", " ").split())
    assert "the GPU FP8 kernels run head_dim 128 only" in text
    r = _run(f, "--precision", "fp8", "--head-dim", "128")
    assert r.exit_code == 0 and "head_dim 128 only" not in " ".join(r.stdout.replace("│", " ").split())
