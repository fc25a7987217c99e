"""Correctness check of ``varlen_attention`` against the exact reference (tests and device scripts).

The acceptance rule (issue 5, FlashAttention's test practice): for O, dQ, dK and dV,
``max|kernel - fp32 reference| <= 2 * max|bf16 torch - fp32 reference| + atol``, where the bf16
torch baseline is the same packed computation done by torch entirely in bfloat16
(``packed_attention_reference(..., compute_dtype=torch.bfloat16)``). Inputs are fresh N(0, 1)
draws; outputs are poisoned: every tensor allocated during the kernel call starts as NaN (torch's
deterministic-mode fill), so an element the kernels never write fails the check.
"""
from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from flamia_pack.kernels.attention import varlen_attention
from flamia_pack.kernels.reference import packed_attention_reference

__all__ = ["compare_with_reference", "random_lengths", "small_test_config"]


def small_test_config(*, schedule: str = "grid_head_major", tile: int = 32):
    """The shipped Triton kernel families on tiles scaled to small rows, for interpreter runs:
    ``wl_block_m = tile`` (32 or 16), a ``tile x 16`` forward, ``tile``-key x 16-query dK/dV and
    ``tile x 16`` dQ programs, the forward launched in ``schedule`` order; the Gluon families kept
    (they run only on sm_90, so on the CPU the Triton kernels of the same config run)."""
    from flamia_pack.kernels.config import AttentionKernelConfig, TritonBwdConfig, TritonFwdConfig

    return AttentionKernelConfig(wl_block_m=tile, fwd=TritonFwdConfig(block_m=tile, block_n=16, schedule=schedule),
                                 bwd=TritonBwdConfig(block_n1=tile, block_m1=16, block_m2=tile, block_n2=16))


def random_lengths(rng: np.random.Generator, total: int, max_docs: int) -> list[int]:
    """Random document lengths summing to ``total`` with 1..max_docs documents (unaligned starts)."""
    n = int(rng.integers(1, max(1, min(max_docs, total)) + 1))
    cuts = np.sort(rng.choice(np.arange(1, total), size=n - 1, replace=False)) if n > 1 else np.array([], np.int64)
    bounds = np.concatenate([[0], cuts, [total]])
    return [int(x) for x in np.diff(bounds)]


@contextlib.contextmanager
def _poisoned():
    """Every ``torch.empty`` inside fills with NaN (torch's deterministic-mode memory fill), so an
    output element the kernels never write shows up as NaN."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def compare_with_reference(
    lengths: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    pad: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    config=None,
    backward: bool = True,
    with_lse_grad: bool = False,
    atol: float = 1e-3,
    prebuilt_work_list: bool = False,
) -> dict:
    """Run ``varlen_attention`` (forward and, optionally, backward) and the two references.

    Args:
        lengths: document lengths in row order; ``pad`` padding tokens follow them.
        num_heads, num_kv_heads, head_dim, causal: the call's shape and mask.
        device: where to run (the kernels on CUDA / under TRITON_INTERPRET, else the fallback).
        seed: torch seed for the N(0, 1) inputs.
        config: optional ``AttentionKernelConfig``.
        backward: also compare dQ, dK, dV.
        with_lse_grad: also return the LSE and give it a random upstream gradient.
        atol: absolute slack added to the 2x-baseline bound.
        prebuilt_work_list: pass a work list built beforehand (``build_attention_work_list``, validated:
            it carries the row's shortest document, ``WorkList.min_seqlen``) instead of letting the
            call build one.

    Returns:
        dict: per quantity ``err_<x>`` (kernel vs fp32 max abs error), ``base_<x>`` (bf16 torch
        vs fp32), ``ok_<x>`` (the acceptance rule, NaN-free), ``ok`` (all), plus ``pad_ok``
        (padding rows zero, LSE +inf, zero grads).
    """
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = int(sum(lengths)) + int(pad)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    max_len = int(max(lengths)) if lengths else 0

    def rnd(h):
        return torch.randn((T, h, head_dim), generator=gen).to(device=device, dtype=torch.bfloat16)

    q, k, v = rnd(num_heads), rnd(num_kv_heads), rnd(num_kv_heads)
    do = torch.randn((T, num_heads, head_dim), generator=gen).to(device=device, dtype=torch.bfloat16)
    dlse = torch.randn((num_heads, T), generator=gen).to(device) if with_lse_grad else None

    def grads_of(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_(backward) for x in (q, k, v)]
        o, lse = fn(*xs)
        if backward:
            outs, gs = [o], [do.to(o.dtype)]
            if dlse is not None:
                fin = torch.isfinite(lse)
                outs.append(torch.where(fin, lse, 0.0))
                gs.append(torch.where(fin, dlse, 0.0).to(lse.dtype))
            gr = torch.autograd.grad(outs, xs, gs)
        else:
            gr = (None, None, None)
        return o.detach(), lse.detach(), gr

    def ref_fn(dtype):
        return lambda a, b, c: packed_attention_reference(a, b, c, cu, causal=causal, compute_dtype=dtype, return_lse=True)

    wl = None
    if prebuilt_work_list:
        from flamia_pack.kernels.attention import build_attention_work_list

        wl = build_attention_work_list(cu, T, causal=causal, head_dim=head_dim, config=config, max_seqlen=max_len,
                                       num_kv_groups=num_heads // num_kv_heads)
    with _poisoned(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse, (dq, dk, dv) = grads_of(
            lambda a, b, c: varlen_attention(a, b, c, cu, max_len, causal=causal, return_lse=True, config=config,
                                             work_list=wl),
            torch.bfloat16)
    o32, lse32, (dq32, dk32, dv32) = grads_of(ref_fn(torch.float32), torch.float32)
    o16, _, (dq16, dk16, dv16) = grads_of(ref_fn(torch.bfloat16), torch.bfloat16)
    used = int(sum(lengths))
    res: dict = {"T": T, "n_docs": len(lengths)}
    pairs = [("o", o, o32, o16)]
    if backward:
        pairs += [("dq", dq, dq32, dq16), ("dk", dk, dk32, dk16), ("dv", dv, dv32, dv16)]
    ok_all = True
    for name, x, x32, x16 in pairs:
        err = (x[:used].float() - x32[:used]).abs().max().item() if used else 0.0
        base = (x16[:used].float() - x32[:used]).abs().max().item() if used else 0.0
        finite = bool(torch.isfinite(x).all().item())
        ok = finite and err <= 2 * base + atol
        res[f"err_{name}"], res[f"base_{name}"], res[f"ok_{name}"] = err, base, ok
        ok_all &= ok
    fin = torch.isfinite(lse32)
    res["err_lse"] = (lse[fin] - lse32[fin]).abs().max().item() if bool(fin.any()) else 0.0
    ok_all &= res["err_lse"] <= 1e-2
    pad_ok = bool((o[used:] == 0).all().item()) and bool(torch.isinf(lse[:, used:]).all().item())
    if backward:
        pad_ok &= all(bool((g[used:] == 0).all().item()) for g in (dq, dk, dv))
    res["pad_ok"] = pad_ok
    res["ok"] = bool(ok_all and pad_ok)
    return res
