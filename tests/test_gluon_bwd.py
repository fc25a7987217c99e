"""CPU tests of the Gluon backward's launchers and gate (the kernels themselves: test_gluon_bwd_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from flamia_pack.kernels.config import CANDIDATES, candidate_config

gluon_bwd = pytest.importorskip("flamia_pack.kernels.gluon_bwd")


def _inputs(T=64, H=4, Hkv=2, D=64, dtype=torch.bfloat16):
    q, do = (torch.zeros(T, H, D, dtype=dtype) for _ in range(2))
    k, v = (torch.zeros(T, Hkv, D, dtype=dtype) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("fn", ["gluon_dkdv", "gluon_dq"])
@pytest.mark.parametrize("case,match", [
    ("cpu", "CUDA tensor"),
    ("fp32", "bf16"),
    ("noncontig", "contiguous"),
])
def test_launchers_reject_bad_inputs_before_launch(fn, case, match):
    q, k, v, do = _inputs(dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "noncontig":
        q = torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, ::2]
    lse = torch.zeros(4, 64)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    items = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        getattr(gluon_bwd, fn)(q, k, v, do, lse, lse, cu, items, torch.ones(1, dtype=torch.int32), 0.125)


def test_shape_rules():
    q, k, v, do = _inputs(H=4, Hkv=3)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        gluon_bwd._check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs(D=96)
    with pytest.raises(ValueError, match="64 or 128"):
        gluon_bwd._check_inputs("x", q, k, v, do)
    q, k, v, do = _inputs()
    with pytest.raises(ValueError, match="shapes disagree"):
        gluon_bwd._check_inputs("x", q, k[:32], v[:32], do)


def test_candidates_that_vary_the_triton_backward_turn_gluon_off():
    on = {n for n, ov in CANDIDATES.items() if candidate_config(n).bwd_gluon}
    assert {"default", "gluon", "gluon_l256"} <= on
    for name in ("bwd_tma", "grid_order", "doc_major", "bwd_m64", "regs_k", "dq_n32", "split_dq128", "small", "triton_bwd"):
        assert not candidate_config(name).bwd_gluon, name
