"""Fixtures every follow test shares."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """Point wbmerge's ledger and a follow's saved state at a directory of the test's own."""
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"
