"""A `merge --out` directory given to the other commands: each takes it, refuses it in one
line, or (with `--job`) leaves it aside; crafted merge blocks are never read as ranks.

Uploads of such directories, checked by value on the sink, are in test_sync.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.errors import WbmergeError
from wbmerge.follow import find_live_runs

from ..conftest import job_dir
from ..support.hostile import one_error_line, rewrite_log, run_cli


def merged_dir(dest: Path, name: str, *options: str) -> Path:
    result = CliRunner().invoke(main, ["merge", str(job_dir(name)), *options, "--out", str(dest)])
    assert result.exit_code == 0, result.stderr
    return dest


def plan(*args) -> list[dict]:
    result = CliRunner().invoke(main, ["sync", "--dry-run", "--json", *map(str, args)])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def refused(*args) -> str:
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def set_block(log: Path, **change) -> None:
    """Change fields of the `wbmerge` block of `log`'s run record (None removes one)."""

    def edit(record):
        if record.WhichOneof("record_type") != "run":
            return None
        for item in record.run.config.update:
            if item.key == "wbmerge":
                block = {**json.loads(item.value_json), **change}
                item.value_json = json.dumps({k: v for k, v in block.items() if v is not None})
        return record

    rewrite_log(log, edit)


@pytest.fixture(scope="module")
def merged_new(tmp_path_factory) -> Path:
    """`new` mode of a job written with wbmerge.init: blocks with rank fields and sources."""
    return merged_dir(tmp_path_factory.mktemp("m") / "new", "one_node_4", "--run-mode", "new")


def test_inspect_lists_merged_runs_by_id_under_their_job(merged_new):
    result = CliRunner().invoke(main, ["inspect", str(merged_new)])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        lines[0] == "runs merged from job fx-one-node-4 (`wbmerge sync` uploads them as they are)"
    )
    ids = [line.split()[0] for line in lines[2:] if line.strip()]
    assert ids == [f"fx-one-node-4-rank-{r}" for r in range(4)]
    rows = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(merged_new)]).stdout)
    assert {(r["job_id"], r["source"], r["rank"]) for r in rows} == {
        ("fx-one-node-4", "merged", None)
    }


def test_a_merged_run_plans_as_itself_with_its_group(merged_new):
    targets = plan(merged_new)
    assert [(t["id"], t["group"], t["kind"], t["primary_rank"]) for t in targets] == [
        (f"fx-one-node-4-rank-{r}", "fx-one-node-4", "merged", r) for r in range(4)
    ]


def test_job_picks_ranks_or_merged_runs_when_both_are_given(merged_new, tmp_path):
    mix = tmp_path / "mix"
    shutil.copytree(merged_new, mix / "merged")
    shutil.copytree(job_dir("two_nodes_2x2"), mix / "ranks")
    message = refused("sync", "--dry-run", mix, "--run-mode", "shared")
    assert "sync merged runs and the runs of ranks apart" in message  # the mix, first
    ranks = plan(mix, "--job", "fx-two-nodes-2x2", "--run-mode", "shared")
    assert [(t["id"], t["kind"], len(t["sources"])) for t in ranks] == [
        ("fx-two-nodes-2x2", "shared", 4)
    ]
    merged = plan(mix, "--job", "fx-one-node-4")
    assert {t["kind"] for t in merged} == {"merged"} and len(merged) == 4
    report = CliRunner().invoke(main, ["report", str(mix), "--job", "fx-two-nodes-2x2"])
    assert report.exit_code == 0, report.stderr
    assert "is a run that wbmerge merged" in refused("report", mix)


def test_two_merges_of_one_job_are_planned_apart(merged_new, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(merged_new, both / "new")
    merged_dir(both / "shared", "one_node_4", "--run-mode", "shared")
    result = CliRunner().invoke(main, ["sync", "--dry-run", str(both)])
    assert result.exit_code == 0, result.stderr
    heads = [line for line in result.stdout.splitlines() if line.startswith("job ")]
    assert [h.split(" -> ")[0].split(": ")[1] for h in heads] == [
        "run_mode=new rank_scope=global project=wbmerge-demo",
        "run_mode=shared rank_scope=global project=wbmerge-demo",
    ]


def test_a_run_id_found_twice_is_refused(merged_new, tmp_path):
    twice = tmp_path / "twice"
    shutil.copytree(merged_new, twice / "a")
    shutil.copytree(merged_new, twice / "b")
    message = refused("sync", "--dry-run", twice)
    assert re.search(r"run fx-one-node-4-rank-\d found twice: \S+/a/\S+ and \S+/b/", message)


@pytest.mark.parametrize(
    "change",
    [{"run_mode": "future"}, {"primary_rank": 9}, {"job_id": None}, {"sources": "all"}],
)
def test_a_merge_block_that_does_not_parse_is_no_rank(merged_new, tmp_path, change):
    crafted = shutil.copytree(merged_new, tmp_path / "crafted")
    for log in crafted.glob("*/run-*.wandb"):
        set_block(log, **change)
    # Not a merged run and never a rank (the block also holds rank 0-3's own fields).
    rows = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(crafted)]).stdout)
    assert {(r["rank"], r["job_id"]) for r in rows} == {(None, None)}
    assert all("neither a merged run nor a rank's" in r["unreadable"] for r in rows)
    assert "neither a merged run nor a rank's" in refused("sync", "--dry-run", crafted)


def test_a_run_record_id_that_is_no_run_id_names_the_file(merged_new, tmp_path):
    crafted = shutil.copytree(merged_new, tmp_path / "crafted")
    [log, *_] = sorted(crafted.glob("*/run-*.wandb"))

    def bad_id(record):
        if record.WhichOneof("record_type") != "run":
            return None
        record.run.run_id = "../x"
        return record

    rewrite_log(log, bad_id)
    line = one_error_line(run_cli("sync", "--dry-run", crafted))
    assert f"{log}: its run record's id '../x' is not a W&B run id" in line


def test_merge_and_follow_refuse_merged_runs(merged_new, tmp_path):
    assert "there is nothing to merge" in refused("merge", merged_new, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(WbmergeError, match="sync merged runs without --follow"):
        find_live_runs([merged_new], None)
    assert find_live_runs([merged_new], None, job="other").jobs == []  # --job of another
