"""Does a model learn to read an FP8 exponent leak? A cheap CPU check before the GPU runs (issue 29).

Trains examples/train_tiny_gpt.py's TinyGPT (2 layers, width 128, one head of 128, rows of 512 bytes
of the bundled sample, examples/train_fp8.py's data split and schedule) with a quantize -> dequantize
model of one ``examples/fp8_leak.py`` mode (q, k, v only, straight-through gradient, the exact float32
reference attention; no P / dS quantization), and evaluates every 100 steps through: the mode itself
(``own``), exact attention (``exact``) and the mode's causal twin (``control``: ``next-floor`` <->
``prev-floor``, ``next`` <-> ``prev``; else exact). A model that reads the future has
own < control; one that only adapted to the clipping has own ~ control < exact.

    PYTHONPATH=. python benchmarks/probes/fp8_leak_training_cpu.py next-floor --steps 500   # ~75 s
    PYTHONPATH=. python benchmarks/probes/fp8_leak_training_cpu.py prev-floor --steps 500

Prints one JSON line per evaluation (``--json PATH`` also writes them).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import fp8_leak  # noqa: E402
import train_fp8 as tf  # noqa: E402
import train_tiny_gpt as tiny  # noqa: E402
from flamia_pack.kernels.reference import packed_attention_reference_blocked  # noqa: E402

TWIN = {"next-floor": "prev-floor", "prev-floor": "next-floor", "next": "prev", "prev": "next"}


def qdq_attention(mode: str):
    def attn(q, k, v, batch):
        if mode == "exact":
            return packed_attention_reference_blocked(q, k, v, batch["cu_seqlens"])
        return fp8_leak.leaky_qdq_attention(q, k, v, batch["cu_seqlens"], mode=mode)
    return attn


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=fp8_leak.MODES + ("exact",))
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=pathlib.Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore", fp8_leak.LeakWarning)
    args = tf.parse_args(["--device", "cpu", "--out", "unused", "--capacity", "512", "--layers", "2", "--d-model",
                          "128", "--heads", "1", "--lr", "3e-3", "--warmup-steps", "30", "--steps", str(a.steps),
                          "--seed", str(a.seed)])
    torch.manual_seed(a.seed)
    model = tiny.TinyGPT(d_model=128, num_layers=2, num_heads=1, attention=qdq_attention(a.mode))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tf.lr_lambda(args))
    train_docs, val_docs = tf.load_split(args.source, args.val_every_nth_doc)
    rows = tf.Rows(train_docs, args)
    vrows = tf.val_rows(val_docs, args.capacity, 24, args.buffer_docs)
    control = TWIN.get(a.mode, "exact")
    cpu = torch.device("cpu")

    @torch.no_grad()
    def evaluate() -> dict:
        res = {}
        model.eval()
        for name, m in (("own", a.mode), ("exact", "exact"), ("control", control)):
            model.attention = qdq_attention(m)
            tot = n = 0
            for r in vrows:
                _, b = tf.prepare([r], cpu, "eval", 128, False)
                lab = b["labels"].reshape(-1)
                tot += float(F.cross_entropy(model(b), lab, ignore_index=-100, reduction="sum"))
                n += int((lab != -100).sum())
            res[name] = tot / n
        model.attention = qdq_attention(a.mode)
        model.train()
        return res

    out, t0 = [], time.time()
    fh = a.json.open("w") if a.json else None
    for s in range(1, a.steps + 1):
        _, b = tf.prepare([rows.next()], cpu, "eval", 128, False)
        loss = F.cross_entropy(model(b), b["labels"].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if s % 100 == 0 or s == a.steps:
            r = {"mode": a.mode, "control_mode": control, "step": s, "train_loss": loss.item(), **evaluate(),
                 "seconds": time.time() - t0}
            out.append(r)
            print(json.dumps(r), flush=True)
            if fh:
                fh.write(json.dumps(r) + "\n")
    return out


if __name__ == "__main__":
    main()
