"""Shared test helpers: where the real fixtures are, and what the manifest says of them."""

from __future__ import annotations

import compileall
import json
import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis's timing health checks fail a run when a busy 2-core CI machine is slow to
# generate large inputs (100 kB payloads); they judge the machine, not the code.
settings.register_profile(
    "wbmerge", suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("wbmerge")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "data"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
JOBS = sorted(MANIFEST["jobs"])


def job_dir(name: str) -> Path:
    return FIXTURES / name


def interruptible() -> None:
    """`preexec_fn` of a child the test will send SIGINT: Ctrl-C's default action, also when
    the suite runs where SIGINT is ignored (a background job of a shell without job
    control, as `cmd &` in a script), which every child would inherit and keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fixture_logs(include_damaged: bool = False) -> list[Path]:
    """Every real `.wandb` file in the fixtures (the damaged copies only on request)."""
    logs = sorted(FIXTURES.glob("*/wandb/offline-run-*/run-*.wandb"))
    if not include_damaged:
        logs = [p for p in logs if "damaged" not in p.parts]
    return logs


def pytest_sessionstart(session):
    """Compile wbmerge and the test helpers once, before the workers start. The suite starts
    hundreds of Python processes (syncs, follows, sinks, ranks); where PYTHONDONTWRITEBYTECODE
    is set (as in many CI images) each compiled every module it imports again, about a third
    of a second of CPU a process: 15% of an upload test's CPU."""
    if not hasattr(session.config, "workerinput"):  # (the controller, or a run without xdist)
        for package in (ROOT / "wbmerge", ROOT / "tests" / "support"):
            compileall.compile_dir(package, quiet=1)


def pytest_xdist_auto_num_workers(config) -> int:
    """How many test processes `-n auto` starts: two a core, at most 16. Most of a test's
    time is spent waiting for ranks, uploads and the sink's late counts, so one process a
    core leaves the cores idle: on 2 cores 3 processes kept them 87% busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(16, 2 * (cores or 1)))


@pytest.fixture(scope="session", autouse=True)
def state_of_this_test_process(tmp_path_factory):
    """Each test process (pytest-xdist runs several) keeps its ledger, locks and follow
    states apart from the others' and from the user's own (`~/.local/state/wbmerge`): a
    sync recorded by one process's test must not be found synced by another's. A test that
    sets WBMERGE_STATE_DIR itself still has its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WBMERGE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield


@pytest.fixture
def manifest() -> dict:
    return MANIFEST


@pytest.fixture
def sink_like():
    """What a test's `sink` and `make_sink()` behave like: the ideal server here. A directory
    or module whose tests must hold on W&B overrides it with `like_wandb_by_default()`."""
    return None


def chosen_like(request, like):
    """`like`, or the ideal server for a test marked `ideal_sink` (one that needs an exact
    server)."""
    return None if request.node.get_closest_marker("ideal_sink") else like


@pytest.fixture
def sink(tmp_path_factory, request, sink_like):
    """A real sink on a free loopback port with a fresh data dir; `.env` points wandb at it."""
    from .support.sinktools import SinkProcess

    process = SinkProcess(
        tmp_path_factory.mktemp("sink") / "data", like=chosen_like(request, sink_like)
    )
    process.data_dir.mkdir()
    process.start()
    yield process
    process.stop()


@pytest.fixture
def wandb_like_sink(tmp_path_factory):
    """A real sink that behaves like W&B (`sink serve --like-wandb`): write cursor, counts
    1 s late, sampled history, rate limits."""
    from .support.sinktools import LIKE_WANDB, SinkProcess

    process = SinkProcess(tmp_path_factory.mktemp("sink") / "data", like=LIKE_WANDB)
    process.data_dir.mkdir()
    process.start()
    yield process
    process.stop()


@pytest.fixture
def make_sink(tmp_path_factory, request, sink_like):
    """Start sinks with options (faults, `like`: a `LikeWandb` of W&B's behaviours, None for
    the ideal server, the test's `sink_like` if not given); all are stopped after the test."""
    from .support.sinktools import SinkProcess

    started = []
    default = chosen_like(request, sink_like)

    def start(faults=(), allow_faults=False, like=...):
        process = SinkProcess(
            tmp_path_factory.mktemp("sink") / "data",
            tuple(faults),
            allow_faults,
            default if like is ... else like,
        )
        process.data_dir.mkdir()
        started.append(process.start())
        return process

    yield start
    for process in started:
        process.stop()
