"""The FP8 path's quantizer (``quantize_qkv`` as ``fp8_quantize`` calls it) at several tiles: bitwise, then timed.

    PYTHONPATH=. python3 benchmarks/probes/quant_tile_probe.py [--tiles 256x8,128x8,128x4,64x4] [--rep 20]

1. **check**, per tile, "block" and "token", one term and with residual codes (``qk_terms=2``), with and without
   the fused rotation: codes, exponents, residual codes and K_lo^T bitwise the torch reference
   (``quant.quantize_token_blocks`` / ``quant.residual_codes`` of ``qk_rotation.rotate_qk``'s tensors; the codes of
   a non-finite group are unspecified, its residual codes NaN) on an unaligned row with a NaN, a zero and a tiny
   token and outlier channels. A tile that fails is not timed.
2. **time**: ``do_bench`` ms of each case at T = 65,536, 16 heads, D 128, unaligned documents of 1-3,000 tokens;
   ``default`` is ``launch_config``'s choice.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from flamia_pack.kernels.qk_rotation import rotate_qk
from flamia_pack.kernels.quantize import quantize_qkv
from flamia_pack.quant import UE8M0_NAN, quantize_token_blocks, residual_codes

CASES = [(r, bw, rot) for rot in (False, True) for r in (False, True) for bw in (False, True)]


def call(q, k, v, cu, gran, residual, backward, rotate, tile):
    kw = {} if tile is None else dict(block_rows=tile[0], num_warps=tile[1])
    return quantize_qkv(q, k, v, cu, gran, transposed=(backward, backward, True), wgmma_order=(backward, False, True),
                        transposed_store="triton", check_finite=False, rotate_qk=rotate,
                        residual=(residual, residual, False), residual_transposed=(False, residual and backward, False),
                        **kw)


def rotation_rounding_only(xr, ref, got_lo, want_lo, gran, tile) -> bool:
    """With the fused rotation, the kernel's rotated rows are ``tl.dot``'s fp32 sums rounded to bf16, the reference's
    torch's: the sums' order differs, so a rotated entry can round to the neighbouring bf16 value. Its code and
    exponent rarely move (checked bitwise by the caller); its residual code does. Accept a residual mismatch only
    where the kernel's ``code + lo`` lies within one bf16 ulp of the rotated entry plus both residuals' rounding
    (half an E4M3 ulp each), and print how many entries differ."""
    fin = (ref.exponents != UE8M0_NAN)[..., None].expand(ref.codes.shape)
    diff = (got_lo != want_lo) & fin
    n = int(diff.sum())
    if n == 0:
        return True
    e = ref.exponents.to(torch.float64)[..., None] - 127
    x = xr.double()
    got = (ref.codes.double() + got_lo.view(torch.float8_e4m3fn).double()) * torch.exp2(e)
    lo_ref = want_lo.view(torch.float8_e4m3fn).double()

    def half_ulp(v, mant_bits, min_exp):  # half the spacing of a float with that many mantissa bits at v
        ex = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** min_exp)))
        return torch.exp2(ex - mant_bits - 1)

    bound = 2 * half_ulp(x, 7, -133) + (half_ulp(lo_ref, 3, -6) * 2 + 2.0 ** -10) * torch.exp2(e)
    err = (got - x).abs()
    ok = bool((err[diff] <= bound[diff]).all())
    print(f"  rotation, tile {tile} {gran}: {n} of {int(fin.sum())} residual codes differ from torch's rotation "
          f"(fp32 sum order), worst |code + lo - x M| / bound {float((err[diff] / bound[diff]).max()):.3f}: "
          f"{'within one bf16 ulp' if ok else 'BEYOND one bf16 ulp'}")
    return ok


def bitwise(tile) -> bool:
    g = torch.Generator().manual_seed(5)
    lens = [300, 1, 77, 130, 611]
    T = sum(lens) + 5
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    q = torch.randn((T, 4, 128), generator=g).bfloat16()
    k, v = (torch.randn((T, 2, 128), generator=g).bfloat16() for _ in range(2))
    k[:, :, [5, 17, 40, 99]] *= 20
    q[40, 1, 7] = float("nan")
    q[90] = 0
    k[10] *= 1e-30
    ok = True
    for gran in ("block", "token"):
        for residual, backward, rotate in CASES:
            got = call(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), gran, residual, backward, rotate, tile)
            qr, kr = rotate_qk(q, k) if rotate else (q, k)
            for x, o in zip((qr, kr, v), got):
                ref = quantize_token_blocks(x, cu, gran, check_finite=False)
                fin = (ref.exponents != UE8M0_NAN)[..., None].expand(ref.codes.shape)  # codes of a NaN group: any
                same = torch.equal(o.exponents.cpu(), ref.exponents) and torch.equal(
                    o.codes.cpu().view(torch.uint8)[fin], ref.codes.view(torch.uint8)[fin])
                if o.codes_lo is not None:
                    lo = residual_codes(x, ref).view(torch.uint8)
                    got_lo = o.codes_lo.cpu().view(torch.uint8)
                    if rotate and same:
                        same &= rotation_rounding_only(x, ref, got_lo, lo, gran, tile)
                    else:
                        same &= torch.equal(got_lo, lo)
                    if o.codes_lo_t is not None:
                        same &= torch.equal(o.codes_lo_t.cpu().view(torch.uint8), got_lo.permute(1, 2, 0))
                if not same:
                    print(f"MISMATCH tile {tile} {gran} residual={residual} backward={backward} rotate={rotate}")
                    ok = False
    return ok


def main(argv=None):
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", default="256x8,128x8,128x4,64x4")
    ap.add_argument("--rep", type=int, default=20)
    a = ap.parse_args(argv)
    tiles = [None] + [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",")]
    print(torch.cuda.get_device_name())
    tiles = [t for t in tiles if bitwise(t) or print(f"tile {t}: not bitwise, not timed")]
    T = 65536
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    c = np.r_[0, np.cumsum(np.random.default_rng(0).integers(1, 3000, 200))]
    cu = torch.tensor(c[c < T].tolist() + [T], device="cuda", dtype=torch.int32)
    print("| granularity | residual | backward copies | rotation | "
          + " | ".join("default" if t is None else f"{t[0]} x {t[1]}" for t in tiles) + " |")
    print("|---" * (4 + len(tiles)) + "|")
    for gran in ("block", "token"):
        for residual, backward, rotate in CASES:
            ms = []
            for t in tiles:
                def f(t=t):
                    return call(q, k, v, cu, gran, residual, backward, rotate, t)
                f()
                ms.append(triton.testing.do_bench(f, rep=a.rep))
            yn = {True: "yes", False: "no"}
            print(f"| {gran} | {yn[residual]} | {yn[backward]} | {yn[rotate]} | "
                  + " | ".join(f"{m:.3f}" for m in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
