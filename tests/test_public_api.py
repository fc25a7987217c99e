"""Every name the package advertises resolves, and importing the package stays light."""
from __future__ import annotations

import subprocess
import sys

import flamia_pack


def test_every_export_resolves_and_is_documented():
    for name in flamia_pack.__all__:
        obj = getattr(flamia_pack, name)
        if name != "__version__":
            assert obj.__doc__, f"{name} has no docstring"


def test_import_does_not_pull_torch():
    code = "import sys, flamia_pack; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
