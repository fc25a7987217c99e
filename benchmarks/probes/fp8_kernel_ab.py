"""Same-process A/B of FP8 kernel files (``gluon_fp8_fwd.py`` / ``gluon_fp8_bwd.py`` and copies of them), H200.

    PYTHONPATH=. python3 benchmarks/probes/fp8_kernel_ab.py --module onecopy=ab/fwd_onecopy.py \
        --rows W1,W2,W3,W6,W7,S2 --rounds 3 [--masked-tile0 both]
    PYTHONPATH=. python3 benchmarks/probes/fp8_kernel_ab.py --kernel bwd --module pers=ab/bwd_persistent.py \
        --rows W1,W3,W6,W7

Each ``--module NAME=PATH`` is loaded as its own module (its Gluon kernels are separate JIT functions),
beside ``main``, the work tree's ``flamia_pack/kernels/gluon_fp8_{fwd,bwd}.py``. Per row (the workloads'
lengths and heads, fresh N(0, 1) bf16 q, k, v (and dO), quantized once; one FP8 work list):

``--kernel fwd`` (default):

1. **check**: every module's kernel on NaN-filled outputs must give ``main``'s O and LSE bit for bit (the
   variants this probe is for change code layout, not numerics), leave no NaN in the row's documents,
   and, with NaN in K and V at the second document's first and last tokens (their groups get the NaN
   code), keep every other document's O equal to the clean run's;
2. **time**: ``triton.testing.do_bench`` medians (ms, L2 flushed by do_bench), the modules interleaved in
   ``--rounds`` rounds, then the median over rounds and ``module / main``.

``--kernel bwd``: every module's ``gluon_fp8_bwd`` on the same prepared operands (``fp8_bwd_probe.
prepared_backward``): dK and dV bit for bit as ``main``'s, dQ (fp32 atomics: the order may differ) within
1e-3 of main's largest |dQ|, all finite; then timed as above (the dQ accumulator zeroed inside each call).

``--close``: a forward module may round differently from ``main`` (another fold or accumulation order): its
O must be within 1% of main's largest |O| with cosine >= 0.99999, its LSE within 1e-4, instead of bit for bit.
``--masked-tile0 both`` times every forward module with ``masked_tile0`` off and on (the launcher's rule picks one
by the mean document length: ``auto``, the default). A module that fails the check is reported and not timed.
Prints markdown; ``$OUT/fp8_kernel_ab.json`` (if ``OUT`` is set) holds every number.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys

import numpy as np
import torch


def _load(name: str, path: str, launcher: str):
    if not os.path.isfile(path):
        raise SystemExit(f"fp8_kernel_ab: --module {name}={path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_fp8_kernel_ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, launcher):
        raise SystemExit(f"fp8_kernel_ab: {path} has no {launcher}")
    return mod


def parse_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; SystemExit on a malformed spec or the reserved name ``main``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path or not name.isidentifier():
        raise SystemExit(f"fp8_kernel_ab: --module takes NAME=PATH (NAME an identifier), got {text!r}")
    if name == "main":
        raise SystemExit("fp8_kernel_ab: 'main' is the work tree's file; name the variant otherwise")
    return name, path


def _row(name: str, seed: int, with_do: bool = False):
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    lens = workload_lengths(name)
    h, hkv = WORKLOADS[name]["num_heads"], WORKLOADS[name]["num_kv_heads"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lens))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((T, n, 128), device="cuda", generator=g).bfloat16() for n in (h, hkv, hkv))
    if with_do:
        return q, k, v, cu, torch.randn((T, h, 128), device="cuda", generator=g).bfloat16()
    return q, k, v, cu


def _run(mod, ops, cu, wl, mt0, poisoned: bool):
    from flamia_pack.kernels.flash_fwd import fill_tails

    T, H, D = ops.qc.shape
    if poisoned:
        o = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((H, T), float("nan"), dtype=torch.float32, device="cuda")
    else:
        o = lse = None
    o, lse = mod.gluon_fp8_fwd(ops.qc, ops.kc, ops.vt, ops.eq, ops.ekt, ops.evt, cu, wl.items, wl.num_items, D ** -0.5,
                               causal=True, wl_block_m=128, skip_len=0, o=o, lse=lse, masked_tile0=mt0)
    if poisoned:
        fill_tails([(o, 0.0, 0), (lse, math.inf, 1)], cu)
    return o, lse


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                                   b.view(torch.int16 if b.element_size() == 2 else torch.int32)))


def _close(o, lse, o0, lse0, n) -> str | None:
    """``--close``'s test of a forward output against main's (rows ``< n``): None or why it failed."""
    a, b = o[:n].double().flatten(), o0[:n].double().flatten()
    cos = float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))
    d = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
    dl = float((lse[:, :n] - lse0[:, :n]).abs().max())
    if cos >= 0.99999 and d <= 0.01 and dl <= 1e-4:
        return None
    return f"O / LSE off main's (cos {cos:.7f}, max {d:.3g} of max|O|, LSE {dl:.3g})"


def check(mods, name, ops, ops_nan, cu, wl, mt0s, doc2, close=False):
    """{(module, mt0): None or the reason it failed}."""
    base = {mt0: _run(mods["main"], ops, cu, wl, mt0, True) for mt0 in mt0s}
    out = {}
    lo, hi = doc2
    for m, mod in mods.items():
        for mt0 in mt0s:
            o, lse = _run(mod, ops, cu, wl, mt0, True)
            n = int(cu[-1])
            why = None
            if bool(o[:n].isnan().any()) or bool(lse[:, :n].isnan().any()):
                why = "NaN left in the row's documents"
            elif close and m != "main":
                why = _close(o, lse, *base[mt0], n)
            elif not (_same_bits(o, base[mt0][0]) and _same_bits(lse, base[mt0][1])):
                diff = int((o.view(torch.int16) != base[mt0][0].view(torch.int16)).sum())
                why = f"O / LSE differ from main's bits ({diff} O elements)"
            if why is None:
                on, _ = _run(mod, ops_nan, cu, wl, mt0, True)
                keep = torch.ones(o.shape[0], dtype=torch.bool, device=o.device)
                keep[lo:hi] = False
                if not _same_bits(on[keep], o[keep]):
                    why = "a NaN group in document 2 changed another document's O"
            out[(m, mt0)] = why
    return out


def _run_bwd(mod, b, cu, dq_acc):
    ops, d8 = b["ops"], b["d8"]
    dq_acc.zero_()
    return mod.gluon_fp8_bwd(ops.qc, ops.kc, ops.vc, ops.qt, ops.kt, d8.codes, d8.codes_t, *b["tables"], b["lse"],
                             b["delta"], cu, 128 ** -0.5, entries=b["entries"], dq_acc=dq_acc, cast_dq=False)


def check_bwd(mods, b, cu, dq_acc):
    """{(module, None): None or the reason it failed}: dK / dV bitwise, dQ within 1e-3 of max |dQ|."""
    n = int(cu[-1])
    dq0, dk0, dv0 = (x.clone() for x in _run_bwd(mods["main"], b, cu, dq_acc))
    tol = 1e-3 * float(dq0[:n].abs().max())
    out = {}
    for m, mod in mods.items():
        dq, dk, dv = _run_bwd(mod, b, cu, dq_acc)
        why = None
        if not all(bool(torch.isfinite(x[:n]).all()) for x in (dq, dk, dv)):
            why = "non-finite gradient in the row's documents"
        elif not (_same_bits(dk, dk0) and _same_bits(dv, dv0)):
            why = (f"dK / dV differ from main's bits ({int((dk.view(torch.int16) != dk0.view(torch.int16)).sum())} / "
                   f"{int((dv.view(torch.int16) != dv0.view(torch.int16)).sum())} elements)")
        elif float((dq - dq0).abs().max()) > tol:
            why = f"dQ off main's by {float((dq - dq0).abs().max()):.3g} (> {tol:.3g})"
        out[(m, None)] = why
    return out


def main(argv=None):
    import triton

    from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_quantize

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--module", action="append", default=[], help="NAME=PATH of a variant of the --kernel's file")
    ap.add_argument("--rows", default="W1,W2,W3,W6,W7,S2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    ap.add_argument("--masked-tile0", choices=("auto", "both"), default="auto")
    ap.add_argument("--close", action="store_true", help="forward modules may round differently (module docs)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_kernel_ab: needs a CUDA GPU (sm_90)")
    if a.rounds < 1:
        raise SystemExit(f"fp8_kernel_ab: --rounds must be >= 1, got {a.rounds}")
    specs = dict(parse_module(t) for t in a.module)
    here = os.path.dirname(os.path.abspath(__file__))
    launcher = f"gluon_fp8_{a.kernel}"
    mods = {"main": _load("main", os.path.join(here, "..", "..", "flamia_pack", "kernels", launcher + ".py"), launcher)}
    mods.update({n: _load(n, p, launcher) for n, p in specs.items()})
    mt0s = [None] if a.masked_tile0 == "auto" or a.kernel == "bwd" else [False, True]
    if a.kernel == "bwd":
        sys.path.insert(0, here)
        from fp8_bwd_probe import prepared_backward
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = {}
    for row in a.rows.split(","):
        if a.kernel == "bwd":
            q, k, v, cu, do = _row(row, seed=3, with_do=True)
            b = prepared_backward(q, k, v, do, cu)
            dq_acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")
            bad = check_bwd(mods, b, cu, dq_acc)
            def fn(m, mt0):
                return lambda: _run_bwd(mods[m], b, cu, dq_acc)
            ops = ops_nan = b
        else:
            q, k, v, cu = _row(row, seed=3)
            bad = None
        if bad is None:
            T = q.shape[0]
            ops = fp8_quantize(q, k, v, cu, "block")
            lo, hi = (int(cu[1]), int(cu[2])) if cu.numel() > 2 else (0, int(cu[1]))
            kn, vn = k.clone(), v.clone()
            for x in (kn, vn):  # NaN groups at document 2's first and last tokens (the tiles it shares)
                for t in (lo, hi - 1):
                    x[t, 0, 9] = float("nan")
            ops_nan = fp8_quantize(q, kn, vn, cu, "block")
            del kn, vn
            wl = build_fp8_work_list(cu, T)
            bad = check(mods, row, ops, ops_nan, cu, wl, mt0s, (lo, hi), close=a.close)

            def fn(m, mt0):
                return lambda: _run(mods[m], ops, cu, wl, mt0, False)
        for key, why in bad.items():
            if why:
                print(f"{row} {key[0]} masked_tile0={key[1]}: CHECK FAILED: {why}", flush=True)
        times = {key: [] for key, why in bad.items() if why is None}
        for _ in range(a.rounds):
            for key in times:
                m, mt0 = key
                times[key].append(float(triton.testing.do_bench(fn(m, mt0), warmup=25, rep=a.rep,
                                                                return_mode="median")))
        med = {key: statistics.median(ts) for key, ts in times.items()}
        results[row] = {f"{m}/{mt0}": {"rounds": times[(m, mt0)], "median": med[(m, mt0)]} for m, mt0 in times}
        results[row].update({f"{m}/{mt0}": {"failed": why} for (m, mt0), why in bad.items() if why})
        for mt0 in mt0s:
            cells = []
            for m in mods:
                t = med.get((m, mt0))
                t0 = med.get(("main", mt0))
                cells.append("FAILED" if t is None else f"{t:.3f}" + ("" if m == "main" or t0 is None else f" ({t / t0:.3f})"))
            print(f"| {row} | masked_tile0={mt0} | " + " | ".join(cells) + " |", flush=True)
        del ops, ops_nan, q, k, v, fn
        torch.cuda.empty_cache()
    print("columns: " + " | ".join(mods) + " (ms, ratio to main)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_kernel_ab.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
