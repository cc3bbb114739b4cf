"""A staged run is compared with its ranks' own logs before it is sent (`sourcecheck`): on
the real fixtures every mode and scope holds what its ranks logged, and a staged run that
lacks one value, line, key or definition is named, by rank, kind and key, and not sent."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import merge
from wbmerge.analyse import PerRank
from wbmerge.cli import main
from wbmerge.log import LogWriter, read_payloads, read_records
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo
from wbmerge.verify import expected_of, source_shortfall

from ..conftest import job_dir
from ..merge.test_merged_rows import history_payload, loss_defined, stage_shared
from ..support.ranklogs import exit_record, history_record, rank_log

RESERVED = ("_step", "_runtime", "_timestamp", "_wandb")
MNIST = job_dir("recipe_mnist_like")


def staged_runs(tmp_path: Path, name: str, mode: str, scope: str = "global", **request):
    root = job_dir(name)
    return merge_jobs(
        MergeRequest([root], run_mode=mode, rank_scope=scope, files_from=[root], **request),
        tmp_path / "out",
    )


def user_values(logs: list[Path]) -> int:
    """The history values a user logged in `logs`, read with protobuf."""
    count = 0
    for log in logs:
        for record in read_records(log):
            if record.HasField("history"):
                for item in record.history.item:
                    top = item.nested_key[0] if item.nested_key else item.key
                    count += top not in RESERVED
    return count


@pytest.mark.parametrize("name", ["two_nodes_2x2", "recipe_mnist_like", "elastic_restart"])
@pytest.mark.parametrize("mode", ["auto", "shared", "new"])
@pytest.mark.parametrize("scope", ["global", "worker"])
def test_every_mode_and_scope_holds_what_its_ranks_logged(tmp_path, name, mode, scope):
    staged = staged_runs(tmp_path, name, mode, scope)
    assert staged
    for run in staged:
        assert source_shortfall(run.target, run.log_path) == []
        expected = expected_of(run.target)
        # What is expected is what the sources hold, read here with protobuf: every value
        # of every rank the run takes, and a summary, config and console of its own.
        logged = user_values([source.path for source in run.target.sources])
        assert sum(count for count, _ in expected.history.values()) == logged > 0
        assert expected.summary and expected.config and expected.stats
        assert sum(count for count, _ in expected.console.values()) > 0


def rewrite(log: Path, change: Callable[[pb.Record], pb.Record | None]) -> None:
    """Write `log` again with our own writer, each record through `change` (None: dropped)."""
    records = [change(pb.Record.FromString(payload)) for payload in read_payloads(log)]
    with open(log, "wb") as stream, LogWriter(stream) as writer:
        for record in records:
            if record is not None:
                writer.write(record.SerializeToString())


def once(change: Callable[[pb.Record], pb.Record | None | bool]):
    """`change` applied to the first record it takes (returns other than False for)."""
    done = []

    def apply(record: pb.Record) -> pb.Record | None:
        if done:
            return record
        changed = change(record)
        if changed is False:
            return record
        done.append(True)
        return changed

    return apply


def item_named(items, name: str):
    return next((i for i in items if (list(i.nested_key) or [i.key]) == [name]), None)


def drop_item(kind: str, name: str):
    def change(record: pb.Record):
        if not record.HasField(kind):
            return False
        items = {"summary": record.summary.update, "config": record.config.update}.get(
            kind, record.history.item
        )
        item = item_named(items, name)
        if item is None:
            return False
        items.remove(item)
        return record

    return once(change)


def set_value(kind: str, name: str, value: str):
    def change(record: pb.Record):
        if not record.HasField(kind):
            return False
        items = record.config.update if kind == "config" else record.history.item
        item = item_named(items, name)
        if item is None:
            return False
        item.value_json = value
        return record

    return once(change)


def drop_console_line(label: str):
    def change(record: pb.Record):
        if not record.output_raw.line.startswith(f"[{label}] "):
            return False
        return None

    return once(change)


def drop_definition(name: str):
    def change(record: pb.Record):
        return None if record.metric.name == name else False

    return once(change)


def drop_sample(key: str):
    def change(record: pb.Record):
        item = next((i for i in record.stats.item if i.key == key), None)
        if item is None:
            return False
        record.stats.item.remove(item)
        return record

    return once(change)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            drop_item("history", "train/loss/rank-1"),
            "rank 1's history key 'train/loss/rank-1': 15 values logged, 14 staged",
        ),
        (
            set_value("history", "train/loss/rank-1", "0.5"),
            "rank 1's history key 'train/loss/rank-1': 15 values logged, other values staged",
        ),
        (drop_item("summary", "rank/rank-1"), "rank 1's summary key 'rank/rank-1': not in"),
        (
            set_value("config", "lr_after", "0.5"),
            "rank 0's config key 'lr_after': 0.025 logged, 0.5 staged",
        ),
        (drop_item("config", "rank/rank-1"), "rank 1's config key 'rank/rank-1': not in"),
        (drop_console_line("rank-1"), "rank 1's console 'rank-1': 2 lines logged, 1 staged"),
        (drop_sample("cpu/l:rank-1"), "rank 1's system metric 'cpu/l:rank-1'"),
        (
            drop_definition("val/acc/rank-0"),
            "rank 0's metric glob 'val/acc/rank-0': not bound to its step metric 'epoch/rank-0'",
        ),
    ],
)
def test_a_shared_run_lacking_what_a_rank_logged_is_named(tmp_path, change, named):
    [run] = staged_runs(tmp_path, "recipe_mnist_like", "shared")
    rewrite(run.log_path, change)
    problems = source_shortfall(run.target, run.log_path)
    assert len(problems) == 1 and problems[0].startswith(named), problems


def test_a_pass_through_lacking_a_row_or_a_definition_is_named(tmp_path):
    runs = staged_runs(tmp_path, "recipe_mnist_like", "new")
    run = next(r for r in runs if r.target.primary_rank == 1)
    rewrite(run.log_path, once(lambda r: None if r.HasField("history") else False))
    problems = source_shortfall(run.target, run.log_path)
    assert "rank 1's history key 'train/loss': 15 values logged, 14 staged" in problems
    run = next(r for r in runs if r.target.primary_rank == 0)
    rewrite(run.log_path, once(lambda r: None if r.HasField("metric") else False))
    [problem] = source_shortfall(run.target, run.log_path)
    assert problem == "rank 0's metric definition 'val/*' (step metric 'epoch'): not staged"


def test_keys_left_out_by_per_rank_are_not_expected_but_the_rest_are(tmp_path):
    [run] = staged_runs(tmp_path, "two_nodes_2x2", "shared", per_rank=["train/*"], rank_stats=True)
    per_rank = PerRank.parse(["train/*"])
    assert source_shortfall(run.target, run.log_path, per_rank=per_rank) == []
    rewrite(run.log_path, drop_item("history", "train/loss/worker-1-rank-1"))
    [problem] = source_shortfall(run.target, run.log_path, per_rank=per_rank)
    assert problem.startswith("rank 3's history key 'train/loss/worker-1-rank-1'")


def test_a_sync_whose_merge_lost_a_line_fails_naming_it_and_records_nothing(
    sink, tmp_path, monkeypatch
):
    """The check runs in `wbmerge sync`: a merge that loses a rank's console line (here, a
    stand-in that drops one after staging) fails the run with one line, sends nothing,
    and records nothing, so the next sync (with the merge whole again) sends it."""
    stage = merge.stage

    def losing_stage(target, out_dir, options, **kwargs):
        staged = stage(target, out_dir, options, **kwargs)
        rewrite(staged.log_path, drop_console_line("rank-1"))
        return staged

    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    args = ["sync", str(MNIST), "--run-mode", "shared", "-p", "checked", "--files-from", MNIST]
    monkeypatch.setattr(merge, "stage", losing_stage)
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error")]
    assert len(lines) == 1  # (no advice to rerun: a rerun would merge it alike)
    assert (
        "run n0s6mi50: not sent: the staged run lacks what its ranks logged: rank 1's "
        "console 'rank-1': 2 lines logged, 1 staged" in lines[0]
    )
    assert "verified" not in result.stdout
    assert sink.client.runs(project="checked") == []
    monkeypatch.setattr(merge, "stage", stage)
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.stderr
    assert [run["id"] for run in sink.client.runs(project="checked")] == ["n0s6mi50"]


def test_the_last_round_of_a_follow_whose_merge_lost_a_line_fails_naming_it(
    sink, tmp_path, monkeypatch
):
    """`sync --follow` checks its last round (every rank's log whole) the same way."""
    from wbmerge.follow import Follower, round_lines

    from ..follow.test_follow import GrowingJob, use_sink

    stage = merge.stage

    def losing_stage(target, out_dir, options, **kwargs):
        staged = stage(target, out_dir, options, **kwargs)
        rewrite(staged.log_path, drop_console_line("worker-1-rank-0"))
        return staged

    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(merge, "stage", losing_stage)
    (tmp_path / "live").mkdir()
    GrowingJob(job_dir("two_nodes_2x2"), tmp_path / "live").grow(1.0)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    with Follower(request, parallel=4, timeout=120.0) as follower:
        report = follower.round()
    said = "\n".join(round_lines(report))
    assert (
        "not sent: the staged run lacks what its ranks logged: rank 2's console "
        "'worker-1-rank-0': 3 lines logged, 2 staged" in said
    )
    assert sink.client.runs() == []


def test_wandb_logger_lines_of_every_rank_are_staged_labelled_and_expected(tmp_path):
    """Every rank's log gets a line of wandb's logger: a shared run holds each rank's,
    `[label] ` prefixed as its console lines are, and a staged run lacking one is named."""
    job = tmp_path / "job"
    shutil.copytree(job_dir("two_nodes_2x2"), job)
    for log in sorted(job.glob("wandb/offline-run-*/run-*.wandb")):
        payloads = list(read_payloads(log))
        line = pb.Record()
        line.output_logger.line = "wandb: a line of wandb's own\n"
        payloads.insert(len(payloads) - 1, line.SerializeToString())  # (before the exit)
        with open(log, "wb") as stream, LogWriter(stream) as writer:
            for payload in payloads:
                writer.write(payload)
    [run] = merge_jobs(MergeRequest([job], run_mode="shared"), tmp_path / "out")
    staged = [
        r.output_logger.line for r in read_records(run.log_path) if r.HasField("output_logger")
    ]
    assert sorted(staged) == [
        f"[worker-{worker}-rank-{local}] wandb: a line of wandb's own\n"
        for worker in (0, 1)
        for local in (0, 1)
    ]
    assert source_shortfall(run.target, run.log_path) == []
    rank_2 = "[worker-1-rank-0] "
    rewrite(
        run.log_path, once(lambda r: None if r.output_logger.line.startswith(rank_2) else False)
    )
    assert source_shortfall(run.target, run.log_path) == [
        "rank 2's wandb logger 'worker-1-rank-0': 1 lines logged, 0 staged"
    ]


def test_a_summary_key_written_in_two_spellings_is_expected_at_its_last_value(tmp_path):
    """wandb-core reads a `key` and a one-element `nested_key` as one key: its last write
    counts, whichever spelling came first."""
    with rank_log(tmp_path / "job", RankInfo(0, 0, 1, 1, 0, job_id="sp"), "sp-0", "p") as log:
        for step, spelling in enumerate(["nested", "key", "nested"]):
            log.write(history_record([("loss", str(step))], step, num=2 * step + 2))
            record = pb.Record(num=2 * step + 3)
            item = record.summary.update.add()
            item.value_json = str(step)
            if spelling == "key":
                item.key = "best"
            else:
                item.nested_key.append("best")
            log.write(record.SerializeToString())
        log.write(exit_record(0))
    [run] = merge_jobs(MergeRequest([tmp_path / "job"], run_mode="new"), tmp_path / "out")
    assert expected_of(run.target).summary[("best",)].endswith(b"2")
    assert source_shortfall(run.target, run.log_path) == []


@pytest.mark.parametrize(
    ("summaries", "named"),
    [
        (["min", "min"], "rank 0's metric definition 'loss/rank-0' (step metric ''): not staged"),
        (
            ["min", "max", "max", "min"],
            "rank 0's metric definition 'loss/rank-0': not the last one staged of its name",
        ),
    ],
)
def test_a_definition_written_again_unchanged_is_expected_once_and_the_last_last(
    tmp_path, summaries, named
):
    """A rank that defines `loss` again as it stands (in a loop, or after an elastic
    restart) needs it staged once; the run is sent. A staged run without the rank's last
    definition of `loss` at the end is named: wandb-core would end with another one."""
    row = history_payload(0, [(["loss"], "1.0")])
    ranks = {
        0: ("rank-0", [row, *map(loss_defined, summaries)]),
        1: ("rank-1", [row, loss_defined("max")]),
    }
    _, staged = stage_shared(tmp_path, ranks, primary=0)
    assert source_shortfall(staged.target, staged.log_path) == []
    records = list(read_records(staged.log_path))
    last = max(i for i, r in enumerate(records) if r.metric.name == "loss/rank-0")
    with open(staged.log_path, "wb") as stream, LogWriter(stream) as writer:
        for record in records[:last] + records[last + 1 :]:
            writer.write(record.SerializeToString())
    assert source_shortfall(staged.target, staged.log_path) == [named]


def staged_config(log: Path) -> dict:
    """A staged log's config as wandb-core applies it, read here with protobuf."""
    config: dict = {}
    for record in read_records(log):
        change = record.run.config if record.HasField("run") else record.config
        for item in change.update:
            config[".".join(item.nested_key) or item.key] = json.loads(item.value_json)
        for item in change.remove:
            config.pop(".".join(item.nested_key) or item.key, None)
    return config


@pytest.mark.parametrize("mode", ["auto", "shared", "new"])
def test_the_config_an_elastic_restart_starts_with_arrives(tmp_path, mode):
    """Each rank's restart starts with `attempt` = 10 x rank + 1 in its `wandb.init`
    config, which its first run lacked: the target run holds it (labelled for rank 1 in
    a shared run, where it differs from the primary's), and the check expects it."""
    job = tmp_path / "job"
    shutil.copytree(job_dir("elastic_restart"), job)
    [first] = merge_jobs(MergeRequest([job], run_mode="shared"), tmp_path / "plan")
    for source in first.target.sources:
        if source.rank.restart:
            attempt = 10 * source.rank.rank + source.rank.restart

            def add_attempt(record: pb.Record, attempt: int = attempt) -> pb.Record:
                if record.HasField("run"):
                    record.run.config.update.add(key="attempt", value_json=str(attempt))
                return record

            rewrite(source.path, add_attempt)
    for run in merge_jobs(MergeRequest([job], run_mode=mode), tmp_path / "out"):
        assert source_shortfall(run.target, run.log_path) == []
        config = staged_config(run.log_path)
        attempts = {k: v for k, v in config.items() if k.startswith("attempt")}
        if mode == "shared":
            label = next(s.label for s in run.target.sources if s.rank.rank == 1)
            assert attempts == {"attempt": 1, f"attempt/{label}": 11}
        else:
            assert attempts == {"attempt": 10 * run.target.primary_rank + 1}


def test_a_check_waits_while_the_slots_are_taken_and_runs_once_one_is_free():
    """A check of a staged run holds up to about 120 MB: no more than `CHECKS_AT_ONCE` run
    at once in a process, however many runs are prepared side by side."""
    from wbmerge.verify import sourcecheck

    started = threading.Event()
    answers: list[str | None] = []

    def check() -> list[str]:
        started.set()
        return ["history key 'loss': 1 value of 2"]

    for _ in range(sourcecheck.CHECKS_AT_ONCE):
        sourcecheck.CHECK_SLOTS.acquire()
    waiter = threading.Thread(target=lambda: answers.append(sourcecheck.lacking_line(check)))
    try:
        waiter.start()
        assert not started.wait(timeout=1.0)  # (every slot is taken: it must not run)
    finally:
        sourcecheck.CHECK_SLOTS.release()  # (one slot free: it runs)
        waiter.join(timeout=60)
        for _ in range(sourcecheck.CHECKS_AT_ONCE - 1):
            sourcecheck.CHECK_SLOTS.release()
    assert started.is_set() and not waiter.is_alive()
    [line] = answers
    assert line is not None and "history key 'loss': 1 value of 2" in line

    def unreadable() -> list[str]:
        raise OSError("gone")

    # (a check that raises gives its slot back: every slot can be taken again)
    assert "could not be compared" in (sourcecheck.lacking_line(unreadable) or "")
    for _ in range(sourcecheck.CHECKS_AT_ONCE):
        assert sourcecheck.CHECK_SLOTS.acquire(timeout=5)
    for _ in range(sourcecheck.CHECKS_AT_ONCE):
        sourcecheck.CHECK_SLOTS.release()
