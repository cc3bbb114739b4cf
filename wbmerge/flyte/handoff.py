"""Hand the runs of every node to the merge task, with nothing but what Flyte provides.

Only rank 0's return value leaves an `Elastic` task, and each node writes its ranks' runs to
its own disk. So when training ends, local rank 0 of every node uploads its node's runs to
one prefix of the action's raw data store (with `flyte.storage`, the API under `flyte.io.Dir`,
so S3, GCS, Azure and the local file system of local mode alike), as `{prefix}/worker-{w}/`. The ranks learn of each other over
the job's own torch.distributed process group (a gloo group made for this): rank 0 names the
prefix, every node reports what it uploaded or why it could not, and rank 0 checks that the
store holds every reported file before it writes a manifest and returns a `Dir` of the
prefix. A node that could not upload fails the task with a message naming that node.

With `handoff="shared-volume"` every node mounts one volume at `WBMERGE_DIR`; the nodes'
folders are already side by side there and rank 0 hands the whole directory on.

The merge task reads the manifest, downloads the whole prefix or one worker's part of it,
and checks that every file the nodes reported arrived with its size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import flyte
import flyte.io
import flyte.storage
from flyte.syncify import syncify

from .. import training
from ..errors import WbmergeError
from ..training import RUN_DATA_DIR, RankInfo
from .context import worker_folder
from .rank import RankState, finish_run, rank_state

MANIFEST = "wbmerge-handoff.json"
MANIFEST_FORMAT = 1
RUN_FILES = "files"  # a run's folder that `wandb sync` uploads beside its log
# How long the ranks wait for each other in the hand-off (the slowest node's upload included).
HANDOFF_TIMEOUT = timedelta(hours=1)
# How long a node waits for wandb's service to close the files of its finished runs.
CLOSE_PATIENCE = 60.0


def offline_runs() -> flyte.io.Dir:
    """Finish this rank's run and hand the job's offline runs on as a Dir (call it on every
    rank: it waits for all of them, so that the Dir holds every rank's finished run)."""
    finish_run()
    state = rank_state()
    info = training.detect_rank()
    shared = state.resolved.get("handoff") == "shared-volume"
    with _handoff_group(info) as group:
        proposal = _destination(state, shared) if info.rank == 0 else None
        destination = _all_gather(proposal, group, info)[0]
        if isinstance(destination, WbmergeError):  # rank 0 could not name one: all stop
            raise WbmergeError(str(destination))
        report = None
        if info.local_rank == 0:
            report = hand_off_node(state.runs_dir, info.worker, destination, upload=not shared)
        reports = [r for r in _all_gather(report, group, info) if r is not None]
        verdict = _conclude(state, reports, info, destination) if info.rank == 0 else None
        verdict = _all_gather(verdict, group, info)[0]  # every rank fails alike, or none
    if verdict is not None:
        raise WbmergeError(verdict)
    if info.rank == 0 and shared and _on_cluster():
        return flyte.io.Dir.from_local_sync(destination)  # to the blob store, by rank 0
    return flyte.io.Dir(path=destination)


def _conclude(
    state: RankState, reports: list[dict], info: RankInfo, destination: str
) -> str | None:
    """Rank 0: every node's upload reported and in the store, then the manifest; else why
    not, for every rank to raise."""
    try:
        check_reports(reports, info.num_workers, destination)
        workers = {r["worker"]: r["files"] for r in reports}
        check_arrived(destination, workers)
        _write_manifest(destination, state, workers)
    except Exception as exc:
        return str(exc).strip() or type(exc).__name__
    return None


def _destination(state: RankState, shared: bool) -> str | WbmergeError:
    """Where the nodes' folders go: a fresh prefix of the raw data store named after the job
    (a retried action does not meet the runs of an earlier attempt), or the shared volume.
    An error is returned, not raised, so that it reaches the ranks waiting for the answer."""
    if shared:
        return str(state.runs_dir.parent)
    context = flyte.ctx()
    if context is None or context.raw_data_path is None:
        return WbmergeError("the blob-store hand-off runs inside a Flyte task (no raw data path)")
    try:
        return _join(context.raw_data_path.get_random_remote_path(), state.job_id)
    except Exception as exc:
        return WbmergeError(f"no place in the raw data store {context.raw_data_path.path}: {exc}")


def _join(prefix: str, *parts: str) -> str:
    return "/".join([prefix.rstrip("/"), *parts])


def _on_cluster() -> bool:
    context = flyte.ctx()
    return context is not None and getattr(context, "mode", "local") != "local"


@contextmanager
def _handoff_group(info: RankInfo) -> Iterator[Any]:
    """A gloo process group over all ranks (CPU objects, whatever backend trains), made from
    the job's own group, or from the launcher's environment when the task made none."""
    if info.world_size <= 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=HANDOFF_TIMEOUT)
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
    else:
        dist.init_process_group("gloo", timeout=HANDOFF_TIMEOUT)
        try:
            yield None
        finally:
            dist.destroy_process_group()


def _all_gather(value: Any, group: Any, info: RankInfo) -> list[Any]:
    """Every rank's `value`, in rank order (and a barrier: it returns when all have sent)."""
    if info.world_size <= 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def node_files(runs_dir: Path, patience: float = CLOSE_PATIENCE) -> dict[str, int]:
    """The files of a node's runs that the merge reads, relative to the node's folder, with
    their sizes: each run's `run-*.wandb` log, its `files/` folder and the staging of its
    artifacts' files (`wandb-data/`, where `wbmerge.init` keeps it). Not its `logs/`, which
    wandb's service goes on writing until the process ends, nor wandb's `latest-run` link,
    which would hand every latest run on twice.

    The sizes are taken once wandb's service has closed the files (see `wait_closed`)."""
    paths = [path for run_dir in _run_dirs(runs_dir) for path in _handed_on(run_dir)]
    wait_closed(paths, patience)
    return {path.relative_to(runs_dir).as_posix(): path.stat().st_size for path in paths}


def wait_closed(paths: list[Path], patience: float = CLOSE_PATIENCE) -> None:
    """Wait (at most `patience` seconds) until no process holds any of `paths` open for
    writing and their sizes stand still.

    `run.finish()` returns before wandb's service has closed the run's log, and the service
    writes the log's last buffered block when it closes it: a size taken before that is not
    the size that arrives. Open files are seen in `/proc` (Linux); elsewhere only the sizes
    are watched."""
    wanted = {_identity(path) for path in paths} - {None}
    deadline = time.monotonic() + patience
    sizes = None
    while time.monotonic() < deadline:
        now = [_size(path) for path in paths]
        if now == sizes and not _open_for_writing(wanted):
            return
        sizes = now
        time.sleep(0.1)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _open_for_writing(files: set[tuple[int, int]]) -> bool:
    """Whether a process (that this one may look at) has one of `files` open for writing.

    Processes end while they are looked at (ranks, data loaders and wandb's services end
    together): one that is gone, or not ours to look at, is passed over at every step."""
    if not files:
        return False
    try:
        pids = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return False  # no /proc (not Linux): only the sizes are watched
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if _identity(Path(f"/proc/{pid}/fd/{fd}")) not in files:  # the open file's
                    continue
                flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            except OSError:
                continue
            mode = int(flags.split("flags:", 1)[1].split()[0], 8) & os.O_ACCMODE
            if mode in (os.O_WRONLY, os.O_RDWR):
                return True
    return False


def _run_dirs(runs_dir: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(runs_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not Path(dirpath, d).is_symlink())
        if any(_is_log(n) for n in filenames):
            found.append(Path(dirpath))
            dirnames[:] = []  # a run directory's own folders are not runs
    return found


def _is_log(name: str) -> bool:
    return name.startswith("run-") and name.endswith(".wandb")


def _handed_on(run_dir: Path) -> list[Path]:
    logs = sorted(p for p in run_dir.iterdir() if _is_log(p.name) and p.is_file())
    files = sorted(
        p
        for folder in (RUN_FILES, RUN_DATA_DIR)
        for p in (run_dir / folder).rglob("*")
        if p.is_file()
    )
    return logs + files


def hand_off_node(runs_dir: Path, worker: int, destination: str, upload: bool) -> dict:
    """One node's part (its local rank 0): upload the node's runs to
    `{destination}/worker-{w}/`; the report says what was handed on, or why it was not."""
    target = _join(destination, worker_folder(worker))
    try:
        files = node_files(runs_dir)
        if not files:
            raise WbmergeError(f"no offline run under {runs_dir}")
        if upload:
            _upload(runs_dir, files, target)
    except Exception as exc:  # reported to rank 0, which fails the task naming this node
        reason = str(exc).strip() or type(exc).__name__
        return {"worker": worker, "error": f"{type(exc).__name__}: {reason}", "target": target}
    return {"worker": worker, "files": files, "target": target}


def _upload(runs_dir: Path, files: dict[str, int], target: str) -> None:
    """One recursive upload of exactly `files`: they are linked (or copied) into a staging
    folder beside the node's runs first, as the store takes a folder in one parallel put."""
    staging = Path(tempfile.mkdtemp(prefix=".handoff-", dir=runs_dir.parent))
    try:
        for name in files:
            source, linked = runs_dir / name, staging / name
            linked.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, linked)
            except OSError:
                shutil.copy2(source, linked)
        syncify(flyte.storage.put)(str(staging), target, recursive=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_reports(reports: list[dict], num_workers: int, destination: str) -> None:
    """Every node reported an upload, and none failed; else an error naming the nodes."""
    failed = [r for r in reports if "error" in r]
    if failed:
        lines = "; ".join(
            f"node {r['worker']} could not hand its runs to {r['target']}: {r['error']}"
            for r in failed
        )
        raise WbmergeError(f"hand-off failed: {lines}")
    reported = {r["worker"] for r in reports}
    silent = [w for w in range(num_workers) if w not in reported]
    if silent:
        names = ", ".join(f"node {w}" for w in silent)
        raise WbmergeError(f"hand-off failed: {names} reported no upload to {destination}")


def check_arrived(destination: str, workers: dict[int, dict[str, int]]) -> None:
    """The store holds every file each node reported, with its size; else an error that
    names the nodes whose files are missing."""
    filesystem = flyte.storage.get_underlying_filesystem(path=destination)
    root = filesystem._strip_protocol(destination).rstrip("/")
    try:
        listing = filesystem.find(destination, detail=True)
    except FileNotFoundError:
        listing = {}
    stored = {
        name[len(root) + 1 :]: info.get("size")
        for name, info in listing.items()
        if name.startswith(root + "/")
    }
    short = []
    for worker, files in sorted(workers.items()):
        folder = worker_folder(worker)
        missing = [f for f, size in files.items() if stored.get(f"{folder}/{f}") != size]
        if missing:
            short.append(
                f"node {worker}: {len(missing)} of {len(files)} file(s), e.g. {missing[0]}"
            )
    if short:
        raise WbmergeError(f"hand-off incomplete at {destination}: missing {'; '.join(short)}")


def _write_manifest(destination: str, state: RankState, workers: dict[int, dict]) -> None:
    manifest = {
        "format": MANIFEST_FORMAT,
        "job_id": state.job_id,
        "run_mode": state.resolved.get("run_mode"),
        "rank_scope": state.resolved.get("rank_scope"),
        "workers": {str(w): {"files": files} for w, files in sorted(workers.items())},
    }
    with tempfile.TemporaryDirectory(prefix="wbmerge-manifest-") as scratch:
        local = Path(scratch, MANIFEST)
        local.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        syncify(flyte.storage.put)(str(local), _join(destination, MANIFEST))


# -- the merge task's side -----------------------------------------------------------------


async def read_manifest(runs: flyte.io.Dir) -> dict:
    """The hand-off's manifest: which nodes handed on which files. Checked for shape, as the
    store is input like any other."""
    try:
        async with flyte.io.File(path=_join(runs.path, MANIFEST)).open("rb") as handle:
            manifest = json.loads(bytes(await handle.read()))  # obstore gives its own Bytes
    except (OSError, ValueError) as exc:
        raise WbmergeError(
            f"{runs.path}: no readable hand-off manifest ({MANIFEST}); "
            "is this the Dir that wbmerge.flyte.offline_runs() returned?"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise WbmergeError(f"{runs.path}: {MANIFEST} is not a wbmerge hand-off manifest")
    workers = manifest.get("workers")
    if not isinstance(workers, dict):
        raise WbmergeError(f"{runs.path}: {MANIFEST} is not a wbmerge hand-off manifest")
    checked: dict[int, dict[str, int]] = {}
    for worker, entry in workers.items():
        files = entry.get("files") if isinstance(entry, dict) else None
        if not str(worker).isdigit() or not isinstance(files, dict):
            raise WbmergeError(f"{runs.path}: {MANIFEST} lists a bad worker {worker!r}")
        for name, size in files.items():
            parts = PurePosixPath(name).parts
            if name.startswith("/") or ".." in parts or not isinstance(size, int):
                raise WbmergeError(f"{runs.path}: {MANIFEST} lists a bad file {name!r}")
        checked[int(worker)] = files
    manifest["workers"] = checked
    return manifest


def workers_of(manifest: dict) -> list[int]:
    return sorted(manifest["workers"])


async def fetch_runs(runs: flyte.io.Dir, manifest: dict, worker: int | None = None) -> Path:
    """The handed-on runs on this machine (the whole job, or one worker's folder), checked
    against the manifest: every file there with its size."""
    if worker is not None and worker not in manifest["workers"]:
        raise WbmergeError(f"{runs.path}: the hand-off has no worker {worker}")
    part = runs if worker is None else flyte.io.Dir(path=_join(runs.path, worker_folder(worker)))
    local = Path(await part.download())
    workers = manifest["workers"] if worker is None else {worker: manifest["workers"][worker]}
    short = []
    for number, files in sorted(workers.items()):
        base = local / worker_folder(number) if worker is None else local
        missing = [
            name
            for name, size in files.items()
            if not (base / name).is_file() or (base / name).stat().st_size != size
        ]
        if missing:
            short.append(
                f"node {number}: {len(missing)} of {len(files)} file(s), e.g. {missing[0]}"
            )
    if short:
        raise WbmergeError(f"{runs.path}: runs missing after download: {'; '.join(short)}")
    return local
