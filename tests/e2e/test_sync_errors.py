"""What `wbmerge sync` / `merge` do with input that cannot be merged as asked: one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile

import pytest
from click.testing import CliRunner

from wbmerge import api
from wbmerge.cli import main

from ..conftest import job_dir
from ..support.sinktools import expected_from_log

LOCAL = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "local-" + "0" * 40}


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env={**LOCAL, **(env or {})})


def assert_one_line_error(result, *fragments, code=2):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output


def copy_job(name, dest, skip_ranks=()):
    for run_dir in (job_dir(name) / "wandb").iterdir():
        rank = expected_from_log(next(run_dir.glob("*.wandb"))).config["wbmerge"]["rank"]
        if rank not in skip_ranks:
            shutil.copytree(run_dir, dest / "wandb" / run_dir.name)
    return dest


def test_missing_rank_is_named(tmp_path):
    copy_job("one_node_4", tmp_path, skip_ranks={2})
    assert_one_line_error(
        run("sync", tmp_path, "--dry-run"), "rank(s) 2 of 4", "--allow-missing-ranks"
    )
    result = run(
        "sync", tmp_path, "--dry-run", "--json", "--run-mode", "new", "--allow-missing-ranks"
    )
    assert result.exit_code == 0
    assert [t["id"] for t in json.loads(result.output)] == [
        f"fx-one-node-4-rank-{r}" for r in (0, 1, 3)
    ]


def test_same_rank_twice_names_both_paths(tmp_path):
    copy_job("one_node_4", tmp_path)
    first = sorted((tmp_path / "wandb").iterdir())[0]
    shutil.copytree(first, tmp_path / "copy" / first.name)
    result = run("sync", tmp_path, "--dry-run")
    assert_one_line_error(result, "claimed twice", str(first.name))
    assert result.stderr.count(first.name) == 2


def test_two_plain_runs_claiming_one_rank_are_named_with_the_option_that_resolves_it(
    tmp_path,
):
    shutil.copytree(job_dir("plain_labels") / "wandb", tmp_path / "wandb")
    first = sorted((tmp_path / "wandb").iterdir())[0]
    shutil.copytree(first, tmp_path / "copy" / first.name)  # the same run twice
    result = run("sync", tmp_path, "--dry-run")
    assert_one_line_error(result, "claimed by more than one run", "--ranks")
    assert result.stderr.count(first.name) == 2 and "label 'rank-" in result.stderr


def test_two_jobs_in_one_directory(tmp_path):
    copy_job("one_node_4", tmp_path)
    copy_job("cadence", tmp_path)
    result = run("sync", tmp_path, "--dry-run", "--json")
    assert result.exit_code == 0
    assert sorted(t["id"] for t in json.loads(result.output)) == ["fx-cadence", "fx-one-node-4"]
    result = run(
        "sync", tmp_path, "--dry-run", "--json", "--job", "fx-cadence", "--run-mode", "shared"
    )
    [target] = json.loads(result.output)
    assert target["id"] == "fx-cadence" and len(target["sources"]) == 4
    assert_one_line_error(
        run("sync", tmp_path, "--dry-run", "--base-id", "x"), "--base-id names one job"
    )
    assert_one_line_error(run("sync", tmp_path, "--dry-run", "--job", "nope"), "no job 'nope'")


def test_dry_run_json_has_the_documented_keys():
    result = run(
        "sync",
        job_dir("two_nodes_2x2"),
        "--dry-run",
        "--json",
        "--run-mode",
        "shared",
        "--rank-scope",
        "worker",
    )
    targets = json.loads(result.output)
    assert {"id", "group", "job_type", "display_name", "primary_rank", "sources"} <= set(targets[0])
    assert [s["label"] for s in targets[1]["sources"]] == ["worker-1-rank-0", "worker-1-rank-1"]
    assert targets[1]["primary_rank"] == 2


def test_no_credentials_fails_before_any_work(tmp_path):
    result = CliRunner().invoke(
        main,
        ["sync", str(job_dir("one_node_4")), "--keep-staging", str(tmp_path / "stage")],
        env={
            "WANDB_API_KEY": None,
            "WANDB_BASE_URL": "http://127.0.0.1:9",
            "NETRC": str(tmp_path / "none"),
            "HOME": str(tmp_path),
        },
    )
    assert_one_line_error(result, "no W&B credentials", "WANDB_API_KEY")
    assert not (tmp_path / "stage").exists()


def test_unreachable_server_is_a_failure_not_success(tmp_path):
    env = {"WBMERGE_STATE_DIR": str(tmp_path)}
    result = run("sync", job_dir("media"), "-p", "x", "-e", "local", env=env)
    assert_one_line_error(result, "cannot reach W&B at http://127.0.0.1:9/graphql", code=1)
    assert not (tmp_path / "ledger.sqlite3").exists()  # nothing recorded as synced


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--base-id", "team/exp"], "cannot contain"),
        (["--key-format", "{key}"], "must contain {key} and {label}"),
        (
            ["--key-format", "{nope}"],
            "bad --key-format '{nope}': no field {nope} (it may use {key} and {label})",
        ),
        # (a huge width was a MemoryError, exit 70; a spec may hold no other field)
        (
            ["--key-format", "{key:>99999999999}/{label}"],
            "bad --key-format '{key:>99999999999}/{label}': {key} may have at most an "
            "alignment and a width of up to 3 digits",
        ),
        (["--key-format", "{key}/{label:{key}}"], "{label} may have at most an alignment"),
        (["--key-format", "{key.__class__}/{label}"], "no field {key.__class__} (it may use"),
        # (the docs allow an alignment and a width: a conversion is neither)
        (
            ["--key-format", "{key}{label!r}"],
            "bad --key-format '{key}{label!r}': {label!r} converts the label; a field may have "
            "only an alignment and a width of up to 3 digits (e.g. {label:>8})",
        ),
        (["--key-format", "{key!s}/{label}"], "{key!s} converts the key; a field may have"),
        # (it holds both fields: what is wrong is that the label is cut to nothing)
        (
            ["--key-format", "{key:>999}/{label:.0}"],
            "bad --key-format '{key:>999}/{label:.0}': {label:.0} cuts the label short "
            "('rank-3' becomes ''), so the keys of two ranks could be one",
        ),
        (
            ["--key-format", "{key:.4}/{label}"],
            "{key:.4} cuts the key short ('train/loss' becomes 'trai'), so two keys could be one",
        ),
        (["--base-id", ""], "--base-id is empty: give the run id to upload under, or leave"),
        (["--base-id", " "], "--base-id is empty: give the run id to upload under, or leave"),
    ],
)
def test_bad_options(args, fragment):
    assert_one_line_error(run("sync", job_dir("one_node_4"), "--dry-run", *args), fragment)


@pytest.mark.parametrize("command", ["merge", "sync", "follow"])
def test_an_empty_base_id_is_refused_by_every_command(tmp_path, command):
    where = ["--out", tmp_path / "out"] if command == "merge" else ["-p", "x", "-e", "local"]
    result = run(
        command,
        job_dir("one_node_4"),
        "--base-id",
        "",
        *where,
        env={"WBMERGE_STATE_DIR": str(tmp_path / "state")},
    )
    assert_one_line_error(result, "--base-id is empty")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key_format, field, cut",
    [
        ("{key}/{label:.6}", "{label:.6}", "label short, so the keys of two ranks"),
        ("{key:.100}/{label:>8}", "{key:.100}", "key short, so two keys"),
    ],
)
def test_a_precision_is_refused_though_the_sample_stays_whole(key_format, field, cut):
    # `{label:.6}` keeps `rank-3` whole but makes `rank-10` `rank-1`: ranks 1 and 10 would
    # log into one key. Before, such a format was taken, its sample being whole.
    assert_one_line_error(
        run("sync", job_dir("one_node_4"), "--dry-run", "--key-format", key_format),
        f"bad --key-format {key_format!r}: {field} has a precision, which cuts any longer "
        f"{cut} could be one",
    )


def test_a_width_and_an_alignment_are_taken():
    result = run(
        "sync",
        job_dir("one_node_4"),
        "--dry-run",
        "--run-mode",
        "shared",
        "--key-format",
        "{key:<100}/{label:>8}",
    )
    assert result.exit_code == 0, result.stderr


def test_nothing_there(tmp_path):
    assert_one_line_error(run("merge", tmp_path, "--out", tmp_path / "o"), "no offline W&B run")


@pytest.mark.parametrize("parallel", ["0", "-3"])
def test_no_runs_at_once_is_refused_before_any_work(tmp_path, parallel):
    result = run("sync", str(job_dir("one_node_4")), "-n", parallel)
    assert_one_line_error(
        result, f"Invalid value for '--parallel' / '-n': {parallel} is not in the range x>=1"
    )


@pytest.mark.parametrize("command", [["sync", "--follow"], ["follow"]], ids=" ".join)
@pytest.mark.parametrize("value", ["nan", "inf", "1e999"])  # (below 0: refused before)
@pytest.mark.parametrize("option", ["--interval", "--idle-timeout", "--restart-grace", "--timeout"])
def test_a_number_of_seconds_that_is_not_finite_or_below_its_minimum_is_refused(
    option, value, command
):
    # (a NaN --interval made the rounds a busy loop, a NaN --idle-timeout never ended)
    result = run(command[0], job_dir("one_node_4"), *command[1:], option, value)
    assert_one_line_error(
        result, f"Invalid value for '{option}': ", f"(see wbmerge {command[0]} --help)"
    )
    assert f"{value!r} is not a finite number of seconds." in result.stderr


@pytest.mark.parametrize("name", ["interval", "idle_timeout", "restart_grace", "timeout"])
def test_the_api_refuses_seconds_that_are_not_finite(name):
    with pytest.raises(api.WbmergeError, match=f"{name} must be a finite number of seconds"):
        api.follow(
            job_dir("one_node_4"), **{name: float("nan") if name != "timeout" else float("inf")}
        )


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["sync", "--run-mode", "x", "."],
            "Invalid value for '--run-mode': 'x' is not one of "
            "'auto', 'shared', 'new'. (see wbmerge sync --help)",
        ),
        (["merge", "."], "Missing option '--out'. (see wbmerge merge --help)"),
        # (click names no command for an option's missing value: the arguments do)
        (["merge", "--out"], "Option '--out' requires an argument. (see wbmerge merge --help)"),
        (
            ["sink", "serve", "--port"],
            "Option '--port' requires an argument. (see wbmerge sink serve --help)",
        ),
        (["sync"], "Missing argument 'PATHS...'. (see wbmerge sync --help)"),
        (["snyc", "."], "No such command 'snyc'. Did you mean 'sync'? (see wbmerge --help)"),
        (
            ["sink", "shwo"],
            "No such command 'shwo'. Did you mean 'show'? (see wbmerge sink --help)",
        ),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help(args, line):
    """click would print four lines (usage, a hint, a blank line, the error)."""
    result = run(*args)
    assert result.exit_code == 2
    assert result.stderr == f"wbmerge: error: {line}\n"


@pytest.mark.parametrize(
    "args, line",
    [
        (["-p", "team/exp"], "invalid project 'team/exp': W&B refuses / in project names"),
        (["-p", "a:b#c"], "invalid project 'a:b#c': W&B refuses # : in project names"),
        (["-p", "p" * 129], f"invalid project {'p' * 40!r}...: longer than W&B's 128 characters"),
        (["-p", "p", "-e", "me/you"], "invalid entity 'me/you': W&B refuses / in entity names"),
        (["-p", ".."], "invalid project '..': not a name a URL path can hold"),
        (["-p", "a\tb"], "invalid project 'a\\tb': not a name a URL path can hold"),
    ],
)
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_project_w_and_b_refuses_is_bad_input_before_any_upload(tmp_path, args, line, dry_run):
    """W&B refuses these names; the upload of every run would fail, unexplained. The server
    here answers nothing: the name is refused before it is asked, and by a dry run too."""
    env = {"WBMERGE_STATE_DIR": str(tmp_path)}
    result = run("sync", job_dir("one_node_4"), *args, *dry_run, env=env)
    assert_one_line_error(result, line)


def test_a_state_directory_that_is_a_file_is_bad_input_and_leaves_no_staging(
    sink, tmp_path, monkeypatch
):
    """WBMERGE_STATE_DIR naming a file: one line naming it (not an internal error), exit 2,
    and no staging directory left in the temp dir."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # (where staging goes)
    state = tmp_path / "state-file"
    state.write_text("not a directory")
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    result = CliRunner().invoke(main, ["sync", str(job_dir("one_node_4"))], env=env)
    assert_one_line_error(
        result,
        f"cannot keep the ledger of synced runs in {state} (File exists)",
        "set WBMERGE_STATE_DIR",
    )
    assert list((tmp_path / "tmp").rglob("*")) == [tmp_path / "tmp" / f"wbmerge-{os.getuid()}"]
    assert sink.client.runs() == []


@pytest.mark.parametrize(
    "make, why",
    [
        ("CREATE TABLE synced (key TEXT, value TEXT)", "its runs have the columns key, value"),
        (None, "file is not a database"),
    ],
)
def test_a_ledger_of_another_schema_is_one_line_naming_it(sink, tmp_path, make, why):
    ledger = tmp_path / "state" / "ledger.sqlite3"
    ledger.parent.mkdir()
    if make is None:
        ledger.write_bytes(b"not a database, a file of another tool" * 100)
    else:
        with sqlite3.connect(ledger) as db:
            db.execute(make)
    env = {**sink.env, "WBMERGE_STATE_DIR": str(ledger.parent)}
    result = CliRunner().invoke(main, ["sync", str(job_dir("one_node_4")), "-p", "x"], env=env)
    assert_one_line_error(
        result,
        f"the ledger at {ledger} was not written by this version of wbmerge ({why}); set "
        "WBMERGE_STATE_DIR to another directory",
    )
    assert sink.client.runs() == []


def test_a_ledger_another_process_holds_locked_is_one_line_naming_it(sink, tmp_path):
    ledger = tmp_path / "state" / "ledger.sqlite3"
    ledger.parent.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], "
            "isolation_level=None); db.execute('BEGIN EXCLUSIVE'); print('held', flush=True); "
            "sys.stdin.read()",
            str(ledger),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        env = {**sink.env, "WBMERGE_STATE_DIR": str(ledger.parent)}
        result = CliRunner().invoke(main, ["sync", str(job_dir("one_node_4")), "-p", "x"], env=env)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert_one_line_error(
        result,
        f"the ledger at {ledger} is locked by another process (pid {holder.pid}, "
        f"{sys.executable}), still after 5 s; rerun when it is done",
    )
    assert sink.client.runs() == []


@pytest.mark.parametrize("how", ["writable by others", "another user's"])
def test_a_state_directory_other_users_may_write_is_refused_in_one_line(sink, tmp_path, how):
    # (they could plant a ledger saying runs are synced, or a link where wbmerge writes)
    state = tmp_path / "state"
    state.mkdir()
    if how == "writable by others":
        state.chmod(0o777)
        why = "may be written by other users (mode 777)"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user takes root")
        os.chown(state, 65534, 65534)
        why = f"belongs to uid 65534, not to this user (uid {os.geteuid()})"
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    result = CliRunner().invoke(main, ["sync", str(job_dir("one_node_4")), "-p", "x"], env=env)
    assert_one_line_error(
        result, f"state directory {state} {why}; set WBMERGE_STATE_DIR to a directory of your own"
    )
    assert sink.client.runs() == [] and list(state.iterdir()) == []


def test_a_sink_port_out_of_range_is_a_usage_error(tmp_path):
    line = (
        "wbmerge: error: Invalid value for '--port': 99999 is not in the range "
        "0<=x<=65535. (see wbmerge sink serve --help)\n"
    )
    result = run("sink", "serve", "--port", "99999", "--data", tmp_path / "sink")
    assert (result.exit_code, result.stderr) == (2, line)
    as_module = subprocess.run(  # (`python -m wbmerge.sink` names the same help)
        [sys.executable, "-m", "wbmerge.sink", "--port", "99999", "--data", tmp_path / "sink"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (as_module.returncode, as_module.stderr) == (2, line)
    assert not (tmp_path / "sink").exists()


@pytest.mark.parametrize(
    "command, line",
    [
        ("merge", "wbmerge: interrupted\n"),
        ("sync", "wbmerge: interrupted; runs verified so far stay recorded\n"),
    ],
)
def test_ctrl_c_says_what_the_command_keeps(tmp_path, monkeypatch, command, line):
    """Ctrl-C while the work goes on (here: as `api.merge` or `api.sync` starts): exit 130,
    one line; only a sync has verified runs to keep."""

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, command, ctrl_c)
    out = ["--out", str(tmp_path / "out")] if command == "merge" else []
    result = run(command, job_dir("one_node_4"), *out, env={"WBMERGE_STATE_DIR": str(tmp_path)})
    assert (result.exit_code, result.stderr) == (130, line)


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    # `wbmerge inspect ... | head -1`: the pipe closes before wbmerge writes its table.
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "wbmerge.cli", "inspect", str(job_dir("one_node_4"))],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""


def test_an_option_the_run_mode_does_not_use_is_said_once(tmp_path):
    result = run(
        "merge",
        job_dir("one_node_4"),
        "--run-mode",
        "new",
        "--rank-stats",
        "--out",
        tmp_path / "out",
    )
    assert result.exit_code == 0, result.stderr
    said = "wbmerge: warning: --rank-stats applies to shared runs only; ignored for --run-mode new"
    assert result.stderr.splitlines().count(said) == 1
    assert len(list((tmp_path / "out").glob("offline-run-*"))) == 4  # merged as asked
