"""Labels and run ids from a run's `wbmerge` block never lead a write out of --out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wbmerge.log import pb, read_payloads

from ..support.hostile import copy_job, one_error_line, rewrite_log, run_cli, run_logs, tree_digest


def set_block(log: Path, **changes: object) -> None:
    """Change the `wbmerge` block that the run record of `log` carries."""

    def change(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") != "run":
            return None
        for item in record.run.config.update:
            if item.key == "wbmerge":
                item.value_json = json.dumps({**json.loads(item.value_json), **changes})
        return record

    rewrite_log(log, change)


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of one_node_4 in which every rank wrote a different `notes.txt`, so that the
    shared merge files the other ranks' under a directory named after their label; --out
    sits deep enough below tmp_path that `../../../..` from a staged file is still in it."""
    job = copy_job("one_node_4", tmp_path / "job")
    for rank, log in enumerate(run_logs(job)):
        (log.parent / "files" / "notes.txt").write_text(f"notes of run {rank}\n")
    return job, tmp_path / "a" / "b" / "out"


def hostile_labels(kind: str, tmp_path: Path) -> dict[int, str]:
    return {
        "dotdot": {r: f"../../../../escape-{r}" for r in (1, 2, 3)},
        "absolute": {r: f"{tmp_path}/abs-escape-{r}" for r in (1, 2, 3)},
        "nul": {r: f"rank\x00{r}" for r in (1, 2, 3)},
        "newline": {r: f"rank\n{r}/../../.." for r in (1, 2, 3)},
    }[kind]


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "nul", "newline"])
def test_hostile_labels_write_nothing_outside_out(layout, tmp_path, kind):
    job, out = layout
    labels = hostile_labels(kind, tmp_path)
    for log in run_logs(job):
        info = json.loads(
            next(
                i.value_json
                for r in map(pb.Record.FromString, read_payloads(log))
                if r.WhichOneof("record_type") == "run"
                for i in r.run.config.update
                if i.key == "wbmerge"
            )
        )
        if info["rank"] in labels:
            set_block(log, label=labels[info["rank"]])
    sources = {p.read_text() for p in job.glob("wandb/*/files/notes.txt")}
    before = tree_digest(tmp_path)

    result = run_cli("merge", job / "wandb", "--run-mode", "shared", "--out", out)

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    after = tree_digest(tmp_path)
    outside = {k: v for k, v in after.items() if not k.startswith("a/b/out/")}
    assert outside == {**before, "a": "dir", "a/b": "dir", "a/b/out": "dir"}
    [staged] = out.glob("offline-run-*")
    # nothing lost: every rank's notes are in the merged run's files, under the run
    kept = [p for p in (staged / "files").rglob("notes.txt") if p.is_file()]
    assert {p.read_text() for p in kept} == sources
    assert all(p.resolve().is_relative_to(staged.resolve() / "files") for p in kept)


@pytest.mark.parametrize(
    "job_id", ["fx\x00one", "fx\none", "x" * 300], ids=["nul", "newline", "long"]
)
def test_a_job_id_that_cannot_name_a_directory_is_one_error_line(tmp_path, job_id):
    job = copy_job("one_node_4", tmp_path / "job")
    for log in run_logs(job):
        set_block(log, job_id=job_id)
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("merge", job / "wandb", "--out", tmp_path / "out"))
    assert "cannot name a directory" in line or "invalid run id" in line
    after = tree_digest(tmp_path)
    assert {k: v for k, v in after.items() if k != "out"} == before
