"""The pages of W&B's app that wbmerge links to: a run's, a group's, and the links a job shows.

The links are the online Flyte plugin's: one per run, or in `new` mode one per group, since
there every rank is a run of its own and the group is the page that shows them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from .targets import Target


def run_url(app_url: str, entity: str, project: str, run_id: str) -> str:
    """A run's page in W&B's app (`app_url` as `app_url()` gives it)."""
    return _page(app_url, entity, project, "runs", run_id)


def group_url(app_url: str, entity: str, project: str, group: str) -> str:
    """A group's page in W&B's app: the link of `new` mode, whose runs share a group."""
    return _page(app_url, entity, project, "groups", group)


def _page(app_url: str, *parts: str) -> str:
    """A page's URL, each name in it quoted (a project `a b` is `a%20b` there)."""
    return "/".join([app_url.rstrip("/"), *(quote(part, safe="") for part in parts)])


def links(
    targets: Sequence[Target], app_url: str, entity: str, project: str, run_mode: str
) -> list[dict]:
    """The links the online plugin shows: runs, or for `new` one per group."""
    if run_mode == "new":
        groups = dict.fromkeys(t.group for t in targets if t.group)
        return [
            {"kind": "group", "name": g, "url": group_url(app_url, entity, project, g)}
            for g in groups
        ]
    return [
        {"kind": "run", "name": t.id, "url": run_url(app_url, entity, project, t.id)}
        for t in targets
    ]


def app_url(base_url: str) -> str:
    """W&B's app host for an API host (api.wandb.ai -> wandb.ai); others are the same."""
    url = base_url.rstrip("/")
    return url.replace("://api.wandb.ai", "://wandb.ai")
