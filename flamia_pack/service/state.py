"""Process state of the service (built in the app's lifespan) and the FastAPI dependencies on it.

:class:`ServiceState` holds the settings, the run store, the dispatcher, the calibration table in
use (swapped atomically by a refit) and the one-run-at-a-time lock. Routes get it through
:func:`get_state`; the dispatcher through :func:`get_dispatcher`, which tests replace with
``app.dependency_overrides[get_dispatcher] = lambda: FakeDispatcher()``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastapi import Request

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.simulate import CalibrationTable
from flamia_pack.service.dispatch import Dispatcher
from flamia_pack.service.engine import MixParams
from flamia_pack.service.mix import MixLimits, lengths_from_histogram, lengths_from_list, lengths_from_lognormal
from flamia_pack.service.models import PredictRequest
from flamia_pack.service.settings import Settings
from flamia_pack.service.store import RunStore

import numpy as np


@dataclass
class ServiceState:
    """Everything the routes share (one per app instance)."""

    settings: Settings
    store: RunStore
    dispatcher: Dispatcher
    calibration: CalibrationTable
    shipped_version: str
    gpu_available: bool = False
    gpu_detail: str = "not checked"
    run_lock: threading.Lock = field(default_factory=threading.Lock)
    refit_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def limits(self) -> MixLimits:
        """Per-request mix limits from the settings."""
        return MixLimits(max_documents=self.settings.max_documents, max_tokens=self.settings.max_tokens)

    def lengths_of(self, req: PredictRequest) -> np.ndarray:
        """The request's mix as int64 lengths (limits checked first).

        Raises:
            FlamiaError: over a limit, or an impossible distribution.
        """
        lim = self.limits
        if req.lengths is not None:
            return lengths_from_list(req.lengths, lim)
        if req.histogram is not None:
            return lengths_from_histogram(req.histogram, lim)
        d = req.distribution
        assert d is not None  # the model guarantees exactly one mix
        return lengths_from_lognormal(
            mu=d.mu, sigma=d.sigma, total_tokens=d.total_tokens, seed=d.seed,
            min_len=d.min_len, max_len=d.max_len, limits=lim,
        )

    def params_of(self, req: PredictRequest) -> MixParams:
        """The request's shape and options (service defaults applied).

        Raises:
            FlamiaError: capacity over the limit, heads not divisible.
        """
        if req.capacity > self.settings.max_capacity:
            raise FlamiaError(
                f"capacity {req.capacity} is larger than this service allows ({self.settings.max_capacity})"
            )
        return MixParams(
            num_heads=req.num_heads,
            num_kv_heads=req.num_kv_heads,
            head_dim=req.head_dim,
            causal=req.causal,
            precision=req.precision,
            capacity=req.capacity,
            long_docs=req.long_docs,
            gpu=req.gpu or self.settings.default_gpu,
            policy=req.policy,
        )


def get_state(request: Request) -> ServiceState:
    """FastAPI dependency: the app's :class:`ServiceState` (set in the lifespan)."""
    return request.app.state.service


def get_dispatcher(request: Request) -> Dispatcher:
    """FastAPI dependency: the dispatcher of ``POST /v1/runs`` (override it in tests)."""
    return request.app.state.service.dispatcher
