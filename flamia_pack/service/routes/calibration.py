"""``POST /v1/calibration:refit``: least-squares refit of (a, b) from recorded runs, new version."""
from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, HTTPException

from flamia_pack.errors import FlamiaError
from flamia_pack.service.calibration import FitRun, refit, table_to_json
from flamia_pack.service.models import CalibrationEntry, ErrorBody, RefitResponse
from flamia_pack.service.routes.common import run_owning_lock
from flamia_pack.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["calibration"])


def base_version(version: str) -> str:
    """The version a refit chain started from (``"est-1+refit3"`` -> ``"est-1"``)."""
    return version.split("+refit", 1)[0]


@router.post(
    "/calibration:refit",
    response_model=RefitResponse,
    responses={
        409: {"model": ErrorBody, "description": "Not enough recorded runs to fit (a, b), or a refit in progress."},
        504: {"model": ErrorBody, "description": "The refit took longer than the request timeout."},
    },
    summary="Refit the cost model's (a, b) from recorded runs",
)
async def refit_calibration(state: ServiceState = Depends(get_state)) -> RefitResponse:
    """For every (gpu, kernel path, head_dim) with at least two recorded runs, fit the per-unit time
    ``a * tiles + b`` to the measured times by least squares on the relative error (re-simulating
    each run's schedule), store the new table in the database under a new version
    (``<base>+refit<n>``) and use it from now on. The shipped calibration file is never modified.
    409 when no key has two runs yet, or while another refit runs. Takes no request body: one sent
    (even malformed JSON) is ignored, so it is never a 422."""
    if not state.refit_lock.acquire(blocking=False):
        raise HTTPException(status_code=409, detail="a refit is already in progress")
    old = state.calibration

    def work():
        rows = state.store.all_runs()
        runs = [
            FitRun(gpu=r.gpu, precision=r.precision, head_dim=r.head_dim, causal=r.causal,
                   num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                   seqlens=np.frombuffer(r.seqlens, dtype="<i4").astype(np.int64), measured_ms=r.measured_ms)
            for r in rows
        ]
        version = f"{base_version(old.version)}+refit{state.store.count_calibrations() + 1}"
        table, fits = refit(runs, old, version=version)
        state.store.save_calibration(version, old.version, table_to_json(table))
        state.calibration = table  # swapped while the refit lock is still held
        return table, fits

    try:
        table, fits = await run_owning_lock(state.refit_lock, work, max(state.settings.request_timeout_s, 60.0))
    except FlamiaError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    return RefitResponse(
        version=table.version,
        previous_version=old.version,
        entries=[
            CalibrationEntry(gpu=f.gpu, kernel_path=f.kernel_path, precision=f.precision, head_dim=f.head_dim,
                             a_us_per_tile=f.a_us_per_tile, b_us_per_item=f.b_us_per_item, runs=f.runs,
                             rms_error_pct=f.rms_error_pct)
            for f in fits
        ],
    )
