"""What an upload's outcome is read from: what wandb-core writes, not what `wandb sync` prints.

Each test runs the real uploader into the sink and checks one reading: a run is finished
when wandb-core marks its log synced, a run that failed carries wandb-core's own account
of why (from its debug log's JSON lines), and the entity the runs went to is the one the
server answers it holds them under. The project name `a]b c` is one W&B accepts and
wandb prints inside its `[entity/project/run]` prefixes, where no parse of those lines
can find where the run's path ends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import txlog
from wbmerge.sync import Deliverer
from wbmerge.upload import Credentials, Delivery, Ledger, ServerClient, Uploader

from ..conftest import job_dir
from ..support.sinktools import like_wandb_by_default

pytestmark = pytest.mark.e2e


@pytest.fixture
def sink_like():
    """The server's answers as a server like W&B gives them (tests/conftest.py)."""
    return like_wandb_by_default()


RUNS = sorted(job_dir("one_node_4").glob("wandb/offline-run-*"))[:2]
IDS = sorted(run.name.rsplit("-", 1)[1] for run in RUNS)


def credentials(sink) -> Credentials:
    return Credentials(sink.url, sink.env["WANDB_API_KEY"])


def copies(tmp_path: Path, count: int = 2, where: str = "runs") -> list[Path]:
    return [shutil.copytree(run, tmp_path / where / run.name) for run in RUNS[:count]]


def upload(sink, tmp_path: Path, project: str, runs: list[Path]):
    """One real `wandb sync` of `runs`; the outcome and the runs said finished, in order."""
    uploader = Uploader(credentials(sink), project, "local", tmp_path / "staging")
    finished: list[str] = []
    outcome = uploader.run(runs, len(runs), finished.append, lambda: False)
    return outcome, finished


def test_each_run_is_finished_once_when_wandb_core_marks_it_synced(sink, tmp_path):
    outcome, finished = upload(sink, tmp_path, "a]b c", copies(tmp_path))
    assert outcome.returncode == 0, outcome.output
    assert sorted(finished) == IDS  # each once, though the printed lines cannot be parsed
    assert outcome.errors == {}
    assert {run["id"] for run in sink.client.runs(project="a]b c")} == set(IDS)


def test_runs_the_server_refuses_to_create_fail_with_its_answer(make_sink, tmp_path):
    """wandb prints this failure without naming the run; its debug log names it."""
    sink = make_sink(["graphql:UpsertBucket=400"])
    outcome, finished = upload(sink, tmp_path, "refused", copies(tmp_path))
    assert finished == []  # never synced: wandb-core writes no marker
    assert sorted(outcome.errors) == IDS
    for messages in outcome.errors.values():
        [message] = messages
        assert "failed to init run" in message and "injected fault 400" in message


def test_a_run_whose_data_stream_gives_up_fails_with_the_servers_answer(make_sink, tmp_path):
    """The filestream's second request (the rows) is refused: wandb-core stops sending the
    run's data but still finishes it; the failure names the request and the answer."""
    sink = make_sink(["file_stream=400@2"])
    outcome, finished = upload(sink, tmp_path, "lost", copies(tmp_path, count=1))
    first = RUNS[0].name.rsplit("-", 1)[1]
    assert finished == [first]
    [(run_id, [message])] = outcome.errors.items()
    assert run_id == first
    assert "/file_stream" in message and "400" in message and "injected fault 400" in message


def named(log: Path, display_name: str) -> None:
    """Give the run of `log` another display name, in its run records (the log re-framed)."""
    payloads = []
    for payload in txlog.read_payloads(log):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            record.run.display_name = display_name
            payload = record.SerializeToString()
        payloads.append(payload)
    txlog.write_payloads(log, payloads)


def test_the_entity_of_the_links_is_the_one_the_server_holds_the_runs_under(sink, tmp_path):
    """No entity given: the run goes to the key's default entity, and the report says which
    from the server's answer. (wandb prints it in a link after the run's display name,
    which may hold spaces, as here.)"""
    creds = credentials(sink)
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite3")
    [run_dir] = copies(tmp_path, count=1)
    log = next(run_dir.glob("run-*.wandb"))
    named(log, "rank zero of four")
    delivery = Delivery(log.stem.removeprefix("run-"), run_dir, log, "key", "print")
    deliverer = Deliverer(
        ServerClient(creds), creds, ledger, "links", None, 1, tmp_path / "staging", expected=1
    )
    try:
        deliverer.submit(delivery)
        report = deliverer.finish()
    finally:
        deliverer.stop()
        ledger.close()
    assert report.failed == [] and delivery.verified, delivery.problems
    assert report.entity == "local"
