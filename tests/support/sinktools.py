"""End-to-end helpers: a real sink process, the real `wandb sync`, and what a `.wandb` file says.

The expectations are computed from the source `.wandb` records with protobuf directly (not
with wbmerge's own merge code), so a test compares what arrived with what was written.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import records
from wbmerge.sink import LikeWandb, LocalSink, SinkClient

# W&B's behaviours, all on (`sink serve --like-wandb`), with counts 1 s late instead of
# W&B's 2-4 s so that the tests stay fast: long enough for a sync to ask in the gap.
LIKE_WANDB = LikeWandb.all_on(lag=1.0)


def like_wandb_by_default() -> LikeWandb | None:
    """The sink of tests that must hold on W&B: `LIKE_WANDB`, or the ideal server when
    `WBMERGE_TEST_SINK=ideal` (to tell a failure of the model from one of the code)."""
    return None if os.environ.get("WBMERGE_TEST_SINK") == "ideal" else LIKE_WANDB


CONSOLE_PREFIX = re.compile(r"^(ERROR )?\d{4}-\d\d-\d\dT[\d:.]+ ?")


class SinkProcess(LocalSink):
    """`wbmerge sink serve` on a free loopback port, in its own process (`api.start_sink`'s
    sink), with what tests need beside it."""

    def __init__(
        self,
        data_dir: Path,
        faults: tuple[str, ...] = (),
        allow_faults: bool = False,
        like: LikeWandb | None = None,
    ) -> None:
        super().__init__(data_dir, port=0, faults=faults, allow_faults=allow_faults, like=like)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def client(self) -> SinkClient:
        return SinkClient(self.url, self.api_key)

    @property
    def auth(self) -> str:
        """The `Authorization` header of a request with the sink's key, as wandb sends it."""
        return "Basic " + base64.b64encode(f"api:{self.api_key}".encode()).decode()

    @property
    def env(self) -> dict[str, str]:
        """The environment that points wandb (and wbmerge) at this sink."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        return {
            **clean,
            "WANDB_BASE_URL": self.url,
            "WANDB_API_KEY": self.api_key,
            "WANDB_SILENT": "true",
        }


def wandb_sync(
    sink: SinkProcess, paths: list[Path], *args: str, timeout: int = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """The real uploader, `wandb sync`, into the sink; it writes its debug log under
    `cwd`/wandb/logs (`debug-sync.*.log`)."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    cmd = [str(wandb_cli), "sync", *args, *map(str, paths)]
    return subprocess.run(
        cmd, env=sink.env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def copy_runs(source: Path, dest: Path) -> Path:
    """`wandb sync` writes beside the runs it reads: give it a copy."""
    shutil.copytree(source, dest)
    return dest


@dataclass
class Expected:
    """What one `.wandb` file says: the run's values as the server should end up with them."""

    run_id: str
    group: str
    job_type: str
    config: dict
    summary: dict
    history: list[dict]
    console: list[str]
    stats: list[dict]
    exit_code: int | None


def _value(item: pb.HistoryItem | pb.SummaryItem | pb.ConfigItem) -> tuple[list[str], object]:
    keys = list(item.nested_key) or [item.key]
    return keys, json.loads(item.value_json)


def _put(target: dict, keys: list[str], value: object) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def expected_from_log(path: Path) -> Expected:
    history, stats, console_text = [], [], []
    config: dict = {}
    summary: dict = {}
    run_id = group = job_type = ""
    exit_code = None
    for record in records.read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, group, job_type = (
                record.run.run_id,
                record.run.run_group,
                record.run.job_type,
            )
            for item in record.run.config.update:
                _put(config, *_value(item))
        elif kind == "config":
            for item in record.config.update:
                _put(config, *_value(item))
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _put(row, *_value(item))
            history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _put(summary, *_value(item))
            for item in record.summary.remove:
                keys = list(item.nested_key) or [item.key]
                summary.pop(keys[0], None)
        elif kind == "stats":
            stats.append({item.key: json.loads(item.value_json) for item in record.stats.item})
        elif kind == "output_raw":
            console_text.append(record.output_raw.line)
        elif kind == "exit":
            exit_code = record.exit.exit_code
    console = [line for line in "".join(console_text).split("\n") if line.strip()]
    config.pop("_wandb", None)
    summary.pop("_wandb", None)
    return Expected(run_id, group, job_type, config, summary, history, console, stats, exit_code)


def content_of(run: dict) -> dict:
    """A run as the sink gives it, but when it was last written: a sync that sends nothing
    of a run still writes its claim on it (a hidden config key), which moves `updated`."""
    return {key: value for key, value in run.items() if key != "updated"}


def console_text(lines: list[str]) -> list[str]:
    """Console lines as the server stores them, without the uploader's timestamp prefix."""
    return [CONSOLE_PREFIX.sub("", line) for line in lines if CONSOLE_PREFIX.sub("", line).strip()]


def system_metric_values(rows: list[dict]) -> list[dict]:
    """System-metric rows with the `system.` prefix the uploader adds taken off again."""
    return [
        {k.removeprefix("system."): v for k, v in row.items() if not k.startswith("_")}
        for row in rows
    ]
