"""The targets of a job (pure): run_mode x rank_scope x its ranks -> the W&B runs to create.

Exactly the table of the online Flyte plugin (the README's run-mode table), so offline and
online jobs line up. Nothing here reads files; `Source` carries what discovery found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from ..errors import WbmergeError
from ..training import RankInfo
from .wandbnames import name_problem, run_id_problem

RunMode = Literal["auto", "shared", "new"]
RankScope = Literal["global", "worker"]
RUN_MODES: tuple[RunMode, ...] = get_args(RunMode)
RANK_SCOPES: tuple[RankScope, ...] = get_args(RankScope)


def run_id_from_file(path: Path) -> str:
    """The run id a `.wandb` file's name carries: `run-<id>.wandb` -> `<id>`."""
    stem = path.name.removesuffix(".wandb")
    return stem.removeprefix("run-")


@dataclass(frozen=True)
class Source:
    """One offline run of one rank (one restart of it)."""

    path: Path  # the .wandb file
    rank: RankInfo
    label: str
    complete: bool = True  # an exit record was seen (known after a scan)
    start_time: float = 0.0  # the run record's, as discovery read it

    @property
    def restart(self) -> int:
        return self.rank.restart

    @property
    def run_id(self) -> str:
        """The id of the offline run this source is (from its file name, as wandb names it)."""
        return run_id_from_file(self.path)


@dataclass(frozen=True)
class Target:
    """One W&B run to create, and the offline runs it is made of."""

    id: str
    group: str | None
    display_name: str
    job_type: str | None
    primary_rank: int
    # "passthrough" (one rank as is), "shared" (ranks merged), "auto+system", "merged"
    # (a run a merge wrote already, uploaded unchanged) or "as-logged" (one offline run under
    # its own id and names, as plain `wandb sync` uploads it)
    kind: str
    sources: tuple[Source, ...]  # ordered by rank, then restart
    worker: int | None = None
    extra_system_sources: tuple[Source, ...] = field(default=())  # auto --system-metrics all

    @property
    def labels(self) -> dict[int, str]:
        return {s.rank.rank: s.label for s in (*self.sources, *self.extra_system_sources)}

    def as_json(self) -> dict:
        return {
            "id": self.id,
            "group": self.group,
            "job_type": self.job_type,
            "display_name": self.display_name,
            "primary_rank": self.primary_rank,
            "kind": self.kind,
            "sources": [
                {
                    "path": str(s.path.parent),
                    "rank": s.rank.rank,
                    "label": s.label,
                    "restart": s.restart,
                }
                for s in self.sources
            ],
            "system_metrics_from": [
                {"path": str(s.path.parent), "rank": s.rank.rank, "label": s.label}
                for s in self.extra_system_sources
            ],
        }


def check_run_id(run_id: str) -> str:
    """Raise WbmergeError unless W&B accepts `run_id` as a run id."""
    problem = run_id_problem(run_id)
    if problem:
        hint = " (choose another --base-id)" if run_id.strip() else ""
        raise WbmergeError(f"invalid run id {run_id!r}: {problem}{hint}")
    return run_id


def check_destination(project: str | None, entity: str | None) -> None:
    """Raise WbmergeError (before any upload) for a missing project, or a project or entity
    name W&B refuses: else every run of it fails only after its upload, unexplained."""
    if not project:
        raise WbmergeError("no project: pass --project or set WANDB_PROJECT")
    for kind, name in (("project", project), ("entity", entity)):
        problem = name_problem(kind, name) if name is not None else None
        if problem:
            shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}..."
            raise WbmergeError(f"invalid {kind} {shown}: {problem}")


def plan(
    sources: Sequence[Source],
    run_mode: str = "auto",
    rank_scope: str = "global",
    base_id: str | None = None,
    system_metrics: str = "primary",
    job_type: str | None = None,
) -> list[Target]:
    """The targets of one job. `sources` are all its offline runs (any order)."""
    if run_mode not in RUN_MODES:
        raise WbmergeError(f"run mode must be one of {', '.join(RUN_MODES)}, not {run_mode!r}")
    if rank_scope not in RANK_SCOPES:
        raise WbmergeError(f"rank scope must be one of {', '.join(RANK_SCOPES)}")
    if not sources:
        raise WbmergeError("no offline runs to plan")
    ordered = tuple(sorted(sources, key=lambda s: (s.rank.rank, s.restart)))
    first = ordered[0].rank
    base = check_run_id(base_id or first.job_id or "")
    multi_node = first.multi_node
    per_worker = rank_scope == "worker" and multi_node

    targets: list[Target] = []
    if run_mode in ("auto", "shared"):
        workers = sorted({s.rank.worker for s in ordered}) if per_worker else [None]
        for worker in workers:
            in_scope = tuple(s for s in ordered if worker is None or s.rank.worker == worker)
            primary = _primary(in_scope, worker)
            run_id = base if worker is None else f"{base}-worker-{worker}"
            if run_mode == "shared":
                chosen, kind, extra = in_scope, "shared", ()
            else:
                chosen = tuple(s for s in in_scope if s.rank.rank == primary)
                extra = ()
                if system_metrics == "all":
                    extra = tuple(s for s in in_scope if s.rank.rank != primary)
                kind = "auto+system" if extra else "passthrough"
            if not any(s.rank.rank == primary for s in chosen):
                raise WbmergeError(
                    f"{run_id}: the primary rank {primary} has no offline run; its config, "
                    "summary and exit code decide the run (merge the others with --run-mode new)"
                )
            targets.append(_target(run_id, None, job_type, primary, kind, chosen, worker, extra))
        return targets

    # new: every rank its own run
    by_rank: dict[int, list[Source]] = {}
    for source in ordered:
        by_rank.setdefault(source.rank.rank, []).append(source)
    for rank, sources in sorted(by_rank.items()):
        chosen, info = tuple(sources), sources[0].rank
        if per_worker:
            run_id, group = (
                f"{base}-worker-{info.worker}-rank-{info.local_rank}",
                f"{base}-worker-{info.worker}",
            )
        else:
            run_id, group = f"{base}-rank-{rank}", base
        worker = info.worker if per_worker else None
        targets.append(_target(run_id, group, job_type, rank, "passthrough", chosen, worker))
    return targets


def _target(
    run_id: str,
    group: str | None,
    job_type: str | None,
    primary: int,
    kind: str,
    sources: tuple[Source, ...],
    worker: int | None,
    extra: tuple[Source, ...] = (),
) -> Target:
    """A checked target; its display name is its id, as the plugin's runs are named."""
    return Target(
        id=check_run_id(run_id),
        group=group,
        display_name=run_id,
        job_type=job_type,
        primary_rank=primary,
        kind=kind,
        sources=sources,
        worker=worker,
        extra_system_sources=extra,
    )


def _primary(sources: Sequence[Source], worker: int | None) -> int:
    """Global rank 0, or local rank 0 of the worker (plugin rule)."""
    if worker is None:
        return 0
    for s in sources:
        if s.rank.local_rank == 0:
            return s.rank.rank
    return sources[0].rank.worker * sources[0].rank.local_world_size


def as_logged(source: Source, run_id: str, group: str, display_name: str, job_type: str) -> Target:
    """One offline run as plain `wandb sync` uploads it: under its own run id, group, name
    and job type (an empty one is left as the run has it)."""
    return Target(
        id=check_run_id(run_id),
        group=group or None,
        display_name=display_name,
        job_type=job_type or None,
        primary_rank=source.rank.rank,
        kind="as-logged",
        sources=(source,),
    )
