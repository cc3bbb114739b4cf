"""Which runs make one job, and which rank each run is (pure: no files are read here).

Discovery reads what each run says about itself into a `RunFacts`; `identify` turns the
facts of all runs found into an `Identity` (rank, topology, job id, label, and where the
rank came from) per run, or a `Notice` that names the runs and the option that resolves it.

The rules, most explicit first:

1. A run's rank comes from `--ranks FILE` (`given`), its `wbmerge` config block, the user's
   `--label-pattern` on its label or name, the `SLURM_*` variables of its `srun` task
   (`slurm`), the `--local_rank` its launcher passed (`args`), its config keys (`rank`,
   `local_rank`, `world_size`, ...), its `x_label` in a common spelling of `rankclaims`,
   its display name likewise, the one GPU its process used (`gpu`); and when no run of a
   job says anything, from the order the runs started in (`order`). Some of these can
   mislead: a `rank` in config may be a LoRA rank, SLURM's task id repeats on every worker
   that one task's torchrun starts, every process may touch GPU 0. So when a job's claims
   do not make one topology, it is read again without config, then also without SLURM,
   then also without the launcher's argument, then also without the GPU. Evidence a run
   gives beside the one used that names another rank is a warning that names the runs.
   Numbering by start order is a guess: `--primary RUN_ID` names a job's rank 0 and the
   rest follow by start, and a job whose rank 0 is still a guess is marked (`guessed`),
   so that the modes that upload rank 0's run alone or take its config can refuse it.
2. Runs with a `wbmerge` block belong to the job its `job_id` names. The others are told
   apart by what they share: the same group (and project), or, without a group, the same
   project and the same spelling of their labels (or names), and for runs that say nothing
   of their rank, the same config; in every case only runs that overlap in time are one
   job. Two groups are two jobs, whatever their directory. A `--ranks FILE` names every
   run of such a job or none of them; the runs it leaves out of a job it names in part
   are a problem (else the job would be cut in two, and both halves uploaded).
3. Where the claims put each run of a job (global or local rank, node) is `placement`'s
   rule. A name before the rank that all runs share (`ddp_rank0`) is a prefix, not a
   node.
4. A job without a `wbmerge` block takes the offline id of its rank-0 run as its job id.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..training import RankInfo, validate
from . import rankclaims
from .placement import Place, Unresolved, place_ranks
from .rankclaims import Claim


@dataclass(frozen=True)
class RunFacts:
    """What one run says about itself, as discovery read it."""

    run_id: str
    project: str = ""
    group: str = ""
    job_type: str = ""
    start: float = 0.0
    end: float = 0.0  # the latest time the run's records show (its start when unknown)
    host: str = ""
    label: str | None = None  # x_label, as written
    name: str = ""  # display name
    config: Mapping[str, object] = field(default_factory=dict)  # config keys that may say a rank
    settings: Mapping[str, str] = field(default_factory=dict)  # the rest of its config, as JSON
    metadata: RankInfo | None = None  # from the `wbmerge` block, with its job id
    metadata_label: str | None = None
    where: str = ""  # how to name the run to the user (its directory)
    args: tuple[str, ...] = ()  # its command line, as wandb recorded it
    slurm: Mapping[str, str] = field(default_factory=dict)  # SLURM_* (lower case, no prefix)
    process_gpus: tuple[int, ...] = ()  # the GPUs its own process used

    def describe(self) -> str:
        """`abc123 (label 'rank_2', name 'rank-2', wandb/offline-run-...)`."""
        parts = [f"label {self.label!r}" if self.label else "no label"]
        if self.name:
            parts.append(f"name {self.name!r}")
        if self.where:
            parts.append(self.where)
        return f"{self.run_id} ({', '.join(parts)})"


@dataclass(frozen=True)
class GivenRank:
    """One row of `--ranks FILE`."""

    rank: int
    local_rank: int | None = None
    worker: int | None = None
    restart: int = 0
    job: str | None = None


@dataclass(frozen=True)
class Hints:
    """What the user says about ranks: a label pattern, and ranks given outright."""

    label_pattern: re.Pattern[str] | None = None
    given: Mapping[str, GivenRank] = field(default_factory=dict)
    primary: frozenset[str] = frozenset()  # run ids named rank 0 of their start-order job


@dataclass(frozen=True)
class Identity:
    rank: RankInfo  # with the job id
    source: str  # one of rankclaims.SOURCES
    label: str
    guessed: bool = False  # the job's rank 0 is only the run that started first


@dataclass(frozen=True)
class Notice:
    """One line about some runs: why they cannot be identified, or a warning."""

    runs: tuple[int, ...]
    message: str


@dataclass
class Identification:
    identities: dict[int, Identity] = field(default_factory=dict)
    problems: list[Notice] = field(default_factory=list)  # these runs stay unidentified
    warnings: list[Notice] = field(default_factory=list)  # shown once per job
    notes: list[str] = field(default_factory=list)  # about all runs: shown once


def identify(runs: Sequence[RunFacts], hints: Hints | None = None) -> Identification:
    """Identities for `runs` (indexed as given), problems, and warnings to show once."""
    hints = hints or Hints()
    result = Identification()
    candidates = {i: claims_of(run, hints) for i, run in enumerate(runs)}
    refused = _refuse_jobs_named_in_part(runs, hints, result) if hints.given else set()
    for i, run in enumerate(runs):
        if i in refused:
            continue
        if run.metadata is not None and candidates[i][0].source == "wbmerge":
            label = run.metadata_label or run.label or run.metadata.label
            result.identities[i] = Identity(run.metadata, "wbmerge", label)
    rest = [i for i in range(len(runs)) if i not in result.identities and i not in refused]
    first = {i: candidates[i][0] for i in rest}
    pattern_given = hints.label_pattern is not None
    for job_id, members in split_jobs(runs, first, rest, hints):
        _identify_job(runs, candidates, members, result, pattern_given, job_id, hints)
    if hints.label_pattern is not None:
        note = _unused_pattern_note(runs, candidates, hints)
        if note:
            result.notes.append(note)
    return result


def _unused_pattern_note(
    runs: Sequence[RunFacts], candidates: Mapping[int, list[Claim]], hints: Hints
) -> str | None:
    """A line when `--label-pattern` read no run's rank (a typo, most likely): the pattern
    is tried only on runs that neither `--ranks` names nor a `wbmerge` block identifies."""
    tried = [
        i for i, run in enumerate(runs) if run.run_id not in hints.given and run.metadata is None
    ]
    if not tried:
        return "--label-pattern is unused: every run has a wbmerge block or a --ranks entry"
    if rankclaims.read_by_pattern(c for i in tried for c in candidates[i]):
        return None
    return (
        f"--label-pattern matched the label or name of none of the {len(tried)} run(s) it "
        "was tried on; their ranks were read as if it were not given"
    )


def claims_of(run: RunFacts, hints: Hints) -> list[Claim]:
    """What `run` says about its rank, most explicit first; the last is `order`."""
    given = hints.given.get(run.run_id)
    if given is not None:
        return [
            Claim(
                "given",
                rank=given.rank,
                local_rank=given.local_rank,
                node=given.worker,
                restart=given.restart,
            )
        ]
    if run.metadata is not None:
        return [Claim("wbmerge", rank=run.metadata.rank)]
    found: list[Claim | None] = []
    texts = ((run.label, "label"), (run.name, "name"))
    if hints.label_pattern is not None:
        found += [
            rankclaims.parse_with_pattern(text, hints.label_pattern, source)
            for text, source in texts
            if text
        ]
    slurm = rankclaims.slurm_claim(run.slurm)
    launcher = rankclaims.launcher_claim(run.args)
    if launcher is not None and slurm is not None:
        # One srun task per node that starts a launcher: the task's procid repeats on every
        # worker of the node (so the SLURM claim gives way), but its node id still orders
        # the nodes, which the launcher's local rank alone cannot.
        launcher = replace(launcher, node=slurm.node)
    found += [slurm, launcher]
    found.append(rankclaims.config_claim(run.config))
    found += [rankclaims.parse_spelling(text, source) for text, source in texts if text]
    found.append(rankclaims.gpu_claim(run.process_gpus))
    return [claim for claim in found if claim is not None] + [Claim("order")]


def split_jobs(
    runs: Sequence[RunFacts],
    claims: Mapping[int, Claim],
    members: Sequence[int],
    hints: Hints | None = None,
) -> list[tuple[str | None, list[int]]]:
    """The runs of `members` (without a wbmerge job id) grouped into jobs (rule 2), each
    with the job id the user gave it, if any.

    Runs given in `--ranks FILE` form one job per value of its `job` column (that value is
    the job's id), whenever they ran.
    """
    given = hints.given if hints else {}
    buckets: dict[tuple, list[int]] = defaultdict(list)
    chosen: dict[str | None, list[int]] = defaultdict(list)
    for i in members:
        run, claim = runs[i], claims[i]
        if claim.source == "given":
            chosen[given[run.run_id].job].append(i)
        elif run.group:
            buckets[("group", run.project, run.group)].append(i)
        elif claim.source == "order":
            # Runs that say nothing of their rank are one job only if configured alike:
            # two experiments started side by side differ in their hyperparameters.
            buckets[("order", run.project, tuple(sorted(run.settings.items())))].append(i)
        else:
            buckets[("family", run.project, claim.source, claim.form)].append(i)
    jobs: list[tuple[str | None, list[int]]] = [(job, found) for job, found in chosen.items()]
    for found in buckets.values():
        jobs.extend((None, job) for job in overlapping(runs, found))
    return jobs


def _refuse_jobs_named_in_part(
    runs: Sequence[RunFacts], hints: Hints, out: Identification
) -> set[int]:
    """The runs a `--ranks` file leaves out of a job it names in part, each a problem.

    Such a file would cut one job in two: the named runs would be one job and the others
    another (ranked by their `wbmerge` block, or by start order), and both would be
    uploaded. So the runs that would be one job without the file must be named all or
    none. Those jobs are found as without the file: runs with a `wbmerge` block by its job
    id, the others by `split_jobs`.
    """
    plain = Hints(label_pattern=hints.label_pattern)
    by_block: dict[str | None, list[int]] = defaultdict(list)
    others = []
    for i, run in enumerate(runs):
        if run.metadata is not None:
            by_block[run.metadata.job_id].append(i)
        else:
            others.append(i)
    first = {i: claims_of(runs[i], plain)[0] for i in others}
    natural = [*by_block.values(), *(m for _, m in split_jobs(runs, first, others, plain))]
    refused: set[int] = set()
    for members in natural:
        named = [runs[i].run_id for i in members if runs[i].run_id in hints.given]
        unnamed = [i for i in members if runs[i].run_id not in hints.given]
        if named and unnamed:
            left_out = few([runs[i].run_id for i in unnamed])
            message = (
                f"--ranks names run(s) {few(named)} but not {left_out} of the same job; "
                "name every run of the job in the file (or pass --job with the named runs' "
                "job id, which `wbmerge inspect --ranks FILE` shows, to merge only them)"
            )
            out.problems.append(Notice(tuple(unnamed), message))
            refused.update(unnamed)
    return refused


def few(items: Sequence[object], shown: int = 4) -> str:
    """`a, b, c, d and 12 more`: a list short enough for one line at 1024 ranks."""
    head = ", ".join(map(str, items[:shown]))
    return head if len(items) <= shown else f"{head} and {len(items) - shown} more"


def overlapping(runs: Sequence[RunFacts], members: Sequence[int]) -> list[list[int]]:
    """`members` cut where no run is alive: runs that overlap in time, directly or through
    others, are one job. E.g. runs alive at [0, 10], [1, 9], [12, 20] give two jobs."""
    ordered = sorted(members, key=lambda i: (runs[i].start, runs[i].run_id))
    jobs: list[list[int]] = []
    alive_until = None
    for i in ordered:
        run = runs[i]
        if alive_until is None or run.start > alive_until:
            jobs.append([])
            alive_until = run.start
        jobs[-1].append(i)
        alive_until = max(alive_until, run.end, run.start)
    return jobs


def _identify_job(
    runs: Sequence[RunFacts],
    candidates: Mapping[int, list[Claim]],
    members: list[int],
    out: Identification,
    pattern_given: bool,
    job_id: str | None = None,
    hints: Hints | None = None,
) -> None:
    """Identify one job's runs from their most explicit claims, or, when those contradict
    each other, from what the runs say besides (the doubtful sources left out in turn)."""
    candidates = rankclaims.gpus_in_order(
        {i: candidates[i] for i in members},
        {i: runs[i].host for i in members},
        [i for i in members if rankclaims.states_a_size(runs[i].config)],
    )
    claims = {i: candidates[i][0] for i in members}
    failure = _try_job(runs, claims, members, out, pattern_given, job_id, hints)
    tried = [claims]
    for doubtful in _DOUBTFUL:
        if failure is None:
            break
        weaker = {i: next(c for c in candidates[i] if c.source not in doubtful) for i in members}
        if weaker in tried:
            continue
        tried.append(weaker)
        if _try_job(runs, weaker, members, out, pattern_given, job_id, hints) is None:
            failure = None
    if failure:
        out.problems.append(Notice(tuple(members), failure))
        return
    _note_disagreements(runs, candidates, members, out)


# The sources a job is read again without when its claims do not make one topology, one
# set after the other (see rule 1): config keys first, then what the launcher recorded.
_DOUBTFUL = (
    {"config"},
    {"config", "slurm"},
    {"config", "slurm", "args"},
    {"config", "slurm", "args", "gpu"},
)
# The sources whose numbers are compared with the rank used, for the warning of evidence
# that disagrees (a label's bare number may be a local or a global rank: not compared).
_COMPARED = ("slurm", "args", "config", "gpu", "given")


def _note_disagreements(
    runs: Sequence[RunFacts],
    candidates: Mapping[int, list[Claim]],
    members: Sequence[int],
    out: Identification,
) -> None:
    """A warning naming the runs of a job whose other evidence names another rank than the
    one used, e.g. a `--local_rank=1` beside a label that says rank 2."""
    found = []
    for i in members:
        identity = out.identities.get(i)
        if identity is None or identity.source == "order":
            continue
        for claim in candidates[i]:
            if claim.source == identity.source or claim.source not in _COMPARED:
                continue
            said = _disagreement(claim, identity.rank)
            if said:
                found.append(
                    f"{runs[i].run_id} is rank {identity.rank.rank} by its {identity.source}, "
                    f"but its {claim.source} says {said}"
                )
    if found:
        job_id = out.identities[members[0]].rank.job_id
        shown = "; ".join(found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4 else "")
        out.warnings.append(Notice(tuple(members), f"job {job_id}: evidence disagrees: {shown}"))


def _disagreement(claim: Claim, rank: RankInfo) -> str | None:
    """What `claim` says that `rank` contradicts, or None."""
    if claim.rank is not None and claim.rank != rank.rank:
        return f"rank {claim.rank}"
    if claim.local_rank is not None and claim.local_rank != rank.local_rank:
        return f"local rank {claim.local_rank}"
    return None


def _try_job(
    runs: Sequence[RunFacts],
    claims: Mapping[int, Claim],
    members: list[int],
    out: Identification,
    pattern_given: bool,
    job_id: str | None,
    hints: Hints | None = None,
) -> str | None:
    """Identify the job from these claims into `out`; the reason why not, `out` untouched."""
    hint = rankclaims.resolve_hint(pattern_given, claims.values())
    saying = [i for i in members if claims[i].says_rank]
    silent = [i for i in members if not claims[i].says_rank]
    if len(members) == 1 and claims[members[0]].source == "name":
        saying, silent = [], members  # a lone run's name is no evidence of other ranks
    if not saying:
        return _number_by_order(runs, members, out, hint, hints.primary if hints else frozenset())
    if silent:
        names = ", ".join(runs[i].describe() for i in silent)
        return (
            f"{names}: say(s) no rank while {len(saying)} other run(s) of the same job do; {hint}"
        )
    try:
        places = place_ranks(runs, claims, members)
        _settle(runs, claims, members, places, out, job_id)
    except Unresolved as exc:
        if all(claims[i].source == "given" for i in members):  # (the user's file says so)
            return f"{exc}; the --ranks file says so: correct it"
        return f"{exc}; {hint}"
    return None


def _settle(
    runs: Sequence[RunFacts],
    claims: Mapping[int, Claim],
    members: list[int],
    places: Mapping[int, Place],
    out: Identification,
    job_id: str | None = None,
) -> None:
    """Identities from places: the job id is rank 0's run id unless given, labels kept as
    written."""
    first = min(
        members, key=lambda i: (places[i].rank, claims[i].restart, runs[i].start, runs[i].run_id)
    )
    job_id = job_id or runs[first].run_id
    infos = {}
    for i in members:
        p = places[i]
        restart = claims[i].restart
        info = RankInfo(
            p.rank, p.local_rank, p.world_size, p.local_world_size, p.worker, restart, job_id
        )
        try:
            validate(info)
        except ValueError as exc:
            raise Unresolved(f"{runs[i].describe()}: {exc}") from None
        infos[i] = info
    labels = {i: runs[i].label or infos[i].label for i in members}
    if _shared_label(labels, {i: infos[i].rank for i in members}):
        out.warnings.append(
            Notice(
                tuple(members),
                f"job {job_id}: runs of different ranks share a label; "
                "labelled rank-N / worker-W-rank-L instead",
            )
        )
        labels = {i: infos[i].label for i in members}
    gpu_order = [i for i in members if claims[i].form == "gpu-order"]
    guessed = any(places[i].worker_guessed for i in members) or bool(gpu_order)
    for i in members:
        out.identities[i] = Identity(infos[i], claims[i].source, labels[i], guessed)
    if gpu_order:
        read = ", ".join(
            f"{runs[i].run_id} on GPU {min(runs[i].process_gpus)} as local rank {infos[i].local_rank}"
            for i in sorted(gpu_order, key=lambda i: infos[i].rank)
        )
        out.warnings.append(
            Notice(
                tuple(members),
                f"job {job_id}: its ranks are read from the order of the GPUs its runs used "
                f"({read}), which holds only if no rank's run is missing",
            )
        )
    if guessed:
        order = ", ".join(
            f"worker {infos[i].worker}={runs[i].host or runs[i].describe()}"
            for i in sorted(members, key=lambda i: infos[i].rank)
            if infos[i].local_rank == 0
        )
        out.warnings.append(
            Notice(
                tuple(members),
                f"job {job_id}: its runs give local ranks only, so which host is worker 0 "
                f"(and so rank 0) is a guess: hosts taken in name order ({order})",
            )
        )
    _warn_of_differing_config(runs, members, job_id, out)


def _number_by_order(
    runs: Sequence[RunFacts],
    members: list[int],
    out: Identification,
    hint: str,
    primary: frozenset[str] = frozenset(),
) -> str | None:
    """Rule 1's last resort: the run the user named `--primary`, else the run whose job type
    is `main`, is rank 0; the others follow in start order. Without either, rank 0 is the
    run that started first: a guess, marked so that auto and shared mode can refuse it.
    Returns why the job cannot be numbered (two primaries), else None."""
    named = [i for i in members if runs[i].run_id in primary]
    if len(named) > 1:
        return (
            f"--primary names {few([runs[i].run_id for i in named])}, runs of one job; "
            "name one rank 0 per job"
        )
    mains = [i for i in members if runs[i].job_type == "main"]
    ordered = sorted(
        members,
        key=lambda i: (i not in named, runs[i].job_type != "main", runs[i].start, runs[i].run_id),
    )
    world = len(ordered)
    guessed = world > 1 and not named and len(mains) != 1
    job_id = runs[ordered[0]].run_id
    labels = {i: runs[i].label or runs[i].name or runs[i].run_id for i in ordered}
    if _shared_label(labels, {i: rank for rank, i in enumerate(ordered)}):
        labels = {i: runs[i].run_id for i in ordered}  # offline run ids are unique
    for rank, i in enumerate(ordered):
        info = RankInfo(rank, rank, world, world, 0, 0, job_id)
        source = "given" if i in named else "order"
        out.identities[i] = Identity(info, source, labels[i], guessed)
    if world > 1:
        order = ", ".join(f"{rank}={runs[i].run_id}" for rank, i in enumerate(ordered))
        first = "the --primary run" if named else "the run of job type main" if not guessed else ""
        assumed = f"{first} is rank 0 and the rest follow" if first else "ranks were assumed from"
        out.warnings.append(
            Notice(
                tuple(members),
                f"job {job_id}: no run says its rank, so {assumed} start order (rank=run: "
                f"{order}); {hint}",
            )
        )
    _warn_of_differing_config(runs, members, job_id, out)
    return None


def _shared_label(labels: Mapping[int, str], ranks: Mapping[int, int]) -> bool:
    """True when two runs of different ranks have one label (restarts of a rank may)."""
    owner: dict[str, int] = {}
    for i, label in labels.items():
        if owner.setdefault(label, ranks[i]) != ranks[i]:
            return True
    return False


# Words that name a setting each process of one job holds its own value of: its seed, its
# data shard, its device or host. A key whose name holds one (`seed`, `data_shard`,
# `shardSeed`, `device`) may differ from rank to rank in one job.
_PER_PROCESS_WORDS = frozenset(
    {
        "seed",
        "shard",
        "rank",
        "device",
        "gpu",
        "cuda",
        "host",
        "hostname",
        "node",
        "worker",
        "pid",
        "port",
        "process",
    }
)
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def is_per_process(key: str) -> bool:
    """Whether a config key's name says each process holds its own value of it: one of its
    words (split at `_`, `/`, `.`, `-` and camelCase; a plural as its singular) is a seed,
    a shard, a rank, a device, a host and the like."""
    words = (word.lower() for word in _WORDS.findall(key))
    return any(
        word in _PER_PROCESS_WORDS or word.removesuffix("s") in _PER_PROCESS_WORDS for word in words
    )


def _warn_of_differing_config(
    runs: Sequence[RunFacts], members: Sequence[int], job_id: str, out: Identification
) -> None:
    """Ranks of one job share their hyperparameters; runs that do not may be two
    experiments taken for one job (for example two jobs that reused one group name). What
    each rank of one job holds its own of (a seed, a data shard, a device: `is_per_process`)
    says nothing of that, nor do wandb's own `_wandb` entries (discovery leaves them out)."""
    keys = {key for i in members for key in runs[i].settings if not is_per_process(key)}
    distinct = {k: len({runs[i].settings.get(k) for i in members}) for k in keys}
    differing = sorted(k for k, count in distinct.items() if count > 1)
    if differing:
        shown = ", ".join(differing[:5]) + (", ..." if len(differing) > 5 else "")
        # Which run holds which value, for the key that splits the runs most coarsely (a
        # seed or a device differs per rank; a learning rate per experiment): what a
        # --ranks file's job column needs.
        key = min(differing, key=lambda k: (distinct[k], k))
        values: dict[str | None, list[str]] = defaultdict(list)
        for i in members:
            values[runs[i].settings.get(key)].append(runs[i].run_id)
        who = "; ".join(
            f"{'(missing)' if value is None else _short(value)}: {few(ids)}"
            for value, ids in list(values.items())[:4]
        )
        if len(values) > 4:
            who += f"; and {len(values) - 4} more values"
        out.warnings.append(
            Notice(
                tuple(members),
                f"job {job_id}: its runs differ in config ({shown}; {key} = {who}); "
                "if they are separate experiments, split them with --ranks FILE (its job "
                "column)",
            )
        )


def _short(value_json: str, limit: int = 40) -> str:
    """A config value's JSON, cut to `limit` characters for one line."""
    return value_json if len(value_json) <= limit else value_json[: limit - 3] + "..."
