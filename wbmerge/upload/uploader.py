"""Running wandb's own uploader, `wandb sync`, under supervision.

The uploader runs in its own session (so a terminal's Ctrl-C reaches wbmerge, which stops
it), with its working and log directories inside staging (its debug logs go to `./wandb`
under its cwd, which must be neither the user's cwd nor a source directory). What it
reports is read from what wandb-core writes, never from the lines it prints (which put
the project's name as it is inside `[entity/project/run]`, and name no run for some
failures): a run is done when its `.wandb.synced` marker appears (`synced_markers`), and
what failed comes from the JSON lines of its debug log (`file_failures`). Its output is
only a sign of life: silence from both the uploader and the server for `timeout` seconds
ends it. `stop()` ends the whole process tree, wandb-core included (wandb starts
wandb-core in a session of its own).

An uploader can be started before its runs are known (`start`): the process imports wandb's
command line and starts wandb-core, then waits for its arguments on standard input, and runs
`wandb sync` with them in-process, exactly as the `wandb` command would. A cold `wandb sync`
spends about 0.8 s of a 2-core machine's time before it sends anything (wandb 0.31: 0.55 s
of imports, then wandb-core's start); one started while wbmerge stages its runs sends a
small run 0.05 s after it is given it. See `STANDBY` for the few lines it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import WbmergeError
from .credentials import Credentials
from .processes import descendants, start_time
from .settle import note_stopped
from .stagingdirs import OwnerRecord
from .standby import STANDBY

DEFAULT_TIMEOUT = 300.0  # seconds without progress before an upload is given up
DEFAULT_PARALLEL = 4  # below wandb sync's own default of 5: one job may be many runs
# Seconds between two recordings of an uploader's process tree in the staging's owner
# record (a walk of /proc and a file written): often enough to name wandb-core soon after
# it starts, and apart from how often the server is asked how far the runs are.
RECORD_EVERY = 2.0
_FILE_NAME = re.compile(r"\bName: (?P<name>[^,{}]+),")
SHOWN_CHARS = 200  # of a failure wandb-core logs, in the line that says a run failed
_LOG_NAME = re.compile(r"run-(?P<run>[^/]+)\.wandb$")


@dataclass
class UploadOutcome:
    returncode: int | None  # None: stopped by wbmerge (timeout or signal)
    output: str
    timed_out: bool = False
    errors: dict[str, list[str]] = field(default_factory=dict)  # run id -> what failed


class Uploader:
    """One `wandb sync` of staged run directories into a project."""

    def __init__(
        self,
        credentials: Credentials,
        project: str,
        entity: str | None,
        workdir: Path,
        timeout: float = DEFAULT_TIMEOUT,
        env: Mapping[str, str] | None = None,
        owner: OwnerRecord | None = None,
    ) -> None:
        """`owner`: the record of the staging directory that names the uploader's processes."""
        self.credentials = credentials
        self.owner = owner
        self.project, self.entity = project, entity
        self.workdir, self.timeout = workdir, timeout
        self.env = dict(os.environ if env is None else env)
        # wandb notes the wandb-core a process started in that process's environment
        # (WANDB_SERVICE), and a child that inherits it uses that wandb-core instead of
        # starting its own: a sync called from a process that used wandb would upload
        # through it, out of this uploader's supervision.
        self.env.pop("WANDB_SERVICE", None)
        self.proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._line_came = threading.Condition(self._lock)  # `_read` appended an output line
        self._reader: threading.Thread | None = None
        self._stopped = False  # stop() came first: nothing more is started
        self._sent = False  # its runs were handed to the process: it may have sent some
        # What failed so far, gathered as the debug logs grow: each run's end asks, and
        # reading everything again each time cost O(runs^2) (0.3 s at 256 runs).
        self._failures_lock = threading.Lock()
        self._run_failures: dict[str, list[str]] = {}  # run id -> the run not created or sent
        self._file_failures: dict[str, list[str]] = {}  # run id -> failed file transfers
        self._log_offsets: dict[Path, int] = {}  # bytes of each debug log read (whole lines)

    def arguments(self, run_dirs: Sequence[Path], parallel: int) -> list[str]:
        """The `wandb sync` arguments for `run_dirs`, `parallel` of them at a time."""
        args = ["sync", "-p", self.project, "-n", str(max(1, parallel))]
        if self.entity:
            args += ["-e", self.entity]
        return args + [str(d) for d in run_dirs]

    def start(self) -> None:
        """Start the process now, before its runs are known; `run` hands them over."""
        # Everything wandb writes goes inside the workdir, which staging removes: its logs
        # (wandb's command line writes `debug-cli.USER.log` to WANDB_DIR/wandb when that
        # exists, else to the temp dir; wandb-core its `core-debug-*.log` under
        # WANDB_CACHE_DIR, else ~/.cache) and its temp directories (left behind when the
        # uploader is stopped).
        try:
            for where in ("wandb", "cache", "tmp"):
                (self.workdir / where).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WbmergeError(
                f"cannot write the staging directory {self.workdir} ({exc.strerror or exc})"
            ) from None
        env = dict(self.env)
        env.update(WANDB_BASE_URL=self.credentials.base_url, WANDB_API_KEY=self.credentials.api_key)
        env.update(WANDB_DIR=str(self.workdir), WANDB_CACHE_DIR=str(self.workdir / "cache"))
        env.update(TMPDIR=str(self.workdir / "tmp"))
        env.pop("WANDB_MODE", None)  # an inherited offline/disabled mode would upload nothing
        env.pop("WANDB_RESUME", None)  # resuming would move the offsets remainder.py relies on
        for quiet in ("WANDB_SILENT", "WANDB_QUIET"):  # its output is how runs are seen ending
            env.pop(quiet, None)
        with self._lock:  # so that a stop() from another thread cannot miss the process
            if self._stopped or self.proc is not None:
                return
            self.proc = subprocess.Popen(
                [sys.executable, "-c", STANDBY],
                cwd=self.workdir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            # (started under the lock too: a `run` in another thread may take it over now)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        self._record_processes()

    def run(
        self,
        run_dirs: Sequence[Path],
        parallel: int,
        on_finished: Callable[[str], None],
        probe: Callable[[], bool],
        probe_every: float = 2.0,
    ) -> UploadOutcome:
        """Upload; `on_finished(run_id)` as each run ends; `probe()` says if the server moved."""
        self.start()
        with self._lock:
            if self._stopped or self.proc is None:
                return UploadOutcome(None, "")
            self._sent = True
            proc, reader = self.proc, self._reader
        assert proc.stdin is not None and reader is not None  # (set together by `start`)
        # (the markers looked for before the runs are handed over: a small run may be synced,
        # and marked, before this thread runs again, and a marker found already is passed over)
        unfinished = synced_markers(run_dirs)
        try:
            proc.stdin.write(json.dumps(self.arguments(run_dirs, parallel)) + "\n")
            proc.stdin.close()
        except OSError:
            pass  # it ended before it was given its runs: its output and exit code say why
        self._record_processes()
        # The server is asked how far the runs are in a thread of its own, so that its
        # questions (a round trip each) never hold up this loop, where each run's end is
        # seen: asked in this loop, they put a batch's last check up to 0.4 s late against
        # a server 50 ms away.
        moved_at = [time.monotonic()]  # when the server was last seen to move
        ending = threading.Event()
        probe_failed: list[BaseException] = []  # raised here once the prober has ended

        def probing() -> None:
            try:
                while not ending.wait(probe_every):
                    if probe():
                        moved_at[0] = time.monotonic()
            except BaseException as exc:  # (not a failed question: those answer False)
                probe_failed.append(exc)
                self.stop()  # the upload cannot be watched any more: end it now

        prober = threading.Thread(target=probing, name="wbmerge-probe", daemon=True)
        prober.start()
        seen, last_progress, last_record = 0, time.monotonic(), time.monotonic()
        timed_out = False
        try:
            while True:
                done = proc.poll() is not None
                with self._lock:
                    new = self._lines[seen:]
                if new:
                    seen += len(new)
                    last_progress = time.monotonic()
                for run_id in newly_synced(unfinished):
                    on_finished(run_id)
                if done and not reader.is_alive():
                    break
                now = time.monotonic()
                last_progress = max(last_progress, moved_at[0])
                if not done and now - last_record >= RECORD_EVERY:
                    last_record = now
                    self._record_processes()
                if not done and now - last_progress > self.timeout:
                    timed_out = True
                    self.stop()
                # Until the next line comes (`_read` says so), or a while: wandb-core writes
                # a run's marker just before the uploader prints that the run finished, so
                # that line wakes this loop to find the marker.
                with self._lock:
                    if len(self._lines) == seen:
                        self._line_came.wait(0.1 if done else 0.25)
        finally:
            ending.set()
            prober.join()
        if probe_failed:
            raise probe_failed[0]
        output = "".join(self._lines)
        if proc.returncode < 0 and not timed_out:  # killed by a signal, not by us
            note_stopped()
        outcome = UploadOutcome(None if timed_out else proc.returncode, output, timed_out)
        outcome.errors = self.errors()
        if self.owner is not None:
            self.owner.uploader(id(self), [])
        return outcome

    def errors(self) -> dict[str, list[str]]:
        """What failed so far, per run id, as wandb-core's debug logs say (`file_failures`):
        runs it could not create or stopped uploading, then files it did not upload."""
        files = self.file_failures()
        with self._failures_lock:
            errors = {run_id: list(found) for run_id, found in self._run_failures.items()}
        for run_id, failures in files.items():
            errors.setdefault(run_id, []).extend(failures)
        return errors

    def _record_processes(self) -> None:
        """Name the uploader's processes in the staging's owner record (see `stagingdirs`)."""
        if self.owner is not None and self.proc is not None:
            self.owner.uploader(id(self), [self.proc.pid, *descendants(self.proc.pid)])

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.proc.stdout as output:  # (closed at its end: a long-lived caller's pipes)
            for line in output:
                with self._lock:
                    self._lines.append(line)
                    self._line_came.notify_all()
        with self._lock:  # (the end of the output: `run` looks at the process again)
            self._line_came.notify_all()

    def file_failures(self) -> dict[str, list[str]]:
        """Failed file transfers per run id, from the uploader's debug logs.

        `wandb sync` reports these only there (it exits 0 and prints nothing), as JSON lines
        at level ERROR whose message starts `file transfer:` or `runfiles:`. The same read
        notes the other failures `errors` gives (see `_note_failure`). Each log is read from
        where the last call stopped, a whole line at a time.
        """
        with self._failures_lock:
            for log in sorted(self.workdir.glob("wandb/logs/debug-sync.*.log")):
                try:
                    with open(log, "rb") as stream:
                        stream.seek(self._log_offsets.get(log, 0))
                        text = stream.read()
                except OSError:
                    continue
                whole = text[: text.rfind(b"\n") + 1]  # a line still being written waits
                self._log_offsets[log] = self._log_offsets.get(log, 0) + len(whole)
                for line in whole.decode(errors="replace").splitlines():
                    self._note_failure(line)
            return {run_id: list(found) for run_id, found in self._file_failures.items()}

    def _note_failure(self, line: str) -> None:
        """Note the failure a debug log's `line` reports, if it reports one.

        wandb-core writes the log with Go's `slog` JSON handler: `level`, `msg`, and the
        `.wandb` file the line is about as `sync_path` (for lines about one run). Three
        kinds of line say that something of a run did not reach the server: a failed file
        transfer (`file transfer:`, `runfiles:`); a run it could not create or update
        (`runupserter:`, with the server's answer in `error`); and any line at its fatal
        level, `ERROR+4` (`observability.LevelFatal`), after which it sends no more of the
        run's data (its filestream gave up). Other ERROR lines are passed over: a request
        that failed once (`api: HTTP error`) is retried, and wandb-core may still succeed.
        """
        if '"ERROR' not in line:
            return
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(entry, dict):
            return
        level, message = entry.get("level"), str(entry.get("msg", ""))
        if not isinstance(level, str) or not level.startswith("ERROR"):
            return
        match = _LOG_NAME.search(str(entry.get("sync_path", "")))
        if message.startswith(("file transfer:", "runfiles:")):
            name = _failed_file_name(entry.get("task"))
            what = f"file {name} not uploaded" if name else _shown(message)
            self._file_failures.setdefault(match["run"] if match else "?", []).append(what)
        elif match and (level != "ERROR" or message.startswith("runupserter:")):
            detail = entry.get("error")
            what = _shown(f"{message}: {detail}" if detail else message)
            self._run_failures.setdefault(match["run"], []).append(what)

    def stop(self, grace: float = 5.0) -> None:
        """End the uploader and everything it started (wandb-core too); wait for them.
        Called before `run`, it keeps `run` from starting anything. Only an uploader that
        was given its runs is noted as stopped: one still waiting for them sent nothing."""
        with self._lock:
            self._stopped = True
            proc, sent = self.proc, self._sent
        if proc is not None and proc.stdin is not None and not sent:
            proc.stdin.close()  # (one never given its runs ends at this end of its input)
        if proc is None or proc.poll() is not None:
            return
        try:
            _end_tree(proc, grace)
        finally:
            if sent:
                note_stopped()  # what it sent last may still be landing (see `settle`)


def _failed_file_name(task: object) -> str | None:
    """The name of the file a failed transfer's `task` names, or None.

    This is the one place where wbmerge reads text meant for people from wandb-core: the
    `task` field of a `file transfer:` line is Go's rendering of the upload task
    (`DefaultUploadTask{FileKind: 1, Path: ..., Name: config.yaml, Url: ..., Size: 3}`),
    and no field of the line holds the file's name alone. When the rendering changes, the
    failure is said with wandb-core's message instead of the file's name.
    """
    match = _FILE_NAME.search(task) if isinstance(task, str) else None
    return match["name"].strip() if match else None


def _shown(text: str) -> str:
    """A message of wandb-core's (which may quote the server's answer) fit for one line."""
    flat = "".join(c if c.isprintable() else " " for c in text)
    return flat if len(flat) <= SHOWN_CHARS else flat[: SHOWN_CHARS - 3] + "..."


def synced_markers(run_dirs: Sequence[Path]) -> dict[str, list[Path]]:
    """The markers wandb-core will write as it finishes each run of `run_dirs`, by run id.

    wandb-core writes `<log>.synced` beside each `.wandb` log it has synced, once the log is
    read to its end and its sender has closed, just before it prints `Finished syncing`;
    it writes none for a run it failed to sync. wandb's own `wandb sync` reads the marker
    to pass over runs synced already, so it is a contract between wandb's command line and
    wandb-core, where the printed line is only text. The run id is the one of the log's
    name (`run-<id>.wandb`, as wandb and wbmerge's staging name logs). A marker there
    before the upload is left out: `wandb sync` passes over that log and never finishes it.
    """
    markers: dict[str, list[Path]] = {}
    for run_dir in run_dirs:
        for log in sorted(Path(run_dir).glob("run-*.wandb")):
            marker = log.with_name(log.name + ".synced")
            match = _LOG_NAME.search(log.name)
            if match and not marker.exists():
                markers.setdefault(match["run"], []).append(marker)
    return markers


def newly_synced(unfinished: dict[str, list[Path]]) -> list[str]:
    """The runs of `unfinished` (`synced_markers`) whose every log is marked synced now;
    they are taken out of it, so each run is given once."""
    done = [run_id for run_id, markers in unfinished.items() if all(map(Path.exists, markers))]
    for run_id in done:
        del unfinished[run_id]
    return done


def _end_tree(proc: subprocess.Popen, grace: float) -> None:
    """End `proc` and every process it started, politely first; wait until they are gone."""
    tree = descendants(proc.pid)
    groups = {proc.pid}
    for pid in tree:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=grace)
            if all(start_time(pid) is None for pid in tree):
                return
            time.sleep(0.2)
        except subprocess.TimeoutExpired:
            continue
