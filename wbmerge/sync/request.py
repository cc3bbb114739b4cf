"""What the user asked a merge or sync for (`MergeRequest`), and the checks of its options
that need no run: the options a run mode ignores, and those that do not apply to runs
merged already. (A key format is checked where it is used: `merge.check_key_format`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypedDict, Union, get_args, get_origin, get_type_hints

from ..errors import WbmergeError
from ..merge import DEFAULT_KEY_FORMAT
from ..plan import RankScope, RunMode

SystemMetrics = Literal["primary", "all"]
Verify = Literal["sample", "full"]
UnknownRecords = Literal["refuse", "copy"]


@dataclass(frozen=True)
class Spelling:
    """How the command line spells a request field, and which checks it takes part in.

    The CLI builds its options from these (`cli.commands.request_option`), the "given"
    checks below read them, and `tests/sync/test_request.py` fails when the API's keywords
    (`RequestOptions`), the CLI or the ledger's fingerprint drift from them."""

    flags: tuple[str, ...]  # the long flag first: ("--project", "-p")
    help: str
    metavar: str | None = None
    show_default: bool = False
    shapes_merge: bool = False  # part of a merge's shape: refused for runs merged already
    shared_only: bool = False  # only a shared merge uses it: said as ignored otherwise
    fingerprint: bool = False  # a run synced with another value is another upload


def option(flags: str, help: str, default: Any = None, **spelling: Any) -> Any:
    """A `MergeRequest` field with its default and its command-line `Spelling`."""
    return field(
        default=default, metadata={"cli": Spelling(tuple(flags.split()), help, **spelling)}
    )


@dataclass
class MergeRequest:
    """What the user asked for; None means "as recorded by the job, else the default".

    Each field but `paths` is one option, declared once here with its spelling."""

    paths: Sequence[str | Path]
    run_mode: RunMode | None = option(
        "--run-mode",
        "auto: the primary rank only; shared: all ranks in one run; new: a run "
        "per rank. Default: as recorded at training time, else auto.",
        shapes_merge=True,
    )
    rank_scope: RankScope | None = option(
        "--rank-scope",
        "global: one unit; worker: per node (primary = local rank 0). Default: global.",
        shapes_merge=True,
    )
    base_id: str | None = option(
        "--base-id",
        "Run-id base instead of the job id ({base} in the plugin's ids).",
        shapes_merge=True,
    )
    job: str | None = option("--job", "Merge only this job id (several jobs in one directory).")
    allow_missing_ranks: bool = option(
        "--allow-missing-ranks", "Merge although ranks have no run.", False, shapes_merge=True
    )
    system_metrics: SystemMetrics = option(
        "--system-metrics",
        "auto mode: also every other rank's system metrics, labelled.",
        "primary",
        show_default=True,
        shapes_merge=True,
        fingerprint=True,
    )
    rank_stats: bool = option(
        "--rank-stats",
        "shared mode: add {key}/ranks/min, median, max, mean, min_rank, max_rank per step.",
        False,
        shared_only=True,
        fingerprint=True,
    )
    skew_metrics: bool = option(
        "--skew-metrics",
        "shared mode: add wbmerge/spread/{key}, (max-min)/median across ranks per step.",
        False,
        shared_only=True,
        fingerprint=True,
    )
    per_rank: Sequence[str] | None = option(
        "--per-rank",
        "shared mode: which keys keep a series per rank (repeatable; globs like "
        "'train/*'). Default: all, with a warning past 10,000 metrics.",
        metavar="all|none|KEY",
        shared_only=True,
        fingerprint=True,
    )
    key_format: str = option(
        "--key-format",
        "How shared mode labels a rank's metric keys.",
        DEFAULT_KEY_FORMAT,
        show_default=True,
        shared_only=True,
        fingerprint=True,
    )
    project: str | None = option("--project -p", "Default: the runs' project, then WANDB_PROJECT.")
    entity: str | None = option("--entity -e", "Default: WANDB_ENTITY, then the runs' entity.")
    job_type: str | None = option(
        "--job-type",
        "Job type of the runs created. Default: the ranks' own (shared: the "
        "primary's); a run given none keeps the server's.",
        shapes_merge=True,
        fingerprint=True,
    )
    files_from: Sequence[str | Path] = option(
        "--files-from",
        "Also read saved files (wandb.save links) and artifact files under "
        "DIR, and find moved ones there (repeatable). Default: only each rank's run directory "
        "and the directory it ran in.",
        (),
        metavar="DIR",
    )
    unknown_records: UnknownRecords = option(
        "--unknown-records",
        "A record of a kind this wbmerge does not know (a newer wandb's): "
        "refuse the run in one line, or copy it as it is.",
        "refuse",
        show_default=True,
        fingerprint=True,
    )
    label_pattern: str | None = option(
        "--label-pattern",
        "How the runs' labels or names spell the rank, e.g. 'rank_{rank}' "
        "or 'node{worker}-gpu{local_rank}'.",
        shapes_merge=True,
    )
    ranks_file: str | Path | None = option(
        "--ranks",
        "JSON or CSV file of run id -> rank (optional local_rank, worker).",
        shapes_merge=True,
    )
    primary: Sequence[str] = option(
        "--primary",
        "Rank 0 of a job whose runs say nothing of their ranks (the others "
        "follow by start time); one per job, repeatable.",
        (),
        metavar="RUN_ID",
        shapes_merge=True,
    )
    rank_order: Literal["start"] | None = option(
        "--rank-order",
        "Accept the order wbmerge assumed for a job whose runs do not say it "
        "(runs by start time, hosts by name); auto and shared mode refuse such a job "
        "otherwise.",
        shapes_merge=True,
    )
    verify: Verify = option(
        "--verify",
        "After each upload every row is read back and checked present once; "
        "full: compare every row's values too, not a sample of 64.",
        "sample",
        show_default=True,
    )
    resend: bool = option(
        "--resend",
        "Send the runs the server holds rows of whole again, each line over the "
        "one at its place: the way out of a run refused as not a beginning (its sources "
        "changed) or of rows lost inside it.",
        False,
    )

    def __post_init__(self) -> None:
        for name, allowed in choices().items():
            if name not in ("run_mode", "rank_scope") and getattr(self, name) not in allowed:
                shown = " or ".join(map(repr, allowed))
                raise WbmergeError(f"{name} takes {shown}, not {getattr(self, name)!r}")
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
    unknown_records: UnknownRecords
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


def spellings() -> dict[str, Spelling]:
    """Each option's spelling, by field name, in the order the command line lists them."""
    return {f.name: f.metadata["cli"] for f in fields(MergeRequest) if "cli" in f.metadata}


@cache
def choices() -> dict[str, tuple[object, ...]]:
    """The values each option of a `Literal` type takes, by field name (None too, where the
    option may be left to the job)."""
    hints = get_type_hints(MergeRequest)
    found = {}
    for name in spellings():
        literals = [arg for arg in _members(hints[name]) if get_origin(arg) is Literal]
        if literals:
            found[name] = tuple(value for arg in literals for value in get_args(arg))
            found[name] += (None,) if type(None) in _members(hints[name]) else ()
    return found


@dataclass(frozen=True)
class OptionType:
    """What the command line needs of a field's type to parse the option."""

    default: object
    choices: tuple[object, ...] | None  # a Literal's values
    is_flag: bool  # a bool: given or not
    is_sequence: bool  # repeatable
    is_path: bool  # a path on this machine


@cache
def request_fields() -> dict[str, tuple[OptionType, Spelling]]:
    """Each option's type and spelling, by field name, in the order of `spellings`
    (worked out once: the command line asks for it once per option it builds)."""
    hints = get_type_hints(MergeRequest)
    defaults = {f.name: f.default for f in fields(MergeRequest)}
    literal_values = choices()
    found = {}
    for name, spelling in spellings().items():
        members = _members(hints[name])
        sequence = any(get_origin(m) is Sequence for m in members)
        inner = [a for m in members if get_origin(m) is Sequence for a in _members(get_args(m)[0])]
        option_type = OptionType(
            default=defaults[name],
            choices=literal_values.get(name),
            is_flag=hints[name] is bool,
            is_sequence=sequence,
            is_path=Path in members or Path in inner,
        )
        found[name] = (option_type, spelling)
    return found


def _members(hint: object) -> tuple[object, ...]:
    return get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)


def _given(request: MergeRequest, name: str) -> bool:
    """Whether `request` gives option `name` other than as its default: a value that is
    empty (None, False, no items) or the default is not given."""
    value = getattr(request, name)
    default = next(f.default for f in fields(MergeRequest) if f.name == name)
    return bool(value) and value != default


def merge_options_given(request: MergeRequest) -> list[str]:
    """The options `request` gives that shape a merge, as the CLI spells them: none of them
    applies to runs merged already."""
    shaping = [
        s.flags[0] for name, s in spellings().items() if s.shapes_merge and _given(request, name)
    ]
    return shaping + shared_only_given(request)


def shared_only_given(request: MergeRequest) -> list[str]:
    """The options `request` gives that only a shared merge uses."""
    return [
        s.flags[0] for name, s in spellings().items() if s.shared_only and _given(request, name)
    ]
