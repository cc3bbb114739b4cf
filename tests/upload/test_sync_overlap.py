"""Staging and upload overlap: runs go up while the rest are still staged, exactly once.

The overlap is shown by order, not by timing: a staging progress callback that waits for
an upload event (or an upload callback that waits for a staging event) can only see it
when the two run side by side; run one after the other, the wait runs out and the test
fails. What arrived is compared by value with the source `.wandb` files.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from itertools import pairwise

import pytest

from wbmerge.sync import MergeRequest, UploadFailed, sync
from wbmerge.upload import batch_lanes, batch_size, runs_to_ask
from wbmerge.upload.batches import PATIENCE, START_COST

from ..conftest import job_dir
from ..e2e.test_sync import assert_shared, sources_of
from ..support.sinktools import like_wandb_by_default
from .test_upload_faults import assert_exactly_once, processes_in


@pytest.fixture
def sink_like():
    """Overlapped uploads to a server like W&B (tests/conftest.py): exactly once must hold there."""
    return like_wandb_by_default()


WAIT = 60  # seconds a callback waits for the other side; the overlap needs far less

# -- how runs are shared out between `wandb sync` processes (pure) -------------------------


def test_ready_runs_wait_while_staging_keeps_up_and_go_once_it_stalls():
    assert batch_size(ready=1, coming=7, uploading=0, free=8, parallel=8, waited=0.0) == 0
    assert batch_size(ready=1, coming=7, uploading=0, free=8, parallel=8, waited=PATIENCE) == 1
    # enough to fill the slots, but more are still coming fast: one process for more of them
    assert batch_size(ready=8, coming=56, uploading=0, free=8, parallel=8, waited=0.0) == 0
    assert batch_size(ready=8, coming=56, uploading=0, free=8, parallel=8, waited=PATIENCE) == 8


def test_the_last_runs_go_at_once():
    assert batch_size(ready=3, coming=0, uploading=0, free=8, parallel=8, waited=0.0) == 3
    assert batch_size(ready=1, coming=0, uploading=5, free=3, parallel=8, waited=0.0) == 1


def test_no_batch_without_a_ready_run_or_a_free_slot():
    assert batch_size(ready=0, coming=9, uploading=0, free=8, parallel=8, waited=9.0) == 0
    assert batch_size(ready=9, coming=0, uploading=8, free=0, parallel=8, waited=9.0) == 0


def test_while_others_upload_a_batch_waits_for_its_part_half_the_slots_or_a_starts_worth():
    # 50 of the 60 runs left are ready: their part is 8 * 50 // 60 = 6 slots, 3 are free
    slow = dict(ready=50, coming=0, uploading=10, free=3, parallel=8, waited=9.0)
    assert batch_size(**slow) == 0
    assert batch_size(**slow, idle=START_COST - 0.1) == 0
    assert batch_size(**slow, idle=START_COST) == 23  # 3/8 of the 60 runs left, rounded up
    # 50 of 110 left: their part, 8 * 50 // 110 = 3 slots, is free: 3/8 of 110, rounded up
    assert batch_size(ready=50, coming=0, uploading=60, free=3, parallel=8, waited=9.0) == 42
    # 4 of 8 slots free: its part of the 150 runs left (50 ready, 100 in other batches) is half
    assert batch_size(ready=50, coming=0, uploading=100, free=4, parallel=8, waited=9.0) == 50
    assert batch_size(ready=200, coming=0, uploading=100, free=4, parallel=8, waited=9.0) == 150


def test_the_slots_an_early_batch_left_free_are_taken_at_once():
    # an early batch took 6 slots for its 48 runs; the last 16 have their 8 * 16 // 64 = 2
    assert batch_size(ready=16, coming=0, uploading=48, free=2, parallel=8, waited=0.0) == 16


def test_a_batch_takes_at_least_its_free_slots_worth():
    assert batch_size(ready=9, coming=0, uploading=4, free=4, parallel=8, waited=0.0) == 7
    assert batch_size(ready=3, coming=0, uploading=4, free=4, parallel=8, waited=0.0) == 3


def test_a_batch_takes_every_free_slot_it_can_use_when_nothing_more_is_coming():
    assert batch_lanes(runs=64, coming=0, uploading=0, free=8, parallel=8) == 8
    assert batch_lanes(runs=3, coming=0, uploading=0, free=8, parallel=8) == 3
    assert batch_lanes(runs=16, coming=0, uploading=48, free=2, parallel=8) == 2


def test_an_early_batch_takes_only_its_part_of_the_slots():
    assert batch_lanes(runs=48, coming=16, uploading=0, free=8, parallel=8) == 6  # 8 * 48 // 64
    assert batch_lanes(runs=3, coming=1, uploading=0, free=4, parallel=4) == 3  # 4 * 3 // 4
    assert batch_lanes(runs=1, coming=63, uploading=0, free=8, parallel=8) == 1  # at least one
    assert batch_lanes(runs=8, coming=8, uploading=16, free=3, parallel=8) == 2  # 8 * 8 // 32


# -- which runs of an uploading batch the server is asked about (pure) ----------------------

RUNS = [f"r{n}" for n in range(10)]
NEVER: dict[str, float] = {}


@pytest.mark.parametrize(
    "unfinished, asked_at, started, want",
    [
        (RUNS, NEVER, set(), ["r0", "r1", "r2", "r3"]),  # none asked yet: in the batch's order
        (RUNS, {r: 1.0 for r in RUNS}, set(), ["r0", "r1", "r2", "r3"]),
        (RUNS, {"r0": 5.0, "r1": 5.0}, set(), ["r2", "r3", "r4", "r5"]),  # never asked first
        # runs being sent are asked each time, however recently, with two others in turn
        (RUNS, {"r7": 9.0, "r9": 9.0}, {"r7", "r9"}, ["r7", "r9", "r0", "r1"]),
        (RUNS, {"r1": 3.0, "r2": 1.0, "r3": 2.0}, {"r1", "r2", "r3"}, ["r2", "r3", "r0", "r4"]),
        (RUNS, NEVER, {"r5"}, ["r5", "r0", "r1", "r2"]),  # one sent: the others take the rest
        (["r0", "r1", "r2", "r3", "r4"], NEVER, {"r0", "r1", "r2", "r3"}, ["r0", "r1", "r2", "r4"]),
        (["r0", "r1", "r2", "r3", "r4"], NEVER, set(RUNS), ["r0", "r1", "r2", "r3"]),  # all sent
        (["r3", "r1"], NEVER, {"r1"}, ["r1", "r3"]),  # fewer than four: all of them
        ([], NEVER, set(), []),
        (["r1", "r1", "r2", "r2", "r3"], NEVER, {"r2"}, ["r2", "r1", "r3"]),  # each run once
    ],
)
def test_runs_to_ask_puts_half_the_questions_on_the_runs_being_sent(
    unfinished, asked_at, started, want
):
    assert runs_to_ask(unfinished, asked_at, started, 4) == want


@pytest.mark.parametrize(
    "asked_at, want",
    [
        (NEVER, ["r0"]),
        ({r: 1.0 for r in RUNS} | {"r0": 2.0, "r5": 0.5}, ["r5"]),  # started or not
        ({r: 1.0 for r in RUNS} | {"r0": 2.0, "r7": 0.5}, ["r7"]),
    ],
)
def test_one_question_goes_to_the_run_asked_longest_ago(asked_at, want):
    assert runs_to_ask(RUNS, asked_at, {"r5"}, 1) == want
    assert runs_to_ask(RUNS, asked_at, {"r5"}, 0) == []


def test_every_run_of_two_batches_side_by_side_is_asked_in_bounded_turns():
    """Two batches of one deliverer ask in alternation and share one record of when each
    run was asked. Each of the 8 runs being sent is asked at least every 4 rounds of its
    batch, and each waiting run at least every 46 (92 of them, 2 a round), whatever the
    other batch does (a turn counter shared by the batches once skipped runs for ever)."""
    first = [f"a{n}" for n in range(100)]
    second = [f"b{n}" for n in range(6)]
    started = {f"a{n}" for n in range(0, 80, 10)} | {"b0"}
    asked_at: dict[str, float] = {}
    rounds_of: dict[str, list[int]] = {run: [] for run in first + second}
    for turn in range(400):
        for number, batch in enumerate((first, second)):
            for run in runs_to_ask(batch, asked_at, started, 4):
                asked_at[run] = turn * 2 + number
                rounds_of[run].append(turn)
    for run in first:
        gaps = [later - earlier for earlier, later in pairwise(rounds_of[run])]
        bound = 4 if run in started else 46
        assert rounds_of[run][0] < bound and max(gaps) <= bound, (run, rounds_of[run][:5])
    assert all(len(rounds_of[run]) >= 200 for run in second)  # 6 runs, 4 a round


# -- end to end, through `sync` -------------------------------------------------------------


def point_at(sink, tmp_path, monkeypatch):
    """Point wandb at `sink`; staging (and so the uploaders' cwd) under the test's own dir."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_BASE_URL", sink.url)
    monkeypatch.setenv("WANDB_API_KEY", sink.env["WANDB_API_KEY"])
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return sink


@pytest.fixture
def env(sink, tmp_path, monkeypatch):
    return point_at(sink, tmp_path, monkeypatch)


class Events:
    """What the callbacks saw, and waits for what the other side has not done yet."""

    def __init__(self) -> None:
        self.staged: list = []
        self.messages: list[str] = []
        self.verified = threading.Event()
        self.failed = threading.Event()
        self.lock = threading.Lock()

    def upload(self, progress) -> None:
        with self.lock:
            if progress.message:
                self.messages.append(progress.message)
        if progress.message.startswith("verified "):
            self.verified.set()
        if progress.message.startswith("incomplete "):
            self.failed.set()

    def first_verified(self) -> str:
        """The run of the first "verified <run>: ..." message (on a server like W&B, a line
        saying it waits for late counts can come before it)."""
        with self.lock:
            first = next(m for m in self.messages if m.startswith("verified "))
        return first.split()[1].rstrip(":")


def new_mode(project: str) -> MergeRequest:
    return MergeRequest([job_dir("one_node_4")], run_mode="new", project=project, entity="local")


def ranks_expected() -> dict:
    return {rank: want for rank, (_, want, _) in sources_of("one_node_4").items()}


def test_the_first_run_is_verified_before_the_last_is_staged(env, tmp_path):
    events = Events()
    seen_before_last = []
    removed = []

    def staged(result) -> None:
        events.staged.append(result)
        if len(events.staged) == 3:  # of 4: the 4th is staged only after this returns
            seen_before_last.append(events.verified.wait(WAIT))
            if not seen_before_last[0]:
                return
            verified = events.first_verified()
            run_dir = next(s.run_dir for s in events.staged if s.target.id == verified)
            removed.append(not run_dir.exists())

    report = sync(new_mode("first"), parallel=4, progress=staged, upload_progress=events.upload)
    assert seen_before_last == [True], "no run was verified until every run was staged"
    assert removed == [True], "a verified run's staged files are removed at once"
    assert len(events.staged) == 4
    assert sorted(t.status for t in report.targets) == ["uploaded"] * 4
    for rank, want in ranks_expected().items():
        assert_exactly_once(env.client.run("local", "first", f"fx-one-node-4-rank-{rank}"), want)
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*"))
    assert processes_in(tmp_path / "tmp") == []


def test_the_next_job_is_merged_while_the_last_one_uploads(env, tmp_path):
    events = Events()
    next_staged = threading.Event()
    waited = []

    def staged(result) -> None:
        events.staged.append(result)
        if len(events.staged) == 2:
            next_staged.set()

    def upload(progress) -> None:
        events.upload(progress)
        if progress.message.startswith("verified ") and not waited:
            waited.append(next_staged.wait(WAIT))  # the first job's run, verified

    request = MergeRequest(
        [job_dir("one_node_4"), job_dir("cadence")],
        run_mode="shared",
        project="jobs",
        entity="local",
    )
    report = sync(request, parallel=4, progress=staged, upload_progress=upload)
    assert waited == [True], "the second job was merged only after the first was uploaded"
    assert sorted(t.target.id for t in report.targets) == ["fx-cadence", "fx-one-node-4"]
    assert {t.status for t in report.targets} == {"uploaded"}
    for name in ("one_node_4", "cadence"):
        got = env.client.run("local", "jobs", f"fx-{name.replace('_', '-')}")
        assert_shared(got, list(sources_of(name).values()))
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*"))


def test_runs_left_unstaged_by_a_timeout_get_no_link(make_sink, tmp_path, monkeypatch):
    """The first run's upload makes no progress (the sink holds its requests) while the
    second run's staging callback waits: the sync gives up after --timeout and stages no
    more runs. None of the four is on the server, so no link is given, the group's either."""
    sink = point_at(make_sink(["file_stream=delay:10"]), tmp_path, monkeypatch)
    staged = []

    def wait_for_the_upload_to_be_given_up(result) -> None:
        staged.append(result)
        if len(staged) == 2:  # (the first run is handed over): until the sink holds its
            # first request, then until its upload is given up
            deadline = time.monotonic() + WAIT
            while not sink.client.faults()["faults"][0]["fired"] and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(5)  # (given up 2 s later, the timeout, and told within 0.25 s)

    with pytest.raises(UploadFailed) as given_up:
        sync(
            new_mode("unstaged"), parallel=1, progress=wait_for_the_upload_to_be_given_up, timeout=2
        )
    assert len(staged) < 4, "every run was staged before the upload was given up"
    assert any(line.startswith("no progress for 2 s") for line in given_up.value.lines)
    assert given_up.value.report.targets == []
    assert given_up.value.report.links == []


def test_failures_while_staging_goes_on_claim_nothing_and_leave_no_staging(
    make_sink, tmp_path, monkeypatch
):
    faulty = point_at(make_sink(["storage=400"]), tmp_path, monkeypatch)  # files refused
    events = Events()
    seen_before_last = []

    def staged(result) -> None:
        events.staged.append(result)
        if len(events.staged) == 3:
            seen_before_last.append(events.failed.wait(WAIT))

    with pytest.raises(UploadFailed) as failed:
        sync(
            new_mode("fail"), parallel=4, progress=staged, upload_progress=events.upload, timeout=30
        )
    assert seen_before_last == [True], "no upload failed until every run was staged"
    assert sorted(line.split(":")[0] for line in failed.value.lines[:-1]) == [
        f"run fx-one-node-4-rank-{rank}" for rank in range(4)
    ]
    assert all("file config.yaml not uploaded" in line for line in failed.value.lines[:-1])
    assert failed.value.report.links == []  # (no run of the group was verified)
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*"))
    assert processes_in(tmp_path / "tmp") == []

    faulty.client.set_faults([])
    again = sync(new_mode("fail"), parallel=4)
    assert sorted(t.status for t in again.targets) == ["uploaded"] * 4, "nothing was claimed"
    for rank, want in ranks_expected().items():
        assert_exactly_once(faulty.client.run("local", "fail", f"fx-one-node-4-rank-{rank}"), want)


def test_ctrl_c_while_staging_goes_on_stops_the_uploads_and_keeps_the_verified(env, tmp_path):
    events = Events()
    first = []

    def staged(result) -> None:
        events.staged.append(result)
        if len(events.staged) == 3:
            assert events.verified.wait(WAIT)
            first.append(events.first_verified())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sync(new_mode("int"), parallel=4, progress=staged, upload_progress=events.upload)
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*")), "staging removed"
    assert processes_in(tmp_path / "tmp") == [], "every uploader and wandb-core stopped"

    again = sync(new_mode("int"), parallel=4)
    status = {t.target.id: t.status for t in again.targets}
    assert status[first[0]] == "already synced"  # verified before Ctrl-C: recorded
    assert status["fx-one-node-4-rank-3"] == "uploaded"  # never staged the first time
    for rank, want in ranks_expected().items():
        assert_exactly_once(env.client.run("local", "int", f"fx-one-node-4-rank-{rank}"), want)


WRITERS = """query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) { bucket(name: $name, missingOk: true) { config } }
}"""


def writer_entries(sink, project: str, run_id: str) -> list[dict]:
    """The writers' entries in a run's config on the sink (a hidden config key each)."""
    answer = sink.client.graphql(WRITERS, {"project": project, "name": run_id})
    config = json.loads(answer["data"]["model"]["bucket"]["config"])
    return [item["value"] for key, item in config.items() if key.startswith("_wbmerge_writer/")]


def test_a_verified_run_is_given_back_while_the_others_upload(env, tmp_path):
    """A sync releases its claim on each run as soon as the run is verified, not when the
    whole sync ends: another writer need not wait for the rest, and the releases are not
    left to the end."""
    events = Events()
    seen: list[list[dict]] = []

    def upload(progress) -> None:
        events.upload(progress)
        if progress.message.startswith("verified ") and not seen:
            seen.append(writer_entries(env, "given", events.first_verified()))

    report = sync(new_mode("given"), parallel=1, upload_progress=upload)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0]["released"]
    assert sorted(t.status for t in report.targets) == ["uploaded"] * 4
    for target in report.targets:
        [entry] = writer_entries(env, "given", target.target.id)
        assert entry["released"]
