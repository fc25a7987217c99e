"""Pydantic v2 request and response models of the service (DESIGN.md §1.5, §6).

Schema errors (wrong types, out-of-range numbers such as a document length < 1, unknown fields, not
exactly one mix) are 422; requests that are well-formed but describe an impossible mix (a document longer than the row with
``long_docs="error"``, zero tokens, ``num_heads % num_kv_heads != 0``, over the service limits, an
uncalibrated GPU) are 400 with the reason (raised as :class:`~flamia_pack.errors.FlamiaError` by the
code below the routes).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT32_MAX = 2**31 - 1

Length = Annotated[int, Field(ge=1, le=_INT32_MAX)]
"""One document length in tokens, >= 1 (as ``flamia plan``: a zero-length document is a schema error, 422)."""
Count = Annotated[int, Field(ge=0, le=_INT32_MAX)]


class LognormalMix(BaseModel):
    """Lengths drawn from ``clip(rint(lognormal(mu, sigma)), min_len, max_len)`` until exactly
    ``total_tokens`` tokens (the last document shortened; WORKLOADS.md W6 rule)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["lognormal"] = Field("lognormal", description="Distribution family (only lognormal).")
    mu: float = Field(6.5, ge=-50.0, le=50.0, description="Mean of log(length).")
    sigma: float = Field(1.0, ge=0.0, le=10.0, description="Standard deviation of log(length).")
    total_tokens: int = Field(65_536, ge=1, le=_INT32_MAX, description="Tokens in the mix (exact).")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="numpy.random.default_rng seed.")
    min_len: int = Field(16, ge=1, le=_INT32_MAX, description="Shortest drawn length (clip).")
    max_len: int = Field(32_768, ge=1, le=_INT32_MAX, description="Longest drawn length (clip).")


_ONE_MIX = {
    "oneOf": [
        {"required": ["lengths"]},
        {"required": ["histogram"]},
        {"required": ["distribution"]},
    ]
}


class PredictRequest(BaseModel):
    """A document-length mix (exactly one of ``lengths``, ``histogram``, ``distribution``) and the
    attention shape to predict for. Defaults: WORKLOADS.md (H_q = 16, D = 128, causal, BF16, rows of
    65,536 tokens, the calibrated H200)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra=_ONE_MIX,
    )

    # The mix fields are typed without ``| None`` (their default None just means "not given"): a
    # union with None would make every schema error of a length also report a second, confusing
    # "Input should be null" error and a ``list[constrained-int]`` step in ``loc``.
    lengths: list[Length] = Field(  # type: ignore[assignment]
        None, description="Document lengths in tokens (each >= 1), in order.", examples=[[4096] * 16]
    )
    histogram: list[tuple[Length, Count]] = Field(  # type: ignore[assignment]
        None, description="[length, count] pairs (length >= 1), expanded in order.", examples=[[[8192, 1], [256, 224]]]
    )
    distribution: LognormalMix = Field(None, description="A random mix (seeded).")  # type: ignore[assignment]
    num_heads: int = Field(16, ge=1, le=512, description="Query heads H_q.")
    num_kv_heads: int | None = Field(
        None, ge=1, le=512, description="Key/value heads H_kv (GQA); None = num_heads. Must divide num_heads."
    )
    head_dim: Literal[64, 128] = Field(128, description="Head dimension D.")
    causal: bool = Field(True, description="Causal (True) or full attention inside each document.")
    precision: Literal["bf16", "fp8"] = Field("bf16", description="Kernel path.")
    capacity: int = Field(65_536, ge=1, le=_INT32_MAX, description="Tokens per packed row.")
    long_docs: Literal["split", "truncate", "drop", "error"] = Field(
        "split",
        description="Documents longer than capacity: split into pieces (default), truncate, drop, "
        "or reject the request (400).",
    )
    gpu: str | None = Field(
        None, min_length=1, max_length=64, description="Calibrated GPU (None = the service default, H200)."
    )
    policy: Literal["auto", "static", "dynamic"] = Field(
        "auto", description="Schedule to report as chosen: the rule's pick (auto) or a forced one."
    )

    @model_validator(mode="after")
    def _exactly_one_mix(self) -> "PredictRequest":
        given = [n for n in ("lengths", "histogram", "distribution") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one length mix: `lengths`, `histogram` or `distribution`"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        return self


class PredictedMs(BaseModel):
    """Predicted wall time of one call (ms) under each schedule, from the scheduler's simulator."""

    static: float = Field(description="Static persistent (snake) schedule makespan, ms.")
    dynamic: float = Field(description="Dynamic persistent (atomic counter) schedule makespan, ms.")
    chosen: float = Field(description="Makespan of the chosen policy, ms.")


class MemoryEstimate(BaseModel):
    """Bytes of the training call's tensors, packed vs padded to the longest document."""

    packed_bytes: int
    padded_bytes: int
    padded_over_packed: float = Field(description="padded_bytes / packed_bytes (>= 1).")


class PackingSummary(BaseModel):
    """Rows needed for the mix (``flamia_pack.pack.plan_packing``, best-fit-decreasing)."""

    capacity: int
    rows: int
    fill: float = Field(description="tokens_packed / (rows * capacity).")
    segments: int = Field(description="Pieces placed in rows (documents, plus extra pieces of split ones).")
    documents_split: int
    documents_dropped: int
    tokens_dropped: int


class PredictResponse(BaseModel):
    """Everything ``flamia plan`` reports for the mix, plus packing."""

    documents: int = Field(description="Documents in the mix.")
    empty_documents: int = Field(description="Zero-length documents (always 0: requests reject lengths < 1).")
    tokens: int = Field(description="Tokens of the mix (sum of lengths).")
    max_seqlen: int
    packing: PackingSummary
    visible_pairs: int = Field(description="Visible (query, key) pairs of the packed segments.")
    flops: float = Field(description="FLOPs of one training call (forward + backward) on visible pairs.")
    work_items: int
    tiles: int = Field(description="Visible key tiles summed over work items (one head).")
    policy: Literal["static", "dynamic"]
    policy_reason: str
    policy_note: str | None = Field(
        None, description="Set when the rule's schedule is predicted slower than the other one (the rule is "
        "kept; `flamia plan` prints the same note); None when it is not, or when `policy` was forced."
    )
    predicted_ms: PredictedMs
    memory: MemoryEstimate
    gpu: str
    num_sms: int
    calibration_version: str
    calibration_measured: bool = Field(
        description="True if (a, b) of this (precision, head_dim, gpu) were fitted to measured runs of our "
        "kernels (fp8 at head_dim 128: the FP8 training call of 2026-12-02); False = an estimate (e.g. head_dim 64, "
        "not yet fitted to our kernels; the FP8 kernels run head_dim 128 only): treat predicted_ms as rough. "
        "Same flag as `flamia plan --json` settings.calibration_measured."
    )


class RunRequest(PredictRequest):
    """A prediction request that is then dispatched to the local GPU."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=_ONE_MIX)

    repeats: int | None = Field(None, ge=1, le=1000, description="Timed calls (None = the service default).")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the random q, k, v, dO.")


class RunRecord(BaseModel):
    """One recorded run: the prediction and the measurement on the local GPU."""

    id: int
    created_at: str = Field(description="UTC time, ISO 8601.")
    gpu: str
    device_name: str
    precision: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    causal: bool
    documents: int
    tokens: int
    work_items: int
    tiles: int
    policy: str
    predicted_ms: float
    measured_ms: float
    error_pct: float = Field(description="100 * (predicted - measured) / measured.")
    calibration_version: str


class RunResult(RunRecord):
    """Answer of ``POST /v1/runs``: the recorded run plus the raw timings."""

    times_ms: list[float] = Field(description="Every timed call (ms), in order; measured_ms is their median.")
    peak_bytes: int = Field(description="Peak allocated device memory during the timed calls.")
    predicted_static_ms: float
    predicted_dynamic_ms: float


class RunList(BaseModel):
    """Recorded runs, newest first."""

    runs: list[RunRecord]
    total: int


class CalibrationEntry(BaseModel):
    """One refitted (a, b) pair: time of one (item, head) unit on one SM = a * tiles + b (us)."""

    gpu: str
    kernel_path: str = Field(description="e.g. bf16_fwd_bwd (one training call).")
    precision: str
    head_dim: int
    a_us_per_tile: float = Field(description="Microseconds per BLOCK_M x BLOCK_N key tile of one head on one SM.")
    b_us_per_item: float = Field(description="Fixed microseconds per (work item, head) unit on one SM.")
    runs: int = Field(description="Runs used in the least-squares fit.")
    rms_error_pct: float = Field(description="RMS relative error of the refitted model on those runs.")


class RefitResponse(BaseModel):
    """Result of ``POST /v1/calibration:refit``."""

    version: str
    previous_version: str
    entries: list[CalibrationEntry]


class Health(BaseModel):
    """``GET /healthz``."""

    status: Literal["ok"]
    version: str
    calibration_version: str
    gpu_available: bool
    gpu_detail: str
    runs_recorded: int


class ValidationItem(BaseModel):
    """One schema violation (as FastAPI reports it, without echoing the input)."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """Body of a 422 answer."""

    detail: list[ValidationItem]


class ErrorBody(BaseModel):
    """Body of every 4xx/5xx answer produced by the service itself."""

    detail: str
