"""examples/train_fp8.py and examples/fp8_leak.py on the CPU (issue 29): a few steps of BF16 and of the
FP8 emulation, bitwise resume, the leaking quantizer's warning and causality, clear CLI errors."""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tf():
    return _load("train_fp8")


@pytest.fixture(scope="module")
def leak():
    return _load("fp8_leak")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """40 documents of the bundled sample (shorter ones): fast to read, real text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(ROOT / "flamia_pack" / "data" / "python-stdlib.parquet").to_pydict()
    texts = [x for x in t["text"] if 200 < len(x) < 3000][:40]
    path = tmp_path_factory.mktemp("src") / "small.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    return path


def _argv(source, out, attn="bf16", steps=3, *extra):
    return ["--device", "cpu", "--attn", attn, "--out", str(out), "--steps", str(steps), "--source", str(source),
            "--layers", "1", "--d-model", "128", "--heads", "2", "--capacity", "128", "--val-rows", "1",
            "--val-every-nth-doc", "10", "--buffer-docs", "8", "--warmup-steps", "1", "--lr", "1e-2",
            "--eval-every", "100", "--log-every", "1", "--quiet", *extra]


def _records(out):
    return [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("attn", ["bf16", "fp8-block"])
def test_three_steps_on_cpu(tf, source, tmp_path, attn):
    s = tf.main(_argv(source, tmp_path / attn, attn))
    assert s["complete"] and s["steps_done"] == 3 and s["attn"] == attn
    recs = _records(tmp_path / attn)
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tok_s"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]  # it learns (and, for fp8, the emulation is differentiable)
    ev = [r for r in recs if r["type"] == "eval"]
    assert [e["step"] for e in ev] == [0, 3]
    own, exact = ev[-1]["val_loss"]["own"], ev[-1]["val_loss"]["exact"]
    if attn == "bf16":
        assert own == exact
    else:  # the FP8 emulation and the exact reference differ a little
        assert own != exact and abs(own - exact) < 0.05
    assert s["flops_per_step"]["total"] > 0 and (tmp_path / attn / "summary.json").is_file()


@pytest.mark.parametrize("attn", ["bf16", "fp8-block"])
def test_grad_probe_logs_the_exact_gradient_and_leaves_the_update(tf, source, tmp_path, attn):
    """--grad-probe: per step the exact-attention gradient's norm, loss and cosine to the run's own; bf16's own
    attention is the exact one (cosine 1, same norm), the FP8 emulation's differs a little; the run's
    trajectory is the one without the probe (bitwise on the CPU)."""
    plain = tf.main(_argv(source, tmp_path / "plain", attn))
    s = tf.main(_argv(source, tmp_path / "probe", attn) + ["--grad-probe"])
    a = [r for r in _records(tmp_path / "plain") if r["type"] == "train"]
    b = [r for r in _records(tmp_path / "probe") if r["type"] == "train"]
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    assert all("grad_norm_exact" not in r for r in a) and plain.get("grad_probe") is None
    for r in b:
        if attn == "bf16":
            assert r["grad_cos_exact"] == pytest.approx(1.0, abs=1e-5)
            assert r["grad_norm_exact"] == pytest.approx(r["grad_norm"], rel=1e-5) and r["loss_exact"] == r["loss"]
        else:
            assert 0.9 < r["grad_cos_exact"] < 1.0 and r["grad_norm_exact"] > 0
            assert abs(r["loss_exact"] - r["loss"]) < 0.05
    assert s["grad_probe"]["steps"] == 3 and s["grad_probe"]["cos_median"] > 0.9


def test_grad_probe_captures_a_spiking_step_layer_by_layer(tf, source, tmp_path):
    """--probe-capture-ratio 0 makes every step a "spike": the first 3 are replayed per layer (own vs exact
    attention gradients on the recorded q, k, v, dO), logged, and the worst layer's inputs saved; they
    replay to the same gradients through the emulation."""
    out = tmp_path / "cap"
    tf.main(_argv(source, out, "fp8-block", 3) + ["--grad-probe", "--probe-capture-ratio", "0", "--layers", "2"])
    spikes = [r for r in _records(out) if r["type"] == "spike"]
    assert [r["step"] for r in spikes] == [1, 2, 3]
    for r in spikes:
        assert [d["layer"] for d in r["layers"]] == [0, 1]
        for d in r["layers"]:
            assert 0.9 < min(d["cos_dq"], d["cos_dk"], d["cos_dv"]) < 1.0  # the emulation differs a little
            assert 0.5 < d["norm_ratio_dq"] < 2.0
        saved = torch.load(out / r["file"])
        assert saved["step"] == r["step"] and saved["attn"] == "fp8-block"
        assert saved["q"].shape == saved["do"].shape and saved["do"].is_floating_point()
        worst = min(r["layers"], key=lambda d: min(d["cos_dq"], d["cos_dk"], d["cos_dv"]))
        assert saved["layer"] == worst["layer"]
    # the saved inputs replay: own attention's dQ on them against exact attention's has the logged cosine
    from flamia_pack.kernels import varlen_attention
    saved = torch.load(out / spikes[0]["file"])
    g = []
    for prec in ("fp8", "bf16"):
        x = [saved[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
        o = varlen_attention(*x, saved["cu_seqlens"], saved["max_seqlen"], precision=prec)
        g.append(torch.autograd.grad(o, x, saved["do"])[0])
    cos = float(torch.nn.functional.cosine_similarity(g[0].double().flatten(), g[1].double().flatten(), dim=0))
    logged = [d for d in spikes[0]["layers"] if d["layer"] == saved["layer"]][0]["cos_dq"]
    assert cos == pytest.approx(logged, abs=1e-6)


def test_resume_is_bitwise(tf, source, tmp_path):
    straight = tf.main(_argv(source, tmp_path / "a", "bf16", 3))
    part = tf.main(_argv(source, tmp_path / "b", "bf16", 3, "--stop-at", "2"))
    assert not part["complete"] and part["stop_reason"] == "stop-at" and part["steps_done"] == 2
    resumed = tf.main(_argv(source, tmp_path / "b", "bf16", 3))
    assert resumed["complete"]
    ra = [r for r in _records(tmp_path / "a") if r["type"] in ("train", "eval")]
    rb = [r for r in _records(tmp_path / "b") if r["type"] in ("train", "eval")]
    def strip(rs):  # timings differ run to run
        return [{k: v for k, v in r.items() if k not in ("tok_s", "step_ms", "eval_s")} for r in rs]

    assert strip(ra) == strip(rb)  # same losses, grad norms, data and val losses at every step
    assert [r["type"] for r in _records(tmp_path / "b")].count("start") == 2
    assert straight["final_val"] == resumed["final_val"]


def test_shuffled_rows_permute_each_epoch_and_resume_across_its_end(tf, source, tmp_path):
    """--row-order shuffle: each epoch serves exactly the streaming packer's rows of that epoch, in
    a seeded permutation; a state saved in one epoch resumes the same rows across the epoch's end."""
    import numpy as np

    args = tf.parse_args(_argv(source, tmp_path / "o"))
    assert args.row_order == "shuffle"
    train_docs, _ = tf.load_split(args.source, args.val_every_nth_doc)
    key = lambda r: bytes(np.asarray(r["input_ids"]).tobytes())  # noqa: E731
    stream = tf.Rows(train_docs, tf.parse_args(_argv(source, tmp_path / "o", "bf16", 3, "--row-order", "stream")))
    n = len(list(stream.ds))
    rows = tf.Rows(train_docs, args)
    got = [rows.next() for _ in range(n + 5)]
    assert sorted(map(key, got[:n])) == sorted(map(key, list(tf.Rows(train_docs, args).ds)))  # epoch 0's rows
    assert [key(r) for r in got[:n]] != [key(r) for r in list(tf.Rows(train_docs, args).ds)]  # in another order
    mid = tf.Rows(train_docs, args)
    for _ in range(n - 2):
        mid.next()
    state = mid.state_dict()
    again = tf.Rows(train_docs, args)
    again.load_state_dict(state)
    assert [key(again.next()) for _ in range(7)] == [key(r) for r in got[n - 2:n + 5]]


def test_resume_with_other_settings_is_refused(tf, source, tmp_path):
    tf.main(_argv(source, tmp_path / "r", "bf16", 3, "--stop-at", "1"))
    with pytest.raises(SystemExit, match="other settings.*lr"):
        tf.main(_argv(source, tmp_path / "r", "bf16", 3, "--lr", "5e-3"))


def test_out_of_other_files_is_refused(tf, source, tmp_path, capsys):
    """--out naming a directory of unrelated files (no checkpoint) was written into (a new user's report,
    2026-12-04); an empty directory is a new run."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        tf.main(_argv(source, tmp_path / "mine", "bf16", 2))
    assert e.value.code == 2 and "a directory of other files (notes.txt)" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert tf.main(_argv(source, tmp_path / "empty", "bf16", 2))["complete"]


@pytest.mark.parametrize("argv,match", [
    (["--attn", "fp8"], "--attn must be one of"),
    (["--attn", "fp8-leak", "--leak-mode", "prev-floor"], "--leak-mode must be one of"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--d-model", "100", "--heads", "3"], "multiple of --heads"),
    (["--attn", "fp8-block", "--device", "cpu", "--d-model", "96", "--heads", "3"], "head_dim 64 or 128"),
    (["--max-minutes", "0"], "--max-minutes must be > 0"),
    (["--capacity", "99999999999"], "--capacity must be in [32, 1,048,576]"),
    (["--capacity", "65536", "--batch-rows", "1024"], "--capacity x --batch-rows must be at most"),
    (["--attn", "bf16", "--leak-mode", "next"], "--leak-mode applies to --attn fp8-leak only"),
    (["--source", "no/such.parquet"], "not found"),
    ([], "--out DIR is required"),
])
def test_bad_flags_are_one_line_errors(tf, capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        tf.parse_args(["--device", "cpu", *(["--out", "x"] if argv else []), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and "Traceback" not in err


def test_leaking_quantizer_warns(leak):
    T, H, D = 64, 2, 64
    q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 40, 64], dtype=torch.int32)
    with pytest.warns(leak.LeakWarning, match="AFTER the query"):
        o = leak.leaky_varlen_attention(q, k, v, cu, 40)
    o.float().sum().backward()  # the CPU path (emulation on leaky codes) is differentiable
    assert all(x.grad is not None and bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error", leak.LeakWarning)  # the causal twin does not warn
        leak.leaky_varlen_attention(q.detach(), k.detach(), v.detach(), cu, 40, mode="prev-floor")


def test_leak_reads_the_next_token_and_the_twin_does_not(leak):
    """Shrinking the tokens after a cut moves O at the cut through next-floor's exponents (the row
    before the cut), never through prev-floor (causal) or anything outside the document."""
    g = torch.Generator().manual_seed(0)
    T, H, D, cut = 96, 2, 64, 50
    q, k, v = (torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 80, 96], dtype=torch.int32)
    small = [x.clone() for x in (q, k, v)]
    for x in small:
        x[cut + 1:80] *= 0.25  # a "quieter" future: token cut's clipping level drops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", leak.LeakWarning)
        for mode, leaks in (("next-floor", True), ("prev-floor", False)):
            o0 = leak.leaky_varlen_attention(q, k, v, cu, 80, mode=mode)
            o1 = leak.leaky_varlen_attention(*small, cu, 80, mode=mode)
            assert torch.equal(o0[:cut], o1[:cut])  # rows before the cut's row never move (one-token reach)
            assert torch.equal(o0[80:], o1[80:])  # the other document never moves
            assert (not torch.equal(o0[cut], o1[cut])) == leaks


def test_leaky_operands_have_the_kernels_layouts(leak):
    from flamia_pack.quant import dequantize

    T, H, D = 100, 2, 128
    q, k, v = (torch.randn(T, H, D) * s for s in (1.0, 3.0, 0.1))
    cu = torch.tensor([0, 37, 90], dtype=torch.int32)
    ops = leak.leaky_operands(q, k, v, cu)
    assert ops.granularity == "token"
    from flamia_pack.kernels.quantize import from_wgmma_order

    assert ops.vt.shape == ops.qt.shape == (H, D, 112)  # V^T, Q^T: the whole pitch, in the wgmma order
    for codes, ex, t, x in ((ops.qc, ops.eq, from_wgmma_order(ops.qt, T), q), (ops.kc, ops.ek, ops.kt, k),
                            (ops.vc, ops.ev, from_wgmma_order(ops.vt, T), v)):
        assert codes.shape == (T, H, D) and codes.is_contiguous() and ex.shape == (T, H)
        assert t.shape == (H, D, T) and t.stride(2) == 1
        assert torch.equal(t.view(torch.uint8), codes.view(torch.uint8).permute(1, 2, 0))
    for t in (ops.qt, ops.kt, ops.vt):
        assert t.stride(2) == 1 and t.stride(1) % 16 == 0
        c2, e2 = leak.leaky_codes(x, cu)
        assert torch.equal(codes.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(ex, e2)
        assert bool(torch.isfinite(dequantize(codes, ex)).all())  # saturating, no NaN codes
    # token 10's exponent is token 11's floor-rule exponent; the document's last token (36) keeps its own
    amax = q.abs().amax(-1)
    want = torch.floor(torch.log2(amax)).to(torch.int32) - 8 + 127
    assert torch.equal(ops.eq[10], want[11].to(torch.uint8)) and torch.equal(ops.eq[36], want[36].to(torch.uint8))


def test_flops_count(tf):
    args = tf.parse_args(["--device", "cpu", "--out", "x", "--layers", "2", "--d-model", "256", "--heads", "2"])
    f = tf.step_flops(args, [[0, 100, 300]])
    assert f["tokens"] == 300 and f["pairs_per_head"] == 100 * 101 / 2 + 200 * 201 / 2
    assert f["linear"] == 6 * (2 * 12 * 256 * 256 + 256 * 256) * 300
    assert f["attention"] == 14 * 2 * 128 * f["pairs_per_head"] * 2


def test_gpu_branch_plumbing(leak, monkeypatch):
    """The sm_90 branch of leaky_varlen_attention with the kernels faked: the leaky FP8Operands go
    through _FP8Attention (saved, rebuilt for the backward) with the call's work list and scale."""
    import flamia_pack.kernels.fp8_attention as fa
    import flamia_pack.kernels.fp8_backward as fb

    seen = {}

    def fake_fwd(ops, cu32, *, causal, softmax_scale, work_list):
        seen["fwd"] = (ops, causal, softmax_scale, work_list)
        T, H, D = ops.qc.shape
        return torch.zeros(T, H, D, dtype=torch.bfloat16), torch.zeros(H, T)

    def fake_bwd(do, ops, o, lse, cu32, *, causal, softmax_scale, dlse=None, entries=None, deterministic=False):
        seen["deterministic"] = deterministic
        seen["bwd"] = ops
        seen["entries"] = entries
        return torch.ones_like(do), torch.ones_like(do), torch.ones_like(do)

    monkeypatch.setattr(fa, "fp8_kernels_available", lambda device: True)
    monkeypatch.setattr(fa, "fp8_attention_forward", fake_fwd)
    monkeypatch.setattr(fb, "fp8_backward", fake_bwd)
    T, H, D = 48, 2, 128
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 30, 48], dtype=torch.int32)
    with pytest.warns(leak.LeakWarning):
        o = leak.leaky_varlen_attention(q, k, v, cu, 30, work_list="WL")
    ops, causal, scale, wl = seen["fwd"]
    assert causal is True and scale == D ** -0.5 and wl == "WL" and ops.granularity == "token"
    want = leak.leaky_codes(q.detach(), cu)
    assert torch.equal(ops.eq, want.exponents) and torch.equal(ops.qc.view(torch.uint8), want.codes.view(torch.uint8))
    o.float().sum().backward()
    back = seen["bwd"]
    keep = [i for i in range(len(ops)) if i not in (2, 8)]  # V^T is not saved (the backward reads V row-major)
    assert back.granularity == "token" and back.vt is None and all(
        (a is None and b is None) or torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                 b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
        for a, b in ((back[i], ops[i]) for i in keep))
    assert back.qc_lo is None and back.kc_lo is None and back.kt_lo is None  # one term: no residual codes
    assert bool((q.grad == 1).all())
    assert seen["entries"] is None and seen["deterministic"] is False  # "WL" carries no backward entries
    # a work list that carries them (build_fp8_work_list's FP8WorkList) hands them to the backward
    wl = type("FakeFP8WorkList", (), {"bwd_entries": ("E", "N", 3)})()
    with pytest.warns(leak.LeakWarning):
        o = leak.leaky_varlen_attention(q, k, v, cu, 30, work_list=wl)
    o.float().sum().backward()
    assert seen["entries"] == ("E", "N", 3)


def test_resume_inside_a_log_window_keeps_every_record(tf, source, tmp_path):
    straight = tf.main(_argv(source, tmp_path / "a", "bf16", 3))
    tf.main(_argv(source, tmp_path / "b", "bf16", 3, "--stop-at", "1"))
    resumed = tf.main(_argv(source, tmp_path / "b", "bf16", 3))
    steps = [r["step"] for r in _records(tmp_path / "b") if r["type"] == "train"]
    assert steps == [1, 2, 3]
    for key in ("final_train_loss_mean100", "grad_norm_p99", "final_train_loss"):
        assert straight[key] == resumed[key], key


def test_unusable_run_directories_are_one_line_errors(tf, source, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit):
            tf.main(_argv(source, out, "bf16", 3))
        assert "--out" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_text("garbage")
    with pytest.raises(SystemExit, match="cannot be read as a checkpoint"):
        tf.main(_argv(source, run, "bf16", 3))
    assert (run / "ckpt.pt").read_text() == "garbage"  # nothing lost


def test_parity_table_of_the_plot_script():
    """benchmarks/plot_fp8_training.parity: per-mode mean / sd of the exact-evaluated validation loss, the
    difference to BF16 with its standard error, and the runs a +-0.01 claim needs (the leak left out)."""
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"attn": "bf16", "val_exact": v} for v in (1.0, 1.2)]
    rows += [{"attn": "fp8-block", "val_exact": v} for v in (1.05, 1.15, 1.25)]
    rows += [{"attn": "fp8-leak", "val_exact": 9.0}, {"attn": "fp8-token", "val_exact": 1.3}]
    got = {x["attn"]: x for x in mod.parity(rows)}
    assert set(got) == {"bf16", "fp8-block", "fp8-token"}
    b = got["fp8-block"]
    assert b["n"] == 3 and b["mean"] == pytest.approx(1.15) and b["sd"] == pytest.approx(0.1)
    assert b["diff_vs_bf16"] == pytest.approx(0.05)
    assert b["se"] == pytest.approx(math.sqrt(0.01 / 3 + 0.02 / 2))
    assert b["runs_for_margin"] in (1200, 1201)  # 2 (2 x pooled sd 0.1225 / 0.01)^2, rounded up
    assert math.isnan(got["fp8-token"]["sd"]) and math.isnan(got["fp8-token"]["runs_for_margin"])
    table = mod.parity_markdown(mod.parity(rows))
    assert "| fp8-block | 3 | 1.1500 | 0.1000 | +0.0500 |" in table


def test_paired_parity_of_the_plot_script():
    """benchmarks/plot_fp8_training.paired: differences of one seed's runs (same initialisation and data),
    their mean, sd, standard error and the one-sided bound mean + 2 SE against the margin; seeds without a
    BF16 run and the leak are left out."""
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"attn": "bf16", "seed": s, "val_exact": v} for s, v in ((0, 1.0), (1, 1.2), (2, 1.1))]
    rows += [{"attn": "fp8-block", "seed": s, "val_exact": v} for s, v in ((0, 1.02), (1, 1.18), (2, 1.13), (9, 5.0))]
    rows += [{"attn": "fp8-leak", "seed": 0, "val_exact": 9.0}, {"attn": "fp8-token", "seed": 1, "val_exact": 1.3}]
    got = {x["attn"]: x for x in mod.paired(rows)}
    assert set(got) == {"fp8-block", "fp8-token"}
    b = got["fp8-block"]
    assert b["n"] == 3 and b["mean_diff"] == pytest.approx(0.01)  # +0.02, -0.02, +0.03
    assert b["sd"] == pytest.approx(math.sqrt((0.01 ** 2 + 0.03 ** 2 + 0.02 ** 2) / 2))
    assert b["se"] == pytest.approx(b["sd"] / math.sqrt(3)) and b["upper"] == pytest.approx(0.01 + 2 * b["se"])
    t = got["fp8-token"]
    assert t["n"] == 1 and t["mean_diff"] == pytest.approx(0.1) and math.isnan(t["upper"])
    table = mod.paired_markdown(mod.paired(rows))
    assert "| fp8-block | 3 | +0.0100 |" in table and "| no |" in table and "| fp8-token | 1 | +0.1000 | - |" in table


def test_students_t_of_the_plot_script():
    """plot_fp8_training's Student's t (no scipy): the textbook quantiles (df 1, 5, 100) and p-values, and the
    paired table's t columns (bound, p, interval) on the same differences as the 2 SE ones."""
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for q, df, t in ((0.975, 1, 12.7062), (0.95, 5, 2.0150), (0.975, 5, 2.5706), (0.975, 100, 1.9840)):
        assert mod.t_quantile(q, df) == pytest.approx(t, abs=1e-4)
        assert mod.t_two_sided_p(t, df) == pytest.approx(2 * (1 - q), abs=1e-4)
    assert mod.t_two_sided_p(0.0, 7) == pytest.approx(1.0)
    rows = [{"attn": "bf16", "seed": s, "val_exact": v} for s, v in ((0, 1.0), (1, 1.2), (2, 1.1))]
    rows += [{"attn": "fp8-block", "seed": s, "val_exact": v} for s, v in ((0, 1.02), (1, 1.18), (2, 1.13))]
    b = mod.paired(rows)[0]
    assert b["upper_t"] == pytest.approx(b["mean_diff"] + 2.9200 * b["se"], abs=1e-4)  # t_0.95, df 2
    assert b["ci95"][1] == pytest.approx(b["mean_diff"] + 4.3027 * b["se"], abs=1e-4)
    assert b["p_two_sided"] == pytest.approx(mod.t_two_sided_p(b["mean_diff"] / b["se"], 2))


def test_spike_overlap_of_the_plot_script():
    """benchmarks/plot_fp8_training.spike_overlap: an FP8 run's spikes count as unshared only on steps where
    none of k BF16 runs spikes (averaged over the choices of k), BF16's against its other k seeds."""
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"attn": "bf16", "seed": 0, "steps": 9, "spikes": [10, 20]},
            {"attn": "bf16", "seed": 1, "steps": 9, "spikes": [20, 30]},
            {"attn": "bf16", "seed": 2, "steps": 9, "spikes": [40]},
            {"attn": "fp8-block", "seed": 0, "steps": 9, "spikes": [10, 50]},
            {"attn": "fp8-leak", "seed": 0, "steps": 9, "spikes": [1, 2, 3]},
            {"attn": "fp8-token", "seed": 0, "steps": 5, "spikes": [99]}]  # shorter: left out
    got = {x["attn"]: x for x in mod.spike_overlap(rows)}
    assert set(got) == {"bf16", "fp8-block"} and got["bf16"]["k"] == 2
    # BF16: 10 (only s0), 30 (only s1), 40 (only s2) unshared; 20 shared: 3 of 5
    assert got["bf16"]["spikes"] == 5 and got["bf16"]["fraction_unshared"] == pytest.approx(3 / 5)
    # fp8-block: 50 never shared; 10 unshared against {s1, s2} only: (1 + 1 + 2) / 3 choices / 2 spikes
    assert got["fp8-block"]["fraction_unshared"] == pytest.approx((1 / 2 + 1 / 2 + 2 / 2) / 3)
    table = mod.spike_markdown(mod.spike_overlap(rows))
    assert "| bf16 | 3 | 5 | 60% |" in table and "none of 2 BF16 runs" in table
    assert mod.spike_overlap(rows[:1]) == []


def test_plot_script_reads_a_gzipped_log_as_the_plain_one(tf, source, tmp_path):
    """benchmarks/runs/ keeps logs as log.jsonl.gz: read_run gives the same records from either."""
    import gzip
    import shutil

    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tf.main(_argv(source, tmp_path / "plain", "bf16", 2))
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "log.jsonl.gz").write_bytes(gzip.compress((tmp_path / "plain" / "log.jsonl").read_bytes()))
    shutil.copy(tmp_path / "plain" / "summary.json", tmp_path / "gz" / "summary.json")
    a, b = mod.read_run(tmp_path / "plain"), mod.read_run(tmp_path / "gz")
    assert a["train"] and {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    with pytest.raises(SystemExit, match="no log.jsonl or log.jsonl.gz"):
        mod.read_run(tmp_path)


def test_a_run_directory_without_a_checkpoint_is_not_overwritten(tf, source, tmp_path):
    out = tmp_path / "archived"
    out.mkdir()
    (out / "summary.json").write_text('{"kept": true}')
    with pytest.raises(SystemExit):
        tf.main(_argv(source, out, "bf16", 2))
    assert (out / "summary.json").read_text() == '{"kept": true}' and not (out / "log.jsonl").exists()


@pytest.mark.parametrize("flag,value", [("--data-seed", "-1"), ("--weight-decay", "-1"), ("--lr", "nan"),
                                        ("--lr", "inf"), ("--grad-clip", "nan")])
def test_bad_numbers_are_argparse_errors(tf, source, tmp_path, flag, value):
    with pytest.raises(SystemExit) as e:
        tf.parse_args(_argv(source, tmp_path / "o", "bf16", 2, flag, value))
    assert e.value.code == 2


def test_a_diverging_run_stops_with_its_records(tf, source, tmp_path):
    out = tmp_path / "div"
    s = tf.main(_argv(source, out, "bf16", 30, "--warmup-steps", "0", "--lr", "1e6", "--grad-clip", "1e30",
                      "--log-every", "5"))
    assert s["stop_reason"] == "diverged" and not s["complete"]
    recs = _records(out)
    assert recs[-1]["type"] == "stop" and recs[-1]["reason"] == "diverged"
    assert any(r["type"] == "error" for r in recs) or any(r["type"] == "train" and not math.isfinite(r["loss"])
                                                          for r in recs)


def test_a_partial_last_log_line_is_dropped_on_resume(tf, source, tmp_path):
    out = tmp_path / "cut"
    tf.main(_argv(source, out, "bf16", 4, "--stop-at", "2"))
    with open(out / "log.jsonl", "a") as f:
        f.write('{"type": "train", "st')  # what a hard kill mid-write leaves
    s = tf.main(_argv(source, out, "bf16", 4))
    assert s["complete"] and all(json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines())


def test_plot_script_skips_files_and_refuses_a_broken_log(tf, source, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tf.main(_argv(source, tmp_path / "r" / "bf16-s0", "bf16", 2))
    (tmp_path / "r" / "bf16-s0.console").write_text("console output of run_fp8_training.sh")
    rows = mod.main([str(tmp_path / "r" / "bf16-s0"), str(tmp_path / "r" / "bf16-s0.console"), "--no-plot"])
    assert [r["run"] for r in rows] == ["bf16-s0"] and "skipping" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "log.jsonl").write_text('{"type": "start", "step": 0}\n{"type": "tr')
    with pytest.raises(SystemExit, match="line 2 of its log is not JSON"):
        mod.main([str(bad), "--no-plot"])
    (bad / "log.jsonl").write_text('{"type": "start", "step": 0}\n["not a record"]\n')
    with pytest.raises(SystemExit, match="line 2 of its log is not a train_fp8.py record"):
        mod.main([str(bad), "--no-plot"])
    (bad / "log.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="its log is empty"):
        mod.main([str(bad), "--no-plot"])
    (bad / "log.jsonl").write_text('{"type": "start", "step": 0}\n')  # started, no step yet: skipped
    rows = mod.main([str(tmp_path / "r" / "bf16-s0"), str(bad), "--no-plot"])
    assert [r["run"] for r in rows] == ["bf16-s0"] and "no training step logged yet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main([str(bad), "--no-plot"])  # nothing left to plot
    with pytest.raises(SystemExit):
        mod.main([str(tmp_path / "r" / "bf16-s0"), "--smooth", "0"])


def test_a_checkpoint_from_before_row_order_resumes_as_stream(tf, source, tmp_path):
    out = tmp_path / "old"
    tf.main(_argv(source, out, "bf16", 3, "--stop-at", "1", "--row-order", "stream"))
    ck = torch.load(out / "ckpt.pt", weights_only=False)
    del ck["config"]["row_order"]
    torch.save(ck, out / "ckpt.pt")
    with pytest.raises(SystemExit, match="row_order"):
        tf.main(_argv(source, out, "bf16", 3))  # the default (shuffle) is another order
    assert tf.main(_argv(source, out, "bf16", 3, "--row-order", "stream"))["complete"]


def test_parity_pools_only_the_full_length_runs():
    spec = importlib.util.spec_from_file_location("plot_fp8_training", ROOT / "benchmarks" / "plot_fp8_training.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"attn": "bf16", "val_exact": v, "steps": 2000} for v in (1.0, 1.2)]
    rows += [{"attn": "fp8-token", "val_exact": 1.1, "steps": 2000}, {"attn": "fp8-token", "val_exact": 9.0, "steps": 1000}]
    got = {x["attn"]: x for x in mod.parity(rows)}
    assert got["fp8-token"]["n"] == 1 and got["fp8-token"]["mean"] == pytest.approx(1.1)


def test_resume_with_another_source_of_the_same_name_is_refused(tf, source, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    tf.main(_argv(source, out, "bf16", 3, "--stop-at", "1"))
    other = tmp_path / "elsewhere" / source.name
    other.parent.mkdir()
    pq.write_table(pa.table({"text": ["another corpus " * 40] * 30}), other)
    with pytest.raises(SystemExit, match="not the data the checkpoint"):
        tf.main(_argv(other, out, "bf16", 3))
    assert tf.main(_argv(source, out, "bf16", 3))["complete"]


def test_a_source_too_small_to_split_is_refused_before_any_file_is_written(tf, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    one = tmp_path / "one.parquet"
    pq.write_table(pa.table({"text": ["a single document " * 20]}), one)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="the training split holds 0 documents"):
        tf.main(_argv(one, out, "bf16", 2))
    assert not (out / "log.jsonl").exists()
