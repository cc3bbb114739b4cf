"""The ledger under concurrent writers, the per-run locks, and stale staging of dead syncs."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

from wbmerge.upload import Ledger, clean_stale, make_staging, run_locks


def _record_many(path: str, writer: int) -> None:
    ledger = Ledger(Path(path))
    for i in range(50):
        ledger.record(f"key-{writer}-{i}", f"fp-{i}", "local")
    ledger.close()


def test_four_processes_record_at_once_and_nothing_is_lost(tmp_path):
    path = tmp_path / "state" / "ledger.sqlite3"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_record_many, args=(str(path), w)) for w in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    ledger = Ledger(path)
    for w in range(4):
        for i in range(50):
            entry = ledger.synced(f"key-{w}-{i}", f"fp-{i}")
            assert entry is not None and entry["entity"] == "local"
        assert ledger.synced(f"key-{w}-0", "another fingerprint") is None


def test_a_held_run_lock_is_waited_for_and_said(tmp_path):
    released = threading.Event()
    holding = threading.Event()

    def hold():
        with run_locks(tmp_path, ["a", "b"]):
            holding.set()
            time.sleep(0.5)
            released.set()

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    waited = []
    with run_locks(tmp_path, ["b"], on_wait=waited.append):
        assert released.is_set()  # we got it only after the other holder let go
    thread.join(10)
    assert waited == ["b"]


def test_stale_staging_of_dead_owners_is_removed(tmp_path):
    dead = make_staging(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    owner = json.loads((dead / "owner.json").read_text())
    owner.update(pid=int(gone.stdout), started="0")  # a process that has ended
    (dead / "owner.json").write_text(json.dumps(owner))
    (dead / "runs").mkdir()
    alive = make_staging(tmp_path)  # ours, and we are alive
    foreign = tmp_path / "wbmerge-staging-not-ours"  # no owner record: not ours to judge
    foreign.mkdir()
    assert clean_stale(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and foreign.exists()


def test_an_orphaned_uploader_of_a_dead_owner_is_stopped(tmp_path):
    staging = make_staging(tmp_path)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = Path(f"/proc/{orphan.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        owner = {"pid": 2**22 + 1, "started": "0", "uploader": [[orphan.pid, start]]}
        (staging / "owner.json").write_text(json.dumps(owner))
        assert clean_stale(tmp_path) == [staging]
        assert orphan.wait(timeout=10) == -9
    finally:
        orphan.kill()
        orphan.wait(timeout=10)


def test_a_process_the_dead_owner_did_not_record_but_that_works_in_its_staging_is_stopped(
    tmp_path,
):
    # wandb-core starts a moment after `wandb sync`: a sync killed in that moment has not
    # named it, and it would go on sending while the next sync asks what the server holds
    staging = make_staging(tmp_path)
    workdir = staging / "job-0" / "uploader" / "batch-0"
    workdir.mkdir(parents=True)
    unrecorded = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  cwd=workdir)  # fmt: skip
    elsewhere = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 cwd=tmp_path)  # fmt: skip
    try:
        owner = {"pid": 2**22 + 1, "started": "0", "uploader": []}
        (staging / "owner.json").write_text(json.dumps(owner))
        assert clean_stale(tmp_path) == [staging]
        assert unrecorded.wait(timeout=10) == -9
        assert elsewhere.poll() is None  # not working in the dead owner's staging: left alone
    finally:
        for proc in (unrecorded, elsewhere):
            proc.kill()
            proc.wait(timeout=10)
