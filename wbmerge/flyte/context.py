"""What a wbmerge Flyte task knows about its job: the decorator's settings, the defaults of
`wandb_config`, the job id Flyte gives the training action, and where each node's ranks write.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flyte

from ..errors import WbmergeError

RUNS_DIR_ENV = "WBMERGE_DIR"
CONTEXT_PREFIX = "wandb_"
HANDOFFS = ("blobstore", "shared-volume")


@dataclass
class Settings:
    """What `wandb_init` was given; the context (`wandb_config`) fills what it was not."""

    run_mode: str | None = None
    rank_scope: str | None = None
    project: str | None = None
    entity: str | None = None
    init_kwargs: dict = field(default_factory=dict)
    nnodes: int = 1
    nproc_per_node: int = 1
    handoff: str = "blobstore"  # how the nodes' runs reach the merge task (HANDOFFS)

    def resolved(self, context: dict[str, str]) -> dict[str, Any]:
        """The effective values: decorator, else `wandb_config` context, else defaults."""
        from_context = read_context(context)
        kwargs = {**from_context.pop("init_kwargs", {}), **self.init_kwargs}
        return {
            "run_mode": self.run_mode or from_context.get("run_mode") or "auto",
            "rank_scope": self.rank_scope or from_context.get("rank_scope") or "global",
            "project": self.project or from_context.get("project"),
            "entity": self.entity or from_context.get("entity"),
            "host": from_context.get("host"),
            "init_kwargs": kwargs,
            "handoff": self.handoff,
        }


@contextmanager
def wandb_config(
    project: str | None = None,
    entity: str | None = None,
    host: str | None = None,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    **init_kwargs: Any,
) -> Iterator[None]:
    """Defaults for the decorated tasks called inside the block, as the plugin's
    `wandb_config` (the decorator's own arguments win)."""
    values = {"project": project, "entity": entity, "host": host, "run_mode": run_mode}
    values["rank_scope"] = rank_scope
    context = {f"{CONTEXT_PREFIX}{k}": v for k, v in values.items() if v is not None}
    if init_kwargs:
        context[f"{CONTEXT_PREFIX}init_kwargs"] = json.dumps(init_kwargs)
    with flyte.custom_context(**context):
        yield


def read_context(context: dict[str, str]) -> dict[str, Any]:
    """The `wandb_config` values among a Flyte custom context."""
    found: dict[str, Any] = {}
    for key, value in (context or {}).items():
        if key.startswith(CONTEXT_PREFIX):
            name = key[len(CONTEXT_PREFIX) :]
            found[name] = json.loads(value) if name == "init_kwargs" else value
    return found


def flyte_context() -> dict[str, str]:
    """The custom context of the running Flyte action (empty outside one)."""
    context = flyte.ctx()
    return dict(context.custom_context or {}) if context is not None else {}


def job_id() -> str:
    """`{run_name}-{action_name}` of the running action: the online plugin's run id base."""
    context = flyte.ctx()
    if context is None:
        raise WbmergeError("wbmerge.flyte tasks run inside Flyte (flyte.run or a cluster)")
    return f"{context.action.run_name}-{context.action.name}"


def runs_root(job: str) -> Path:
    """Where this machine keeps the job's offline runs: `$WBMERGE_DIR/{job id}` (default: the
    temp dir). Each node writes into its own `worker-{w}` folder below it."""
    base = os.environ.get(RUNS_DIR_ENV) or Path(tempfile.gettempdir()) / "wbmerge-runs"
    return Path(base) / job


def worker_folder(worker: int) -> str:
    """The name of one node's folder, on its disk and in the hand-off."""
    return f"worker-{worker}"
