"""`files` records that point out of their run are left out, and `files/` links that lead out
of the allowed directories are refused: the merge reads nothing outside what the user named
and the uploader is given no path that leaves the run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from wbmerge.log import pb, read_records

from ..support.hostile import copy_job, insert_after_run_record, run_cli, run_logs, tree_digest

SECRET = "the canary outside every run\n"


def files_record(*paths: str) -> bytes:
    record = pb.Record()
    for path in paths:
        record.files.files.add(path=path, type=pb.FilesItem.FileType.OTHER)
    return record.SerializeToString()


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """one_node_4 with, in every rank, a files record naming the canary outside (by `..` and
    absolute) and one honest file."""
    canary = tmp_path / "canary.txt"
    canary.write_text(SECRET)
    job = copy_job("one_node_4", tmp_path / "job")
    bad = []
    for rank, log in enumerate(run_logs(job)):
        files = log.parent / "files"
        (files / "honest.txt").write_text(f"honest file of run {rank}\n")
        depth = "../" * (len(files.relative_to(tmp_path).parts) + 2)
        bad = [f"{depth}canary.txt", str(canary), "a/../../x"]
        insert_after_run_record(log, [files_record(*bad, "honest.txt")])
    return job, canary, bad


@pytest.mark.parametrize("mode", ["new", "auto", "shared"])
def test_files_pointing_out_of_the_run_are_left_out_with_a_warning(hostile, tmp_path, mode):
    job, canary, bad = hostile
    digest = hashlib.sha256(canary.read_bytes()).hexdigest()
    before = tree_digest(tmp_path)
    out = tmp_path / "out"

    result = run_cli("merge", job / "wandb", "--run-mode", mode, "--out", out)

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "left out" in result.stderr and "a/../../x" in result.stderr
    assert hashlib.sha256(canary.read_bytes()).hexdigest() == digest
    after = tree_digest(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before
    for staged in out.glob("offline-run-*"):
        named = [
            item.path
            for record in read_records(next(staged.glob("run-*.wandb")))
            if record.WhichOneof("record_type") == "files"
            for item in record.files.files
        ]
        assert not set(named) & set(bad)
        assert "honest.txt" in named  # nothing honest lost
        assert (staged / "files" / "honest.txt").read_text().startswith("honest file of run")
        for path in staged.rglob("*"):
            assert not path.is_symlink()
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes()


@pytest.mark.parametrize("mode", ["new", "auto", "shared"])
def test_a_link_out_of_the_run_is_refused_and_nothing_is_written(hostile, tmp_path, mode):
    job, canary, _ = hostile
    for log in run_logs(job):
        (log.parent / "files" / "link.txt").symlink_to(canary)
    before = tree_digest(tmp_path)

    result = run_cli("merge", job / "wandb", "--run-mode", mode, "--out", tmp_path / "out")

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "'link.txt'" in line and "--files-from" in line
    assert tree_digest(tmp_path) == before  # no --out, nothing read into it
