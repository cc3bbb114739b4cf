"""Incremental rounds of `sync --follow`: a round merges only what the ranks wrote since the
last one, and the runs end byte for byte as a one-shot sync of the final files makes them.

The reference is the merge from scratch: the one-shot reader of a log cut where a round
found it (`txlog.read_payloads`), and a one-shot `sync` of the whole job. Logs are cut at
every kind of place: after a whole record, inside a record's payload, inside a chunk
header, on a block boundary, inside the file header.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from wbmerge.follow import Follower, NotIncremental, ScannedLog, incremental, passlive, round_lines
from wbmerge.follow.tails import LiveReaders
from wbmerge.identify import read_identity, scan
from wbmerge.log import BLOCK_SIZE, FILE_HEADER, LogWriter, pb, read_payloads, write_payloads
from wbmerge.sync import MergeRequest, sync

from ..merge.test_merged_artifacts import JOB_ID, assert_checkpoint_of, output_artifacts, write_job
from ..support import synthetic
from .test_follow import (
    MODES,
    UPLOAD_TIMEOUT,
    assert_same_runs,
    follow_sink,
    one_shot,
    sink_runs,
)


def chunk_places(data: bytes) -> tuple[list[int], list[int]]:
    """Where each chunk of a log ends, and where each record ends (after a FULL or LAST
    chunk): walked here from the format, not with the reader under test."""
    chunks, record_ends = [], []
    pos = len(FILE_HEADER)
    while pos < len(data):
        room = BLOCK_SIZE - pos % BLOCK_SIZE
        if room < 7 or not any(data[pos : pos + 7]):
            pos += room
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += 7 + length
        chunks.append(pos)
        if kind in (1, 4):
            record_ends.append(pos)
    return chunks, record_ends


def cut_points(data: bytes) -> list[int]:
    """Cuts of every kind, rising: in the file header, after whole records, inside a
    record's payload, inside a chunk header, on block boundaries, at the end."""
    chunks, record_ends = chunk_places(data)
    picks = {3, len(FILE_HEADER)}
    picks.update(record_ends[:: max(1, len(record_ends) // 6)])
    picks.update(end - 5 for end in record_ends[1 :: max(1, len(record_ends) // 5)])
    picks.update(end + 3 for end in chunks[2 :: max(1, len(chunks) // 5)])
    picks.update(range(BLOCK_SIZE, len(data), BLOCK_SIZE))
    picks.update(range(BLOCK_SIZE - 4, len(data), BLOCK_SIZE))  # (in a block's trailer)
    picks.add(len(data))
    return sorted(p for p in picks if 0 < p <= len(data))


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A job of 2 nodes x 2 ranks whose logs span several blocks (with console lines and
    system metrics), written by the synthetic writer in the shapes wandb 0.31 writes."""
    root = tmp_path_factory.mktemp("job")
    synthetic.write_job(root, 2, 2, 300, metrics=12, job_id="incremental")
    return root


def test_live_reads_give_each_record_once_as_the_one_shot_reader_does_and_scan_counts(
    job, tmp_path
):
    source = sorted(job.rglob("run-*.wandb"))[0]
    data = source.read_bytes()
    assert len(data) > 2 * BLOCK_SIZE
    live = tmp_path / "run.wandb"
    live.write_bytes(b"")
    readers = LiveReaders({0: [live]})
    scanned = ScannedLog(live)
    taken: list[bytes] = []
    for cut in cut_points(data):
        with open(live, "ab") as out:
            out.write(data[live.stat().st_size : cut])
        readers.begin_round()
        while ranks := readers.live():
            frames, reads = readers.read(ranks, 1)
            assert sum(read.records for read in reads) == len(frames)
            taken += list(frames.payloads())
        assert taken == list(read_payloads(live)), f"cut at byte {cut}"
        whole = scan(read_identity(live))
        counted = scanned.update()
        assert (
            counted.records,
            counted.history_rows,
            counted.first_step,
            counted.last_step,
            counted.complete,
            counted.exit_code,
        ) == (
            whole.records,
            whole.history_rows,
            whole.first_step,
            whole.last_step,
            whole.complete,
            whole.exit_code,
        ), f"cut at byte {cut}"
    assert len(taken) > 100
    assert readers.open_ranks() == []  # (its exit record read, and all of it: ended)


def test_a_log_truncated_rewritten_or_replaced_is_not_continued(job, tmp_path):
    data, other = (log.read_bytes() for log in sorted(job.rglob("run-*.wandb"))[:2])
    half = BLOCK_SIZE + 1000
    for change in ("truncated", "rewritten", "replaced"):
        live = tmp_path / f"{change}.wandb"
        live.write_bytes(data[:half])
        readers = LiveReaders({0: [live]})
        readers.begin_round()
        while ranks := readers.live():
            readers.read(ranks, 4)
        readers.begin_round()  # (nothing changed: it goes on)
        if change == "truncated":
            live.write_bytes(data[: half - 300])
        elif change == "rewritten":
            changed = bytearray(data[:half])
            changed[BLOCK_SIZE + 100] ^= 1
            live.write_bytes(bytes(changed))
        else:  # (by another rank's log: a new file in its place)
            live.unlink()
            live.write_bytes(other[:half])
        with pytest.raises(NotIncremental):
            readers.begin_round()


def test_a_log_whose_first_block_was_rewritten_is_not_continued_after_a_restart(job, tmp_path):
    """The block where reading resumes is as it was, an earlier one is not (a rank's log
    written again while no follower ran): a follower started again must not go on."""
    data = sorted(job.rglob("run-*.wandb"))[0].read_bytes()
    assert len(data) > 3 * BLOCK_SIZE
    live = tmp_path / "run.wandb"
    live.write_bytes(data[: 2 * BLOCK_SIZE + 500])
    readers = LiveReaders({0: [live]})
    readers.begin_round()
    while ranks := readers.live():
        readers.read(ranks, 1)
    positions = readers.positions()
    LiveReaders.resumed({0: [live]}, positions).begin_round()  # (as it was: goes on)
    changed = bytearray(live.read_bytes())
    changed[100] ^= 1  # (in the first block)
    with open(live, "r+b") as stream:  # (in place: the same file)
        stream.write(bytes(changed))
    with pytest.raises(NotIncremental, match="no longer begins as it did"):
        LiveReaders.resumed({0: [live]}, positions)


class Growing:
    """Each rank's log appearing in `live` up to given cut points, its run directory first."""

    def __init__(self, job: Path, live: Path) -> None:
        self.logs = sorted(job.rglob("run-*.wandb"))
        self.live = live
        self.cuts = {log: cut_points(log.read_bytes()) for log in self.logs}

    def grow(self, fraction: float, behind: float = 1.0) -> None:
        """Each log to the cut point at `fraction` of its cut points (1.0: all of it), the
        last rank's at `fraction * behind`."""
        for log in self.logs:
            if log == self.logs[-1]:
                fraction *= behind
            dest = self.live / log.parent.name / log.name
            if not dest.parent.exists():
                shutil.copytree(log.parent, dest.parent, ignore=shutil.ignore_patterns("*.wandb"))
            cuts = self.cuts[log]
            cut = cuts[min(len(cuts) - 1, int(fraction * (len(cuts) - 1)))]
            data = log.read_bytes()
            have = dest.stat().st_size if dest.exists() else 0
            with open(dest, "ab") as out:
                out.write(data[have : max(have, cut)])

    def truncate(self, fraction: float) -> None:
        """Every rank's log cut back to `fraction` of what it holds (a rank rewritten)."""
        for log in self.logs:
            dest = self.live / log.parent.name / log.name
            dest.write_bytes(dest.read_bytes()[: int(dest.stat().st_size * fraction)])


def follow_rounds(
    follower: Follower, growing: Growing, fractions, sink, want, seen, behind: float = 1.0
) -> None:
    for fraction in fractions:
        growing.grow(fraction, behind)
        report = follower.round()
        assert not report.done
        assert all(t.status != "failed" for t in report.targets), round_lines(report)
        seen.append(report)
        for run_id, run in sink_runs(sink).items():  # running, and a beginning of the end
            assert (run["state"], run["exit_code"]) == ("running", None)
            rows = run["history"]
            assert rows == want[run_id]["history"][: len(rows)]


FRACTIONS = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)


@pytest.mark.parametrize(
    ("run_mode", "rank_scope", "behind"),
    [*((mode, scope, 1.0) for mode, scope in MODES), ("shared", "global", 0.3)],
)
def test_incremental_rounds_end_as_one_sync(
    run_mode, rank_scope, behind, job, make_sink, monkeypatch, tmp_path, state
):
    """Every run_mode x rank_scope; and a shared run whose last rank lags far behind the
    others (their rows wait for it, round after round)."""
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode, rank_scope=rank_scope)
    want = one_shot(monkeypatch, make_sink, job, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, tmp_path / "live")
    (tmp_path / "live").mkdir()
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, FRACTIONS, sink, want, seen, behind)
        growing.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)
    # (the last round goes on from the kept merge too, a pass-through's as a shared one's)
    assert all(t.continued and t.final for t in report.targets), round_lines(report)
    sent = [t for report in seen for t in report.targets if t.status == "sent"]
    assert sum(t.added for t in sent) > 0
    continued = [t for t in sent if t.continued and t.added > 0]
    assert len(continued) >= len(want) * 3  # (pass-through targets too: `passlive`)
    # (only a rank that starts late makes a shared merge begin again)
    said = [w for r in seen for w in r.warnings if "merged from scratch" in w]
    assert all("a rank or restart started" in w for w in said) and len(said) <= 1, said


def rows_changed(change):
    """A LogWriter that writes each history record as `change` gives it (None: not at all)."""

    class Changing(LogWriter):
        def write(self, payload: bytes) -> None:
            if pb.Record.FromString(payload).HasField("history"):
                payload = change(payload)
                if payload is None:
                    return
            super().write(payload)

    return Changing


@pytest.mark.parametrize("run_mode", ["shared", "new"])
@pytest.mark.parametrize("fault", ["row left out a round before", "value changed at the end"])
def test_the_last_round_finds_what_the_kept_merge_got_wrong(
    fault, run_mode, job, make_sink, monkeypatch, tmp_path, state
):
    """The last round goes on from the kept merge (a shared one, or a pass-through's:
    `passlive`) and checks the run against the ranks' logs by what the rounds counted as
    they went (the rows sent, the records read): a row a round before left out of its
    staged log (rounds are not checked against logs still growing), or a value the last
    round's log holds changed, fails the run; it is not sent and not recorded synced."""
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode, rank_scope="global")
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, tmp_path / "live")
    (tmp_path / "live").mkdir()
    changed: list[bytes] = []

    def change_once(payload: bytes) -> bytes | None:
        if changed:
            return payload
        changed.append(payload)
        if fault.startswith("row"):
            return None
        record = pb.Record.FromString(payload)
        [item] = [i for i in record.history.item if not i.key.startswith("_")][:1]
        item.value_json = json.dumps(json.loads(item.value_json) + 0.5)
        return record.SerializeToString()

    kept = incremental if run_mode == "shared" else passlive
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        for fraction in (0.2, 0.5, 1.0):
            growing.grow(fraction)
            with monkeypatch.context() as patch:
                if fraction == (0.5 if fault.startswith("row") else 1.0):
                    patch.setattr(kept, "LogWriter", rows_changed(change_once))
                report = follower.round()
            if fraction < 1.0:
                for target in report.targets:
                    assert (target.status, target.continued) == ("sent", fraction > 0.2)
        assert changed
        # (the first run staged in that round is changed: the others end as they should)
        failed, *others = sorted(report.targets, key=lambda t: t.status != "failed")
        assert not report.done and failed.status == "failed"
        assert "the staged run lacks what its ranks logged" in failed.problems[0]
        assert "history key" in failed.problems[0], failed.problems
        assert all(t.status == "sent" and t.final and t.continued for t in others)
        runs = sink_runs(sink)
        assert runs.pop(failed.run_id)["state"] == "running"
        assert [run["state"] for run in runs.values()] == ["finished"] * len(others)


def test_a_follower_restarted_goes_on_and_a_rank_rewritten_merges_again_from_scratch(
    job, make_sink, monkeypatch, tmp_path, state
):
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared", rank_scope="global")
    want = one_shot(monkeypatch, make_sink, job, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, tmp_path / "live")
    (tmp_path / "live").mkdir()
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:  # then "killed"
        follow_rounds(follower, growing, (0.05, 0.2, 0.35, 0.5), sink, want, seen)
    assert [t.continued for r in seen for t in r.targets] == [False, True, True]
    seen.clear()
    logs = sorted((tmp_path / "live").rglob("run-*.wandb"))
    held = sum(log.stat().st_size for log in logs)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        growing.grow(0.65)
        now = sum(log.stat().st_size for log in logs)
        seen.append(follower.round())
        follow_rounds(follower, growing, (0.8,), sink, want, seen)
        growing.truncate(0.9)  # every rank loses its tail (then writes it again)
        report = follower.round()  # (the server holds rows the files lack now: refused)
        assert [t.continued for t in report.targets] == [False]
        [line] = [w for w in report.warnings if "merged from scratch" in w]  # (said once)
        assert "no longer holds what was read of it" in line and "\n" not in line
        follow_rounds(follower, growing, (0.9, 0.95), sink, want, seen)
        growing.grow(1.0)
        assert follower.round().done
    # the restarted follower goes on from the state the first one saved, reading only the
    # bytes written since (and the block where each log was left); a rewrite merges again
    assert [t.continued for r in seen for t in r.targets] == [True, True, False, True]
    [first] = seen[0].targets
    assert first.status == "sent" and first.added > 0, first.problems
    assert 0 < first.bytes_read <= now - held + len(logs) * BLOCK_SIZE < now
    assert_same_runs(sink, want)


@pytest.mark.parametrize("statistics", ["rank_stats", "skew_metrics"])
def test_a_follower_restarted_goes_on_with_statistics_across_ranks(
    statistics, job, make_sink, monkeypatch, tmp_path, state
):
    """`--rank-stats` or `--skew-metrics`: the numbers waiting for their step, each key's
    last statistics and the key ids are saved with the merge, so the restarted follower
    reads only the new bytes, and its rows hold the statistics a one-shot sync writes."""
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared", **{statistics: True})
    want = one_shot(monkeypatch, make_sink, job, request, tmp_path)
    [whole] = want.values()
    stat_key = "wbmerge/spread/" if statistics == "skew_metrics" else "/ranks/median"
    assert any(stat_key in key for key in whole["history"][-1])  # (the options reached it)
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, tmp_path / "live")
    (tmp_path / "live").mkdir()
    seen: list = []
    # (the last rank behind the others: their numbers past its step wait across the restart)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:  # then "killed"
        follow_rounds(follower, growing, (0.3, 0.5), sink, want, seen, behind=0.5)
    logs = sorted((tmp_path / "live").rglob("run-*.wandb"))
    held = sum(log.stat().st_size for log in logs)
    growing.grow(0.7, behind=0.5)
    now = sum(log.stat().st_size for log in logs)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        # (the rows of each round: the first rows of the one-shot sync's)
        follow_rounds(follower, growing, (0.7, 0.85), sink, want, seen, behind=0.5)
        growing.grow(1.0)
        assert follower.round().done
    assert [t.continued for r in seen for t in r.targets] == [False, True, True, True]
    [first] = seen[2].targets
    assert first.status == "sent" and first.added > 0, first.problems
    assert seen[2].warnings == []
    assert 0 < first.bytes_read <= now - held + len(logs) * BLOCK_SIZE < now
    assert_same_runs(sink, want)


def test_a_round_never_continues_on_rows_another_sync_sent_since(
    job, make_sink, monkeypatch, tmp_path, state
):
    """A one-shot sync of the live files between two rounds (the follower's claim on the
    run ran out) sends rows the follower's merge did not: the next round's log, which continues the rounds sent, is refused by the
    server's count instead of being sent on top of them, and the follower merges from
    scratch after it."""
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared", rank_scope="global")
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, tmp_path / "live")
    (tmp_path / "live").mkdir()
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        # Its claim on the run runs out at once, as for a follower frozen for longer than a
        # claim lives: the other sync takes the run over (see `upload.claims`).
        follower.uploads.claims.ttl = 0.1
        for fraction in (0.3, 0.5):
            growing.grow(fraction)
            [target] = follower.round().targets
            assert target.status == "sent", target.problems
        assert target.continued
        # (from another machine: its own ledger and locks; every row written so far)
        monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "other-state"))
        sync(request, timeout=UPLOAD_TIMEOUT)
        monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))
        [run] = sink_runs(sink).values()
        held = run["history"]
        assert len(held) > target.rows
        growing.grow(0.7)
        report = follower.round()
        [target] = report.targets
        assert target.status == "failed" and not target.continued
        assert f"not the {target.rows} the rounds before sent" in target.problems[0]
        assert sink_runs(sink)[run["id"]]["history"] == held  # nothing sent on top
        [target] = follower.round().targets  # (merged from scratch: it names the rows)
        assert not target.continued


def test_a_shared_follow_of_ranks_that_log_artifacts_files_them_under_the_merged_run(
    make_sink, monkeypatch, tmp_path, state
):
    """Real ranks that log a checkpoint artifact each and, on rank 0, a Table, followed
    while their logs grow: every artifact ends committed under the merged run with the
    bytes each rank wrote (a kept merge gives way to one from scratch at an artifact).
    Those rounds merged from scratch are live too: rank 1's own `seed` waits for the last."""
    job = write_job(tmp_path / "job")
    live = tmp_path / "live"
    live.mkdir()
    growing = Growing(job, live)
    request = MergeRequest(paths=[live], run_mode="shared", files_from=[job])
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        for fraction in (0.3, 0.6, 0.9):
            growing.grow(fraction)
            report = follower.round()
            assert all(t.status != "failed" for t in report.targets), round_lines(report)
            for run in sink_runs(sink).values():
                assert not [key for key in run["config"] if key.startswith("seed/")]
        assert not all(t.continued for r in [report] for t in r.targets)  # (from scratch)
        growing.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
    [run] = sink_runs(sink).values()
    assert (run["config"]["seed"], run["config"]["seed/worker-1-rank-0"]) == (0, 1)
    logged = output_artifacts(sink, JOB_ID)
    checkpoints = sorted(
        (json.loads(node.metadata)["rank"], node)
        for (name, _), node in logged.items()
        if name == "ckpt"
    )
    assert [rank for rank, _ in checkpoints] == [0, 1]
    for rank, node in checkpoints:
        assert_checkpoint_of(sink, node, rank)
    assert [name for name, _ in logged if name != "ckpt"] == [f"run-{JOB_ID}-samples"]


@pytest.mark.parametrize("started_again", [True, False])
def test_the_other_ranks_config_arrives_with_the_last_round_as_a_one_shot_sync_has_it(
    started_again, job, make_sink, monkeypatch, tmp_path, state
):
    """Each rank sets its own `seed` early on; ranks 1-3 set `shards` early, and the primary
    sets it to the same value only near its end. A one-shot sync labels each other rank's
    `seed` and no `shards`. Live rounds (before and after the follower is started again)
    hold the primary's config only: had a round sent `shards/...` while the primary lacked
    it, the server would keep it (an upload resumes from the server's config). The last
    round sends the rest, whether merged from scratch (after a start again) or by the merge
    kept since the first round."""
    own = tmp_path / "own"
    shutil.copytree(job, own)
    for rank, log in enumerate(sorted(own.rglob("run-*.wandb"))):
        payloads = list(read_payloads(log))
        seed, shards = pb.Record(), pb.Record()
        seed.config.update.add(key="seed", value_json=json.dumps(rank))
        shards.config.update.add(key="shards", value_json="8")
        payloads.insert(len(payloads) - 2 if rank == 0 else 3, shards.SerializeToString())
        payloads.insert(3, seed.SerializeToString())  # (after the header and run record)
        log.unlink()
        write_payloads(log, payloads)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    want = one_shot(monkeypatch, make_sink, own, request, tmp_path)
    [(run_id, whole)] = want.items()
    added = {k: v for k, v in whole["config"].items() if k.startswith(("seed", "shards"))}
    assert added == {
        "seed": 0,
        "shards": 8,
        "seed/worker-0-rank-1": 1,
        "seed/worker-1-rank-0": 2,
        "seed/worker-1-rank-1": 3,
    }
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(own, tmp_path / "live")
    (tmp_path / "live").mkdir()
    seen: list = []

    def live_config() -> dict:
        config = sink_runs(sink)[run_id]["config"]
        return {k: v for k, v in config.items() if k.startswith(("seed", "shards"))}

    follower = Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT)
    try:
        follow_rounds(follower, growing, (0.2, 0.4), sink, want, seen)
        assert live_config() == {"seed": 0}
        if started_again:
            follower.close()
            follower = Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT)
        follow_rounds(follower, growing, (0.7,), sink, want, seen)
        assert live_config() == {"seed": 0}
        growing.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
        [last] = report.targets
        assert last.continued == (not started_again)  # (a state taken up ends from scratch)
    finally:
        follower.close()
    assert [t.continued for r in seen for t in r.targets] == [False, True, True]
    assert live_config() == added
    assert_same_runs(sink, want)
