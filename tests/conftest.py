"""Shared pytest fixtures and the GPU marker: tests marked ``gpu`` skip cleanly without CUDA."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
