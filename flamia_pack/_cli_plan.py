"""Input readers and formatting helpers of ``flamia plan`` (the command itself is in :mod:`flamia_pack.cli`).

Imports stay inside the functions, so that importing the CLI stays fast.
"""
from __future__ import annotations


def _plan_read_lengths_file(path: str):
    """Document lengths from a text file: one positive integer per line ('#' comments, blanks ok).

    Raises:
        SourceError: not UTF-8 text (e.g. a parquet file), a line that is not an integer, a length < 1
            or >= 2**31, or no lengths at all.
        OSError: the file cannot be opened.
    """
    import numpy as np

    from flamia_pack.errors import SourceError

    out = []
    with open(path, encoding="utf-8") as f:
        try:
            for no, line in enumerate(f, 1):
                s = line.split("#", 1)[0].strip()
                if not s:
                    continue
                try:
                    v = int(s)
                except ValueError:
                    raise SourceError(f"{path}:{no}: expected one document length (integer) per line, got {s[:40]!r}") from None
                if v < 1:
                    raise SourceError(f"{path}:{no}: document lengths must be >= 1, got {v}")
                if v > 2 ** 31 - 1:
                    raise SourceError(f"{path}:{no}: document lengths must fit int32 offsets (at most 2**31 - 1 = "
                                      f"{2 ** 31 - 1:,} tokens), got {v:,}")
                out.append(v)
        except UnicodeDecodeError:
            raise SourceError(f"{path}: not a UTF-8 text file; SOURCE must be a text file with one document "
                              "length per line or a packed dataset directory (manifest.json + parquet shards)") from None
    if not out:
        raise SourceError(f"{path}: no document lengths found (one integer per line)")
    return [np.asarray(out, dtype=np.int64)], None


def _plan_read_packed_dir(path: str, max_rows: int | None):
    """Per-row document lengths from a packed dataset directory (manifest.json + parquet shards)."""
    import pathlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flamia_pack import formats
    from flamia_pack.errors import FormatError

    man = formats.read_manifest(path)
    rows = []
    for shard in man.shards:
        p = pathlib.Path(path) / shard.file
        if not p.is_file():
            raise FormatError(f"shard {shard.file} listed in {pathlib.Path(path) / 'manifest.json'} is missing; "
                              "re-run `flamia pack` to rebuild the directory")
        try:
            formats.check_shard_schema(p, pq.read_schema(p), columns=["cu_seqlens"], manifest=man)
            col = pq.read_table(p, columns=["cu_seqlens"]).column("cu_seqlens").combine_chunks()
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot read cu_seqlens from {p}: {' '.join(str(e).split())}") from None
        offs = col.offsets.to_numpy()
        vals = col.values.to_numpy(zero_copy_only=False).astype(np.int64)
        for r in range(len(col)):
            cu = vals[offs[r]:offs[r + 1]]
            lens = np.diff(cu)
            if lens.size and lens.min() < 1 or (cu.size and cu[0] != 0):
                raise FormatError(f"{p}: row {r} has invalid cu_seqlens")
            rows.append(lens)
            if max_rows is not None and len(rows) >= max_rows:
                return rows, int(man.capacity)
    if not rows:
        raise FormatError(f"{path}: the packed dataset has no rows")
    return rows, int(man.capacity)


def _plan_fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _plan_rows_reason(preds) -> str:
    """Policy reason over several rows: how many rows got each policy, with the first such row's reason.

    (Joining every row's reason made one unreadable line cut at 500 characters, since each row's
    reason carries its own numbers.) Per-row reasons stay in ``--json``'s ``per_row``.
    """
    parts = []
    for pol in sorted({p.policy for p in preds}):
        rows = [i for i, p in enumerate(preds) if p.policy == pol]
        parts.append(f"{pol} on {len(rows)} of {len(preds)} rows (e.g. row {rows[0]}: {preds[rows[0]].reason})")
    return "; ".join(parts)


def _plan_policy_note(summary: dict, policy: str) -> str | None:
    """When the rule (``--policy auto``) picked the schedule the simulator predicts slower, say so
    (``scheduler.policy.slower_choice_note``; None otherwise)."""
    from flamia_pack.scheduler.policy import slower_choice_note

    if policy not in (None, "auto"):
        return None
    if summary["policy"] == "mixed":
        rule, suffix = "rule: static or dynamic per row", " on every row"
    else:
        kind = ("causal" if summary["settings"]["causal"] else
                "non-causal, skewed" if summary["policy"] == "dynamic" else "non-causal, balanced")
        rule, suffix = f"rule: {kind} -> {summary['policy']}", ""
    return slower_choice_note(rule, summary["predicted_ms"], summary["static_ms"], summary["dynamic_ms"], suffix)
