"""The ledger under concurrent writers, the per-run locks, stale staging of dead syncs, and
the wait after a stopped upload."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wbmerge.upload import STANDBY, Ledger, clean_stale, make_staging, run_locks, wait_settled
from wbmerge.upload.ledger import server_key
from wbmerge.upload.processes import command_line
from wbmerge.upload.settle import SETTLE, last_stop, note_stopped


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    """wbmerge's state directory of each test, so that stops it notes stay its own."""
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


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
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    owner = json.loads((dead / "owner.json").read_text())
    owner.update(pid=int(gone.stdout), started="0")  # a process that has ended
    (dead / "owner.json").write_text(json.dumps(owner))
    (dead / "runs").mkdir()
    alive = make_staging(tmp_path)  # ours, and we are alive
    foreign = tmp_path / "wbmerge-staging-not-ours"  # no owner record: not ours to judge
    foreign.mkdir()
    written = time.time() - 3600
    os.utime(dead / "runs", (written, written))
    os.utime(dead / "owner.json", (written, written))
    assert clean_stale(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and foreign.exists()
    # it died an hour ago, as its files say: nothing it sent can still be landing
    assert abs(last_stop() - written) < 1 and wait_settled() == 0


def test_an_orphaned_uploader_of_a_dead_owner_is_stopped(tmp_path):
    # (the wandb-core it starts, and processes that are no uploader: test_staging_private)
    staging = make_staging(tmp_path)
    orphan = subprocess.Popen([sys.executable, "-c", STANDBY], cwd=staging, stdin=subprocess.PIPE)
    try:
        # An orphan of a dead sync has run for a while; one just started may not show its
        # command line in /proc yet (seen on a loaded machine), and is then rightly left
        # alone. So wait until it shows one, as every orphan does.
        deadline = time.monotonic() + 60
        while not command_line(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        start = Path(f"/proc/{orphan.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        owner = {
            "pid": 2**22 + 1,
            "started": "0",
            "uid": os.geteuid(),
            "uploader": [[orphan.pid, start]],
        }
        (staging / "owner.json").write_text(json.dumps(owner))
        assert clean_stale(tmp_path) == [staging]
        assert orphan.wait(timeout=10) == -9
        assert time.time() - last_stop() < 5  # stopped just now: the next sync waits
    finally:
        orphan.kill()
        orphan.wait(timeout=10)


def test_no_stop_noted_means_no_wait(state):
    assert last_stop() == 0 and wait_settled() == 0


def test_counts_are_read_only_once_a_stopped_uploads_requests_could_land():
    note_stopped(time.time() - SETTLE + 1)
    start = time.monotonic()
    waited = wait_settled()
    assert 0 < waited <= 1  # (however long this machine took between the two calls)
    assert time.monotonic() - start >= waited
    assert time.time() >= last_stop() + SETTLE - 0.001  # no earlier than SETTLE after it
    assert wait_settled() == 0  # settled now


def test_an_earlier_stop_does_not_replace_a_later_one():
    now = time.time()
    note_stopped(now)
    note_stopped(now - 100)
    assert last_stop() == now


def test_a_stop_noted_in_the_future_waits_no_longer_than_settle():
    note_stopped(time.time() + 3600)  # the clock was set back since
    start = time.monotonic()
    assert wait_settled(settle=0.3) == 0.3
    assert 0.3 <= time.monotonic() - start  # (it did wait; no upper bound on a busy machine)


def test_a_stop_noted_in_the_future_is_waited_for_once_not_before_every_run():
    """Each run's counts are read after `wait_settled`: a mark an hour ahead (a clock set
    back since) must not make every run of every sync wait for the next hour."""
    note_stopped(time.time() + 3600)
    assert wait_settled(settle=0.3) == 0.3
    assert [wait_settled(settle=0.3) for _ in range(3)] == [0, 0, 0]  # the seconds waited
    now = time.time()
    note_stopped(now)  # a stop after it is noted again
    assert last_stop() == now


def test_stops_noted_by_threads_at_once_are_all_noted_and_the_latest_kept():
    """An upload's thread notes its uploader's death while another thread stops the next
    uploader: no note may fail (a failed note would keep the rest from being stopped)."""
    noted: list[float] = []
    failures: list[BaseException] = []

    def note() -> None:
        for _ in range(300):
            at = time.time()
            try:
                note_stopped(at)
            except BaseException as exc:  # every failure is the finding
                failures.append(exc)
            noted.append(at)

    threads = [threading.Thread(target=note) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert last_stop() == max(noted)


def test_a_state_dir_that_cannot_be_written_loses_the_note_but_stops_nothing(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(blocker / "state"))
    note_stopped()  # must not raise: it is called while uploads are being stopped
    assert last_stop() == 0 and wait_settled() == 0


@pytest.mark.parametrize(
    "base_url, key",
    [
        ("https://api.wandb.ai", "https://api.wandb.ai"),
        ("HTTPS://API.Wandb.AI:443/", "https://api.wandb.ai"),
        ("http://127.0.0.1:80", "http://127.0.0.1"),
        ("http://127.0.0.1:8765/", "http://127.0.0.1:8765"),
        ("https://wandb.example.com:8443/prefix/", "https://wandb.example.com:8443/prefix"),
        ("http://[::1]:8080", "http://127.0.0.1:8080"),  # every name of the loopback
        ("http://localhost:8080", "http://127.0.0.1:8080"),
        ("http://LocalHost.:8080/", "http://127.0.0.1:8080"),
        ("http://wandb.localhost:8080", "http://127.0.0.1:8080"),
        ("http://127.0.1.1:8080", "http://127.0.0.1:8080"),
        ("http://[fe80::1]:8080", "http://[fe80::1]:8080"),
        ("http://10.0.0.1:8080", "http://10.0.0.1:8080"),  # other addresses as they are
        ("http://localhost.example.com", "http://localhost.example.com"),
    ],
)
def test_one_server_spelled_two_ways_is_one_ledger_key(base_url, key):
    """A sync of the same runs to `HTTPS://API.wandb.ai/` finds them in the ledger."""
    assert server_key(base_url) == key
