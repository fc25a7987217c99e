"""Training call and forward of the FP8 precision tiers against our BF16 op, in one process (GPU).

    PYTHONPATH=. python3 benchmarks/probes/fp8_terms_timing.py [W1,W2,...]

Per row of ``bench_attention.WORKLOADS`` (default W1-W9): ``bench_attention.measure`` of our BF16 op, and
``precision="fp8"`` with one term, ``qk_terms=2``, and ``qk_terms=2, pv_terms=2`` (the precision tier: two-term Q,
K, P~ and V), each a training call (quantization, forward, backward) and a forward; prints each one's ratio to BF16
and writes ``$OUT/fp8_terms_timing.json``. The full peer comparison (FA4, cuDNN) is ``bench_attention.py --fp8``.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as B  # noqa: E402

VARIANTS = {"bf16": B.ours, "fp8_qk1": B.ours_fp8, "fp8_qk2": lambda i: B.ours_fp8(i, qk_terms=2),
            "fp8_qk2_pv2": lambda i: B.ours_fp8(i, qk_terms=2, pv_terms=2)}


def main(argv=None):
    rows = (argv or sys.argv[1:] or ["W1,W2,W3,W4,W5,W6,W7,W8,W9"])[0].split(",")
    print(torch.cuda.get_device_name())
    out = {}
    for name in rows:
        spec = B.WORKLOADS[name]
        inp = B.make_inputs(B.workload_lengths(name), spec["num_heads"], spec["num_kv_heads"], seed=hash(name) % 10000)
        r = out[name] = {k: B.measure(k, make, inp, rep=100) for k, make in VARIANTS.items()}
        base = r["bf16"]
        cells = [f"{k} {v['error']}" if "error" in v else
                 f"{k} fwd {v['fwd_ms']:.3f} train {v['train_ms']:.3f} ({base['train_ms'] / v['train_ms']:.3f}x bf16)"
                 for k, v in r.items()]
        print(f"{name}: " + " | ".join(cells), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_terms_timing.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
