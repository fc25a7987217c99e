"""End-to-end training throughput of a Llama-style transformers model: "flamia" on packed rows vs
transformers' "sdpa" on padded batches and "flex_attention" on the same packed rows (issue 30).

Data: the bundled Python-stdlib sample (``flamia_pack/data/python-stdlib.parquet``), byte tokenizer
(ids 0..255, as ``examples/train_tiny_gpt.py``; no hub), packed on the fly by
``StreamingPackedDataset`` into rows of ``--capacities`` tokens (default 8,192 and 65,536) and
collated by ``PackedCollator`` (``--rows`` rows per step). Every implementation trains on the same
documents per step:

- ``flamia``: the packed rows flattened to ``(1, T)`` with ``cu_seq_lens_q/k`` + ``max_length_q/k``
  (``flamia_pack.integrations.transformers.packed_batch_to_model_inputs``);
- ``flamia_fp8``: the same with ``precision="fp8"`` (block scales); reported as unavailable while
  the FP8 path has no GPU backward (issue 28), or for a head_dim it does not take;
- ``flex_attention``: the same ``(1, T)`` rows with ``position_ids`` restarts (transformers builds a
  document ``BlockMask`` per forward; ``use_cache=False``);
- ``sdpa``: padded batches of the same documents, one document per line, each line padded to the
  longest document of its micro-batch, with an ``attention_mask``; documents are taken in order into
  micro-batches of at most ``capacity`` slots (lines x longest), one forward/backward each, and one
  optimizer step after all of them (the step's real tokens equal the packed step's).

Model (default ~250M parameters): hidden 1024, 16 layers, 8 query heads of 128, 4 kv heads (GQA),
MLP 4096, vocab 256, bfloat16 parameters, AdamW. Loss: mean next-token cross entropy inside documents
(PackedCollator's labels; computed here, in float32, from the logits).

Reported per (capacity, implementation): real tokens/s (median step), peak memory
(``torch.cuda.max_memory_allocated``), the share of the step spent in the attention function
(forward and backward, CUDA events around each call and around its backward via identity autograd
markers; mask / BlockMask construction is outside it), the first step's loss, the token slots the
model computes per real token (padding and row-end padding included), and the ratios of
"flamia" to the others. ``--json PATH`` writes everything. A configuration that runs out of memory is
reported as OOM. ``--smoke`` runs a tiny float32 version on the CPU in a few seconds (flamia and
sdpa, plus flamia_fp8's status; it checks that flamia and sdpa give the same first-step loss).

Run on the GPU machine: ``python benchmarks/bench_model.py`` (``--grad-ckpt`` for activation
checkpointing, ``--impls flamia sdpa`` to pick implementations).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from flamia_pack.errors import FlamiaError  # noqa: E402
from flamia_pack.loaders import PackedCollator, StreamingPackedDataset, open_source, to_device  # noqa: E402

SAMPLE = ROOT / "flamia_pack" / "data" / "python-stdlib.parquet"
VOCAB = 256
IGNORE = -100
IMPLS = ("flamia", "flamia_fp8", "sdpa", "flex_attention")
ATTN = {"flamia": "flamia", "flamia_fp8": "flamia", "sdpa": "sdpa", "flex_attention": "flex_attention"}


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

def sample_documents(max_doc_len: Optional[int]):
    """A zero-argument callable yielding the sample's byte-token documents (int32 arrays), each cut
    into pieces of at most ``max_doc_len`` tokens (None: whole documents)."""
    def docs():
        for doc in open_source(str(SAMPLE), tokenizer="bytes"):
            if max_doc_len is None:
                yield doc
            else:
                for i in range(0, len(doc), max_doc_len):
                    yield doc[i:i + max_doc_len]
    return docs


def packed_batches(capacity: int, rows: int, count: int, buffer_docs: int,
                   max_doc_len: Optional[int] = None) -> list[dict[str, Any]]:
    """``count`` PackedCollator batches of ``rows`` rows of ``capacity`` tokens from the sample
    (documents longer than the capacity are split by the packer; the source is read again from the
    start when it runs out)."""
    collate = PackedCollator(pad_id=0, ignore_index=IGNORE)
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    while len(out) < count:
        got = 0
        for row in StreamingPackedDataset(sample_documents(max_doc_len), capacity=capacity, buffer_docs=buffer_docs):
            got += 1
            pending.append(row)
            if len(pending) == rows:
                out.append(collate(pending))
                pending = []
                if len(out) == count:
                    break
        if got == 0:
            raise SystemExit(f"{SAMPLE}: no rows")
    return out


def padded_micro_batches(batch: dict[str, Any], capacity: int) -> list[dict[str, torch.Tensor]]:
    """The documents of a packed batch as padded micro-batches (one document per line, lines padded
    to the micro-batch's longest document, at most ``capacity`` slots each), with the packed batch's
    labels (already shifted inside each document)."""
    cu = batch["cu_seqlens"].tolist()
    ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    segs = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    groups: list[list[tuple[int, int]]] = []
    for a, b in segs:
        if groups:
            g = groups[-1]
            longest = max(b - a, max(y - x for x, y in g))
            if (len(g) + 1) * longest <= capacity:
                g.append((a, b))
                continue
        groups.append([(a, b)])
    out = []
    for g in groups:
        L = max(b - a for a, b in g)
        x = torch.zeros(len(g), L, dtype=torch.long)
        y = torch.full((len(g), L), IGNORE, dtype=torch.long)
        m = torch.zeros(len(g), L, dtype=torch.long)
        for i, (a, b) in enumerate(g):
            x[i, :b - a], y[i, :b - a], m[i, :b - a] = ids[a:b], labels[a:b], 1
        out.append({"input_ids": x, "labels": y, "attention_mask": m})
    return out


# ---------------------------------------------------------------------------------------------
# attention timing
# ---------------------------------------------------------------------------------------------

class _Clock:
    """CUDA events on a GPU, ``perf_counter`` on the CPU; ``elapsed(a, b)`` in ms."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class _BwdEnd(torch.autograd.Function):
    """Identity on (q, k, v); its backward runs right after the attention's backward: marks its end."""

    @staticmethod
    def forward(ctx, timer, slot, q, k, v):
        ctx.timer, ctx.slot = timer, slot
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        ctx.slot["bwd_end"] = ctx.timer.clock.mark()
        return None, None, gq, gk, gv


class _BwdStart(torch.autograd.Function):
    """Identity on the attention output; its backward runs right before the attention's backward."""

    @staticmethod
    def forward(ctx, timer, slot, out):
        ctx.timer, ctx.slot = timer, slot
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        ctx.slot["bwd_start"] = ctx.timer.clock.mark()
        return None, None, g


class AttentionTimer:
    """Wraps transformers' attention functions (forward and backward) with clock marks."""

    def __init__(self, cuda: bool) -> None:
        self.clock = _Clock(cuda)
        self.slots: list[dict[str, Any]] = []
        self.enabled = False

    def wrap(self, fn):
        def timed(module, query, key, value, *args, **kwargs):
            if not self.enabled:
                return fn(module, query, key, value, *args, **kwargs)
            slot: dict[str, Any] = {}
            self.slots.append(slot)
            if torch.is_grad_enabled():
                query, key, value = _BwdEnd.apply(self, slot, query, key, value)
            slot["fwd_start"] = self.clock.mark()
            out, weights = fn(module, query, key, value, *args, **kwargs)
            slot["fwd_end"] = self.clock.mark()
            if torch.is_grad_enabled() and out.requires_grad:
                out = _BwdStart.apply(self, slot, out)
            return out, weights
        return timed

    def total_ms(self) -> float:
        total = 0.0
        for s in self.slots:
            total += self.clock.elapsed(s["fwd_start"], s["fwd_end"])
            if "bwd_start" in s and "bwd_end" in s:
                total += self.clock.elapsed(s["bwd_start"], s["bwd_end"])
        return total


def install_timer(impl: str, timer: AttentionTimer):
    """Route ``impl`` through the timer (a local override on transformers' global interface)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[impl] = timer.wrap(ALL_ATTENTION_FUNCTIONS._global_mapping[impl])
    return lambda: ALL_ATTENTION_FUNCTIONS._local_mapping.pop(impl, None)


# ---------------------------------------------------------------------------------------------
# model and steps
# ---------------------------------------------------------------------------------------------

def build_model(args: argparse.Namespace, impl: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.capacities),
                      rope_theta=500000.0, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)  # the same initial weights for every implementation
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN[impl])
    model = model.to(device=device, dtype=dtype).train()
    if impl == "flamia_fp8":
        from flamia_pack.integrations.transformers import set_options

        set_options(model, precision="fp8", granularity="block")
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    return model


def loss_of(logits: torch.Tensor, labels: torch.Tensor, denom: int) -> torch.Tensor:
    """Sum of next-token cross entropy over the real targets, divided by ``denom`` (all targets of the step)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum") / denom


def make_step(impl: str, model, opt, batch: dict[str, Any], device: torch.device, capacity: int):
    """A closure running one training step of ``impl`` on ``batch``; returns the loss (float tensor)."""
    from flamia_pack.integrations.transformers import packed_batch_to_model_inputs

    targets = int((batch["labels"] != IGNORE).sum())
    if impl == "sdpa":
        micro = [{k: v.to(device) for k, v in mb.items()} for mb in padded_micro_batches(batch, capacity)]

        def step():
            total = 0.0
            for mb in micro:
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
                loss = loss_of(logits, mb["labels"], targets)
                loss.backward()
                total = total + loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total
        slots = sum(mb["input_ids"].numel() for mb in micro)
        return step, slots

    dev = to_device(batch, device)
    inputs = packed_batch_to_model_inputs(dev, labels=False)
    labels = dev["labels"].reshape(1, -1)
    if ATTN[impl] != "flamia":
        inputs = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}

    def step():
        logits = model(**inputs, use_cache=False).logits
        loss = loss_of(logits, labels, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, inputs["input_ids"].numel()


def run_one(args, impl: str, capacity: int, batches: list[dict[str, Any]], device: torch.device,
            dtype: torch.dtype) -> dict[str, Any]:
    cuda = device.type == "cuda"
    model = build_model(args, impl, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    timer = AttentionTimer(cuda)
    uninstall = install_timer(ATTN[impl], timer)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, shares, fills, first_loss = [], [], [], None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for i, batch in enumerate(batches):
            step, slots = make_step(impl, model, opt, batch, device, capacity)
            timer.slots.clear()
            timer.enabled = i >= args.warmup
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            dt = time.perf_counter() - t0
            if first_loss is None:
                first_loss = float(loss)
            if i >= args.warmup:
                times.append(dt)
                fills.append(slots / max(1, batch["num_real_tokens"]))
                shares.append(timer.total_ms() / (dt * 1e3))
    except torch.cuda.OutOfMemoryError as exc:
        return {"impl": impl, "capacity": capacity, "status": "OOM", "error": str(exc).splitlines()[0]}
    except NotImplementedError as exc:  # precision="fp8" on the GPU: no FP8 backward yet (issue 28)
        return {"impl": impl, "capacity": capacity, "status": "unavailable", "error": str(exc)}
    except FlamiaError as exc:  # a shape the FP8 path does not take (e.g. the smoke model's head_dim 16)
        if impl != "flamia_fp8":
            raise
        return {"impl": impl, "capacity": capacity, "status": "unavailable", "error": str(exc)}
    finally:
        uninstall()
        del model, opt
    real = [b["num_real_tokens"] for b in batches[args.warmup:]]
    return {
        "impl": impl, "capacity": capacity, "status": "ok", "params": params,
        "tokens_per_s": statistics.median(r / t for r, t in zip(real, times)),
        "step_ms": statistics.median(times) * 1e3,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "attention_share": statistics.median(shares),
        "first_loss": first_loss,
        "slots_per_real_token": statistics.mean(fills),
    }


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacities", type=int, nargs="+", default=[8192, 65536], help="packed row length(s)")
    p.add_argument("--rows", type=int, default=1, help="packed rows per step")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--buffer-docs", type=int, default=256, help="StreamingPackedDataset look-ahead")
    p.add_argument("--max-doc-len", type=int, default=None,
                   help="cut the sample's documents into pieces of at most this many tokens first (default: whole)")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing (all implementations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny float32 run on the CPU (a few seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.capacities, args.steps, args.warmup, args.buffer_docs, args.max_doc_len = [256], 1, 1, 32, 100
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
        args.impls = [i for i in args.impls if i != "flex_attention"]
        args.device = args.device or "cpu"
    for name in ("rows", "steps", "hidden", "layers", "heads", "kv_heads", "intermediate", "buffer_docs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_doc_len is not None and args.max_doc_len < 1:
        p.error("--max-doc-len must be >= 1")
    if args.warmup < 0 or min(args.capacities) < 2:
        p.error("--warmup must be >= 0 and every capacity >= 2")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    import transformers

    import flamia_pack.integrations.transformers  # noqa: F401  (registers "flamia")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    head_dim = args.hidden // args.heads
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}, {dtype}, "
          f"hidden {args.hidden} x {args.layers} layers, {args.heads}/{args.kv_heads} heads of {head_dim}")
    results = []
    for cap in args.capacities:
        batches = packed_batches(cap, args.rows, args.warmup + args.steps, args.buffer_docs, args.max_doc_len)
        docs = sum(b["cu_seqlens"].numel() - 1 for b in batches)
        fill = sum(b["num_real_tokens"] for b in batches) / (len(batches) * args.rows * cap)
        print(f"\ncapacity {cap:,} x {args.rows} row(s): {docs} documents in {len(batches)} steps, fill {fill:.1%}")
        for impl in args.impls:
            r = run_one(args, impl, cap, batches, device, dtype)
            results.append(r)
            if r["status"] != "ok":
                print(f"  {impl:15s} {r['status']}: {r['error']}")
                continue
            mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "n/a"
            print(f"  {impl:15s} {r['tokens_per_s']:>12,.0f} tok/s  step {r['step_ms']:8.1f} ms  peak {mem:>10}  "
                  f"attention {r['attention_share']:.0%}  first loss {r['first_loss']:.5f}  "
                  f"slots/token {r['slots_per_real_token']:.2f}  ({r['params'] / 1e6:.0f}M params)")
        ok = {r["impl"]: r for r in results if r["capacity"] == cap and r["status"] == "ok"}
        if "flamia" in ok:
            for other in ("sdpa", "flex_attention"):
                if other in ok:
                    f, o = ok["flamia"], ok[other]
                    mem = (f" peak memory {f['peak_mem_gib'] / o['peak_mem_gib']:.2f}x"
                           if f["peak_mem_gib"] and o["peak_mem_gib"] else "")
                    print(f"  flamia / {other}: tokens/s {f['tokens_per_s'] / o['tokens_per_s']:.2f}x{mem}")
    out = {"args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
           "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "results": results}
    if args.smoke:
        losses = {r["impl"]: r["first_loss"] for r in results if r["status"] == "ok"}
        if "flamia" in losses and "sdpa" in losses and not math.isclose(losses["flamia"], losses["sdpa"], rel_tol=1e-4):
            raise SystemExit(f"smoke: first-step losses differ: {losses}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
