"""benchmarks/probes/ncu_stalls.py on a synthetic Nsight Compute source page: the header found below the
kernel-name line, the step loops' ranges found by their shared execution count, the producer's NOP and
code left out, and the stall shares summed over what remains."""
from __future__ import annotations

import csv
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mod():
    spec = importlib.util.spec_from_file_location("ncu_stalls", ROOT / "benchmarks" / "probes" / "ncu_stalls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_consumer_shares(tmp_path, capsys):
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
            "Instructions Executed", "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]
    rows = [["Kernel Name", "_fp8_fwd_kernel", ""], head]
    for i in range(300):  # a step loop: 300 instructions run 1,000 times each; FMUL waits 3 samples each
        rows.append([hex(i), "FMUL R1, R2, R3", "4", "0", "1000", "3", "1", "0"])
    for i in range(1000):  # code this row never runs
        rows.append([hex(300 + i), "FFMA R1, R2, R3, R4", "0", "0", "0", "0", "0", "0"])
    for i in range(200):  # the producer, far away: run 10 times, its NOP idles
        rows.append([hex(1300 + i), "NOP" if i % 2 else "@!P0  BRA 0x10", "50", "0", "10", "0", "50", "0"])
    path = tmp_path / "src.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    _mod().main([str(path), "--top", "1"])
    out = capsys.readouterr().out
    assert "samples: 11200 in all, 1200 (10.7%) in the step loops' code (instruction ranges [(0, 299)])" in out
    assert "stall_wait                75.0%  FMUL 75.0" in out and "stall_long_sb             25.0%" in out


def test_a_csv_without_the_source_header_is_a_clear_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="no source-page header"):
        _mod().main([str(path)])


def test_missing_file_and_no_step_loop_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="cannot be read"):
        _mod().main([str(tmp_path / "absent.csv")])
    path = tmp_path / "few.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"],
                                 ["0x0", "FMUL R1, R2, R3", "5", "7"]])
    with pytest.raises(SystemExit, match="no step loop found"):
        _mod().main([str(path)])
