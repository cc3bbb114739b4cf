"""The W&B links a wbmerge job shows in the Flyte UI: the online plugin's, from the run mode,
rank scope and number of nodes (a run, a run per node, or the group(s) of `new`)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import flyte

from ..plan import app_url, group_url, run_url
from .context import Settings, read_context


def run_links(
    base: str,
    run_mode: str,
    rank_scope: str,
    num_workers: int,
    host: str,
    entity: str,
    project: str,
) -> list[str]:
    """The online plugin's links: a run, one per worker with rank_scope "worker" on several
    nodes, or the group(s) of `new`."""
    per_worker = rank_scope == "worker" and num_workers > 1
    names = [f"{base}-worker-{i}" for i in range(num_workers)] if per_worker else [base]
    url = group_url if run_mode == "new" else run_url
    return [url(host, entity, project, name) for name in names]


@dataclass
class RunLink(flyte.Link):
    """One W&B link of a wbmerge job, rendered by Flyte from the run and action names (on
    the training task) or from the context `sync` sets (on the merge task)."""

    index: int = 0
    settings: dict = field(default_factory=dict)
    from_context: bool = False
    name: str = "Weights & Biases"
    icon_uri: str = ""

    def get_link(
        self,
        run_name: str,
        project: str,
        domain: str,
        context: dict[str, str],
        parent_action_name: str,
        action_name: str,
        pod_name: str,
        **kwargs: Any,
    ) -> str:
        values = {**self.settings, **read_context(context or {})}
        if self.from_context:
            values.update(
                {
                    k[len("wbmerge_") :]: v
                    for k, v in (context or {}).items()
                    if k.startswith("wbmerge_")
                }
            )
        base = values.get("base") or f"{run_name}-{action_name}"
        links = run_links(
            base,
            values.get("run_mode") or "auto",
            values.get("rank_scope") or "global",
            int(values.get("num_workers") or 1),
            values.get("host") or app_url(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")),
            values.get("entity") or os.environ.get("WANDB_ENTITY", "<entity>"),
            values.get("project") or os.environ.get("WANDB_PROJECT", "<project>"),
        )
        return links[self.index] if self.index < len(links) else links[-1]


def link_count(settings: Settings) -> int:
    worker = (settings.rank_scope or "global") == "worker" and settings.nnodes > 1
    return settings.nnodes if worker else 1


def training_links(settings: Settings, from_context: bool = False) -> tuple[RunLink, ...]:
    values = {
        k: v
        for k, v in asdict(settings).items()
        if k not in ("init_kwargs", "handoff") and v is not None
    }
    values["num_workers"] = settings.nnodes
    count = link_count(settings)
    return tuple(
        RunLink(
            index=i,
            settings=values,
            from_context=from_context,
            name=f"Weights & Biases worker {i}" if count > 1 else "Weights & Biases",
        )
        for i in range(count)
    )
