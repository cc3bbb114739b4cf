"""An upload session that cannot open all of its parts gives back those it opened."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from wbmerge.errors import WbmergeError
from wbmerge.sync import UploadSession
from wbmerge.upload import Credentials


def open_files() -> set[Path]:
    """The files this process holds open (Linux)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(Path(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # (the listing's own descriptor, closed since)
    return found


def test_a_session_without_room_for_staging_closes_its_ledger(sink, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))

    def no_room(*args: object, **kwargs: object) -> str:  # (a full TMPDIR)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkdtemp", no_room)
    with pytest.raises(WbmergeError, match="No space left") as failed:
        UploadSession(1, 10.0, credentials=Credentials(sink.url, sink.api_key))
    # (while the caller still holds the error, as a library's caller may)
    assert failed.value is not None
    assert [path for path in open_files() if state in path.parents] == []
