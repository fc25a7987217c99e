"""``/v1/runs``: simulate, then time a real training call on the local GPU; recorded in SQLite."""
from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Path, Query

from flamia_pack.errors import FlamiaError
from flamia_pack.service.dispatch import Dispatcher, GpuUnavailable, Measurement, RunSpec
from flamia_pack.service.engine import critical_load, predict_mix
from flamia_pack.service.models import ErrorBody, RunList, RunRecord, RunRequest, RunResult
from flamia_pack.service.routes.common import ERRORS, JsonBody, json_body_openapi, offload, run_owning_lock
from flamia_pack.service.state import ServiceState, get_dispatcher, get_state
from flamia_pack.service.store import RunRow

router = APIRouter(prefix="/v1", tags=["runs"])

_RUN_ERRORS = {
    **ERRORS,
    409: {"model": ErrorBody, "description": "Another run is in progress (one at a time)."},
    501: {"model": ErrorBody, "description": "The requested kernel path is not implemented in this build."},
    503: {"model": ErrorBody, "description": "No usable GPU / attention op on this machine."},
}


def _record(row: RunRow) -> RunRecord:
    return RunRecord(
        id=int(row.id), created_at=str(row.created_at), gpu=row.gpu, device_name=row.device_name,
        precision=row.precision, head_dim=row.head_dim, num_heads=row.num_heads,
        num_kv_heads=row.num_kv_heads, causal=row.causal, documents=row.documents, tokens=row.tokens,
        work_items=row.work_items, tiles=row.tiles, policy=row.policy, predicted_ms=row.predicted_ms,
        measured_ms=row.measured_ms, error_pct=row.error_pct, calibration_version=row.calibration_version,
    )


@router.post(
    "/runs",
    status_code=201,
    response_model=RunResult,
    responses=_RUN_ERRORS,
    summary="Predict, then run and time one training call on the local GPU",
    openapi_extra=json_body_openapi(RunRequest),
)
async def create_run(
    req: RunRequest = Depends(JsonBody(RunRequest)),
    state: ServiceState = Depends(get_state),
    dispatcher: Dispatcher = Depends(get_dispatcher),
) -> RunResult:
    """Simulate the mix (as ``POST /v1/cost:predict``), then dispatch ``varlen_attention`` forward +
    backward on random BF16 inputs of that mix and time it (median of ``repeats`` after warm-up).
    The run is recorded; the answer carries measured vs predicted ms and the error in percent.
    503 without a GPU, 409 while another run is in progress, 400 for an impossible or too large mix."""
    ok, detail = dispatcher.availability()
    if not ok:
        raise HTTPException(status_code=503, detail=f"no GPU to run on: {detail}")
    settings = state.settings
    calibration = state.calibration

    def plan():
        lengths = state.lengths_of(req)
        params = state.params_of(req)
        tokens = int(lengths.sum())
        if tokens > settings.max_run_tokens:
            raise FlamiaError(
                f"a dispatched run may hold at most {settings.max_run_tokens} tokens, the mix has {tokens}"
            )
        mp = predict_mix(lengths, params, calibration=calibration, max_intervals=2**62,
                         max_segments=settings.max_segments)
        return params, mp, critical_load(mp.seqlens, mp.prediction)

    params, mp, (crit_tiles, crit_items) = await offload(plan, settings.request_timeout_s)
    p = mp.prediction
    spec = RunSpec(
        seqlens=mp.seqlens, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
        causal=p.causal, precision=p.precision, warmup=settings.run_warmup,
        repeats=req.repeats or settings.run_repeats, seed=req.seed,
    )
    if not state.run_lock.acquire(blocking=False):
        raise HTTPException(status_code=409, detail="another run is in progress; try again when it has finished")
    try:
        m = await run_owning_lock(state.run_lock, lambda: dispatcher.run(spec), settings.run_timeout_s)
    except GpuUnavailable as exc:
        raise HTTPException(status_code=503, detail=f"no GPU to run on: {exc}") from None
    except (HTTPException, FlamiaError):
        raise
    except NotImplementedError as exc:  # e.g. a kernel path or shape this build has no GPU kernel for
        raise HTTPException(status_code=501, detail=f"not available on this build: {exc}") from None
    except Exception as exc:  # a device failure is the server's problem, reported as such
        raise HTTPException(
            status_code=500, detail=f"the run failed on the device: {type(exc).__name__}: {exc}"
        ) from None
    assert isinstance(m, Measurement)
    measured = float(m.measured_ms)
    row = RunRow(
        gpu=params.gpu, device_name=m.device_name or "unknown", precision=p.precision, head_dim=p.head_dim,
        num_heads=p.num_heads, num_kv_heads=p.num_kv_heads, causal=p.causal, documents=int(mp.lengths.size),
        tokens=int(p.tokens), work_items=int(p.items), tiles=int(p.tiles), policy=p.policy,
        predicted_ms=float(p.predicted_ms), measured_ms=measured,
        error_pct=100.0 * (float(p.predicted_ms) - measured) / measured if measured > 0 else 0.0,
        calibration_version=str(p.calibration_version), crit_tiles=crit_tiles, crit_items=crit_items,
        request_json=req.model_dump_json(exclude_none=True),
        seqlens=np.ascontiguousarray(mp.seqlens, dtype="<i4").tobytes(),
    )
    saved = await offload(lambda: state.store.add_run(row), settings.request_timeout_s)
    return RunResult(
        **_record(saved).model_dump(),
        times_ms=[float(t) for t in m.times_ms],
        peak_bytes=int(m.peak_bytes),
        predicted_static_ms=float(p.static_ms),
        predicted_dynamic_ms=float(p.dynamic_ms),
    )


@router.get("/runs", response_model=RunList, summary="Recorded runs, newest first")
def list_runs(
    limit: int = Query(100, ge=1, le=1000, description="Most runs returned."),
    offset: int = Query(0, ge=0, le=2**62, description="Runs skipped (newest first)."),
    state: ServiceState = Depends(get_state),
) -> RunList:
    """Page through the recorded runs (newest first) and the total count."""
    rows, total = state.store.list_runs(limit=limit, offset=offset)
    return RunList(runs=[_record(r) for r in rows], total=total)


@router.get(
    "/runs/{run_id}",
    response_model=RunRecord,
    responses={404: {"model": ErrorBody, "description": "No run with this id."}},
    summary="One recorded run",
)
def get_run(
    run_id: int = Path(ge=1, le=2**63 - 1, description="Run id from POST /v1/runs."),
    state: ServiceState = Depends(get_state),
) -> RunRecord:
    """The run with this id; 404 if there is none."""
    row = state.store.get_run(run_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no run with id {run_id}")
    return _record(row)
