"""`define_metric` in a shared run: every rank's definitions, names and globs alike, bound to
that rank's own labelled keys, so that no rank's definition replaces another's.

The fixture `recipe_saved_files` is a real torchrun job in which every rank calls
`define_metric("epoch", hidden=True)` and `define_metric("val/*", step_metric="epoch",
summary="max")`, and only rank 0 logs `epoch` and `val/acc`. The merged log is read with
protobuf; what each rank logged and defined is read from the sources the same way.

A definition that binds keys of the merged run (a glob that matches some, a name logged)
must name as its step metric a key the same rank logged. Ranks 1 to 3 define `val/*` too,
bound to their own `epoch`, but log neither it nor a `val/` key: theirs bind nothing.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import api
from wbmerge.txlog import read_payloads

from .conftest import job_dir

JOB = "recipe_saved_files"


def records(log: Path) -> list[pb.Record]:
    return [pb.Record.FromString(payload) for payload in read_payloads(log)]


def key_of(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def sources() -> dict[str, tuple[set[str], list[pb.MetricRecord]]]:
    """label -> (the keys the rank logged, its metric definitions), from its own file."""
    found = {}
    for log in job_dir(JOB).glob("wandb/*/run-*.wandb"):
        logged, metrics, rank = set(), [], None
        for record in records(log):
            for item in record.run.config.update:
                if key_of(item) == "rank":
                    rank = int(item.value_json)
            if record.HasField("history"):
                logged |= {key_of(item) for item in record.history.item}
            if record.HasField("metric"):
                metrics.append(record.metric)
        found[f"rank-{rank}"] = (logged, metrics)
    return found


@pytest.mark.parametrize("key_format", ["{key}/{label}", "{label}:{key}"])
def test_every_definition_binds_its_own_ranks_keys(tmp_path, key_format):
    job = job_dir(JOB)
    [staged] = api.merge(job / "wandb", tmp_path / "out", run_mode="shared",
                         key_format=key_format, files_from=job)  # fmt: skip
    merged = records(staged.log_path)
    definitions = [record.metric for record in merged if record.HasField("metric")]
    merged_keys = {key_of(i) for record in merged if record.HasField("history")
                   for i in record.history.item}  # fmt: skip
    by_rank = sources()
    logged_by = {key_format.format(key=key, label=label): label
                 for label, (logged, _) in by_rank.items() for key in logged
                 if not key.startswith("_")}  # fmt: skip
    assert logged_by.keys() <= merged_keys

    # one definition for each of every rank's, none replacing another (same name or glob)
    expected = {
        (key_format.format(key=m.name or m.glob_name, label=label), bool(m.glob_name))
        for label, (_, metrics) in by_rank.items() for m in metrics
    }  # fmt: skip
    written = [(m.name or m.glob_name, bool(m.glob_name)) for m in definitions]
    assert sorted(written) == sorted(expected)

    bound = 0
    for metric in definitions:
        pattern = metric.glob_name or metric.name
        [label] = [label for label in by_rank
                   if any(pattern == key_format.format(key=m.name or m.glob_name, label=label)
                          for m in by_rank[label][1])]  # fmt: skip
        matched = [key for key in merged_keys if fnmatchcase(key, pattern)]
        assert all(logged_by.get(key) == label for key in matched), (pattern, matched)
        if metric.step_metric:
            assert metric.step_metric.startswith("_") or metric.step_metric in [
                key_format.format(key=m.step_metric, label=label) for m in by_rank[label][1]
            ]
            if matched:  # a definition that binds keys: to a key that rank logged
                assert logged_by.get(metric.step_metric) == label, (pattern, metric.step_metric)
                bound += 1
    assert bound == 1  # rank 0's val/* (val/acc), the only rank that logs val/ keys

    [rank0_glob] = [
        m for m in definitions if m.glob_name == key_format.format(key="val/*", label="rank-0")
    ]
    assert rank0_glob.step_metric == key_format.format(key="epoch", label="rank-0")
    assert rank0_glob.summary.max  # summary= kept
    hidden = [m.name for m in definitions if m.options.hidden]
    assert sorted(hidden) == sorted(key_format.format(key="epoch", label=f"rank-{r}")
                                    for r in range(4))  # fmt: skip
