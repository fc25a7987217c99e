"""GPU tests of the warp-specialized Gluon kernels (``gluon_fwd.py``, ``gluon_dkdv.py``, ``gluon_dq.py``).

Same acceptance rule as tests/test_attention_gpu.py (``kernels.check``: dQ, dK, dV within 2x the
bf16-torch error + atol of the fp32 reference, NaN-poisoned outputs, padding rows zero). Rows are
chosen to exercise every path of the Gluon programs and the hand-off to Triton: unaligned
documents, documents shorter than one 64-query step and than one 128-key tile, 1-token documents
and merged items (skipped by Gluon, run by the Triton launch), GQA / MQA, D = 64 and 128, padding
rows, and a non-causal call (which falls back to Triton).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flamia_pack.kernels.check import compare_with_reference
from flamia_pack.kernels.config import GluonBwdConfig, GluonFwdConfig, candidate_config

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

_HOPPER = torch.cuda.get_device_capability()[0] == 9


_BWD = {  # the Gluon backward's shipped modes, and min_len at its edges (which documents go to Triton)
    "default": GluonBwdConfig(),
    "dq_programs": GluonBwdConfig(dq_reduce=False),  # deterministic=True
    "persistent": GluonBwdConfig(dq_reduce=False, persistent=True),  # all_pers_dqp
    "min_len_1": GluonBwdConfig(min_len=1),
    "min_len_256": GluonBwdConfig(min_len=256),
}


def _gluon(d: int, bwd: str = "default"):
    cfg = dataclasses.replace(candidate_config("default", head_dim=d), gluon_bwd=_BWD[bwd])
    assert cfg.gluon_bwd is not None and (cfg.gluon_fwd is not None or d == 64)
    return cfg


@pytest.mark.parametrize("name", sorted(_BWD))
@pytest.mark.parametrize("lengths,h,hkv,d,pad", [
    ([2048, 2048], 8, 8, 128, 0),
    ([300, 129, 1000, 77, 700, 1890], 4, 4, 128, 37),
    ([513, 2048, 200, 1333], 8, 2, 128, 0),
    ([4096, 1, 1, 3, 60, 5, 2000], 4, 1, 128, 11),  # merged items + 1-token documents -> Triton
    ([1500, 65, 2, 700, 1890], 4, 2, 64, 9),
    ([128, 129, 127, 64, 63, 256, 4000], 2, 2, 128, 0),
])
def test_gluon_backward_vs_reference(lengths, h, hkv, d, pad, name):
    if not _HOPPER:
        pytest.skip("the Gluon backward runs on sm_90 only (the Triton kernels run elsewhere)")
    r = compare_with_reference(lengths, num_heads=h, num_kv_heads=hkv, head_dim=d, causal=True, pad=pad,
                               device="cuda", seed=len(lengths), config=_gluon(d, name))
    assert r["ok"] and r["pad_ok"], r


def test_gluon_matches_triton_backward_and_is_deterministic():
    """Same computation as the Triton backward (fp32 accumulation of the same products): the two agree
    to bf16 rounding, and two Gluon runs with the dQ programs agree bitwise (no atomics, no reduces)."""
    if not _HOPPER:
        pytest.skip("sm_90 only")
    from flamia_pack.kernels import varlen_attention

    lengths = [3000, 17, 900, 4275]
    T = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn((T, hh, 128), device="cuda", generator=g, dtype=torch.bfloat16) for hh in (8, 2, 2, 8))
    grads = {}
    for name in ("gluon", "gluon2", "triton"):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        cfg = _gluon(128, "dq_programs") if name.startswith("gluon") else candidate_config("triton", head_dim=128)
        o = varlen_attention(*xs, cu, max(lengths), config=cfg)
        o.backward(do)
        grads[name] = [x.grad for x in xs]
    for a, b in zip(grads["gluon"], grads["gluon2"]):
        assert torch.equal(a, b)
    for a, b in zip(grads["gluon"], grads["triton"]):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 2e-3, err


def test_dq_reduce_agrees_and_deterministic_turns_it_off():
    """``GluonBwdConfig.dq_reduce`` (dQ partials by TMA bulk reduce from the dK/dV programs) computes the
    same dQ as the dQ programs up to fp32 summation order; ``deterministic=True`` runs without it
    (bitwise equal to the default backward)."""
    if not _HOPPER:
        pytest.skip("sm_90 only")
    from flamia_pack.kernels import varlen_attention

    lengths = [3000, 17, 900, 4275, 1]
    T = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, do = (torch.randn((T, hh, 128), device="cuda", generator=g, dtype=torch.bfloat16) for hh in (8, 4, 4, 8))
    grads = {}
    # "chunks": the accumulator capped at one kv head's bytes (dq_reduce_max_bytes): 4 launches, one buffer
    one_head = 4 * T * 2 * 128
    for name, det in (("gluon_dq_programs", False), ("gluon_dqr", False), ("gluon_dqr", True), ("chunks", False)):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        cfg = _gluon(128, "dq_programs" if name == "gluon_dq_programs" else "default")
        if name == "chunks":
            cfg = dataclasses.replace(cfg, gluon_bwd=GluonBwdConfig(dq_reduce_max_bytes=one_head))
        o = varlen_attention(*xs, cu, max(lengths), config=cfg, deterministic=det)
        o.backward(do)
        grads[(name, det)] = [x.grad for x in xs]
    ref, det = grads[("gluon_dq_programs", False)], grads[("gluon_dqr", True)]
    for a, b in zip(det, ref):
        assert torch.equal(a, b)
    for red in (grads[("gluon_dqr", False)], grads[("chunks", False)]):
        assert torch.equal(red[1], ref[1]) and torch.equal(red[2], ref[2])  # dK, dV: the same products
        err = ((red[0].float() - ref[0].float()).norm() / ref[0].float().norm()).item()
        assert err < 2e-3, err


def test_noncausal_falls_back_to_triton():
    r = compare_with_reference([700, 1300, 45], num_heads=4, num_kv_heads=2, head_dim=128, causal=False, pad=3,
                               device="cuda", seed=3, config=_gluon(128))
    assert r["ok"] and r["pad_ok"], r


_FWD = {  # the Gluon forward's shipped variants (the default's ping-pong, small_fwd_pers's without turns)
    "pingpong": GluonFwdConfig(pingpong=True),
    "no_pingpong": GluonFwdConfig(pingpong=False),
}


@pytest.mark.parametrize("name", sorted(_FWD))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,h,hkv,d,pad", [
    ([2048, 2048], 8, 8, 128, 0),
    ([300, 129, 1000, 77, 700, 1890], 4, 4, 128, 37),
    ([4096, 1, 1, 3, 60, 5, 2000], 4, 1, 128, 11),  # merged items + 1-token documents -> Triton
    ([1500, 65, 2, 700, 1890], 4, 2, 64, 9),
])
def test_gluon_forward_vs_reference(lengths, h, hkv, d, pad, causal, name):
    """The persistent Gluon forward with its two partitions taking turns (the default) and not
    (``small_fwd_pers``'s kernel), head_dim 64 and 128, causal or not, GQA / MQA, merged items and
    1-token documents (the Triton leftover launch)."""
    if not _HOPPER:
        pytest.skip("sm_90 only")
    r = compare_with_reference(lengths, num_heads=h, num_kv_heads=hkv, head_dim=d, causal=causal, pad=pad,
                               device="cuda", seed=len(lengths), with_lse_grad=True,
                               config=dataclasses.replace(candidate_config("default", head_dim=d), gluon_fwd=_FWD[name]))
    assert r["ok"] and r["pad_ok"], r


_ITEM_ROWS = [
    ([256] * 16, 4, 4, 0),  # every item a whole document sharing its K / V tiles
    ([300, 129, 256, 77, 500, 1, 3, 256, 511], 4, 4, 37),  # long documents' items, 1- / 3-token ones (Triton)
    ([200, 128, 255, 130, 129, 256, 64, 200], 4, 2, 5),  # cut last tiles, one-tile items, GQA
    ([256] * 40 + [100], 8, 8, 11),  # more items than programs: the ring and the Q slots wrap
]
_ITEM_CASES = ([("small_fwd_pers_items_n64s5_skip", c, *row) for c in (True, False) for row in _ITEM_ROWS]
               + [("small_fwd_pers", True, *row) for row in _ITEM_ROWS[:2]])


@pytest.mark.parametrize("name,causal,lengths,h,hkv,pad", _ITEM_CASES)
def test_forward_claiming_whole_items(name, causal, lengths, h, hkv, pad):
    """The persistent Gluon forward claiming whole 256-row list items (``GluonFwdConfig.whole_items``, a
    5-slot ring of 64-key tiles, each partition skipping the tiles all masked for its rows: the
    ``small_fwd_pers_items_n64s5_skip`` band config; ``small_fwd_pers`` the 128-row claims), vs the fp32
    reference with the Triton backward on the same list: every query tile run once, the shared K / V
    tiles released only by the item's last query
    tile (a release too early would let the producer overwrite them: wrong rows; too late or never: a
    hang, so run under ``timeout``)."""
    if not _HOPPER:
        pytest.skip("sm_90 only")
    r = compare_with_reference(lengths, num_heads=h, num_kv_heads=hkv, head_dim=128, causal=causal, pad=pad,
                               device="cuda", seed=len(lengths) + h, config=candidate_config(name),
                               with_lse_grad=True)
    assert r["ok"] and r["pad_ok"], r
