"""Causal leak probe (flamia_pack.kernels.leak, DESIGN.md §5) on the built-in quantize->dequantize
->exact-attention paths, on deliberately leaky callables (the probe must catch them), and the
``flamia probe-leak`` command."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from flamia_pack.cli import app
from flamia_pack.errors import FlamiaError
from flamia_pack.kernels import varlen_attention
from flamia_pack.kernels.leak import EXPECTED, FP8_PATHS, PATHS, LeakReport, leak_table, probe_leak, probe_paths
from flamia_pack.kernels.reference import packed_attention_reference

# small problem: four unaligned documents (lengths 40, 100, 10, 80) and 6 padding rows
CU = (0, 40, 140, 150, 230)
SMALL = dict(cu_seqlens=CU, total_tokens=236, num_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def reports() -> dict[str, LeakReport]:
    # the FP8 paths take FP8 attention's head dims (64, 128) only
    small = probe_paths([n for n in PATHS if n not in FP8_PATHS], seed=3, **SMALL)
    fp8 = probe_paths(list(FP8_PATHS), seed=3, **dict(SMALL, head_dim=64))
    return {r.path: r for r in small + fp8}


def neg_max(r: LeakReport) -> float:
    return max(r.neg_outside.values())


def test_positive_control_is_real(reports):
    for r in reports.values():
        assert r.exponent_changed, r.path
        assert r.doc == 1 and r.doc_start == 40 and r.doc_end == 140
        assert r.cut_group_start <= r.cut < r.cut_group_start + 31  # perturbed tokens share the group
        assert (r.cut_group_start - r.doc_start) % 32 == 0
        assert r.noise == 0.0  # deterministic torch paths
        # queries after the cut legitimately feed dK/dV of earlier keys: the probe must see that
        assert r.dk_prefix > 0 and r.dv_prefix > 0


@pytest.mark.parametrize("name", ["reference", "token", "mx"])
def test_exact_paths_measure_exactly_zero(reports, name):
    r = reports[name]
    assert r.o_prefix == 0.0 and r.dq_prefix == 0.0
    assert r.first_changed is None
    assert r.outside_positive == 0.0
    assert neg_max(r) == 0.0
    assert r.verdict == "exact" == EXPECTED[name]


def test_block_scales_leak_only_inside_the_cut_group(reports):
    r = reports["block"]
    assert r.o_prefix > 0 or r.dq_prefix > 0  # the documented within-block future dependency
    assert r.dq_prefix > 0
    assert r.first_changed is not None
    assert r.cut_group_start <= r.first_changed <= r.cut  # nothing before the cut's group moved
    assert r.outside_positive == 0.0 and neg_max(r) == 0.0  # groups never span documents
    assert r.verdict == "within-group" == EXPECTED["block"]


def test_per_tensor_scale_leaks_across_documents(reports):
    r = reports["tensor"]
    assert r.neg_outside["o"] > 0 and r.neg_outside["dq"] > 0
    assert r.outside_positive > 0
    assert r.first_changed < r.cut_group_start  # the whole prefix moves, not just the cut's group
    assert r.verdict == "cross-document" == EXPECTED["tensor"]


def test_block_is_exact_when_the_cut_ends_a_group():
    # cut = last token of a 32-token group: every perturbed token is in a later group
    r = probe_leak(PATHS["block"], cut=40 + 63, seed=1, **SMALL)
    assert r.exponent_changed is False  # the cut's own group is untouched ...
    assert r.verdict == "exact"  # ... so nothing before the cut moves


def test_block_gqa_and_other_documents():
    r = probe_leak(PATHS["block"], cu_seqlens=CU, num_heads=4, num_kv_heads=2, head_dim=32, doc=3,
                   neg_doc=0, seed=5)
    assert r.doc == 3 and r.neg_doc == 0 and r.num_kv_heads == 2
    assert r.verdict == "within-group"
    assert r.cut_group_start <= r.first_changed <= r.cut


# ---- the probe catches leaks it is shown ------------------------------------------------------


def non_causal(q, k, v, cu_seqlens, max_seqlen):
    return packed_attention_reference(q, k, v, cu_seqlens, causal=False)


def one_document(q, k, v, cu_seqlens, max_seqlen):
    whole = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    return packed_attention_reference(q, k, v, whole)


def noisy(q, k, v, cu_seqlens, max_seqlen):
    o = packed_attention_reference(q, k, v, cu_seqlens)
    return o + 1e-3 * torch.randn_like(o)


def test_probe_flags_non_causal_attention():
    r = probe_leak(non_causal, **SMALL)
    assert r.verdict == "prefix-leak"
    assert r.first_changed == r.doc_start and r.o_prefix > 1e-3
    assert neg_max(r) == 0.0


def test_probe_flags_cross_document_attention():
    r = probe_leak(one_document, cu_seqlens=CU, num_heads=2, head_dim=32)
    assert r.verdict == "cross-document" and neg_max(r) > 0


def test_probe_flags_nondeterminism():
    assert probe_leak(noisy, **SMALL).verdict == "nondeterministic"


def test_probe_input_errors():
    with pytest.raises(FlamiaError):
        probe_leak(PATHS["reference"], doc=9, **SMALL)
    with pytest.raises(FlamiaError):
        probe_leak(PATHS["reference"], doc=1, cut=139, **SMALL)  # last token of the document
    with pytest.raises(FlamiaError):
        probe_leak(PATHS["reference"], doc=1, cut=20, **SMALL)  # outside the document
    with pytest.raises(FlamiaError):
        probe_leak(PATHS["reference"], cu_seqlens=CU, num_heads=3, num_kv_heads=2)
    with pytest.raises(FlamiaError):
        probe_leak(PATHS["reference"], neg_doc=1, **SMALL)  # same document as the cut
    with pytest.raises(FlamiaError):
        probe_leak(lambda q, k, v, cu, m: q[:, :1], **SMALL)  # wrong output shape
    with pytest.raises(FlamiaError):
        probe_paths(["nope"], **SMALL)


def _detached(q, k, v, cu, m):
    return packed_attention_reference(q, k, v, cu).detach()


@pytest.mark.parametrize(
    "fn, kw, msg",
    [
        # each was a TypeError / RuntimeError / ZeroDivisionError (or a silent wrong verdict) before
        (5, {}, "callable"),
        (lambda q, k, v: q, {}, "attn_fn raised TypeError"),
        (_detached, {}, "differentiable"),
        (lambda q, k, v, cu, m: q * float("nan"), {}, "NaN/Inf"),
        (PATHS["reference"], {"cut": 50.5}, "cut must be an int"),
        (PATHS["reference"], {"head_dim": 0}, "head_dim"),
        (PATHS["reference"], {"head_dim": -3}, "head_dim"),
        (PATHS["block"], {"magnitude": 0.0}, "magnitude"),  # a vacuous positive control said "exact"
        (PATHS["block"], {"magnitude": float("nan")}, "magnitude"),
        (PATHS["reference"], {"device": "tpu0"}, "unknown device"),
        (PATHS["reference"], {"dtype": torch.int32}, "floating-point"),
        (PATHS["reference"], {"cu_seqlens": ()}, "at least one document"),
    ],
)
def test_probe_bad_arguments_are_flamia_errors(fn, kw, msg):
    args = {**SMALL, **kw}
    with pytest.raises(FlamiaError, match=msg):
        probe_leak(fn, **args)


def test_probe_accepts_unused_inputs_and_one_path_name():
    # o independent of k and v: their gradients are zero, not an autograd error
    r = probe_leak(lambda q, k, v, cu, m: q * 2, cu_seqlens=(0, 40, 100), num_heads=1, head_dim=8)
    assert r.verdict == "exact" and r.dk_prefix == 0.0
    # float64 inputs for the exact reference (the exponent check quantizes a float32 copy)
    assert probe_leak(PATHS["reference"], dtype=torch.float64, **SMALL).verdict == "exact"
    (rep,) = probe_paths("token", cu_seqlens=(0, 40, 100), num_heads=1, head_dim=8)  # a str is one name
    assert rep.path == "token"


def test_leak_table_needs_a_report():
    with pytest.raises(FlamiaError, match="at least one"):  # was an IndexError
        leak_table([])


def test_single_document_has_no_negative_control():
    r = probe_leak(PATHS["token"], cu_seqlens=(0, 70), num_heads=1, head_dim=16)
    assert r.neg_doc is None and r.neg_outside is None and r.verdict == "exact"


def test_report_dict_and_table(reports):
    d = reports["block"].to_dict()
    assert json.loads(json.dumps(d))["verdict"] == "within-group"
    assert d["cu_seqlens"] == list(CU)
    from rich.console import Console

    con = Console(record=True, width=200)
    con.print(leak_table(list(reports.values())))
    con.print(reports["token"].to_table())
    text = con.export_text()
    for name in PATHS:
        assert name in text
    assert "within-group" in text and "cross-document" in text


# ---- CLI ---------------------------------------------------------------------------------------


def test_cli_probe_leak_json_and_table():
    runner = CliRunner()
    args = ["probe-leak", "--cu-seqlens", ",".join(map(str, CU)), "--num-heads", "2", "--head-dim", "64"]
    res = runner.invoke(app, args + ["--path", "block", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert len(data) == 1 and data[0]["path"] == "block" and data[0]["verdict"] == "within-group"
    res = runner.invoke(app, args + ["--all"])
    assert res.exit_code == 0, res.output
    for name in PATHS:
        assert name in res.stdout
    # not a terminal: the table is not cut at rich's default 80 columns (verdicts were "cross-docu…")
    assert "cross-document" in res.stdout and "within-group" in res.stdout and "…" not in res.stdout


@pytest.mark.parametrize("bad", [["--path", "nope"], ["--cu-seqlens", "0,5,x"], ["--device", "tpu"],
                                 ["--cut", "1000"], ["--head-dim", "0"], ["--magnitude", "0"],
                                 ["--cu-seqlens", ""]])
def test_cli_probe_leak_errors(bad):
    res = CliRunner().invoke(app, ["probe-leak", "--num-heads", "1", "--head-dim", "8"] + bad)
    assert res.exit_code == 2
    assert "error:" in res.output


@pytest.mark.parametrize("args", [["--head-dim", "96", "--path", "fp8-emu-token"],
                                  ["--head-dim", "7", "--path", "fp8-emu-block"],
                                  ["--head-dim", "32", "--all"]])
def test_cli_fp8_paths_refuse_head_dims_fp8_attention_refuses(args, monkeypatch):
    """`flamia probe-leak --head-dim 96 --path fp8-emu-token` exited 0 with a verdict (the probe's FP8
    emulation skipped FP8 attention's head_dim rule); it is now varlen_attention(precision="fp8")'s
    error, exit code 2, before any path runs."""
    import flamia_pack.kernels.leak as leak

    monkeypatch.setattr(leak, "probe_leak", lambda *a, **k: pytest.fail("a path ran"))
    res = CliRunner().invoke(app, ["probe-leak", "--num-heads", "1", *args], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    d = args[1]
    assert len(lines) == 1 and lines[0].startswith(f"error: FP8 attention supports head_dim in (64, 128), got {d}"), \
        res.output
    assert "fp8-emu-" in lines[0]
    # the rule is the public one, and the path callables apply it too
    q = torch.zeros(8, 1, int(d))
    with pytest.raises(FlamiaError, match=f"FP8 attention supports head_dim in \\(64, 128\\), got {d}"):
        varlen_attention(q, q, q, torch.tensor([0, 8]), 8, precision="fp8")
    with pytest.raises(FlamiaError, match="head_dim"):
        probe_leak(PATHS["fp8-emu-token"], cu_seqlens=(0, 40, 100), num_heads=1, head_dim=int(d))


def test_probe_fp8_paths_at_the_kernel_head_dims():
    """The FP8 paths still run (and keep their verdicts) at head_dim 64 and 128."""
    for d in (64, 128):
        reports = probe_paths(list(FP8_PATHS), cu_seqlens=(0, 40, 100), num_heads=1, head_dim=d, seed=1)
        assert [r.verdict for r in reports] == [EXPECTED[n] for n in FP8_PATHS]
