"""Service settings, read from the environment (prefix ``FLAMIA_``) by pydantic-settings.

Every field can be set as ``FLAMIA_<FIELD>`` (case-insensitive), e.g. ``FLAMIA_DB_PATH=/var/lib/
flamia/runs.sqlite3`` or ``FLAMIA_MAX_DOCUMENTS=262144``. :func:`get_settings` caches one instance
(``lru_cache``) and is the FastAPI dependency; tests pass their own ``Settings`` to
``create_app(settings)`` instead of touching the environment.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Limits, paths and defaults of the cost-prediction service (DESIGN.md §1.5)."""

    model_config = SettingsConfigDict(env_prefix="FLAMIA_", extra="ignore", frozen=True)

    db_path: Path = Field(
        Path("flamia_runs.db"),
        description="SQLite file holding recorded runs and refitted calibration tables (created on start).",
    )
    calibration_path: Path | None = Field(
        None,
        description="Calibration JSON to start from; None = the table shipped with flamia_pack.scheduler. "
        "It is only read, never written: refits are stored in the database.",
    )
    default_gpu: str = Field("H200", description="GPU whose calibration a request without `gpu` uses.")
    max_documents: int = Field(131_072, ge=1, description="Most documents one request may describe.")
    max_tokens: int = Field(16_777_216, ge=1, description="Most tokens (sum of lengths) one request may describe.")
    max_segments: int = Field(
        262_144, ge=1, description="Most row pieces a mix may become when documents are split at row ends."
    )
    max_capacity: int = Field(1 << 22, ge=1, description="Largest row capacity a request may ask for.")
    max_run_tokens: int = Field(1 << 20, ge=1, description="Most tokens a dispatched GPU run may allocate.")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body in bytes (413 above it)."
    )
    request_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one request (504 above it).")
    run_timeout_s: float = Field(300.0, gt=0, description="Wall-clock limit of one dispatched run.")
    run_warmup: int = Field(3, ge=0, le=100, description="Untimed training calls before timing a run.")
    run_repeats: int = Field(10, ge=1, le=1000, description="Timed training calls of a run (median reported).")
    gantt_max_sms: int = Field(64, ge=1, le=1024, description="Most SMs drawn in a Gantt chart (evenly sampled).")
    gantt_max_bars_per_sm: int = Field(
        48, ge=1, le=10_000, description="Most bars per SM lane; consecutive items are merged above it."
    )
    page_max_units: int = Field(
        600_000, ge=0, description="Most (item, head) units whose intervals the page keeps for a Gantt chart; "
        "above it the chart shows per-SM busy time only."
    )
    warmup_on_start: bool = Field(True, description="Run one tiny prediction in lifespan (JIT warm-up).")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Return the process-wide :class:`Settings` read from the environment (cached)."""
    return Settings()
