"""Where each run of one job sits: global rank, local rank and worker, from their claims
(pure).

`jobs` decides which runs make a job and which claim of each run to believe; this module
turns those claims into one topology, or raises `Unresolved` naming the runs that do not
fit. A label's number after a node (`node1_rank0`) is a local rank when every node counts
from 0, else a global rank when the numbers are distinct: `node0_rank0, node0_rank1,
node1_rank0, node1_rank1` is two nodes of local ranks 0-1 (global ranks 0-3), while
`node0_rank0, node0_rank1, node1_rank2, node1_rank3` names the global ranks. Without a
node in the claims, the host a run was written on tells the nodes apart: the ranks of one
host are one worker, the hosts ordered by their lowest rank, else by name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .rankclaims import Claim


class PlacedRun(Protocol):
    """What placing a run needs of it: where it ran, when it started, and how to name it."""

    host: str
    start: float

    def describe(self) -> str: ...


class Unresolved(Exception):
    """A job's claims that do not make one topology (the message names the runs)."""


@dataclass(frozen=True)
class Place:
    rank: int
    local_rank: int
    worker: int
    world_size: int
    local_world_size: int
    # Which node is worker 0 is only the nodes' names in order: the runs give local ranks
    # and a host or node name, never a global rank or node number that orders the nodes.
    worker_guessed: bool = False


def place_ranks(
    runs: Sequence[PlacedRun], claims: Mapping[int, Claim], members: Sequence[int]
) -> dict[int, Place]:
    """Global rank, local rank and worker of every run of one job from their claims.

    Raises `Unresolved` naming the runs when the claims contradict each other.
    """
    numbers = {i: claims[i] for i in members if claims[i].number is not None}
    ranks: dict[int, int] = {i: c.rank for i in members if (c := claims[i]).rank is not None}
    locals_: dict[int, int] = {}
    nodes: dict[int, object] = {}
    hosts = {runs[i].host for i in members}
    named = {c.node for i in members if isinstance((c := claims[i]).node, str)}
    for i in members:
        claim = claims[i]
        if claim.node is not None and not (isinstance(claim.node, str) and len(named) == 1):
            nodes[i] = claim.node
        elif len(hosts) > 1:
            nodes[i] = ("host", runs[i].host)
        if claim.local_rank is not None:
            locals_[i] = claim.local_rank
    if nodes and len(nodes) < len(members):
        names = ", ".join(runs[i].describe() for i in members if i not in nodes)
        raise Unresolved(f"{names}: no node, while other runs of its job name theirs")
    if numbers:
        resolve_numbers(runs, numbers, nodes, ranks, locals_)
    if not nodes:  # one node: a local rank is the rank
        ranks.update({i: local for i, local in locals_.items() if i not in ranks})
    lws = {c.local_world_size for i in members if (c := claims[i]).local_world_size}
    if len(lws) == 1 and len(nodes) < len(members) and len(ranks) == len(members):
        size = lws.pop()
        for i in members:
            nodes.setdefault(i, ranks[i] // size)
    return _places(runs, claims, members, ranks, locals_, nodes)


def resolve_numbers(
    runs: Sequence[PlacedRun],
    numbers: Mapping[int, Claim],
    nodes: Mapping[int, object],
    ranks: dict[int, int],
    locals_: dict[int, int],
) -> None:
    """Decide whether the label numbers of a job are local or global ranks (rule 3)."""
    by_node: dict[object, list[int]] = defaultdict(list)
    for i, claim in numbers.items():
        by_node[nodes.get(i)].append(claim.number)  # type: ignore[arg-type]
    counts_from_zero = all(sorted(n) == list(range(len(n))) for n in by_node.values())
    if len(by_node) > 1 and counts_from_zero:
        locals_.update({i: c.number for i, c in numbers.items()})  # type: ignore[misc]
        return
    values = [c.number for c in numbers.values()]
    if len(set(values)) == len(values):
        ranks.update({i: c.number for i, c in numbers.items()})  # type: ignore[misc]
        return
    twice = sorted({v for v in values if values.count(v) > 1})  # type: ignore[type-var]
    rank = twice[0]
    names = " and ".join(runs[i].describe() for i, c in numbers.items() if c.number == rank)
    raise Unresolved(f"rank {rank} claimed by more than one run: {names}")


def _places(
    runs: Sequence[PlacedRun],
    claims: Mapping[int, Claim],
    members: Sequence[int],
    ranks: dict[int, int],
    locals_: dict[int, int],
    nodes: dict[int, object],
) -> dict[int, Place]:
    sizes = {c.world_size for i in members if (c := claims[i]).world_size}
    if len(ranks) == len(members):
        world = max([*ranks.values(), *(s - 1 for s in sizes)]) + 1
        _check_distinct(runs, claims, ranks)
        if not nodes:
            return {i: Place(r, r, 0, world, world) for i, r in ranks.items()}
        workers = _worker_order(nodes, ranks)
        per_node: dict[object, list[int]] = defaultdict(list)
        for i in members:
            per_node[nodes[i]].append(i)
        local_world = max(len(v) for v in per_node.values())
        world = max(world, (max(workers.values()) + 1) * local_world)
        places = {}
        for node, node_runs in per_node.items():
            for i in node_runs:
                worker = workers[node]
                local = locals_.get(i, ranks[i] - worker * local_world)
                if not 0 <= local < local_world or ranks[i] != worker * local_world + local:
                    raise Unresolved(
                        f"{runs[i].describe()}: rank {ranks[i]} does not fit worker {worker} "
                        f"of {local_world} ranks"
                    )
                places[i] = Place(ranks[i], local, worker, world, local_world)
        return places
    missing = [i for i in members if i not in ranks and (i not in locals_ or i not in nodes)]
    if missing:
        names = ", ".join(runs[i].describe() for i in missing)
        raise Unresolved(f"{names}: rank or node unclear among the runs of its job")
    workers = _worker_order(nodes, {})
    guessed = len(set(workers.values())) > 1 and not all(isinstance(n, int) for n in workers)
    local_world = max(locals_.values()) + 1
    places = {}
    for i in members:
        worker = workers[nodes[i]]
        rank = ranks.get(i, worker * local_world + locals_[i])
        places[i] = Place(rank, locals_[i], worker, 0, local_world)
    world = max(max(p.rank for p in places.values()) + 1, *sizes, len(set(workers.values())))
    num_workers = max(workers.values()) + 1
    world = max(world, num_workers * local_world)
    _check_distinct(runs, claims, {i: p.rank for i, p in places.items()})
    return {
        i: Place(p.rank, p.local_rank, p.worker, world, local_world, guessed)
        for i, p in places.items()
    }


def _worker_order(nodes: Mapping[int, object], ranks: Mapping[int, int]) -> dict[object, int]:
    """Worker index of each node: its own number (`node1`), else by lowest rank, else name."""
    keys = set(nodes.values())
    if keys and all(isinstance(k, int) for k in keys):
        return {k: k for k in keys}  # type: ignore[misc]
    lowest: dict[object, tuple] = {}
    for i, node in nodes.items():
        key = (ranks.get(i, 1 << 30), str(node))
        lowest[node] = min(lowest.get(node, key), key)
    return {node: index for index, node in enumerate(sorted(keys, key=lowest.__getitem__))}


def _check_distinct(
    runs: Sequence[PlacedRun], claims: Mapping[int, Claim], ranks: Mapping[int, int]
) -> None:
    """Raise `Unresolved` when two runs claim one rank (and restart)."""
    seen: dict[tuple[int, int], int] = {}
    for i, rank in sorted(ranks.items(), key=lambda item: runs[item[0]].start):
        key = (rank, claims[i].restart)
        if key in seen:
            raise Unresolved(
                f"rank {rank} claimed by more than one run: "
                f"{runs[seen[key]].describe()} and {runs[i].describe()}"
            )
        seen[key] = i
