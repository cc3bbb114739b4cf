"""ruff is part of the test command: lint and format check of the whole repo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff(args):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


MODULES = sorted((ROOT / "wbmerge").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_fits_on_a_few_screens(path):
    assert len(path.read_text().splitlines()) <= 600


def test_the_framing_knows_nothing_of_records():
    """`txlog` frames bytes; what a payload is belongs to `records` (and `wire`)."""
    source = (ROOT / "wbmerge" / "txlog.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in imports if "proto" in line or "wire" in line or "records" in line]
