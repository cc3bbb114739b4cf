"""The Python API (`wbmerge.api`) does what the CLI does, and every command runs as a module.

The CLI is a thin layer over the API, so each test here compares the API's result with an
independent truth: the fixture's launch manifest, the bytes the CLI wrote, or what arrived
in the sink (read back through the sink's own client).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import warnings

import pytest
from click.testing import CliRunner

from wbmerge import api
from wbmerge.cli import main
from wbmerge.errors import WbmergeError
from wbmerge.sink import SinkClient
from wbmerge.sync import option_names

from ..conftest import MANIFEST, ROOT, job_dir
from ..support.sinktools import expected_from_log

COMMANDS = ["inspect", "merge", "sync", "follow", "export", "report", "sink"]


@pytest.mark.parametrize("module", ["wbmerge", "wbmerge.cli"])
def test_every_command_runs_as_a_module(module):
    listed = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert listed.returncode == 0, listed.stderr
    for command in COMMANDS:
        assert f"  {command} " in listed.stdout
        one = subprocess.run(
            [sys.executable, "-m", module, command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert one.returncode == 0, (command, one.stderr)
        assert one.stdout.startswith(f"Usage: wbmerge {command}")


def test_a_module_run_does_real_work():
    done = subprocess.run(
        [sys.executable, "-m", "wbmerge", "inspect", "--json", str(job_dir("one_node_4"))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(r["rank"] for r in json.loads(done.stdout)) == [0, 1, 2, 3]


def test_discover_finds_every_rank_the_job_launched():
    job = MANIFEST["jobs"]["two_nodes_2x2"]
    runs = api.discover([job_dir("two_nodes_2x2")])
    world = job["nodes"] * job["nproc"]
    assert [r.rank.rank for r in runs] == list(range(world))
    assert [(r.rank.worker, r.rank.local_rank) for r in runs] == [
        (rank // job["nproc"], rank % job["nproc"]) for rank in range(world)
    ]


def test_plan_writes_nothing_and_names_the_plugins_runs(tmp_path):
    planned = api.plan([job_dir("two_nodes_2x2")], run_mode="new", rank_scope="worker")
    (job,) = planned
    ids = sorted(t.id for t in job.targets)
    base = job.job.job_id
    # The plugin's ids in new mode with rank_scope worker: {base}-worker-{w}-rank-{local}.
    assert ids == sorted(f"{base}-worker-{w}-rank-{r}" for w in (0, 1) for r in (0, 1))
    assert {t.group for t in job.targets} == {f"{base}-worker-0", f"{base}-worker-1"}


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="run_mod"):
        api.plan([job_dir("one_node_4")], run_mod="shared")


def test_one_path_is_a_path_not_a_list_of_its_characters(tmp_path):
    """`api.discover("./wandb")` reads that directory (a string is not a list of paths of a
    character each); so does a `Path`, and `metrics` may be one name."""
    source = job_dir("slow_rank")
    listed = [(r.rank, r.path) for r in api.discover([source])]
    assert [(r.rank, r.path) for r in api.discover(str(source))] == listed
    assert [(r.rank, r.path) for r in api.discover(source)] == listed
    assert [j.job.job_id for j in api.plan(str(source))] == [
        j.job.job_id for j in api.plan([source])
    ]
    one = api.report(source, metrics="train/loss")
    assert [m.key for m in one[0].metrics] == ["train/loss"]
    assert [r["run_id"] for r in api.inspect(source)] == [
        r["run_id"] for r in api.inspect([source])
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"parallel": 0}, "parallel must be a whole number, 1 or more, not 0"),
        ({"parallel": "4"}, "parallel must be a whole number, 1 or more, not '4'"),
        ({"timeout": -1}, "timeout must be a number of seconds above 0, not -1"),
    ],
)
def test_sync_refuses_what_the_cli_refuses(options, message, tmp_path, monkeypatch):
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path))
    with pytest.raises(WbmergeError, match=message) as raised:
        api.sync(job_dir("one_node_4"), project="p", **options)
    assert raised.value.exit_code == 2


def test_ranks_assumed_from_start_order_are_said_as_the_cli_says_them(tmp_path):
    """recipe_group's runs say no rank: merge and plan, told to accept the start order,
    assume the ranks from it. The API says so as an InputWarning, as the CLI prints it, and
    in the plan's warnings."""
    source = job_dir("recipe_group")
    [job] = api.plan(source, run_mode="shared", rank_order="start")
    [assumed] = [w for w in job.warnings if "assumed from start order" in w]
    with pytest.warns(api.InputWarning) as said:
        api.merge(source, tmp_path / "out", run_mode="shared", rank_order="start")
    assert assumed in [str(w.message) for w in said]
    printed = CliRunner().invoke(
        main,
        [
            "merge",
            "--run-mode",
            "shared",
            "--rank-order",
            "start",
            "--out",
            str(tmp_path / "cli"),
            str(source),
        ],
    )
    assert f"wbmerge: warning: {assumed}" in printed.stderr


def test_the_errors_a_sync_raises_are_the_apis():
    from wbmerge.sync import UploadFailed
    from wbmerge.upload import ServerError

    assert api.UploadFailed is UploadFailed and api.ServerError is ServerError
    assert issubclass(api.UploadFailed, api.WbmergeError)
    assert issubclass(api.ServerError, api.WbmergeError)


def test_a_failure_of_several_jobs_gives_its_advice_once_after_every_run():
    """Each job's lines end with what to do (rerun; or upload under other run ids): said
    once each, in the order first given, after the runs of every job."""
    rerun = "nothing missing was recorded as synced; rerun `wbmerge sync` to send it"
    other_ids = (
        "syncing again cannot complete these runs: upload under other run ids (with --base-id "
        "ID), or delete the runs on the server first"
    )
    failed = api.UploadFailed(
        [
            "run a: history rows 1 of 3",
            rerun,
            "run b: refused",
            other_ids,
            "run c: file config.yaml not uploaded",
            rerun,
        ],
        api.SyncReport([]),
    )
    assert failed.lines == [
        "run a: history rows 1 of 3",
        "run b: refused",
        "run c: file config.yaml not uploaded",
        rerun,
        other_ids,
    ]
    assert failed.exit_code == 1 and str(failed) == "; ".join(failed.lines)


def test_merge_writes_what_the_cli_writes(tmp_path):
    staged = api.merge([job_dir("one_node_4")], tmp_path / "api", run_mode="shared")
    result = CliRunner().invoke(
        main,
        [
            "merge",
            "--run-mode",
            "shared",
            "--out",
            str(tmp_path / "cli"),
            str(job_dir("one_node_4")),
        ],
    )
    assert result.exit_code == 0, result.output
    (one,) = staged
    twin = tmp_path / "cli" / one.run_dir.name / one.log_path.name
    assert one.log_path.read_bytes() == twin.read_bytes()
    assert one.history_rows == MANIFEST["jobs"]["one_node_4"]["steps"]


def test_merge_refuses_to_write_into_its_sources():
    source = job_dir("one_node_4")
    with pytest.raises(WbmergeError, match="--out"):
        api.merge([source], source / "merged", run_mode="shared")


def test_export_and_report_match_the_cli(tmp_path):
    source = [job_dir("slow_rank")]
    exported = api.export(source, tmp_path / "api.parquet")
    result = CliRunner().invoke(
        main, ["export", "-o", str(tmp_path / "cli.parquet"), *map(str, source)]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {exported.rows} values of {exported.ranks} ranks" in result.output
    assert exported.ranks == MANIFEST["jobs"]["slow_rank"]["nproc"]

    reports = api.report(source)
    printed = CliRunner().invoke(main, ["report", "--json", *map(str, source)])
    assert printed.exit_code == 0, printed.output
    assert [r.to_dict() for r in reports] == json.loads(printed.output)
    # The fixture's rank 2 sleeps every step: the report must name it as the slow rank.
    slow = int(MANIFEST["jobs"]["slow_rank"]["train_args"][-1])
    assert any(m.slowest == slow for m in reports[0].metrics)


@pytest.mark.e2e
def test_sync_uploads_and_verifies(sink, tmp_path, monkeypatch):
    for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    # Garbage an earlier test in this process left (a socket in a reference cycle) is
    # collected first: the warnings counted are those of the sockets this sync left.
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:  # (a long-lived caller's sockets)
        warnings.simplefilter("always", ResourceWarning)
        result = api.sync([job_dir("one_node_4")], run_mode="auto", project="api-test")
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
    (synced,) = result.targets
    assert synced.status == "uploaded"
    log = next(
        p
        for p in sorted(job_dir("one_node_4").glob("wandb/*/run-*.wandb"))
        if expected_from_log(p).config["wbmerge"]["rank"] == 0
    )
    want = expected_from_log(log)
    entity = synced.url.split("/")[-4]
    got = sink.client.run(entity, "api-test", synced.target.id)
    rows = [{k: v for k, v in row.items() if k in want.history[0]} for row in got["history"]]
    assert rows == want.history


def test_a_type_checker_names_a_wrong_option_or_run_mode(tmp_path):
    """The API's keywords are typed (`RequestOptions`), so a misspelt option or a run mode
    that does not exist is found before anything runs, and results have their types."""
    script = tmp_path / "user.py"
    script.write_text(
        "from wbmerge import api\n"
        "api.sync(['./wandb'], run_mode='sharde')\n"
        "api.plan('./wandb', rank_scop='worker')\n"
        "report = api.sync('./wandb', run_mode='shared', rank_scope='worker', verify='full')\n"
        "reveal_type(report.targets)\n"
        "reveal_type(api.follow('./wandb', run_mode='new'))\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--ignore-missing-imports",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if ": " in line]
    assert lines == [
        'error: Argument "run_mode" to "sync" has incompatible type "Literal[\'sharde\']"; '
        "expected \"Literal['auto', 'shared', 'new'] | None\"  [arg-type]",
        'error: Unexpected keyword argument "rank_scop" for "plan"; did you mean "rank_scope"?'
        "  [call-arg]",
        'note: "plan" defined in "wbmerge.api"',
        'note: Revealed type is "list[wbmerge.sync.pipeline.SyncedTarget]"',
        'note: Revealed type is "wbmerge.follow.FollowReport"',
    ], result.stdout + result.stderr


def test_the_typed_options_are_the_requests_fields():
    assert set(api.RequestOptions.__annotations__) == option_names()


@pytest.mark.e2e
def test_a_sink_started_from_python_takes_a_sync_and_stops(tmp_path, monkeypatch):
    import os
    import socket
    import stat

    old_umask = os.umask(0o022)  # (what most shells give: the log must not follow it)
    try:
        sink = api.start_sink(tmp_path / "sink", port=0)
    finally:
        os.umask(old_umask)
    with sink:
        assert sink.api_key == (tmp_path / "sink" / "api-key").read_text().strip()
        log = tmp_path / "sink.log"
        assert sink.api_key in log.read_text()  # (its first lines say the key) ...
        assert stat.S_IMODE(log.stat().st_mode) == 0o600  # ... so it is the owner's alone
        with pytest.raises(WbmergeError, match="runs already"):
            sink.start()
        for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
            monkeypatch.setenv(name, value)
        result = api.sync(job_dir("one_node_4"), run_mode="auto", project="from-python")
        (synced,) = result.targets
        entity = synced.url.split("/")[-4]
        got = SinkClient(sink.url, sink.api_key).run(entity, "from-python", synced.target.id)
        log = next(
            p
            for p in sorted(job_dir("one_node_4").glob("wandb/*/run-*.wandb"))
            if expected_from_log(p).config["wbmerge"]["rank"] == 0
        )
        want = expected_from_log(log).history
        assert [{k: row[k] for k in want[0]} for row in got["history"]] == want
    port = int(sink.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # A sink that cannot start says why, in one line, as `wbmerge sink serve` would.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(WbmergeError, match=f"cannot serve on 127.0.0.1:{busy}"):
            api.start_sink(tmp_path / "other", port=busy)


@pytest.mark.e2e
def test_a_sink_left_running_stops_when_its_python_ends(tmp_path):
    script = (
        "import sys\n"
        "from wbmerge import api\n"
        f"sink = api.start_sink({str(tmp_path / 'sink')!r}, port=0)\n"
        "print(sink.process.pid, sink.url.rsplit(':', 1)[1], flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    pid, port = map(int, done.stdout.split())
    import os
    import socket

    with pytest.raises(ConnectionRefusedError):  # (nothing holds its port any more)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ProcessLookupError):  # (stopped and reaped before its Python ended)
        os.kill(pid, 0)
