"""Property-based API test of the service with schemathesis (4.x) against its own OpenAPI schema.

The app runs in-process (ASGI, lifespan started by schemathesis) with a temporary database, a fake
dispatcher (no GPU on CI) and small per-request limits so every generated request is cheap. Every
operation gets a bounded number of generated cases (positive and negative data); the checks are
that no answer is a server error and that every answer matches the documented status codes,
content types and response schemas.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks  # noqa: E402

from flamia_pack.service.app import create_app  # noqa: E402
from flamia_pack.service.dispatch import Measurement, RunSpec  # noqa: E402
from flamia_pack.service.settings import Settings  # noqa: E402


class _FixedDispatcher:
    """CPU stand-in for the GPU: 'measures' 1 ms + 1 us per token, instantly."""

    def availability(self):
        return True, "FakeGPU (schemathesis)"

    def run(self, spec: RunSpec) -> Measurement:
        ms = 1.0 + 1e-3 * spec.total_tokens
        return Measurement(measured_ms=ms, times_ms=(ms,), device_name="FakeGPU", peak_bytes=0)


_DB_DIR = Path(tempfile.mkdtemp(prefix="flamia-schemathesis-"))
atexit.register(shutil.rmtree, _DB_DIR, ignore_errors=True)
_APP = create_app(
    Settings(
        db_path=_DB_DIR / "runs.db",
        max_documents=4096,
        max_tokens=1 << 20,
        max_run_tokens=1 << 18,
        max_body_bytes=256 * 1024,
        request_timeout_s=20.0,
    ),
    dispatcher=_FixedDispatcher(),
)
schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    print_blob=True,
)
def test_api_conforms_and_never_errors(case):
    case.call_and_validate(checks=CHECKS)
