"""Fixtures every follow test shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..support.sinktools import like_wandb_by_default


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """Point wbmerge's ledger and a follow's saved state at a directory of the test's own."""
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def sink_like():
    """A follow uploads to a server like W&B (tests/conftest.py): what it proves must hold there."""
    return like_wandb_by_default()
