"""`wbmerge report`: per-rank statistics checked against the source values, and the slow rank named."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.analyse import outliers, report
from wbmerge.api import inspect as api_inspect
from wbmerge.cli import main

from ..conftest import job_dir
from .test_export import expected_values


def by_rank(job: str, key: str) -> dict[int, list[tuple[int, float]]]:
    values: dict[int, list[tuple[int, float]]] = {}
    for rank, _, kind, step, name, value, _ in expected_values(job):
        if kind == "history" and name == key:
            values.setdefault(rank, []).append((step, value))
    return values


def test_slow_rank_is_the_throughput_outlier_and_the_json_says_so():
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "--json"])
    assert result.exit_code == 0, result.output
    (job,) = json.loads(result.output)
    metric = next(m for m in job["metrics"] if m["key"] == "train/samples_per_sec")
    assert metric["outliers"] == [2]
    assert metric["slowest"] == 2 and metric["faster"] == "higher"
    assert metric["fastest"] != 2
    # no other logged metric singles out a rank: the others' step time waits for rank 2
    others = [
        m
        for m in job["metrics"]
        if m["kind"] == "history" and m["key"] not in ("train/samples_per_sec", "rank")
    ]
    assert all(m["outliers"] == [] for m in others)


def test_per_rank_statistics_are_those_of_the_source_values():
    (job,) = report([job_dir("cadence")], metrics=["train/loss"])
    (metric,) = job.metrics
    source = by_rank("cadence", "train/loss")
    assert [s.rank for s in metric.ranks] == sorted(source)
    for stats in metric.ranks:
        values = [v for _, v in sorted(source[stats.rank])]
        assert stats.count == len(values)
        assert stats.mean == pytest.approx(statistics.fmean(values), rel=1e-12)
        assert (stats.last, stats.min, stats.max) == (values[-1], min(values), max(values))


def test_spread_is_taken_at_the_steps_ranks_share():
    # rank 0 logs every step, the others every 5th: the spread is over the 5th steps only
    (job,) = report([job_dir("cadence")], metrics=["train/loss"])
    (metric,) = job.metrics
    source = by_rank("cadence", "train/loss")
    steps: dict[int, list[float]] = {}
    for values in source.values():
        for step, value in values:
            steps.setdefault(step, []).append(value)
    spreads = [(max(v) - min(v)) / abs(statistics.median(v)) for v in steps.values() if len(v) >= 2]
    assert metric.aligned_steps == len(spreads) < len(steps)
    assert metric.spread_mean == pytest.approx(statistics.fmean(spreads))
    assert metric.spread_max == pytest.approx(max(spreads))


def test_default_metrics_are_those_every_rank_logged_plus_system_metrics():
    (job,) = report([job_dir("media")])
    history = {m.key for m in job.metrics if m.kind == "history"}
    assert history == {"rank", "train/loss", "train/samples_per_sec", "train/step_time"}
    assert any(m.kind == "system" for m in job.metrics)


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        ([100.0, 101.0, 99.0, 10.0], [3]),  # one far below
        ([100.0, 100.0, 100.0, 100.0], []),  # all alike
        ([100.0, 100.0, 100.0, 102.0], []),  # MAD 0, but only 2 % off
        ([100.0, 100.0, 100.0, 150.0], [3]),  # MAD 0 and 50 % off
        ([100.0, 120.0, 80.0, 110.0], []),  # noisy, nobody stands out
        ([1.0, 50.0], []),  # two ranks: no majority to stand out from
    ],
)
def test_outlier_rule(means, expected):
    import numpy as np

    assert outliers(np.array(means)) == expected


def test_terminal_report_names_the_outlier():
    result = CliRunner().invoke(
        main, ["report", str(job_dir("slow_rank")), "-m", "train/samples_per_sec"]
    )
    assert result.exit_code == 0
    assert "outlier in train/samples_per_sec: rank 2" in result.output
    assert "slowest rank 2" in result.output


def test_unknown_metric_is_one_line_and_exit_2():
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "-m", "no/such"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "no numeric metric 'no/such'" in result.output
    assert "(some that are: rank, train/loss, train/samples_per_sec, train/step_time, cpu, " in (
        result.output
    )


@pytest.mark.parametrize("typed", ["train/los", "loss", "Train/Loss"])
def test_a_mistyped_metric_is_told_what_it_may_mean(typed):
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "-m", typed])
    assert result.exit_code == 2
    assert result.stderr == (
        f"wbmerge: error: no numeric metric {typed!r} in the runs (did you mean 'train/loss'?)\n"
    )


def test_the_report_counts_its_metrics_in_words():
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "-m", "train/loss"])
    assert result.exit_code == 0
    assert result.output.splitlines()[0] == "job fx-slow-rank: 3 ranks, 1 metric"


def test_report_and_skew_metrics_share_one_spread_with_the_true_median(tmp_path):
    """Four ranks (an even count: the median is the mean of the two middle values), the
    spread recomputed here with `statistics.median` from the source values; `report`'s
    per-step spreads and the merged run's `wbmerge/spread/{key}` must both equal it."""
    from wbmerge.log import read_records

    key = "train/loss"
    source = by_rank("one_node_4", key)
    steps: dict[int, list[float]] = {}
    for values in source.values():
        for step, value in values:
            steps.setdefault(step, []).append(value)
    assert {len(v) for v in steps.values()} == {4}
    expected = {step: (max(v) - min(v)) / abs(statistics.median(v)) for step, v in steps.items()}
    upper_median = {step: (max(v) - min(v)) / sorted(v)[2] for step, v in steps.items()}
    assert expected != pytest.approx(upper_median)  # the case where two definitions differ

    (job,) = report([job_dir("one_node_4")], metrics=[key])
    (metric,) = job.metrics
    assert metric.spread_mean == pytest.approx(statistics.fmean(expected.values()))
    assert metric.spread_max == pytest.approx(max(expected.values()))

    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "merge",
            str(job_dir("one_node_4")),
            "--run-mode",
            "shared",
            "--skew-metrics",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    merged = {}
    for record in read_records(next(out.glob("offline-run-*/run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if f"wbmerge/spread/{key}" in items:
                merged[int(items["_step"])] = json.loads(items[f"wbmerge/spread/{key}"])
    assert merged == pytest.approx(expected)


def test_a_killed_rank_and_missing_ranks_are_said_not_hidden():
    from ..conftest import FIXTURES, MANIFEST

    [killed] = report([job_dir("killed_rank")])
    kill_step = MANIFEST["jobs"]["killed_rank"]
    last = max(step for step, _ in by_rank("killed_rank", "train/loss")[2])
    assert last < kill_step["steps"] - 1  # (the fixture: rank 2 died part way)
    [line] = killed.damage
    assert line.endswith(
        f"no exit record (killed, or still writing); its values end at step {last}"
    )
    assert not killed.warnings
    [alone] = report([FIXTURES / "damaged" / "corrupt_block"])
    assert "rank(s) 1, 2, 3 of 4 have no offline run" in alone.warnings[-1]
    result = CliRunner().invoke(main, ["report", str(FIXTURES / "damaged" / "corrupt_block")])
    assert result.exit_code == 0 and "have no offline run" in result.stderr


def test_a_restart_without_an_exit_record_is_continued_not_ended(tmp_path):
    from wbmerge.log import pb, read_payloads, write_payloads

    job = tmp_path / "job"
    shutil.copytree(job_dir("elastic_restart"), job)
    rows = api_inspect([job])
    first = next(r for r in rows if (r["rank"], r["restart"]) == (1, 0))
    [log] = Path(first["path"]).glob("run-*.wandb")
    kept = [p for p in read_payloads(log) if not pb.Record.FromString(p).HasField("exit")]
    write_payloads(log, kept)  # rank 1's first restart, killed between records
    [made] = report([job])
    [line] = made.damage
    assert line == f"{log}: no exit record; the next restart continues"
