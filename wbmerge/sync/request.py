"""What the user asked a merge or sync for (`MergeRequest`), and the checks of its options
that need no run: the options a run mode ignores, and those that do not apply to runs
merged already. (A key format is checked where it is used: `merge.check_key_format`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal, TypedDict

from ..errors import WbmergeError
from ..merge import DEFAULT_KEY_FORMAT
from ..plan import RankScope, RunMode

SystemMetrics = Literal["primary", "all"]
Verify = Literal["sample", "full"]


@dataclass
class MergeRequest:
    """What the user asked for; None means "as recorded by the job, else the default"."""

    paths: Sequence[str | Path]
    run_mode: RunMode | None = None
    rank_scope: RankScope | None = None
    base_id: str | None = None
    job: str | None = None
    allow_missing_ranks: bool = False
    system_metrics: SystemMetrics = "primary"
    key_format: str = DEFAULT_KEY_FORMAT
    project: str | None = None
    entity: str | None = None
    job_type: str | None = None
    skew_metrics: bool = False
    rank_stats: bool = False  # shared mode: min/median/max/mean across ranks per step
    per_rank: Sequence[str] | None = None  # shared mode: "all", "none" or keys/globs
    label_pattern: str | None = None  # how the runs spell their rank, e.g. "rank_{rank}"
    ranks_file: str | Path | None = None  # run id -> rank, JSON or CSV
    primary: Sequence[str] = ()  # run ids: rank 0 of jobs whose runs say nothing of ranks
    rank_order: Literal["start"] | None = None  # accept a rank 0 that only started first
    files_from: Sequence[str | Path] = ()  # directories saved files may be read from too
    verify: Verify = "sample"  # "full": compare every row's values read back, not a sample
    unknown_records: Literal["refuse", "copy"] = "refuse"  # "copy": kinds unknown to wbmerge
    # sync: send runs the server holds rows of whole again, over those rows (not only the rest)
    resend: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("rank_order", (None, "start")), ("verify", ("sample", "full")),
                              ("unknown_records", ("refuse", "copy"))):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise WbmergeError(f"{name} takes {' or '.join(map(repr, allowed))}, not "
                                   f"{getattr(self, name)!r}")  # fmt: skip
        if self.base_id is not None and not self.base_id.strip():
            # (an empty one is not "no --base-id": the docs and every command refuse it)
            raise WbmergeError(
                "--base-id is empty: give the run id to upload under, or leave the option out "
                "to use the job's id"
            )


class RequestOptions(TypedDict, total=False):
    """The keywords `api.plan`, `api.merge`, `api.sync` and `api.follow` take: the fields of
    `MergeRequest` but `paths`, each typed, so that a type checker names a misspelt option
    or a run mode that does not exist."""

    run_mode: RunMode | None
    rank_scope: RankScope | None
    base_id: str | None
    job: str | None
    allow_missing_ranks: bool
    system_metrics: SystemMetrics
    key_format: str
    project: str | None
    entity: str | None
    job_type: str | None
    skew_metrics: bool
    rank_stats: bool
    per_rank: Sequence[str] | None
    label_pattern: str | None
    ranks_file: str | Path | None
    primary: Sequence[str]
    rank_order: Literal["start"] | None
    files_from: Sequence[str | Path]
    verify: Verify
    unknown_records: Literal["refuse", "copy"]
    resend: bool


def option_names() -> set[str]:
    """The options a `MergeRequest` takes by keyword (all its fields but `paths`)."""
    return {f.name for f in fields(MergeRequest)} - {"paths"}


def ignored_options(request: MergeRequest, run_modes: set[str]) -> list[str]:
    """The options the request gives that none of `run_modes` uses, as a line each (said as
    warnings: a user who asks for statistics in `new` mode should hear that none come)."""
    shared_only = shared_only_given(request)
    modes = "/".join(sorted(run_modes))
    lines = []
    if shared_only and run_modes and "shared" not in run_modes:
        verb = "applies" if len(shared_only) == 1 else "apply"
        names = ", ".join(shared_only)
        lines.append(f"{names} {verb} to shared runs only; ignored for --run-mode {modes}")
    if request.system_metrics == "all" and run_modes == {"new"}:
        lines.append(
            "--system-metrics all applies to auto and shared runs (a run of its own keeps each "
            "rank's); ignored for --run-mode new"
        )
    return lines


def merge_options_given(request: MergeRequest) -> list[str]:
    """The options `request` gives that shape a merge, as the CLI spells them: none of them
    applies to runs merged already."""
    given = [
        ("--run-mode", request.run_mode),
        ("--rank-scope", request.rank_scope),
        ("--base-id", request.base_id),
        ("--allow-missing-ranks", request.allow_missing_ranks),
        ("--system-metrics", request.system_metrics != "primary"),
        ("--job-type", request.job_type),
        ("--label-pattern", request.label_pattern),
        ("--ranks", request.ranks_file),
        ("--primary", bool(request.primary)),
        ("--rank-order", request.rank_order),
    ]
    return [name for name, value in given if value] + shared_only_given(request)


def shared_only_given(request: MergeRequest) -> list[str]:
    """The options `request` gives that only a shared merge uses."""
    given = [
        ("--rank-stats", request.rank_stats),
        ("--skew-metrics", request.skew_metrics),
        ("--per-rank", bool(request.per_rank)),
        ("--key-format", request.key_format != DEFAULT_KEY_FORMAT),
    ]
    return [name for name, asked in given if asked]
