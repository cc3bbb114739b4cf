"""Upload: staged offline runs go to W&B through wandb's own uploader, `wandb sync` (wandb-core).

We never speak W&B's upload protocol ourselves. This module finds the credentials, runs the
uploader, and keeps a small ledger (outside the user's directories) of what was uploaded
from which source files, so a second `wbmerge sync` uploads no duplicates.
"""

from __future__ import annotations

import hashlib
import json
import netrc
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .errors import WbmergeError
from .plan import Target

DEFAULT_BASE_URL = "https://api.wandb.ai"
DEFAULT_PARALLEL = 4  # below wandb sync's own default of 5: one job may be many runs
_VIEW_RUN = re.compile(r"View run \S+ at (\S+/(?P<entity>[^/\s]+)/(?P<project>[^/\s]+)/runs/\S+)")


@dataclass(frozen=True)
class Credentials:
    base_url: str
    api_key: str


def find_credentials(env: Mapping[str, str] | None = None) -> Credentials:
    """WANDB_BASE_URL (default api.wandb.ai) and a key from WANDB_API_KEY or ~/.netrc."""
    env = os.environ if env is None else env
    base_url = (env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    key = env.get("WANDB_API_KEY")
    if not key:
        host = urlparse(base_url).hostname or ""
        try:
            entry = netrc.netrc(env.get("NETRC") or None).authenticators(host)
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            entry = None
        key = entry[2] if entry else None
    if not key:
        raise WbmergeError(
            f"no W&B credentials for {base_url}: set WANDB_API_KEY or run `wandb login` "
            "(for the local sink: WANDB_BASE_URL=http://127.0.0.1:8765 and any 40+ character key)"
        )
    return Credentials(base_url, key)


def wandb_executable() -> str:
    beside = Path(sys.executable).with_name("wandb")
    found = str(beside) if beside.exists() else shutil.which("wandb")
    if not found:
        raise WbmergeError("the `wandb` command is not installed (pip install wandb)")
    return found


@dataclass
class UploadResult:
    ok: bool
    output: str
    entity: str | None  # as the uploader reported it, when we did not know it


def run_wandb_sync(
    run_dirs: Sequence[Path],
    project: str,
    entity: str | None,
    parallel: int,
    credentials: Credentials,
    env: Mapping[str, str] | None = None,
) -> UploadResult:
    """`wandb sync` of the staged run directories; ok only when the uploader says so."""
    cmd = [wandb_executable(), "sync", "-p", project, "-n", str(max(1, parallel))]
    if entity:
        cmd += ["-e", entity]
    cmd += [str(d) for d in run_dirs]
    child_env = dict(os.environ if env is None else env)
    child_env.update(WANDB_BASE_URL=credentials.base_url, WANDB_API_KEY=credentials.api_key)
    child_env.pop("WANDB_MODE", None)  # an inherited offline/disabled mode would upload nothing
    proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    reported = {m["entity"] for m in _VIEW_RUN.finditer(output)}
    failed = proc.returncode != 0 or re.search(r"^wandb: ERROR", output, re.M) is not None
    return UploadResult(not failed, output, next(iter(reported)) if len(reported) == 1 else None)


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("WBMERGE_STATE_DIR"):
        return Path(env["WBMERGE_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "wbmerge"


class Ledger:
    """What was uploaded where, from which source files (paths, sizes, mtimes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, dict] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            self.entries = {}

    @staticmethod
    def key(base_url: str, entity: str | None, project: str, target: Target) -> str:
        return f"{base_url}|{entity or ''}|{project}|{target.id}"

    @staticmethod
    def fingerprint(target: Target, settings: Mapping[str, object]) -> str:
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        for source in (*target.sources, *target.extra_system_sources):
            stat = source.path.stat()
            digest.update(f"{source.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        return digest.hexdigest()

    def synced(self, key: str, fingerprint: str) -> bool:
        return self.entries.get(key, {}).get("fingerprint") == fingerprint

    def record(self, key: str, fingerprint: str) -> None:
        self.entries[key] = {"fingerprint": fingerprint, "time": time.time()}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True))
        tmp.replace(self.path)
