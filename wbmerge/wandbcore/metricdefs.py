"""The metric definitions (`define_metric`) a log leaves on the server, and those a server
holds, in one shape, so that an upload can be checked for each of them. Pure functions.

wandb-core (0.31) folds a log's metric records into one definition per name and one per
glob (`runmetric.MetricHandler.ProcessRecord`): a record merges into the definition
before it (a step metric replaces the one before; hidden, step sync and summary types
once set stay set), unless it asks to overwrite (`_control.overwrite`). It sends the
folded definitions in the run's config, under `_wandb` -> `m`, as a list of objects keyed
by the `MetricRecord` field numbers (`corelib.ProtoEncodeToDict`): `"1"` the name, `"2"`
the glob, `"5"` the 1-based place in the list of its step metric's definition, `"6"` and
`"7"` the numbers of the options and summary types set, `"8"` the goal. Measured against
the sink with wandb 0.31: `define_metric("val/*", step_metric="epoch", summary="max")`
arrives as `{"2": "val/*", "5": 2, "6": [1], "7": [2]}` beside `{"1": "epoch"}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ..log import pb

# Field numbers of `MetricOptions` and `MetricSummary` that a definition is compared on.
# (`defined`, option 3, says only whether the record named the key; `best` and `copy` of
# the summary are never set by wandb-core.)
_OPTIONS = {1: "step_sync", 2: "hidden"}
_SUMMARY = {1: "min", 2: "max", 3: "mean", 5: "last", 6: "none", 8: "first"}


@dataclass(frozen=True)
class Definition:
    """One folded metric definition, as wandb-core keeps it: its step metric's name ("" for
    none), the options and summary types set, and its goal (0 unset, 1 minimize, 2
    maximize)."""

    step: str = ""
    options: frozenset[str] = frozenset()
    summary: frozenset[str] = frozenset()
    goal: int = 0

    def describe(self) -> str:
        parts = [f"step metric {self.step!r}"] if self.step else []
        parts += sorted(self.options) + [f"summary {s}" for s in sorted(self.summary)]
        parts += [f"goal {'minimize' if self.goal == 1 else 'maximize'}"] if self.goal else []
        return ", ".join(parts) or "no settings"


# A definition's key: ("name", key) or ("glob", pattern).
DefinitionKey = tuple[str, str]


def fold(metrics: Iterable[pb.MetricRecord], into: dict[DefinitionKey, Definition]) -> None:
    """Fold metric records into `into` in order, as wandb-core does (see the module's
    docstring). A record with neither name nor glob (an explicit x axis) defines nothing."""
    for metric in metrics:
        if metric.name:
            key = ("name", metric.name)
        elif metric.glob_name:
            key = ("glob", metric.glob_name)
        else:
            continue
        before = Definition() if metric._control.overwrite else into.get(key, Definition())
        options = {name for name in _OPTIONS.values() if getattr(metric.options, name)}
        kinds = set(before.summary - {"none"})
        none = "none" in before.summary
        if metric.HasField("summary"):  # (its `none` replaces the one before)
            none = metric.summary.none
            kinds |= {
                name
                for name in _SUMMARY.values()
                if name != "none" and getattr(metric.summary, name)
            }
        into[key] = Definition(
            step=metric.step_metric or before.step,
            options=frozenset(before.options | options),
            summary=frozenset(kinds | ({"none"} if none else set())),
            goal=metric.goal or before.goal,
        )


def held_definitions(config_json: str) -> dict[DefinitionKey, Definition] | None:
    """The metric definitions a server's run config (JSON text, as `RunResumeStatus` gives
    it) holds under `_wandb` -> `m`; {} when it holds none, None when `m` is there but not
    in the shape wandb-core sends (then no definition can be shown to be held)."""
    try:
        config = json.loads(config_json) if config_json else {}
    except (ValueError, RecursionError):
        return None
    wandb = config.get("_wandb") if isinstance(config, dict) else None
    if isinstance(wandb, dict) and "value" in wandb:
        wandb = wandb["value"]
    listed = wandb.get("m", []) if isinstance(wandb, dict) else []
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        return None
    held: dict[DefinitionKey, Definition] = {}
    for entry in listed:
        name, glob, index = entry.get("1"), entry.get("2"), entry.get("5")
        step = ""
        if isinstance(index, int) and 0 < index <= len(listed):
            step = listed[index - 1].get("1") or ""
        if name and isinstance(name, str):
            key: DefinitionKey = ("name", name)
        elif glob and isinstance(glob, str):
            key = ("glob", glob)
        else:
            continue
        if not isinstance(step, str):
            step = ""
        goal = entry.get("8")
        held[key] = Definition(
            step=step,
            options=_named_numbers(entry.get("6"), _OPTIONS),
            summary=_named_numbers(entry.get("7"), _SUMMARY),
            goal=goal if isinstance(goal, int) and not isinstance(goal, bool) else 0,
        )
    return held


def definitions_missing(
    expected: dict[DefinitionKey, Definition], held: dict[DefinitionKey, Definition] | None
) -> list[str]:
    """A line for each `expected` definition the server does not hold as it is (`held`,
    from `held_definitions`); [] when it holds every one. Definitions the server holds
    beyond these (wandb-core adds one for each step metric named) are not compared."""
    if not expected:
        return []
    if held is None:
        return ["metric definitions not readable in the server's config (_wandb.m)"]
    problems = []
    for (kind, name), definition in expected.items():
        there = held.get((kind, name))
        if there is None:
            problems.append(f"metric definition {kind} {name!r} not on the server")
        elif there != definition:
            problems.append(
                f"metric definition {kind} {name!r} is {there.describe()} on the "
                f"server, the upload gives {definition.describe()}"
            )
    return problems


def _named_numbers(numbers: object, names: dict[int, str]) -> frozenset[str]:
    if not isinstance(numbers, list):
        return frozenset()
    return frozenset(names[n] for n in numbers if isinstance(n, int) and n in names)
