"""A run whose recorded root is `/` by any spelling (`//`, `/..`, `/etc/..`) opens nothing
by it, and nothing under /proc, /sys or /dev is read for a saved file or an artifact entry,
even under a `--files-from` directory.

The runs are hostile copies of the real job `recipe_saved_files`. A run found in
`<root>/wandb/` of the root it records is trusted to have run there; the case that matters
is a container that ran in `/` with its runs at `/wandb`, so the copies are mounted at
`/mnt` in a mount namespace of their own (`unshare --mount`): each run then lies at
`/mnt/<run>`, whose grandparent is `/`, and nothing outside the test sees the mount.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from wbmerge.log import pb

from ..conftest import job_dir
from ..support.hostile import insert_after_run_record, rewrite_log, run_cli, run_logs

pytestmark = pytest.mark.e2e
CANARY = "wbmerge-canary-9f3c1e"  # in the environment of the command under test
MOUNTED = Path("/mnt")


def can_mount(tmp_path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    command = ["unshare", "--mount", "mount", "--bind", str(probe), str(MOUNTED)]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def artifact_record(local_path: str) -> bytes:
    """A finalized artifact whose one entry names `local_path`, with that file's size and
    MD5, as the uploader would take it."""
    data = Path(local_path).read_bytes()
    record = pb.Record()
    artifact = record.artifact
    artifact.type, artifact.name, artifact.finalize = "model", "ckpt", True
    artifact.manifest.version = 1
    artifact.manifest.storage_policy = "wandb-storage-policy-v1"
    entry = artifact.manifest.contents.add()
    entry.path, entry.local_path, entry.size = "stolen", local_path, len(data)
    entry.digest = md5_b64(data)
    text = f"wandb-artifact-manifest-v1\nstolen:{entry.digest}\n"
    artifact.digest = hashlib.md5(text.encode()).hexdigest()
    return record.SerializeToString()


def hostile_job(tmp_path: Path, root: str, link: str | None, entry: str | None) -> Path:
    """A copy of the job whose every run says it ran in `root`, its `model.pt` a link to
    `link`, and an artifact naming `entry` in its log (each when given)."""
    job = tmp_path / "job"
    shutil.copytree(job_dir("recipe_saved_files"), job, symlinks=True)

    def new_root(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") == "environment" and record.environment.root:
            record.environment.root = root
            return record
        return None

    for log in run_logs(job):
        rewrite_log(log, new_root)
        if entry:
            insert_after_run_record(log, [artifact_record(entry)])
        saved = log.parent / "files" / "model.pt"
        saved.unlink()
        saved.symlink_to(link if link else job / "rank-0" / "model.pt")
    return job


def run_mounted(job: Path, *args: str | Path):
    """`wbmerge ARGS` with the job's `wandb/` mounted at /mnt."""
    script = f'mount --bind "{job / "wandb"}" {MOUNTED} && exec "$@"'
    return run_cli(*args, prefix=("unshare", "--mount", "sh", "-c", script, "sh"))


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.stderr, result.stdout)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    return lines[0]


def assert_canary_nowhere(*trees: Path) -> None:
    for tree in trees:
        for path in tree.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert CANARY.encode() not in path.read_bytes(), path


@pytest.fixture
def command_env(monkeypatch, sink, tmp_path):
    """The canary and the sink in the environment of the commands run, a state directory
    of the test's own."""
    for name, value in {
        **sink.env,
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "WBMERGE_TEST_CANARY": CANARY,
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def mountable(tmp_path, command_env):
    if not can_mount(tmp_path):
        pytest.skip("mounting the runs at /mnt needs root and `unshare --mount`")


@pytest.mark.parametrize("root", ["//", "/..", "/etc/..", "/mnt/.."])
def test_a_root_that_is_slash_by_another_spelling_opens_nothing(mountable, tmp_path, root):
    secret = tmp_path / "home" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(f"a file of the user's, out of the job: {CANARY}\n")
    job = hostile_job(tmp_path, root, str(secret), None)
    out = tmp_path / "out"
    line = one_error_line(run_mounted(job, "merge", MOUNTED, "--run-mode", "new", "--out", out))
    assert "'model.pt'" in line and repr(str(secret)) in line and "--files-from" in line
    assert f"the run says it ran in {root}, which is /" in line
    assert not out.exists()
    assert_canary_nowhere(tmp_path / "job", tmp_path / "state")


def test_a_sync_of_runs_at_the_top_sends_no_environment(mountable, sink, tmp_path):
    job = hostile_job(tmp_path, "/etc/..", "/proc/self/environ", None)
    staging = tmp_path / "staging"
    result = run_mounted(
        job,
        "sync",
        MOUNTED,
        "--run-mode",
        "new",
        "-p",
        "exfil",
        "-e",
        "local",
        "--keep-staging",
        staging,
    )
    line = one_error_line(result)
    assert "'model.pt'" in line and "'/proc/self/environ'" in line
    assert sink.client.runs() == []
    assert_canary_nowhere(tmp_path, sink.data_dir)


@pytest.mark.parametrize("command", ["merge", "sync"])
def test_an_artifact_entry_under_a_root_of_slash_is_not_read(mountable, sink, tmp_path, command):
    job = hostile_job(tmp_path, "/etc/..", None, "/etc/hostname")
    out = tmp_path / "out"
    where = ["--out", out] if command == "merge" else ["-p", "exfil", "-e", "local"]
    result = run_mounted(
        job, command, MOUNTED, "--run-mode", "new", "--files-from", job / "rank-0", *where
    )
    line = one_error_line(result)
    assert "artifact 'ckpt'" in line and "'/etc/hostname'" in line and "--files-from" in line
    assert not out.exists()
    assert sink.client.runs() == []
    assert not (sink.data_dir / "artifacts").exists() or not any(
        path.is_file() for path in (sink.data_dir / "artifacts").rglob("*")
    )


@pytest.mark.parametrize("kind", ["saved", "artifact"])
@pytest.mark.parametrize("system", ["/proc/self/environ", "/sys/kernel/uevent_seqnum"])
def test_nothing_under_proc_sys_or_dev_is_read_even_under_files_from(
    command_env, tmp_path, kind, system
):
    """`--files-from /` allows every file the user can read, but not the kernel's."""
    if kind == "saved":
        job = hostile_job(tmp_path, str(tmp_path / "job"), system, None)
        named = "'model.pt'"
    else:
        job = hostile_job(tmp_path, str(tmp_path / "job"), None, system)
        named = "artifact 'ckpt'"
    out = tmp_path / "out"
    result = run_cli("merge", job / "wandb", "--run-mode", "new", "--files-from", "/", "--out", out)
    line = one_error_line(result)
    assert named in line and f"'{system}'" in line and "/proc, /sys or /dev" in line
    assert not out.exists()
    assert_canary_nowhere(tmp_path)
