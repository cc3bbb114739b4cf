"""The way out of a run that a rerun refuses: `sync --resend` sends it whole again, each line
over the one at its place, through the real uploader into the sink; what arrived is compared
with the source records row by row."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.training import RankInfo

from ..conftest import job_dir
from ..support import synthetic
from ..support.sinktools import content_of, expected_from_log, like_wandb_by_default
from .test_upload_faults import assert_exactly_once

pytestmark = pytest.mark.e2e


@pytest.fixture
def sink_like():
    """Resending to a server like W&B (tests/conftest.py): what it mends must be mended there."""
    return like_wandb_by_default()


JOB = "edited"  # the job's id, and so its run's id


def write(root, seed, steps=400, print_every=50, config=None):
    """One rank of job `JOB`, its values drawn with `seed`, a console line every
    `print_every` steps and `config` besides its own keys; returns its `.wandb` path."""
    return synthetic.write_rank(
        root,
        RankInfo(0, 0, 1, 1, 0, job_id=JOB),
        steps,
        5,
        print_every=print_every,
        seed=seed,
        config=config,
    )


def sync(sink, tmp_path, source, *more):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    args = ["sync", "--json", str(source), "-p", "resent", "-e", "local", *more]
    return CliRunner().invoke(main, args, env=env)


def test_a_run_whose_sources_changed_is_refused_saying_why_and_resend_rewrites_it(sink, tmp_path):
    write(tmp_path / "before", seed=0)
    after = write(tmp_path / "after", seed=1)  # the same steps, other values
    first = sync(sink, tmp_path, tmp_path / "before")
    assert first.exit_code == 0, first.output + first.stderr
    refused = sync(sink, tmp_path, tmp_path / "after")
    assert refused.exit_code == 1
    assert "the server's row 400 differs from the staged row 400" in refused.stderr
    assert "this machine verified it from other files or settings before" in refused.stderr
    assert "`wbmerge sync --resend`" in refused.stderr
    resent = sync(sink, tmp_path, tmp_path / "after", "--resend")
    assert resent.exit_code == 0, resent.output + resent.stderr
    assert [run["status"] for run in json.loads(resent.stdout)["runs"]] == ["uploaded"]
    assert_exactly_once(sink.client.run("local", "resent", JOB), expected_from_log(after))


def test_a_refusal_without_this_machines_record_names_the_likely_causes(sink, tmp_path):
    write(tmp_path / "before", seed=0)
    write(tmp_path / "after", seed=1)
    assert sync(sink, tmp_path, tmp_path / "before").exit_code == 0
    (tmp_path / "state" / "ledger.sqlite3").unlink()  # as from another machine
    refused = sync(sink, tmp_path, tmp_path / "after")
    assert refused.exit_code == 1
    assert "its sources changed since an earlier upload, or it was uploaded with" in refused.stderr


def test_resend_refuses_a_run_the_server_holds_more_rows_of(sink, tmp_path):
    write(tmp_path / "long", seed=0, steps=400)
    write(tmp_path / "short", seed=0, steps=300)
    assert sync(sink, tmp_path, tmp_path / "long").exit_code == 0
    resent = sync(sink, tmp_path, tmp_path / "short", "--resend")
    assert resent.exit_code == 1
    assert "the server holds 400 history rows, more than the 300 staged" in resent.stderr
    assert "cannot remove rows" in resent.stderr
    assert len(sink.client.run("local", "resent", JOB)["history"]) == 400  # left as it was


def test_resend_cannot_be_used_with_follow(tmp_path):
    result = CliRunner().invoke(main, ["sync", str(tmp_path), "--follow", "--resend"])
    assert result.exit_code == 2
    assert "--resend cannot be used with --follow" in result.stderr


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error:")]


def assert_mends_without_resend(result) -> None:
    """The refusal names what can mend the run (another --base-id, or deleting it on the
    server) and never `--resend`, which cannot."""
    assert result.exit_code == 1, result.output + result.stderr
    lines = error_lines(result)
    assert not [line for line in lines if "--resend" in line], lines
    assert lines[-1] == (
        "wbmerge: error: syncing again cannot complete these runs: upload under other run ids "
        "(with --base-id ID), or delete the runs on the server first"
    ), lines


@pytest.mark.parametrize("resend", [False, True], ids=["sync", "resend"])
def test_a_run_the_server_holds_more_rows_of_is_not_told_to_resend(sink, tmp_path, resend):
    write(tmp_path / "long", seed=0, steps=400)
    write(tmp_path / "short", seed=0, steps=300)
    assert sync(sink, tmp_path, tmp_path / "long").exit_code == 0
    before = sink.client.run("local", "resent", JOB)
    refused = sync(sink, tmp_path, tmp_path / "short", *(["--resend"] if resend else []))
    (line, _) = error_lines(refused)
    # (a sync compares system-metric rows first, `--resend` history rows)
    what = (
        "400 history rows, more than the 300" if resend else "4 system-metric rows, more than the 3"
    )
    assert f"wbmerge: error: run {JOB}: the server holds {what} staged" in line
    assert_mends_without_resend(refused)
    assert content_of(sink.client.run("local", "resent", JOB)) == content_of(before)


def test_a_run_holding_more_system_metric_rows_is_told_what_mends_it(sink, tmp_path):
    """Synced with every rank's system metrics, then with the primary's alone: this ledger
    knows the options changed, so the line says so rather than guess; neither a rerun
    nor `--resend` can remove rows, so neither is advised."""
    args = (job_dir("slow_rank"),)
    assert sync(sink, tmp_path, *args, "--system-metrics", "all").exit_code == 0
    before = sink.client.run("local", "resent", "fx-slow-rank")
    for more in ([], ["--resend"]):
        refused = sync(sink, tmp_path, *args, *more)
        (line, _) = error_lines(refused)
        assert "system-metric rows, more than the" in line
        assert "--system-metrics all?" not in line
        assert "this machine verified it from other files or settings before" in line
        assert_mends_without_resend(refused)
    assert content_of(sink.client.run("local", "resent", "fx-slow-rank")) == content_of(before)


LEFT_BEHIND = {  # what the first upload leaves that sending the run again cannot remove
    "console": "the server holds 40 console lines, more than the 8 staged",
    "config": "the server's config holds old_only, which the staged run does not",
}
CONFIGS = {  # the config of the first sources and of the second, by case
    "console": (None, None),
    "config": ({"old_only": 1}, None),
}


@pytest.mark.parametrize("left", LEFT_BEHIND)
def test_resend_refuses_sources_whose_run_would_keep_the_first_uploads_lines_or_keys(
    sink, tmp_path, left
):
    """Synced from sources of 40 console lines or a config key `old_only`, then sent again
    from sources of 8 lines and without the key: lines 9-40 and the key would stay on the
    server, so the run is refused, left as it was, and told what mends it."""
    config_before, config_after = CONFIGS[left]
    write(
        tmp_path / "before",
        seed=0,
        print_every=10 if left == "console" else 50,
        config=config_before,
    )
    write(tmp_path / "after", seed=1, config=config_after)
    assert sync(sink, tmp_path, tmp_path / "before").exit_code == 0
    before = sink.client.run("local", "resent", JOB)
    resent = sync(sink, tmp_path, tmp_path / "after", "--resend")
    (line, _) = error_lines(resent)
    assert line.startswith(
        f"wbmerge: error: run {JOB}: {LEFT_BEHIND[left]}, and sending the "
        "run again cannot remove them"
    ), line
    assert_mends_without_resend(resent)
    assert content_of(sink.client.run("local", "resent", JOB)) == content_of(before)


def test_a_run_left_with_a_config_key_the_files_lack_is_refused_naming_what_mends_it(
    sink, tmp_path
):
    """The same rows, synced first from sources whose config holds a key `old_only` the
    second sources lack, then from the second on a machine without the first's record:
    the server keeps a config key once sent (wandb#11055), so `old_only` would stay
    whatever is sent. Before the config was compared, this sync said "verified" while the
    run kept the first upload's key."""
    write(tmp_path / "before", seed=0, config={"lr": 1, "old_only": 2})
    write(tmp_path / "after", seed=0, config={"lr": 1})
    assert sync(sink, tmp_path, tmp_path / "before").exit_code == 0
    before = sink.client.run("local", "resent", JOB)
    (tmp_path / "state" / "ledger.sqlite3").unlink()  # as from another machine
    again = sync(sink, tmp_path, tmp_path / "after")
    (line, _) = error_lines(again)
    assert line.startswith(
        f"wbmerge: error: run {JOB}: the server's config holds old_only, which the staged run "
        "does not"
    ), line
    assert "verified" not in again.stderr + again.stdout
    assert_mends_without_resend(again)
    assert content_of(sink.client.run("local", "resent", JOB)) == content_of(before)


def test_a_config_object_that_changed_is_sent_again_whole(sink, tmp_path):
    """The same rows, the config object `opt` narrowed in the second sources: wandb's
    uploader sends `opt` whole and the server replaces it (wandb#9844), so the run ends
    exact and nothing is refused."""
    write(tmp_path / "before", seed=0, config={"opt": {"lr": 1, "warmup": 5}})
    after = write(tmp_path / "after", seed=0, config={"opt": {"lr": 1}})
    assert sync(sink, tmp_path, tmp_path / "before").exit_code == 0
    (tmp_path / "state" / "ledger.sqlite3").unlink()  # as from another machine
    again = sync(sink, tmp_path, tmp_path / "after")
    assert again.exit_code == 0, again.stderr
    held = sink.client.run("local", "resent", JOB)
    assert held["config"]["opt"] == {"lr": 1}
    assert_exactly_once(held, expected_from_log(after))
