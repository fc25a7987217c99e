"""``POST /v1/cost:predict``: a length mix -> packing, work, policy and predicted time."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from flamia_pack.scheduler.policy import slower_choice_note
from flamia_pack.service.engine import MixPrediction, predict_mix
from flamia_pack.service.models import (
    MemoryEstimate,
    PackingSummary,
    PredictedMs,
    PredictRequest,
    PredictResponse,
)
from flamia_pack.service.routes.common import ERRORS, JsonBody, json_body_openapi, offload
from flamia_pack.service.state import ServiceState, get_state

router = APIRouter(prefix="/v1", tags=["cost"])


def to_response(mp: MixPrediction, rule_applied: bool = True) -> PredictResponse:
    """Build the API answer from a :class:`~flamia_pack.service.engine.MixPrediction`; ``rule_applied``:
    the policy came from the rule (request ``policy="auto"``), not forced, so a slower pick gets a note."""
    p, st = mp.prediction, mp.pack
    return PredictResponse(
        documents=int(mp.lengths.size),
        empty_documents=int(st.docs_empty),
        tokens=int(st.tokens_in),
        max_seqlen=int(p.max_len),
        packing=PackingSummary(
            capacity=int(st.capacity),
            rows=int(st.rows),
            fill=float(st.fill),
            segments=int(mp.seqlens.size),
            documents_split=int(st.docs_split),
            documents_dropped=int(st.docs_dropped),
            tokens_dropped=int(st.tokens_dropped),
        ),
        visible_pairs=int(p.pairs),
        flops=float(p.flops),
        work_items=int(p.items),
        tiles=int(p.tiles),
        policy=p.policy,
        policy_reason=p.reason,
        policy_note=slower_choice_note(f"rule: {p.policy}", p.predicted_ms, p.static_ms, p.dynamic_ms)
        if rule_applied else None,
        predicted_ms=PredictedMs(static=p.static_ms, dynamic=p.dynamic_ms, chosen=p.predicted_ms),
        memory=MemoryEstimate(
            packed_bytes=int(p.memory_packed_bytes),
            padded_bytes=int(p.memory_padded_bytes),
            padded_over_packed=float(p.memory_padded_bytes) / max(float(p.memory_packed_bytes), 1.0),
        ),
        gpu=p.gpu,
        num_sms=int(p.num_sms),
        calibration_version=str(p.calibration_version),
        calibration_measured=bool(p.calibration_measured),
    )


@router.post(
    "/cost:predict",
    response_model=PredictResponse,
    responses=ERRORS,
    summary="Predict the attention cost and time of a document-length mix",
    openapi_extra=json_body_openapi(PredictRequest),
)
async def predict_cost(
    req: PredictRequest = Depends(JsonBody(PredictRequest)), state: ServiceState = Depends(get_state)
) -> PredictResponse:
    """Pack the mix (best-fit-decreasing, rows of ``capacity``), build the work list, simulate the
    static and dynamic schedules with the calibrated cost model and report everything ``flamia
    plan`` reports (one training call: forward + backward). 400 for an impossible mix."""
    calibration = state.calibration

    def work() -> PredictResponse:
        lengths = state.lengths_of(req)
        params = state.params_of(req)
        mp = predict_mix(lengths, params, calibration=calibration, max_segments=state.settings.max_segments)
        return to_response(mp, rule_applied=params.policy == "auto")

    return await offload(work, state.settings.request_timeout_s)
