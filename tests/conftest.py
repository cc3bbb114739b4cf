"""Shared test helpers: where the real fixtures are, and what the manifest says of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "data"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
JOBS = sorted(MANIFEST["jobs"])


def job_dir(name: str) -> Path:
    return FIXTURES / name


def fixture_logs(include_damaged: bool = False) -> list[Path]:
    """Every real `.wandb` file in the fixtures (the damaged copies only on request)."""
    logs = sorted(FIXTURES.glob("*/wandb/offline-run-*/run-*.wandb"))
    if not include_damaged:
        logs = [p for p in logs if "damaged" not in p.parts]
    return logs


@pytest.fixture
def manifest() -> dict:
    return MANIFEST
