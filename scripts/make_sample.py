"""Build the bundled sample corpus ``flamia_pack/data/python-stdlib.parquet`` reproducibly.

The sample is real text with a heavy-tailed length distribution: the source files (``*.py``) and
plain-text files (``*.txt``, ``*.rst``, ``*.md``) of the Python standard library that ships with the
interpreter running this script (PSF License, see ``flamia_pack/data/README.md``), one document per
file, in sorted path order. Test suites, generated tables and third-party packages are left out
(see ``SKIP_DIRS``) to keep the file small (about 2 MB with zstd).

Output columns: ``path`` (string, relative to the stdlib root, '/'-separated) and ``text``
(string, the file's UTF-8 content). The schema metadata records the Python version the files came
from. The same Python + pyarrow versions give a byte-identical file.

Usage::

    .venv/bin/python scripts/make_sample.py [--out flamia_pack/data/python-stdlib.parquet]
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import sysconfig

import pyarrow as pa
import pyarrow.parquet as pq

#: directories (any depth) not included: tests, third-party packages, caches, and bulky
#: generated or GUI-only code that adds size without adding variety.
SKIP_DIRS = frozenset(
    {
        "test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "lib2to3",
        "turtledemo", "ensurepip", "distutils", "tkinter", "idlelib", "lib-dynload",
    }
)
SUFFIXES = frozenset({".py", ".txt", ".rst", ".md"})
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "flamia_pack" / "data" / "python-stdlib.parquet"


def collect(root: pathlib.Path) -> list[pathlib.Path]:
    """Return the sorted relative paths of the files that go into the sample."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if p.suffix in SUFFIXES and p.is_file() and not p.name.startswith("_sysconfigdata"):
            out.append(rel)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = collect(root)
    texts = [(root / f).read_bytes().decode("utf-8") for f in files]
    table = pa.table(
        {"path": pa.array([f.as_posix() for f in files], pa.string()), "text": pa.array(texts, pa.string())}
    ).replace_schema_metadata(
        {
            "flamia_pack.sample": "Python standard library source and text files, one document per file",
            "python_version": platform.python_version(),
            "license": "PSF-2.0 (Python Software Foundation License Version 2)",
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out, compression="zstd", compression_level=19, row_group_size=256)
    n_bytes = sum(len(t.encode()) for t in texts)
    print(f"wrote {args.out}: {len(files)} documents, {n_bytes:,} UTF-8 bytes, "
          f"{args.out.stat().st_size:,} bytes on disk (Python {platform.python_version()})")


if __name__ == "__main__":
    main()
