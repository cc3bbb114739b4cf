"""Two syncs of one job at once, as from two machines: every row exactly once, every time.

Each sync has its own state directory (so neither ledger nor lock keeps them apart: only the
server is shared), or they share one and name the server two ways. Each round ends by
comparing what the sink holds with the source `.wandb` records, row by row: every `_step`
once, every value as written. The race the relay closes is also forced in a fixed order
with the sink's faults (`test_a_sync_whose_uploader_starts_after_the_other_sent_...`), so
that it does not depend on how two processes happen to interleave.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ..support import synthetic
from ..support.sinktools import expected_from_log
from ..upload.test_upload_faults import assert_exactly_once

pytestmark = pytest.mark.e2e
ROWS = 3000  # one request of history rows: a second writer that starts late misses them all
RUN = "twice"  # the job's id, and so its run's id


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One rank of `ROWS` rows, and what its `.wandb` file says."""
    root = tmp_path_factory.mktemp("twice")
    [log] = synthetic.write_job(root, 1, 1, ROWS, metrics=5, job_id=RUN)
    return root, expected_from_log(log)


# A sync as an older wbmerge runs it, taking no turns on the server (`upload.claims`): it
# reads what the server holds and sends, whoever else is sending. The relay is what keeps
# such a writer from adding rows twice.
NO_TURNS = (
    "from wbmerge.upload import Claims; "
    "Claims.take = lambda self, entity, project, run_id, stop=None, say=None: "
    "self.client.held(entity, project, run_id); "
    "from wbmerge.cli import main; main()"
)


def spawn(sink, tmp_path, source, project, state, url=None, takes_turns=True):
    """`wbmerge sync` of `source` in a process of its own, with the state directory `state`
    and the server named `url` (the sink's own URL by default); `takes_turns=False` as a
    writer that takes no turns on the server."""
    env = {
        **sink.env,
        "WBMERGE_STATE_DIR": str(tmp_path / state),
        "TMPDIR": str(tmp_path / "tmp"),
        "HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "WANDB_BASE_URL": url or sink.url,
    }
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    args = ["sync", "--json", str(source), "-p", project, "-e", "local"]
    return subprocess.Popen(
        [sys.executable, *(["-m", "wbmerge.cli"] if takes_turns else ["-c", NO_TURNS]), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ended(proc, timeout=180):
    """(exit code, stderr, what became of its run) of a spawned sync, once it ended."""
    out, err = proc.communicate(timeout=timeout)
    runs = json.loads(out)["runs"] if proc.returncode == 0 else []
    return proc.returncode, err, [run["status"] for run in runs]


def steps_twice(sink, project):
    """The `_step`s the sink holds more than once."""
    held = sink.client.run("local", project, RUN)["history"]
    return sorted(step for step, n in Counter(row["_step"] for row in held).items() if n > 1)


# Two rounds each: from two state directories (two machines), and from one state
# directory with the server named two ways; in both, one sync names it `localhost`.
RACES = [("state-a", "state-b")] * 2 + [("state", "state")] * 2


@pytest.mark.parametrize("states", RACES)
def test_two_syncs_at_once_leave_every_row_once(sink, tmp_path, job, states):
    source, want = job
    localhost = sink.url.replace("127.0.0.1", "localhost")
    first = spawn(sink, tmp_path, source, "both", states[0])
    second = spawn(sink, tmp_path, source, "both", states[1], localhost)
    for proc in (first, second):
        code, err, _ = ended(proc)
        assert code == 0, err
    assert steps_twice(sink, "both") == []
    assert_exactly_once(sink.client.run("local", "both", RUN), want)


def test_a_sync_to_localhost_finds_the_run_a_sync_to_127_0_0_1_recorded(sink, tmp_path, job):
    source, _ = job
    first = spawn(sink, tmp_path, source, "spelled", "state")
    assert ended(first)[2] == ["uploaded"]
    second = spawn(
        sink, tmp_path, source, "spelled", "state", sink.url.replace("127.0.0.1", "localhost")
    )
    code, err, status = ended(second)
    assert code == 0, err
    assert status == ["already synced"]  # (from the ledger: the server was not asked)


def wait_until(condition, what, deadline=90):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def test_a_sync_whose_uploader_starts_after_the_other_sent_its_rows_rewrites_them(
    make_sink, tmp_path, job
):
    """The race in a fixed order: sync B, a writer that takes no turns (an older wbmerge),
    plans from 0 rows while sync A's rows are refused (500, retried by wandb-core); A's rows
    then land; only then is B's wandb-core told how many rows the run holds (its
    UpsertBucket was refused until then), so it begins after them. Without the relay B
    appended every row again."""
    source, want = job
    sink = make_sink(allow_faults=True)
    counts = lambda: sink.client.faults()["counts"]  # noqa: E731
    sink.client.set_faults(["file_stream:history=500"])
    first = spawn(sink, tmp_path, source, "ordered", "state-a")
    wait_until(lambda: counts().get("file_stream:history", 0) >= 1, "A sends rows")
    sink.client.set_faults(["file_stream:history=500", "graphql:UpsertBucket=500"])
    second = spawn(sink, tmp_path, source, "ordered", "state-b", takes_turns=False)
    # B's wandb-core asks for the run only after B planned what to send (from 0 rows)
    wait_until(lambda: counts().get("graphql:UpsertBucket", 0) >= 1, "B's uploader starts")
    sink.client.set_faults(["graphql:UpsertBucket=500"])
    wait_until(
        lambda: len(sink.client.run("local", "ordered", RUN)["history"]) == ROWS, "A's rows land"
    )
    sink.client.set_faults([])
    results = [ended(proc) for proc in (first, second)]
    assert steps_twice(sink, "ordered") == []
    assert_exactly_once(sink.client.run("local", "ordered", RUN), want)
    for code, err, status in results:
        assert code == 0, err
        assert status == ["uploaded"]  # (B sent too, not "on the server already": it raced)
