"""benchmarks/bench_attention.py's tables re-rendered from a saved run (``--table``, no GPU) and issue 27's
HBM-floor check of the FP8 forward (``fp8_fwd_min_bytes``)."""
from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "runs" / "bench-2026-12-03c-fp8" / "bench_attention.json"


def _mod():
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "benchmarks" / "bench_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fp8_fwd_min_bytes_counts_each_tensor_once():
    """W1's shape (65,536 tokens, 16 / 16 heads, D 128): quantization reads 2 B and writes 1 B per element of
    Q, K, V, moves V's codes twice more for V^T, writes a byte of exponent per token and head and K's / V's
    float32 tables; the kernel reads the codes and tables once and writes bf16 O and float32 LSE."""
    mod = _mod()
    T, H, Hkv, D = 65536, 16, 16, 128
    n = T * (H + 2 * Hkv) * D
    quant, kernel = mod.fp8_fwd_min_bytes(T, H, Hkv, D)
    assert quant == 3 * n + 2 * T * Hkv * D + T * (H + 2 * Hkv) + 8 * T * Hkv
    assert kernel == n + 8 * T * Hkv + 2 * T * H * D + 4 * T * H
    assert 0.45 < (quant + kernel) / mod.HBM_BYTES_PER_S * 1e3 < 0.46  # ms: the floor the table prints


def test_table_renders_a_saved_run(capsys):
    """``--table`` prints the saved run's tables, the FP8 HBM-floor table among them (W7: the committed
    run's 0.881 ms against a 0.452 ms floor); a file that is not a run is one error line, exit 2."""
    mod = _mod()
    assert mod.main(["--table", str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "against the HBM floor" in out and "| W7 | 1.49 + 0.68 | 0.452 | 0.881 | 0.51x |" in out
    rows = json.loads(RUN.read_text())["rows"]
    assert mod.markdown(rows).count("\n| W") >= 9
    bad = RUN.parent / "bench_attention.md"
    assert mod.main(["--table", str(bad)]) == 2
    assert "not a bench_attention.json" in capsys.readouterr().err


def test_fp8_table_has_the_two_term_columns():
    """A row with the ``qk_terms=2`` measurement gets its times and ratios to the fastest BF16 call; rows without it
    (older runs) print dashes."""
    mod = _mod()
    rows = json.loads(RUN.read_text())["rows"]
    old = mod.markdown(rows)
    assert "qk_terms=2 fwd / training call" in old and "| - / - | - / - |" in old
    w1 = next(r for r in rows if r["name"] == "W1")
    bf, bt = mod._fastest_bf16(w1, "fwd_ms"), mod._fastest_bf16(w1, "train_ms")
    w1["impl"]["ours_fp8_qk2"] = {"fwd_ms": bf * 2, "train_ms": bt * 4}
    line = next(x for x in mod.markdown(rows).splitlines() if x.startswith("| W1 |") and "qk" not in x
                and x.rstrip().endswith("0.25x |"))
    assert "| 0.50x / 0.25x |" in line
