"""Staging lives in a directory private to the user, and a sync stops only the uploaders its
user's killed syncs left behind: nothing another user (or anything else) can plant in the
temp dir makes it signal a process or delete a file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from wbmerge.upload import STANDBY, clean_stale, make_staging, staging_root

from ..conftest import job_dir

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


@pytest.fixture(autouse=True)
def temp_dir(tmp_path, monkeypatch):
    """The temp dir wbmerge stages in (in-process: tempfile's, in a subprocess: TMPDIR)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    return temp


@pytest.fixture
def live_process(tmp_path):
    """A process that is nobody's uploader (`sleep 60`), working in a directory of its own."""
    cwd = tmp_path / "victim"
    cwd.mkdir()
    process = subprocess.Popen(["sleep", "60"], cwd=cwd)
    yield process
    process.kill()
    process.wait(timeout=10)


def started(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def plant(directory, victim, **more):
    """An owner record of a dead owner that names `victim` as its uploader, with its real
    pid and start time (both public in /proc)."""
    directory.mkdir(parents=True, exist_ok=True)
    owner = {
        "pid": 2**22 + 1,
        "started": "0",
        "uid": os.geteuid(),
        "uploader": [[victim.pid, started(victim.pid)]],
        **more,
    }
    (directory / "owner.json").write_text(json.dumps(owner))


def gone(pid):
    """Whether a process has ended (it may be a zombie until its parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for_core(standby, deadline=30):
    """The wandb-core that the uploader's process starts (about a second after it starts)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                argv = entry.joinpath("cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"/wandb-core") and b"--pid" in argv:
                if argv[argv.index(b"--pid") + 1] == str(standby.pid).encode():
                    return int(entry.name)
        time.sleep(0.05)
    raise AssertionError("the uploader started no wandb-core")


def test_staging_goes_in_a_directory_of_this_user_that_no_one_else_may_enter(temp_dir):
    staging = make_staging()
    root = temp_dir / f"wbmerge-{os.geteuid()}"
    assert staging.parent == root == staging_root()
    status = os.lstat(root)
    assert status.st_uid == os.geteuid() and status.st_mode & 0o777 == 0o700


def test_a_planted_record_naming_a_live_process_stops_nothing(temp_dir, live_process):
    # in the temp dir itself, where anyone may write, and in this user's own directory
    plant(temp_dir / "wbmerge-staging-planted", live_process)
    plant(staging_root() / "wbmerge-staging-planted", live_process)
    clean_stale()
    assert live_process.poll() is None, "a process that is not an uploader was killed"


def test_a_planted_link_to_a_directory_of_a_live_process_stops_and_deletes_nothing(
    temp_dir, tmp_path, live_process
):
    target = tmp_path / "victim"
    (target / "precious").write_text("keep me")
    plant(target, live_process)  # (an owner record there too, to follow the link to)
    for parent in (temp_dir, staging_root()):
        (parent / "wbmerge-staging-link").symlink_to(target)
    with pytest.warns(UserWarning, match="not a staging directory of this user; left alone"):
        clean_stale()
    assert live_process.poll() is None
    assert (target / "precious").read_text() == "keep me"
    assert (target / "owner.json").exists()


def test_the_uploader_of_a_killed_sync_and_its_wandb_core_are_stopped(tmp_path):
    # the recorded uploader process, and the wandb-core it started after the last record
    staging = make_staging()
    workdir = staging / "job-0" / "uploader" / "batch-0"
    (workdir / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        "TMPDIR": str(workdir / "tmp"),
        "WANDB_DIR": str(workdir),
        "WANDB_CACHE_DIR": str(workdir / "cache"),
    }
    standby = subprocess.Popen(
        [sys.executable, "-c", STANDBY], cwd=workdir, env=env, stdin=subprocess.PIPE
    )
    bystander = subprocess.Popen(["sleep", "60"], cwd=workdir)  # this user's, not an uploader
    try:
        core = wait_for_core(standby)
        owner = {
            "pid": 2**22 + 1,
            "started": "0",
            "uid": os.geteuid(),
            "uploader": [
                [standby.pid, started(standby.pid)],
                [bystander.pid, started(bystander.pid)],
            ],
        }
        (staging / "owner.json").write_text(json.dumps(owner))
        assert clean_stale() == [staging]
        assert standby.wait(timeout=10) == -9
        assert gone(core), "the wandb-core of the killed sync's uploader"
        assert bystander.poll() is None, "a process of this user that is no uploader"
    finally:
        for process in (standby, bystander):
            process.kill()
            process.wait(timeout=10)


@pytest.mark.parametrize("how", ["open to others", "another user's", "a link"])
def test_a_staging_directory_not_private_to_the_user_is_refused_in_one_line(
    temp_dir, tmp_path, sink, how
):
    root = temp_dir / f"wbmerge-{os.geteuid()}"
    if how == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
        why = "is a symbolic link"
    else:
        root.mkdir(mode=0o700)
        if how == "open to others":
            root.chmod(0o777)
            why = "is open to other users (mode 777, want 700)"
        else:
            if os.geteuid() != 0:
                pytest.skip("giving a directory to another user takes root")
            os.chown(root, NOBODY, NOBODY)
            why = f"belongs to uid {NOBODY}, not to this user (uid 0)"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "wbmerge.cli",
            "sync",
            str(job_dir("one_node_4")),
            "-p",
            "refused",
            "-e",
            "local",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **sink.env, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"wbmerge: error: staging directory {root} {why}; refusing to stage there: remove "
        "it, or set TMPDIR to a directory of your own"
    ]
    assert sink.client.runs("local", "refused") == [], "nothing was sent"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="planting as a second user takes root and setpriv",
)
def test_another_user_planting_staging_cannot_make_a_root_sync_kill(live_process, sink):
    # a temp dir as /tmp is (anyone may write, sticky), where the second user can reach it
    shared = Path(tempfile.mkdtemp(prefix="wbmerge-shared-", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        planted = shared / "wbmerge-staging-evil"
        owner = {
            "pid": 2**22 + 1,
            "started": "0",
            "uid": os.geteuid(),
            "uploader": [[live_process.pid, started(live_process.pid)]],
        }
        victim_cwd = Path(f"/proc/{live_process.pid}/cwd").readlink()
        script = (
            f"mkdir {planted} && printf '%s' '{json.dumps(owner)}' > {planted}/owner.json"
            f" && ln -s {victim_cwd} {shared}/wbmerge-staging-link"
        )
        subprocess.run(
            [
                "setpriv",
                "--reuid",
                str(NOBODY),
                "--regid",
                str(NOBODY),
                "--clear-groups",
                "sh",
                "-c",
                script,
            ],
            check=True,
            timeout=30,
        )
        assert os.lstat(planted).st_uid == NOBODY
        (victim_cwd / "precious").write_text("keep me")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "wbmerge.cli",
                "sync",
                str(job_dir("one_node_4")),
                "-p",
                "planted",
                "-e",
                "local",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **sink.env, "PYTHONPATH": str(ROOT), "TMPDIR": str(shared)},
        )
        assert result.returncode == 0, result.stderr
        assert live_process.poll() is None, "the sync killed a process another user named"
        assert (victim_cwd / "precious").read_text() == "keep me"
        assert planted.exists() and (shared / "wbmerge-staging-link").is_symlink()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
