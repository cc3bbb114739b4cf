"""Uploaders started ahead of their runs: wandb imported and wandb-core up before the runs
are known. One given its runs sends all of them; one stopped before sends nothing, leaves
no process behind and makes no later sync wait; a deliverer starts its first one before
any run is handed to it."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from wbmerge.sync import Deliverer
from wbmerge.upload import Credentials, Delivery, Ledger, ServerClient, Uploader
from wbmerge.upload.settle import last_stop

from ..conftest import job_dir
from ..support.sinktools import console_text, expected_from_log

pytestmark = pytest.mark.e2e
RUN = sorted(job_dir("one_node_4").glob("wandb/offline-run-*"))[0]


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def working_in(directory: Path) -> list[int]:
    """The processes whose working directory is `directory` or below it (Linux /proc)."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            where = Path(os.readlink(cwd))
        except OSError:
            continue
        if where == directory or directory in where.parents:
            found.append(int(cwd.parent.name))
    return found


def wait_for(condition, seconds: float = 240.0) -> None:
    """Wait for `condition`, failing only if it never comes: on a machine loaded by other
    suites, wandb-core took over 60 s to start (three tests in one run, one after another)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def credentials(sink) -> Credentials:
    return Credentials(sink.url, sink.env["WANDB_API_KEY"])


def copy_run(tmp_path: Path) -> tuple[Path, Path]:
    run_dir = shutil.copytree(RUN, tmp_path / "runs" / RUN.name)
    return run_dir, next(run_dir.glob("run-*.wandb"))


def assert_arrived_whole(sink, project: str, log: Path) -> None:
    want = expected_from_log(log)
    got = sink.client.run("local", project, want.run_id)
    assert [row["_step"] for row in got["history"]] == [row["_step"] for row in want.history]
    assert got["history"] == want.history
    assert console_text(got["console"]) == want.console
    assert got["state"] == "finished"


def test_an_uploader_started_ahead_sends_the_runs_it_is_given_later(sink, state, tmp_path):
    run_dir, log = copy_run(tmp_path)
    workdir = tmp_path / "staging" / "batch-0"
    uploader = Uploader(credentials(sink), "ahead", "local", workdir)
    uploader.start()
    # wandb-core, which wandb starts as a process of its own, is up before the runs are known
    wait_for(lambda: len(working_in(workdir)) >= 2)
    finished = []
    outcome = uploader.run([run_dir], 1, finished.append, lambda: False)
    assert outcome.returncode == 0, outcome.output
    assert finished == [log.stem.removeprefix("run-")]
    assert_arrived_whole(sink, "ahead", log)
    wait_for(lambda: not working_in(workdir), seconds=120)


def test_an_uploader_stopped_before_its_runs_sends_nothing_and_leaves_nothing(
    sink, state, tmp_path
):
    workdir = tmp_path / "staging" / "batch-0"
    uploader = Uploader(credentials(sink), "never", "local", workdir)
    uploader.start()
    wait_for(lambda: len(working_in(workdir)) >= 2)  # wandb and wandb-core
    uploader.stop()
    wait_for(lambda: not working_in(workdir), seconds=120)
    assert last_stop() == 0  # nothing was sent, so no later sync waits for it to land
    outcome = uploader.run([tmp_path], 1, lambda run_id: None, lambda: False)
    assert outcome.returncode is None and outcome.output == ""  # stopped: nothing starts
    assert sink.client.runs(project="never") == []


@contextlib.contextmanager
def deliverer_into(sink, state: Path, project: str, workdir: Path, expected: int):
    """A deliverer of `expected` runs into `project` of the sink, stopped afterwards."""
    creds = credentials(sink)
    ledger = Ledger(state / "ledger.sqlite3")
    deliverer = Deliverer(
        ServerClient(creds), creds, ledger, project, "local", 4, workdir, expected=expected
    )
    try:
        yield deliverer
    finally:
        deliverer.stop()
        ledger.close()


def test_a_deliverer_starts_its_first_uploader_before_any_run_is_staged(sink, state, tmp_path):
    run_dir, log = copy_run(tmp_path)
    workdir = tmp_path / "staging" / "uploader"
    with deliverer_into(sink, state, "first", workdir, expected=1) as deliverer:
        wait_for(lambda: len(working_in(workdir)) >= 2)  # started with no run submitted
        run_id = log.stem.removeprefix("run-")
        delivery = Delivery(run_id, run_dir, log, "key", "fingerprint")
        deliverer.submit(delivery)
        report = deliverer.finish()
    assert report.failed == [] and delivery.verified, delivery.problems
    assert_arrived_whole(sink, "first", log)
    wait_for(lambda: not working_in(workdir), seconds=120)


def test_a_deliverer_with_nothing_to_send_stops_its_waiting_uploader(sink, state, tmp_path):
    workdir = tmp_path / "staging" / "uploader"
    with deliverer_into(sink, state, "none", workdir, expected=0) as deliverer:
        wait_for(lambda: len(working_in(workdir)) >= 1)
        ended = threading.Event()
        threading.Thread(target=lambda: (deliverer.finish(), ended.set()), daemon=True).start()
        assert ended.wait(60)
    wait_for(lambda: not working_in(workdir), seconds=120)
    assert last_stop() == 0
    assert sink.client.runs(project="none") == []


def test_an_uploader_starts_its_own_wandb_core_whatever_its_parent_used(
    sink, state, tmp_path, monkeypatch
):
    """A process that used wandb keeps its wandb-core in WANDB_SERVICE, which its children
    inherit (a sync called from a notebook, or from a test process that ran wandb): the
    uploader starts its own wandb-core all the same, in its working directory."""
    from wandb.sdk.lib.service.service_token import UnixServiceToken

    gone = UnixServiceToken(parent_pid=os.getpid(), path=str(tmp_path / "no-such-socket"))
    monkeypatch.setenv("WANDB_SERVICE", gone.env_value)
    run_dir, log = copy_run(tmp_path)
    workdir = tmp_path / "staging" / "batch-0"
    uploader = Uploader(credentials(sink), "inherited", "local", workdir)
    uploader.start()
    wait_for(lambda: len(working_in(workdir)) >= 2)  # wandb and its own wandb-core
    outcome = uploader.run([run_dir], 1, lambda run_id: None, lambda: False)
    assert outcome.returncode == 0, outcome.output
    assert_arrived_whole(sink, "inherited", log)
    wait_for(lambda: not working_in(workdir), seconds=120)
