"""Every kind of fallback a follow round gives, driven through real rounds: each is acted on
in `Follower.fall_back`, the one place that does, and said in its one line, or not said.

A fallback is a value (`follow.fallback.Fallback`), not an exception: the round that cannot
go on with a target's kept merge drops it and merges the target from scratch. Every line
"<run id>: <reason>: merged from scratch" a round says must come from that place.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from wbmerge.follow import Follower, RoundReport
from wbmerge.follow.fallback import LAST_ROUND, NOT_KEPT, UNVERIFIED, Fallback
from wbmerge.sync import MergeRequest, sync
from wbmerge.training import RankInfo

from ..support import synthetic
from ..support.ranklogs import exit_record, history_record, rank_log
from .test_follow import UPLOAD_TIMEOUT, follow_sink
from .test_follow_incremental import Growing
from .test_follow_saved import flip_a_byte, lose_it, saved_states

SHARED = {"run_mode": "shared", "rank_scope": "global"}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A job of 2 nodes x 2 ranks whose logs span several blocks (the synthetic writer)."""
    root = tmp_path_factory.mktemp("job")
    synthetic.write_job(root, 2, 2, 300, metrics=12, job_id="fallback")
    return root


def follower(request: MergeRequest) -> Follower:
    return Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT)


def a_rank_starts_late(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """The last rank's log appears after the first round: the kept merge was made of the
    other ranks."""
    growing = Growing(job, live)
    late = growing.logs.pop()
    with follower(MergeRequest(paths=[live], **SHARED)) as rounds:
        growing.grow(0.3)
        first = rounds.round()
        growing.logs.append(late)
        growing.grow(0.5)
        return [first, rounds.round()]


def a_rank_rewritten(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """Every rank's log loses its tail between two rounds of one follower."""
    growing = Growing(job, live)
    with follower(MergeRequest(paths=[live], **SHARED)) as rounds:
        reports = []
        for fraction in (0.3, 0.5):
            growing.grow(fraction)
            reports.append(rounds.round())
        growing.truncate(0.9)
        return [*reports, rounds.round()]


def restarted_after(change: Callable[[Path, Path], None]):
    """A follower that saved its state after a round; `change(live, state)`; another
    follower started on the same paths."""

    def scenario(job: Path, live: Path, state: Path) -> list[RoundReport]:
        growing = Growing(job, live)
        request = MergeRequest(paths=[live], **SHARED)
        with follower(request) as rounds:
            growing.grow(0.3)
            first = rounds.round()
        change(live, state)
        with follower(request) as again:
            growing.grow(0.5)
            return [first, again.round()]

    return scenario


def a_state_a_round_behind(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """The state saved after the first of two rounds, put back: the server holds more rows
    than it says were sent."""
    growing = Growing(job, live)
    request = MergeRequest(paths=[live], **SHARED)
    with follower(request) as rounds:
        growing.grow(0.2)
        reports = [rounds.round()]
        shutil.copytree(state / "follow", state / "before")
        growing.grow(0.4)
        reports.append(rounds.round())
    shutil.rmtree(state / "follow")
    (state / "before").rename(state / "follow")
    with follower(request) as again:
        growing.grow(0.6)
        return [*reports, again.round()]


def every_ranks_system_metrics(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """`auto` with every rank's system metrics: no merge is kept between rounds."""
    growing = Growing(job, live)
    with follower(MergeRequest(paths=[live], run_mode="auto", system_metrics="all")) as rounds:
        growing.grow(0.3)
        return [rounds.round()]


def a_sync_sent_rows_early(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """A one-shot sync sent rows of rank 0 that rank 1 has not logged (as in
    `test_rows_a_sync_sent_before_every_rank_logged_them_are_named`): the new kept merge
    holds fewer rows than the server, and the last round's upload is refused."""
    full = live.parent / "full"
    for root, steps in ((live, (range(6), range(4))), (full, (range(6), range(6)))):
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, job_id="early")
            with rank_log(root, info, f"early-{rank}", "p") as writer:
                for step in steps[rank]:
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                if root == full:
                    writer.write(exit_record(0))
    request = MergeRequest(paths=[live], run_mode="shared")
    sync(request, timeout=UPLOAD_TIMEOUT)
    with follower(request) as rounds:
        first = rounds.round()
        for log in full.glob("wandb/*/run-*.wandb"):
            shutil.copy(log, live / log.relative_to(full))
        return [first, rounds.round()]


def the_last_round(job: Path, live: Path, state: Path) -> list[RoundReport]:
    """Every rank finished, and the merge was taken up from a saved state (its counts for
    the check are not saved): the last round is merged whole, as a one-shot sync merges
    it. (A merge kept by the same follower ends the run itself.)"""
    growing = Growing(job, live)
    with follower(MergeRequest(paths=[live], **SHARED)) as rounds:
        growing.grow(0.5)
        first = rounds.round()
    with follower(MergeRequest(paths=[live], **SHARED)) as rounds:
        growing.grow(1.0)
        last = rounds.round()
        assert last.done
        return [first, last]


# name: (the rounds, the reason's words, said, the saved state forgotten, a state saved
# before the fallback: without one, there is nothing on disk to forget or keep)
CASES = {
    "a rank starts": (a_rank_starts_late, "a rank or restart started", True, True, True),
    "a log rewritten": (
        a_rank_rewritten,
        "no longer holds what was read of it",
        True,
        True,
        True,
    ),
    "state lost": (
        restarted_after(lose_it),
        "no state saved by a follower before this one",
        True,
        True,
        False,
    ),
    "state damaged": (restarted_after(flip_a_byte), "is damaged", True, True, True),
    "state a round behind": (
        a_state_a_round_behind,
        "a follower before this one saved does not fit (the server holds",
        True,
        True,
        True,
    ),
    "server rows sent early": (
        a_sync_sent_rows_early,
        "the server holds 6 history rows, not what it sent",
        False,
        True,
        False,
    ),
    "upload refused": (a_sync_sent_rows_early, UNVERIFIED.reason, False, True, False),
    "the last round": (the_last_round, LAST_ROUND.reason, False, False, True),
    "a kind not kept": (every_ranks_system_metrics, NOT_KEPT.reason, False, False, False),
}


@pytest.mark.parametrize("case", CASES)
def test_each_fallback_is_acted_on_in_one_place_and_says_its_line(
    case, job, make_sink, monkeypatch, tmp_path, state
):
    scenario, words, said, forget, held = CASES[case]
    acted: list[tuple[str, Fallback, RoundReport]] = []
    # the saved states on disk just before and just after each fallback was acted on
    on_disk: list[tuple[dict[Path, bytes], dict[Path, bytes]]] = []
    fall_back = Follower.fall_back

    def spy(self, run_id: str, fallback: Fallback, report: RoundReport) -> None:
        acted.append((run_id, fallback, report))
        before = {path: path.read_bytes() for path in saved_states(state)}
        fall_back(self, run_id, fallback, report)
        on_disk.append((before, {path: path.read_bytes() for path in saved_states(state)}))

    monkeypatch.setattr(Follower, "fall_back", spy)
    follow_sink(make_sink, monkeypatch, state)
    live = tmp_path / "live"
    live.mkdir()
    reports = scenario(job, live, state)
    found = [
        (run_id, f, report, disk)
        for (run_id, f, report), disk in zip(acted, on_disk, strict=True)
        if words in f.reason
    ]
    assert found, [f.reason for _, f, _ in acted]
    for run_id, fallback, report, (before, after) in found:
        assert (fallback.said, fallback.forget) == (said, forget)
        lines = [w for w in report.warnings if fallback.reason in w]
        assert lines == ([fallback.line(run_id)] if said else [])
        # the one run's saved state went when it is forgotten, else it stayed as it was
        assert len(before) == held
        assert after == ({} if forget else before)
    # every "merged from scratch" a round said is the line of a fallback acted on
    lines = [w for report in reports for w in report.warnings if "merged from scratch" in w]
    made = {fallback.line(run_id) for run_id, fallback, _ in acted if fallback.said}
    assert set(lines) <= made and (lines or not said)


def test_a_fallback_line_names_the_run_and_its_reason():
    assert Fallback("a rank or restart started").line("run-1") == (
        "run-1: a rank or restart started: merged from scratch"
    )
