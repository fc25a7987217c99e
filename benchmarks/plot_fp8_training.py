"""Plot FP8-vs-BF16 training runs of ``examples/train_fp8.py`` from their ``log.jsonl`` (issue 29).

Reads each run directory's ``log.jsonl`` (CPU only, no torch) and writes one PNG with three panels:
training loss (smoothed), validation loss through the run's own attention (solid) and through
exact BF16 attention (dashed; the leak's causal control dotted), and the gradient norm. Also
prints a table of the final numbers (markdown with ``--markdown``, then the per-mode parity table of
:func:`parity`: mean, sd and difference to BF16 over each mode's runs; the seed-paired one of :func:`paired`;
the spike comparison of :func:`spike_overlap`).

    python benchmarks/plot_fp8_training.py out/fp8-train/* --out benchmarks/fp8_training.png
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: issue 29's parity margin on the exact-evaluated validation loss
PARITY_MARGIN = 0.01
COLORS = {"bf16": "#1f77b4", "fp8-block": "#2ca02c", "fp8-token": "#9467bd", "fp8-leak": "#d62728"}
OTHER_SEED = {"bf16": "#17becf", "fp8-block": "#98df8a", "fp8-token": "#c5b0d5", "fp8-leak": "#ff9896"}


def read_run(d: pathlib.Path) -> dict:
    """``{"name", "attn", "seed", "train": [...], "eval": [...], "summary": {...} | None}`` of one run."""
    log = d / "log.jsonl"
    if log.is_file():
        text = log.read_text()
    elif (d / "log.jsonl.gz").is_file():  # as committed under benchmarks/runs/ (gzip -9)
        try:
            text = gzip.decompress((d / "log.jsonl.gz").read_bytes()).decode()
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise SystemExit(f"error: {d}/log.jsonl.gz cannot be read ({exc})") from None
    else:
        raise SystemExit(f"error: {d}: no log.jsonl or log.jsonl.gz (not a train_fp8.py run directory)")
    recs = []
    for no, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            r = json.loads(ln)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise SystemExit(f"error: {d}: line {no} of its log is not JSON ({exc.__class__.__name__}: "
                             f"{str(exc).split(':')[0]}; a run cut off mid-write? the last line may be partial)") from None
        if not (isinstance(r, dict) and isinstance(r.get("type"), str) and isinstance(r.get("step", 0), int)):
            raise SystemExit(f"error: {d}: line {no} of its log is not a train_fp8.py record (a string 'type' and "
                             "an integer 'step')")
        recs.append(r)
    if not recs:
        raise SystemExit(f"error: {d}: its log is empty (no records: the run has not started)")
    starts = [r for r in recs if r["type"] == "start"]
    cfg = starts[0].get("config") if starts else None
    cfg = cfg if isinstance(cfg, dict) else {}
    summ = d / "summary.json"
    # a resumed run appends: keep the last record of every step
    train = {r["step"]: r for r in recs if r["type"] == "train"}
    ev = {r["step"]: r for r in recs if r["type"] == "eval"}
    try:
        summary = json.loads(summ.read_text()) if summ.is_file() else None
    except ValueError as exc:
        raise SystemExit(f"error: {summ} is not JSON ({exc})") from None
    return {"name": d.name, "attn": cfg.get("attn", "?"), "seed": cfg.get("seed"), "config": cfg,
            "train": [train[k] for k in sorted(train)], "eval": [ev[k] for k in sorted(ev)],
            "summary": summary if isinstance(summary, dict) else None}


def _smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def table(runs: list[dict]) -> list[dict]:
    """One row per run: final train loss (mean of the last 100 steps), final validation losses,
    own - exact gap, max gradient norm, median tokens/s."""
    rows = []
    for r in runs:
        tr, ev = r["train"], r["eval"]
        last = ev[-1]["val_loss"] if ev else {}
        losses = [t["loss"] for t in tr]
        tps = sorted(t["tok_s"] for t in (tr[20:] or tr) if t.get("tok_s")) or [0.0]
        rows.append({
            "run": r["name"], "attn": r["attn"], "seed": r["seed"], "steps": tr[-1]["step"] if tr else 0,
            "train_loss_last100": sum(losses[-100:]) / max(1, len(losses[-100:])) if losses else float("nan"),
            "val_own": last.get("own", float("nan")), "val_exact": last.get("exact", float("nan")),
            "val_control": last.get("control"),
            "gap_own_minus_exact": last.get("own", float("nan")) - last.get("exact", float("nan")),
            "grad_norm_max": max((t["grad_norm"] for t in tr), default=float("nan")),
            "spikes": (r["summary"] or {}).get("grad_norm_spikes"),
            "tok_s": tps[len(tps) // 2],
        })
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| run | attn | seed | steps | train loss (last 100) | val own | val exact | own - exact | val control "
            "| max grad norm | spikes | tokens/s |")
    out = [head, "|" + "---|" * 12]
    for x in rows:
        ctl = "-" if x["val_control"] is None else f"{x['val_control']:.4f}"
        sp = "-" if x["spikes"] is None else str(len(x["spikes"]))
        out.append(f"| {x['run']} | {x['attn']} | {x['seed']} | {x['steps']} | {x['train_loss_last100']:.4f} | "
                   f"{x['val_own']:.4f} | {x['val_exact']:.4f} | {x['gap_own_minus_exact']:+.4f} | {ctl} | "
                   f"{x['grad_norm_max']:.3f} | {sp} | {x['tok_s'] / 1e3:.1f}k |")
    return "\n".join(out)


def _pooled(x: dict, full: int) -> bool:
    """Whether :func:`parity` pools ``table`` row ``x``: not the leak, and as long as the longest run
    (``full`` steps: a shorter or unfinished run ends at another point of the schedule)."""
    return x["attn"] != "fp8-leak" and x.get("steps", 0) == full


def _full_steps(rows: list[dict]) -> int:
    return max((x.get("steps", 0) for x in rows), default=0)


def parity(rows: list[dict], margin: float = PARITY_MARGIN) -> list[dict]:
    """Issue 29's parity test on the exact-evaluated validation loss, per attention mode over its runs
    (``table`` rows; the leak left out): ``n``, mean, sample sd, the mean's difference to BF16's with its
    standard error ``sqrt(sd^2 / n + sd_bf16^2 / n_bf16)``, and ``runs_for_margin``: the runs per mode
    (at the pooled sd) that put two standard errors of the difference inside ``margin`` -- the number a
    claim "within ``margin`` of BF16" needs (each row carries ``margin``). A mode with one run has no sd
    (``nan``). Only the runs :func:`_pooled` accepts."""
    by: dict[str, list[float]] = {}
    full = _full_steps(rows)
    for x in rows:
        if _pooled(x, full) and math.isfinite(x["val_exact"]):
            by.setdefault(x["attn"], []).append(x["val_exact"])
    stats = {a: (len(v), statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else float("nan"))
             for a, v in by.items()}
    base = stats.get("bf16")
    out = []
    for a, (n, mean, sd) in stats.items():
        d = se = need = float("nan")
        if base is not None and a != "bf16":
            nb, mb, sb = base
            d, se = mean - mb, math.sqrt(sd ** 2 / n + sb ** 2 / nb)
            pooled = math.sqrt((sd ** 2 + sb ** 2) / 2)
            need = math.ceil(2 * (2 * pooled / margin) ** 2) if math.isfinite(pooled) else float("nan")
        out.append({"attn": a, "n": n, "mean": mean, "sd": sd, "diff_vs_bf16": d, "se": se, "runs_for_margin": need,
                    "margin": margin})
    return out


def _num(v: float, fmt: str) -> str:
    """``v`` formatted, ``-`` for NaN (a statistic with too few runs)."""
    return "-" if v != v else format(v, fmt)


def parity_markdown(prows: list[dict]) -> str:
    margin = prows[0]["margin"] if prows else PARITY_MARGIN
    out = [f"| attn | runs | val exact: mean | sd | - BF16 | standard error | runs for +-{margin} at 2 SE |",
           "|" + "---|" * 7]
    f = _num
    for x in prows:
        out.append(f"| {x['attn']} | {x['n']} | {x['mean']:.4f} | {f(x['sd'], '.4f')} | {f(x['diff_vs_bf16'], '+.4f')} | "
                   f"{f(x['se'], '.4f')} | {f(x['runs_for_margin'], '.0f')} |")
    return "\n".join(out)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (Lentz's continued fraction, Numerical
    Recipes 6.4), for Student's t below; ``x`` in [0, 1]."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(lbeta) * h / a


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with ``df`` degrees of freedom."""
    return _betainc(df / 2, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """``t`` with ``P(T <= t) = q`` for Student's t (``q`` in (0.5, 1)), by bisection on :func:`t_two_sided_p`."""
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1 - t_two_sided_p(mid, df) / 2 < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired(rows: list[dict], margin: float = PARITY_MARGIN) -> list[dict]:
    """The parity test on seed-paired runs: a seed is the model's initialisation and every run reads the
    same data order (``train_fp8.py --data-seed``), so a mode's run and BF16's run of one seed differ only
    in the attention. Per FP8 mode (the leak left out), over the seeds it shares with BF16 (runs
    :func:`_pooled` accepts): ``n``, the mean of ``val_exact(mode, s) - val_exact(bf16, s)``, its sample
    sd and standard error ``sd / sqrt(n)``, ``upper``: mean + 2 SE, the one-sided bound that "no worse
    than BF16 by more than ``margin``" needs below ``margin``; with Student's t (``n - 1`` degrees of
    freedom): ``upper_t`` (mean + t_0.95 SE), ``p_two_sided`` (the mean against 0) and ``ci95`` (the
    two-sided 95% interval). ``nan`` where ``n < 2``."""
    full = _full_steps(rows)
    by: dict[str, dict[int, float]] = {}
    for x in rows:
        if _pooled(x, full) and math.isfinite(x["val_exact"]) and x.get("seed") is not None:
            by.setdefault(x["attn"], {})[x["seed"]] = x["val_exact"]
    base = by.get("bf16", {})
    out = []
    for a, vals in by.items():
        if a == "bf16":
            continue
        d = [vals[s] - base[s] for s in sorted(vals) if s in base]
        n, nan = len(d), float("nan")
        mean = statistics.fmean(d) if d else nan
        sd = statistics.stdev(d) if n > 1 else nan
        se = sd / math.sqrt(n) if n > 1 else nan
        t95, t975 = (t_quantile(0.95, n - 1), t_quantile(0.975, n - 1)) if n > 1 else (nan, nan)
        p = t_two_sided_p(mean / se, n - 1) if n > 1 and se > 0 else nan
        out.append({"attn": a, "n": n, "mean_diff": mean, "sd": sd, "se": se, "upper": mean + 2 * se,
                    "upper_t": mean + t95 * se, "p_two_sided": p, "ci95": (mean - t975 * se, mean + t975 * se),
                    "margin": margin})
    return out


def paired_markdown(prows: list[dict]) -> str:
    margin = prows[0]["margin"] if prows else PARITY_MARGIN
    out = [f"| attn | seed pairs | mean (mode - BF16) | sd | standard error | mean + 2 SE | no worse than +{margin} "
           "| mean + t_0.95 SE | two-sided p (t) | 95% interval (t) |", "|" + "---|" * 10]
    f = _num
    for x in prows:
        ok = "-" if x["upper"] != x["upper"] else ("yes" if x["upper"] <= margin else "no")
        lo, hi = x["ci95"]
        out.append(f"| {x['attn']} | {x['n']} | {f(x['mean_diff'], '+.4f')} | {f(x['sd'], '.4f')} | "
                   f"{f(x['se'], '.4f')} | {f(x['upper'], '+.4f')} | {ok} | {f(x['upper_t'], '+.4f')} | "
                   f"{f(x['p_two_sided'], '.3f')} | {f(lo, '+.4f')} .. {f(hi, '+.4f')} |")
    return "\n".join(out)


def spike_overlap(rows: list[dict]) -> list[dict]:
    """Issue 29's "no gradient-norm spikes the BF16 run does not have", against BF16's own seed noise.
    Spikes are ``train_fp8.py``'s (a step's norm > 3x the median of the previous 100). Per FP8 mode (the
    leak left out): the fraction of its runs' spikes on steps where none of ``k`` BF16 runs spikes, averaged
    over every choice of ``k`` BF16 runs; for BF16: each run's spikes against the other ``k`` BF16 runs
    (leave-one-out). ``k`` = the number of BF16 runs - 1, so both fractions count against as many runs.
    Rows: ``{"attn", "runs", "spikes", "fraction_unshared", "k"}``; ``[]`` with fewer than 2 BF16 runs."""
    import itertools

    full = _full_steps(rows)
    by: dict[str, list[set]] = {}
    for x in rows:
        if _pooled(x, full) and x.get("spikes") is not None:
            by.setdefault(x["attn"], []).append(set(x["spikes"]))
    bf = by.get("bf16", [])
    if len(bf) < 2:
        return []
    k = len(bf) - 1
    out = []
    for a, runs in by.items():
        total = sum(len(v) for v in runs)
        if a == "bf16":
            unshared = sum(len(v - set().union(*(w for j, w in enumerate(bf) if j != i))) for i, v in enumerate(bf))
            frac = unshared / total if total else float("nan")
        else:
            fr = [sum(len(v - set().union(*sub)) for v in runs) / total
                  for sub in itertools.combinations(bf, k)] if total else [float("nan")]
            frac = statistics.fmean(fr)
        out.append({"attn": a, "runs": len(runs), "spikes": total, "fraction_unshared": frac, "k": k})
    return out


def spike_markdown(srows: list[dict]) -> str:
    k = srows[0]["k"] if srows else 0
    out = [f"| attn | runs | spikes | on steps where none of {k} BF16 runs spikes |", "|" + "---|" * 4]
    for x in srows:
        frac = _num(100 * x["fraction_unshared"], ".0f")
        out.append(f"| {x['attn']} | {x['runs']} | {x['spikes']} | {frac}{'%' if frac != '-' else ''} |")
    return "\n".join(out)


def plot(runs: list[dict], out: pathlib.Path, smooth: int = 50) -> pathlib.Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: matplotlib is not installed here; the plot is a separate CPU step: "
                         "pip install matplotlib, then run this script on the copied log.jsonl files") from None
    fig, ax = plt.subplots(1, 4, figsize=(22, 4.8), gridspec_kw={"width_ratios": [1, 1.2, 1, 0.7]})
    dashes = {0: "-", 1: (0, (5, 2)), 2: (0, (1, 1))}
    for i, r in enumerate(runs):
        color = (COLORS if (r["seed"] or 0) == 0 else OTHER_SEED).get(r["attn"], None)
        ls = "-"
        label = f"{r['attn']} s{r['seed']}"
        if sum(1 for o in runs if (o["attn"], o["seed"]) == (r["attn"], r["seed"])) > 1:
            label += f" ({r['name']})"  # two runs of one configuration: tell them apart by directory
        steps = [t["step"] for t in r["train"]]
        ax[0].plot(steps, _smooth([t["loss"] for t in r["train"]], smooth), color=color, ls=ls, lw=1.2, label=label)
        ax[2].plot(steps, [t["grad_norm"] for t in r["train"]], color=color, ls=ls, lw=0.6, alpha=0.8, label=label)
        es = [e["step"] for e in r["eval"]]
        for j, key in enumerate(("own", "exact", "control")):
            ys = [e["val_loss"].get(key) for e in r["eval"]]
            if any(y is None for y in ys) or (key == "exact" and r["attn"] == "bf16"):
                continue
            ax[1].plot(es, ys, color=color, ls=dashes[j], marker="o" if j == 0 else None, ms=3, lw=1.2,
                       label=f"{label} ({key})")
    ax[0].set(title=f"training loss ({smooth}-step mean)", xlabel="step", ylabel="nats / byte")
    ax[1].set(title="validation loss: own kernel (solid), exact BF16 (dashed), control (dotted)", xlabel="step",
              ylabel="nats / byte")
    ax[2].set(title="gradient norm (before clipping)", xlabel="step", yscale="log")
    # zoom the loss panels on the second half of training, where the differences are
    for a, series in ((ax[0], [_smooth([t["loss"] for t in r["train"]], smooth) for r in runs]),
                      (ax[1], [[v for e in r["eval"] for v in e["val_loss"].values()] for r in runs])):
        tail = [y for s in series for y in s[len(s) // 3:]]
        if tail:
            lo, hi = min(tail), max(tail)
            a.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.3 * (hi - lo + 1e-3))
    # the final evaluation: own - exact (the leak's signature) and, for the leak, own - control; the
    # two BF16 seeds' difference of exact losses is the run-to-run noise to compare with
    rows = table(runs)
    names = [x["run"] for x in rows]
    gaps = [x["gap_own_minus_exact"] for x in rows]
    colors = [(COLORS if (x["seed"] or 0) == 0 else OTHER_SEED).get(x["attn"], "gray") for x in rows]
    ax[3].barh(names, gaps, color=colors)
    for i, x in enumerate(rows):
        if x["val_control"] is not None:
            ax[3].plot([x["val_own"] - x["val_control"]], [i], "k^", ms=7, label="own - control")
    bf = [x["val_exact"] for x in rows if x["attn"] == "bf16"]
    if len(bf) >= 2:
        noise = max(bf) - min(bf)
        ax[3].axvspan(-noise, noise, color="gray", alpha=0.2, label=f"BF16 seed spread ({noise:.4f})")
    ax[3].axvline(0, color="k", lw=0.8)
    ax[3].set(title="final val: own - exact", xlabel="nats / byte")
    for a in ax:
        a.grid(alpha=0.3)
    for a, kw in ((ax[0], dict(fontsize=8)), (ax[1], dict(fontsize=7, ncol=2)), (ax[3], dict(fontsize=7))):
        if a.get_legend_handles_labels()[0]:  # a panel with nothing labelled (one BF16 run) gets no legend
            a.legend(**kw)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=pathlib.Path, help="run directories (each with log.jsonl)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="PNG path (default: fp8_training.png beside the first run directory; the README's figure is "
                        "benchmarks/fp8_training.png)")
    p.add_argument("--smooth", type=int, default=50, help="training-loss moving-average window (steps)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--no-plot", action="store_true", help="only print the table")
    a = p.parse_args(argv)
    if a.smooth < 1:
        p.error(f"--smooth must be >= 1 step, got {a.smooth}")
    dirs = [d for d in a.runs if d.is_dir()]
    for d in a.runs:
        if not d.is_dir():  # e.g. run_fp8_training.sh's <run>.console files beside the run directories
            print(f"skipping {d}: not a run directory", file=sys.stderr)
    if not dirs:
        p.error("no run directories among the paths given")
    out = a.out if a.out is not None else dirs[0].resolve().parent / "fp8_training.png"
    if out.suffix.lower() != ".png":
        p.error(f"--out {out}: must be a .png path")
    runs = []
    for d in dirs:
        r = read_run(d)
        if r["train"]:
            runs.append(r)
        else:
            print(f"skipping {d}: no training step logged yet", file=sys.stderr)
    if not runs:
        p.error("no run among the directories given has a logged training step")
    rows = table(runs)
    if a.markdown:
        print(markdown(rows))
        print()
        print(parity_markdown(parity(rows)))
        print()
        print(paired_markdown(paired(rows)))
        srows = spike_overlap(rows)
        if srows:
            print()
            print(spike_markdown(srows))
        full = _full_steps(rows)
        short = [x["run"] for x in rows if x["attn"] != "fp8-leak" and not _pooled(x, full)]
        if short:
            print(f"\n(left out of the per-mode table: {', '.join(short)}, shorter than {full} steps)")
    else:
        json.dump(rows, sys.stdout, indent=1)
        print()
    if not a.no_plot:
        print(f"wrote {plot(runs, out, a.smooth)}")
    return rows


if __name__ == "__main__":
    main()
