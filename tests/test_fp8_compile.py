"""The Gluon FP8 forward (``gluon_fp8_fwd.py``) compiles for sm_90a on the CPU (triton's bundled ptxas,
``gluon_compile.compile_sm90(kind="fp8_fwd")``): FP8 wgmma (QGMMA) in the SASS, asynchronous products,
spills and the size of the key-tile step loops within what benchmarks/NOTES.md records. No GPU needed;
skips without triton 3.6 (the kernels are written against its Gluon API) or its ptxas."""
from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")
gluon_fp8_fwd = pytest.importorskip("flamia_pack.kernels.gluon_fp8_fwd")

if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 6):
    pytest.skip("the kernels are written against triton 3.6's Gluon API", allow_module_level=True)

#: the launcher's defaults: the configuration ``varlen_attention(precision="fp8")`` ships
DEFAULTS = {k: p.default for k, p in inspect.signature(gluon_fp8_fwd.gluon_fp8_fwd).parameters.items()
            if k in ("pingpong", "pv_promote")}

#: static instructions of the mask-free step loop (one consumer partition) at or below which the
#: shipped kernel stays (benchmarks/NOTES.md: 710 accumulating P~V in the MMA, the row factor folded
#: into exp2, on triton 3.6.0's ptxas; 782 with per-tile promotion)
MAX_STEP = 730


def _compile(**kw):
    from flamia_pack.kernels.gluon_compile import compile_sm90

    try:
        return compile_sm90("fp8_fwd", **kw)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("causal", [True, False])
def test_shipped_fp8_forward_compiles_for_sm90(causal):
    from flamia_pack.kernels.gluon_compile import mma_step_loops

    r = _compile(causal=causal, **DEFAULTS)
    assert r["shared"] <= 228 * 1024
    assert "QGMMA" in r["sass"] and "HGMMA" not in r["sass"] and "UTMALDG" in r["sass"]
    assert not r["serialized"], r["ptxas"]
    assert r["spill_bytes"] <= 64, r["ptxas"]  # 24 B
    steps = mma_step_loops(r["sass"])
    assert len(steps) == 4, steps  # per consumer partition: the mask-free and the masked step loop
    for lp in steps:
        assert lp["gmma"] == 8, lp  # S and P~V: 4 QGMMA each, k = 32
    free = min(steps, key=lambda lp: lp["instructions"])
    assert free["instructions"] <= MAX_STEP, steps
    assert all(lp["ldl"] <= 1 and lp["stl"] <= 1 for lp in steps if lp["instructions"] <= MAX_STEP), steps


@pytest.mark.parametrize("kw,max_spill,serialized", [
    ({"pingpong": False, "pv_promote": False}, 128, False),  # the partitions without turns
    # per-tile promotion of P~V into fp32 registers (issue 27 item 3's alternative); 32 B
    ({"pingpong": True, "pv_promote": True}, 96, False),
    # every entry's tile 0 masked (the launcher's choice on short-document rows): one prologue softmax; 16 B
    ({"pingpong": True, "pv_promote": False, "masked_tile0": True}, 64, False),
])
def test_fp8_forward_variants_compile_for_sm90(kw, max_spill, serialized):
    r = _compile(causal=True, **kw)
    assert "QGMMA" in r["sass"] and r["serialized"] == serialized, r["ptxas"]
    assert r["spill_bytes"] <= max_spill, r["ptxas"]


@pytest.mark.parametrize("causal,group", [(True, 1), (False, 4)])
def test_fp8_backward_compiles_for_sm90(causal, group):
    """The FP8 backward (``gluon_fp8_bwd.py``): QGMMA for all five products (4 k = 32 instructions
    each of S^T and dP^T per warpgroup, the register-A dV / dK products and the dQ partial), no HGMMA,
    asynchronous, TMA, and bounded spills (none serializing; 476-768 B by configuration with the
    wgmma-order operands on triton 3.6's ptxas: benchmarks/NOTES.md)."""
    try:
        from flamia_pack.kernels.gluon_compile import compile_sm90

        r = compile_sm90("fp8_bwd", causal=causal, group=group)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert r["shared"] <= 228 * 1024
    assert r["sass"].count("QGMMA") >= 40 and "HGMMA" not in r["sass"] and "UTMALDG" in r["sass"]
    assert "UTMAREDG" in r["sass"]  # the dQ partial's TMA reduce-add
    assert not r["serialized"], r["ptxas"]
    assert r["spill_bytes"] <= 800, r["ptxas"]


@pytest.mark.parametrize("causal,group", [(True, 1), (False, 4)])
def test_fp8_backward_deterministic_variant_compiles_for_sm90(causal, group):
    """``gluon_fp8_bwd(deterministic=True)``: before each dQ reduce-add one thread spins on the turn
    counter with acquire loads (broadcast to the consumer), after it waits for the reduce's completion
    (``cp.async.bulk.wait_group 0``, not only ``.read``) and releases the next turn; the default kernel
    has none of it. Products stay asynchronous; spills bounded (the turn counter's pointer, stride and rank
    stay live across the step loops: 332-896 B on triton 3.6's ptxas, against 348-404 B by default)."""
    try:
        from flamia_pack.kernels.gluon_compile import compile_sm90

        det = compile_sm90("fp8_bwd", causal=causal, group=group, deterministic=True)
        base = compile_sm90("fp8_bwd", causal=causal, group=group)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    turns = ("ld.global.gpu.acquire.b32", "atom.global.gpu.release.add", "cp.async.bulk.wait_group 0;")
    assert all(t in det["ptx"] for t in turns)
    assert not any(t in base["ptx"] for t in turns)
    assert "UTMAREDG" in det["sass"] and not det["serialized"], det["ptxas"]
    assert det["spill_bytes"] <= 1024, det["ptxas"]
