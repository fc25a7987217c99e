"""``GET /`` and ``POST /``: the HTML page (form + server-rendered SVG pictures)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from flamia_pack.service.page import FormError, parse_form, render_page
from flamia_pack.service.routes.common import offload
from flamia_pack.service.state import ServiceState, get_state

router = APIRouter(tags=["page"], include_in_schema=False)


@router.get("/", response_class=HTMLResponse)
async def page(state: ServiceState = Depends(get_state)) -> HTMLResponse:
    """The form with defaults and the predicted-vs-measured history."""
    text, status = await offload(lambda: render_page(state), state.settings.request_timeout_s)
    return HTMLResponse(text, status_code=status)


@router.post("/", response_class=HTMLResponse)
async def page_submit(request: Request, state: ServiceState = Depends(get_state)) -> HTMLResponse:
    """The form posted back: the same page with the prediction and its pictures (400 with the reason
    shown on the page when the form describes an impossible mix)."""
    body = await request.body()
    try:
        form = parse_form(body, request.headers.get("content-type"))
    except FormError as exc:
        import html

        return HTMLResponse(f"<!doctype html><p class='error'>{html.escape(str(exc))}</p>", status_code=400)
    text, status = await offload(lambda: render_page(state, form, compute=True), state.settings.request_timeout_s)
    return HTMLResponse(text, status_code=status)
