"""Recovery converges: after damage to a run on the server, the command wbmerge's failure
line names ends with the run exact, in one run of it.

Each test syncs a small job into a sink that behaves like W&B, damages one run inside the
sink's own store (as a server incident does: rows lost, twice or moved, console lines lost,
a summary or config value changed or removed, a file or the whole run lost), runs `wbmerge
verify` (or `wbmerge sync` from another machine's state), reads the line it prints, runs
exactly the command that line advises, and compares the run on the sink with the ranks'
own files, read with protobuf (sinktools), not with wbmerge.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
import urllib.parse

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.training import RankInfo

from ..support import synthetic
from ..support.sinktools import console_text, expected_from_log, system_metric_values
from .test_sync import assert_shared

pytestmark = pytest.mark.e2e
RANKS = 2
STEPS = 300
PROJECT = "mend"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two small ranks (300 rows of 3 metrics, 6 console lines and 3 system-metric rows
    each), by rank."""
    root = tmp_path_factory.mktemp("job")
    logs = {}
    for rank in range(RANKS):
        info = RankInfo(rank, rank, RANKS, RANKS, 0, 0, "mendjob")
        logs[rank] = synthetic.write_rank(root, info, STEPS, metrics=3)
    return root, logs


def cli(sink, state, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    result = CliRunner().invoke(main, [*map(str, args)], env=env)
    assert "Traceback" not in result.output + result.stderr
    return result


def options(root, mode, base_id):
    return [root, "--run-mode", mode, "-p", PROJECT, "-e", "local", "--base-id", base_id]


def run_ids(mode, base_id):
    return [base_id] if mode == "shared" else [f"{base_id}-rank-{r}" for r in range(RANKS)]


def last_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error:")]
    assert lines, result.output + result.stderr
    return lines[-1]


# ---- damage inside the sink's own store -----------------------------------------------------


def _run_pk(db, run_id):
    [pk] = db.execute("SELECT pk FROM runs WHERE name = ?", (run_id,)).fetchone()
    return pk


def _lines(db, pk, stream):
    return db.execute(
        "SELECT offset, line, step FROM lines WHERE run = ? AND stream = ? ORDER BY offset",
        (pk, stream),
    ).fetchall()


def _put_lines(db, pk, stream, at, lines):
    db.executemany(
        "INSERT OR REPLACE INTO lines (run, stream, offset, line, step) VALUES (?, ?, ?, ?, ?)",
        [(pk, stream, at + i, line, step) for i, (_, line, step) in enumerate(lines)],
    )


def rows_lost_inside(db, pk):
    db.execute(
        "DELETE FROM lines WHERE run = ? AND stream = 'history' AND offset BETWEEN 100 AND 119",
        (pk,),
    )


def rows_lost_at_the_end(db, pk):
    db.execute(
        "DELETE FROM lines WHERE run = ? AND stream = 'history' AND offset >= ?", (pk, STEPS - 30)
    )


def rows_twice(db, pk):
    """The first 10 rows again past the last, as a second writer that began at offset 0
    and was placed at the run's end leaves them."""
    history = _lines(db, pk, "history")
    _put_lines(db, pk, "history", len(history), history[:10])


def rows_moved(db, pk):
    """The first 10 rows written again over rows 50-59 (a batch sent at a stale offset,
    wandb#12269): the line count is unchanged, steps 0-9 twice, steps 50-59 gone."""
    _put_lines(db, pk, "history", 50, _lines(db, pk, "history")[:10])


def console_lost(db, pk):
    db.execute("DELETE FROM lines WHERE run = ? AND stream = 'console' AND offset >= 2", (pk,))


def _edit_json(db, pk, column, edit):
    [text] = db.execute(f"SELECT {column} FROM runs WHERE pk = ?", (pk,)).fetchone()
    value = json.loads(text)
    edit(value)
    db.execute(f"UPDATE runs SET {column} = ? WHERE pk = ?", (json.dumps(value), pk))


def _a_metric(summary):
    return sorted(key for key in summary if key.startswith("train/"))[0]


def summary_changed(db, pk):
    _edit_json(db, pk, "summary", lambda s: s.__setitem__(_a_metric(s), -12345.5))


def summary_removed(db, pk):
    _edit_json(db, pk, "summary", lambda s: s.pop(_a_metric(s)))


def config_changed(db, pk):
    _edit_json(db, pk, "config", lambda c: c.__setitem__("lr", {"value": 0.5}))


def config_removed(db, pk):
    _edit_json(db, pk, "config", lambda c: c.pop("lr"))


def run_lost(db, pk):
    """The whole run gone: every line, file and the run itself."""
    for table in ("lines", "files"):
        db.execute(f"DELETE FROM {table} WHERE run = ?", (pk,))
    db.execute("DELETE FROM runs WHERE pk = ?", (pk,))


def file_lost(db, pk):
    gone = db.execute("DELETE FROM files WHERE run = ? AND name = 'config.yaml'", (pk,))
    assert gone.rowcount == 1


def damage(sink, run_id, how) -> None:
    """Damage `run_id` in the sink's store, then start the sink again on its port, as a
    server holds its runs after an incident: the counts and cursors a W&B-like sink keeps
    in memory are those of the damaged run. Its counts lag as W&B's do, so they are asked
    for once and waited for: a run held from before a start is counted from its first
    question on."""
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        how(db, _run_pk(db, run_id))
    db.close()
    restart(sink)


def restart(sink) -> None:
    sink.port = int(urllib.parse.urlsplit(sink.url).port)
    sink.restart()
    if sink.like is not None and sink.like.lag:
        for run in sink.client.runs(project=PROJECT):
            resume_status(sink, run["id"])
        time.sleep(max(sink.like.lag, sink.like.tail_seconds))


def resume_status(sink, run_id):
    query = (
        "query RunResumeStatus($project: String, $entity: String, $name: String!) "
        "{ model(name: $project, entityName: $entity) { bucket(name: $name) "
        "{ historyLineCount } } }"
    )
    sink.client.graphql(query, {"project": PROJECT, "entity": "local", "name": run_id})


def delete_run(sink, run_id) -> None:
    """Delete a run on the server, as a user does in W&B's UI."""
    damage(sink, run_id, run_lost)


# ---- what the run must be: the ranks' own files ---------------------------------------------


def assert_exact(sink, mode, base_id, logs):
    """Every run of the job on the sink as its ranks' files make it: rows by value and
    `_step` once, console lines, system metrics, summary, config and files."""
    wanted = {rank: expected_from_log(log) for rank, log in logs.items()}
    for run_id in run_ids(mode, base_id):
        got = sink.client.run("local", PROJECT, run_id)
        assert got["state"] == "finished" and got["exit_code"] == 0, run_id
        assert {"config.yaml", "output.log", "wandb-summary.json"} <= set(got["files"])
        assert got["config"]["lr"] == 0.001
        if mode == "shared":
            ranks = [(f"rank-{rank}", want, logs[rank]) for rank, want in sorted(wanted.items())]
            assert_shared(got, ranks)
            assert len(got["console"]) == sum(len(want.console) for want in wanted.values())
            assert got["summary"]["_step"] == STEPS - 1
            continue
        want = wanted[int(run_id.rsplit("-", 1)[1])]
        assert got["history"] == want.history
        assert console_text(got["console"]) == want.console
        assert system_metric_values(got["system_metrics"]) == want.stats
        assert {k: v for k, v in got["summary"].items() if k in want.summary} == want.summary
        assert got["summary"]["_step"] == STEPS - 1


def synced(sink, tmp_path, root, mode, base_id):
    state = tmp_path / "state"
    first = cli(sink, state, "sync", *options(root, mode, base_id))
    assert first.exit_code == 0, first.stderr
    return state


# ---- each damage, mended by the command the failure line names -------------------------------

# Damage that `wbmerge sync --resend` mends: each line is sent again over the one at its
# place, the config merged, the summary and files put again.
MENDED_BY_RESEND = [
    rows_lost_inside,
    rows_lost_at_the_end,
    rows_moved,
    console_lost,
    summary_changed,
    summary_removed,
    config_changed,
    config_removed,
    file_lost,
    run_lost,
]
CASES = [(how, "new") for how in MENDED_BY_RESEND] + [
    (how, "shared") for how in (rows_lost_inside, rows_moved, console_lost, summary_changed)
]


@pytest.mark.parametrize("how, mode", CASES, ids=[f"{h.__name__}-{m}" for h, m in CASES])
def test_verify_names_a_command_that_makes_the_damaged_run_exact(
    wandb_like_sink, tmp_path, job, how, mode
):
    root, logs = job
    sink, base = wandb_like_sink, f"{mode}-{how.__name__}".replace("_", "-")
    state = synced(sink, tmp_path, root, mode, base)
    victim = run_ids(mode, base)[0]
    damage(sink, victim, how)

    # A plain sync finds every run recorded as synced in its ledger and sends nothing: the
    # line must not point at it.
    checked = cli(sink, state, "verify", *options(root, mode, base))
    assert checked.exit_code == 1, checked.output
    line = last_error(checked)
    assert (
        f"`wbmerge sync --resend` with them sends the runs whole again over what the "
        f"server holds, which mends {victim}" in line
    )
    assert "no upload" not in line

    mended = cli(sink, state, "sync", *options(root, mode, base), "--resend")
    assert mended.exit_code == 0, mended.stderr
    assert_exact(sink, mode, base, logs)
    # The summary W&B answers comes from a cache as late as the counts: a verify asked
    # sooner would see the one from before the resend.
    time.sleep(sink.like.tail_seconds)
    again = cli(sink, state, "verify", *options(root, mode, base))
    assert again.exit_code == 0, again.output + again.stderr


@pytest.mark.parametrize("mode", ["new", "shared"])
def test_rows_twice_are_mended_by_other_ids_or_by_deleting_the_run(
    wandb_like_sink, tmp_path, job, mode
):
    """W&B has no row delete: rows on the server twice past the run's end cannot be sent
    away. The line says so, and names what mends it: other run ids, or deleting the run."""
    root, logs = job
    sink, base = wandb_like_sink, f"twice-{mode}"
    state = synced(sink, tmp_path, root, mode, base)
    victim = run_ids(mode, base)[0]
    damage(sink, victim, rows_twice)

    checked = cli(sink, state, "verify", *options(root, mode, base))
    assert checked.exit_code == 1
    line = last_error(checked)
    assert (
        f"the server holds more of {victim} than the files make, which no upload can "
        "remove: delete them on the server, then `wbmerge sync --resend` with them, or "
        "upload under other run ids (sync with --base-id ID)"
    ) in line
    assert "which mends" not in line  # (--resend alone would not)

    # One way: other run ids.
    elsewhere = cli(sink, state, "sync", *options(root, mode, f"{base}-again"))
    assert elsewhere.exit_code == 0, elsewhere.stderr
    assert_exact(sink, mode, f"{base}-again", logs)

    # The other: delete the run on the server, then the command named.
    delete_run(sink, victim)
    mended = cli(sink, state, "sync", *options(root, mode, base), "--resend")
    assert mended.exit_code == 0, mended.stderr
    assert_exact(sink, mode, base, logs)


# A sync from another machine (its own state directory, so no ledger entry): what it does
# with each damage, and the command its failure line names when it cannot mend the run.
ELSEWHERE = [
    (rows_lost_inside, "`wbmerge sync --resend`"),
    (rows_moved, "`wbmerge sync --resend`"),
    (rows_twice, "--base-id ID"),
    (rows_lost_at_the_end, None),  # None: the sync itself mends the run
    (console_lost, None),
    (summary_changed, None),
    (config_removed, None),
    (file_lost, None),
]


@pytest.mark.parametrize("how, advice", ELSEWHERE, ids=[h.__name__ for h, _ in ELSEWHERE])
def test_a_sync_from_another_machine_mends_the_run_or_names_what_does(
    wandb_like_sink, tmp_path, job, how, advice
):
    root, logs = job
    sink, base = wandb_like_sink, f"elsewhere-{how.__name__}".replace("_", "-")
    synced(sink, tmp_path, root, "new", base)
    victim = run_ids("new", base)[0]
    damage(sink, victim, how)

    other = tmp_path / "other-machine"
    result = cli(sink, other, "sync", *options(root, "new", base))
    if advice is None:
        assert result.exit_code == 0, result.stderr
        assert "warning" not in result.stderr, result.stderr
        assert_exact(sink, "new", base, logs)
        return
    assert result.exit_code == 1, result.stderr
    line = last_error(result)
    assert advice in line, line
    if advice == "--base-id ID":
        assert "--resend" not in line, line  # (it cannot remove rows: not advised)
        command = [*options(root, "new", f"{base}-again")]
        base = f"{base}-again"
    else:
        command = [*options(root, "new", base), "--resend"]
    mended = cli(sink, other, "sync", *command)
    assert mended.exit_code == 0, mended.stderr
    assert_exact(sink, "new", base, logs)


def test_the_advice_names_only_runs_a_command_mends(wandb_like_sink, tmp_path, job):
    """Runs damaged in different ways: the line names the runs each command mends."""
    root, logs = job
    sink, base = wandb_like_sink, "mixed"
    state = synced(sink, tmp_path, root, "new", base)
    first, second = run_ids("new", base)
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        rows_twice(db, _run_pk(db, first))
        summary_removed(db, _run_pk(db, second))
    db.close()
    restart(sink)
    checked = cli(sink, state, "verify", *options(root, "new", base))
    line = last_error(checked)
    assert re.search(rf"which mends {second}; the server holds more of {first} than", line), line
