"""What one run says about its rank, read from its label, its name or its config (pure).

Runs written without wbmerge carry their rank, if at all, the way their authors wrote it:
an `x_label` such as `rank_0` (W&B's shared-mode guide), `rank0` (its UI example),
`rank-0` (the Flyte plugin), a display name `rank-3`, a config `{"rank": 3}`, or a
multi-node form such as `worker-1-rank-0`, `node1_rank0`, `node1-gpu0` or `host-a-rank-3`.
Each function here turns one such text into a `Claim`; `jobs.py` puts the claims of a
job's runs together. A label is never rewritten: it stays what the user sees in W&B.

Every run also records how its process was started (wandb's environment record): the
command line, where `torch.distributed.launch` and DeepSpeed pass `--local_rank=N`; the
`SLURM_*` variables of an `srun` task; and, on a GPU machine, the system metrics name the
GPU the process itself used (`gpu.process.N.*`), which a torchrun job binds to its local
rank. `launcher_claim`, `slurm_claim` and `gpu_claim` read those.

A label's number is deliberately left undecided between a global and a local rank when it
follows a node (`node1_rank0`): only the whole job can tell (see `placement.resolve_numbers`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..training import MAX_RANKS, rank_number, slurm_task

SOURCES = ("wbmerge", "slurm", "args", "config", "label", "name", "gpu", "order", "given")

_SEP = r"[-_. ]?"
_RANK_WORD = r"(?P<word>rank|gpu)"
# `rank3`, `rank_3`, `Rank 3`, `gpu3`: the number is the rank on a single node.
_PLAIN = re.compile(rf"^{_RANK_WORD}{_SEP}(?P<n>\d+)$", re.IGNORECASE)
# `worker-1-rank-0`, `node1_rank0`, `node1-gpu0`: a numbered node, then a rank.
_NUMBERED_NODE = re.compile(
    rf"^(?P<nodeword>worker|node|host|machine){_SEP}(?P<node>\d+){_SEP}{_RANK_WORD}{_SEP}(?P<n>\d+)$",
    re.IGNORECASE,
)
# `host-a-rank-3`, `gpu-node-07_rank1`: a named node (a host name with a letter in it).
_NAMED_NODE = re.compile(
    rf"^(?P<node>[a-z0-9][a-z0-9.-]*?)[-_. ]{_RANK_WORD}{_SEP}(?P<n>\d+)$", re.IGNORECASE
)
_PATTERN_FIELDS = ("rank", "local_rank", "worker")

# Config keys people use for a rank's place, lower-cased; the first key found wins.
CONFIG_KEYS = {
    "rank": ("rank", "global_rank"),
    "local_rank": ("local_rank",),
    "world_size": ("world_size",),
    "local_world_size": ("local_world_size",),
    "node": ("node_rank", "group_rank", "node"),
}


@dataclass(frozen=True)
class Claim:
    """What a run says about its place in a job; None where it says nothing.

    `number` is a label's or name's rank number whose kind (global or local) is not yet
    known; `rank` and `local_rank` are known to be what they say. `node` is a node's
    number (`node1_rank0`) or name (`host-a-rank-3`). `form` is the spelling with the
    numbers and the node name left out (`node{}_rank{}`), so that runs written by one
    job, which spell their labels alike, can be told from another job's.
    """

    source: str
    rank: int | None = None
    local_rank: int | None = None
    number: int | None = None
    node: int | str | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    form: str = ""
    restart: int = 0

    @property
    def says_rank(self) -> bool:
        return self.rank is not None or self.number is not None or self.local_rank is not None


def parse_spelling(text: str, source: str = "label") -> Claim | None:
    """The rank a label or display name spells, or None when it spells none.

    >>> parse_spelling("rank_3").number
    3
    >>> parse_spelling("node1-gpu0").node, parse_spelling("node1-gpu0").number
    (1, 0)
    >>> parse_spelling("worker-a") is None
    True
    """
    text = text.strip()
    match = _PLAIN.match(text)
    if match and (number := rank_number(match["n"])) is not None:
        return Claim(source, number=number, form=_form(text, match, ("n",)))
    match = _NUMBERED_NODE.match(text)
    if match and None not in (
        number := rank_number(match["n"]),
        node := rank_number(match["node"]),
    ):
        form = _form(text, match, ("node", "n"))
        return Claim(source, number=number, node=node, form=form)
    match = _NAMED_NODE.match(text) if source != "name" else None
    # A display name is a weaker sign than a label: `bert-lr0-gpu0` or `llama-7b-gpu8`
    # names an experiment, not a node, so names are read only in the plain spellings.
    if match and _is_node_name(match["node"]) and (number := rank_number(match["n"])) is not None:
        form = _form(text, match, ("node", "n"))
        return Claim(source, number=number, node=match["node"], form=form)
    return None


def _is_node_name(prefix: str) -> bool:
    """A host-like prefix: letters only (`hosta`), or parts joined by `-` or `.` with a
    letter somewhere (`host-a`, `dgx-a100-07`). A single word glued to a number
    (`seed42-rank3`, `exp2_rank0`, `gpu0-rank3`) is two unrelated numbers, not a node."""
    if prefix.isalpha():
        return True
    return bool(re.search(r"[-.]", prefix)) and bool(re.search(r"[a-z]", prefix, re.IGNORECASE))


def _form(text: str, match: re.Match, fields: Iterable[str]) -> str:
    """The text with the named groups replaced by `{}`, lower-cased: `Rank {}`."""
    out, last = [], 0
    for name in sorted(fields, key=match.start):
        out += [text[last : match.start(name)], "{}"]
        last = match.end(name)
    return ("".join(out) + text[last:]).lower()


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A regular expression for `--label-pattern` such as `rank_{rank}` or
    `node{worker}-gpu{local_rank}`: the fields match whole numbers, the rest literally.

    Raises ValueError for an unknown field, a field used twice, or no field at all.
    """
    parts = re.split(r"\{([^{}]*)\}", pattern)
    regex, seen = [], set()
    for index, part in enumerate(parts):
        if index % 2 == 0:
            regex.append(re.escape(part))
            continue
        if part not in _PATTERN_FIELDS:
            raise ValueError(
                f"unknown field {{{part}}} in label pattern {pattern!r} "
                f"(fields: {', '.join('{' + f + '}' for f in _PATTERN_FIELDS)})"
            )
        if part in seen:
            raise ValueError(f"field {{{part}}} twice in label pattern {pattern!r}")
        seen.add(part)
        regex.append(rf"(?P<{part}>\d+)")
    if not seen & {"rank", "local_rank"}:
        raise ValueError(f"label pattern {pattern!r} needs {{rank}} or {{local_rank}}")
    return re.compile("^" + "".join(regex) + "$")


PATTERN_FORM = "pattern:"  # how the form of a claim a --label-pattern read begins


def read_by_pattern(claims: Iterable[Claim]) -> bool:
    """Whether the user's `--label-pattern` read any of `claims`."""
    return any(claim.form.startswith(PATTERN_FORM) for claim in claims)


def resolve_hint(pattern_given: bool, claims: Iterable[Claim]) -> str:
    """What to do when a job's runs do not say their ranks one way (`claims`: what they
    say). A `--label-pattern` given already is named as the thing to correct when it read
    some of these claims; when it read none, only `--ranks` is left (one pattern reads
    every job)."""
    given = "say each run's rank with --ranks FILE (run id -> rank)"
    if not pattern_given:
        return f"{given} or --label-pattern"
    return f"{given}, or correct --label-pattern" if read_by_pattern(claims) else given


def parse_with_pattern(text: str, pattern: re.Pattern[str], source: str) -> Claim | None:
    """The claim a user's `--label-pattern` reads from a label or name, or None."""
    match = pattern.match(text.strip())
    if not match:
        return None
    fields = {k: rank_number(v) for k, v in match.groupdict().items()}
    if None in fields.values():
        return None  # (a number no job has)
    worker = fields.get("worker")
    return Claim(
        source,
        rank=fields.get("rank"),
        local_rank=fields.get("local_rank"),
        node=worker,
        form=f"{PATTERN_FORM}{pattern.pattern}",
    )


def config_claim(config: Mapping[str, object]) -> Claim | None:
    """The rank a run's config states (`rank`/`global_rank`, `local_rank`, `world_size`,
    `local_world_size`, `node_rank`/`group_rank`/`node`, any case); None without a rank."""
    lowered = {str(k).lower(): v for k, v in config.items()}
    found: dict[str, int] = {}
    for field, keys in CONFIG_KEYS.items():
        for key in keys:
            value = _whole_number(lowered.get(key))
            if value is not None:
                found[field] = value
                break
    if "rank" not in found and "local_rank" not in found:
        return None
    return Claim("config", form="config", **found)


def config_value(value_json: str) -> object:
    """A config item's value: wandb stores some values as `{"value": ..., "desc": ...}`."""
    try:
        value = json.loads(value_json)
    except (ValueError, RecursionError):  # (nested past json's limit: no value to us)
        return None
    if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
        return value["value"]
    return value


def _whole_number(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value < MAX_RANKS:
        return value
    if isinstance(value, float) and value.is_integer() and 0 <= value < MAX_RANKS:
        return int(value)
    if isinstance(value, str):
        return rank_number(value)
    return None


# `--local_rank=3` (DeepSpeed, torch.distributed.launch before torch 2.0), `--local-rank=3`
# (torch.distributed.launch since 2.0), or either spelling with the number as the next word.
_LOCAL_RANK_ARG = re.compile(r"^--local[-_]rank(?:=(?P<n>\d+))?$")


def launcher_claim(args: Sequence[str]) -> Claim | None:
    """The local rank a launcher passed on the command line, or None.

    >>> launcher_claim(["train.py", "--local_rank=2"]).local_rank
    2
    >>> launcher_claim(["--local-rank", "1", "--lr", "3"]).local_rank
    1
    >>> launcher_claim(["--local_rank=1", "--local_rank=2"]) is None  # which one?
    True
    """
    found = set()
    for index, arg in enumerate(args):
        match = _LOCAL_RANK_ARG.match(arg)
        if not match:
            continue
        value = match["n"] if match["n"] is not None else _next(args, index)
        number = rank_number(value) if value is not None else None
        if number is None:
            return None  # (a flag without a number is not a launcher's)
        found.add(number)
    if len(found) != 1:
        return None
    return Claim("args", local_rank=found.pop(), form="args")


def _next(args: Sequence[str], index: int) -> str | None:
    return args[index + 1] if index + 1 < len(args) else None


def slurm_claim(slurm: Mapping[str, str]) -> Claim | None:
    """The place of an `srun` task from the `SLURM_*` variables wandb recorded (their names
    lower-cased without the prefix: `procid`, `localid`, `nodeid`, `ntasks`, `step_id`).

    A batch script's own process is no task (`topology.slurm_task` says which are). When
    one task per node starts torchrun, every worker of a node inherits that task's
    variables: their `procid` repeats, and `jobs` then reads the job without these claims.
    The job and step go into the claim's form, so two steps are never taken for one job.
    """
    env = {f"SLURM_{key.upper()}": value for key, value in slurm.items()}
    info = slurm_task(env)
    if info is None or max(info.rank, info.world_size, info.worker) >= MAX_RANKS:
        return None
    return Claim(
        "slurm",
        rank=info.rank,
        local_rank=info.local_rank,
        node=info.worker,
        world_size=info.world_size,
        local_world_size=info.local_world_size,
        form=f"slurm:{info.job_id or ''}",
        restart=info.restart,
    )


def gpu_claim(process_gpus: Iterable[int]) -> Claim | None:
    """The local rank the one GPU a process used says (torchrun jobs bind rank N of a node
    to its GPU N); None when the process used none or several (a stray context on GPU 0)."""
    gpus = {gpu for gpu in process_gpus if gpu < MAX_RANKS}
    if len(gpus) != 1:
        return None
    return Claim("gpu", local_rank=gpus.pop(), form="gpu")


def states_a_size(config: Mapping[str, object]) -> bool:
    """Whether a run's config states a world size or a local world size (any case)."""
    lowered = {str(k).lower(): v for k, v in config.items()}
    keys = (*CONFIG_KEYS["world_size"], *CONFIG_KEYS["local_world_size"])
    return any(_whole_number(lowered.get(key)) for key in keys)


def gpus_in_order(
    candidates: Mapping[int, list[Claim]], hosts: Mapping[int, str], sized: Iterable[int] = ()
) -> dict[int, list[Claim]]:
    """The runs' claims with each GPU claim made a local rank by its GPU's place among the
    GPUs of its host, where the GPUs' own numbers cannot be the local ranks.

    wandb records a GPU by the machine's number for it, while torchrun binds local rank N to
    the N-th GPU the job may use. A job given GPUs 4-7 of an 8-GPU machine
    (`CUDA_VISIBLE_DEVICES=4,5,6,7`) has its ranks on GPUs 4, 5, 6 and 7: local ranks 0-3,
    not 4-7. Only a host whose runs each used a GPU of their own, the lowest above 0, and
    that state no world size, is read so; and since the order holds only if no rank's run
    is missing (GPUs 2 and 3 may be ranks 2 and 3 of a job whose first two runs are gone),
    such claims are marked (`form` "gpu-order"): the job's rank 0 is then a guess, said as
    one. `candidates` and `hosts` are keyed alike (a run's index); `sized` are the runs that
    state a world size elsewhere (their config), whose hosts are left as they are.
    """
    by_host: dict[str, dict[int, int]] = {}
    sized_hosts = {hosts[i] for i in sized}
    for i, claims in candidates.items():
        gpu = next((c.local_rank for c in claims if c.source == "gpu"), None)
        by_host.setdefault(hosts[i], {})[i] = -1 if gpu is None else gpu
        if any(c.world_size or c.local_world_size for c in claims):
            sized_hosts.add(hosts[i])
    renumbered: dict[int, int] = {}
    for host, gpus in by_host.items():
        used = sorted(gpus.values())
        if used[0] > 0 and len(set(used)) == len(used) and host not in sized_hosts:
            renumbered.update({i: used.index(gpu) for i, gpu in gpus.items()})
    return {
        i: [
            replace(c, local_rank=renumbered[i], form="gpu-order")
            if c.source == "gpu" and i in renumbered
            else c
            for c in claims
        ]
        for i, claims in candidates.items()
    }
