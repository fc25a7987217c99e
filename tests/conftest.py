"""Shared pytest fixtures and the GPU marker: tests marked ``gpu`` skip cleanly without CUDA."""
from __future__ import annotations

import os

# Under pytest-xdist (`make test` runs `-n 2`) each worker gets its share of the cores for torch's
# intra-op threads, and so do the subprocesses it starts (OMP_NUM_THREADS is inherited): two workers
# with a full-size pool each oversubscribe a 2-core machine (measured there: the suite in 2:28-2:33 with
# one thread per worker, 3:17 with two). An OMP_NUM_THREADS the caller set is kept.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _XDIST_WORKERS:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _XDIST_WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _XDIST_WORKERS and os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def pytest_collection_modifyitems(config, items):
    if _XDIST_WORKERS:
        # the tests marked slow (the Triton-interpreter runs, 7-75 s each) start first, one per free
        # worker, so that none of them is left to run alone at the end; a stable sort keeps the rest in
        # file order (each worker collects the same order, as xdist requires)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def run_interpreter():
    """A runner for the Triton-interpreter tests: ``run(script, *args, timeout=600) -> dict``.

    Runs ``python -c script *args`` in a fresh process with ``TRITON_INTERPRET=1``, the repository on
    ``PYTHONPATH`` and ``FLAMIA_ATTN_CONFIG`` unset (the scripts choose their configs), asserts that it
    exited 0 and printed a ``RESULTS <json>`` line, and returns the last one's JSON. Skips the test
    when triton is not installed."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(script: str, *args: str, timeout: int = 600):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("FLAMIA_ATTN_CONFIG", None)
        proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True,
                              text=True, timeout=timeout)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert proc.returncode == 0 and line, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return json.loads(line[-1][len("RESULTS "):])

    return run
