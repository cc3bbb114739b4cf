"""The entry point of a merge: one planned target written as a new offline run directory
that `wandb sync` accepts, created exclusively and removed again on any failure."""

from __future__ import annotations

import errno
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import safepaths
from ..errors import WbmergeError
from ..log import LogWriter
from ..plan import Target
from ..runtime import streaming
from ..wandbcore import StagedContent
from .artifactfiles import LoggedArtifact
from .artifacts import ArtifactRecords
from .files import stage_files
from .options import MergeOptions
from .passthrough import write_passthrough


@dataclass
class Staged:
    """One merged offline run, ready for `wandb sync`."""

    target: Target
    run_dir: Path
    history_rows: int = 0  # shared targets: merged rows written
    source_rows: int = 0  # shared targets: source rows read
    records: int = 0
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)
    metrics: int = 0  # shared targets: distinct metric keys written (history and summary)
    bound_notice: str | None = None  # shared targets: more metrics than W&B recommends
    # What the staged log will put on the server (`content.read_staged` of it), when the
    # merge counted it on the way: a spliced log, whose source was read anyway. None: count
    # the staged log when it is needed.
    content: StagedContent | None = None
    # The saved files (`wandb.save` links of the sources, followed) by their staged names,
    # with the sizes read from the sources: what the upload must put on the server.
    saved_files: dict[str, int] = field(default_factory=dict)
    # The artifacts of the sources the staged run logs (`merge.artifacts`), with their files'
    # sizes and MD5s read from the sources: each must be committed on the server after the
    # upload.
    artifacts: list[LoggedArtifact] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"run-{self.target.id}.wandb"


def staged_with_files(
    target: Target, run_dir: Path, files_from: tuple[Path, ...]
) -> tuple[Staged, dict[tuple[Path, str], str]]:
    """The staged run of `target` in its new `run_dir`, the files of its ranks' runs copied
    into `files/` (`stage_files`), and the names they were given there: the start of a
    one-shot stage and of each round of a follow alike. The caller removes `run_dir` on a
    failure."""
    (run_dir / "files").mkdir()
    staged = Staged(target, run_dir)
    files = stage_files(target, run_dir / "files", staged.warnings, files_from)
    staged.saved_files = files.saved
    return staged, files.names


def stage(
    target: Target, out_dir: Path, options: MergeOptions, count_content: bool = False
) -> Staged:
    """Write `target` under `out_dir` as `offline-run-<time>-<id>/`; returns what was written.

    With `count_content` (a sync, which verifies the upload against it), a log that is
    spliced is also counted while it is checked (`Staged.content`); a merge alone does not
    need the count, which halves the pass-through's speed.

    The run directory is created exclusively: one that exists already is an error naming
    it, never replaced (it may be a source, or another merge's output). On any failure the
    directory this call created is removed again, and nothing else.
    """
    run_dir = new_run_dir(target, out_dir)
    try:
        staged, file_names = staged_with_files(target, run_dir, options.files_from)
        artifacts = ArtifactRecords(target, options, run_dir / "artifacts")
        with streaming(), open(staged.log_path, "xb") as stream, LogWriter(stream) as writer:
            if target.kind == "shared":
                # Imported here: the shared merge brings in pyarrow (85 ms of every start),
                # which a pass-through (`new`, `auto`) never uses.
                from .shared import write_shared

                outcome = write_shared(target, writer, options, file_names, out_dir, artifacts)
            else:
                outcome = write_passthrough(target, writer, options, artifacts, count_content)
            staged.records = writer.records
        staged.artifacts = artifacts.logged
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        if not _writing(exc, out_dir):
            raise
        raise WbmergeError(
            f"cannot write the merged run in {out_dir} ({exc.strerror or exc})"
        ) from None
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    staged.history_rows = outcome.history_rows
    staged.source_rows = outcome.source_rows
    staged.exit_code = outcome.exit_code
    staged.metrics = outcome.metrics
    staged.bound_notice = outcome.bound_notice
    staged.content = outcome.content
    staged.warnings += outcome.warnings
    return staged


# Failures that only a write can meet: a full disk, a quota, a file too large, a read-only
# file system. (A failed read of a source names the source, which is not in `out_dir`.)
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _writing(exc: OSError, out_dir: Path) -> bool:
    """Whether `exc` is a failure to write the merged run (or its spools) in `out_dir`."""
    if exc.errno in _WRITE_ERRORS:
        return True
    return exc.filename is not None and safepaths.is_within(Path(exc.filename), out_dir)


def new_run_dir(target: Target, out_dir: Path) -> Path:
    """A new, empty staged run directory for `target` under `out_dir`, named as wandb names
    an offline run's (`offline-run-<start>-<id>`); one that exists already is an error
    naming it, never replaced (it may be a source, or another merge's output)."""
    start = target.sources[0].start_time
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(start or time.time()))
    name = f"offline-run-{stamp}-{safepaths.check_component(target.id, 'run id')}"
    run_dir = out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
    except FileExistsError:
        raise WbmergeError(
            f"{run_dir} exists already; merged runs are never written over an existing "
            "directory (choose an empty --out, or remove it)"
        ) from None
    except OSError as exc:
        raise WbmergeError(f"{run_dir}: cannot create ({exc.strerror or exc})") from None
    return run_dir
