"""Every `flamia` command on bad input (missing file, empty file, a directory instead of a file, bad
numbers, bad JSON, unknown options) prints one `error:` line and exits non-zero, no traceback; and
every command's --help reads at 80 columns (no cut words, no `<bool>` label on flags)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flamia_pack.cli import app

COMMANDS = [[], ["pack"], ["plan"], ["probe-leak"], ["bench"], ["serve"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "flamia")
def test_help_reads_at_80_columns(cmd):
    res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output and "…" not in res.output, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80


def _cases(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "dir").mkdir()
    (tmp_path / "bad.json").write_text("{bad\n")
    (tmp_path / "ok.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "lens.txt").write_text("12\n40\n")
    t = str(tmp_path)
    out = ["--out", f"{t}/o"]
    return {
        "pack missing file": (["pack", f"{t}/missing.jsonl", *out, "--capacity", "64"], "source not found"),
        "pack directory": (["pack", f"{t}/dir", *out, "--capacity", "64"], "no supported files"),
        "pack bad json": (["pack", f"{t}/bad.json", *out, "--capacity", "64"], "line 1"),
        "pack bad number": (["pack", f"{t}/ok.jsonl", *out, "--capacity", "abc"], "--capacity"),
        "pack tokenizer is a directory": (["pack", f"{t}/ok.jsonl", *out, "--capacity", "64", "--tokenizer", f"{t}/dir"],
                                          "is a directory"),
        "pack tokenizer bad json": (["pack", f"{t}/ok.jsonl", *out, "--capacity", "64", "--tokenizer", f"{t}/bad.json"],
                                    "cannot load tokenizer"),
        "pack bad utf8 option": (["pack", f"{t}/ok.jsonl", *out, "--capacity", "64", "--on-invalid-utf8", "x"],
                                 "on_invalid_utf8"),
        "pack missing option": (["pack", f"{t}/ok.jsonl", "--capacity", "64"], "--out"),
        "plan missing file": (["plan", f"{t}/missing.txt"], "source not found"),
        "plan empty file": (["plan", f"{t}/empty.txt"], "no document lengths"),
        "plan directory": (["plan", f"{t}/dir"], "no manifest.json"),
        "plan bad json": (["plan", f"{t}/bad.json"], "expected one document length"),
        "plan bad number": (["plan", f"{t}/lens.txt", "--heads", "x"], "--heads"),
        "plan bad calibration": (["plan", f"{t}/lens.txt", "--calibration", f"{t}/bad.json"], "not valid JSON"),
        "plan calibration directory": (["plan", f"{t}/lens.txt", "--calibration", f"{t}/dir"], "calibration"),
        "plan unknown option": (["plan", f"{t}/lens.txt", "--bogus"], "No such option"),
        "probe-leak bad numbers": (["probe-leak", "--cu-seqlens", "0,a"], "comma-separated integers"),
        "probe-leak bad number": (["probe-leak", "--num-heads", "two"], "--num-heads"),
        # a new user's report, 2026-12-04: an allocator traceback, a message about the CLI's missing
        # check_finite option, one naming num_kv_heads the user never set
        "probe-leak huge row": (["probe-leak", "--cu-seqlens", "0,99999999999"], "the probe's row is too large"),
        "probe-leak huge magnitude": (["probe-leak", "--magnitude", "1e300"], "magnitude must be a finite number in"),
        "probe-leak no heads": (["probe-leak", "--num-heads", "0"], "num_heads must be >= 1, got 0"),
        "bench bad number": (["bench", "--rep", "x"], "--rep"),
        "serve bad port": (["serve", "--port", "99999"], "--port"),
        "serve bad calibration": (["serve", "--calibration", f"{t}/bad.json"], "not valid JSON"),
        "serve db directory": (["serve", "--db", f"{t}/dir"], "is a directory"),
        "unknown command": (["nope"], "No such command"),
    }


NAMES = ["pack missing file", "pack directory", "pack bad json", "pack bad number", "pack tokenizer is a directory",
         "pack tokenizer bad json", "pack bad utf8 option", "pack missing option", "plan missing file",
         "plan empty file", "plan directory", "plan bad json", "plan bad number", "plan bad calibration",
         "plan calibration directory", "plan unknown option", "probe-leak bad numbers", "probe-leak bad number",
         "probe-leak huge row", "probe-leak huge magnitude", "probe-leak no heads",
         "bench bad number", "serve bad port", "serve bad calibration", "serve db directory", "unknown command"]


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_one_error_line(tmp_path, name):
    cases = _cases(tmp_path)
    assert sorted(cases) == sorted(NAMES)
    args, needle = cases[name]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code != 0, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert needle in lines[0], lines[0]


def test_no_command_prints_the_help_and_says_a_command_is_required():
    """A bare `flamia` printed the help, then `error: (see flamia --help)` with an empty message; it
    still prints the help (stdout) but the error line names what is missing and the commands."""
    res = CliRunner().invoke(app, [], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Usage: flamia" in res.stdout and "probe-leak" in res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["error: a command is required (pack, plan, probe-leak, bench, serve); flamia COMMAND "
                     "--help describes each"], res.stderr
