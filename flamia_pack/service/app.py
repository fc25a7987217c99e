"""FastAPI app factory of the cost-prediction service (DESIGN.md §1.5).

``create_app(settings=None, dispatcher=None)`` builds an app; ``flamia serve`` runs it with uvicorn.
Heavy resources live in the lifespan: the calibration table (shipped, or the newest refit stored
in the database), the run store, the JIT warm-up of the packer/scheduler and the GPU check.

Routes (one ``APIRouter`` per resource, ``flamia_pack.service.routes``)::

    GET  /healthz                   liveness, calibration version, GPU check, runs recorded
    POST /v1/cost:predict           mix -> packing, work, policy, predicted ms (static, dynamic)
    POST /v1/runs                   predict, then time a real training call on the local GPU
    GET  /v1/runs, /v1/runs/{id}    recorded runs (SQLite)
    POST /v1/calibration:refit      least-squares refit of (a, b) from the runs, new version
    GET  /, POST /                  HTML page (form + SVG pictures); OpenAPI at /docs (Swagger UI), /redoc

The /docs and /redoc pages load Swagger UI / ReDoc from this server (``/static-docs``, the assets
shipped in the ``fastapi-offline`` wheel, FastAPI's "self-hosting JavaScript and CSS for docs"
recipe), not from a CDN, so they work offline.

Status codes: 422 schema errors (pydantic), 400 impossible mixes (``FlamiaError``, with the reason),
404 unknown run, 409 busy / nothing to refit, 413 body too large (FastAPI ``max_body_size``), 503 no GPU, 504 past the request
timeout. A 500 means a bug (or a failing device), never bad input.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import flamia_pack
from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.simulate import load_calibration
from flamia_pack.service.calibration import table_from_json
from flamia_pack.service.dispatch import Dispatcher, GpuDispatcher
from flamia_pack.service.engine import MixParams, predict_mix
from flamia_pack.service.models import PredictRequest, RunRequest
from flamia_pack.service.routes import calibration, cost, health, page, runs
from flamia_pack.service.settings import Settings, get_settings
from flamia_pack.service.state import ServiceState
from flamia_pack.service.store import RunStore

__all__ = ["create_app"]

log = logging.getLogger("flamia_pack.service")


class TimeoutMiddleware:
    """Pure-ASGI wall-clock limit per request: 504 when the app has not answered in time (the
    compute runs in abandon-on-cancel threads, so the cancellation is immediate). ``POST /v1/runs``
    gets the longer run timeout. (Body size is limited by FastAPI's own ``max_body_size``: 413.)"""

    def __init__(self, app: ASGIApp, *, timeout_s: float, run_timeout_s: float) -> None:
        self.app = app
        self.timeout_s = float(timeout_s)
        self.run_timeout_s = float(run_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        is_run = scope.get("method") == "POST" and scope.get("path") == "/v1/runs"
        # the routes enforce the exact limits (504 from inside); this is the backstop
        timeout = (self.run_timeout_s if is_run else self.timeout_s) + 1.0
        try:
            with anyio.fail_after(timeout):
                await self.app(scope, receive, tracked_send)
        except TimeoutError:
            if not started:
                resp = JSONResponse({"detail": f"request took longer than {timeout - 1.0:g} s"}, status_code=504)
                await resp(scope, receive, send)


def _load_table(settings: Settings, store: RunStore):
    shipped = load_calibration(settings.calibration_path)
    latest = store.latest_calibration()
    if latest is not None:
        version, raw = latest
        try:
            table = table_from_json(raw)
            if table.version.split("+refit", 1)[0] == shipped.version.split("+refit", 1)[0]:
                return table, shipped.version
            log.warning("stored refit %s is based on another calibration than %s; using the latter", version, shipped.version)
        except FlamiaError as exc:
            log.warning("ignoring stored refit %s: %s", version, exc)
    return shipped, shipped.version


DOCS_STATIC_URL = "/static-docs"
"""Where the Swagger UI / ReDoc assets are served."""


def _add_offline_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI 5), its OAuth2 redirect and ``/redoc`` with JS/CSS/favicon served locally.

    FastAPI's self-hosting recipe (``docs_url=None`` + :func:`get_swagger_ui_html` pointing at
    :class:`StaticFiles`); the files are the ``fastapi_offline`` package's copies of swagger-ui-dist
    (Apache-2.0) and redoc (MIT). ``root_path`` is honoured as in FastAPI's own pages.
    """
    from importlib.resources import files

    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
    from fastapi.responses import HTMLResponse
    from fastapi.staticfiles import StaticFiles

    static_dir = files("fastapi_offline") / "static"
    app.mount(DOCS_STATIC_URL, StaticFiles(directory=str(static_dir)), name="static-docs")
    oauth2_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{oauth2_url}",
            swagger_js_url=f"{root}{DOCS_STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png",
            # no validator badge: it would load an image from validator.swagger.io
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
        )

    @app.get(oauth2_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_STATIC_URL}/favicon.png", with_google_fonts=False,
        )


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: limits and paths (default: :func:`get_settings`, i.e. ``FLAMIA_*`` variables).
        dispatcher: runs ``POST /v1/runs`` (default :class:`GpuDispatcher`; tests also can use
            ``app.dependency_overrides[get_dispatcher]``).

    Returns:
        A ``FastAPI`` app; its lifespan opens the store, loads the calibration, warms the JIT and
        checks the GPU. ``app.state.service`` is the :class:`ServiceState` while it runs.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        def start() -> ServiceState:
            store = RunStore(settings.db_path)
            table, shipped_version = _load_table(settings, store)
            disp = dispatcher or GpuDispatcher()
            ok, detail = disp.availability()
            if settings.warmup_on_start:  # compile/load the numba kernels before the first request
                predict_mix(np.array([300, 5, 0, 70000]), MixParams(gpu=settings.default_gpu), calibration=table,
                            max_intervals=10_000)
            return ServiceState(settings=settings, store=store, dispatcher=disp, calibration=table,
                                shipped_version=shipped_version, gpu_available=ok, gpu_detail=detail)

        app.state.service = await anyio.to_thread.run_sync(start)
        log.info("flamia service ready: calibration %s, GPU: %s", app.state.service.calibration.version,
                 app.state.service.gpu_detail)
        yield

    app = FastAPI(
        title="flamia_pack service",
        version=flamia_pack.__version__,
        summary="Attention cost/time prediction for document-length mixes, and dispatch to the local GPU.",
        description=(
            "Predicts packing, work, the static-vs-dynamic policy and the time of one packed causal attention "
            "training call for a proposed document-length mix, with the scheduler's simulator (the code behind "
            "`flamia plan`), and times real calls on the local GPU."
        ),
        lifespan=lifespan,
        max_body_size=settings.max_body_bytes,
        docs_url=None,  # served below from local assets (no CDN)
        redoc_url=None,
    )
    _add_offline_docs(app)
    app.add_middleware(TimeoutMiddleware, timeout_s=settings.request_timeout_s, run_timeout_s=settings.run_timeout_s)

    @app.exception_handler(FlamiaError)
    async def _bad_mix(request: Request, exc: FlamiaError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # like FastAPI's default, without echoing the (possibly huge) input back
        errs: list[dict[str, Any]] = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()[:20]
        ]
        return JSONResponse({"detail": jsonable_encoder(errs)}, status_code=422)

    for r in (health.router, cost.router, runs.router, calibration.router, page.router):
        app.include_router(r)

    def openapi() -> dict[str, Any]:
        # request bodies parsed by JsonBody are documented by reference; add their schemas
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in (PredictRequest, RunRequest)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
