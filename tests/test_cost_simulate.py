"""Cost functions, policy rule, schedule simulator and predict (DESIGN.md §6)."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler import (
    Calibration,
    TileConfig,
    attention_flops,
    build_work_list_host,
    choose_policy,
    fit_calibration,
    kernel_path,
    load_calibration,
    predict,
    simulate_schedule,
    tile_count,
    visible_pairs,
    workload_lengths,
)
from flamia_pack.scheduler.cost import document_first_items
from flamia_pack.scheduler.simulate import memory_bytes
from flamia_pack.scheduler.worklist import build_work_list_numba


def test_visible_pairs_seed_examples():
    # seed 001 §6: 16 x 4096 -> 134,250,496; 8192 + 224 x 256 -> 40,927,232
    assert visible_pairs([4096] * 16) == 134_250_496
    assert visible_pairs(workload_lengths("W2")) == 40_927_232
    assert visible_pairs([3, 1], causal=False) == 10
    assert visible_pairs([3, 1], causal=True) == 7
    assert visible_pairs([]) == 0
    # exact beyond int64 squares
    assert visible_pairs([2**40], causal=False) == 2**80


def test_flops_against_workloads_md():
    # W1 fwd+bwd FlexAttention 11.40 ms; WORKLOADS.md best W1 fwd+bwd 473 TFLOP/s at padded SDPA's 8.14 ms
    w1 = workload_lengths("W1")
    fwd = attention_flops(w1, 16, 128)
    assert fwd == 4 * 16 * 128 * 134_250_496
    assert attention_flops(w1, 16, 128, backward=True) == pytest.approx(2.5 * fwd)
    assert attention_flops(w1, 16, 128, mode="bwd") == pytest.approx(2.5 * fwd)
    total = attention_flops(w1, 16, 128, mode="fwd_bwd")
    assert total == pytest.approx(3.5 * fwd)
    assert round(total / 8.14e-3 / 1e12) == 473
    # W4: 549 TFLOP/s at 112.1 ms
    assert round(attention_flops(workload_lengths("W4"), 16, 128, mode="fwd_bwd") / 112.1e-3 / 1e12) == 549
    with pytest.raises(FlamiaError):
        attention_flops(w1, 16, 128, mode="both")


def test_tile_count_equals_sum_of_item_costs():
    cu = np.array([0, 5, 300, 1000])
    for cfg in (TileConfig(), TileConfig(causal=False), TileConfig(block_m=64, block_n=32, merge_short=True)):
        assert tile_count(cu, cfg) == int(build_work_list_host(cu, cfg)[:, 3].sum())
    # aligned causal doc of 4096 with 128x128 tiles: 32 * 33 / 2 tiles
    assert tile_count(np.array([0, 4096]), TileConfig()) == 32 * 33 // 2


def test_workload_mixes_match_workloads_md():
    for name in ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9"):
        assert workload_lengths(name).sum() == 65536, name
    w6 = workload_lengths("W6")
    assert w6[:-1].min() >= 16 and w6.max() <= 32768
    s2 = workload_lengths("S2")
    assert s2.sum() == 131072 and len(s2) == 145  # WORKLOADS.md: "seed 1; 145 documents"
    assert round(len(s2) * s2.max() / s2.sum(), 1) == 9.4  # "padded-to-longest would need 9.4x"
    with pytest.raises(FlamiaError):
        workload_lengths("W10")


def test_policy_rule():
    assert choose_policy([10, 10], causal=True)[0] == "dynamic"
    assert choose_policy([100, 100, 100, 100], causal=False)[0] == "static"
    # max = 4 x mean exactly -> dynamic (>=)
    lens = [400] + [0] * 3  # mean 100
    assert choose_policy(lens, causal=False)[0] == "dynamic"
    assert choose_policy([399, 1, 0, 0], causal=False)[0] == "static"  # mean 100, max 399
    pol, why = choose_policy([1, 1], causal=True, override="static")
    assert pol == "static" and "explicit" in why
    with pytest.raises(FlamiaError):
        choose_policy([1], causal=True, override="fast")
    for bad, msg in (([100, float("nan")], "nan at index 1"), ([100, -50], "-50 at index 1"),
                     ([[1, 2], [3, 4]], "1-D"), ("abc", "document lengths"), (["1", "x"], "document lengths")):
        with pytest.raises(FlamiaError, match=msg):
            choose_policy(bad, causal=True)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=0, max_size=60), causal=st.booleans())
def test_policy_for_call_agrees_with_choose_policy(lengths, causal):
    """The kernels' host-int form of the rule picks what choose_policy picks from the lengths."""
    from flamia_pack.scheduler.policy import policy_for_call

    from flamia_pack.scheduler.policy import policy_name_for_call

    args = (causal, max(lengths, default=0), sum(lengths), len(lengths))
    got = policy_for_call(*args)[0]
    want = "static" if sum(lengths) == 0 and not causal else choose_policy(lengths, causal=causal)[0]
    assert got == want == policy_name_for_call(*args)


def test_policy_for_call_rejects_bad_ints_and_resolves_the_kernel_schedule():
    from flamia_pack.kernels.attention import _resolve_policy
    from flamia_pack.kernels.config import AttentionKernelConfig, TritonFwdConfig
    from flamia_pack.scheduler.policy import policy_for_call

    for bad in ((-1, 10, 2), (5, 1.5, 2), (5, 10, True)):
        with pytest.raises(FlamiaError, match="must be an int >= 0"):
            policy_for_call(False, *bad)
    cfg = AttentionKernelConfig(fwd=TritonFwdConfig(schedule="policy"))
    assert _resolve_policy(cfg, False, 60, 250, 5).fwd.schedule == "static"  # max 60 < 4 x mean 50
    assert _resolve_policy(cfg, False, 200, 250, 5).fwd.schedule == "persistent"  # 200 >= 4 x 50
    assert _resolve_policy(cfg, True, 60, 250, 5).fwd.schedule == "persistent"  # causal -> dynamic


@settings(max_examples=40, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=0, max_size=300),
    p=st.integers(1, 20),
    a=st.floats(0.1, 10),
    b=st.floats(0, 5),
)
def test_simulator_invariants(costs, p, a, b):
    c = np.sort(np.asarray(costs, dtype=np.int64))[::-1]
    t = a * c + b
    for policy in ("static", "dynamic"):
        s = simulate_schedule(c, p, a, b, policy)
        if len(c) == 0:
            assert s.makespan_us == 0
            continue
        lower = max(t.sum() / p, t.max())
        assert s.makespan_us >= lower * (1 - 1e-12)
        assert s.makespan_us <= t.sum() * (1 + 1e-12)
        assert s.per_sm_busy_us.sum() == pytest.approx(t.sum())
        assert 0 <= s.busy_fraction <= 1 + 1e-12
        if t.sum() > 0:
            assert s.busy_fraction > 0
        # intervals: each unit once, durations right, no overlap on an SM, none after the makespan
        assert np.allclose(s.end_us - s.start_us, t)
        assert s.end_us.max() == pytest.approx(s.makespan_us)
        for sm in range(p):
            sel = np.sort(s.start_us[s.sm == sm])
            ends = np.sort(s.end_us[s.sm == sm])
            assert np.all(sel[1:] >= ends[:-1] - 1e-9)
        if p == 1:
            assert s.makespan_us == pytest.approx(t.sum())
    # greedy list scheduling (dynamic) is within 2x of the optimum, hence of the lower bound
    d = simulate_schedule(c, p, a, b, "dynamic")
    if len(c):
        assert d.makespan_us <= 2 * max(t.sum() / p, t.max()) + 1e-9


def test_simulator_static_snake_and_dynamic_order():
    costs = np.array([4, 3, 2, 1, 1, 1])
    s = simulate_schedule(costs, 2, 1.0, 0.0, "static")
    # snake over 2 SMs: SM0 gets units 0,3,4 (4+1+1), SM1 gets 1,2,5 (3+2+1)
    assert s.sm.tolist() == [0, 1, 1, 0, 0, 1]
    assert s.makespan_us == 6
    d = simulate_schedule(costs, 2, 1.0, 0.0, "dynamic")
    # greedy: SM0 [0,4), SM1 [0,3) then unit 2 on SM1 [3,5), unit 3 on SM0 [4,5), 4 on SM0 (tie -> lower id), 5 on SM1
    assert d.sm.tolist() == [0, 1, 1, 0, 0, 1]
    assert d.start_us.tolist() == [0, 0, 3, 4, 5, 5]
    assert d.makespan_us == 6
    with pytest.raises(FlamiaError):
        simulate_schedule(costs, 2, 1.0, 0.0, "random")


def test_calibration_table_and_lookup(tmp_path):
    table = load_calibration()
    for prec in ("bf16", "fp8"):
        for pas in ("fwd", "bwd", "fwd_bwd"):
            for d in (64, 128):
                cal = table.lookup(kernel_path(prec, pas), d, "H200")
                assert cal.a_us_per_tile > 0 and cal.b_us_per_item >= 0 and cal.source
    with pytest.raises(FlamiaError, match="available"):
        table.lookup("bf16_fwd", 96)
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"version": "x"}))
    with pytest.raises(FlamiaError, match="malformed"):
        load_calibration(bad)
    with pytest.raises(FlamiaError):
        kernel_path("fp4", "fwd")


def test_fit_calibration_recovers_known_model():
    a, b = 3.0, 7.0
    samples = []
    for name in ("W1", "W3", "W7", "W4"):
        p = predict(workload_lengths(name), calibration=Calibration(kernel_path="bf16_fwd", head_dim=128, gpu="H200",
                                                                      a_us_per_tile=a, b_us_per_item=b), pass_="fwd")
        samples.append((workload_lengths(name), 16, p.dynamic_ms * 1e3))
    fa, fb = fit_calibration(samples)
    assert fa == pytest.approx(a, rel=0.03) and fb == pytest.approx(b, rel=0.15)


def test_predict_w1_and_reports_everything():
    p = predict(workload_lengths("W1"))
    assert p.docs == 16 and p.tokens == 65536 and p.pairs == 134_250_496
    # default geometry = the calibration's: query tile i of a 4,096-token document sees
    # (i + 1) * 128 keys, i.e. (i + 1) * 128 / BLOCK_N key tiles
    per_tile = 128 // p.block_n
    assert p.block_m == 128 and p.block_n in (64, 128)
    assert p.items == 16 * 32 and p.tiles == 16 * per_tile * 32 * 33 // 2 and p.units == p.items * 16
    assert p.flops == attention_flops(workload_lengths("W1"), 16, 128, mode="fwd_bwd")
    assert p.policy == "dynamic" and p.predicted_ms == p.dynamic_ms
    # both schedules are at least the balanced lower bound
    t = p.a_us_per_tile * p.tiles * 16 + p.b_us_per_item * p.units
    assert p.static_ms * 1e3 >= t / 132 - 1e-6 and p.dynamic_ms * 1e3 >= t / 132 - 1e-6
    assert p.memory_packed_bytes == p.memory_padded_bytes  # equal lengths: no padding
    d = p.to_dict()
    json.dumps(d)
    assert set(d["schedules"]) == {"static", "dynamic"}
    assert p.calibration_version


def test_predict_memory_padded_vs_packed_s2():
    s2 = workload_lengths("S2")
    p = predict(s2, pass_="fwd_bwd")
    assert p.memory_padded_bytes / p.memory_packed_bytes == pytest.approx(145 * s2.max() / 131072)
    # q,k,v,o,dO,dq,dk,dv in bf16 + fp32 lse: 8 * T * H * D * 2 + 4 * T * H
    assert p.memory_packed_bytes == 8 * 131072 * 16 * 128 * 2 + 4 * 131072 * 16
    assert memory_bytes(10, 16, 4, 64, "fwd") == 2 * 10 * 64 * (32 + 8) + 4 * 10 * 16


def test_predict_options_and_errors():
    lens = [4000, 10, 10, 10, 10]
    cu = np.concatenate([[0], np.cumsum(lens)])
    a = predict(lens, num_kv_heads=4, capacity=4096, causal=False, precision="fp8", pass_="fwd")
    b = predict(cu_seqlens=cu, num_kv_heads=4, capacity=4096, causal=False, precision="fp8", pass_="fwd")
    assert a.to_dict() == b.to_dict()
    assert a.policy == "dynamic" and "skewed" in a.reason  # max 4000 >= 4 x mean 808
    assert predict(lens[:3], causal=False).policy == "static"  # 4000 < 4 x 1340
    assert a.capacity == 4096 and a.kernel_path == "fp8_fwd"
    s = predict(lens, policy="static")
    assert s.policy == "static" and s.predicted_ms == s.static_ms
    for kwargs in (dict(capacity=10), dict(num_heads=16, num_kv_heads=5), dict(precision="fp4"), dict(head_dim=96)):
        with pytest.raises(FlamiaError):
            predict(lens, **kwargs)
    with pytest.raises(FlamiaError):
        predict([])
    with pytest.raises(FlamiaError):
        predict([5, 0, 3])
    with pytest.raises(FlamiaError):
        predict(lens, cu_seqlens=cu)


@pytest.mark.parametrize("max_intervals", [0, 1, 1_000_000])
@pytest.mark.parametrize("num_sms", [0, -3, 2.5, True, 99_999_999_999])
def test_predict_rejects_num_sms_below_one_on_every_path(num_sms, max_intervals):
    """num_sms was validated only on the interval path: the item path (max_intervals=0, what
    `flamia plan` uses) raised ZeroDivisionError for 0 and "negative dimensions" for -3, and a huge
    value allocated per-SM state until MemoryError."""
    with pytest.raises(FlamiaError, match=r"num_sms must be an integer in \[1, 65,536\]"):
        predict([100, 200], num_sms=num_sms, max_intervals=max_intervals)
    assert predict([100, 200], num_sms=1, max_intervals=max_intervals).num_sms == 1


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{bad", "not valid JSON"),
        (b"\xff\xfe\x00", "cannot read calibration"),
        ("[1, 2]", "top level is not a JSON object"),
        ('{"entries": []}', "missing key 'version'"),
        ('{"version": "v"}', "missing key 'entries'"),
        ('{"version": "v", "entries": {}}', "'entries' is not a list"),
        ('{"version": "v", "entries": [3]}', "entries[0] is not a JSON object"),
        ('{"version": "v", "entries": [{"kernel_path": "bf16_fwd", "head_dim": 128}]}',
         "entries[0] is missing key(s) 'gpu', 'a_us_per_tile', 'b_us_per_item'"),
    ],
)
def test_load_calibration_says_what_is_wrong_and_what_is_expected(tmp_path, content, needle):
    """A calibration without "version" was reported as "malformed calibration X: 'version'"."""
    f = tmp_path / "cal.json"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(FlamiaError) as info:
        load_calibration(f)
    msg = str(info.value)
    assert needle in msg and str(f) in msg
    if "malformed" in msg:
        assert 'expected {"version": str, "entries": [{kernel_path, head_dim, gpu' in msg
    with pytest.raises(FlamiaError, match="Is a directory|cannot read calibration"):
        load_calibration(tmp_path)


def test_predict_merge_short_makes_one_token_documents_cheap():
    lens = np.ones(8192, np.int64)
    plain = predict(lens, pass_="fwd", config=TileConfig(merge_short=False))
    merged = predict(lens, pass_="fwd", config=TileConfig(merge_short=True))
    assert plain.items == 8192 and merged.items == 64
    assert merged.dynamic_ms < plain.dynamic_ms / 50


def test_predict_default_geometry_follows_the_calibrated_kernel():
    """Without a config, predict uses the calibration entry's tile geometry, i.e. the work lists the
    kernel really builds (the bf16 kernels merge tiny documents), so S1-like mixes are not
    predicted as 131,072 separate tiles."""
    lens = np.ones(8192, np.int64)
    cal = load_calibration().lookup("bf16_fwd", 128, "H200")
    assert cal.merge_short
    default = predict(lens, pass_="fwd")
    explicit = predict(lens, pass_="fwd", config=TileConfig(block_m=cal.block_m, block_n=cal.block_n, merge_short=True))
    assert default.merge_short and default.items == explicit.items == 64
    assert default.dynamic_ms == explicit.dynamic_ms


def test_predict_error_messages_name_the_real_problem():
    """A document length >= 2**31 was reported as "capacity ... does not fit int32" although no
    capacity was given; capacity 0 was reported as "more than capacity 0" (regression)."""
    with pytest.raises(FlamiaError, match=r"documents total 3000000000 tokens; one call holds at most 2\*\*31 - 1"):
        predict([3_000_000_000])
    with pytest.raises(FlamiaError, match="capacity must be >= 1 token, got 0"):
        predict([5, 3], capacity=0)
    with pytest.raises(FlamiaError, match=r"capacity 2147483648 does not fit int32 offsets \(at most 2\*\*31 - 1\)"):
        predict([5, 3], capacity=2**31)


# The committed benchmark the FP8 entries are fitted to (RESULTS.md "Session of 2026-12-06 (third)", commit 8654e79, W1-W9,
# bench_attention.py --fp8): per row the FP8 forward incl. quantization, the training call, and the backward a call pays
# (training call - forward), ms.
BENCH_FP8 = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "runs" / "bench-2026-12-06c-fp8-fa4" / \
    "bench_attention.json"


def _bench_fp8_ms() -> dict[str, dict[str, float]]:
    rows = json.loads(BENCH_FP8.read_text())["rows"]
    out = {"fp8_fwd": {}, "fp8_fwd_bwd": {}, "fp8_bwd": {}}
    for r in rows:
        if r["name"].startswith("W"):
            x = r["impl"]["ours_fp8"]
            out["fp8_fwd"][r["name"]] = x["fwd_ms"]
            out["fp8_fwd_bwd"][r["name"]] = x["train_ms"]
            out["fp8_bwd"][r["name"]] = x["train_ms"] - x["fwd_ms"]
    return out


def _fp8_errors(cal, measured):
    """Per-row relative error (%) of the shipped prediction (default policy: dynamic) against ``measured``."""
    from flamia_pack.scheduler import WORKLOADS

    pass_ = cal.kernel_path.split("_", 1)[1]
    out = {}
    for w, ms in measured.items():
        p = predict(workload_lengths(w), num_heads=WORKLOADS[w]["num_heads"], num_kv_heads=WORKLOADS[w]["num_kv_heads"],
                    precision="fp8", pass_=pass_)
        assert p.policy == "dynamic" and p.calibration_measured and p.kernel_path == cal.kernel_path
        out[w] = 100 * (p.predicted_ms - ms) / ms
    return out


@pytest.mark.parametrize("path, geometry", [("fp8_fwd", (128, 128, False)), ("fp8_bwd", (128, 64, False)),
                                            ("fp8_fwd_bwd", (128, 64, False))])
def test_fp8_calibration_is_the_fit_of_the_committed_benchmark(path, geometry):
    """The FP8 forward / backward / training-call entries are fit_calibration of the committed bench_attention.py
    --fp8 run on the entry's own geometry, and their source names the run and quotes the errors the shipped
    prediction really has; rows beyond the issues' 10% are named there (the model's limits), not hidden."""
    from flamia_pack.scheduler import WORKLOADS

    measured = _bench_fp8_ms()[path]
    assert sorted(measured) == [f"W{i}" for i in range(1, 10)]
    cal = load_calibration().lookup(path, 128, "H200")
    assert cal.measured and (cal.block_m, cal.block_n, cal.merge_short) == geometry
    cfg = TileConfig(block_m=cal.block_m, block_n=cal.block_n, merge_short=cal.merge_short)
    # the forward's entry carries the masked-tile and per-document terms (fit with its masked_tile0 rule, 0: tile 0
    # counted as mask-free); the others have neither
    fwd = path == "fp8_fwd"
    fit = fit_calibration([(workload_lengths(w), WORKLOADS[w]["num_heads"], ms * 1e3) for w, ms in measured.items()],
                          config=cfg, masked_tile0_max_mean=cal.masked_tile0_max_mean if fwd else None, doc_term=fwd)
    assert tuple(round(x, 4) for x in fit) == ((cal.a_us_per_tile, cal.b_us_per_item, cal.c_us_per_masked_tile,
                                                cal.d_us_per_doc) if fwd else (cal.a_us_per_tile, cal.b_us_per_item))
    assert (cal.c_us_per_masked_tile > 0) == fwd and (cal.d_us_per_doc > 0) == fwd
    for needle in ("8654e79", "2026-12-06", "bench_attention.py --fp8 --workloads W1,W2,W3,W6,W7,S2",
                   "--workloads W4,W5,W8,W9,S1", "benchmarks/runs/bench-2026-12-06c-fp8-fa4/"):
        assert needle in cal.source, needle
    errors = _fp8_errors(cal, measured)
    assert f"In-sample error (dynamic schedule): {', '.join(f'{w} {e:+.1f}%' for w, e in errors.items())}." in cal.source
    beyond = [w for w, e in errors.items() if abs(e) > 10.0]
    if beyond:
        named = cal.source.split("Beyond 10%:")[1]
        assert all(w in named for w in beyond), (beyond, named)


def test_fp8_backward_prediction_reproduces_measured_w1():
    """W1 (16 x 4,096, 16 heads, D 128, causal): the shipped prediction is within the fit's W1 error of the
    measured FP8 backward (8.339 ms, +1.8%) and training call (10.757 ms, +3.0%)."""
    ms = _bench_fp8_ms()
    bwd = predict(workload_lengths("W1"), num_heads=16, precision="fp8", pass_="bwd")
    assert bwd.kernel_path == "fp8_bwd" and bwd.calibration_measured
    assert bwd.predicted_ms == pytest.approx(ms["fp8_bwd"]["W1"], rel=0.02)
    train = predict(workload_lengths("W1"), num_heads=16, precision="fp8")
    assert train.kernel_path == "fp8_fwd_bwd" and train.calibration_measured
    assert train.predicted_ms == pytest.approx(ms["fp8_fwd_bwd"]["W1"], rel=0.035)
    assert bwd.predicted_ms < train.predicted_ms


def test_fp8_backward_units_mirror_the_kernel_programs():
    """The fp8_bwd entry's units (128-row items walking 64-key tiles) are the FP8 backward kernel's programs
    (128-key tiles on floor16(doc start) + 128 n walking 64-row query steps) mirrored: the same count and
    multiset of steps per document on rows whose documents span an even number of 64-row steps (W1-W5,
    W7-W9), a little more on unaligned ones (W6: +2.0%)."""
    pytest.importorskip("triton")
    import torch

    from flamia_pack.kernels.gluon_fp8_bwd import BWD_BLOCK_M, fp8_bwd_entries
    from flamia_pack.scheduler.worklist import build_work_list_numba, walked_tiles

    cal = load_calibration().lookup("fp8_bwd", 128, "H200")
    cfg = TileConfig(block_m=cal.block_m, block_n=cal.block_n, merge_short=cal.merge_short)
    for w in ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9"):
        lens = workload_lengths(w)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ent, n, _ = fp8_bwd_entries(torch.from_numpy(cu.astype(np.int32)), int(cu[-1]))
        a, f, _, end = ent[: int(n)].to(torch.int64).numpy().T
        steps = np.sort((end - f + BWD_BLOCK_M - 1) // BWD_BLOCK_M - (a - f) // BWD_BLOCK_M)
        model = np.sort(walked_tiles(build_work_list_numba(cu, cfg), cu, cfg))
        if w == "W6":
            assert (model.size, int(model.sum())) == (542, 8795) and (steps.size, int(steps.sum())) == (544, 8618)
        else:
            assert np.array_equal(model, steps), w


def _fp8_fwd_masked_brute(lens, causal, masked_tile0, block_n=128):
    """The FP8 forward's masked steps, item by item, as its loops run them (gluon_fp8_fwd._fp8_consume_entry:
    tile 0 masked unless u1 > 0 and the document starts on the 16-token grid and not masked_tile0; then
    tiles 1 .. u1 - 1 mask-free, the rest masked), from the kernel's geometry formulas."""
    out, s = [], 0
    for n in lens:
        ds, de = s, s + n
        for rs in range(ds, de, 128):
            re_ = min(rs + 128, de)
            ph = ds % 16
            lo = ds - ph
            hi = re_ if causal else de
            steps = -(-(hi - lo) // block_n)
            u1 = (rs - lo + 1) // block_n if causal else (hi - lo) // block_n
            t0_free = u1 > 0 and ph == 0 and not masked_tile0
            out.append((0 if t0_free else 1) + sum(1 for j in range(max(u1, 1), steps)) )
        s = de
    return out


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 700), min_size=1, max_size=30), causal=st.booleans(), mt0=st.booleans())
def test_fp8_fwd_masked_tiles_follow_the_kernels_loops(lens, causal, mt0):
    """cost.fp8_fwd_masked_tiles counts, per 128-row FP8 item, the key tiles the kernel's loops run through
    the masked softmax (unaligned starts, the diagonal, the masked_tile0 variant); causal: at least one (the
    diagonal)."""
    from flamia_pack.scheduler.cost import fp8_fwd_masked_tiles

    cfg = TileConfig(block_m=128, block_n=128, merge_short=False, causal=causal)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    items = build_work_list_host(cu, cfg)
    order = np.lexsort((items[:, 1], items[:, 0]))  # document order, rows ascending (the brute force's)
    got = fp8_fwd_masked_tiles(items, cu, cfg, masked_tile0=mt0)[order]
    assert got.tolist() == _fp8_fwd_masked_brute(lens, causal, mt0)
    assert got.min() >= (1 if causal else 0)


def test_fp8_fwd_masked_tile0_rule_matches_the_kernel():
    """An entry fitted with the launcher's masked_tile0 rule (MASKED_TILE0_MAX_MEAN) has predict apply it by the
    row's mean document length; the shipped entry counts tile 0 as mask-free (0: its fit gave those tiles no extra
    cost), so no row gets the rule."""
    gluon_fp8_fwd = pytest.importorskip("flamia_pack.kernels.gluon_fp8_fwd")
    cal = load_calibration().lookup("fp8_fwd", 128, "H200")
    assert cal.masked_tile0_max_mean in (0, gluon_fp8_fwd.MASKED_TILE0_MAX_MEAN)
    ruled = dataclasses.replace(cal, masked_tile0_max_mean=gluon_fp8_fwd.MASKED_TILE0_MAX_MEAN)
    short = predict([256] * 64, num_heads=16, precision="fp8", pass_="fwd", calibration=ruled)
    long = predict([4096] * 4, num_heads=16, precision="fp8", pass_="fwd", calibration=ruled)
    assert short.masked_tile0 and not long.masked_tile0
    assert short.c_us_per_masked_tile == cal.c_us_per_masked_tile > 0
    shipped = predict([256] * 64, num_heads=16, precision="fp8", pass_="fwd")
    assert shipped.masked_tile0 == (cal.masked_tile0_max_mean > 0)
    assert short.predicted_ms > shipped.predicted_ms  # the ruled entry charges c for 64 x 2 more masked tiles a head


def test_document_first_items_and_the_per_document_term():
    """document_first_items marks each document's first item (several for a merged item); predict's per-document
    term adds d per (document, head) to the busiest SMs' load: on a balanced row of equal documents and one unit an
    SM, the makespan grows by exactly d."""
    lens = np.array([300, 1, 77, 1500, 128, 129])
    cu = np.concatenate([[0], np.cumsum(lens)])
    for merge in (False, True):
        cfg = TileConfig(block_m=128, block_n=128, merge_short=merge)
        items = build_work_list_numba(cu, cfg)
        first = document_first_items(items, cu)
        assert first.sum() == lens.size and first.min() >= 0
        starts = set(cu[:-1].tolist())
        want = [sum(1 for s in starts if q0 <= s < q1) for q0, q1 in items[:, 1:3].tolist()]
        assert first.tolist() == want
    cal = load_calibration().lookup("fp8_fwd", 128, "H200")
    base = dataclasses.replace(cal, d_us_per_doc=0.0)
    more = dataclasses.replace(cal, d_us_per_doc=25.0)
    rows = [128] * 132  # one single-item document a head: 132 units on 132 SMs, one head
    p0 = predict(rows, num_heads=1, precision="fp8", pass_="fwd", calibration=base)
    p1 = predict(rows, num_heads=1, precision="fp8", pass_="fwd", calibration=more)
    assert p1.d_us_per_doc == 25.0 and p1.predicted_ms * 1e3 == pytest.approx(p0.predicted_ms * 1e3 + 25.0)


@pytest.mark.parametrize("field, value, needle", [
    ("c_us_per_masked_tile", -1.0, "c_us_per_masked_tile >= 0"),
    ("c_us_per_masked_tile", float("inf"), "finite c_us_per_masked_tile"),
    ("masked_tile0_max_mean", -5, "masked_tile0_max_mean >= 0"),
    ("masked_tile0_max_mean", 1.5, "integer masked_tile0_max_mean"),
    ("d_us_per_doc", -1.0, "d_us_per_doc >= 0"),
    ("d_us_per_doc", float("nan"), "finite d_us_per_doc"),
    ("d_us_per_doc", True, "finite d_us_per_doc"),
    ("c_us_per_masked_tile", True, "finite c_us_per_masked_tile"),
    ("a_us_per_tile", float("inf"), "finite numbers a > 0"),
    ("b_us_per_item", float("inf"), "finite numbers a > 0"),
    ("a_us_per_tile", True, "finite numbers a > 0"),
])
def test_calibration_masked_term_is_validated(field, value, needle):
    with pytest.raises(FlamiaError, match=needle):
        Calibration(kernel_path="fp8_fwd", head_dim=128, gpu="H200", **{"a_us_per_tile": 1.0, "b_us_per_item": 1.0,
                                                                      field: value})


def test_service_unit_costs_carry_the_masked_term():
    """engine.unit_costs (the refit's critical load) weighs units as predict does: with the fp8_fwd entry's
    masked-tile term, the busiest SM's time a * tiles + b * units is the predicted makespan."""
    from flamia_pack.service.engine import critical_load

    lens = np.array([300, 77, 1500, 31, 600, 2048])
    p = predict(lens, num_heads=2, precision="fp8", pass_="fwd", max_intervals=10 ** 6)
    assert p.c_us_per_masked_tile > 0
    tiles, units = critical_load(lens, p)
    assert p.a_us_per_tile * tiles + p.b_us_per_item * units == pytest.approx(p.schedules[p.policy].makespan_us)


@pytest.mark.parametrize("kw", [dict(num_heads=16.9), dict(num_kv_heads=4.0), dict(head_dim=128.7),
                                dict(num_heads=True)])
def test_predict_refuses_non_integer_shapes(kw):
    with pytest.raises(FlamiaError, match="must be an integer"):
        predict([100, 200], precision="fp8", pass_="fwd", **kw)
