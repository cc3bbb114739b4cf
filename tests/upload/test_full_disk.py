"""A full disk under wbmerge's state directory, its staging or `merge --out` is one line
naming the directory and "no space left" (exit 2), never an internal error.

Each command runs in a mount namespace of its own (`unshare --mount`) over a small tmpfs
filled almost to the brim, so the disk is really full and nothing outside the test sees it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wbmerge.log import read_records

from ..conftest import ROOT, job_dir


def _can_mount(tmp_path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    command = ["unshare", "--mount", "mount", "-t", "tmpfs", "tmpfs", str(probe)]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def full_disk(tmp_path):
    """Run `wbmerge ARGS` with a full tmpfs at `tmp_path/full` (of `size` kB, `free` kB
    left, at most `inodes` files), after `prepare` (shell) ran there."""
    if not _can_mount(tmp_path):
        pytest.skip("a full tmpfs needs root and `unshare --mount` (mount namespaces)")
    disk = tmp_path / "full"
    disk.mkdir()

    def run(*args, env=None, free=24, inodes=None, prepare=""):
        options = "size=1m" + (f",nr_inodes={inodes}" if inodes else "")
        script = (
            f"mount -t tmpfs -o {options} tmpfs {disk} && {prepare or 'true'} && "
            f"dd if=/dev/zero of={disk}/fill bs=1k count={1024 - free} 2>/dev/null; "
            'exec "$@"'
        )
        command = [
            "unshare",
            "--mount",
            "sh",
            "-c",
            script,
            "sh",
            sys.executable,
            "-m",
            "wbmerge.cli",
            *map(str, args),
        ]
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        environment.pop("WBMERGE_DEBUG", None)
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)

    run.disk = disk
    return run


def one_line(result):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def test_staging_on_a_full_disk_is_one_line_naming_it(full_disk, sink, tmp_path):
    env = {**sink.env, "TMPDIR": str(full_disk.disk), "WBMERGE_STATE_DIR": str(tmp_path / "s")}
    line = one_line(full_disk("sync", job_dir("one_node_4"), "-p", "full", "-e", "local", env=env))
    assert line.startswith(
        f"wbmerge: error: cannot write the merged run in {full_disk.disk}/wbmerge-{os.geteuid()}"
        "/wbmerge-staging-"
    )
    assert line.endswith("/runs (No space left on device)")
    assert sink.client.runs() == []


@pytest.mark.parametrize(
    "inodes, line",
    [
        (3, "cannot make a staging directory in {root} (No space left on device)"),
        (4, "cannot write the staging directory {root}/wbmerge-staging-"),
    ],
    ids=["no-directory", "no-owner-record"],
)
def test_staging_with_no_file_left_is_one_line_naming_it(full_disk, sink, tmp_path, inodes, line):
    # (files: the tmpfs itself, the filler, this user's directory, then the staging's)
    env = {**sink.env, "TMPDIR": str(full_disk.disk), "WBMERGE_STATE_DIR": str(tmp_path / "s")}
    result = full_disk(
        "sync", job_dir("one_node_4"), "-p", "full", "-e", "local", env=env, free=512, inodes=inodes
    )
    root = full_disk.disk / f"wbmerge-{os.geteuid()}"
    assert one_line(result).startswith("wbmerge: error: " + line.format(root=root))
    assert "(No space left on device); set TMPDIR to a directory with room" in result.stderr
    assert sink.client.runs() == []


def test_a_state_directory_on_a_full_disk_is_one_line_naming_it(full_disk, sink):
    state = full_disk.disk / "state"
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    result = full_disk("sync", job_dir("one_node_4"), "-p", "full", "-e", "local", env=env, free=0)
    assert one_line(result).startswith(
        f"wbmerge: error: cannot keep the ledger of synced runs in {state} (no space left on device"
    )
    assert sink.client.runs() == []


def test_run_locks_on_a_disk_with_no_file_left_are_one_line_naming_them(full_disk, sink):
    # (room for the ledger, which exists already, and for no other file)
    state = full_disk.disk / "state"
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
        "from wbmerge.upload import Ledger; "
        f"Ledger(Path({str(state / 'ledger.sqlite3')!r})).close()"
    )
    make_ledger = f"{sys.executable} -c {shlex.quote(code)}"
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    result = full_disk(
        "sync",
        job_dir("one_node_4"),
        "-p",
        "full",
        "-e",
        "local",
        env=env,
        free=512,
        inodes=4,
        prepare=f"mkdir {state} && {make_ledger}",
    )
    assert one_line(result) == (
        f"wbmerge: error: cannot keep the locks of runs being synced in {state / 'locks'} (No "
        "space left on device); set WBMERGE_STATE_DIR to a directory wbmerge may write"
    )
    assert sink.client.runs() == []


@pytest.mark.parametrize("run_mode", ["auto", "shared"])
def test_merge_out_on_a_full_disk_is_one_line_naming_it(full_disk, run_mode):
    out = full_disk.disk / "merged"
    result = full_disk(
        "merge", job_dir("one_node_4"), "--out", out, "--run-mode", run_mode, prepare=f"mkdir {out}"
    )
    assert one_line(result) == (
        f"wbmerge: error: cannot write the merged run in {out} (No space left on device)"
    )


def test_a_state_disk_full_after_the_upload_says_the_run_is_on_the_server(
    full_disk, sink, tmp_path
):
    """The ledger (made before the disk filled) cannot record the run once it is verified:
    the run is on the server whole, so the sync says so and exits 1, not "bad input, nothing
    uploaded"; a rerun with room finds it whole and records it without sending it again."""
    state = full_disk.disk / "state"
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
        "from wbmerge.upload import Ledger; "
        f"Ledger(Path({str(state / 'ledger.sqlite3')!r})).close()"
    )
    prepare = f"mkdir {state} {state / 'locks'} && {sys.executable} -c {shlex.quote(code)}"
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    args = ("sync", job_dir("one_node_4"), "-p", "full", "-e", "local")
    result = full_disk(*args, env=env, free=0, prepare=prepare)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error:")]
    assert errors == [
        "wbmerge: error: run fx-one-node-4: on the server whole and verified, but not recorded "
        f"as synced: cannot keep the ledger of synced runs in {state} (no space left on device: "
        "database or disk is full); set WBMERGE_STATE_DIR to a directory wbmerge may write; a "
        "rerun finds the run whole on the server and records it without sending it again"
    ], result.stderr
    rank0 = [
        record.history.step.num
        for record in read_records(next(job_dir("one_node_4").glob("wandb/*-xjp8yzcx/*.wandb")))
        if record.WhichOneof("record_type") == "history"
    ]
    history = sink.client.run("local", "full", "fx-one-node-4")["history"]
    assert [row["_step"] for row in history] == rank0 == list(range(30))

    rerun = subprocess.run(
        [sys.executable, "-m", "wbmerge.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            **sink.env,
            "WBMERGE_STATE_DIR": str(tmp_path / "room"),
        },
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "verified fx-one-node-4: 30 rows, all on the server already" in rerun.stderr
    assert sink.client.run("local", "full", "fx-one-node-4")["history"] == history
