"""Helpers shared by the routers: error answers documented in OpenAPI and the thread-offload rule."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from flamia_pack.service.models import ErrorBody, ValidationErrorBody

T = TypeVar("T")

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "A well-formed request describing an impossible mix (reason in detail)."},
    422: {"model": ValidationErrorBody, "description": "The body does not match the schema (or is not JSON)."},
    413: {
        "description": "Request body larger than the service accepts (FLAMIA_MAX_BODY_BYTES).",
        "content": {"text/plain": {"schema": {"type": "string"}}, "application/json": {"schema": {"type": "object"}}},
    },
    504: {"model": ErrorBody, "description": "The request took longer than the service's request timeout."},
}


async def offload(fn: Callable[[], T], timeout_s: float) -> T:
    """Run blocking ``fn`` in a worker thread with a deadline.

    The numba/numpy work releases the GIL, so two requests use both cores. On timeout the
    request answers 504 at once (``abandon_on_cancel``); the thread finishes in the background.

    Raises:
        HTTPException: 504 past ``timeout_s``.
    """
    try:
        with anyio.fail_after(timeout_s):
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    except TimeoutError:
        raise HTTPException(status_code=504, detail=f"request took longer than {timeout_s:g} s") from None


async def run_owning_lock(lock: threading.Lock, fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in its own thread that releases ``lock`` (already acquired by the caller) when
    ``fn`` ends -- even if the request gives up first (504), so the lock always means "work still
    running" (one GPU run / one refit at a time).

    Raises:
        HTTPException: 504 past ``timeout_s`` (the work goes on in the background).
        BaseException: whatever ``fn`` raised.
    """
    box: dict[str, object] = {}
    done = threading.Event()

    def job() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the request below
            box["error"] = exc
        finally:
            lock.release()
            done.set()

    try:
        threading.Thread(target=job, name="flamia-owned-work", daemon=True).start()
    except BaseException:
        lock.release()
        raise
    await offload(done.wait, timeout_s)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


class JsonBody:
    """FastAPI dependency: the request body validated straight from its bytes by pydantic-core
    (``model_validate_json``, strict: JSON types must match the schema), skipping FastAPI's
    ``json.loads`` + dict validation pass -- for a 131,072-length list that is ~5 ms less per
    request. Errors are the
    same 422 as FastAPI's (``loc`` starts with ``"body"``). The route documents the body with
    :func:`json_body_openapi` and the app adds the model to the OpenAPI components.
    """

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model

    async def __call__(self, request: Request) -> BaseModel:
        ctype = request.headers.get("content-type", "")
        main = ctype.split(";", 1)[0].strip().lower()
        if not (main == "application/json" or (main.startswith("application/") and main.endswith("+json"))):
            raise RequestValidationError(
                [{"type": "content_type", "loc": ("body",), "msg": f"expected an application/json body, got {ctype!r}",
                  "input": None}]
            )
        body = await request.body()
        try:
            # strict: JSON types must match the schema (no "12" or true for an integer, no "yes"
            # for a boolean); numbers for float fields may still be written as integers
            return self.model.model_validate_json(body, strict=True)
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
            ) from None


def json_body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a required JSON body of ``model`` (a components reference)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }
