"""A sink in a process of its own, started and stopped from Python (`api.start_sink`).

The sink serves with aiohttp's event loop until it is stopped, so a caller that wants to go
on (a notebook, a test, a script that syncs into it) runs it in a child process: the same
`wbmerge sink serve` a user would type, on a port it picks or is given. The child writes
the port it bound to a file once it accepts connections, which is how the parent knows it
is ready; the key is the one the sink keeps in its data directory.
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from ..errors import WbmergeError
from .access import read_api_key
from .wandblike import LikeWandb

START_SECONDS = 30.0  # a sink that has not bound its port by then is taken as failed


class LocalSink:
    """`wbmerge sink serve` in a child process; `start()` returns once it serves.

    `url` and `api_key` are what wandb needs (`env` gives them as `WANDB_BASE_URL` and
    `WANDB_API_KEY` beside the rest of this process's environment); `stop()` ends it, as
    does leaving a `with` block. Port 0 picks a free port.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        faults: Sequence[str] = (),
        allow_faults: bool = False,
        like: LikeWandb | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.like = like  # which of W&B's behaviours it models (None: the ideal server)
        self.port = port
        self.faults = tuple(faults)
        self.allow_faults = allow_faults
        self.process: subprocess.Popen[bytes] | None = None
        self._at_exit: functools.partial[None] | None = None
        self.url = ""
        self.api_key = ""

    @property
    def log_path(self) -> Path:
        """Where the child's own lines go (beside the data directory, which is the sink's)."""
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def start(self) -> LocalSink:
        if self.process is not None and self.process.poll() is None:
            raise WbmergeError(f"the sink at {self.url or self.data_dir} runs already")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        port_file = self.data_dir / "port"
        port_file.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "wbmerge.sink",
            "--port",
            str(self.port),
            "--data",
            str(self.data_dir),
            "--port-file",
            str(port_file),
        ]
        for fault in self.faults:
            command += ["--fault", fault]
        if self.allow_faults:
            command.append("--allow-faults")
        if self.like is not None:
            command += self.like.cli_args()
        # The sink's first lines hold its key: its log is the owner's alone, and this start's.
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(log, 0o600)
            self.process = subprocess.Popen(command, stdout=log, stderr=log)
        finally:
            os.close(log)
        # A sink left running when this process ends would hold its port: stop it then.
        self._at_exit = functools.partial(_stop, self.process)
        atexit.register(self._at_exit)
        try:
            deadline = time.monotonic() + START_SECONDS
            while not port_file.exists():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise WbmergeError(f"the sink did not start: {self._last_line()}")
                time.sleep(0.05)
            self.url = f"http://127.0.0.1:{port_file.read_text()}"
            self.api_key = read_api_key(self.data_dir)  # made on the sink's first start
        except BaseException:  # (also Ctrl-C while it starts: no sink is left behind)
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End the sink (SIGTERM, then SIGKILL after 30 s); stopping a stopped sink does
        nothing."""
        if self.process is not None:
            _stop(self.process)
            atexit.unregister(self._at_exit)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with wandb pointed at the sink."""
        return {**os.environ, "WANDB_BASE_URL": self.url, "WANDB_API_KEY": self.api_key}

    def _last_line(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1].removeprefix("wbmerge: error: ") if lines else "(it said nothing)"

    def __enter__(self) -> LocalSink:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
