"""Why is the FP8 forward slow on W6 (unaligned documents)? Same lengths, shifted onto the 16 / 128 grids (H200).

W6 (lognormal documents, starts off the 16-token grid) runs the FP8 forward kernel at 0.69 us per walked
128-key tile against W1's 0.37 (RESULTS 2026-12-02 (third)); the calibration under-predicts it by 37%.
Two candidate costs, both only where a document starts off the grid (``ph = start % 16 > 0``):

1. masked tiles: the key grid is anchored at ``floor16(start)`` but query items at ``start``, so every
   item's diagonal straddles two key tiles (W6: 1,452 masked of 4,870 walked tiles; anchored query items
   would give 1,000 of 4,444: ``tile_counts``);
2. the zeroing of tile 0's V^T columns of the previous document (NaN containment), once per item.

This times the forward kernel alone (``fp8_attention_forward`` on pre-quantized operands, do_bench
median) and the FP8 training call on: W6 as it is; the same documents each padded to a multiple of 16
tokens (every start on the grid: neither cost; 4,414 walked tiles, 542 masked); padded to a multiple of
128 (the same counts, whole tiles); with the tile counts of each row (and of anchored query items) and
our BF16 forward for scale. W6 minus the 16-aligned row is the alignment penalty; the tile counts say
how much of it (1) explains at a masked tile's measured cost, the rest is (2).

    PYTHONPATH=. python3 benchmarks/probes/fp8_alignment_probe.py
"""
from __future__ import annotations

import sys

import numpy as np
import torch


def tile_counts(lens, anchored: bool = False) -> tuple[int, int, int]:
    """``(items, walked 128-key tiles, masked tiles)`` per head of the FP8 forward on one packed row of
    ``lens``: key tiles on the grid ``floor16(start) + 128 n``, query items of 128 rows from ``start``
    (``anchored``: from ``floor16(start)``); a tile is masked for an item when tile 0 holds the previous
    document's keys or the item's first row does not see the tile's last key."""
    s = items = walked = masked = 0
    for L in lens:
        ph = s % 16
        f = s - ph
        base = f if anchored else s
        n_items = -(-(L + (ph if anchored else 0)) // 128)
        for i in range(n_items):
            q0 = base + 128 * i
            q1 = min(base + 128 * (i + 1), s + L)
            nt = (q1 - 1 - f) // 128 + 1
            m = {0} if ph else set()
            m |= {t for t in range(nt) if f + 128 * t + 127 > q0}
            items, walked, masked = items + 1, walked + nt, masked + len(m)
        s += L
    return items, walked, masked


def main() -> int:
    if not torch.cuda.is_available():
        print("error: fp8_alignment_probe.py needs the H200 (CUDA); nothing run", file=sys.stderr)
        return 2
    import triton

    from flamia_pack.kernels import varlen_attention
    from flamia_pack.kernels.fp8_attention import build_fp8_work_list, fp8_attention_forward, fp8_quantize
    from flamia_pack.scheduler.workloads import workload_lengths

    w6 = np.asarray(workload_lengths("W6"))
    rows = {"W6": w6, "W6, lengths -> x16": -(-w6 // 16) * 16, "W6, lengths -> x128": -(-w6 // 128) * 128}
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| row | tokens | items / tiles / masked (anchored items) | FP8 fwd kernel ms | us / tile | FP8 training "
          "call ms | BF16 fwd ms |")
    print("|---|---|---|---|---|---|---|")
    for name, lens in rows.items():
        T = int(lens.sum())
        g = torch.Generator(device="cuda").manual_seed(6)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        q, k, v, do = (torch.randn((T, 16, 128), device="cuda", generator=g).bfloat16() for _ in range(4))
        wl = build_fp8_work_list(cu, T, causal=True)
        ops = fp8_quantize(q, k, v, cu)
        fwd = triton.testing.do_bench(lambda: fp8_attention_forward(ops, cu, work_list=wl), warmup=10, rep=100,
                                      return_mode="median")
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def train():
            o = varlen_attention(*x, cu, int(lens.max()), precision="fp8", work_list=wl)
            torch.autograd.grad(o, x, do)

        tr = triton.testing.do_bench(train, warmup=5, rep=100, return_mode="median")
        bf = triton.testing.do_bench(lambda: varlen_attention(q, k, v, cu, int(lens.max())), warmup=10, rep=100,
                                     return_mode="median")
        it, wt, mk = tile_counts(lens)
        ait, awt, amk = tile_counts(lens, anchored=True)
        print(f"| {name} | {T} | {it} / {wt} / {mk} ({ait} / {awt} / {amk}) | {fwd:.3f} | "
              f"{1e3 * fwd * 132 / (wt * 16):.3f} | {tr:.3f} | {bf:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
