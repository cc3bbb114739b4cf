"""`merge --out` and `export -o` never write into the runs they read; `merge --out` never
replaces a directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wbmerge.identify import discover

from ..support.hostile import (
    CLI_TIMEOUT,
    ROOT,
    copy_job,
    one_error_line,
    run_cli,
    run_logs,
    tree_digest,
)


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """Runs without a wbmerge block: auto mode's run id is rank 0's own offline id. Rank 0's
    directory is named after its start time, as wandb names it (the fixture's name is a
    second early), so a merge into wandb/ stages exactly the name of rank 0's source."""
    job = copy_job("plain_labels", tmp_path / "job")
    rank0 = next(run for run in discover([job]) if run.rank.rank == 0)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(rank0.start_time))
    rank0.run_dir.rename(rank0.run_dir.with_name(f"offline-run-{stamp}-{rank0.run_id}"))
    return job


@pytest.mark.parametrize(
    "out_of",
    [
        lambda job: job / "wandb",  # the named directory itself
        lambda job: job / "wandb" / "new",  # inside it
        lambda job: run_logs(job)[0].parent,  # a run directory
        lambda job: run_logs(job)[0].parent / "files" / "merged",  # inside a run
    ],
    ids=["named-dir", "inside-named-dir", "run-dir", "inside-run-dir"],
)
def test_out_in_a_source_tree_is_refused_and_sources_are_untouched(plain, out_of):
    before = tree_digest(plain)
    out = out_of(plain)
    line = one_error_line(run_cli("merge", plain / "wandb", "--out", out))
    assert "--out" in line and "source" in line
    assert tree_digest(plain) == before


def test_out_through_a_symlink_to_the_sources_is_refused(plain, tmp_path):
    before = tree_digest(plain)
    link = tmp_path / "looks-elsewhere"
    link.symlink_to(plain / "wandb", target_is_directory=True)
    one_error_line(run_cli("merge", plain / "wandb", "--out", link))
    assert tree_digest(plain) == before


def test_sources_inside_out_are_fine_and_untouched(plain):
    # --out is the job directory, which holds the named wandb/ directory but is not read
    before = tree_digest(plain / "wandb")
    result = run_cli("merge", plain / "wandb", "--out", plain)
    assert result.returncode == 0, result.stderr
    assert tree_digest(plain / "wandb") == before
    [staged] = plain.glob("offline-run-*")
    # the merged run is rank 0's, re-framed with a new run record: a whole log, not empty
    source = next(log for log in run_logs(plain) if log.parent.name == staged.name)
    assert (staged / source.name).stat().st_size >= source.stat().st_size - 1024


def test_an_existing_run_directory_in_out_is_an_error_never_removed(plain, tmp_path):
    out = tmp_path / "out"
    assert run_cli("merge", plain / "wandb", "--out", out).returncode == 0
    [staged] = out.glob("offline-run-*")
    marker = staged / "kept.txt"
    marker.write_text("mine")
    before = tree_digest(out)
    line = one_error_line(run_cli("merge", plain / "wandb", "--out", out))
    assert str(staged) in line and "exists" in line
    assert tree_digest(out) == before


@pytest.mark.parametrize(
    "out_of",
    [
        lambda job: run_logs(job)[0],  # a source log itself
        lambda job: run_logs(job)[1].parent / "files" / "requirements.txt",  # a run's file
        lambda job: run_logs(job)[0].parent / "runs.parquet",  # beside a log
    ],
    ids=["log", "run-file", "run-dir"],
)
def test_export_into_a_run_directory_is_refused_and_sources_are_untouched(plain, out_of):
    before = tree_digest(plain)
    out = out_of(plain)
    line = one_error_line(run_cli("export", plain / "wandb", "-o", out))
    assert f"-o {out} is inside the run directory" in line
    assert tree_digest(plain) == before


def test_export_beside_the_runs_is_fine(plain):
    # Next to the run directories (not inside one) nothing of a run can be replaced.
    before = tree_digest(plain / "wandb")
    result = run_cli("export", plain / "wandb", "-o", plain / "wandb" / "runs.parquet")
    assert result.returncode == 0, result.stderr
    after = tree_digest(plain / "wandb")
    assert set(after) - set(before) == {"runs.parquet"}
    assert all(after[name] == digest for name, digest in before.items())


def test_export_over_a_log_of_a_run_it_does_not_read_is_refused(plain, tmp_path):
    # Only one run is read; the file named is another run's log, beside it.
    reads, other = run_logs(plain)[:2]
    before = tree_digest(plain)
    line = one_error_line(run_cli("export", reads.parent, "-o", other))
    assert f"is inside the run directory {other.parent}" in line
    assert tree_digest(plain) == before


def test_export_to_a_link_loop_is_one_line(plain, tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    line = one_error_line(run_cli("export", plain / "wandb", "-o", tmp_path / "a"))
    assert "cannot be resolved" in line


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_device(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node takes root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # (a null device of the test's)


def make_link_to_stdout(path: Path) -> None:
    path.symlink_to("/proc/self/fd/1")


def make_link_to_a_file(path: Path) -> None:
    (path.parent / "target").write_text("not the export's")
    path.symlink_to(path.parent / "target")


@pytest.mark.parametrize(
    "make, kind",
    [
        (make_fifo, "a FIFO"),
        (make_device, "a device"),
        (make_link_to_stdout, "a symbolic link"),
        (make_link_to_a_file, "a symbolic link"),
    ],
    ids=["fifo", "device", "link-to-stdout", "link-to-a-file"],
)
def test_export_over_what_is_not_a_regular_file_is_refused_and_left_as_it_is(
    plain, tmp_path, make, kind
):
    # (as root, an export to /dev/full replaced the device with a regular file)
    out = tmp_path / "out.parquet"
    make(out)
    before = os.lstat(out)
    line = one_error_line(run_cli("export", plain / "wandb", "-o", out))
    assert line == (
        f"wbmerge: error: -o {out} is {kind}; give the name of a new file or of a regular "
        "file to replace"
    )
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    if make is make_link_to_a_file:
        assert (tmp_path / "target").read_text() == "not the export's"


def test_a_link_planted_at_the_exports_scratch_name_is_not_written_through(plain, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / ".out.parquet.partial").symlink_to(victim)
    result = run_cli("export", plain / "wandb", "-o", tmp_path / "out.parquet")
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "keep me"
    out = os.lstat(tmp_path / "out.parquet")
    assert stat.S_ISREG(out.st_mode) and out.st_size > 0
    assert not os.path.lexists(tmp_path / ".out.parquet.partial")


def test_a_sink_port_file_that_is_a_fifo_is_refused(tmp_path):
    port_file = tmp_path / "port"
    os.mkfifo(port_file)
    args = ("sink", "serve", "--port", "0", "--data", tmp_path / "data", "--port-file", port_file)
    line = one_error_line(run_cli(*args))
    assert line == (
        f"wbmerge: error: --port-file {port_file} is a FIFO; give the name of a new file or "
        "of a regular file to replace"
    )
    assert stat.S_ISFIFO(os.lstat(port_file).st_mode)


def test_a_link_planted_at_the_sink_port_files_scratch_name_is_not_written_through(tmp_path):
    """Another user's link at `PORT_FILE.tmp` (in a shared directory) would make the sink,
    run as root, overwrite the file it names: it is removed, never written through."""
    victim = tmp_path / "victim"
    victim.write_text("a root-owned file\n")
    port_file = tmp_path / "port"
    Path(f"{port_file}.tmp").symlink_to(victim)
    command = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "sink",
        "serve",
        "--port",
        "0",
        "--data",
        str(tmp_path / "data"),
        "--port-file",
        str(port_file),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sink = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT  # (a bound on a hang, not a measurement)
        while not port_file.exists() and sink.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sink.terminate()
        _, err = sink.communicate(timeout=CLI_TIMEOUT)
    assert victim.read_text() == "a root-owned file\n", err
    assert stat.S_ISREG(os.lstat(port_file).st_mode)
    assert 0 < int(port_file.read_text()) < 65536
    assert not os.path.lexists(f"{port_file}.tmp")
