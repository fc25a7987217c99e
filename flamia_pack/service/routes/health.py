"""``GET /healthz``: liveness plus what the service is working with."""
from __future__ import annotations

from fastapi import APIRouter, Depends

import flamia_pack
from flamia_pack.service.models import Health
from flamia_pack.service.state import ServiceState, get_state

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness and configuration summary")
def healthz(state: ServiceState = Depends(get_state)) -> Health:
    """Always 200 while the process serves requests; reports the calibration version in use, the
    GPU check done at start-up and the number of recorded runs."""
    return Health(
        status="ok",
        version=flamia_pack.__version__,
        calibration_version=state.calibration.version,
        gpu_available=state.gpu_available,
        gpu_detail=state.gpu_detail,
        runs_recorded=state.store.count_runs(),
    )
