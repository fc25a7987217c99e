"""`flamia --help`: the command list shows every command's summary on one line."""
from __future__ import annotations

from typer.testing import CliRunner

from flamia_pack.cli import app


def test_root_help_lists_each_command_on_one_line():
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    start = next(i for i, line in enumerate(lines) if "Commands" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith(("╰", "+")))
    panel = [line.strip("│| ").strip() for line in lines[start + 1:end]]
    names = sorted(c.name for c in app.registered_commands)
    assert len(panel) == len(names), panel  # a multi-line summary adds continuation lines
    assert sorted(line.split()[0] for line in panel) == names
