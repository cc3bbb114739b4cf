"""The fast source check hashes a read's history values in one compiled call (XXH64 over
each value's bytes) and sums them per key over arrays, where the reference hashes each
value in Python. A staged value changed in a way a weaker fast form would not see (its
last byte, a byte far into a long value, two 8-byte words swapped, a byte added, values
swapped between two keys of a row, values whose XXH64 sums collide under a known seed)
must be named by both alike."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import xxhash

from wbmerge.log import Frames, pb, read_payloads, records
from wbmerge.merge import DEFAULT_KEY_FORMAT
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo
from wbmerge.verify.sourcecheck import (
    ExpectedFold,
    continued_shortfall,
    fast_hashes,
    fast_shortfall,
    source_shortfall,
)

from ..support.ranklogs import exit_record, history_record, rank_log
from .test_source_check import once, rewrite

STEPS = 12


def long_text(rank: int, step: int) -> str:
    """A long string value: different rows differ in their first bytes."""
    return json.dumps(f"{rank}-{step:04d}-" + "abcdefghijklmnop" * 6)


def shared_run(tmp_path):
    """A shared run of two ranks that log a short number, a 16-byte number and a long
    string every step."""
    root = tmp_path / "job"
    for rank in range(2):
        info = RankInfo(rank, rank, 2, 2, 0, 0, "digests")
        with rank_log(root, info, f"digest{rank}", "p") as writer:
            for step in range(STEPS):
                items = [
                    ("loss", f"0.{rank}{step:02d}5"),
                    ("lr", f"12345678.{step:07d}"),
                    ("note", long_text(rank, step)),
                ]
                writer.write(history_record(items, step))
            writer.write(exit_record(0))
    [run] = merge_jobs(MergeRequest([root], run_mode="shared"), tmp_path / "out")
    return run


def changed_value(key: str, change: Callable[[str], str]):
    """The first staged row's value of `key` through `change`."""

    def apply(record: pb.Record):
        item = next((i for i in record.history.item if (i.key or i.nested_key[0]) == key), None)
        if item is None:
            return False
        item.value_json = change(item.value_json)
        return record

    return once(apply)


def swapped(first: str, second: str):
    """The values of two keys of the first staged row that holds both, swapped."""

    def apply(record: pb.Record):
        items = {i.key or i.nested_key[0]: i for i in record.history.item}
        if first not in items or second not in items:
            return False
        a, b = items[first], items[second]
        a.value_json, b.value_json = b.value_json, a.value_json
        return record

    return once(apply)


def other_last(text: str) -> str:
    return text[:-1] + ("6" if text[-1] != "6" else "7")


def words_swapped(text: str) -> str:
    assert len(text) >= 16
    return text[8:16] + text[:8] + text[16:]


def far_in(text: str) -> str:
    assert len(text) > 100 and text[90] != "Z"
    return text[:90] + "Z" + text[91:]


def both(run) -> tuple[list[str], list[str]]:
    return (
        source_shortfall(run.target, run.log_path, check="fast"),
        source_shortfall(run.target, run.log_path, check="reference"),
    )


def test_the_shared_run_holds_what_its_ranks_logged(tmp_path):
    run = shared_run(tmp_path)
    assert both(run) == ([], [])


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (changed_value("loss/rank-0", other_last), "loss/rank-0"),
        (changed_value("note/rank-1", far_in), "note/rank-1"),
        (changed_value("lr/rank-0", words_swapped), "lr/rank-0"),
        (changed_value("loss/rank-1", lambda text: text + " "), "loss/rank-1"),
    ],
)
def test_a_value_a_weak_fast_digest_would_miss_is_named(tmp_path, change, key):
    run = shared_run(tmp_path)
    rewrite(run.log_path, change)
    fast, reference = both(run)
    assert (
        fast
        == reference
        == [f"rank {key[-1]}'s history key {key!r}: {STEPS} values logged, other values staged"]
    )


def test_values_swapped_between_two_keys_are_named(tmp_path):
    run = shared_run(tmp_path)
    rewrite(run.log_path, swapped("loss/rank-0", "lr/rank-0"))
    fast, reference = both(run)
    assert fast == reference
    assert sorted(fast) == [
        f"rank 0's history key 'loss/rank-0': {STEPS} values logged, other values staged",
        f"rank 0's history key 'lr/rank-0': {STEPS} values logged, other values staged",
    ]


# Two pairs of JSON numbers whose value parts' XXH64 (seed 0) sum alike mod 2**64: found by
# a generalized birthday search over 2**22 numbers of each form (37 s of CPU), as anyone
# could search against a hash whose seed is known.
LOGGED_PAIR, STAGED_PAIR = ("1.0023261", "2.3563498"), ("3.3415013", "4.0385705")


def value_part(text: str) -> bytes:
    """A history item's value part as wandb writes it: field 16, its length, the JSON."""
    return b"\x82\x01" + bytes([len(text)]) + text.encode()


def seed_0_sum(texts: tuple[str, ...]) -> int:
    return sum(xxhash.xxh64_intdigest(value_part(text)) for text in texts) % (1 << 64)


def colliding_run(tmp_path):
    """A shared run of two ranks whose rank 0 logs `LOGGED_PAIR` as its first two losses."""
    root = tmp_path / "job"
    for rank in range(2):
        info = RankInfo(rank, rank, 2, 2, 0, 0, "collide")
        with rank_log(root, info, f"collide{rank}", "p") as writer:
            for step in range(STEPS):
                loss = LOGGED_PAIR[step] if rank == 0 and step < 2 else f"0.{rank}{step:02d}5"
                writer.write(history_record([("loss", loss)], step))
            writer.write(exit_record(0))
    [run] = merge_jobs(MergeRequest([root], run_mode="shared"), tmp_path / "out")
    return run


def replaced(key: str, by: dict[str, str]):
    """Every staged value of `key` that is a key of `by` replaced by its value there."""

    def apply(record: pb.Record) -> pb.Record:
        for item in record.history.item:
            if (item.key or item.nested_key[0]) == key and item.value_json in by:
                item.value_json = by[item.value_json]
        return record

    return apply


def test_values_whose_digest_collides_under_a_known_seed_are_named(tmp_path):
    assert set(LOGGED_PAIR).isdisjoint(STAGED_PAIR)
    assert seed_0_sum(LOGGED_PAIR) == seed_0_sum(STAGED_PAIR)  # (a real collision)
    run = colliding_run(tmp_path)
    assert both(run) == ([], [])
    rewrite(run.log_path, replaced("loss/rank-0", dict(zip(LOGGED_PAIR, STAGED_PAIR, strict=True))))
    held = [
        item.value_json
        for payload in read_payloads(run.log_path)
        for item in pb.Record.FromString(payload).history.item
        if (item.key or item.nested_key[0]) == "loss/rank-0"
    ]
    assert held[:2] == list(STAGED_PAIR)  # (the staged log holds the other pair)
    # with the seed known, the fast digest is fooled; with its own random seed it is not
    assert fast_shortfall(run.target, run.log_path, DEFAULT_KEY_FORMAT, None, seed=0) == []
    fast, reference = both(run)
    assert (
        fast
        == reference
        == [f"rank 0's history key 'loss/rank-0': {STEPS} values logged, other values staged"]
    )


@pytest.mark.parametrize("change", [None, changed_value("note/rank-1", far_in)])
def test_the_check_folded_a_read_at_a_time_names_what_the_whole_one_names(tmp_path, change):
    """A follow folds the ranks' records as its merge reads them, a read at a time, and
    counts the rows it sent (`ExpectedFold`, `rows_tally`): its last round's check gives the
    lines of the check that reads every log whole, with the same seed."""
    run = shared_run(tmp_path)
    if change is not None:
        rewrite(run.log_path, change)
    hashes = fast_hashes(7)
    fold = ExpectedFold(run.target, DEFAULT_KEY_FORMAT, None, hashes)
    for source in run.target.sources:  # (a record at a time: a follow's reads end anywhere)
        for read in records.read_indexed(source.path):
            frames = read.frames
            for at in range(len(frames)):
                one = Frames(frames.data, frames.starts[at : at + 1], frames.ends[at : at + 1])
                fold.add(source.rank.rank, 0, records.RecordIndex(one))
    whole = fast_shortfall(run.target, run.log_path, DEFAULT_KEY_FORMAT, None, seed=7)
    assert continued_shortfall(run.target, run.log_path, fold, hashes, {}) == whole
    assert bool(whole) == (change is not None)
