"""Two writers of one run at once, on a sink like W&B (a write cursor: a batch sent past the
server's end lands at it, so two uploads of one run move each other's rows).

Each pair is one that happens: two machines that sync one shared directory (two state
directories, two spellings of the server), two syncs of one run with other options, a
follow and a one-shot sync of one job, a Flyte merge task run twice at once. One writer
sends; the other waits and then finds the run whole, or stops with one line. The runs
end exact, value by value against the ranks' own files.

The sink holds the first writer's file_stream requests, the second starts only once the
first holds a run on the server, and the test lets the requests go only once the second
says it waits: so the two always meet, however slow the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from wbmerge.sync import MergeRequest

from ..conftest import job_dir
from ..support.sinktools import LIKE_WANDB, expected_from_log
from ..upload.test_upload_faults import PRIMARY, assert_every_rank_exactly_once, assert_exactly_once
from .test_sync import assert_shared, sources_of

pytestmark = pytest.mark.e2e
HELD = ["file_stream=hold"]
WRITER = "_wbmerge_writer/"
RESUME_STATUS = """query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) { bucket(name: $name, missingOk: true) { config } }
}"""


@pytest.fixture
def held_sink(make_sink):
    return make_sink(HELD, like=LIKE_WANDB)


def writers_of(sink, project: str, run_id: str) -> list[dict]:
    """The writers' entries in a run's config on the server (a hidden config key each)."""
    answer = sink.client.graphql(RESUME_STATUS, {"project": project, "name": run_id})
    bucket = answer["data"]["model"]["bucket"]
    config = json.loads(bucket["config"]) if bucket else {}
    return [item["value"] for key, item in config.items() if key.startswith(WRITER)]


def wait_until_held(sink, project: str, run_id: str, first: Writer) -> None:
    deadline = time.monotonic() + 120
    while not any(not entry["released"] for entry in writers_of(sink, project, run_id)):
        assert first.poll() is None, "the first writer ended before it held the run"
        assert time.monotonic() < deadline, "the first writer never held the run"
        time.sleep(0.05)


class Writer:
    """A writer's process, its stderr read as it comes so that a test can wait for a line."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.err: list[str] = []
        self.waiting = threading.Event()
        self._reader = threading.Thread(target=self._read_err, daemon=True)
        self._reader.start()

    def _read_err(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.err.append(line)
            if "waiting for" in line:
                self.waiting.set()

    def poll(self) -> int | None:
        return self.process.poll()

    def ended(self) -> tuple[int, str, str]:
        assert self.process.stdout is not None
        out = self.process.stdout.read()
        self.process.wait(timeout=600)
        self._reader.join(timeout=60)
        return self.process.returncode, out, "".join(self.err)


def let_go_once_waiting(sink, second: Writer) -> None:
    """Lift the sink's hold on the first writer once the second says it waits for it."""
    deadline = time.monotonic() + 180
    while not second.waiting.wait(0.1):
        assert second.poll() is None, "the second writer ended without waiting"
        assert time.monotonic() < deadline, "the second writer never waited"
    sink.client.set_faults([])


def start_sync(sink, tmp_path, name: str, *args: str, url: str | None = None) -> Writer:
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / f"state-{name}")}
    if url:
        env["WANDB_BASE_URL"] = url
    return Writer(
        [sys.executable, "-m", "wbmerge.cli", "sync", "--json", "-e", "local", *args], env
    )


def test_two_machines_syncing_one_directory_at_once_leave_every_run_exact(held_sink, tmp_path):
    """`new` mode from two state directories, one naming the server `localhost`: the second
    waits for the first, then finds every run whole and sends nothing."""
    job = str(job_dir("one_node_4"))
    first = start_sync(held_sink, tmp_path, "a", job, "--run-mode", "new", "-p", "two")
    wait_until_held(held_sink, "two", "fx-one-node-4-rank-0", first)
    other_url = held_sink.url.replace("127.0.0.1", "localhost")
    second = start_sync(
        held_sink, tmp_path, "b", job, "--run-mode", "new", "-p", "two", url=other_url
    )
    let_go_once_waiting(held_sink, second)
    (code1, _, err1), (code2, out2, err2) = first.ended(), second.ended()
    assert (code1, code2) == (0, 0), err1 + err2
    assert "waiting for wbmerge sync on" in err2
    assert {run["status"] for run in json.loads(out2)["runs"]} == {"already complete"}
    assert_every_rank_exactly_once(held_sink, "two")
    # both writers left their entries released: a third sync is not held up
    entries = writers_of(held_sink, "two", "fx-one-node-4-rank-0")
    assert len(entries) == 2 and all(entry["released"] for entry in entries)


def test_a_second_sync_with_other_options_is_refused_not_verified(held_sink, tmp_path):
    """One shared run, keys `{key}/{label}` and `{label}/{key}`: the second waits, then
    finds rows it would write otherwise, and refuses; the run is the first one's, exact."""
    job = str(job_dir("slow_rank"))
    common = [job, "--run-mode", "shared", "--base-id", "both", "-p", "opts"]
    first = start_sync(held_sink, tmp_path, "a", *common, "--key-format", "{key}/{label}")
    wait_until_held(held_sink, "opts", "both", first)
    second = start_sync(held_sink, tmp_path, "b", *common, "--key-format", "{label}/{key}")
    let_go_once_waiting(held_sink, second)
    (code1, _, err1), (code2, out2, err2) = first.ended(), second.ended()
    assert code1 == 0, err1
    assert code2 == 1 and "waiting for wbmerge sync on" in err2
    assert "the server's run is not a beginning of this one" in err2
    assert json.loads(out2)["runs"] == []
    got = held_sink.client.run("local", "opts", "both")
    ranks = sources_of("slow_rank")
    assert_shared(got, [ranks[r] for r in sorted(ranks)], key_format="{key}/{label}")


def test_a_sync_during_a_follow_of_the_same_job_stops_in_one_line(sink, tmp_path, monkeypatch):
    """The follow holds its runs until it ends: a sync meanwhile sends nothing and says
    who holds them; once the follow ended, the same sync finds the runs whole."""
    from wbmerge.follow import Follower

    monkeypatch.setenv("WANDB_BASE_URL", sink.url)
    monkeypatch.setenv("WANDB_API_KEY", sink.api_key)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state-follow"))
    request = MergeRequest(
        paths=(job_dir("one_node_4"),), run_mode="new", project="fs", entity="local"
    )
    with Follower(request, parallel=2, timeout=120) as follower:
        report = follower.round()
        assert report.done
        during = start_sync(
            sink, tmp_path, "s", str(job_dir("one_node_4")), "--run-mode", "new", "-p", "fs"
        )
        code, out, err = during.ended()
        assert code == 1
        lines = [line for line in err.splitlines() if "is sending it" in line]
        assert len(lines) == 4 and all(
            f"wbmerge follow on {os.uname().nodename} (pid {os.getpid()}) is sending it" in line
            for line in lines
        ), err
        assert json.loads(out)["runs"] == []
    after = start_sync(
        sink, tmp_path, "s", str(job_dir("one_node_4")), "--run-mode", "new", "-p", "fs"
    )
    code, out, err = after.ended()
    assert code == 0, err
    assert {run["status"] for run in json.loads(out)["runs"]} == {"already complete"}
    assert_every_rank_exactly_once(sink, "fs")


def test_a_flyte_merge_task_run_twice_at_once_uploads_once(held_sink, tmp_path):
    """The merge task's child (`python -m wbmerge.flyte merge`), as two attempts of the task
    run it on two pods (two state directories): both end with the run's link, and the run
    is exact."""
    request = {"path": str(job_dir("one_node_4")), "run_mode": "auto", "project": "fl"}
    spec = tmp_path / "request.json"
    spec.write_text(json.dumps(request))

    def attempt(name: str) -> Writer:
        env = {**held_sink.env, "WBMERGE_STATE_DIR": str(tmp_path / f"state-{name}")}
        command = [sys.executable, "-m", "wbmerge.flyte", "merge", str(spec), str(tmp_path / name)]
        return Writer(command, env)

    first = attempt("first")
    wait_until_held(held_sink, "fl", "fx-one-node-4", first)
    second = attempt("second")
    let_go_once_waiting(held_sink, second)
    err1, err2 = first.ended()[2], second.ended()[2]
    answers = [json.loads((tmp_path / name).read_text()) for name in ("first", "second")]
    assert (
        answers[0]["links"]
        == answers[1]["links"]
        == [f"{held_sink.url}/local/fl/runs/fx-one-node-4"]
    ), err1 + err2
    assert "waiting for wbmerge sync on" in err2
    primary = next(log for log in PRIMARY if expected_from_log(log).config["wbmerge"]["rank"] == 0)
    assert_exactly_once(
        held_sink.client.run("local", "fl", "fx-one-node-4"), expected_from_log(primary)
    )
