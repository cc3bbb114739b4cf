"""`wbmerge report --rank-stats`: the statistics across ranks at each metric's last step,
checked against the source values and against the merged run's summary of `--rank-stats`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from wbmerge.analyse import STATS, report
from wbmerge.cli import main
from wbmerge.log import read_records

from ..conftest import job_dir
from ..merge.test_rank_stats_merge import assert_statistics
from .test_report import by_rank


@pytest.mark.parametrize(("job", "ranks_at_end"), [("one_node_4", 4), ("cadence", 1)])
def test_statistics_at_the_last_step_are_those_of_the_source_values(job, ranks_at_end):
    (made,) = report([job_dir(job)], metrics=["train/loss"], rank_stats=True)
    (metric,) = made.metrics
    source = by_rank(job, "train/loss")
    last = max(step for values in source.values() for step, _ in values)
    at_last = {r: v for r, values in source.items() for step, v in values if step == last}
    assert len(at_last) == ranks_at_end
    assert metric.across_ranks["step"] == last
    assert metric.across_ranks["count"] == ranks_at_end
    assert_statistics(
        {f"train/loss/ranks/{stat}": metric.across_ranks[stat] for stat in STATS},
        "train/loss",
        at_last,
        job,
    )


def test_without_the_option_there_are_none():
    (made,) = report([job_dir("one_node_4")], metrics=["train/loss"])
    assert made.metrics[0].across_ranks is None


def test_report_and_the_merged_summary_agree(tmp_path):
    out = tmp_path / "out"
    merged = CliRunner().invoke(
        main,
        [
            "merge",
            str(job_dir("two_nodes_2x2")),
            "--run-mode",
            "shared",
            "--rank-scope",
            "global",
            "--rank-stats",
            "--out",
            str(out),
        ],
    )
    assert merged.exit_code == 0, merged.output
    summary = {}
    for record in read_records(next(out.glob("offline-run-*/run-*.wandb"))):
        if record.HasField("summary"):
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    result = CliRunner().invoke(
        main, ["report", str(job_dir("two_nodes_2x2")), "--rank-stats", "--json"]
    )
    assert result.exit_code == 0, result.output
    (made,) = json.loads(result.output)
    history = [m for m in made["metrics"] if m["kind"] == "history"]
    assert {m["key"] for m in history} == {
        "rank",
        "train/loss",
        "train/samples_per_sec",
        "train/step_time",
    }
    for metric in history:
        for stat in STATS:
            assert metric["across_ranks"][stat] == pytest.approx(
                summary[f"{metric['key']}/ranks/{stat}"], rel=1e-12
            ), (metric["key"], stat)
    assert all(m["across_ranks"] is None for m in made["metrics"] if m["kind"] == "system")


def test_the_text_report_names_the_ranks_of_the_extremes():
    result = CliRunner().invoke(
        main, ["report", str(job_dir("one_node_4")), "-m", "rank", "--rank-stats"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "across 4 ranks at step 29: min 0 (rank 0), median 1.5, max 3 (rank 3), mean 1.5"
        in result.output
    )
