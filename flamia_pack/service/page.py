"""The HTML page of ``GET /`` and ``POST /``: a form for the mix, server-rendered SVGs.

The page works without JavaScript: the form posts ``application/x-www-form-urlencoded`` to ``/`` and
the answer is the same page with the results (length histogram, Gantt charts of the static and the
dynamic schedule, predicted-vs-measured history). The few lines of inline JS only show the fields
of the chosen mix kind. No external resources (CSS inline, no CDN).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any
from urllib.parse import parse_qs

import numpy as np
from pydantic import ValidationError

import flamia_pack
from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths
from flamia_pack.service import plots
from flamia_pack.service.engine import MixPrediction, predict_mix, unit_costs
from flamia_pack.service.models import PredictRequest
from flamia_pack.service.state import ServiceState

__all__ = ["FormError", "PageForm", "parse_form", "render_page"]

_TEMPLATE = Template(resources.files("flamia_pack.service").joinpath("templates/page.html").read_text("utf-8"))
_MIX_KINDS = ("preset", "lengths", "histogram", "lognormal")
_DEFAULTS: dict[str, str] = {
    "mix": "preset", "preset": "W6", "lengths": "", "histogram": "", "mu": "6.5", "sigma": "1.0",
    "total_tokens": "65536", "min_len": "16", "max_len": "32768", "seed": "0", "num_heads": "16",
    "num_kv_heads": "", "head_dim": "128", "precision": "bf16", "causal": "1", "capacity": "65536",
    "long_docs": "split", "policy": "auto", "gpu": "",
}


class FormError(FlamiaError):
    """The form cannot be turned into a request (the page shows the message, status 400)."""


@dataclass
class PageForm:
    """Raw form values (strings), defaults filled in."""

    values: dict[str, str] = field(default_factory=lambda: dict(_DEFAULTS))


def parse_form(body: bytes, content_type: str | None) -> PageForm:
    """Decode a urlencoded form body (the only encoding the page sends).

    Raises:
        FormError: another content type or undecodable bytes.
    """
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    if ctype not in ("application/x-www-form-urlencoded", ""):
        raise FormError(f"the page form must be sent as application/x-www-form-urlencoded, got {ctype!r}")
    try:
        raw = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=64)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormError(f"cannot decode the form: {exc}") from None
    vals = dict(_DEFAULTS)
    vals["causal"] = ""  # an unchecked checkbox is simply absent
    for k, v in raw.items():
        if k in vals and v:
            vals[k] = v[-1]
    return PageForm(values=vals)


_SPLIT = re.compile(r"[\s,;]+")
_INT = re.compile(r"[+-]?[0-9]+")
_PAIR = re.compile(r"^\s*([0-9]{1,20})\s*(?:[x*:,]|\s)\s*([0-9]{1,20})\s*$", re.IGNORECASE)


def _ints(text: str, what: str) -> list[int]:
    out = []
    for p in (p for p in _SPLIT.split(text.strip()) if p):
        # ASCII digits only: int() also takes '1_000' and other scripts' digits, and raises for
        # '²' (which str.isdigit() accepts) or for more than 4,300 digits
        if not _INT.fullmatch(p) or len(p) > 20:
            shown = p if len(p) <= 40 else p[:40] + "..."
            raise FormError(f"{what}: {shown!r} is not an integer (ASCII digits, at most 20 of them)")
        out.append(int(p))
    return out


def form_to_request(form: PageForm) -> PredictRequest:
    """Build the API request from the form (the same model ``POST /v1/cost:predict`` takes).

    Raises:
        FormError: unparsable numbers, unknown preset, or a schema violation (message from pydantic).
    """
    v = form.values
    body: dict[str, Any] = {}
    kind = v["mix"]
    if kind not in _MIX_KINDS:
        raise FormError(f"mix kind must be one of {', '.join(_MIX_KINDS)}, got {kind!r}")
    if kind == "preset":
        name = v["preset"].upper()
        if name not in WORKLOADS:
            raise FormError(f"unknown workload {v['preset']!r}; known: {', '.join(WORKLOADS)}")
        body["lengths"] = workload_lengths(name).tolist()
        if not v["num_kv_heads"]:
            body["num_kv_heads"] = WORKLOADS[name]["num_kv_heads"]
    elif kind == "lengths":
        body["lengths"] = _ints(v["lengths"], "lengths")
    elif kind == "histogram":
        pairs = []
        for i, line in enumerate(l for l in v["histogram"].splitlines() if l.strip()):
            m = _PAIR.match(line)
            if not m:
                raise FormError(f"histogram line {i + 1}: {line.strip()!r} is not 'length x count'")
            pairs.append([int(m.group(1)), int(m.group(2))])
        body["histogram"] = pairs
    else:
        body["distribution"] = {k: v[k] for k in ("mu", "sigma", "total_tokens", "min_len", "max_len", "seed")}
    for k in ("num_heads", "num_kv_heads", "head_dim", "capacity"):
        if v[k] and k not in body:
            body[k] = _ints(v[k], k)[0] if _ints(v[k], k) else None
    for k in ("precision", "long_docs", "policy", "gpu"):
        if v[k]:
            body[k] = v[k]
    body["causal"] = bool(v["causal"])
    try:
        return PredictRequest.model_validate(body)
    except ValidationError as exc:
        msgs = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'form'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise FormError(msgs) from None


def _options(values: tuple[str, ...] | list[str], selected: str, labels: dict[str, str] | None = None) -> str:
    out = []
    for val in values:
        sel = " selected" if val == selected else ""
        out.append(f'<option value="{html.escape(val)}"{sel}>{html.escape((labels or {}).get(val, val))}</option>')
    return "".join(out)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return str(n)


def _views(mp: MixPrediction, note_units: int) -> dict[str, plots.ScheduleView]:
    p = mp.prediction
    views = {}
    costs = None
    for name in ("static", "dynamic"):
        s = p.schedules[name]
        if s.sm is not None and s.unit is not None:
            if costs is None:
                costs = unit_costs(mp.seqlens, p)
            views[name] = plots.ScheduleView(
                name=name, sm=np.asarray(s.sm), start_ms=np.asarray(s.start_us) / 1e3,
                end_ms=np.asarray(s.end_us) / 1e3, cost=costs[np.asarray(s.unit)].astype(np.int64),
                num_sms=s.num_sms, makespan_ms=s.makespan_us / 1e3,
            )
        else:  # too many units to keep intervals: one bar per SM (its busy time)
            busy = np.asarray(s.per_sm_busy_us) / 1e3
            views[name] = plots.ScheduleView(
                name=name, sm=np.arange(s.num_sms), start_ms=np.zeros(s.num_sms), end_ms=busy,
                cost=np.zeros(s.num_sms, dtype=np.int64), num_sms=s.num_sms, makespan_ms=s.makespan_us / 1e3,
                units=p.units, busy_only=True,
                note=f"busy time per SM only (more than {note_units:,} units to draw one by one)",
            )
    return views


def _results_html(mp: MixPrediction, state: ServiceState) -> str:
    p, st = mp.prediction, mp.pack
    rows = [
        ("documents", f"{mp.lengths.size:,} ({st.docs_empty:,} empty)"),
        ("tokens", f"{st.tokens_in:,} (longest document {int(mp.lengths.max()):,})"),
        ("rows needed", f"{st.rows:,} of {st.capacity:,} tokens, fill {100 * st.fill:.2f} %"
         + (f"; {st.docs_split:,} documents split" if st.docs_split else "")
         + (f"; {st.tokens_dropped:,} tokens dropped" if st.tokens_dropped else "")),
        ("visible pairs", f"{p.pairs:,}"),
        ("FLOPs (fwd+bwd)", f"{p.flops:.4g}"),
        ("work items / tiles", f"{p.items:,} items, {p.tiles:,} key tiles per head ({p.units:,} units)"),
        ("policy", f"<b>{p.policy}</b> &mdash; {html.escape(p.reason)}"),
        ("predicted", f"static <b>{p.static_ms:.3f} ms</b>, dynamic <b>{p.dynamic_ms:.3f} ms</b> "
         f"({p.predicted_tflops:.3g} TFLOP/s under {p.policy})"),
        ("memory", f"packed {_fmt_bytes(p.memory_packed_bytes)} vs padded {_fmt_bytes(p.memory_padded_bytes)} "
         f"({p.memory_padded_bytes / max(p.memory_packed_bytes, 1):.2f}x)"),
        ("calibration", f"{html.escape(p.calibration_version)} ({html.escape(p.kernel_path)}, D={p.head_dim}, "
         f"{html.escape(p.gpu)}, {p.num_sms} SMs{'' if p.calibration_measured else ', estimate'})"),
    ]
    table = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    s = state.settings
    views = _views(mp, s.page_max_units)
    xmax = max(v.makespan_ms for v in views.values())
    g = {
        name: plots.gantt_svg(views[name], max_sms=s.gantt_max_sms, max_bars_per_sm=s.gantt_max_bars_per_sm, xmax_ms=xmax)
        for name in ("static", "dynamic")
    }
    hist = plots.length_histogram_svg(mp.lengths, capacity=st.capacity)
    return (
        f'<table class="kv" id="summary">{table}</table>'
        f'<section class="plot" id="plot-lengths"><h2>Length mix</h2>{hist}</section>'
        f'<div class="pair">'
        f'<section class="plot" id="gantt-static"><h2>Static schedule (snake), per SM</h2>{g["static"]}</section>'
        f'<section class="plot" id="gantt-dynamic"><h2>Dynamic schedule (atomic counter), per SM</h2>{g["dynamic"]}</section>'
        f"</div>"
    )


def _history_svg(state: ServiceState) -> str:
    runs, _ = state.store.list_runs(limit=500)
    return plots.history_svg([r.predicted_ms for r in runs], [r.measured_ms for r in runs], [f"#{r.id}" for r in runs])


def render_page(state: ServiceState, form: PageForm | None = None, *, compute: bool = False) -> tuple[str, int]:
    """Render the page; with ``compute`` also predict the form's mix and draw its pictures.

    Returns:
        ``(html, status)``: 200, or 400 with the reason shown when the form is unusable.
    """
    form = form or PageForm()
    v = form.values
    error, results, status = "", "", 200
    if compute:
        try:
            req = form_to_request(form)
            lengths = state.lengths_of(req)
            params = state.params_of(req)
            mp = predict_mix(lengths, params, calibration=state.calibration,
                             max_intervals=state.settings.page_max_units, max_segments=state.settings.max_segments)
            results = _results_html(mp, state)
        except FlamiaError as exc:
            error, status = f'<div class="error" id="error">{html.escape(str(exc))}</div>', 400
    else:
        results = '<p class="hint" id="no-results">Choose a mix and press <b>Predict</b>.</p>'
    presets = list(WORKLOADS)
    fields = {k: html.escape(v[k]) for k in ("lengths", "histogram", "mu", "sigma", "total_tokens", "min_len",
                                                 "max_len", "seed", "num_heads", "num_kv_heads", "capacity", "gpu")}
    page = _TEMPLATE.substitute(
        calibration_version=html.escape(state.calibration.version),
        version=html.escape(flamia_pack.__version__),
        mix_options=_options(_MIX_KINDS, v["mix"], {"preset": "preset (WORKLOADS.md)", "lengths": "list of lengths",
                                                    "histogram": "histogram", "lognormal": "lognormal"}),
        preset_options=_options(presets, v["preset"].upper()),
        head_dim_options=_options(("64", "128"), v["head_dim"]),
        precision_options=_options(("bf16", "fp8"), v["precision"]),
        causal_checked="checked" if v["causal"] else "",
        long_docs_options=_options(("split", "truncate", "drop", "error"), v["long_docs"]),
        policy_options=_options(("auto", "static", "dynamic"), v["policy"]),
        error=error,
        results=results,
        history_svg=_history_svg(state),
        **fields,
    )
    return page, status
