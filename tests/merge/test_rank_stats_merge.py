"""`--rank-stats` and `--per-rank` in shared runs, checked against the values each rank logged.

The expected statistics come from `test_rankstats.reference_one` (sorted, statistics.median,
math.fsum) over the source rows written here or read from the fixtures with protobuf, never
from the merge's own code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.analyse import STATS
from wbmerge.cli import main
from wbmerge.log import BLOCK_SIZE, read_records
from wbmerge.merge import shared
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo

from ..analyse.test_rankstats import reference_one, same_value
from ..conftest import job_dir
from ..e2e.test_sync import UNLABELLED, cli_sync, sources_of
from ..support import synthetic
from ..support.ranklogs import rank_log

LONG = "x" * 300  # a value too long for the batch split: its rows take the exact path


def logged_value(rank: int, step: int, key: str) -> str | None:
    """What rank `rank` logs for `key` at `step` (JSON text), or None: ties, NaN,
    infinities, strings, booleans, missing values, all at some steps."""
    if key == "train/loss":
        if step % 17 == 3 and rank == 2:
            return "NaN"
        if step % 11 == 5:
            return json.dumps(float(step % 3))  # every rank the same: a tie
        return repr((rank + 1) * 0.25 + step / 100)
    if key == "train/acc":
        if step % 13 == 0 and rank == 1:
            return "Infinity"
        if rank == 0 and step % 4 == 1:
            return '"skipped"'  # not a number: as if rank 0 had not logged it
        return repr(1 - rank / (step + 2))
    if key == "lr":
        return "true" if step % 9 == 0 else repr(0.1 / (rank + 1))
    if key == "note":
        return json.dumps(LONG) if step % 50 == 7 else None
    return None


# rank -> (first step, steps): ranks start and end at different steps
RANKS = {0: (0, 400), 1: (5, 300), 2: (0, 350), 3: (100, 250)}
KEYS = ("train/loss", "train/acc", "lr", "note")


def write_rank(root: Path, rank: int, keys: tuple[str, ...] = KEYS) -> dict[int, dict[str, str]]:
    """One rank's log (with a nested key `eval.loss` and a repeated key); its rows as step ->
    {key name: value_json}, the last value where a row repeats a key. Without "note" in
    `keys`, every row takes the batch split."""
    first, steps = RANKS[rank]
    info = RankInfo(rank, rank, len(RANKS), len(RANKS), 0, job_id="stats")
    rows: dict[int, dict[str, str]] = {}
    with rank_log(root, info, f"st{rank}", "stats") as writer:
        for name in ("train/loss", "eval"):
            record = pb.Record()
            record.metric.name = name
            writer.write(record.SerializeToString())
        for step in range(first, first + steps):
            row = {k: v for k in keys if (v := logged_value(rank, step, k)) is not None}
            record = pb.Record()
            for key, value in row.items():
                item = record.history.item.add()
                item.key, item.value_json = key, value
            item = record.history.item.add()
            item.nested_key.extend(["eval", "loss"])
            item.value_json = row["eval.loss"] = repr(rank * 10.0 + step % 7)
            if step % 10 == 0:  # the same key twice in one row: the last one counts
                item = record.history.item.add()
                row["lr"] = repr(-step - rank)
                item.key, item.value_json = "lr", row["lr"]
            for key, value in (("_step", str(step)), ("_runtime", str(step))):
                item = record.history.item.add()
                item.key, item.value_json = key, value
            record.history.step.num = step
            writer.write(record.SerializeToString())
            rows[step] = row
            if step % 25 == 0:
                record = pb.Record()
                item = record.summary.update.add()
                item.key, item.value_json = "train/loss", row["train/loss"]
                writer.write(record.SerializeToString())
        record = pb.Record()
        record.exit.exit_code = 0
        writer.write(record.SerializeToString())
    return rows


def numbers_at(sources: dict[int, dict[int, dict[str, str]]], step: int, key: str) -> dict:
    """rank -> the number it logged for `key` at `step` (JSON numbers only)."""
    found = {}
    for rank, rows in sources.items():
        text = rows.get(step, {}).get(key)
        if text is None:
            continue
        value = json.loads(text)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[rank] = float(value)
    return found


def assert_statistics(row: dict, key: str, by_rank: dict, where: object) -> None:
    want = reference_one(by_rank)
    for stat in STATS:
        got = row[f"{key}/ranks/{stat}"]
        if stat.endswith("_rank"):
            assert got == want[stat], (where, key, stat)
        elif stat == "mean" and math.isfinite(want["mean"]):
            assert got == pytest.approx(want["mean"], rel=1e-12), (where, key, stat)
        else:
            assert same_value(got, want[stat]), (where, key, stat, got, want[stat])


# what all ranks' reads may hold at once: a block a turn, one rank at a time; a block of
# every rank each turn (all ranks' rows fed together, cut at every turn); everything at once
@pytest.mark.parametrize("budget", [BLOCK_SIZE, 4 * BLOCK_SIZE, shared.READ_BUDGET])
# with long values (the rows of a rank that has one take the exact split on their own) and
# without (every turn's rows of all ranks as one batch)
@pytest.mark.parametrize("keys", [KEYS, KEYS[:-1]], ids=["long", "batch"])
def test_statistics_of_every_step_and_the_keys_kept_per_rank(tmp_path, monkeypatch, budget, keys):
    monkeypatch.setattr(shared, "READ_BUDGET", budget)
    sources = {rank: write_rank(tmp_path / "job", rank, keys) for rank in RANKS}
    request = MergeRequest(
        [tmp_path / "job"], run_mode="shared", rank_stats=True, per_rank=["train/*"]
    )
    [staged] = merge_jobs(request, tmp_path / "out")
    merged: dict[int, dict] = {}
    texts: dict[int, dict[str, str]] = {}  # the values' JSON as written
    summary: dict = {}
    defined = []
    for record in read_records(staged.log_path):
        if record.HasField("history"):
            items = record.history.item
            row = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
            merged[record.history.step.num] = row
            texts[record.history.step.num] = {i.key or i.nested_key[0]: i.value_json for i in items}
        elif record.HasField("summary"):
            summary.update(
                {
                    ".".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.summary.update
                }
            )
        elif record.HasField("metric"):
            defined.append(record.metric.name)
    steps = sorted(set().union(*sources.values()))
    assert sorted(merged) == steps
    names = ("train/loss", "train/acc", "lr", "eval.loss", "note")
    last_step = {}
    for step in steps:
        row = merged[step]
        want_keys = {"_step", "_runtime"}
        for key in names:
            by_rank = numbers_at(sources, step, key)
            if by_rank:
                assert_statistics(row, key, by_rank, step)
                want_keys |= {f"{key}/ranks/{stat}" for stat in STATS}
                last_step[key] = step
        for rank, rows in sources.items():  # train/* keeps its series per rank, nothing else
            for key in ("train/loss", "train/acc"):
                if key in rows.get(step, {}):
                    assert texts[step][f"{key}/rank-{rank}"] == rows[step][key]
                    want_keys.add(f"{key}/rank-{rank}")
        assert set(row) == want_keys, step
    assert "note" not in last_step  # a string only: no statistics, ever
    # the summary: each statistic's last value, the ranks' kept keys, nothing of the others
    for key, step in last_step.items():
        assert_statistics(summary, key, numbers_at(sources, step, key), ("summary", key))
    ranks_summary = {k for k in summary if "/rank-" in k}
    assert ranks_summary == {f"train/loss/rank-{rank}" for rank in RANKS}
    assert sorted(defined) == [f"train/loss/rank-{rank}" for rank in RANKS]  # not `eval`
    assert staged.metrics == 2 * len(RANKS) + len(STATS) * 4
    assert staged.bound_notice is None


def test_rank_stats_sync_into_the_sink_without_per_rank_keys(sink, tmp_path):
    """The `cadence` job: rank 0 logs every step, the others every fifth, so most steps
    have one rank and some all four."""
    result = cli_sync(
        sink,
        tmp_path,
        job_dir("cadence"),
        "--run-mode",
        "shared",
        "--rank-stats",
        "--per-rank",
        "none",
        "-p",
        "stats",
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    [run] = sink.client.runs(project="stats")
    got = sink.client.run("local", "stats", run["id"])
    logged = {
        rank: {row["_step"]: row for row in want.history}
        for rank, (_, want, _) in sources_of("cadence").items()
    }
    keys = {k for rows in logged.values() for row in rows.values() for k in row} - UNLABELLED
    assert keys == {"rank", "train/loss", "train/samples_per_sec", "train/step_time"}
    rows = {row["_step"]: row for row in got["history"]}
    assert sorted(rows) == sorted(set().union(*logged.values()))
    counts = set()
    for step, row in rows.items():
        for key in keys:
            by_rank = {r: float(rs[step][key]) for r, rs in logged.items() if step in rs}
            counts.add(len(by_rank))
            assert_statistics(row, key, by_rank, step)
        assert not [k for k in row if "/rank-" in k], step  # no series per rank arrived
        assert len(row) == len(UNLABELLED) + len(keys) * len(STATS), step
    assert counts == {1, 4}
    last = max(rows)
    for key in keys:
        by_rank = {r: float(rs[last][key]) for r, rs in logged.items() if last in rs}
        assert_statistics(got["summary"], key, by_rank, "summary")
    assert not [k for k in got["summary"] if "/rank-" in k]


def over_the_bound(root: Path) -> Path:
    """128 ranks x 79 metrics: 10,112 labelled keys, just over W&B's 10,000."""
    for rank in range(128):
        info = RankInfo(rank, rank, 128, 128, 0, job_id="wide")
        synthetic.write_rank(root, info, steps=2, metrics=79, stats_every=10, print_every=10)
    return root


def test_a_run_over_the_bound_is_named_in_one_line_before_the_upload(sink, tmp_path):
    job = over_the_bound(tmp_path / "job")
    result = cli_sync(sink, tmp_path, job, "--run-mode", "shared", "-p", "wide", "-e", "local")
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    [notice] = [i for i, line in enumerate(lines) if "10,112 distinct metrics" in line]
    line = lines[notice]
    assert line.startswith("wbmerge: warning: run wide ") and "10,000" in line
    for option in ("--rank-stats", "--per-rank none", "--per-rank all"):
        assert option in line
    uploaded = [i for i, line in enumerate(lines) if "(1/1 runs)" in line]
    assert uploaded and notice < uploaded[0]  # said before the upload finished
    got = sink.client.run("local", "wide", "wide")
    assert len(got["history"][0]) == 10_112 + len(UNLABELLED)


@pytest.mark.parametrize(
    ("options", "warned"),
    [((), True), (("--per-rank", "all"), False), (("--per-rank", "none", "--rank-stats"), False)],
)
def test_merge_warns_past_the_bound_unless_chosen(tmp_path, options, warned):
    job = over_the_bound(tmp_path / "job")
    result = CliRunner().invoke(
        main, ["merge", str(job), "--run-mode", "shared", "--out", str(tmp_path / "out"), *options]
    )
    assert result.exit_code == 0, result.output
    assert ("distinct metrics" in result.stderr) == warned


def test_bad_per_rank_values_are_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "merge",
            str(job_dir("cadence")),
            "--run-mode",
            "shared",
            "--per-rank",
            "all",
            "--per-rank",
            "train/loss",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "--per-rank all cannot be combined" in result.stderr


def test_a_per_rank_pattern_that_matches_nothing_is_a_warning(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "merge",
            str(job_dir("cadence")),
            "--run-mode",
            "shared",
            "--per-rank",
            "train/los",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "--per-rank 'train/los' matches no key" in result.stderr


def test_the_flyte_merge_task_passes_the_options_on(sink, tmp_path):
    """The merge task's child (`python -m wbmerge.flyte merge`), as the task runs it."""
    spec, answer = tmp_path / "request.json", tmp_path / "result.json"
    spec.write_text(
        json.dumps(
            {
                "path": str(job_dir("cadence")),
                "run_mode": "shared",
                "rank_scope": None,
                "project": "flytestats",
                "entity": "local",
                "worker": None,
                "rank_stats": True,
                "per_rank": ["none"],
            }
        )
    )
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run(
        [sys.executable, "-m", "wbmerge.flyte", "merge", str(spec), str(answer)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "error" not in json.loads(answer.read_text())
    [run] = sink.client.runs(project="flytestats")
    got = sink.client.run("local", "flytestats", run["id"])
    logged = {
        rank: {row["_step"]: row for row in want.history}
        for rank, (_, want, _) in sources_of("cadence").items()
    }
    last = max(got["history"], key=lambda row: row["_step"])["_step"]
    by_rank = {r: float(rows[last]["train/loss"]) for r, rows in logged.items() if last in rows}
    assert_statistics(got["summary"], "train/loss", by_rank, "summary")
    assert not [k for row in got["history"] for k in row if "/rank-" in k]
