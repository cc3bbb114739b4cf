"""Helpers of the hostile-input tests: copies of the real fixtures, run the CLI as a
subprocess with a timeout, and snapshots of a directory tree to compare."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from wbmerge.log import pb, read_payloads, write_payloads

from ..conftest import job_dir

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT = 120


def copy_job(name: str, dest: Path) -> Path:
    """A private copy of the fixture job `name` (its `wandb/` directory) under `dest`."""
    shutil.copytree(job_dir(name), dest)
    return dest


def run_logs(job: Path) -> list[Path]:
    return sorted(job.glob("wandb/offline-run-*/run-*.wandb"))


def run_cli(*args: str | Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`wbmerge ARGS` in a fresh interpreter, bounded in time (a hang fails the test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WBMERGE_DEBUG", None)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "wbmerge.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=env,
        cwd=ROOT,
    )


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (not following links) -> a digest of what it is."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = "link:" + os.readlink(path)
            elif path.is_file():
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = "special"
    return found


def rewrite_log(log: Path, change: Callable[[pb.Record], pb.Record | None]) -> None:
    """Write `log` again (with wbmerge's own writer) with `change` applied to each record;
    `change` returns the record to write, or None to keep the original bytes."""
    payloads = []
    for payload in read_payloads(log):
        changed = change(pb.Record.FromString(payload))
        payloads.append(payload if changed is None else changed.SerializeToString())
    write_payloads(log, payloads)


def insert_after_run_record(log: Path, extra: list[bytes]) -> None:
    """Insert raw record payloads into `log` right after its run record."""
    payloads = list(read_payloads(log))
    at = next(
        i
        for i, p in enumerate(payloads)
        if pb.Record.FromString(p).WhichOneof("record_type") == "run"
    )
    write_payloads(log, [*payloads[: at + 1], *extra, *payloads[at + 1 :]])


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one `wbmerge: error:` line of a refused command (no traceback, exit 2)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    errors = [line for line in lines if line.startswith("wbmerge: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]
