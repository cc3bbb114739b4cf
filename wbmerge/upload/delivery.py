"""One staged run to deliver, what became of it, and how far an upload of many runs is.

`sync.exactlyonce.Deliverer` fills these in as it asks the server, sends and verifies; `verify.readback`
reads them to compare the server's run with the staged one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..merge import LoggedArtifact
from ..wandbcore import StagedContent


@dataclass
class Delivery:
    """One staged run to deliver: where it is, and under which ledger key."""

    run_id: str
    run_dir: Path
    log: Path
    key: str
    fingerprint: str
    content: StagedContent | None = None
    problems: list[str] = field(default_factory=list)
    verified: bool = False
    # The server holds rows of this run that are not a beginning of it: a rerun refuses too.
    refused: bool = False
    # A refused run that `sync --resend` would leave exact (`Mismatch.resend_mends`; rows
    # lost inside it): only then is `--resend` advised.
    resend_mends: bool = True
    # Recorded in the ledger once verified. A live round of `sync --follow` sends runs that
    # are not done yet: verified, but not recorded, so that later rounds send the rest.
    final: bool = True
    # This ledger verified the run from these very files (a `--force` sync): the files
    # wandb-core made need not be read back.
    verified_before: bool = False
    exit_code: int = 0  # the staged run's: a whole upload leaves it finished, or failed
    # The server held the whole run already (`Deliverer.prepare`): verified, nothing sent.
    held_already: bool = False
    # The first rows of the staged log that the server held already, cut from `log` before
    # the upload (`remainder`): `log`'s row i is the staged run's row `rows_cut + i`.
    rows_cut: int = 0
    # Given when `log` comes cut already (a round of a follow that continues the rounds
    # before): the staged run's row `rows_cut - 1`, the last the server must hold, as
    # wandb-core sends it. `content` then counts the whole run, not the log.
    row_before: dict | None = None
    # The steps of the first rows of the staged run as an earlier verified upload of this
    # process read them back from the server (a follow's rounds): when the staged run
    # sends its first rows at these very steps and the server held them before this
    # upload (`rows_cut` reaches past them), only the rows after them are read back.
    steps_checked: Sequence[int] = ()
    warnings: list[str] = field(default_factory=list)  # what the user should know of it
    # The saved files (`wandb.save` links) of the sources by staged name, with their sizes
    # read from the sources (`Staged.saved_files`): each must be on the server after the
    # upload, whatever the staged `files/` holds.
    saved_files: dict[str, int] = field(default_factory=dict)
    # The artifacts the run logs, as read from the sources (`Staged.artifacts`): each must
    # be committed under the run with its digest and every file's size and MD5.
    artifacts: list[LoggedArtifact] = field(default_factory=list)
    # What the staged run lacks of what its ranks logged, compared before it is sent
    # (`sourcecheck.source_shortfall` with its arguments bound); None: not compared (a
    # round of a follow, whose log is cut).
    source_check: Callable[[], list[str]] | None = field(default=None, repr=False, compare=False)
    # The staged run lacks what its ranks logged (`source_check`): not sent, and neither a
    # rerun nor other run ids would help, so no advice follows its line.
    merge_fault: bool = False
    # Verified whole on the server, but the ledger could not record it (a full disk): not
    # `verified`, so the sync fails; its line says the run is whole, and no other advice
    # follows it (a rerun with room records it without sending it).
    unrecorded: bool = False
    # Every config key the server may hold of the run is set by the staged log's records:
    # not so for a shared run, whose labelled keys (`lr/rank-1`) come and go as the ranks
    # log, so a key an earlier sync of it sent may be missing from a later merge.
    config_from_log: bool = True
    # held by the thread counting what the staged log holds (`content`), so it is counted once
    counting: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def config_checked(self) -> bool:
        """Whether a config key the server holds that none of the staged log's records
        sets fails the run: the one rule of every check of the config, after an upload,
        of a run found whole, and before one. Not for a log cut already (its records are
        not all the run's; a follow's last round sends the whole run and is checked), nor
        for a shared run (`config_from_log`)."""
        return self.row_before is None and self.config_from_log


@dataclass
class Progress:
    """How far an upload is: runs verified of all, and history rows the server holds."""

    done: int
    total: int
    rows: int
    message: str = ""  # a line to say once: a run finished, failed or sent again


@dataclass
class DeliveryReport:
    entity: str | None
    timed_out: bool = False
    failed: list[Delivery] = field(default_factory=list)
