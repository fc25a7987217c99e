"""Embedded SQLite store of dispatched runs and refitted calibration tables.

Standard-library ``sqlite3`` only (no web imports). One connection per operation (cheap, and safe
from any thread: FastAPI runs sync work in a thread pool), WAL journal, every write in a
transaction. The schema is created on open; ``PRAGMA user_version`` records its version.

Tables::

    runs(id, created_at, gpu, device_name, precision, head_dim, num_heads, num_kv_heads, causal,
         documents, tokens, work_items, tiles, policy, predicted_ms, measured_ms, error_pct,
         calibration_version, crit_tiles, crit_items, request_json, seqlens)
    calibrations(version, created_at, previous_version, table_json)

``crit_tiles`` / ``crit_items`` are the visible tiles and items of the busiest SM of the chosen
schedule at prediction time: for that schedule the makespan is ``a * crit_tiles + b * crit_items``,
which is what :func:`flamia_pack.service.calibration.refit` fits by least squares. ``seqlens`` is
the call's segment lengths (int32 little-endian bytes) so a refit can re-simulate the schedule.
"""
from __future__ import annotations

import json
import sqlite3
from contextlib import closing, contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    gpu TEXT NOT NULL,
    device_name TEXT NOT NULL,
    precision TEXT NOT NULL,
    head_dim INTEGER NOT NULL,
    num_heads INTEGER NOT NULL,
    num_kv_heads INTEGER NOT NULL,
    causal INTEGER NOT NULL,
    documents INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    work_items INTEGER NOT NULL,
    tiles INTEGER NOT NULL,
    policy TEXT NOT NULL,
    predicted_ms REAL NOT NULL,
    measured_ms REAL NOT NULL,
    error_pct REAL NOT NULL,
    calibration_version TEXT NOT NULL,
    crit_tiles REAL NOT NULL,
    crit_items REAL NOT NULL,
    request_json TEXT NOT NULL,
    seqlens BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS calibrations (
    version TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    previous_version TEXT NOT NULL,
    table_json TEXT NOT NULL
);
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRow:
    """One row of ``runs`` (see the module docstring; times in ms, ``error_pct`` signed)."""

    gpu: str
    device_name: str
    precision: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    causal: bool
    documents: int
    tokens: int
    work_items: int
    tiles: int
    policy: str
    predicted_ms: float
    measured_ms: float
    error_pct: float
    calibration_version: str
    crit_tiles: float
    crit_items: float
    request_json: str
    seqlens: bytes = b""
    id: int | None = None
    created_at: str | None = None


_COLUMNS = [f.name for f in fields(RunRow) if f.name not in ("id", "created_at")]
_PUBLIC = [c for c in _COLUMNS if c not in ("crit_tiles", "crit_items", "request_json", "seqlens")]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class RunStore:
    """Runs and calibration tables in one SQLite file.

    Args:
        path: database file (parent directories are created); ``":memory:"`` is not supported
            because every operation opens its own connection.

    Raises:
        OSError / sqlite3.Error: the file cannot be created or is not a database.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._tx() as con:
            con.executescript(_SCHEMA)
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        with closing(sqlite3.connect(self.path)) as con:
            con.execute("PRAGMA journal_mode=WAL")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=10.0)
        con.row_factory = sqlite3.Row
        try:
            with con:  # commit on success, roll back on error
                yield con
        finally:
            con.close()

    # ---- runs -------------------------------------------------------------------------------
    def add_run(self, run: RunRow) -> RunRow:
        """Insert ``run`` and return it with ``id`` and ``created_at`` set."""
        created = _now()
        values = [getattr(run, c) for c in _COLUMNS]
        with self._tx() as con:
            cur = con.execute(
                f"INSERT INTO runs (created_at, {', '.join(_COLUMNS)}) VALUES (?, {', '.join('?' * len(_COLUMNS))})",
                [created, *[int(v) if isinstance(v, bool) else v for v in values]],
            )
            run_id = int(cur.lastrowid)
        return self.get_run(run_id)  # type: ignore[return-value]

    def _row(self, r: sqlite3.Row) -> RunRow:
        d = dict(r)
        d["causal"] = bool(d["causal"])
        d["seqlens"] = bytes(d["seqlens"])
        return RunRow(**d)

    def get_run(self, run_id: int) -> RunRow | None:
        """The run with this id, or None."""
        with self._tx() as con:
            r = con.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
        return None if r is None else self._row(r)

    def list_runs(self, *, limit: int = 100, offset: int = 0) -> tuple[list[RunRow], int]:
        """Runs newest first (``limit``/``offset`` paging) and the total count.

        ``request_json`` and ``seqlens`` are not read (they can be large); they come back empty.
        """
        cols = ", ".join(["id", "created_at", *_PUBLIC, "crit_tiles", "crit_items"])
        with self._tx() as con:
            rows = con.execute(
                f"SELECT {cols}, '' AS request_json, X'' AS seqlens FROM runs ORDER BY id DESC LIMIT ? OFFSET ?",
                (int(limit), int(offset)),
            ).fetchall()
            total = int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        return [self._row(r) for r in rows], total

    def all_runs(self) -> list[RunRow]:
        """Every run, oldest first, with ``seqlens`` (for a refit)."""
        with self._tx() as con:
            rows = con.execute("SELECT * FROM runs ORDER BY id").fetchall()
        return [self._row(r) for r in rows]

    def count_runs(self) -> int:
        """Number of recorded runs."""
        with self._tx() as con:
            return int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    # ---- calibration tables -----------------------------------------------------------------
    def save_calibration(self, version: str, previous_version: str, table: dict[str, Any]) -> None:
        """Store a refitted calibration table (JSON-serialisable dict) under a new version.

        Raises:
            sqlite3.IntegrityError: the version already exists.
        """
        with self._tx() as con:
            con.execute(
                "INSERT INTO calibrations (version, created_at, previous_version, table_json) VALUES (?, ?, ?, ?)",
                (version, _now(), previous_version, json.dumps(table, sort_keys=True)),
            )

    def latest_calibration(self) -> tuple[str, dict[str, Any]] | None:
        """``(version, table)`` of the newest refit, or None when there is none."""
        with self._tx() as con:
            r = con.execute(
                "SELECT version, table_json FROM calibrations ORDER BY created_at DESC, rowid DESC LIMIT 1"
            ).fetchone()
        return None if r is None else (str(r["version"]), json.loads(r["table_json"]))

    def count_calibrations(self) -> int:
        """Number of stored refits."""
        with self._tx() as con:
            return int(con.execute("SELECT COUNT(*) FROM calibrations").fetchone()[0])
