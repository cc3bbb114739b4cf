"""One writer per run (`upload.claims`): the rule a writer reads a run's entries by, as a
table, and writers claiming runs of a real sink at once."""

from __future__ import annotations

import json
import threading
import time

import pytest

from wbmerge.upload import Credentials, OtherWriter, ServerClient, ServerError
from wbmerge.upload.claims import PREFIX, Claims, Entry, entries_of, verdict

NOW = 1_000_000.0
SETTLE = 5.0


def sync_entry(until: float, released: bool = False, host: str = "a") -> Entry:
    return Entry("sync", host, 7, until, released)


def follow_entry(until: float) -> Entry:
    return Entry("follow", "f", 9, until)


@pytest.mark.parametrize(
    "entries, go, wait, holder, stop",  # (holder: the host of the entry waited for)
    [
        ({}, True, 0.0, None, False),
        ({"me": sync_entry(NOW + 60)}, True, 0.0, None, False),  # its own entry
        ({"b": sync_entry(NOW + 60)}, False, 0.0, "a", False),
        ({"b": follow_entry(NOW + 60)}, False, 0.0, "f", True),
        # a follow holds it and so does a sync (they stepped back at once): a follow stops it
        ({"b": sync_entry(NOW + 60), "c": follow_entry(NOW + 30)}, False, 0.0, "f", True),
        ({"b": sync_entry(NOW - 2, released=True)}, True, 3.0, None, False),
        ({"b": sync_entry(NOW - 60, released=True)}, True, 0.0, None, False),
        ({"b": sync_entry(NOW - 1)}, True, 4.0, None, False),  # ran out a second ago
        ({"b": sync_entry(NOW - 600)}, True, 0.0, None, False),  # a writer long dead
        # released on a clock ahead of this one: waited for `SETTLE` at most
        ({"b": sync_entry(NOW + 3600, released=True)}, True, SETTLE, None, False),
    ],
)
def test_a_writer_goes_waits_or_stops_as_the_other_entries_say(entries, go, wait, holder, stop):
    found = verdict(entries, "me", NOW, SETTLE)
    assert (found.go, found.wait, found.stop) == (go, wait, stop)
    assert (found.holder.host if found.holder else None) == holder


def config_with(entries: dict[str, object]) -> str:
    return json.dumps(
        {"lr": {"value": 0.1}, **{PREFIX + k: {"value": v} for k, v in entries.items()}}
    )


def test_entries_are_read_from_the_config_and_anything_else_is_not_an_entry():
    good = {"kind": "sync", "host": "n1", "pid": 4, "until": 12.5, "released": False}
    config = config_with(
        {
            "w1": good,
            "w2": {**good, "until": "soon"},
            "w3": {**good, "pid": True},
            "w4": [1, 2],
            "w5": {**good, "released": "yes"},
            "w6": {**good, "kind": None},
        }
    )
    assert entries_of(config) == {"w1": Entry("sync", "n1", 4, 12.5, False)}
    assert entries_of(config.replace("12.5", "NaN")) == {}  # (json reads NaN: not a time)
    assert entries_of("") == entries_of("not json") == entries_of("[1]") == {}


@pytest.fixture
def client(sink):
    made = ServerClient(Credentials(sink.url, sink.api_key))
    yield made
    made.close()


def claims(client, writer: str, kind: str = "sync", **timing) -> Claims:
    timing = {"settle": 0.2, "poll": 0.05, **timing}
    return Claims(client, writer, kind, "host-" + writer, 100, **timing)


def test_a_second_writer_waits_until_the_first_releases_and_says_so_once(client):
    first, second = claims(client, "w1"), claims(client, "w2")
    assert first.take("local", "p", "run") is not None
    lines: list[str] = []
    took = threading.Event()

    def take_second():
        second.take("local", "p", "run", say=lines.append)
        took.set()

    thread = threading.Thread(target=take_second)
    thread.start()
    assert not took.wait(1.0)  # (20 looks at the run, all while the first holds it)
    assert lines == ["run: waiting for wbmerge sync on host-w1 (pid 100), which is sending it"]
    first.close()
    assert took.wait(30)
    thread.join()
    entries = entries_of(client.held("local", "p", "run").config_json)
    assert entries["w1"].released and entries["w2"].live(time.time())
    second.close()
    assert entries_of(client.held("local", "p", "run").config_json)["w2"].released


def test_a_run_a_follow_holds_is_refused_at_once(client):
    follow = claims(client, "f", kind="follow")
    follow.take("local", "p", "run")
    with pytest.raises(OtherWriter, match=r"wbmerge follow on host-f \(pid 100\) is sending it"):
        claims(client, "w").take("local", "p", "run")
    # (the refused writer's entry is left released, so it holds nothing up)
    assert entries_of(client.held("local", "p", "run").config_json)["w"].released
    follow.close()


def test_a_writer_that_died_holding_a_run_is_waited_out(client):
    dead = claims(client, "dead", ttl=1.0, renew=60.0)
    dead.take("local", "p", "run")  # (and never renewed nor released)
    ran_out = entries_of(client.held("local", "p", "run").config_json)["dead"].until
    assert claims(client, "w").take("local", "p", "run") is not None
    assert time.time() >= ran_out + 0.2  # its TTL, then the settle


def test_a_writer_renews_what_it_holds(client):
    holder = claims(client, "w", ttl=2.0, renew=0.1)
    holder.take("local", "p", "run")
    first = entries_of(client.held("local", "p", "run").config_json)["w"].until
    deadline = time.monotonic() + 30
    while entries_of(client.held("local", "p", "run").config_json)["w"].until == first:
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.05)
    holder.close()


def test_writers_claiming_one_run_at_once_never_hold_it_together(client):
    """Four writers, each taking the run, holding it a little and releasing it, 5 times:
    at no moment do two hold it. All four start together, so entries are set at once and
    writers read each other's."""
    holding: list[str] = []
    most = []
    waits: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def writer(name: str) -> None:
        for _ in range(5):
            mine = claims(client, name, settle=0.0, poll=0.02)
            if _ == 0:
                start.wait()
            assert mine.take("local", "p", "shared", say=waits.append) is not None
            with lock:
                holding.append(name)
                most.append(len(holding))
            time.sleep(0.02)
            with lock:
                holding.remove(name)
            mine.close()

    threads = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(most) == 20 and max(most) == 1
    assert waits  # (the writers did meet: the check above was put to the test)


def test_a_run_whose_read_back_failed_is_still_released(client, monkeypatch):
    """The entry is set, then the server fails to answer: the writer's close releases the
    entry all the same, so no other writer waits for it to run out."""
    writer = claims(client, "w")

    def fails(*args):
        raise ServerError("the server went away")

    with monkeypatch.context() as patch:
        patch.setattr(client, "held", fails)
        with pytest.raises(ServerError):
            writer.take("local", "p", "run")
    writer.close()
    assert entries_of(client.held("local", "p", "run").config_json)["w"].released


def test_a_run_released_early_is_neither_renewed_nor_released_again(client):
    """A sync gives back each run once it is verified: its entry says released at once, the
    renewals of the runs still held pass it over, and another writer takes it."""
    holder = claims(client, "w", renew=0.05)
    holder.take("local", "p", "done")
    holder.take("local", "p", "sending")
    holder.release("local", "p", "done")
    released = entries_of(client.held("local", "p", "done").config_json)["w"]
    assert released.released
    renewed = entries_of(client.held("local", "p", "sending").config_json)["w"].until
    deadline = time.monotonic() + 30
    while entries_of(client.held("local", "p", "sending").config_json)["w"].until == renewed:
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.05)
    assert entries_of(client.held("local", "p", "done").config_json)["w"] == released
    assert claims(client, "w2").take("local", "p", "done") is not None
    holder.close()
    assert entries_of(client.held("local", "p", "sending").config_json)["w"].released
    assert entries_of(client.held("local", "p", "done").config_json)["w"] == released
