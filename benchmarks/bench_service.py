"""Latency and throughput of ``POST /v1/cost:predict`` on loopback (issue 7 benchmark).

Starts ``flamia serve`` (uvicorn, one process) in a subprocess on 127.0.0.1 and drives it with a
small keep-alive HTTP/1.1 client written on asyncio streams (so the load generator costs little of
the machine's two cores). Load is bounded: each scenario sends at most ``--requests`` requests
and runs at most ``--seconds`` seconds after ``--warmup`` untimed requests. Latency is measured
per request from the first byte sent to the last byte of the answer; throughput is completed
requests over wall time. Every answer must be 200 (the script fails otherwise).

Mixes (lengths drawn once with numpy, sent as JSON):

- ``1k``        1,000 documents, lognormal(mu=4, sigma=1) clipped to [16, 32768], seed 0, as ``lengths``
- ``131k``      131,072 documents, same distribution, seed 1, as ``lengths`` (the large-mix target)
- ``131k-S1``   131,072 one-token documents (WORKLOADS.md S1), as ``lengths``
- ``131k-hist`` the ``131k`` mix sent as a ``histogram`` (same documents, small body)

Targets (issue 7): p99 <= 50 ms for 131,072 documents; >= 500 requests/s for the small mix.

Usage::

    .venv/bin/python benchmarks/bench_service.py [--requests 400] [--seconds 20] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def lognormal_mix(n: int, seed: int, mu: float = 4.0, sigma: float = 1.0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 16, 32768).astype(np.int64).tolist()


def histogram_of(lengths: list[int]) -> list[list[int]]:
    vals, counts = np.unique(np.asarray(lengths), return_counts=True)
    return [[int(v), int(c)] for v, c in zip(vals, counts)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, db: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, FLAMIA_DB_PATH=str(db), **extra_env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "flamia_pack.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


async def _one(reader, writer, request: bytes) -> tuple[float, int, bytes]:
    t0 = time.perf_counter()
    writer.write(request)
    await writer.drain()
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
    body = await reader.readexactly(length)
    return time.perf_counter() - t0, status, body


async def drive(port: int, body: bytes, *, requests: int, seconds: float, warmup: int, concurrency: int):
    req = (b"POST /v1/cost:predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
    first = None
    for i in range(warmup):
        _, status, b = await _one(*conns[i % concurrency], req)
        if status != 200:
            raise SystemExit(f"warm-up request failed: {status} {b[:300]!r}")
        first = b
    lat: list[float] = []
    sent = 0
    t_start = time.perf_counter()
    deadline = t_start + seconds

    async def worker(reader, writer):
        nonlocal sent
        while sent < requests and time.perf_counter() < deadline:
            sent += 1
            dt, status, b = await _one(reader, writer, req)
            if status != 200:
                raise SystemExit(f"request failed: {status} {b[:300]!r}")
            lat.append(dt)

    await asyncio.gather(*(worker(r, w) for r, w in conns))
    wall = time.perf_counter() - t_start
    for _, w in conns:
        w.close()
    return lat, wall, json.loads(first) if first else {}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="most timed requests per scenario")
    ap.add_argument("--seconds", type=float, default=20.0, help="most seconds per scenario")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4, help="keep-alive connections for the small mix")
    ap.add_argument("--only", default="", help="comma-separated scenario names to run")
    args = ap.parse_args()

    small = lognormal_mix(1000, 0)
    big = lognormal_mix(131_072, 1)
    scenarios = [
        ("1k", {"lengths": small}, args.concurrency),
        ("1k-c1", {"lengths": small}, 1),
        ("131k", {"lengths": big}, 2),
        ("131k-c1", {"lengths": big}, 1),
        ("131k-S1", {"lengths": [1] * 131_072}, 1),
        ("131k-hist", {"histogram": histogram_of(big)}, 1),
    ]
    if args.only:
        keep = set(args.only.split(","))
        scenarios = [s for s in scenarios if s[0] in keep]
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        proc = start_server(port, Path(d) / "runs.db", {})
        try:
            rows = []
            for name, payload, conc in scenarios:
                body = json.dumps(payload, separators=(",", ":")).encode()
                lat, wall, answer = asyncio.run(drive(port, body, requests=args.requests, seconds=args.seconds,
                                                      warmup=args.warmup, concurrency=conc))
                rows.append((name, answer.get("documents"), answer.get("tokens"), answer.get("work_items"),
                             len(body), conc, len(lat), pct(lat, 50), pct(lat, 99), max(lat) * 1e3, len(lat) / wall,
                             answer.get("predicted_ms", {}).get("chosen")))
                print(f"{name}: done", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(20)
    cpu = os.cpu_count()
    print(f"\nPOST /v1/cost:predict on loopback (uvicorn 1 process, {cpu} CPU cores shared with the client)\n")
    hdr = ("mix", "docs", "tokens", "items", "body B", "conns", "n", "p50 ms", "p99 ms", "max ms", "req/s", "pred ms")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        name, docs, toks, items, blen, conc, n, p50, p99, mx, rps, pms = r
        print(f"| {name} | {docs:,} | {toks:,} | {items:,} | {blen:,} | {conc} | {n} | {p50:.2f} | {p99:.2f} | "
              f"{mx:.2f} | {rps:.0f} | {pms:.3f} |")


if __name__ == "__main__":
    main()
