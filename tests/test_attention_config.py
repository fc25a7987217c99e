"""CPU tests of the kernel configs: the family dataclasses and their validation, the band table,
``FLAMIA_ATTN_CONFIG`` / named configs, the custom-op int round trip, every shipped kernel family in
the Triton interpreter against the fp32 reference, and the host-side launch hints."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.attention import _config_from_ints, _config_to_ints
from flamia_pack.kernels.config import (BANDS, CONFIG_ENV, NAMED_CONFIGS, SMALL_BWD, AttentionKernelConfig,
                                        GluonBwdConfig, GluonFwdConfig, TritonBwdConfig, TritonFwdConfig, band_of,
                                        candidate_config, kernel_config)


def test_env_var_selects_a_named_config(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    base = kernel_config(128)
    assert base == candidate_config("default") == AttentionKernelConfig()
    for name, over in NAMED_CONFIGS.items():
        monkeypatch.setenv(CONFIG_ENV, name)
        cfg = kernel_config(128, max_seqlen=100)  # the variable wins over the band table
        assert cfg == dataclasses.replace(base, **over), name
        assert kernel_config(64) == candidate_config(name, 64)
    monkeypatch.setenv(CONFIG_ENV, "default")
    assert kernel_config(128, max_seqlen=256) == base
    monkeypatch.setenv(CONFIG_ENV, "")
    assert kernel_config(128, max_seqlen=256) == candidate_config("small_fwd_pers_items_n64s5_skip")


def test_band_table(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    cases = {(128, None, 1): "default", (128, 1025, 1): "default", (128, 4096, 4): "default",
             (128, 1024, 1): "all_pers_dqp", (128, 513, 1): "all_pers_dqp",
             (128, 512, 1): "small_fwd_pers", (128, 257, 1): "small_fwd_pers",
             (128, 256, 1): "small_fwd_pers_items_n64s5_skip", (128, 128, 1): "small_fwd_pers_items_n64s5_skip",
             (128, 127, 1): "small_n32r", (128, 1, 1): "small_n32r", (128, 0, 1): "small_n32r",
             (128, 1024, 4): "small_m16", (128, 100, 2): "small_m16",
             (64, 256, 1): "default", (64, None, 4): "default"}
    for (d, m, g), name in cases.items():
        assert band_of(d, m, g) == name, (d, m, g)
        assert kernel_config(d, max_seqlen=m, num_kv_groups=g) == candidate_config(name, d), (d, m, g)
    assert {b[1] for b in BANDS} == set(NAMED_CONFIGS) - {"triton"}  # every band config is named, and documented
    assert all(b[2].startswith("RESULTS") for b in BANDS)
    # what each band runs
    d = kernel_config(128)
    assert d.gluon_fwd == GluonFwdConfig(pingpong=True) and d.gluon_bwd == GluonBwdConfig()
    assert kernel_config(64).gluon_fwd is None and kernel_config(64).fwd.block_n == 128
    band = candidate_config("all_pers_dqp")
    assert band.gluon_bwd.persistent and not band.gluon_bwd.dq_reduce and band.gluon_fwd == d.gluon_fwd
    pers = candidate_config("small_fwd_pers")
    assert pers.gluon_fwd == GluonFwdConfig(pingpong=False) and pers.gluon_bwd is None and pers.bwd == SMALL_BWD
    items = candidate_config("small_fwd_pers_items_n64s5_skip")
    assert items == dataclasses.replace(pers, wl_block_m=256, gluon_fwd=GluonFwdConfig(
        block_n=64, stages=5, pingpong=False, whole_items=True, part_skip=True))
    n32r = candidate_config("small_n32r")
    assert n32r.gluon_fwd is None and n32r.fwd == TritonFwdConfig(block_m=64, block_n=32, num_warps=4, maxnreg=168)
    m16 = candidate_config("small_m16")
    assert m16.gluon_fwd is None and m16.gluon_bwd is None and m16.bwd.block_m1 == 16 and SMALL_BWD.block_m1 == 32
    tri = candidate_config("triton")
    assert tri.gluon_fwd is None and tri.gluon_bwd is None and tri.fwd == d.fwd and tri.bwd == d.bwd


def test_kernel_config_rejects_bad_arguments(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(FlamiaError, match="num_kv_groups"):
            kernel_config(128, max_seqlen=256, num_kv_groups=bad)
    for bad in (128.0, True, "128", 96):
        with pytest.raises(FlamiaError, match="head_dim"):
            kernel_config(bad, max_seqlen=256)
    with pytest.raises(FlamiaError, match="causal must be a bool"):
        kernel_config(128, "no")
    with pytest.raises(FlamiaError, match="precision"):
        kernel_config(128, precision="fp4")
    for bad in (-5, True, 2.5, "12"):
        with pytest.raises(FlamiaError, match="max_seqlen"):
            kernel_config(128, max_seqlen=bad)


def test_env_var_unknown_name_is_a_clear_error(monkeypatch):
    import torch

    from flamia_pack.kernels.attention import varlen_attention

    monkeypatch.setenv(CONFIG_ENV, "no_such_variant")
    with pytest.raises(FlamiaError, match="FLAMIA_ATTN_CONFIG='no_such_variant' names no attention config.*small_n32r"):
        kernel_config(128)
    q = torch.randn(10, 2, 64)
    with pytest.raises(FlamiaError, match="FLAMIA_ATTN_CONFIG"):  # the CPU fallback checks it too
        varlen_attention(q, q, q, torch.tensor([0, 10], dtype=torch.int32), 10)


@pytest.mark.parametrize("cls,bad,match", [
    (TritonFwdConfig, {"block_m": 48}, "block_m must be a power of two"),
    (TritonFwdConfig, {"num_warps": 3}, "num_warps"),
    (TritonFwdConfig, {"num_stages": 0}, "num_stages"),
    (TritonFwdConfig, {"maxnreg": 12}, "maxnreg"),
    (TritonFwdConfig, {"schedule": "rr"}, "schedule must be one of"),
    (GluonFwdConfig, {"block_n": 32}, "block_n must be 64 or 128"),
    (GluonFwdConfig, {"stages": 1}, "stages"),
    (GluonFwdConfig, {"block_n": 128, "stages": 3}, "do not fit"),
    (GluonFwdConfig, {"part_skip": True}, "part_skip needs whole_items"),
    (GluonFwdConfig, {"pingpong": 1}, "pingpong must be a bool"),
    (TritonBwdConfig, {"block_m1": 256}, "block_m1 | block_n1"),
    (TritonBwdConfig, {"num_warps": 5}, "num_warps"),
    (GluonBwdConfig, {"min_len": 0}, "min_len"),
    (GluonBwdConfig, {"min_len": True}, "min_len"),
    (GluonBwdConfig, {"dq_reduce": 1}, "dq_reduce must be a bool"),
    (AttentionKernelConfig, {"wl_block_m": 96}, "wl_block_m"),
    (AttentionKernelConfig, {"wl_block_m": 32}, "must divide wl_block_m"),
    (AttentionKernelConfig, {"fwd": {"block_m": 64}}, "fwd must be a TritonFwdConfig"),
    (AttentionKernelConfig, {"bwd": None}, "bwd must be a TritonBwdConfig, got None"),
    (AttentionKernelConfig, {"wl_block_m": 256}, "whole_items"),
    (AttentionKernelConfig, {"gluon_fwd": GluonFwdConfig(whole_items=True)}, "whole_items"),
])
def test_family_fields_are_validated(cls, bad, match):
    with pytest.raises(FlamiaError, match=match):
        cls(**bad)


def test_config_int_round_trip_keeps_types():
    cfgs = [candidate_config(n, d) for n in NAMED_CONFIGS for d in (64, 128)]
    cfgs.append(AttentionKernelConfig(fwd=TritonFwdConfig(schedule="policy"), gluon_bwd=None))
    for cfg in cfgs:
        ints = _config_to_ints(cfg)
        assert len(ints) == AttentionKernelConfig.key_length() and all(type(x) is int for x in ints)
        back = _config_from_ints(ints)
        assert back == cfg
        if back.gluon_fwd is not None:
            assert isinstance(back.gluon_fwd.pingpong, bool)


_SCRIPT = r"""
import dataclasses, json
from flamia_pack.kernels.check import compare_with_reference
from flamia_pack.kernels.config import NAMED_CONFIGS, SMALL_BWD, AttentionKernelConfig, TritonBwdConfig, TritonFwdConfig
import flamia_pack.kernels.flash_bwd as B
# each Triton family's tiles scaled to a small row (wl_block_m = 32): the shape of each shipped
# config (its tile ratios, warps, stages, schedule) on a row the interpreter runs in seconds
def scale(t):
    return dataclasses.replace(t, **{f.name: max(16, getattr(t, f.name) // 4) for f in dataclasses.fields(t)
                                     if f.name.startswith("block")})
B.SMALL_BWD = scale(SMALL_BWD)
out = {}
configs = {name: AttentionKernelConfig(**{**dict(NAMED_CONFIGS[name])}) for name in NAMED_CONFIGS
           if NAMED_CONFIGS[name].get("wl_block_m", 128) == 128}
configs["policy"] = AttentionKernelConfig(fwd=TritonFwdConfig(schedule="policy"))
for name, cfg in configs.items():
    cfg = dataclasses.replace(cfg, wl_block_m=32, fwd=scale(cfg.fwd), bwd=scale(cfg.bwd))
    for causal in (True, False):
        r = compare_with_reference([40, 5, 1, 1, 2, 23], num_heads=4, num_kv_heads=2, head_dim=64, causal=causal,
                                   pad=3, seed=11, config=cfg, with_lse_grad=causal)
        out[f"{name}/{causal}"] = r
print("RESULTS " + json.dumps(out))
"""
_INTERP_CONFIGS = sorted([n for n in NAMED_CONFIGS if NAMED_CONFIGS[n].get("wl_block_m", 128) == 128] + ["policy"])


@pytest.fixture(scope="module")
def interp_results(run_interpreter):
    # forward + backward of every shipped Triton family (the Gluon families need sm_90 and run in the
    # GPU tests; on the CPU their configs run the Triton kernels of the same config), both masks
    return run_interpreter(_SCRIPT, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", _INTERP_CONFIGS)
@pytest.mark.parametrize("causal", [True, False])
def test_shipped_configs_in_interpreter(interp_results, name, causal):
    r = interp_results[f"{name}/{causal}"]
    # every output element written exactly by one launch: the poisoned (NaN) outputs would fail
    assert r["pad_ok"], r
    for x in ("o", "dq", "dk", "dv"):
        assert r[f"ok_{x}"], f"{name}: {x} error {r[f'err_{x}']:.4g} > 2 x bf16 baseline {r[f'base_{x}']:.4g} + atol"


def test_gluon_available_on_this_triton():
    """The Gluon paths' gate (version parse + import) runs without error; only triton 3.6.x qualifies."""
    import triton

    from flamia_pack.kernels.flash_fwd import gluon_available

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    assert gluon_available() == ((major, minor) == (3, 6))


@pytest.mark.parametrize("bad", [["small"], None, 3])
def test_candidate_config_name_must_be_a_str(bad):
    """candidate_config(['small']) raised TypeError: unhashable type: 'list' (regression)."""
    with pytest.raises(FlamiaError, match="config name must be a str.*known: default"):
        candidate_config(bad)
    with pytest.raises(FlamiaError, match="unknown attention config name 'nope'; known: default"):
        candidate_config("nope")


def test_kernel_breakdown_table_and_cpu_smoke(capsys):
    """benchmarks/probes/kernel_breakdown.py: the aggregation is per call and sorted; the CPU smoke run prints a table."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    import kernel_breakdown as K

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [SimpleNamespace(name="a", device_type=cuda, device_time=10.0, self_cpu_time_total=0.0),
          SimpleNamespace(name="a", device_type=cuda, device_time=30.0, self_cpu_time_total=0.0),
          SimpleNamespace(name="b", device_type=cuda, device_time=60.0, self_cpu_time_total=0.0),
          SimpleNamespace(name="host", device_type=cpu, device_time=0.0, self_cpu_time_total=99.0)]
    rows = K.kernel_table(ev, calls=2)
    assert [r[0] for r in rows] == ["b", "a"]
    assert rows[0][1:] == (30.0, 0.5, 0.6) and rows[1][1:] == (20.0, 1.0, 0.4)
    assert K.kernel_table(ev, calls=1, device=False) == [("host", 99.0, 1.0, 1.0)]
    with pytest.raises(ValueError, match="calls must be >= 1"):
        K.kernel_table(ev, calls=0)
    assert K.main(["--cpu-smoke", "--calls", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "### smoke train" in out and "| kernel | us / call |" in out


def test_ab_kernel_file_helpers(tmp_path, capsys):
    """benchmarks/probes/ab_kernel_file.py: variant specs are validated, medians and ratios vs ``current``
    are per (variant, workload, metric), and without a GPU nothing is touched or measured."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes"))
    import ab_kernel_file as A

    f = tmp_path / "v.py"
    f.write_text("x = 1\n")
    assert A.parse_variant(f"old={f}") == ("old", str(f))
    for bad in ("old", "=x", f"current={f}", "old=/nonexistent/file.py"):
        with pytest.raises(ValueError):
            A.parse_variant(bad)
    runs = {"current": [{"W1": {"fwd_ms": 2.0, "train_ms": 8.0}}, {"W1": {"fwd_ms": 4.0, "train_ms": 10.0}}],
            "old": [{"W1": {"fwd_ms": 3.3, "train_ms": 9.9}}]}
    rows = A.summarize(runs)
    assert ("current", "W1", "fwd_ms", 3.0, 1.0) in rows
    assert ("current", "W1", "train_ms", 9.0, 1.0) in rows
    old = {(r[1], r[2]): r for r in rows if r[0] == "old"}
    assert old[("W1", "fwd_ms")][3:] == pytest.approx((3.3, 1.1))
    assert old[("W1", "train_ms")][3:] == pytest.approx((9.9, 1.1))
    target = tmp_path / "target.py"
    target.write_text("y = 2\n")
    import torch

    if not torch.cuda.is_available():
        assert A.main(["--file", str(target), "--variant", f"v={f}"]) == 0
        assert "needs a CUDA GPU" in capsys.readouterr().out
        assert target.read_text() == "y = 2\n"


def _leftover_rows(cu, cfg, skip: int) -> int:
    """Brute force: rows of the host work list that the Gluon paths leave to their Triton launch
    (merged items and documents of at most ``skip`` tokens: ``gluon_common._item_span``)."""
    from flamia_pack.scheduler.worklist import build_work_list_host
    from flamia_pack.scheduler.worklist import TileConfig

    items = build_work_list_host(cu, TileConfig(block_m=cfg.wl_block_m, block_n=64, causal=True,
                                                merge_short=cfg.merge_short))
    n = 0
    for doc, qs, qe, _ in items:
        ds, de = int(cu[doc]), int(cu[doc + 1])
        n += int(qe > de or de - ds <= skip)
    return n


def test_leftover_bits_are_sound_and_skip_long_document_rows():
    """``attention.leftover_bits``: a launch is marked skippable only if the row really has no row for
    it (brute force over the host work list, random rows of short and long documents, several
    configs), and the long-document workloads skip both launches."""
    from flamia_pack.kernels.attention import LEFTOVER_BWD, LEFTOVER_FWD, leftover_bits
    from flamia_pack.scheduler.workloads import workload_lengths

    import numpy as np

    rep = dataclasses.replace
    cfgs = [kernel_config(128), kernel_config(128, max_seqlen=1024), kernel_config(128, max_seqlen=256),
            rep(kernel_config(128), gluon_bwd=GluonBwdConfig(min_len=64)), rep(kernel_config(128), merge_short=False),
            rep(kernel_config(128), gluon_bwd=GluonBwdConfig(min_len=300))]
    rng = np.random.default_rng(0)
    checked = skipped = 0
    for trial in range(400):
        hi = int(rng.choice([3, 130, 600, 3000]))
        lo = int(rng.integers(1, hi))
        lengths = rng.integers(lo, hi + 1, size=int(rng.integers(1, 12)))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for cfg in cfgs:
            bits = leftover_bits(cfg, int(lengths.min()))
            fwd_rows = _leftover_rows(cu, cfg, 1)
            bwd_rows = _leftover_rows(cu, cfg, (cfg.gluon_bwd or GluonBwdConfig()).min_len)
            assert fwd_rows == 0 or bits & LEFTOVER_FWD, (lengths.tolist(), cfg.wl_block_m, bits)
            assert bwd_rows == 0 or bits & LEFTOVER_BWD, (lengths.tolist(), cfg.wl_block_m, bits)
            checked += 1
            skipped += (bits & LEFTOVER_FWD == 0) + (bits & LEFTOVER_BWD == 0)
    assert checked == 2400 and skipped > 500  # the skip is exercised, not just the safe default
    # exactly at the thresholds (a document of skip_len tokens is the Triton launch's; merging needs one
    # shorter than wl_block_m)
    c300 = rep(kernel_config(128), gluon_bwd=GluonBwdConfig(min_len=300))
    for cfg, lengths, fwd, bwd in ((c300, [300, 1000], False, True), (c300, [301, 1000], False, False),
                                   (kernel_config(128), [512, 1000], False, True),
                                   (kernel_config(128), [513, 1000], False, False),
                                   (kernel_config(128), [127, 1000], True, True),
                                   (kernel_config(128), [128, 1000], False, True)):
        cu = np.concatenate([[0], np.cumsum(lengths)])
        bits = leftover_bits(cfg, min(lengths))
        assert bool(bits & LEFTOVER_FWD) == fwd and bool(bits & LEFTOVER_BWD) == bwd, (lengths, bits)
        assert (_leftover_rows(cu, cfg, 1) > 0) == fwd or lengths[0] == 127, lengths
        assert (_leftover_rows(cu, cfg, cfg.gluon_bwd.min_len) > 0) == bwd or lengths[0] == 127, lengths
    assert leftover_bits(kernel_config(128), None) == LEFTOVER_FWD | LEFTOVER_BWD  # unknown: launch both
    for name in ("W1", "W3", "W4", "W5", "W8", "W9"):
        assert leftover_bits(kernel_config(128), int(workload_lengths(name).min())) == 0, name
    assert leftover_bits(kernel_config(128), 256) == LEFTOVER_BWD  # W2's shortest: the forward skips
    assert leftover_bits(kernel_config(128), 1) == LEFTOVER_FWD | LEFTOVER_BWD


def test_op_config_carries_the_leftover_bits():
    from flamia_pack.kernels.attention import _op_config, _op_config_ints

    cfg = kernel_config(128)
    for bits in range(8):
        assert _op_config(_op_config_ints(cfg, bits)) == (cfg, bits)
    assert _op_config(_config_to_ints(cfg)) == (cfg, 7)  # no mask: every launch, as before


def test_launch_bits_fill_the_tail_unless_the_row_is_known_to_have_none():
    """``attention.launch_bits``: PAD_TAIL (the padding fills) is cleared only when the host knows
    ``cu_seqlens[-1] == T``; the leftover bits are :func:`leftover_bits`' unchanged."""
    from flamia_pack.kernels.attention import PAD_TAIL, launch_bits, leftover_bits

    cfg = kernel_config(128)
    for ms in (None, 1, 100, 300, 4096):
        lb = leftover_bits(cfg, ms)
        assert launch_bits(cfg, ms, 65536, 65536) == lb
        assert launch_bits(cfg, ms, 65535, 65536) == lb | PAD_TAIL
        assert launch_bits(cfg, ms, 0, 65536) == lb | PAD_TAIL
        assert launch_bits(cfg, ms, None, 65536) == lb | PAD_TAIL  # unknown: fill


def test_work_list_doc_tokens_hint():
    """``WorkList.doc_tokens`` (``cu_seqlens[-1]``): from a validated build or given by the caller,
    trusted as ``min_seqlen`` is (dropped once the buffers are rewritten), and checked."""
    import torch

    from flamia_pack.errors import MetadataError
    from flamia_pack.scheduler.worklist import TileConfig, build_work_list, work_list_hints

    full = torch.tensor([0, 600, 1300, 2048], dtype=torch.int32)
    padded = torch.tensor([0, 5, 20, 2000], dtype=torch.int32)
    wl = build_work_list(full, 2048, TileConfig())
    assert (wl.doc_tokens, work_list_hints(wl)) == (2048, (600, 2048))
    other = build_work_list(padded, 2048, TileConfig(), max_items=wl.max_items)
    assert work_list_hints(other) == (5, 2000)
    wl.items.copy_(other.items)
    assert work_list_hints(wl) == (None, None)  # refilled in place: neither hint is trusted
    assert work_list_hints(build_work_list(full, 2048, TileConfig(), validate=False)) == (None, None)
    given = build_work_list(full, 2048, TileConfig(), validate=False, doc_tokens=2048)  # a caller's host copy
    assert work_list_hints(given) == (None, 2048)
    hand = build_work_list(full, 2048, TileConfig(), validate=False)
    hand.doc_tokens = 2048  # set by hand on the object: not trusted
    assert work_list_hints(hand) == (None, None)
    edited = build_work_list(padded, 2048, TileConfig())  # validated and stamped, then edited by hand
    edited.doc_tokens = 2048  # would skip the padding fills of rows 2000-2047
    assert work_list_hints(edited) == (None, None)
    edited = build_work_list(padded, 2048, TileConfig())
    edited.min_seqlen = 600
    assert work_list_hints(edited) == (None, None)
    for bad in (2049, -1, 3.0):
        with pytest.raises(MetadataError, match="doc_tokens"):
            build_work_list(full, 2048, TileConfig(), validate=False, doc_tokens=bad)


def test_work_list_min_seqlen_only_when_validated():
    """``WorkList.min_seqlen`` (the hint behind the skipped launches) is known only from a validated
    build, and a buffer rebuilt without validation never keeps another row's value."""
    import torch

    from flamia_pack.scheduler.worklist import build_work_list
    from flamia_pack.scheduler.worklist import TileConfig

    cu = torch.tensor([0, 700, 1300, 3000], dtype=torch.int32)
    wl = build_work_list(cu, 3010, TileConfig())
    assert wl.min_seqlen == 600
    assert build_work_list(cu, 3010, TileConfig(), validate=False).min_seqlen is None
    short = torch.tensor([0, 5, 1300, 3000], dtype=torch.int32)
    again = build_work_list(short, 3010, TileConfig(), out=wl, max_items=wl.max_items, validate=False)
    assert again is wl and wl.min_seqlen is None
    assert build_work_list(short, 3010, TileConfig(), out=wl, max_items=wl.max_items).min_seqlen == 5
    assert build_work_list(torch.tensor([0], dtype=torch.int32), 8, TileConfig()).min_seqlen is None


def test_work_list_hint_is_dropped_when_the_buffers_are_rewritten():
    """A validated list later refilled in place for another row (``copy_`` into its static buffers)
    must not keep the first row's hint: ``work_list_hints`` compares the buffers' version counters."""
    import torch

    from flamia_pack.scheduler.worklist import TileConfig, build_work_list, work_list_hints

    long_cu = torch.tensor([0, 600, 1300, 2048], dtype=torch.int32)
    short_cu = torch.tensor([0, 5, 20, 2048], dtype=torch.int32)
    wl = build_work_list(long_cu, 2048, TileConfig())
    other = build_work_list(short_cu, 2048, TileConfig(), max_items=wl.max_items)
    assert work_list_hints(wl)[0] == 600 and work_list_hints(other)[0] == 5
    wl.items.copy_(other.items)
    assert wl.min_seqlen == 600 and work_list_hints(wl)[0] is None
    fresh = build_work_list(long_cu, 2048, TileConfig())
    fresh.num_items.copy_(other.num_items)
    assert work_list_hints(fresh)[0] is None
    hand = build_work_list(long_cu, 2048, TileConfig(), validate=False)
    hand.min_seqlen = 600  # set by hand on the object: not trusted
    assert work_list_hints(hand)[0] is None
    given = build_work_list(long_cu, 2048, TileConfig(), validate=False, min_seqlen=600)  # a caller's host copy
    assert work_list_hints(given)[0] == 600


def test_work_lists_follow_the_call_band_and_old_lists_still_serve(monkeypatch):
    """``build_attention_work_list(max_seqlen=)`` builds the list the call would (256-row items in the
    whole-item band); a list built without it (128-row items) makes the automatic config fall back to
    the band's 128-row programs (``small_fwd_pers``) instead of raising; an explicit config does not."""
    import torch

    from flamia_pack.kernels.attention import _check_work_list, _config_for_list, build_attention_work_list

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    cu = torch.tensor([0, 256, 300, 556], dtype=torch.int32)
    wl256 = build_attention_work_list(cu, 556, max_seqlen=256)
    wl128 = build_attention_work_list(cu, 556)
    assert (wl256.config.block_m, wl128.config.block_m) == (256, 128)
    assert build_attention_work_list(cu, 556, max_seqlen=1000).config.block_m == 128
    auto = kernel_config(128, max_seqlen=256)
    assert _config_for_list(auto, wl256) is auto
    assert _config_for_list(auto, wl128) == candidate_config("small_fwd_pers")
    _check_work_list(wl128, True, _config_for_list(auto, wl128), cu.device, 556, cu)
    with pytest.raises(FlamiaError, match="block_m=128; the kernels chosen for this call expect block_m=256"):
        _check_work_list(wl128, True, auto, cu.device, 556, cu)
    other = kernel_config(128, max_seqlen=2048)
    assert _config_for_list(other, wl256) is other


def test_work_list_row_hints_are_checked_and_the_cpu_path_accepts_band_lists(monkeypatch):
    """``build_attention_work_list``: ``max_seqlen`` / ``num_kv_groups`` / ``config`` checked (also with a
    config), ``max_seqlen`` below the longest document rejected (validate), and the CPU path takes a
    list built with the call's ``max_seqlen`` (the GPU path's geometry), with a message naming the fix
    for a list of other geometry."""
    import numpy as np
    import torch

    from flamia_pack.errors import MetadataError
    from flamia_pack.kernels.attention import build_attention_work_list
    from flamia_pack.kernels.attention import varlen_attention

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    cu = torch.tensor([0, 200, 256, 500, 512], dtype=torch.int32)
    for bad in (-1, 1.0, True, "200"):
        with pytest.raises(MetadataError, match="max_seqlen must be None or an int >= 0"):
            build_attention_work_list(cu, 512, max_seqlen=bad)
        with pytest.raises(MetadataError, match="max_seqlen must be None or an int >= 0"):
            build_attention_work_list(cu, 512, config=kernel_config(128), max_seqlen=bad)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(FlamiaError, match="num_kv_groups must be an int >= 1"):
            build_attention_work_list(cu, 512, config=kernel_config(128), num_kv_groups=bad)
    with pytest.raises(FlamiaError, match=r"config=candidate_config\('small_fwd_pers'\)"):
        build_attention_work_list(cu, 512, config="small_fwd_pers")
    with pytest.raises(MetadataError, match="smaller than the longest document"):
        build_attention_work_list(cu, 512, max_seqlen=200)
    assert build_attention_work_list(cu, 512, max_seqlen=np.int64(244)).config.block_m == 256
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(512, 4, 128, generator=g) for _ in range(3))
    ref = varlen_attention(q, k, v, cu, 244)
    for wl in (build_attention_work_list(cu, 512, max_seqlen=244), build_attention_work_list(cu, 512)):
        assert torch.equal(varlen_attention(q, k, v, cu, 244, work_list=wl), ref)
    with pytest.raises(FlamiaError, match=r"max_seqlen=<this call's max_seqlen>"):
        varlen_attention(q, k, v, cu, 1000, work_list=build_attention_work_list(cu, 512, max_seqlen=244))
