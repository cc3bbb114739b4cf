"""Why a follow round merges a target from scratch instead of going on with its kept merge.

A round that cannot continue the merge it kept between rounds (`incremental`, `passlive`)
gets a `Fallback`, a value, not an exception. The round acts on it in one place
(`rounds.Follower.fall_back`): it drops the kept merge, says one line, and the target is
merged from scratch. Real errors (bad input, a server that fails) stay exceptions.

Two exceptions stay inside their modules, where a value would contort the code: the readers
and merges deep in a round raise `NotIncremental`, and `saved.load` raises `Unusable`. A
kept merge's `stage`, and the round that loads a saved state, turn them into a Fallback.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fallback:
    """A reason to merge a target from scratch this round.

    `said`: the user is told, in one warning line; False when it is the normal course
    (the last round is merged whole) or something else says it. `forget`: the kept
    merge's saved state goes too (it went wrong, and a follower started again must not go
    on from it); False when it is still sound."""

    reason: str
    said: bool = True
    forget: bool = True

    def line(self, run_id: str) -> str:
        """The warning a round gives for this fallback of run `run_id`."""
        return f"{run_id}: {self.reason}: merged from scratch"


# A pass-through log with no run record yet: it comes soon, which is no fault to be said.
NOT_YET = Fallback("its run record is not written yet", said=False)
# Every rank finished and no kept merge can end the run (one made in this process for the
# same sources does): the last round is a one-shot merge of the files, as sync makes it.
LAST_ROUND = Fallback("every rank finished: the last round is merged whole", False, False)
# A round's upload not verified: its problems say why; the next round merges from scratch.
UNVERIFIED = Fallback("its upload was not verified", said=False)
# A kind not kept between rounds (`auto` with every rank's system metrics).
NOT_KEPT = Fallback("its kind is merged whole every round", said=False, forget=False)


def restarted() -> Fallback:
    """A rank or restart started since the kept merge was made."""
    return Fallback("a rank or restart started")


def server_rows_differ(server_rows: int, rows_sent: int) -> Fallback:
    """The server holds other rows than the kept merge sent. Not said when it sent none:
    the round's cut says those rows (another sync sent them)."""
    if rows_sent:
        return Fallback(f"the server holds {server_rows} history rows, not the {rows_sent} it sent")
    return Fallback(f"the server holds {server_rows} history rows, not what it sent", said=False)


def no_saved_state() -> Fallback:
    """The server holds rows, and no follower before this one saved a state to go on from."""
    return Fallback("no state saved by a follower before this one")


def saved_misfit(state_file: object, why: str) -> Fallback:
    """A state a follower before this one saved, taken up, does not fit (`why`)."""
    return Fallback(f"the state {state_file} a follower before this one saved does not fit ({why})")
