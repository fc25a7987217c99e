"""Fused token-block FP8 quantizer vs a copy floor and vs the torch reference (issue 3, DESIGN.md §4).

Cases (16 heads, D = 128, bf16 inputs, MHA so Q, K and V each have 16 heads):

- ``A``: T = 16,384 = 4 documents x 4,096 (aligned starts: no scale group crosses a tile edge);
- ``B``: T = 65,536 = 16 x 4,096 (aligned; a size where launch overhead is negligible);
- ``C``: T = 65,536 in 40 random unaligned documents (groups straddle tile edges: halo reads).

"Same bytes" (the floor). Quantizing N = T * H * D elements must read x once (2 B/elem for bf16)
and write the codes (1 B/elem) and the exponents (1 B per token and head, N / D bytes); the
transposed copy adds 1 B/elem. The floor is a flat Triton copy kernel over the same N elements
that reads bf16 and writes 1 B/elem (a float8 cast: no scale, no reduction), plus a second
1 B/elem output for the transposed variants; for QKV it copies 3 N elements. The exponents
(0.8 % of the bytes) are not in the floor. ``x / floor`` is the quantizer's time over the floor's
(target <= 1.3). Peers in the same run: torch's own bf16->fp8 cast (``copy_`` into a float8
buffer, same bytes as the floor), a bf16 clone (2 + 2 B/elem, the device copy bandwidth), and the
torch reference ``quant.quantize_token_blocks`` (several passes; precomputed ``group_start``).

Every quantizer variant is checked bitwise against the torch reference before it is timed (the
in-kernel transposed store, ``transposed_store="kernel"``, is miscompiled by the bundled ptxas for
some tiles: its wrong bytes are counted and shown instead); first, the transposed-copy modes are
checked on an unaligned packing for both input dtypes and granularities.
Case A is timed again at the end (same version twice: the noise between runs).
Timing: ``triton.testing.do_bench`` median (L2 flushed between calls), 25 ms warm-up, 200 ms.
GB/s counts the minimal bytes above. Register/spill/shared-memory use of every compiled
quantizer variant is printed at the end (Triton's compiled-kernel metadata).

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/bench_quant.py [--out DIR]``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from flamia_pack.kernels import quantize as qmod
from flamia_pack.kernels.quantize import quantize, quantize_qkv
from flamia_pack.quant import quantize_token_blocks, scale_groups


@triton.jit
def _copy_floor(x_ptr, y_ptr, z_ptr, n, TWO: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(x_ptr + offs, mask=m).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(y_ptr + offs, y, mask=m)
    if TWO:
        tl.store(z_ptr + offs, y, mask=m)


def copy_floor(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None) -> None:
    n = x.numel()
    block = 8192
    _copy_floor[(triton.cdiv(n, block),)](x, y, z if z is not None else y, n, TWO=z is not None,
                                          BLOCK=block, num_warps=8)


def bench(fn) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def make_case(name: str, T: int, lens: list[int], H: int, D: int, gen: torch.Generator):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    assert int(cu[-1]) == T
    xs = [torch.randn(T, H, D, generator=gen).mul_(torch.exp2(torch.randint(-6, 7, (T, H, 1), generator=gen).float()))
          .to(torch.bfloat16).cuda() for _ in range(3)]
    return {"name": name, "T": T, "cu": cu, "xs": xs, "n_docs": len(lens), "H": H, "D": D}


def check(outs, xs, cu, granularity, transposed) -> int:
    """Assert codes and exponents bitwise; return the number of wrong codes_t bytes (asserted by
    the caller for the default store, reported for the in-kernel one)."""
    bad_t = 0
    for o, x in zip(outs, xs):
        ref = quantize_token_blocks(x, cu, granularity, check_finite=False)
        assert torch.equal(o.codes.view(torch.uint8), ref.codes.view(torch.uint8)), "codes differ"
        assert torch.equal(o.exponents, ref.exponents), "exponents differ"
        if transposed:
            bad_t += int((o.codes_t.view(torch.uint8) != ref.codes.view(torch.uint8).permute(1, 2, 0)).sum())
    return bad_t


def kernel_cache_keys() -> set:
    """Keys of the quantizer's compiled-kernel cache (Triton internals; empty if they change)."""
    keys = set()
    try:
        for dev, entry in getattr(qmod._quantize_kernel, "device_caches", {}).items():
            cache = entry[0] if isinstance(entry, tuple) else entry
            keys |= {(dev, k) for k in cache}
    except Exception:  # noqa: BLE001
        pass
    return keys


def kernel_by_key(key):
    dev, k = key
    entry = qmod._quantize_kernel.device_caches[dev]
    cache = entry[0] if isinstance(entry, tuple) else entry
    return cache[k]


def transposed_store_diagnostic(gen: torch.Generator) -> list[dict]:
    """Bitwise check of codes_t for both store modes on an unaligned packing (T % 16 != 0),
    bf16 and float32 inputs, both granularities, default tiles; prints mismatch counts."""
    lens = torch.randint(1, 900, (17,), generator=gen).tolist()
    T = sum(lens) + 13
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(T, 4, 128, generator=gen) * torch.exp2(torch.randint(-8, 8, (T, 4, 1), generator=gen).float()))
        x = x.to(dtype).cuda()
        for gran in ("block", "token"):
            ref = quantize_token_blocks(x, cu, gran, check_finite=False).codes.view(torch.uint8).permute(1, 2, 0)
            for mode, hw in (("torch", True), ("kernel", True), ("kernel", False)):
                junk = torch.full((8 * x.numel(),), 0xA5, dtype=torch.uint8, device="cuda")
                del junk
                q = quantize(x, cu, gran, transposed=True, check_finite=False, transposed_store=mode, hw_cvt=hw)
                bad = int((q.codes_t.view(torch.uint8) != ref).sum())
                out.append(dict(dtype=str(dtype).replace("torch.", ""), granularity=gran, mode=mode,
                                cvt="hw" if hw else "int", T=T, mismatches=bad))
    print("transposed-copy store check (bitwise vs reference; T = %d):" % T)
    for r in out:
        print(f"  {r['dtype']:<9} {r['granularity']:<6} {r['mode']:<7} cvt={r['cvt']:<3} mismatches={r['mismatches']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_quant.json")
    ap.add_argument("--quick", action="store_true", help="only case A")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    H, D = 16, 128
    cases = [make_case("A 4x4096", 16384, [4096] * 4, H, D, gen)]
    if not args.quick:
        cases.append(make_case("B 16x4096", 65536, [4096] * 16, H, D, gen))
        cut = sorted(torch.randperm(65535, generator=gen)[:39].add(1).tolist())
        lens = [b - a for a, b in zip([0] + cut, cut + [65536])]
        cases.append(make_case("C 40 unaligned", 65536, lens, H, D, gen))

    variants = [
        # (label, tensors, granularity, transposed, kwargs); defaults: launch_config()
        ("qkv block", 3, "block", False, {}),
        ("qkv block +T", 3, "block", True, {}),
        ("qkv token", 3, "token", False, {}),
        ("qkv token +T", 3, "token", True, {}),
        ("qkv block gs", 3, "block", False, {"group_start": True}),
        ("qkv block intcvt", 3, "block", False, {"hw_cvt": False}),
        ("qkv block 128/8", 3, "block", False, {"block_rows": 128, "num_warps": 8}),
        ("qkv block 128/4", 3, "block", False, {"block_rows": 128, "num_warps": 4}),
        ("qkv block +T kernel", 3, "block", True, {"transposed_store": "kernel"}),
        ("qkv block +T kernel int", 3, "block", True, {"transposed_store": "kernel", "hw_cvt": False}),
        ("x block", 1, "block", False, {}),
        ("x block +T", 1, "block", True, {}),
        ("x token", 1, "token", False, {}),
    ]
    diag = transposed_store_diagnostic(gen)
    rows = []
    kernels = {}
    for case in cases:
        T, cu, xs = case["T"], case["cu"], case["xs"]
        n = T * H * D
        gs = scale_groups(cu, T).group_start
        flat = [torch.cat([x.reshape(-1) for x in xs]), xs[0].reshape(-1)]
        outs8 = [torch.empty(f.numel(), dtype=torch.uint8, device="cuda") for f in flat]
        outs8b = [torch.empty(f.numel(), dtype=torch.uint8, device="cuda") for f in flat]
        f8 = [torch.empty(f.numel(), dtype=torch.float8_e4m3fn, device="cuda") for f in flat]
        floor = {}
        for i, nt in enumerate((3, 1)):
            floor[(nt, False)] = bench(lambda: copy_floor(flat[i], outs8[i], None))
            floor[(nt, True)] = bench(lambda: copy_floor(flat[i], outs8[i], outs8b[i]))
            t_cast = bench(lambda: f8[i].copy_(flat[i]))
            t_clone = bench(lambda: flat[i].clone())
            byt = 3 * nt * n
            rows.append(dict(case=case["name"], variant=f"floor copy ({nt} tensor{'s' if nt > 1 else ''})",
                             ms=floor[(nt, False)], gbs=byt / floor[(nt, False)] / 1e6, floor=1.0, ref=None))
            rows.append(dict(case=case["name"], variant=f"floor copy 2 outputs ({nt})", ms=floor[(nt, True)],
                             gbs=4 * nt * n / floor[(nt, True)] / 1e6, floor=1.0, ref=None))
            rows.append(dict(case=case["name"], variant=f"torch fp8 cast ({nt})", ms=t_cast,
                             gbs=byt / t_cast / 1e6, floor=t_cast / floor[(nt, False)], ref=None))
            rows.append(dict(case=case["name"], variant=f"torch bf16 clone ({nt})", ms=t_clone,
                             gbs=4 * nt * n / t_clone / 1e6, floor=None, ref=None))
        t_ref = {}
        for nt in (3, 1):
            t_ref[nt] = bench(lambda: [quantize_token_blocks(x, cu, "block", group_start=gs, check_finite=False)
                                       for x in xs[:nt]])
            rows.append(dict(case=case["name"], variant=f"torch reference ({nt})", ms=t_ref[nt],
                             gbs=(3 * nt * n + nt * n // D) / t_ref[nt] / 1e6, floor=t_ref[nt] / floor[(nt, False)],
                             ref=1.0))
        for label, nt, gran, tr, kw in variants:
            kw = dict(kw)
            if kw.pop("group_start", False):
                kw["group_start"] = gs
            before = kernel_cache_keys()
            if nt == 3:
                fn = lambda: quantize_qkv(*xs, cu, gran, transposed=tr, check_finite=False, **kw)  # noqa: E731
            else:
                fn = lambda: quantize(xs[0], cu, gran, transposed=tr, check_finite=False, **kw)  # noqa: E731
            out = fn()
            torch.cuda.synchronize()
            bad_t = check(out if nt == 3 else [out], xs[:nt], cu, gran, tr)
            assert bad_t == 0 or kw.get("transposed_store") == "kernel", f"{label}: {bad_t} wrong codes_t bytes"
            for key in kernel_cache_keys() - before:
                kernels[label] = key
            ms = bench(fn)
            byt = nt * n * (3 + (1 if tr else 0)) + nt * n // D
            fl = floor[(nt, tr)]
            rows.append(dict(case=case["name"], variant=label + (f" [{bad_t} WRONG codes_t]" if bad_t else ""),
                             ms=ms, gbs=byt / ms / 1e6, floor=ms / fl, ref=t_ref[nt] / ms if gran == "block" else None))
        flat = outs8 = outs8b = f8 = None  # free before the next case
        torch.cuda.empty_cache()
    # the same version timed twice: case A again, after everything else (noise / clock drift)
    case = cases[0]
    for label in ("qkv block", "qkv token", "x block", "x token"):
        _, nt, gran, tr, kw = next(v for v in variants if v[0] == label)
        xs, cu = case["xs"], case["cu"]
        fn = (lambda: quantize_qkv(*xs, cu, gran, check_finite=False)) if nt == 3 else \
             (lambda: quantize(xs[0], cu, gran, check_finite=False))
        ms = bench(fn)
        n = case["T"] * H * D
        prev = next(r for r in rows if r["case"] == case["name"] and r["variant"] == label)
        rows.append(dict(case=case["name"] + " (again)", variant=label, ms=ms,
                         gbs=(nt * n * 3 + nt * n // D) / ms / 1e6, floor=prev["floor"] * ms / prev["ms"], ref=None))

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "H": H, "D": D,
    }
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; H={H}, D={D}, bf16 inputs")
    print("ms = median (do_bench); GB/s = minimal bytes / time; x floor = time / copy-floor time "
          "(same bytes; target <= 1.3); ref/x = torch reference time / this time\n")
    print("| case | variant | time | GB/s | x floor | ref / x |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fl = "–" if r["floor"] is None else f"{r['floor']:.2f}"
        rf = "–" if r["ref"] is None else f"{r['ref']:.1f}x"
        print(f"| {r['case']} | {r['variant']} | {r['ms'] * 1000:.1f} us | {r['gbs']:.0f} | {fl} | {rf} |"
              if r["ms"] < 1 else
              f"| {r['case']} | {r['variant']} | {r['ms']:.3f} ms | {r['gbs']:.0f} | {fl} | {rf} |")
    print("\ncompiled quantizer variants (registers / spills / shared bytes; F2FP = hw e4m3 converts in SASS)")
    res = {}
    for label, key in kernels.items():
        try:
            k = kernel_by_key(key)
        except Exception as e:  # noqa: BLE001
            print(f"  {label:<20} unavailable ({type(e).__name__})")
            continue
        info = {}
        for attr in ("n_regs", "n_spills"):
            info[attr] = getattr(k, attr, None)
        info["shared"] = getattr(getattr(k, "metadata", None), "shared", None)
        info["num_warps"] = getattr(getattr(k, "metadata", None), "num_warps", None)
        try:
            sass = k.asm["sass"]
            info["F2FP_E4M3"] = sass.count("E4M3")
            info["LDG.128"] = sass.count("LDG.E.128")
            info["STG.128"] = sass.count("STG.E.128")
            info["LDL/STL"] = sass.count("LDL") + sass.count("STL")
        except Exception as e:  # noqa: BLE001 - cuobjdump may be missing
            info["sass"] = f"unavailable ({type(e).__name__})"
        res[label] = info
        print(f"  {label:<20} {info}")
    with open(os.path.join(args.out, "bench_quant.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "kernels": res, "transposed_store": diag}, f, indent=1)


if __name__ == "__main__":
    main()
