"""A shared merge writes each step's rows of every rank as one record, as the plain
reference merge (`reference_merge`) says: staged with `stage()` from small logs of random
records, read back, and compared record by record, bytes and all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.errors import WbmergeError
from wbmerge.log import read_payloads, record_kind, write_payloads
from wbmerge.merge import MergeOptions, stage
from wbmerge.plan import Source, Target
from wbmerge.training import RankInfo
from wbmerge.verify import expected_of

from ..log.test_items import history_records
from ..support import reference_merge
from ..support.ranklogs import history_record

MERGED_KINDS = ("history", "metric", "config", "summary")


def run_record(run_id: str) -> bytes:
    record = pb.Record()
    record.run.run_id, record.run.project = run_id, "reference"
    return record.SerializeToString()


def exit_record() -> bytes:
    record = pb.Record()
    record.exit.exit_code = 0
    return record.SerializeToString()


def shared_target(root: Path, ranks: dict[int, tuple[str, list[bytes]]], primary: int) -> Target:
    """`ranks` (rank -> (label, records)) written as one log each under `root`, as the
    sources of one shared target."""
    sources = []
    world = max(ranks) + 1
    for rank, (label, payloads) in sorted(ranks.items()):
        run_dir = root / "wandb" / f"offline-run-20260101_000000-ref{rank}"
        run_dir.mkdir(parents=True)
        path = run_dir / f"run-ref{rank}.wandb"
        write_payloads(path, [run_record(f"ref{rank}"), *payloads, exit_record()])
        info = RankInfo(rank, rank, world, world, 0, job_id="reference")
        sources.append(Source(path=path, rank=info, label=label))
    target = Target(
        id="reference-shared",
        group=None,
        display_name="reference-shared",
        job_type=None,
        primary_rank=primary,
        kind="shared",
        sources=tuple(sources),
    )
    return target


def stage_shared(
    root: Path,
    ranks: dict[int, tuple[str, list[bytes]]],
    primary: int,
    skew: bool = False,
    live: bool = False,
) -> tuple[list[bytes], object]:
    """`ranks` (rank -> (label, records)) written as one log each and staged as one shared
    run (`live`: as a follow's round before the last); returns the staged run's history,
    metric, config and summary records, and what `stage` said."""
    target = shared_target(root, ranks, primary)
    options = MergeOptions(run_mode="shared", skew_metrics=skew, live=live)
    staged = stage(target, root / "out", options)
    merged = [p for p in read_payloads(staged.log_path) if record_kind(p) in MERGED_KINDS]
    return merged, staged


def assert_as_reference(merged: list[bytes], want: list[pb.Record]) -> None:
    """The merged records are the reference's, byte for byte, but for the text of each
    spread (`--skew-metrics`): the merge writes a float's shortest text as arrow spells it
    (`1e-8`, not Python's `1e-08`), so it must be a float's text of the very same number."""
    got = [pb.Record.FromString(p) for p in merged]
    for record, reference in zip(got, want, strict=False):
        for item, wanted in zip(record.history.item, reference.history.item, strict=False):
            if item.nested_key[:1] == wanted.nested_key[:1] and item.nested_key[0].startswith(
                "wbmerge/spread/"
            ):
                assert set(item.value_json) & set(".eE"), item.value_json  # a float
                assert float(item.value_json) == float(wanted.value_json)
                item.value_json = wanted.value_json
    assert got == want
    assert [r.SerializeToString() for r in got] == [r.SerializeToString() for r in want]
    spread_free = [r.SerializeToString() for r in got if not _has_spread(r)]
    assert spread_free == [p for p in merged if not _has_spread(pb.Record.FromString(p))]


def _has_spread(record: pb.Record) -> bool:
    return any(
        i.nested_key[:1] and i.nested_key[0].startswith("wbmerge/spread/")
        for i in record.history.item
    )


def with_step(payload: bytes, step: int) -> bytes:
    record = pb.Record.FromString(payload)
    record.history.step.num = step
    return record.SerializeToString()


def summary_of(payload: bytes) -> bytes:
    """The summary record wandb writes beside a history row: the same items."""
    record = pb.Record()
    for item in pb.Record.FromString(payload).history.item:
        record.summary.update.add().CopyFrom(
            pb.SummaryItem(key=item.key, nested_key=item.nested_key, value_json=item.value_json)
        )
    return record.SerializeToString()


@st.composite
def config_records(draw: st.DrawFn) -> bytes:
    """A `config.update` (or a removal) of a few keys, top-level or nested, whose values
    often agree across ranks, as most of a job's config does."""
    record = pb.Record()
    paths = [["lr"], ["seed"], ["opt", "beta"], ["opt"]]
    for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique_by=tuple)):
        item = record.config.update.add() if draw(st.integers(0, 4)) else record.config.remove.add()
        if len(path) == 1:
            item.key = path[0]
        else:
            item.nested_key.extend(path)
        item.value_json = json.dumps(draw(st.integers(0, 2)))
    return record.SerializeToString()


@st.composite
def rank_logs(draw: st.DrawFn) -> tuple[dict[int, tuple[str, list[bytes]]], int]:
    """Ranks 0-4 (some without a log), each logging rows at some of up to 6 steps: some
    steps without the primary's row, rows with different W&B keys (`_runtime` here, not
    there), some with a summary beside them, a metric defined between rows here and there.
    Returns (rank -> (label, records), primary)."""
    steps = sorted(draw(st.sets(st.integers(0, 10**6), min_size=1, max_size=6)))
    primary = draw(st.sampled_from([0, 1]))
    ranks: dict[int, tuple[str, list[bytes]]] = {}
    for rank in sorted(draw(st.sets(st.integers(0, 4), min_size=1, max_size=4)) | {primary}):
        payloads = []
        for step in steps:
            if draw(st.booleans()):
                payload = with_step(draw(history_records()), step)
                payloads.append(payload)
                if draw(st.booleans()):
                    payloads.append(summary_of(payload))
            if draw(st.integers(0, 5)) == 0:
                metric = pb.Record()
                metric.metric.name = draw(st.sampled_from(["loss", "acc", "_runtime"]))
                metric.metric.summary.max = draw(st.booleans())  # (defined again, changed)
                payloads.append(metric.SerializeToString())
            if draw(st.integers(0, 3)) == 0:
                payloads.append(draw(config_records()))
        ranks[rank] = (f"rank-{rank}", payloads)
    return ranks, primary


@settings(max_examples=150, deadline=None)
@given(rank_logs(), st.booleans())
def test_merged_rows_are_the_reference_merge(tmp_path_factory, logs, skew):
    ranks, primary = logs
    merged, staged = stage_shared(tmp_path_factory.mktemp("ref"), ranks, primary, skew)
    want = reference_merge.merged_records(ranks, primary, skew)
    assert_as_reference(merged, want)
    rows = [r for r in want if r.HasField("history")]
    assert staged.history_rows == len(rows)
    source_rows = sum(
        len(
            {
                pb.Record.FromString(p).history.step.num
                for p in payloads
                if record_kind(p) == "history"
            }
        )
        for _, payloads in ranks.values()
    )
    assert staged.source_rows == source_rows


@settings(max_examples=150, deadline=None)
@given(st.lists(history_records(), min_size=1, max_size=8))
def test_rows_of_any_items_are_labelled_as_the_reference_says(tmp_path_factory, payloads):
    """Rows in the shapes of `history_records` (keys twice, W&B's own keys, values too long
    for the batch split): two ranks log the same rows, so every step has two."""
    rows = [with_step(payload, step) for step, payload in enumerate(payloads)]
    ranks = {0: ("rank-0", rows), 1: ("rank-1", rows)}
    merged, _ = stage_shared(tmp_path_factory.mktemp("ref"), ranks, 0, skew=True)
    assert_as_reference(merged, reference_merge.merged_records(ranks, 0, skew=True))


def history_payload(step: int, pairs: list[tuple[list[str], str]]) -> bytes:
    return history_record(list(pairs), step)


def test_labelled_row_decodes_to_the_labelled_keys(tmp_path):
    """User keys get the rank's label (the top-level key only: a nested value stays whole),
    `_step` is the merged row's, and only one-level numbers have a spread."""
    ranks = {
        2: (
            "rank-2",
            [
                history_payload(
                    3, [(["train/loss"], "0.5"), (["samples", "path"], '"a.png"'), (["_step"], "3")]
                )
            ],
        ),
        5: (
            "rank-5",
            [history_payload(3, [(["train/loss"], "1.5"), (["samples", "path"], '"b.png"')])],
        ),
    }
    [row, _summary], _ = stage_shared(tmp_path, ranks, primary=2, skew=True)
    items = [(list(i.nested_key), i.value_json) for i in pb.Record.FromString(row).history.item]
    assert items == [
        (["train/loss/rank-2"], "0.5"),
        (["samples/rank-2", "path"], '"a.png"'),
        (["train/loss/rank-5"], "1.5"),
        (["samples/rank-5", "path"], '"b.png"'),
        (["_step"], "3"),
        (["wbmerge/spread/train/loss"], json.dumps(1.0)),  # (1.5 - 0.5) / |median 1.0|
    ]


def summary_payload(pairs: list[tuple[str, str]]) -> bytes:
    record = pb.Record()
    for key, value in pairs:
        item = record.summary.update.add()
        item.nested_key.append(key)
        item.value_json = value
    return record.SerializeToString()


def test_summary_keys_keep_the_order_they_were_first_set_in(tmp_path):
    """A key's place in the merged summary is where the rank first set it, its value the
    last one; whether the records came in one read or several."""
    records = [
        summary_payload([("a", "1"), ("b", "2")]),
        summary_payload([("a", "3")]),
        history_payload(0, [(["a"], "3")]),
    ]
    merged, _ = stage_shared(tmp_path, {0: ("rank-0", records)}, primary=0)
    summary = pb.Record.FromString(merged[-1]).summary
    assert [(list(i.nested_key), i.value_json) for i in summary.update] == [
        (["a/rank-0"], "3"),
        (["b/rank-0"], "2"),
    ]


def config_payload(**values: object) -> bytes:
    record = pb.Record()
    for key, value in values.items():
        record.config.update.add(key=key, value_json=json.dumps(value))
    return record.SerializeToString()


def loss_defined(summary: str) -> bytes:
    record = pb.Record()
    record.metric.name = "loss"
    setattr(record.metric.summary, summary, True)
    return record.SerializeToString()


def test_a_config_key_or_definition_set_back_to_an_earlier_value_is_written_again(tmp_path):
    """The primary sets `a` to 1, 2, then 1 again, and defines `loss` with min, max, then
    min again: the run must end with a = 1 and min, so all three of each are written. Rank
    1's config keys that differ from the primary's (`seed`, and `b`, which the primary lacks)
    are added labelled; `lr`, the same on both, once."""
    row = history_payload(0, [(["loss"], "1.0")])
    ranks = {
        0: (
            "rank-0",
            [
                config_payload(lr=0.1, seed=0),
                row,
                config_payload(a=1),
                loss_defined("min"),
                config_payload(a=2),
                loss_defined("max"),
                config_payload(a=1),
                loss_defined("min"),
            ],
        ),
        1: ("rank-1", [config_payload(lr=0.1, seed=1), row, config_payload(b=5)]),
    }
    merged, _ = stage_shared(tmp_path, ranks, primary=0)
    records = [pb.Record.FromString(p) for p in merged]
    configs = [
        [(i.key, i.value_json) for i in r.config.update] for r in records if r.HasField("config")
    ]
    assert configs == [
        [("lr", "0.1"), ("seed", "0")],
        [("a", "1")],
        [("a", "2")],
        [("a", "1")],
        [("seed/rank-1", "1"), ("b/rank-1", "5")],
    ]
    defined = [r.metric.summary.max for r in records if r.HasField("metric")]
    assert defined == [False, True, False]
    # A follow's round before the last leaves the other ranks' config for the last one.
    merged, _ = stage_shared(tmp_path / "live", ranks, primary=0, live=True)
    records = [pb.Record.FromString(p) for p in merged]
    configs = [
        [(i.key, i.value_json) for i in r.config.update] for r in records if r.HasField("config")
    ]
    assert configs == [[("lr", "0.1"), ("seed", "0")], [("a", "1")], [("a", "2")], [("a", "1")]]


def test_a_labelled_config_key_the_primary_holds_already_is_refused_in_one_line(tmp_path):
    """The primary's own `seed/rank-1` and rank 1's `seed`, labelled, would be one key:
    the merge refuses in one line, and the source check (counting on its own) names it."""
    row = history_payload(0, [(["loss"], "1.0")])
    ranks = {
        0: ("rank-0", [config_payload(seed=0, **{"seed/rank-1": 5}), row]),
        1: ("rank-1", [config_payload(seed=1), row]),
    }
    target = shared_target(tmp_path, ranks, primary=0)
    with pytest.raises(WbmergeError, match=r"^rank-1: its config key 'seed' is 'seed/rank-1'"):
        stage(target, tmp_path / "out", MergeOptions(run_mode="shared"))
    assert expected_of(target).clashes == [
        "rank 1's config key 'seed/rank-1': the primary's config holds it too"
    ]
