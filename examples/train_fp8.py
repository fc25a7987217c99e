"""Train a byte-level GPT with FP8 attention and compare it with BF16 (issue 29).

One run = one ``--attn`` configuration, trained on packed rows of real text with ONE data order
(``--data-seed``, the same for every run) and evaluated on a held-out set through its OWN attention
and through exact BF16 attention (``precision="bf16"``):

    bf16        varlen_attention(precision="bf16")                    (the baseline; seeds = noise)
    fp8-block   varlen_attention(precision="fp8")                     (32-token document-local exponents)
    fp8-token   varlen_attention(precision="fp8", scale_granularity="token", causal_dq_scale=True)
    fp8-leak    examples/fp8_leak.py: the FP8 kernels fed exponents that read the NEXT token
                (``--leak-mode next-floor``: token i takes token i+1's floor-rule exponent, so its
                clipping level depends on the token it predicts; experiment only, warns); also
                evaluated through its causal twin (``prev-floor``: the previous token's exponent,
                the same clipping statistics, no future)

Why the exact evaluation (seed 001 §8): a kernel whose scale selection reads the future lets the
model learn from the future, so it looks *better* through its own kernel and worse under exact
attention. A single-call cosine does not show that (``python examples/fp8_leak.py``).

The model is ``examples/train_tiny_gpt.py``'s TinyGPT (pre-norm, RoPE from the batch's
``position_ids``, tied byte embedding) with its attention swapped. Data: the bundled Python-stdlib
sample (8.6 M bytes, 392 files; every ``--val-every-nth-doc``-th file is held out), byte tokens,
packed on the fly by ``StreamingPackedDataset`` into rows of ``--capacity`` tokens (documents longer
than a row are split). 2,000 steps of one 8,192-token row read ~2 epochs of the training split.

Resumable: ``--out DIR`` holds ``ckpt.pt`` (model, optimizer, LR schedule, RNG states, loader
position), ``log.jsonl`` (one record per step and per evaluation) and ``summary.json``. Running the
same command again continues from the checkpoint; ``--max-minutes`` stops cleanly (checkpoint
written) before the limit, so a time-limited device call loses no work. Straight and resumed runs
give the same losses (bitwise on the CPU; tested).

Run::

    python examples/train_fp8.py --attn bf16 --out out/fp8-train/bf16-s0            # GPU
    python examples/train_fp8.py --attn fp8-leak --out out/fp8-train/leak --max-minutes 4
    python examples/train_fp8.py --estimate                                         # FLOPs / time
    python benchmarks/plot_fp8_training.py out/fp8-train/*                          # the plot
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Optional

T_START = time.monotonic()  # --max-minutes counts from here (imports included)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import fp8_leak  # noqa: E402
import train_tiny_gpt as tiny  # noqa: E402
from flamia_pack.errors import FlamiaError  # noqa: E402
from flamia_pack.kernels.attention import varlen_attention  # noqa: E402
from flamia_pack.kernels.config import kernel_config, work_list_tile_config  # noqa: E402
from flamia_pack.loaders import PackedCollator, StreamingPackedDataset, open_source, to_device  # noqa: E402

ATTNS = ("bf16", "fp8-block", "fp8-token", "fp8-leak")
SAMPLE = tiny.SAMPLE
VOCAB = tiny.VOCAB
H200_BF16_PEAK = 989e12  # dense BF16 tensor-core FLOP/s of an H200 SXM (no sparsity)
CKPT, LOG, SUMMARY = "ckpt.pt", "log.jsonl", "summary.json"
#: the longest packed row and the most tokens a step this example takes (the model is small: more is a typo)
MAX_CAPACITY, MAX_STEP_TOKENS = 1 << 20, 1 << 24
# settings that change the trajectory: a resume with any other value is refused
TRAJECTORY = ("attn", "seed", "data_seed", "steps", "layers", "d_model", "heads", "capacity", "batch_rows", "lr",
              "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "source", "val_every_nth_doc",
              "val_rows", "buffer_docs", "leak_mode", "row_order")


# ---------------------------------------------------------------------------------------------
# attention configurations
# ---------------------------------------------------------------------------------------------


def make_attention(kind: str, *, leak_mode: str = "next-floor", prebuilt: bool = True) -> Callable:
    """``(q, k, v, batch) -> o`` for one configuration. ``kind``: one of :data:`ATTNS`, ``"exact"``
    (= bf16, for evaluation) or ``"leak-control"`` (the leak's causal twin, mode ``"prev"``).
    ``prebuilt``: use the batch's prebuilt work lists (training); evaluation builds its own."""

    def wl(batch, key):
        return batch.get(key) if prebuilt else None

    if kind in ("bf16", "exact"):
        def attn(q, k, v, batch):
            return varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], causal=True,
                                    work_list=wl(batch, "work_list"))
    elif kind in ("fp8-block", "fp8-token"):
        gran = kind.split("-")[1]

        def attn(q, k, v, batch):
            return varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], causal=True, precision="fp8",
                                    scale_granularity=gran, causal_dq_scale=gran == "token",
                                    work_list=wl(batch, "fp8_work_list"))
    elif kind == "leak-control" and leak_mode not in fp8_leak.CONTROL:  # no twin: the causal per-token FP8
        return make_attention("fp8-token", prebuilt=prebuilt)
    elif kind in ("fp8-leak", "leak-control"):
        mode = leak_mode if kind == "fp8-leak" else fp8_leak.CONTROL[leak_mode]

        def attn(q, k, v, batch):
            return fp8_leak.leaky_varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], mode=mode,
                                                   work_list=wl(batch, "fp8_work_list"))
    else:
        raise ValueError(f"unknown attention {kind!r}")
    attn.__name__ = kind
    return attn


def eval_kinds(attn: str) -> dict[str, str]:
    """Evaluation name -> attention kind: ``own`` and ``exact`` for every run (the same kernel for
    bf16), and ``control`` for fp8-leak (its causal twin ``fp8_leak.CONTROL``, else fp8-token)."""
    kinds = {"own": attn, "exact": "exact"}
    if attn == "fp8-leak":
        kinds["control"] = "leak-control"
    return kinds


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def load_split(source: pathlib.Path, every: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Byte-tokenized documents of ``source``: (train, val); document ``i`` is held out iff
    ``i % every == 0``."""
    try:
        docs = [np.asarray(d, dtype=np.int32) for d in open_source(str(source))]
    except FlamiaError as exc:  # a source this script cannot read as text files: say why, no traceback
        raise SystemExit(f"error: --source {source}: {exc}; train_fp8.py reads plain-text files or a 'text' "
                         "column (it has no --text-column option; the default is the bundled sample)") from None
    train = [d for i, d in enumerate(docs) if i % every]
    val = [d for i, d in enumerate(docs) if i % every == 0]
    return train, val


def val_rows(docs: list[np.ndarray], capacity: int, n: int, buffer_docs: int) -> list[dict]:
    """The first ``n`` rows packed from the held-out documents, shuffled by a fixed seed (the same
    for every run and ``--data-seed``), so the rows mix the held-out files."""
    out = []
    for row in StreamingPackedDataset(docs, capacity=capacity, buffer_docs=buffer_docs, shuffle=True, seed=1234):
        out.append(row)
        if len(out) == n:
            break
    return out


class Rows:
    """Training rows: the streaming packer over the training split, epoch after epoch, with its
    exact position as :meth:`state_dict`.

    ``row_order="shuffle"`` (the default): each epoch's rows are packed first (the packer's own
    seeded order) and then served in a seeded permutation (``default_rng((data_seed, epoch))``), the
    map-style sampler of most training loops. Why: the streaming order serves a long document's
    row-sized pieces back to back (the sample's 757 KB ``pydoc_data/topics.py`` fills 92 consecutive
    steps) and the short documents' rows at each epoch's end, so the validation loss at any step
    depends on which of those phases just ran (benchmarks/NOTES.md, "FP8 training protocol").
    ``"stream"``: the packer's order as it comes (the protocol of the runs before 2026-12-03)."""

    def __init__(self, docs, args) -> None:
        self.ds = StreamingPackedDataset(docs, capacity=args.capacity, buffer_docs=args.buffer_docs,
                                         seed=args.data_seed, shuffle=True)
        self.order = args.row_order
        self.data_seed = args.data_seed
        self.it = None
        self.epoch, self.pos, self.rows = 0, 0, None

    def _epoch_rows(self) -> list[dict]:
        self.ds.set_epoch(self.epoch)
        rows = list(self.ds)  # not empty: train() refuses a training split without tokens
        perm = np.random.default_rng((self.data_seed, self.epoch)).permutation(len(rows))
        return [rows[i] for i in perm]

    def next(self) -> dict:
        if self.order == "shuffle":
            if self.rows is None:
                self.rows = self._epoch_rows()
            if self.pos == len(self.rows):
                self.epoch, self.pos = self.epoch + 1, 0
                self.rows = self._epoch_rows()
            self.pos += 1
            return self.rows[self.pos - 1]
        if self.it is None:
            self.it = iter(self.ds)
        try:
            return next(self.it)
        except StopIteration:  # the dataset moved itself to the next epoch (new shuffle)
            self.it = iter(self.ds)
            try:
                return next(self.it)
            except StopIteration:
                raise SystemExit("error: the training split holds no documents (the source is too small, or "
                                 "--val-every-nth-doc sends all of it to validation)") from None

    def state_dict(self) -> dict:
        if self.order == "shuffle":
            return {"row_order": "shuffle", "epoch": self.epoch, "pos": self.pos}
        return self.ds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.order == "shuffle":
            self.epoch, self.pos, self.rows = int(state["epoch"]), int(state["pos"]), None
            return
        self.ds.load_state_dict(state)
        self.it = None


def prepare(rows: list[dict], device: torch.device, attn: str, head_dim: int, fp8_gpu: bool) -> tuple[dict, dict]:
    """Collate rows into one batch (host) and copy it to ``device`` with the work list its attention
    reads (``work_list`` for BF16, ``fp8_work_list`` for the FP8 kernels)."""
    cpu_batch = PackedCollator(pad_id=0)(rows)
    tiny.check_token_ids(cpu_batch, "the training data")
    cuda = device.type == "cuda"
    wl_cfg = work_list_tile_config(kernel_config(head_dim, True), True) if cuda and attn == "bf16" else None
    batch = to_device(cpu_batch, device, wl_cfg)
    if fp8_gpu:
        from flamia_pack.kernels.fp8_attention import build_fp8_work_list

        batch["fp8_work_list"] = build_fp8_work_list(batch["cu_seqlens"], int(batch["input_ids"].numel()),
                                                     causal=True, validate=False)
    return cpu_batch, batch


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=tiny._DefaultsFormatter)
    p.add_argument("--attn", default="bf16", help=f"attention: {', '.join(ATTNS)}")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="run directory (checkpoint, log.jsonl, summary.json); re-running resumes from it")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model initialisation")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data order (keep it the same for every run)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop cleanly, checkpoint written, before this many minutes since start (default: no limit)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop cleanly (checkpoint written) once this many steps are done (default: --steps)")
    p.add_argument("--eval-every", type=int, default=250, help="evaluate every this many steps (and at the end)")
    p.add_argument("--log-every", type=int, default=10, help="flush per-step records (one host sync) this often")
    p.add_argument("--ckpt-every", type=int, default=500, help="also checkpoint every this many steps")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=512, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = d_model / heads; 128 for the "
                   "GPU FP8 kernels)")
    p.add_argument("--capacity", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--batch-rows", type=int, default=1, help="packed rows per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at this fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--source", type=pathlib.Path, default=SAMPLE, help="text source (default: the bundled sample)")
    p.add_argument("--val-every-nth-doc", type=int, default=20, help="hold out every n-th document for validation")
    p.add_argument("--val-rows", type=int, default=32, help="validation rows (of --capacity tokens)")
    p.add_argument("--buffer-docs", type=int, default=256, help="look-ahead buffer of the streaming packer")
    p.add_argument("--row-order", default="shuffle", choices=("shuffle", "stream"),
                   help="training rows: each epoch packed, then served in a seeded permutation ('shuffle'), or in "
                        "the streaming packer's order ('stream': a long document's pieces back to back; the "
                        "protocol of the runs before 2026-12-03)")
    p.add_argument("--leak-mode", default=None,
                   help=f"fp8-leak only: {', '.join(fp8_leak.LEAK_MODES)} (default next-floor)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cuda' or 'cpu'")
    p.add_argument("--estimate", action="store_true", help="print FLOPs per step and the H200 time estimate, then exit")
    p.add_argument("--quiet", action="store_true", help="print nothing while training (the log has it all)")
    p.add_argument("--verbose", action="store_true", help="print every --log-every window, not only at evaluations")
    p.add_argument("--grad-probe", action="store_true",
                   help="diagnostic: every step also computes the same batch's gradient through exact BF16 attention "
                        "(same weights; the update still uses the run's own) and logs its norm, its loss and the "
                        "cosine between the two gradients (about doubles the step time)")
    p.add_argument("--probe-capture-ratio", type=float, default=3.0,
                   help="with --grad-probe: on a step whose gradient norm exceeds this many times the exact one, "
                        "compare each layer's attention gradients (own vs exact, on the step's recorded q, k, v, "
                        "dO), log them and save the worst layer's inputs to --out/spike-step<N>.pt (first 3 steps)")
    args = p.parse_args(argv)
    if args.attn not in ATTNS:
        p.error(f"--attn must be one of {', '.join(ATTNS)}, got {args.attn!r}")
    if args.leak_mode is not None and args.attn != "fp8-leak":
        p.error(f"--leak-mode applies to --attn fp8-leak only (got --attn {args.attn}); leave it out")
    args.leak_mode = "next-floor" if args.leak_mode is None else args.leak_mode  # recorded for every run
    if args.leak_mode not in fp8_leak.LEAK_MODES:
        p.error(f"--leak-mode must be one of {', '.join(fp8_leak.LEAK_MODES)}, got {args.leak_mode!r}")
    if args.stop_at is not None and args.stop_at < 1:
        p.error(f"--stop-at must be >= 1, got {args.stop_at}")
    for name in ("steps", "eval_every", "log_every", "ckpt_every", "layers", "batch_rows", "val_rows",
                 "buffer_docs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.val_every_nth_doc < 2:
        p.error(f"--val-every-nth-doc must be >= 2, got {args.val_every_nth_doc}")
    if not 32 <= args.capacity <= MAX_CAPACITY:
        p.error(f"--capacity must be in [32, {MAX_CAPACITY:,}] tokens per row, got {args.capacity:,}")
    if args.capacity * args.batch_rows > MAX_STEP_TOKENS:
        p.error(f"--capacity x --batch-rows must be at most {MAX_STEP_TOKENS:,} tokens a step, got "
                f"{args.capacity:,} x {args.batch_rows:,}")
    if (args.warmup_steps < 0 or not 0 <= args.min_lr_ratio <= 1 or not 0 < args.lr < math.inf
            or not 0 < args.grad_clip < math.inf or not 0 <= args.weight_decay < math.inf):
        p.error("--lr and --grad-clip must be finite and > 0, --weight-decay finite and >= 0, --warmup-steps >= 0 "
                "and --min-lr-ratio in [0, 1]")
    if args.seed < 0 or args.data_seed < 0:
        p.error(f"--seed and --data-seed must be >= 0, got {args.seed} and {args.data_seed}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        p.error(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.heads < 1 or args.d_model < 1 or args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error(f"--d-model {args.d_model} must be a positive multiple of --heads {args.heads} with an even head_dim")
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch has no usable CUDA device; use --device cpu")
    head_dim = args.d_model // args.heads
    if args.attn != "bf16":
        if args.device.startswith("cuda"):
            from flamia_pack.kernels.fp8_attention import fp8_kernels_available

            if head_dim not in (64, 128):
                p.error(f"--attn {args.attn} on the GPU needs head_dim 64 or 128 (--d-model / --heads), got {head_dim}")
            if not fp8_kernels_available(args.device):
                p.error(f"--attn {args.attn}: the FP8 kernels need a Hopper (sm_90) GPU with triton's Gluon")
        elif head_dim not in (64, 128):
            p.error(f"--attn {args.attn} (the CPU FP8 emulation) needs head_dim 64 or 128, got {head_dim}")
    elif args.device.startswith("cuda") and head_dim not in (64, 128):
        p.error(f"--attn bf16 on the GPU needs head_dim 64 or 128, got {head_dim}")
    if not args.source.exists():
        p.error(f"--source {args.source}: not found")
    if args.out is None and not args.estimate:
        p.error("--out DIR is required (the run directory)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file; it must be a run directory (new or one to resume)")
    if args.out is not None and any(x.exists() and not x.is_dir() for x in args.out.parents):
        p.error(f"--out {args.out}: a parent of it is a file")
    if (args.out is not None and not args.estimate and args.out.is_dir() and not (args.out / CKPT).exists()
            and any((args.out / n).exists() for n in (LOG, SUMMARY, LOG + ".gz"))):
        p.error(f"--out {args.out} holds a run's log or summary but no {CKPT} to resume from; it would be "
                "overwritten: use another --out (or move the directory away)")
    if args.out is not None and not args.estimate and args.out.is_dir() and not (args.out / CKPT).exists():
        tmp = pathlib.Path(CKPT).with_suffix(".tmp").name  # the checkpoint save's temporary (an interrupted first save)
        other = [x.name for x in args.out.iterdir() if not (x.name.startswith("spike-step") or x.name == tmp)]
        if other:
            p.error(f"--out {args.out} is a directory of other files ({', '.join(sorted(other)[:3])}"
                    f"{', ...' if len(other) > 3 else ''}), not a run to resume: give a new or empty directory")
    return args


def _config(args: argparse.Namespace) -> dict[str, Any]:
    d = {k: getattr(args, k) for k in TRAJECTORY}
    d["source"] = str(pathlib.Path(d["source"]).resolve().name)  # the file, not the machine's path
    return d


def _commit() -> str:
    env = os.environ.get("FLAMIA_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def step_flops(args: argparse.Namespace, cu_list: list[list[int]]) -> dict[str, float]:
    """Training FLOPs of one step (2 per multiply-add): 6 x (matmul params) x tokens for the
    projections, MLP and tied head, and 14 x head_dim x visible causal pairs per head and layer for
    attention (forward QK^T + PV = 4 D pairs, backward 2.5x that). ``cu_list``: each step's rows'
    ``cu_seqlens`` (the mean is taken)."""
    d, L = args.d_model, args.layers
    matmul_params = L * 12 * d * d + VOCAB * d
    tokens = pairs = 0.0
    for cu in cu_list:
        n = np.diff(np.asarray(cu, dtype=np.float64))
        tokens += n.sum()
        pairs += (n * (n + 1) / 2).sum()
    tokens, pairs = tokens / len(cu_list), pairs / len(cu_list)
    lin = 6 * matmul_params * tokens
    att = 14 * args.heads * (d // args.heads) * pairs * L
    return {"tokens": tokens, "pairs_per_head": pairs, "linear": lin, "attention": att, "total": lin + att}


def estimate(args: argparse.Namespace) -> dict[str, Any]:
    train, _ = load_split(args.source, args.val_every_nth_doc)
    rows = Rows(train, args)
    cus = []
    for _ in range(64):
        b = PackedCollator(pad_id=0)([rows.next() for _ in range(args.batch_rows)])
        cus.append(b["cu_seqlens"].tolist())
    f = step_flops(args, cus)
    n_train = sum(len(d) for d in train)
    out = {"flops_per_step": f, "train_tokens": n_train,
           "epochs": args.steps * f["tokens"] / n_train,
           "seconds_at_mfu": {str(m): args.steps * f["total"] / (m * H200_BF16_PEAK) for m in (0.1, 0.2, 0.3, 0.4)}}
    print(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


class Log:
    """``log.jsonl``: appended, flushed per write; on resume the records after the checkpoint's step
    (written before a hard stop) are dropped."""

    def __init__(self, path: pathlib.Path, keep_until: Optional[int]) -> None:
        self.path = path
        if keep_until is None:
            path.write_text("")
        elif path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            try:
                json.loads(lines[-1]) if lines else None
            except json.JSONDecodeError:  # a hard kill mid-write leaves a partial last line: drop it
                lines = lines[:-1]
            try:
                kept = [ln for ln in lines if int(json.loads(ln).get("step", 0)) <= keep_until]
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
                raise SystemExit(f"error: {path} is not a train_fp8 log ({exc}); move it away to resume "
                                 "(the checkpoint is intact)") from None
            path.write_text("".join(ln + "\n" for ln in kept))
        self.fh = path.open("a")

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()

    def records(self) -> list[dict]:
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def lr_lambda(args: argparse.Namespace) -> Callable[[int], float]:
    def f(s: int) -> float:
        if s < args.warmup_steps:
            return (s + 1) / args.warmup_steps
        t = min(1.0, (s - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


@torch.no_grad()
def evaluate(model, rows: list[dict], device, kinds: dict[str, str], args, fp8_gpu: bool) -> dict[str, float]:
    """Token-weighted mean cross-entropy of the validation rows through each attention of ``kinds``."""
    was = model.training
    model.eval()
    own = model.attention
    out = {}
    cuda = device.type == "cuda"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp8_leak.LeakWarning)  # warned once at start
            for name, kind in kinds.items():
                if name == "exact" and args.attn == "bf16":
                    out[name] = out["own"]
                    continue
                model.attention = make_attention(kind, leak_mode=args.leak_mode, prebuilt=False)
                tot = torch.zeros((), dtype=torch.float64, device=device)
                n = 0
                for row in rows:
                    _, batch = prepare([row], device, "eval", model.head_dim, False)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                        logits = model(batch)
                    lab = batch["labels"].reshape(-1)
                    tot += F.cross_entropy(logits.float(), lab, ignore_index=-100, reduction="sum").double()
                    n += int((batch["labels"] != -100).sum())
                out[name] = float(tot) / max(n, 1)
    finally:
        model.attention = own
        model.train(was)
    return out


def _rng_state(device) -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict, device) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def _save(path: pathlib.Path, obj: dict) -> float:
    t = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - t


def _spikes(norms: list[float], warmup: int, window: int = 100, factor: float = 3.0) -> list[int]:
    """Steps (1-based) after warm-up whose gradient norm exceeds ``factor`` x the median of the
    previous ``window`` steps."""
    out = []
    for i in range(max(warmup, 10), len(norms)):
        prev = norms[max(0, i - window):i]
        if prev and norms[i] > factor * float(np.median(prev)):
            out.append(i + 1)
    return out


def summarize(args, log: Log, flops: Optional[dict], complete: bool, device) -> dict:
    recs = log.records()
    tr = [r for r in recs if r["type"] == "train"]
    ev = [r for r in recs if r["type"] == "eval"]
    norms = [r["grad_norm"] for r in tr]
    losses = [r["loss"] for r in tr]
    tps = [r["tok_s"] for r in tr[args.log_every * 2:] if r.get("tok_s")]  # steady state: skip the first windows
    s = {
        "attn": args.attn, "seed": args.seed, "data_seed": args.data_seed, "leak_mode": args.leak_mode
        if args.attn == "fp8-leak" else None,
        "complete": complete, "steps_done": tr[-1]["step"] if tr else 0, "steps": args.steps,
        "commit": _commit(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "command": "python examples/train_fp8.py " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(
            "train_fp8.py") else None,
        "final_train_loss": losses[-1] if losses else None,
        "final_train_loss_mean100": float(np.mean(losses[-100:])) if losses else None,
        "final_val": ev[-1]["val_loss"] if ev else None,
        "val_step": ev[-1]["step"] if ev else None,
        "grad_norm_max": max(norms) if norms else None,
        "grad_norm_p99": float(np.percentile(norms, 99)) if norms else None,
        "grad_norm_spikes": _spikes(norms, args.warmup_steps),
        "tokens_per_s": float(np.median(tps)) if tps else None,
        "train_seconds": sum(r.get("step_ms", 0) for r in tr) / 1e3,
        "flops_per_step": flops,
    }
    pr = [r for r in tr if "grad_norm_exact" in r]
    if pr:  # --grad-probe: the run's gradient against exact attention's on the same weights and batch
        by_step = {r["step"]: r for r in pr}
        cos = [r["grad_cos_exact"] for r in pr]
        s["grad_probe"] = {
            "steps": len(pr), "cos_median": float(np.median(cos)), "cos_p01": float(np.percentile(cos, 1)),
            "norm_ratio_median": float(np.median([r["grad_norm"] / max(r["grad_norm_exact"], 1e-30) for r in pr])),
            "at_spikes": [{"step": st, "grad_norm": by_step[st]["grad_norm"],
                           "grad_norm_exact": by_step[st]["grad_norm_exact"], "cos": by_step[st]["grad_cos_exact"]}
                          for st in s["grad_norm_spikes"] if st in by_step],
            "exact_spikes": _spikes([r["grad_norm_exact"] for r in pr], args.warmup_steps),
        }
    if flops and s["tokens_per_s"]:
        s["mfu_h200_bf16"] = s["tokens_per_s"] * flops["total"] / flops["tokens"] / H200_BF16_PEAK
    (args.out / SUMMARY).write_text(json.dumps(s, indent=1))
    return s


class AttentionRecorder:
    """``--grad-probe``: the model's attention, recording each call's ``q, k, v`` (references, detached) and,
    through a hook on the output, its ``dO``, so a spiking step's attention gradients can be replayed
    layer by layer (:func:`capture_spike`). ``calls`` holds the current step's records."""

    def __init__(self, attn: Callable) -> None:
        self.attn = attn
        self.calls: list[dict] = []

    def __call__(self, q, k, v, batch):
        o = self.attn(q, k, v, batch)
        rec = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
        if o.requires_grad:
            o.register_hook(lambda g, rec=rec: rec.__setitem__("do", g.detach()))
        self.calls.append(rec)
        return o


def _attn_grads(fn: Callable, rec: dict, batch: dict) -> list[torch.Tensor]:
    x = [rec[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
    o = fn(*x, batch)
    return list(torch.autograd.grad(o, x, rec["do"].to(o.dtype)))


def capture_spike(recorder: AttentionRecorder, batch: dict, args, step: int, log) -> dict:
    """One spiking step of ``--grad-probe``: each layer's attention gradients through the run's own attention
    and through exact BF16 attention on the step's recorded ``q, k, v, dO``: cosines and norm ratios per
    layer (logged as a ``"spike"`` record); the worst layer's inputs saved to ``--out/spike-step<N>.pt``
    (``q, k, v, do, cu_seqlens, max_seqlen``, the run's ``attn``) for a replay through the CPU emulation."""
    exact = make_attention("exact", prebuilt=False)
    layers = []
    for i, rec in enumerate(recorder.calls):
        if "do" not in rec:
            continue
        own, ex = _attn_grads(recorder.attn, rec, batch), _attn_grads(exact, rec, batch)
        cos = [float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)) for a, b in zip(own, ex)]
        ratio = [float(a.double().norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(own, ex)]
        layers.append({"layer": i, "cos_dq": cos[0], "cos_dk": cos[1], "cos_dv": cos[2],
                       "norm_ratio_dq": ratio[0], "norm_ratio_dk": ratio[1], "norm_ratio_dv": ratio[2]})
    worst = min(layers, key=lambda d: min(d["cos_dq"], d["cos_dk"], d["cos_dv"])) if layers else None
    rec = {"type": "spike", "step": step, "layers": layers}
    if worst is not None:
        r = recorder.calls[worst["layer"]]
        path = args.out / f"spike-step{step}.pt"
        torch.save({"step": step, "layer": worst["layer"], "attn": args.attn, "cu_seqlens": batch["cu_seqlens"].cpu(),
                    "max_seqlen": int(batch["max_seqlen"]), **{n: r[n].cpu() for n in ("q", "k", "v", "do")}}, path)
        rec["file"] = path.name
    log.write(rec)
    return rec


def grad_probe(model, batch, grads: list, cuda: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``--grad-probe`` of one step: ``(loss, grad norm, cosine to grads)`` of the same batch and weights
    through exact BF16 attention, as device scalars (no sync). ``grads``: the run's own gradients (before
    clipping), restored into ``.grad`` afterwards, so the step's update is unchanged. Tells a gradient
    spike of the kernel (the exact gradient is small there) from one of the trajectory (large as well)."""
    params = [p for p in model.parameters() if p.requires_grad]
    own_attn = model.attention
    model.attention = make_attention("exact", prebuilt=False)
    try:
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(batch)
        loss = F.cross_entropy(logits.float(), batch["labels"].reshape(-1), ignore_index=-100)
        loss.backward()
        ge = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    finally:
        model.attention = own_attn
    dot = sum((a.float() * b.float()).sum() for a, b in zip(grads, ge))
    n_own = torch.sqrt(sum(a.float().square().sum() for a in grads))
    n_ex = torch.sqrt(sum(b.float().square().sum() for b in ge))
    for p, g in zip(params, grads):
        p.grad = g
    return loss.detach(), n_ex, dot / (n_own * n_ex).clamp_min(1e-30)


def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    fp8_gpu = cuda and args.attn != "bf16"
    if args.attn == "fp8-leak":
        fp8_leak.warn_leak(args.leak_mode)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"error: --out {args.out} cannot be created ({exc.strerror or exc})") from None
    ckpt_path = args.out / CKPT
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path.exists() else None
        if ckpt is not None and not (isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict)
                                     and all(k in ckpt for k in ("model", "opt", "sched", "data", "rng", "step"))):
            raise ValueError("not a train_fp8 checkpoint (a dict with config, model, opt, sched, data, rng, step)")
    except Exception as exc:  # a damaged or foreign file: say so, lose nothing
        raise SystemExit(f"error: {ckpt_path} cannot be read as a checkpoint ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); move it away to start over, "
                         "or use another --out") from None
    if ckpt is not None:  # checkpoints from before --row-order existed were written in the streaming order
        ckpt["config"].setdefault("row_order", "stream")
    if ckpt is not None and ckpt["config"] != _config(args):
        diff = {k: (ckpt["config"].get(k), v) for k, v in _config(args).items() if ckpt["config"].get(k) != v}
        raise SystemExit(f"error: --out {args.out} holds a run with other settings (checkpoint vs now: {diff}); "
                         "use another --out, or the same settings to resume")

    torch.manual_seed(args.seed)
    model = tiny.TinyGPT(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                         attention=make_attention(args.attn, leak_mode=args.leak_mode)).to(device)
    recorder = AttentionRecorder(model.attention) if args.grad_probe else None
    if recorder is not None:
        model.attention = recorder
    spikes_saved = 0
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                            **({"fused": True} if cuda else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    train_docs, val_docs = load_split(args.source, args.val_every_nth_doc)
    rows = Rows(train_docs, args)
    vrows = val_rows(val_docs, args.capacity, args.val_rows, args.buffer_docs)
    kinds = eval_kinds(args.attn)
    split = [len(train_docs), int(sum(len(d) for d in train_docs)), len(val_docs)]  # docs, tokens, val docs
    if split[1] == 0 or not vrows:
        raise SystemExit(f"error: --source {args.source}: the training split holds {split[0]} documents "
                         f"({split[1]} tokens) and the validation split {len(vrows)} rows "
                         f"(every {args.val_every_nth_doc}-th document); both need tokens (a larger source, or "
                         "another --val-every-nth-doc)")
    step, flops = 0, None
    if ckpt is not None and ckpt.get("split", split) != split:  # the config names the source file only
        raise SystemExit(f"error: --source {args.source} is not the data the checkpoint in {args.out} was trained on "
                         f"(train docs / tokens / val docs: checkpoint {ckpt['split']}, now {split}); use the same "
                         "source, or another --out")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        rows.load_state_dict(ckpt["data"])
        _set_rng_state(ckpt["rng"], device)
        step, flops = ckpt["step"], ckpt.get("flops")
    log = Log(args.out / LOG, step if ckpt is not None else None)
    log.write({"type": "start", "step": step, "resumed": ckpt is not None, "commit": _commit(),
               "argv": sys.argv[1:], "config": _config(args), "device": str(device),
               "params": sum(p.numel() for p in model.parameters()), "val_rows": len(vrows),
               "val_tokens": int(sum(int(r["num_tokens"]) for r in vrows)),
               "train_docs": split[0], "train_tokens": split[1]})

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{args.attn} s{args.seed}] {msg}", flush=True)

    def run_eval(at: int) -> float:
        t = time.perf_counter()
        res = evaluate(model, vrows, device, kinds, args, fp8_gpu)
        dt = time.perf_counter() - t
        log.write({"type": "eval", "step": at, "val_loss": res, "eval_s": dt})
        say(f"step {at}: val " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()) + f" ({dt:.1f} s)")
        return dt

    def checkpoint() -> float:
        return _save(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                 "data": rows.state_dict(), "rng": _rng_state(device), "step": step,
                                 "config": _config(args), "flops": flops, "split": split})

    eval_s = run_eval(0) if step == 0 else 3.0
    ckpt_s, step_s = 3.0, None
    deadline = None if args.max_minutes is None else T_START + 60 * args.max_minutes
    pending: list[tuple] = []  # (step, loss, grad_norm, lr, tokens, cu) awaiting one sync
    t_win = time.perf_counter()
    cus: list[list[int]] = []
    stop_reason = "done" if step >= args.steps else None
    diverged = False

    def write_pending():
        """The pending steps' records (one sync); returns ``(their values, tokens, seconds, diverged)``."""
        vals = torch.stack([torch.stack([p[1].float(), p[2].float(), *(p[6] if p[6] else [p[1]] * 3)])
                            for p in pending]).float().cpu().tolist()
        dt = time.perf_counter() - t_win
        ntok = sum(p[4] for p in pending)
        bad = False
        for (s, _, _, lr_s, tok, ndocs, pr), (lv, gv, le, ge, gc) in zip(pending, vals):
            rec = {"type": "train", "step": s, "loss": lv, "grad_norm": gv, "lr": lr_s, "tokens": tok,
                   "docs": ndocs, "tok_s": ntok / dt, "step_ms": 1e3 * dt / len(pending)}
            if pr is not None:
                rec.update(loss_exact=le, grad_norm_exact=ge, grad_cos_exact=gc)
            log.write(rec)
            bad = bad or not (math.isfinite(lv) and math.isfinite(gv))
        return vals, ntok, dt, bad

    while step < args.steps:
        if args.stop_at is not None and step >= args.stop_at:
            stop_reason = "stop-at"
            break
        if deadline is not None:
            nxt = step + 1
            need = 2 * (step_s or 1.0) + ckpt_s + 5.0 + (eval_s if (nxt % args.eval_every == 0 or nxt == args.steps)
                                                        else 0.0)
            if time.monotonic() + need > deadline:
                stop_reason = "max-minutes"
                break
        cpu_batch, batch = prepare([rows.next() for _ in range(args.batch_rows)], device, args.attn,
                                   model.head_dim, fp8_gpu)
        if recorder is not None:
            recorder.calls.clear()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                logits = model(batch)
            loss = F.cross_entropy(logits.float(), batch["labels"].reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except FlamiaError as exc:  # the attention refuses NaN / Inf q, k, v or gradients: the run diverged
            say(f"step {step + 1}: diverged ({str(exc).splitlines()[0][:200]})")
            log.write({"type": "error", "step": step + 1, "message": str(exc)[:500]})
            stop_reason = "diverged"
            break
        probe = None
        if args.grad_probe:
            own = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters() if p.requires_grad]
            probe = grad_probe(model, batch, own, cuda)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if probe is not None and spikes_saved < 3 and float(gn) > args.probe_capture_ratio * float(probe[1]):
            rec = capture_spike(recorder, batch, args, step + 1, log)
            spikes_saved += 1
            say(f"step {step + 1}: grad norm {float(gn):.3f} vs exact {float(probe[1]):.3f}; per layer min cos "
                + ", ".join(f"{d['layer']}: {min(d['cos_dq'], d['cos_dk'], d['cos_dv']):.4f}" for d in rec["layers"]))
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        step += 1
        cu = cpu_batch["cu_seqlens"].tolist()
        if len(cus) < 64:
            cus.append(cu)
        pending.append((step, loss.detach(), gn.detach(), lr, int(cpu_batch["num_real_tokens"]), len(cu) - 1, probe))
        is_eval = step % args.eval_every == 0 or step == args.steps
        if len(pending) >= args.log_every or is_eval or step % args.ckpt_every == 0 or step == args.steps:
            vals, ntok, dt, bad = write_pending()
            diverged = diverged or bad
            step_s = dt / len(pending) if step_s is None else 0.7 * step_s + 0.3 * dt / len(pending)
            if flops is None and len(cus) >= min(16, args.steps):
                flops = step_flops(args, cus)
            if is_eval or args.verbose:
                say(f"step {step}: loss {vals[-1][0]:.4f}, grad norm {vals[-1][1]:.3f}, {ntok / dt / 1e3:.1f}k tok/s")
            pending.clear()
            if diverged:
                stop_reason = "diverged"
                break
            if is_eval:
                eval_s = run_eval(step)
            if step % args.ckpt_every == 0 and step < args.steps:
                ckpt_s = checkpoint()
            t_win = time.perf_counter()
    if stop_reason is None:
        stop_reason = "done"
    if pending:  # stopped inside a log window (--stop-at, --max-minutes): its steps' records first
        write_pending()
        pending.clear()
    if flops is None and cus:
        flops = step_flops(args, cus)
    ckpt_s = checkpoint()
    log.write({"type": "stop", "step": step, "reason": stop_reason, "checkpoint_s": ckpt_s})
    say(f"stopped at step {step}/{args.steps} ({stop_reason})")
    s = summarize(args, log, flops, step >= args.steps, device)
    s["stop_reason"] = stop_reason
    return s


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.estimate:
        return estimate(args)
    return train(args)


if __name__ == "__main__":
    main()
