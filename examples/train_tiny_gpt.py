"""Train a tiny byte-level GPT from packed rows with varlen attention.

The whole path of flamia_pack in one script:

    source (bundled Python-stdlib sample, byte tokenizer)
      -> StreamingPackedDataset (online best fit; or PackedDataset over a `flamia pack` output)
      -> DataLoader workers -> PackedCollator (flattened batch, labels inside documents)
      -> to_device (pinned, non-blocking copy + GPU work list, no host sync)
      -> varlen_attention (flamia_pack's Triton kernels on CUDA; the exact torch reference on CPU)

The model is a pre-norm GPT with rotary position embeddings driven by the batch's
``position_ids`` (positions restart in every document), so documents never see each other:
attention is masked by ``cu_seqlens`` and the labels never cross a document boundary.

Run::

    python examples/train_tiny_gpt.py --steps 200                 # GPU if present, else CPU
    python examples/train_tiny_gpt.py --device cpu --steps 20 --capacity 1024
    python examples/train_tiny_gpt.py --packed out/sample-packed   # read a `flamia pack` output

Each log line reports the loss, tokens/s (real tokens, padding excluded) and the time the step
spent waiting for the next batch (``wait``: blocked in the DataLoader) and copying it
(``h2d``: pinned copy + work-list launch, host time). ``--json PATH`` writes the summary.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from flamia_pack.kernels.attention import varlen_attention  # noqa: E402
from flamia_pack.kernels.config import kernel_config, work_list_tile_config  # noqa: E402
from flamia_pack.loaders import PackedCollator, PackedDataset, StreamingPackedDataset, to_device  # noqa: E402

SAMPLE = ROOT / "flamia_pack" / "data" / "python-stdlib.parquet"
VOCAB = 256  # byte-level tokenizer


def _rate(tokens_per_s: float) -> str:
    """Tokens per second with a unit that keeps three significant digits (a CPU run's ~480 tok/s
    printed as 0.000M)."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g}{unit} tok/s"
    return f"{tokens_per_s:.3g} tok/s"


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------

def rope_tables(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(T, 1, head_dim // 2)`` float32 for per-token positions ``(T,)``."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    ang = position_ids.to(torch.float32)[:, None] * inv[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` by the tables (rotate-half convention); result in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """The model's default attention: ``varlen_attention`` (BF16 kernels on CUDA, the exact torch
    reference on CPU) over the batch's documents, causal, with the batch's prebuilt work list."""
    return varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], causal=True,
                            work_list=batch.get("work_list"))


class Block(nn.Module):
    """Pre-norm transformer block: packed causal attention (varlen) + GELU MLP.

    ``attention(q, k, v, batch) -> o`` (``(T, H, D)`` each) is passed in by :class:`TinyGPT` at every
    call, so a model can be trained with one attention and evaluated through another
    (``examples/train_fp8.py``)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: dict[str, Any],
                attention=packed_attention) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = attention(q.contiguous(), k.contiguous(), v.contiguous(), batch)
        x = x + self.proj(o.reshape(T, -1).to(x.dtype))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT over a flattened packed batch: tokens ``(T,)`` -> logits ``(T, 256)``.

    ``attention``: the blocks' ``(q, k, v, batch) -> o`` (default :func:`packed_attention`); a plain
    attribute, so it can be swapped between calls (train through one kernel, evaluate through another)."""

    def __init__(self, *, d_model: int = 256, num_layers: int = 4, num_heads: int = 4, attention=None) -> None:
        super().__init__()
        self.attention = attention or packed_attention
        self.head_dim = d_model // num_heads
        self.embed = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        ids = batch["input_ids"].reshape(-1)
        rope = rope_tables(batch["position_ids"].reshape(-1), self.head_dim)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, rope, batch, self.attention)
        return F.linear(self.norm(x), self.embed.weight)  # tied output head


# ---------------------------------------------------------------------------------------------
# training loop
# ---------------------------------------------------------------------------------------------
class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` except where the default is None or the help text names the default
    itself (it says what None means, or names it more readably than its value)."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help  # None, or the help text names the default itself
        return super()._get_help_string(action)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cuda' or 'cpu'")
    p.add_argument("--capacity", type=int, default=None, help="tokens per packed row (default 16384 on GPU, 512 on CPU)")
    p.add_argument("--batch-rows", type=int, default=None, help="packed rows per batch (default 4 on GPU, 2 on CPU)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=256, help="model width (embedding size; a multiple of --heads)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = d_model / heads; 64 or 128 on GPU)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (20-step warm-up, cosine decay)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default 4 on GPU, 0 on CPU)")
    p.add_argument("--buffer-docs", type=int, default=256, help="look-ahead buffer of the streaming packer")
    p.add_argument("--packed", type=pathlib.Path, default=None, help="read a `flamia pack` output directory instead of streaming")
    p.add_argument("--source", type=pathlib.Path, default=SAMPLE, help="document source to stream (default: bundled sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init and the data shuffle")
    p.add_argument("--log-every", type=int, default=10, help="log loss and throughput every this many steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps excluded from the throughput figures")
    p.add_argument("--max-seconds", type=float, default=None, help="stop early after this many seconds of training")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the run summary as JSON here")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.heads < 1 or args.d_model < 1 or args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error(f"--d-model {args.d_model} must be a positive multiple of --heads {args.heads} with an even "
                f"head_dim (d_model / heads; 64 or 128 for the GPU kernels)")
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch has no usable CUDA device (torch {torch.__version__}); "
                f"use --device cpu or auto")
    if args.packed is not None and not (args.packed / "manifest.json").is_file():
        p.error(f"--packed {args.packed}: not a `flamia pack` output directory (no manifest.json there)")
    return args


def make_loader(args: argparse.Namespace, cuda: bool):
    if args.packed is not None:
        ds = PackedDataset(args.packed, shuffle=True, seed=args.seed)
        capacity = ds.capacity
        vocab = (getattr(ds.manifest, "tokenizer", None) or {}).get("vocab_size")
        if vocab is not None and int(vocab) > VOCAB:  # token ids would index past the byte embedding
            raise SystemExit(f"--packed {args.packed}: its tokenizer has vocab_size {vocab}, but this example's "
                             f"model is byte-level (vocab {VOCAB}); pack with the default bytes tokenizer")
        pad_id = ds.pad_id  # padding moved to the batch tail holds the dataset's own pad id
        if not 0 <= pad_id < VOCAB:
            raise SystemExit(f"--packed {args.packed}: its pad_id is {pad_id}, outside this example's byte "
                             f"vocabulary (ids 0..{VOCAB - 1}); pack with a pad_id in that range")
    else:
        ds = StreamingPackedDataset(args.source, capacity=args.capacity, buffer_docs=args.buffer_docs,
                                    shuffle=True, seed=args.seed)
        capacity = args.capacity
        pad_id = 0
    loader = torch.utils.data.DataLoader(
        ds, batch_size=args.batch_rows, collate_fn=PackedCollator(pad_id=pad_id, scale_groups=None),
        num_workers=args.workers, pin_memory=cuda, prefetch_factor=4 if args.workers else None,
        persistent_workers=args.workers > 0, drop_last=False,  # persistent workers move to the next epoch themselves
    )
    return ds, loader, capacity


def check_token_ids(cpu_batch: dict[str, Any], where: str) -> None:
    """Exit with one message if the batch holds token ids outside the byte vocabulary ``[0, VOCAB)``.

    One ``aminmax`` over the CPU batch ``input_ids`` (int64 ``(B, capacity)``, pad tail included)
    before the host -> device copy: a few microseconds per batch, instead of an embedding
    ``IndexError`` (CPU) or a device-side assert (CUDA) deep inside the model.

    Raises:
        SystemExit: an id < 0 or >= ``VOCAB``, with the data source named in ``where``.
    """
    lo, hi = (int(v) for v in torch.aminmax(cpu_batch["input_ids"]))
    if lo < 0 or hi >= VOCAB:
        bad = hi if hi >= VOCAB else lo
        raise SystemExit(f"{where}: token id {bad} is outside this example's byte vocabulary (ids 0..{VOCAB - 1}); "
                         "the model is byte-level: use a text source with the default bytes tokenizer, "
                         "not pre-tokenized ids from a larger vocabulary")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training loop; returns the summary (losses per step, tokens/s, data wait)."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.capacity = args.capacity or (16384 if cuda else 512)
    args.batch_rows = args.batch_rows or (4 if cuda else 2)
    args.workers = (4 if cuda else 0) if args.workers is None else args.workers
    torch.manual_seed(args.seed)

    model = TinyGPT(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                            **({"fused": True} if cuda else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    ds, loader, capacity = make_loader(args, cuda)
    where = f"--packed {args.packed}" if args.packed is not None else f"--source {args.source}"
    wl_cfg = work_list_tile_config(kernel_config(model.head_dim, True), True) if cuda else None
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    console.log(f"device {device}, capacity {capacity}, {args.batch_rows} rows/batch, {args.workers} workers, "
                f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
                f"attention {'triton kernels' if cuda else 'torch reference'}")
    if not cuda and capacity > 4096:
        # the CPU reference materialises each document's full (heads, L, L) float32 score matrix
        gib = args.heads * capacity * capacity * 4 / 2 ** 30
        console.log(f"[yellow]warning: rows of {capacity} tokens on the CPU: the torch reference builds each "
                    f"document's full score matrix (up to {gib:.1f} GiB per layer for a row-long document) and "
                    f"runs very slowly; use a GPU or rows of <= 4096 tokens (--capacity, or pack with a smaller "
                    f"--capacity)[/yellow]")

    epoch, it = 0, iter(loader)
    losses: list[torch.Tensor] = []
    loss_values: list[float] = []
    waits, h2ds, step_times, tokens = [], [], [], []
    t_start = t_window = time.perf_counter()
    t_steady = None
    k = min(args.warmup_steps, args.steps - 1)  # steps excluded from the throughput figures
    tok_window = 0
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console, disable=args.no_progress)
    with progress:
        task = progress.add_task("train", total=args.steps, info="")
        for step in range(args.steps):
            t0 = time.perf_counter()
            try:
                cpu_batch = next(it)
            except StopIteration:  # next epoch: a new shuffle (set_epoch reaches non-persistent workers)
                epoch += 1
                ds.set_epoch(epoch)
                it = iter(loader)
                cpu_batch = next(it)
            t1 = time.perf_counter()
            check_token_ids(cpu_batch, where)
            batch = to_device(cpu_batch, device, wl_cfg)
            t2 = time.perf_counter()
            with amp:
                logits = model(batch)
                loss = F.cross_entropy(logits.float(), batch["labels"].reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.detach())
            t3 = time.perf_counter()
            waits.append(t1 - t0)
            h2ds.append(t2 - t1)
            step_times.append(t3 - t0)
            n_tok = int(cpu_batch["num_real_tokens"])
            tokens.append(n_tok)
            tok_window += n_tok
            if step == k - 1:  # end of warm-up (triton compilation, first batches)
                if cuda:
                    torch.cuda.synchronize()
                t_steady = time.perf_counter()
            out_of_time = args.max_seconds is not None and t3 - t_start > args.max_seconds
            last = step == args.steps - 1 or out_of_time
            if (step + 1) % args.log_every == 0 or last:
                vals = torch.stack(losses).float().cpu().tolist()  # one sync per log window
                losses.clear()
                loss_values += vals
                now = time.perf_counter()
                tps = tok_window / (now - t_window)
                w = sum(waits[-len(vals):]) / len(vals)
                info = f"loss {vals[-1]:.3f}  {_rate(tps)}  wait {w * 1e3:.2f} ms/step"
                progress.update(task, info=info)
                if args.no_progress or last or (step + 1) % (args.log_every * 5) == 0:
                    console.log(f"step {step + 1:5d}  {info}  h2d {sum(h2ds[-len(vals):]) / len(vals) * 1e3:.2f} ms")
                t_window, tok_window = now, 0
            progress.advance(task)
            if out_of_time:
                console.log(f"--max-seconds {args.max_seconds} reached after {step + 1} steps")
                break
    if cuda:
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    total = t_end - t_start
    n_steps = len(step_times)
    k = min(k, n_steps - 1)
    steady_time = (t_end - t_steady) if (t_steady is not None and k > 0) else total
    summary = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "attention": "varlen_attention (triton)" if cuda else "varlen_attention (torch reference)",
        "steps": n_steps,
        "capacity": capacity,
        "batch_rows": args.batch_rows,
        "workers": args.workers,
        "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads},
        "losses": loss_values,
        "first_loss": loss_values[0],
        "final_loss": loss_values[-1],
        "tokens": sum(tokens),
        "wall_s": total,
        "tokens_per_s": sum(tokens[k:]) / steady_time if steady_time > 0 else 0.0,
        "step_ms_mean": 1e3 * steady_time / max(n_steps - k, 1),
        "data_wait_ms_mean": 1e3 * sum(waits[k:]) / max(len(waits) - k, 1),
        "data_wait_ms_p50": 1e3 * _pct(waits[k:], 0.5),
        "data_wait_ms_p99": 1e3 * _pct(waits[k:], 0.99),
        "data_wait_ms_max": 1e3 * max(waits[k:], default=0.0),
        "h2d_ms_mean": 1e3 * sum(h2ds[k:]) / max(len(h2ds) - k, 1),
        "warmup_steps_excluded": k,
        "epochs_started": epoch + 1,
    }
    if isinstance(ds, StreamingPackedDataset) and args.workers == 0:
        summary["packer_fill"] = ds.stats["fill"]
    console.log(f"done: {_rate(summary['tokens_per_s'])}, step {summary['step_ms_mean']:.2f} ms, data wait "
                f"mean {summary['data_wait_ms_mean']:.3f} ms (p99 {summary['data_wait_ms_p99']:.3f}, max "
                f"{summary['data_wait_ms_max']:.3f}), loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point: parse ``argv`` and train; returns the summary dict."""
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
