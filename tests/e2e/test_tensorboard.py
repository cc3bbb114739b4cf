"""A job that logs through TensorBoard (`sync_tensorboard=True` on every rank) arrives whole
in every run mode: the scalars wandb made history rows of, once each, and the tfevents
files wandb linked into each run's `files/`, with the bytes each rank wrote.

The fixture `recipe_tensorboard` is a real 2-rank torchrun job: each rank ran in
`rank-{r}/` of the fixture's directory and wrote `tb/loss` and `tb/lr` with torch's
`SummaryWriter` under `rank-{r}/tb/`. Its links name the absolute path where the fixture
was made, so the tests pass the fixture's directory with `--files-from`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main

from ..conftest import job_dir
from ..support.hostile import tree_digest
from ..support.sinktools import expected_from_log

pytestmark = pytest.mark.e2e
JOB = "recipe_tensorboard"
SCALARS = ("tb/loss", "tb/lr", "global_step")


def sources(job: Path) -> dict[int, Path]:
    """rank -> the `.wandb` file of that rank (its config's `rank`, read with protobuf)."""
    logs = sorted(job.glob("wandb/*/run-*.wandb"))
    return {expected_from_log(log).config["rank"]: log for log in logs}


def tfevents(job: Path, log: Path) -> dict[str, bytes]:
    """The tfevents files a run links to, by their name in `files/`, with the bytes found
    at the same place under the fixture's directory (where the rank wrote them)."""
    found = {}
    for link in (log.parent / "files").rglob("events.out.tfevents.*"):
        target = Path(os.readlink(link))
        rank_dir = next(i for i, part in enumerate(target.parts) if part.startswith("rank-"))
        found[link.relative_to(log.parent / "files").as_posix()] = job.joinpath(
            *target.parts[rank_dir:]
        ).read_bytes()
    return found


def scalars(rows: list[dict], suffix: str = "") -> list[dict]:
    """Each row's step and TensorBoard scalars (keys ending in `suffix`, which is dropped)."""
    return [
        {"_step": row["_step"]} | {key: row[key + suffix] for key in SCALARS if key + suffix in row}
        for row in rows
    ]


@pytest.mark.parametrize("mode", ["auto", "shared", "new"])
def test_tensorboard_scalars_and_event_files_arrive_once(sink, tmp_path, mode):
    job = job_dir(JOB)
    before = tree_digest(job)
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    result = CliRunner().invoke(
        main,
        [
            "sync",
            "--json",
            str(job / "wandb"),
            "--run-mode",
            mode,
            "-p",
            "tb",
            "-e",
            "local",
            "--files-from",
            str(job),
        ],
        env=env,
    )
    assert result.exit_code == 0, result.stderr
    logs = sources(job)
    assert sorted(logs) == [0, 1]
    want = {rank: expected_from_log(log) for rank, log in logs.items()}
    for rank in (0, 1):  # (the comparisons below compare values, not empty rows)
        assert all(set(SCALARS) <= set(row) for row in scalars(want[rank].history))
    events = {rank: tfevents(job, log) for rank, log in logs.items()}
    assert all(len(found) == 1 for found in events.values()), events.keys()
    assert events[0] != events[1]
    base = want[0].run_id
    runs = {run["id"] for run in json.loads(result.stdout)["runs"]}
    if mode == "new":
        assert runs == {f"{base}-rank-0", f"{base}-rank-1"}
        for rank in (0, 1):
            got = sink.client.run("local", "tb", f"{base}-rank-{rank}")
            assert scalars(got["history"]) == scalars(want[rank].history)
            for name, data in events[rank].items():
                assert sink.client.file("local", "tb", f"{base}-rank-{rank}", name) == data
        return
    assert runs == {base}
    got = sink.client.run("local", "tb", base)
    if mode == "auto":
        assert scalars(got["history"]) == scalars(want[0].history)
        expected_files = events[0]
    else:  # every rank's scalars under its label, a row per step
        for rank in (0, 1):
            assert scalars(got["history"], f"/rank-{rank}") == scalars(want[rank].history)
        expected_files = events[0] | events[1]  # (their names differ: wandb adds the pid)
    assert [row["_step"] for row in got["history"]] == list(range(15))  # each step once
    for name, data in expected_files.items():
        assert sink.client.file("local", "tb", base, name) == data, name
    assert tree_digest(job) == before  # sources are read, never written
