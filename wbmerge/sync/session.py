"""One upload session: what every upload of a sync, or of a follow's rounds, shares.

A session finds the credentials, asks the server whose key it is (a wrong URL or key fails
here, in seconds), removes what killed syncs left in staging, opens the ledger and makes
the staging directory with its owner record. It holds the runs it sends on the server
(`claims`), so that no other writer sends them at the same time. Runs go out through `deliverer`, which
builds the one `Deliverer` of a project with the session's parts; `delivery` turns a
staged run into what a deliverer sends and verifies. `close` gives everything back.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from ..merge import MergeOptions, Staged
from ..plan import Target
from ..upload import (
    Claims,
    ClaimsKind,
    Credentials,
    Delivery,
    Ledger,
    OwnerRecord,
    Progress,
    ServerClient,
    UploadSlots,
    clean_stale,
    find_credentials,
    make_staging,
    run_locks,
    state_dir,
    writer_id,
)
from ..verify import source_shortfall
from .exactlyonce import Deliverer


class UploadSession:
    """The server, the ledger, staging and the upload slots of one sync or follow.

    `parallel` is `-n` for the whole session, however many projects upload at once.
    `staging_dir`: stage there instead of in a new private directory (`--keep-staging`);
    it is then kept. `every_value`: read back every value, not a sample (`--verify full`).
    `kind`: the writer its claims name ("follow" makes other writers stop, not wait).
    """

    def __init__(
        self,
        parallel: int,
        timeout: float,
        *,
        credentials: Credentials | None = None,
        staging_dir: Path | None = None,
        keep_staging: bool = False,
        upload_progress: Callable[[Progress], None] | None = None,
        every_value: bool = False,
        resend: bool = False,
        kind: ClaimsKind = "sync",
    ) -> None:
        self.credentials = credentials or find_credentials()
        self.parallel, self.timeout = parallel, timeout
        self.every_value, self.resend = every_value, resend
        self.upload_progress = _one_at_a_time(upload_progress)
        self.client = ServerClient(self.credentials)
        try:
            self.viewer_entity = self.client.viewer_entity()  # fails in seconds, naming the URL
            clean_stale()  # leftovers of syncs that were killed, their uploaders first
            self.ledger = Ledger(state_dir() / "ledger.sqlite3")  # (a bad state dir first)
        except BaseException:
            self.client.close()
            raise
        self.own_staging = staging_dir is None
        try:  # (a TMPDIR with no room for staging: what is open is given back)
            self.staging = make_staging() if staging_dir is None else staging_dir
        except BaseException:
            self.ledger.close()
            self.client.close()
            raise
        # A run's staged files go once it is verified, unless the user keeps staging.
        self.remove_verified = self.own_staging and not keep_staging
        self.keep_staging = keep_staging
        self.owner = OwnerRecord(self.staging)  # names the uploaders running in staging
        self.slots = UploadSlots(parallel)
        host = socket.gethostname()
        writer = writer_id(host, os.path.realpath(state_dir()))
        self.kind = kind
        self.claims = Claims(self.client, writer, kind, host, os.getpid())

    def __enter__(self) -> UploadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.claims.close()
        self.ledger.close()
        self.client.close()
        if self.own_staging and not self.keep_staging:
            shutil.rmtree(self.staging, ignore_errors=True)

    def entity(self, entity: str | None) -> str | None:
        """The entity runs go to: the one asked for, else the key's default."""
        return entity or self.viewer_entity

    def key(self, entity: str | None, project: str, target: Target) -> str:
        """The ledger's key of a target run on this server."""
        return Ledger.key(self.credentials.base_url, entity, project, target)

    @contextmanager
    def locks(
        self, keys: Sequence[str], on_wait: Callable[[str], None] | None = None
    ) -> Iterator[bool]:
        """Hold the runs' locks; whether another sync held one first. A sync waited for may
        have been killed since, so its uploader is stopped before anything is asked."""
        with run_locks(state_dir() / "locks", keys, on_wait) as waited:
            if waited:
                clean_stale()
            yield waited

    def deliverer(
        self,
        project: str,
        entity: str | None,
        workdir: Path,
        expected: int = 0,
        progress: bool = True,
        say_waiting: Callable[[str, str], None] | None = None,
    ) -> Deliverer:
        """The deliverer of one project's runs, uploading from `workdir`. `expected`: how
        many runs it will be given (a batch waits for them); `progress`: whether it calls
        the session's progress callback; `say_waiting(run_id, line)`: where the line goes
        that a run waits for another writer (else to the progress callback)."""
        return Deliverer(
            self.client,
            self.credentials,
            self.ledger,
            project,
            entity,
            self.parallel,
            workdir,
            self.timeout,
            self.upload_progress if progress else None,
            staging=self.owner,
            slots=self.slots,
            claims=self.claims,
            say_waiting=say_waiting,
            expected=expected,
            remove_verified=self.remove_verified,
            every_value=self.every_value,
            resend=self.resend,
            release_verified=self.kind == "sync",
        )


def delivery_of(
    target: Target,
    staged: Staged,
    key: str,
    fingerprint: str,
    options: MergeOptions | None,
    *,
    final: bool = True,
    verified_before: bool = False,
) -> Delivery:
    """A staged run as a deliverer sends and verifies it.

    With `options`, the staged run is compared with its sources' own logs before it is
    sent (`verify.source_shortfall`), so nothing the merge left out passes as verified.
    Without, the sources are still growing (a follow's round before the last) and only
    the server is checked. A run that is not `final` stays running on the server, so
    neither its exit code nor its content as a whole are known yet.
    """
    made = Delivery(
        target.id,
        staged.run_dir,
        staged.log_path,
        key,
        fingerprint,
        final=final,
        verified_before=verified_before,
        saved_files=staged.saved_files,
        artifacts=staged.artifacts,
        config_from_log=target.kind != "shared",
    )
    if final:
        made.content, made.exit_code = staged.content, staged.exit_code
    if options is not None:
        made.source_check = partial(
            source_shortfall, target, staged.log_path, options.key_format, options.per_rank
        )
    return made


def _one_at_a_time(
    callback: Callable[[Progress], None] | None,
) -> Callable[[Progress], None] | None:
    """The upload progress callback, called by one upload at a time (they run in threads)."""
    if callback is None:
        return None
    lock = threading.Lock()

    def call(progress: Progress) -> None:
        with lock:
            callback(progress)

    return call
