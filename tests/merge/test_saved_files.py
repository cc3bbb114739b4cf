"""Saved files (`wandb.save` links in a run's `files/`) arrive in every run mode, read only
under the directory the rank ran in or a `--files-from` directory; anything else is refused
in one line before anything is uploaded.

The fixture `recipe_saved_files` is a real torchrun job: each rank ran in `rank-{r}/` of the
fixture's directory and saved its own `model.pt` there (policy now, end, live by rank). Its
links name the absolute path where the fixture was made, so the tests pass the fixture's
directory with `--files-from`, which finds the files wherever the repository is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge import api
from wbmerge.cli import main
from wbmerge.log import pb, read_records
from wbmerge.merge.files import moved_files_notice
from wbmerge.sync import Deliverer
from wbmerge.upload import Credentials, Delivery, Ledger, ServerClient

from ..conftest import job_dir
from ..support.hostile import rewrite_log, tree_digest

pytestmark = pytest.mark.e2e
JOB = "recipe_saved_files"


def rank_of(log: Path) -> int:
    """The rank a source run says it is (its config's `rank`), read with protobuf."""
    for record in read_records(log):
        for item in [*record.run.config.update, *record.config.update]:
            if (list(item.nested_key) or [item.key]) == ["rank"]:
                return int(item.value_json)
    raise AssertionError(f"{log} has no rank")


def source_runs(job: Path) -> dict[int, Path]:
    """rank -> the run directory of the source job `job`."""
    return {rank_of(log): log.parent for log in job.glob("wandb/*/run-*.wandb")}


def base_id(job: Path) -> str:
    """The job's id, `{base}` of the run ids: its rank-0 run's offline id (docs/identification.md)."""
    return source_runs(job)[0].name.rsplit("-", 1)[-1]


def saved_bytes(job: Path) -> dict[int, bytes]:
    """rank -> the bytes of the checkpoint that rank saved, from where it wrote it."""
    return {rank: (job / f"rank-{rank}" / "model.pt").read_bytes() for rank in range(4)}


def cli(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(main, [*map(str, args)], env=env)


def synced_runs(result) -> list[str]:
    return [run["id"] for run in json.loads(result.stdout)["runs"]]


@pytest.mark.parametrize("mode", ["auto", "new", "shared"])
def test_saved_files_arrive_with_the_bytes_each_rank_saved(sink, tmp_path, mode):
    job = job_dir(JOB)
    before = tree_digest(job)
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        job / "wandb",
        "--run-mode",
        mode,
        "-p",
        "saved",
        "-e",
        "local",
        "--files-from",
        job,
    )
    assert result.exit_code == 0, result.stderr
    assert "not copied" not in result.stderr
    saved = saved_bytes(job)
    assert len(set(saved.values())) == 4  # (every rank's checkpoint differs)
    runs = synced_runs(result)
    base = base_id(job)
    if mode == "new":
        expected = {f"{base}-rank-{rank}": {"model.pt": saved[rank]} for rank in range(4)}
    elif mode == "auto":
        expected = {base: {"model.pt": saved[0]}}
    else:  # each rank's own under its label, the primary's under its name
        files = {f"rank-{rank}/model.pt": saved[rank] for rank in range(1, 4)}
        expected = {base: {"model.pt": saved[0], **files}}
    assert sorted(runs) == sorted(expected)
    for run_id, files in expected.items():
        listed = sink.client.run("local", "saved", run_id)["files"]
        for name, data in files.items():
            assert name in listed, (run_id, name)
            assert sink.client.file("local", "saved", run_id, name) == data, (run_id, name)
    assert tree_digest(job) == before  # sources are read, never written


def moved_job(tmp_path: Path) -> Path:
    """A copy of the fixture whose runs say they ran in a directory that is gone, with their
    links to it dangling: a job's directory moved to another machine."""
    gone = "/nonexistent/wbmerge-moved-job"
    return rerooted_job(tmp_path, gone, lambda job, rank: f"{gone}/rank-{rank}/model.pt")


def test_moved_files_are_found_under_files_from(sink, tmp_path):
    job = moved_job(tmp_path)
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        job / "wandb",
        "--run-mode",
        "new",
        "-p",
        "moved",
        "-e",
        "local",
        "--files-from",
        job,
    )
    assert result.exit_code == 0, result.stderr
    saved = saved_bytes(job)
    base = base_id(job)
    for rank in range(4):
        got = sink.client.file("local", "moved", f"{base}-rank-{rank}", "model.pt")
        assert got == saved[rank]


def test_a_run_synced_already_is_not_refused_for_files_moved_since(sink, tmp_path):
    job = moved_job(tmp_path)
    args = ("sync", "--json", job / "wandb", "--run-mode", "new", "-p", "moved", "-e", "local")
    first = cli(sink, tmp_path, *args, "--files-from", job)
    assert first.exit_code == 0, first.stderr
    again = cli(sink, tmp_path, *args)  # (the files are not found without --files-from)
    assert again.exit_code == 0, again.stderr
    statuses = {run["status"] for run in json.loads(again.stdout)["runs"]}
    assert statuses == {"already synced"}


def test_moved_files_without_files_from_are_refused_before_any_upload(sink, tmp_path):
    job = moved_job(tmp_path)
    result = cli(sink, tmp_path, "sync", job / "wandb", "--run-mode", "new", "-p", "moved")
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    assert "'model.pt'" in lines[0] and "--files-from" in lines[0]
    assert "does not exist" in lines[0]
    assert sink.client.runs() == []


def hostile_links(tmp_path: Path) -> dict[str, str | Path]:
    """Where a saved file's link may lead that must be refused, each made real under
    `tmp_path` (the copy of the job is `tmp_path/job`, given as --files-from)."""
    job = tmp_path / "job"
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"a file outside every allowed directory\n")
    (job / "a-directory").mkdir()
    os.mkfifo(job / "a-fifo")
    (job / "chain.pt").symlink_to(outside)  # inside, but leads out
    return {
        "etc-passwd": "/etc/passwd",
        "directory": job / "a-directory",
        "fifo": job / "a-fifo",
        "dangling": job / "nowhere.pt",
        "chain": job / "chain.pt",
        "dotdot": f"{job}/rank-0/../../outside.pt",
    }


@pytest.mark.parametrize("case", ["etc-passwd", "directory", "fifo", "dangling", "chain", "dotdot"])
@pytest.mark.parametrize("command", ["sync", "merge"])
def test_links_out_of_the_allowed_directories_are_refused(sink, tmp_path, case, command):
    job = tmp_path / "job"
    shutil.copytree(job_dir(JOB), job, symlinks=True)
    link = source_runs(job)[2] / "files" / "model.pt"
    link.unlink()
    link.symlink_to(hostile_links(tmp_path)[case])
    before = tree_digest(tmp_path)
    out = tmp_path / "out"
    where = ["--out", out] if command == "merge" else ["-p", "hostile"]
    result = cli(
        sink, tmp_path, command, job / "wandb", "--run-mode", "shared", "--files-from", job, *where
    )
    assert result.exit_code == 2, (result.stderr, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    assert "rank-2" in lines[0] and "'model.pt'" in lines[0] and "--files-from" in lines[0]
    assert "Traceback" not in result.stderr
    assert sink.client.runs() == []  # nothing uploaded
    assert not out.exists()  # nothing merged
    after = {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith("state")}
    assert after == {k: v for k, v in before.items() if not k.startswith("state")}


def test_a_saved_file_missing_on_the_server_fails_the_run(sink, tmp_path, monkeypatch):
    """The files check counts the saved files of the sources, not what staging holds: a
    staged run that lost its saved file uploads whole by every other count, and fails."""
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    job = job_dir(JOB)
    [staged] = api.merge(job / "wandb", tmp_path / "out", run_mode="auto", files_from=job)
    assert staged.saved_files == {"model.pt": len(saved_bytes(job)[0])}
    (staged.run_dir / "files" / "model.pt").unlink()  # (a staging that lost it)
    creds = Credentials(sink.url, sink.env["WANDB_API_KEY"])
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite3")
    deliveries = {}
    for project, saved in (("unchecked", {}), ("checked", staged.saved_files)):
        deliverer = Deliverer(
            ServerClient(creds),
            creds,
            ledger,
            project,
            "local",
            4,
            tmp_path / project / "uploader",
            expected=1,
        )
        run_dir = shutil.copytree(staged.run_dir, tmp_path / project / staged.run_dir.name)
        delivery = Delivery(
            staged.target.id,
            run_dir,
            run_dir / staged.log_path.name,
            f"key-{project}",
            "fingerprint",
            saved_files=saved,
        )
        try:
            deliverer.submit(delivery)
            deliverer.finish()
        finally:
            deliverer.stop()
        deliveries[project] = delivery
    ledger.close()
    assert deliveries["unchecked"].verified, deliveries["unchecked"].problems
    assert not deliveries["checked"].verified
    assert deliveries["checked"].problems == ["saved file model.pt not on the server"]


def test_a_run_that_says_it_ran_in_the_root_directory_opens_nothing(sink, tmp_path):
    """The recorded root is untrusted: `/` would allow every file, and is not taken."""
    job = tmp_path / "job"
    shutil.copytree(job_dir(JOB), job, symlinks=True)

    def root_everything(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") == "environment" and record.environment.root:
            record.environment.root = "/"
            return record
        return None

    run = source_runs(job)[0]
    rewrite_log(next(run.glob("run-*.wandb")), root_everything)
    (run / "files" / "model.pt").unlink()
    (run / "files" / "model.pt").symlink_to("/etc/passwd")
    result = cli(
        sink, tmp_path, "merge", job / "wandb", "--run-mode", "auto", "--out", tmp_path / "out"
    )
    assert result.exit_code == 2, result.stderr
    assert "'/etc/passwd'" in result.stderr and "--files-from" in result.stderr
    assert not (tmp_path / "out").exists()


def rerooted_job(tmp_path: Path, root: str, link_to) -> Path:
    """A copy of the fixture whose every run says it ran in `root`, its `model.pt` link
    leading to `link_to(job, rank)`."""
    job = tmp_path / "job"
    shutil.copytree(job_dir(JOB), job, symlinks=True)

    def new_root(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") == "environment" and record.environment.root:
            record.environment.root = root
            return record
        return None

    for rank, run in source_runs(job).items():
        rewrite_log(next(run.glob("run-*.wandb")), new_root)
        link = run / "files" / "model.pt"
        link.unlink()
        link.symlink_to(link_to(job, rank))
    return job


@pytest.mark.parametrize("claim", ["etc", "ancestor"])
@pytest.mark.parametrize("command", ["sync", "merge"])
def test_a_root_the_run_was_not_found_in_allows_nothing(sink, tmp_path, claim, command):
    """The recorded root is untrusted: a run that says it ran in /etc (or in a directory
    far above where it lies) and links to a file there has that file refused."""
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"a file the syncing user can read, out of the job\n")
    if claim == "etc":
        root, target = "/etc", Path("/etc/passwd")
    else:
        root, target = str(tmp_path), outside
    secret = target.read_bytes()
    job = rerooted_job(tmp_path, root, lambda job, rank: target)
    out = tmp_path / "out"
    staging = tmp_path / "staging"  # (kept: what sync staged is looked at too)
    where = ["--out", out] if command == "merge" else ["-p", "rv-exfil", "--keep-staging", staging]
    result = cli(sink, tmp_path, command, job / "wandb", "--run-mode", "auto", *where)
    assert result.exit_code == 2, (result.stderr, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    assert "'model.pt'" in lines[0] and "--files-from" in lines[0]
    assert sink.client.runs() == []
    assert not out.exists() and not any(staging.rglob("*.wandb"))
    for path in tmp_path.rglob("*"):  # (the state directory and staging included)
        if path.is_file() and not path.is_symlink() and path != outside:
            assert secret not in path.read_bytes(), path


def test_a_run_found_where_it_ran_follows_its_links_without_files_from(sink, tmp_path):
    """A run lying in `<root>/wandb/` of the root it recorded ran there: its links under
    that root are followed with no --files-from."""
    job = rerooted_job(
        tmp_path, str(tmp_path / "job"), lambda job, rank: job / f"rank-{rank}" / "model.pt"
    )
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        job / "wandb",
        "--run-mode",
        "new",
        "-p",
        "ranhere",
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    saved = saved_bytes(job)
    base = base_id(job)
    for rank in range(4):
        got = sink.client.file("local", "ranhere", f"{base}-rank-{rank}", "model.pt")
        assert got == saved[rank]


def test_files_every_rank_saves_are_said_once_not_once_a_file(tmp_path):
    """Shared mode keeps another rank's different `model.pt` under its label, as documented;
    with four ranks that each save one that is three files, said in one line, not three."""
    job = job_dir(JOB)
    assert len(set(saved_bytes(job).values())) == 4  # (each rank saved other bytes)
    [staged] = api.merge(job / "wandb", tmp_path / "out", run_mode="shared", files_from=job)
    said = [line for line in staged.warnings if "also written by another rank" in line]
    assert said == [
        "3 files also written by another rank kept under their rank's label: "
        "rank-1/model.pt, rank-2/model.pt, rank-3/model.pt"
    ]
    for rank in (1, 2, 3):  # (and each is where the line says)
        kept = staged.run_dir / "files" / f"rank-{rank}" / "model.pt"
        assert kept.read_bytes() == saved_bytes(job)[rank]


def test_the_line_of_moved_files_stays_one_line_at_many_ranks():
    line = moved_files_notice([f"rank-{rank}/model.pt" for rank in range(1, 1024)])
    assert line == (
        "1023 files also written by another rank kept under their rank's label: "
        "rank-1/model.pt, rank-2/model.pt, rank-3/model.pt, rank-4/model.pt "
        "and 1019 more"
    )
    assert moved_files_notice(["rank-1/a.pt"]).startswith("1 file also written")
