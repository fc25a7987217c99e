"""CPU tests of the attention config candidates (issue 5 backward sweep): ``FLAMIA_ATTN_CONFIG``,
validation of the backward knobs, and every candidate's kernels in the Triton interpreter against
the fp32 reference (TMA descriptor loads included)."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from flamia_pack.errors import FlamiaError
from flamia_pack.kernels.attention import _config_from_ints, _config_to_ints
from flamia_pack.kernels.config import CANDIDATES, CONFIG_ENV, AttentionKernelConfig, candidate_config, kernel_config


def test_env_var_selects_candidate(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    base = kernel_config(128)
    assert base == candidate_config("default")
    assert not base.bwd_tma and base.bwd_masked_stages == 0 and base.bwd_fused
    for name, over in CANDIDATES.items():
        monkeypatch.setenv(CONFIG_ENV, name)
        cfg = kernel_config(128)
        for field, value in over.items():
            assert getattr(cfg, field) == value, (name, field)
        # fields a candidate does not name keep the default's value
        for field in AttentionKernelConfig.__dataclass_fields__:
            if field not in over:
                assert getattr(cfg, field) == getattr(base, field), (name, field)
        monkeypatch.delenv(CONFIG_ENV)
        base64 = kernel_config(64)
        monkeypatch.setenv(CONFIG_ENV, name)
        assert kernel_config(64) == candidate_config(name, 64)
        assert kernel_config(64).block_n == (over["block_n"] if "block_n" in over else base64.block_n), name
    monkeypatch.setenv(CONFIG_ENV, "default")
    assert kernel_config(128) == base
    monkeypatch.setenv(CONFIG_ENV, "")
    assert kernel_config(128) == base


def test_small_tiles_for_rows_of_short_documents(monkeypatch):
    from flamia_pack.kernels.config import (SMALL_BWD_MAX_SEQLEN, SMALL_FWD_GLUON_MIN_SEQLEN, SMALL_ITEMS_MAX_SEQLEN,
                                            SMALL_MAX_SEQLEN)

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    small = candidate_config("small")
    assert small.block_m == 64 and small.bwd_block_n1 == 64 and small.bwd_num_warps == 4
    # <= 512: the small set with the 64 x 32 forward capped at 168 registers
    # <= 512 with a document of >= 128 tokens: the persistent Gluon forward, the small Triton backward
    assert kernel_config(128, max_seqlen=SMALL_BWD_MAX_SEQLEN) == candidate_config("small_fwd_pers")
    assert kernel_config(128, max_seqlen=SMALL_ITEMS_MAX_SEQLEN + 1) == candidate_config("small_fwd_pers")
    pers = candidate_config("small_fwd_pers")
    assert pers.fwd_gluon and pers.fwd_gluon_persistent and not pers.bwd_gluon
    # 128..256: the same on whole 256-row items (one per document), K / V once in a 5 x 64-key ring
    # and each consumer partition skipping the tiles all masked for its rows (2026-11-30 (sixth))
    items = candidate_config("small_fwd_pers_items_n64s5_skip")
    assert kernel_config(128, max_seqlen=SMALL_FWD_GLUON_MIN_SEQLEN) == items
    assert kernel_config(128, max_seqlen=SMALL_ITEMS_MAX_SEQLEN) == items
    assert items == dataclasses.replace(pers, wl_block_m=256, fwd_gluon_items=True, fwd_gluon_block_n=64,
                                        fwd_gluon_stages=5, fwd_gluon_part_skip=True)
    # every document shorter than a 128-row entry: no Gluon entry to run, the Triton forward
    assert kernel_config(128, max_seqlen=SMALL_FWD_GLUON_MIN_SEQLEN - 1) == candidate_config("small_n32r")
    assert kernel_config(128, max_seqlen=1) == candidate_config("small_n32r")
    assert candidate_config("small_n32r") == dataclasses.replace(small, block_n=32, fwd_maxnreg=168)
    # 513..1024: the persistent Gluon forward, dK/dV and dQ programs
    band = candidate_config("all_pers_dqp")
    assert kernel_config(128, max_seqlen=SMALL_MAX_SEQLEN) == band
    assert kernel_config(128, max_seqlen=SMALL_BWD_MAX_SEQLEN + 1) == band
    assert band.fwd_gluon and band.fwd_gluon_persistent and band.bwd_gluon and band.bwd_gluon_persistent
    assert not band.bwd_gluon_dq_reduce
    # the short-document tile sets run the Triton forward with their own tiles
    for name in ("small", "small_n32r", "small_m16", "fwd_small"):
        assert not candidate_config(name).fwd_gluon, name
    assert kernel_config(128, max_seqlen=SMALL_MAX_SEQLEN + 1) == kernel_config(128)
    # GQA: the small set's spill-free 16-query dK/dV step
    assert kernel_config(128, max_seqlen=256, num_kv_groups=4) == candidate_config("small_m16")
    assert candidate_config("small_m16").bwd_block_m1 == 16 and small.bwd_block_m1 == 32
    assert kernel_config(128, max_seqlen=4096, num_kv_groups=4) == kernel_config(128)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(FlamiaError, match="num_kv_groups"):
            kernel_config(128, max_seqlen=256, num_kv_groups=bad)
    for bad in (128.0, True, "128"):
        with pytest.raises(FlamiaError, match="head_dim"):
            kernel_config(bad, max_seqlen=256)
    with pytest.raises(FlamiaError, match="causal must be a bool"):
        kernel_config(128, "no")
    assert kernel_config(128, max_seqlen=SMALL_MAX_SEQLEN + 1) == kernel_config(128)
    assert kernel_config(128, max_seqlen=None) == kernel_config(128) != small
    assert kernel_config(64, max_seqlen=256) == kernel_config(64)  # D = 64: not measured, default tiles
    # same work-list geometry: a list built for one tile set serves the other
    assert (small.wl_block_m, small.merge_short) == (kernel_config(128).wl_block_m, kernel_config(128).merge_short)
    monkeypatch.setenv(CONFIG_ENV, "default")  # an explicit choice wins over the rule
    assert kernel_config(128, max_seqlen=256) == kernel_config(128)
    monkeypatch.setenv(CONFIG_ENV, "bwd_tma")
    assert kernel_config(128, max_seqlen=256) == candidate_config("bwd_tma")


def test_env_var_unknown_name_is_a_clear_error(monkeypatch):
    import torch

    from flamia_pack.kernels.attention import varlen_attention

    monkeypatch.setenv(CONFIG_ENV, "no_such_variant")
    with pytest.raises(FlamiaError, match="FLAMIA_ATTN_CONFIG='no_such_variant' names no attention config.*bwd_tma"):
        kernel_config(128)
    q = torch.randn(10, 2, 64)
    with pytest.raises(FlamiaError, match="FLAMIA_ATTN_CONFIG"):  # the CPU fallback checks it too
        varlen_attention(q, q, q, torch.tensor([0, 10], dtype=torch.int32), 10)


@pytest.mark.parametrize("bad", [-5, True, 2.5, "12"])
def test_kernel_config_rejects_bad_max_seqlen(monkeypatch, bad):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(FlamiaError, match="max_seqlen"):
        kernel_config(128, max_seqlen=bad)


@pytest.mark.parametrize("bad", [
    {"bwd_masked_stages": -1}, {"bwd_masked_stages": 9}, {"bwd_masked_stages": True},
    {"bwd_tma": 1}, {"bwd_dq_num_warps": 3}, {"bwd_dq_num_stages": 9},
    {"bwd_dq_num_warps": 4},  # needs bwd_fused=False
    {"bwd_dq_num_stages": 2},
])
def test_backward_knob_validation(bad):
    with pytest.raises(FlamiaError):
        AttentionKernelConfig(**bad)


def test_config_int_round_trip_keeps_bools():
    for name in CANDIDATES:
        cfg = candidate_config(name)
        back = _config_from_ints(_config_to_ints(cfg))
        assert back == cfg and isinstance(back.bwd_tma, bool)
    cfg = AttentionKernelConfig(bwd_fused=False, bwd_dq_num_warps=4, bwd_dq_num_stages=2, bwd_masked_stages=1)
    assert _config_from_ints(_config_to_ints(cfg)) == cfg


_SCRIPT = r"""
import json, sys
import triton.runtime.interpreter as I
from flamia_pack.kernels.check import compare_with_reference
from flamia_pack.kernels.config import AttentionKernelConfig, CANDIDATES
import flamia_pack.kernels.config as C
# the hybrid candidate's second launch uses SMALL_TILES: scaled like the candidates' tiles below
C.SMALL_TILES.update({f: max(16, v // 4) for f, v in C.SMALL_TILES.items() if f.startswith(("block_", "bwd_block_"))})
C.SHORT_FWD_TILES.update({f: max(16, v // 4) for f, v in C.SHORT_FWD_TILES.items() if f.startswith("block_")})
n_desc = [0]
orig = I.InterpreterBuilder.create_descriptor_load
def counted(self, *a, **k):
    n_desc[0] += 1
    return orig(self, *a, **k)
I.InterpreterBuilder.create_descriptor_load = counted
small = dict(wl_block_m=32, block_m=32, block_n=16, bwd_block_n1=32, bwd_block_m1=16, bwd_block_m2=32, bwd_block_n2=16)
out = {}
extra = {  # knob combinations no candidate uses: two launches with their own dQ warps/stages, head-major
    "split_head_major_tma_ms1": dict(bwd_fused=False, bwd_head_major=True, bwd_tma=True, bwd_masked_stages=1,
                                     bwd_dq_num_warps=2, bwd_dq_num_stages=2),
    "split_rank_major": dict(bwd_fused=False, bwd_dq_num_stages=1),
}
for name, over in list(CANDIDATES.items()) + list(extra.items()):
    over = dict(over)
    for f in ("block_m", "bwd_block_n1", "bwd_block_m1", "bwd_block_m2", "bwd_block_n2"):
        if f in over:  # the candidate's tile shape scaled to this small row (wl_block_m = 32)
            over[f] = max(16, over[f] // 4)
    for f in ("hybrid_short_len", "fwd_short_len"):
        if f in over:  # documents 40 and 23 in the long launch, the rest (merged too) in the short one
            over[f] = 20
    cfg = AttentionKernelConfig(**{**small, **over})
    for causal in (True, False):
        n_desc[0] = 0
        r = compare_with_reference([40, 5, 1, 1, 2, 23], num_heads=4, num_kv_heads=2, head_dim=64, causal=causal,
                                   pad=3, seed=11, config=cfg, with_lse_grad=causal)
        r["descriptor_loads"] = n_desc[0]
        out[f"{name}/{causal}"] = r
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interp_results(run_interpreter):
    # (FLAMIA_ATTN_CONFIG unset: the script's defaults are the shipped ones). Every candidate, both masks,
    # forward + backward in the interpreter: ~430-450 s on the 2-core dev VM (2026-11-30), too close to
    # the runner's default 600 s limit for a slower CI machine
    return run_interpreter(_SCRIPT, timeout=1800)


_EXTRA_TMA = {"split_head_major_tma_ms1": True, "split_rank_major": False}


@pytest.mark.parametrize("name", sorted(CANDIDATES) + sorted(_EXTRA_TMA))
@pytest.mark.parametrize("causal", [True, False])
def test_candidates_in_interpreter(interp_results, name, causal):
    r = interp_results[f"{name}/{causal}"]
    # every output element written exactly by one launch: the poisoned (NaN) outputs would fail
    tma = _EXTRA_TMA[name] if name in _EXTRA_TMA else bool(CANDIDATES[name].get("bwd_tma", False))
    assert r["pad_ok"], r
    for x in ("o", "dq", "dk", "dv"):
        assert r[f"ok_{x}"], f"{name}: {x} error {r[f'err_{x}']:.4g} > 2 x bf16 baseline {r[f'base_{x}']:.4g} + atol"
    # the TMA candidates really load through descriptors; the others never do
    assert (r["descriptor_loads"] > 0) == tma


def test_hybrid_launch_parts_and_validation():
    from flamia_pack.kernels.config import SMALL_TILES

    cfg = candidate_config("hybrid")
    (long_cfg, s1), (small_cfg, s2) = cfg.launch_parts()
    assert (s1, s2) == (1024, -1024) and long_cfg.hybrid_short_len == 0 == small_cfg.hybrid_short_len
    assert long_cfg.block_m == kernel_config(128).block_m
    assert all(getattr(small_cfg, f) == v for f, v in SMALL_TILES.items())
    assert kernel_config(128).launch_parts() == [(kernel_config(128), 0)]
    with pytest.raises(FlamiaError, match="hybrid_short_len"):
        AttentionKernelConfig(hybrid_short_len=-1)
    with pytest.raises(FlamiaError, match="bwd_dq_atomic"):
        AttentionKernelConfig(hybrid_short_len=64, bwd_dq_atomic=True)


def test_forward_short_launch_parts_and_validation():
    """``fwd_short_len``: the forward pass runs two launches (default tiles for long documents,
    SHORT_FWD_TILES for the rest); the backward's launches are unchanged; ``hybrid_short_len`` wins."""
    from flamia_pack.kernels.config import SHORT_FWD_TILES

    cfg = candidate_config("fwd_split512")
    assert cfg.bwd_gluon and cfg.bwd_gluon_dq_reduce  # the backward stays the default's
    (long_cfg, s1), (short_cfg, s2) = cfg.launch_parts(forward=True)
    assert (s1, s2) == (512, -512) and long_cfg.fwd_short_len == 0 == short_cfg.fwd_short_len
    assert long_cfg.block_m == kernel_config(128).block_m and long_cfg.block_n == kernel_config(128).block_n
    assert all(getattr(short_cfg, f) == v for f, v in SHORT_FWD_TILES.items())
    assert cfg.launch_parts() == [(cfg, 0)]
    both = dataclasses.replace(candidate_config("hybrid"), fwd_short_len=512)
    assert [sel for _, sel in both.launch_parts(forward=True)] == [1024, -1024]
    assert candidate_config("small_n32r") == dataclasses.replace(candidate_config("small"), **SHORT_FWD_TILES)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(FlamiaError, match="fwd_short_len"):
            AttentionKernelConfig(fwd_short_len=bad)


def test_bwd_gluon_fields_validated():
    from flamia_pack.kernels.config import AttentionKernelConfig, candidate_config
    from flamia_pack.errors import FlamiaError

    assert candidate_config("gluon").bwd_gluon and candidate_config("gluon_l256").bwd_gluon_min_len == 256
    for bad in (0, -1, 1.5, True):
        with pytest.raises(FlamiaError, match="bwd_gluon_min_len"):
            AttentionKernelConfig(bwd_gluon_min_len=bad)
    with pytest.raises(FlamiaError, match="bwd_gluon must be bool"):
        AttentionKernelConfig(bwd_gluon=1)


def test_gluon_available_on_this_triton():
    """The Gluon paths' gate (version parse + import) runs without error; only triton 3.6.x qualifies."""
    import triton

    from flamia_pack.kernels.flash_fwd import gluon_available

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    assert gluon_available() == ((major, minor) == (3, 6))


@pytest.mark.parametrize("bad", [["small"], None, 3])
def test_candidate_config_name_must_be_a_str(bad):
    """candidate_config(['small']) raised TypeError: unhashable type: 'list' (regression)."""
    with pytest.raises(FlamiaError, match="candidate name must be a str.*known: default"):
        candidate_config(bad)
    with pytest.raises(FlamiaError, match="unknown attention config candidate 'nope'; known: default"):
        candidate_config("nope")


def test_default_forward_is_the_persistent_gluon_kernel_at_head_dim_128(monkeypatch):
    from flamia_pack.kernels.config import PERSISTENT_FWD

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    d128 = kernel_config(128)
    assert d128.fwd_gluon and d128.fwd_gluon_persistent
    assert all(getattr(d128, f) == v for f, v in PERSISTENT_FWD.items())
    assert kernel_config(128, max_seqlen=4096, num_kv_groups=4) == d128
    # head_dim 64: not measured, the Triton forward
    assert not kernel_config(64).fwd_gluon
    # the previous default and the one-entry Gluon forward stay selectable
    old = candidate_config("triton_fwd")
    assert not old.fwd_gluon and dataclasses.replace(old, **PERSISTENT_FWD) == d128
    one = candidate_config("gluon_fwd")
    assert one.fwd_gluon and not one.fwd_gluon_persistent
    # a candidate that varies the Triton forward's tiles or order runs the Triton forward
    for name in ("grid_order", "tma_head_major_fwd64", "doc_major", "fwd_split512", "hybrid"):
        assert not candidate_config(name).fwd_gluon, name


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
    (merged items and documents of at most ``skip`` tokens: ``gluon_attention._item_span``)."""
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
    cfgs = [kernel_config(128), kernel_config(128, max_seqlen=1024), rep(kernel_config(128), fwd_short_len=300),
            rep(kernel_config(128), bwd_gluon_min_len=64), rep(kernel_config(128), merge_short=False),
            rep(kernel_config(128), wl_block_m=256)]
    rng = np.random.default_rng(0)
    checked = skipped = 0
    for trial in range(400):
        hi = int(rng.choice([3, 130, 600, 3000]))
        lo = int(rng.integers(1, hi))
        lengths = rng.integers(lo, hi + 1, size=int(rng.integers(1, 12)))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for cfg in cfgs:
            bits = leftover_bits(cfg, int(lengths.min()))
            fwd_rows = _leftover_rows(cu, cfg, max(1, cfg.fwd_short_len))
            bwd_rows = _leftover_rows(cu, cfg, cfg.bwd_gluon_min_len)
            assert fwd_rows == 0 or bits & LEFTOVER_FWD, (lengths.tolist(), cfg.wl_block_m, bits)
            assert bwd_rows == 0 or bits & LEFTOVER_BWD, (lengths.tolist(), cfg.wl_block_m, bits)
            checked += 1
            skipped += (bits & LEFTOVER_FWD == 0) + (bits & LEFTOVER_BWD == 0)
    assert checked == 2400 and skipped > 500  # the skip is exercised, not just the safe default
    # exactly at the thresholds (a document of skip_len tokens is the Triton launch's; merging needs one
    # shorter than wl_block_m)
    c300 = rep(kernel_config(128), fwd_short_len=300)
    for cfg, lengths, fwd, bwd in ((c300, [300, 1000], True, True), (c300, [301, 1000], False, True),
                                   (kernel_config(128), [512, 1000], False, True),
                                   (kernel_config(128), [513, 1000], False, False),
                                   (kernel_config(128), [127, 1000], True, True),
                                   (kernel_config(128), [128, 1000], False, True)):
        cu = np.concatenate([[0], np.cumsum(lengths)])
        bits = leftover_bits(cfg, min(lengths))
        assert bool(bits & LEFTOVER_FWD) == fwd and bool(bits & LEFTOVER_BWD) == bwd, (lengths, bits)
        assert (_leftover_rows(cu, cfg, max(1, cfg.fwd_short_len)) > 0) == fwd or lengths[0] == 127, lengths
        assert (_leftover_rows(cu, cfg, cfg.bwd_gluon_min_len) > 0) == bwd or lengths[0] == 127, lengths
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
    _check_work_list(wl128, True, _config_for_list(auto, wl128), cu.device, 556)
    with pytest.raises(FlamiaError, match="block_m=128; the kernels chosen for this call expect block_m=256"):
        _check_work_list(wl128, True, auto, cu.device, 556)
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
    with pytest.raises(FlamiaError, match=r"config=candidate_config\('small_fwd_pers_items'\)"):
        build_attention_work_list(cu, 512, config="small_fwd_pers_items")
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
