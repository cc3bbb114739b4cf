"""`define_metric` in a shared run: every rank's definitions, names and globs alike, bound to
that rank's own labelled keys, so that no rank's definition replaces another's, checked by
wandb's own rules: `define_metric` takes a glob only as a prefix with a trailing `*`, and
wandb-core binds a key to its definition by name, else to a glob whose text before the `*`
the key starts with (`matchGlobMetric`).

The fixture `recipe_saved_files` is a real torchrun job in which every rank calls
`define_metric("epoch", hidden=True)` and `define_metric("val/*", step_metric="epoch",
summary="max")`, and only rank 0 logs `epoch` and `val/acc`. The merged log is read with
protobuf; what each rank logged and defined is read from the sources the same way.

A definition that binds keys of the merged run (a glob that matches some, a name logged)
must name as its step metric a key the same rank logged. Ranks 1 to 3 define `val/*` too,
bound to their own `epoch`, but log neither it nor a `val/` key: theirs bind nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import api
from wbmerge.analyse import PerRank
from wbmerge.log import read_payloads
from wbmerge.merge import glob_definitions
from wbmerge.merge.metricglobs import label_prefixes

from ..conftest import job_dir

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


KEY_FORMATS = ["{key}/{label}", "{label}/{key}", "{label}:{key}", "{key:>12}/{label}"]


def is_glob_wandb_takes(glob: str) -> bool:
    """wandb's `define_metric` check: at most one `*`, and only at the end."""
    return glob.endswith("*") and "*" not in glob[:-1]


def bound_by(key: str, definitions: list[pb.MetricRecord]) -> list[pb.MetricRecord]:
    """The definitions wandb-core may bind `key` to: its definition by name, else every
    glob whose text before the `*` the key starts with (wandb-core takes any one)."""
    named = [m for m in definitions if m.name == key]
    if named:
        return named
    return [m for m in definitions if m.glob_name and key.startswith(m.glob_name[:-1])]


@pytest.mark.parametrize("key_format", KEY_FORMATS)
def test_every_key_a_glob_matched_is_bound_to_its_own_ranks_step(tmp_path, key_format):
    job = job_dir(JOB)
    [staged] = api.merge(
        job / "wandb", tmp_path / "out", run_mode="shared", key_format=key_format, files_from=job
    )
    merged = records(staged.log_path)
    definitions = [record.metric for record in merged if record.HasField("metric")]
    merged_keys = {
        key_of(i) for record in merged if record.HasField("history") for i in record.history.item
    }
    globs = [m.glob_name for m in definitions if m.glob_name]
    assert all(is_glob_wandb_takes(glob) for glob in globs), globs

    by_rank = sources()
    label_of = {
        key_format.format(key=key, label=label): label
        for label, (logged, _) in by_rank.items()
        for key in logged
        if not key.startswith("_")
    }
    assert label_of.keys() <= merged_keys
    bound = 0
    for label, (logged, metrics) in by_rank.items():
        named = {m.name for m in metrics if m.name}
        for key in sorted(logged - named):
            if key.startswith("_"):
                continue
            own = [m for m in metrics if m.glob_name and key.startswith(m.glob_name[:-1])]
            found = bound_by(key_format.format(key=key, label=label), definitions)
            if not own:  # (no glob of its rank matches it: no definition claims it)
                assert found == [], (label, key)
                continue
            assert found, (label, key)
            for metric in found:  # the rank's glob's step metric, summary and options
                assert metric.step_metric == key_format.format(key=own[0].step_metric, label=label)
                assert metric.summary == own[0].summary and metric.options == own[0].options
            bound += 1
    assert bound == 1  # rank 0's val/acc: the only key under a glob (rank 0's val/*)

    steps = {key_format.format(key="epoch", label=label): label for label in by_rank}
    for metric in definitions:  # a glob binds its own rank's keys only
        if metric.glob_name:
            owner = steps[metric.step_metric]
            matched = [k for k in merged_keys if k.startswith(metric.glob_name[:-1])]
            assert all(label_of.get(k) == owner for k in matched), (metric.glob_name, matched)
    hidden = [m.name for m in definitions if m.options.hidden]
    assert sorted(hidden) == sorted(
        key_format.format(key="epoch", label=f"rank-{r}") for r in range(4)
    )


def test_a_glob_is_labelled_only_where_a_prefix_selects_one_rank():
    ranks = ["rank-1", "rank-10"]
    assert label_prefixes("{label}/{key}", ranks) == {"rank-1": "rank-1/", "rank-10": "rank-10/"}
    assert label_prefixes("{label}{key}", ranks) is None  # (rank-1... starts rank-10's keys)
    assert label_prefixes("{label}/{key}", ["a", "a/b"]) is None
    assert label_prefixes("{label}/{key}", ["host*1"]) is None
    assert label_prefixes("{key}/{label}", ranks) is None
    assert label_prefixes("{label}/{key:>9}", ranks) is None


def glob_record(glob: str, step: str = "epoch") -> bytes:
    record = pb.Record()
    record.metric.glob_name = glob
    record.metric.step_metric = step
    record.metric.summary.max = True
    return record.SerializeToString()


def test_an_expanded_glob_names_each_matching_key_once_with_the_first_glob():
    globs = [glob_record("val/*"), glob_record("v*", "other"), glob_record("a*b*")]
    keys = {"val/acc", "val/loss", "vocab", "epoch", "_runtime", "ab_x", "named/x"}
    written = [
        pb.Record.FromString(p).metric
        for p in glob_definitions(
            globs, {"val/loss"}, keys, "rank-2", "{key}/{label}", PerRank(), None
        )
    ]
    assert [(m.name, m.glob_name, m.step_metric) for m in written] == [
        ("val/acc/rank-2", "", "epoch/rank-2"),
        ("vocab/rank-2", "", "other/rank-2"),
    ]
    assert all(m.summary.max for m in written)
