"""A follow's merge saved in the state directory (`follow.saved`): a follower killed and
started again goes on from its last verified round, reading only what the ranks wrote
since, and ends as a one-shot sync; a saved state that does not fit the files, the server
or this wbmerge is said in one line and the round merges from scratch, with the right
answer.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from wbmerge.follow import Follower, round_lines, saved
from wbmerge.log import BLOCK_SIZE
from wbmerge.merge import Spools
from wbmerge.sync import MergeRequest

from ..support import synthetic
from .test_follow import UPLOAD_TIMEOUT, assert_same_runs, follow_sink, one_shot
from .test_follow_incremental import Growing, follow_rounds


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A job of 2 nodes x 2 ranks whose logs span several blocks, with console lines and
    system metrics (the synthetic writer, in the shapes wandb 0.31 writes)."""
    root = tmp_path_factory.mktemp("job")
    synthetic.write_job(root, 2, 2, 300, metrics=12, job_id="saved")
    return root


REQUEST = {"run_mode": "shared", "rank_scope": "global"}


def followed_job(job, make_sink, monkeypatch, tmp_path, state):
    """A follow of `job` set up: the live folder its files grow in (empty yet), the request,
    the runs a one-shot sync of the whole files makes (what the follow must end as), the
    sink the follow sends to and the files that grow."""
    live = tmp_path / "live"
    request = MergeRequest(paths=[live], **REQUEST)
    want = one_shot(monkeypatch, make_sink, job, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, live)
    live.mkdir()
    return live, request, want, sink, growing


def saved_states(state: Path) -> list[Path]:
    return sorted(state.glob(f"follow/*/{saved.STATE_FILE}"))


def log_sizes(live: Path) -> int:
    return sum(log.stat().st_size for log in live.rglob("run-*.wandb"))


def test_a_follower_killed_goes_on_from_its_saved_state(
    job, make_sink, monkeypatch, tmp_path, state
):
    """A real `wbmerge follow` killed with SIGKILL after its first round: the next follower
    goes on from the state it saved, reading only the bytes written since."""
    live, request, want, sink, growing = followed_job(job, make_sink, monkeypatch, tmp_path, state)
    growing.grow(0.3)
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "follow",
        str(live),
        "--run-mode",
        "shared",
        "--interval",
        "0.5",
    ]
    follower = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # (said once the round is verified and saved)
        assert "running" in first, first + follower.stderr.read()  # type: ignore[union-attr]
    finally:
        os.killpg(follower.pid, signal.SIGKILL)  # (its uploader too, if one runs)
        follower.communicate(timeout=60)
    assert follower.returncode == -signal.SIGKILL
    assert len(saved_states(state)) == 1
    held = log_sizes(live)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        growing.grow(0.6)
        now = log_sizes(live)
        report = again.round()
        [target] = report.targets
        assert target.status == "sent" and target.added > 0, round_lines(report)
        assert target.continued
        assert 0 < target.bytes_read <= now - held + 4 * BLOCK_SIZE < now
        # (and the ranks' steps are counted on from where it stopped too)
        assert 0 < report.bytes_scanned <= now - held + 4 * BLOCK_SIZE
        assert report.warnings == []
        follow_rounds(again, growing, (0.8, 0.95), sink, want, seen)
        assert all(t.continued for r in seen for t in r.targets)
        growing.grow(1.0)
        assert again.round().done
    assert_same_runs(sink, want)
    assert list(state.glob("follow/*/*")) == []  # (the run is final: nothing goes on from it)


def truncate_a_rank(live: Path, state: Path) -> None:
    log = sorted(live.rglob("run-*.wandb"))[1]
    log.write_bytes(log.read_bytes()[: BLOCK_SIZE + 100])


def flip_a_byte(live: Path, state: Path) -> None:
    [path] = saved_states(state)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def another_version(live: Path, state: Path) -> None:
    [path] = saved_states(state)
    head, _, body = path.read_bytes().partition(b"\n")
    header = json.loads(head)
    header["version"] = saved.VERSION + 1
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


def lose_it(live: Path, state: Path) -> None:
    [path] = saved_states(state)
    path.unlink()


def hostile_values(live: Path, state: Path) -> None:
    """Values of the right types and a right hash that are not what a follower saves: a
    key that is not a key part, a last row that is not a record."""
    [path] = saved_states(state)
    head, _, body = path.read_bytes().partition(b"\n")
    content = json.loads(body)
    rank = content["state"]["ranks"][0][1]
    rank["known"].append(base64.b64encode(b"\x0a\xff").decode())
    content["state"]["last_row"] = base64.b64encode(b"\xff\xff\xff").decode()
    body = json.dumps(content).encode()
    header = json.loads(head)
    header["digest"] = saved.body_digest(body)
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


def statistics_not_asked_for(live: Path, state: Path) -> None:
    """The state of a merge with statistics across ranks (`--rank-stats`), for a follower
    without them (its hash right): the options differ in a way its name does not say."""
    [path] = saved_states(state)
    head, _, body = path.read_bytes().partition(b"\n")
    content = json.loads(body)
    assert content["state"]["across"] == []
    columns = [["f", ""]] * 4 + [["i", ""]] * 2
    content["state"]["across"] = [
        {
            "statistics": ["min", "median", "max", "mean", "min_rank", "max_rank"],
            "keys": [],
            "pending": [],
            "last": {"keys": "", "columns": columns},
        }
    ]
    body = json.dumps(content).encode()
    header = json.loads(head)
    header["digest"] = saved.body_digest(body)
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


FALLBACKS = {
    # case: (what changes while no follower runs, what the restarted round says)
    "truncated rank": (truncate_a_rank, "does not fit"),
    "corrupt state": (flip_a_byte, "is damaged"),
    "other version": (another_version, "is of another wbmerge"),
    "hostile values": (hostile_values, "does not fit"),
    "statistics not asked for": (statistics_not_asked_for, "does not fit"),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_a_saved_state_that_does_not_fit_merges_from_scratch(
    case, job, make_sink, monkeypatch, tmp_path, state
):
    live, request, want, sink, growing = followed_job(job, make_sink, monkeypatch, tmp_path, state)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.2, 0.4), sink, want, seen)
    change, said = FALLBACKS[case]
    change(live, state)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        if case != "truncated rank":  # (read while shorter than what the state read of it)
            growing.grow(0.6)
        report = again.round()
        [target] = report.targets
        assert not target.continued
        [line] = [w for w in report.warnings if "merged from scratch" in w]
        assert said in line and "\n" not in line
        if case == "truncated rank":  # (the server holds rows the files lack now: refused)
            assert target.status == "failed"
            growing.grow(0.6)  # (the rank writes its tail again)
            follow_rounds(again, growing, (0.6,), sink, want, [])
        else:
            assert target.status == "sent"
            assert target.bytes_read == log_sizes(live)  # (every log read whole)
        follow_rounds(again, growing, (0.8, 0.95), sink, want, seen)
        assert seen[-1].targets[0].continued  # (the new merge goes on)
        growing.grow(1.0)
        assert again.round().done
    assert_same_runs(sink, want)


def test_a_lost_state_or_one_a_round_did_not_save_merges_from_scratch(
    job, make_sink, monkeypatch, tmp_path, state
):
    """A follower killed after its upload was verified, before it saved the state: the
    state saved is of the round before, the server holds more rows than it says; then the
    state is lost altogether. Each time the round merges from scratch, right."""
    live, request, want, sink, growing = followed_job(job, make_sink, monkeypatch, tmp_path, state)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.2,), sink, want, seen)
        before = state / "before"
        shutil.copytree(state / "follow", before)
        follow_rounds(follower, growing, (0.4,), sink, want, seen)
    shutil.rmtree(state / "follow")
    before.rename(state / "follow")
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        growing.grow(0.6)
        report = again.round()
        [target] = report.targets
        assert target.status == "sent" and not target.continued, round_lines(report)
        [line] = [w for w in report.warnings if "merged from scratch" in w]
        assert f"the server holds {seen[-1].targets[0].rows} history rows, not the" in line
        follow_rounds(again, growing, (0.7,), sink, want, seen)
    lose_it(live, state)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        growing.grow(0.8)
        report = again.round()
        [target] = report.targets
        assert target.status == "sent" and not target.continued
        assert [w for w in report.warnings if "merged from scratch" in w] == [
            f"{target.run_id}: no state saved by a follower before this one: merged from scratch"
        ]
        follow_rounds(again, growing, (0.95,), sink, want, seen)
        assert seen[-1].targets[0].continued
        growing.grow(1.0)
        assert again.round().done
    assert_same_runs(sink, want)


def test_a_source_added_while_no_follower_ran_merges_from_scratch(
    job, make_sink, monkeypatch, tmp_path, state
):
    """A rank whose log was not on disk yet when the state was saved joins the run: the
    state was made of other sources, so the round merges all of them from scratch."""
    live, request, want, sink, growing = followed_job(job, make_sink, monkeypatch, tmp_path, state)
    late = growing.logs.pop()  # (the last rank starts late)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        growing.grow(0.3)
        report = follower.round()
        assert [t.status for t in report.targets] == ["sent"], round_lines(report)
    assert len(saved_states(state)) == 1
    growing.logs.append(late)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        growing.grow(0.5)
        report = again.round()
        [target] = report.targets
        assert target.status == "sent" and not target.continued, round_lines(report)
        [line] = [w for w in report.warnings if "merged from scratch" in w]
        assert "of other sources or options" in line
        growing.grow(1.0)
        assert again.round().done
    assert_same_runs(sink, want)


def test_the_spool_past_its_saved_end_is_written_over(job, make_sink, monkeypatch, tmp_path, state):
    """A round that set console lines aside and was killed before its upload leaves bytes
    in the spool past the saved end: the next follower goes on and writes over them."""
    live, request, want, sink, growing = followed_job(job, make_sink, monkeypatch, tmp_path, state)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.2, 0.4), sink, want, seen)
    [path] = saved_states(state)
    with open(path.with_name(saved.SPOOL_FILE), "ab") as spool:
        spool.write(b"\x05\x00\x00\x00stale" * 1000)
    seen.clear()
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        follow_rounds(again, growing, (0.6, 0.8), sink, want, seen)
        growing.grow(1.0)
        assert again.round().done
    assert [t.continued for r in seen for t in r.targets] == [True, True]
    assert_same_runs(sink, want)


DROP = object()  # (a field left out)
HOSTILE = {
    "not json": b"\x80\x81",
    "a number for the header": b"7\n{}",
    "a list for the state": None,  # (a right header and hash, then the wrong shapes)
    "a string for a number": {"rounds": "1"},
    "a float for a number": {"rounds": 1.5},
    "a number past 64 bits": {"rows_sent": 1 << 70},
    "bytes not in base64": {"held": "%%%"},
    "a missing field": {"seen": DROP},
    "a rank twice": {"ranks": [[0, {}], [0, {}]]},
    "deep nesting": {"events": [[[[[[[[[[1]]]]]]]]]] * 3},
    "statistics' arrays of 3": {
        "across": [
            {
                "statistics": [],
                "keys": [],
                "pending": [["", "", ""]],
                "last": {"keys": "", "columns": []},
            }
        ]
    },
}


def test_a_state_file_of_any_shape_is_refused_in_one_phrase(tmp_path):
    place = tmp_path / "place"
    good = {
        "rounds": 1,
        "rows_sent": 0,
        "others_sent": [],
        "held": None,
        "step_runs": [],
        "last_row": None,
        "readers": {},
        "ranks": {},
        "pending": {"steps": [], "ranks": [], "labelled": [], "names": [], "reserved": []},
        "events": [],
        "seen": [],
        "spool": {"end": 0, "digest": b"", "writers": {}},
        "across": [
            {
                "statistics": ["spread"],
                "keys": [b"\n\x01a"],
                "pending": [(b"\x01" * 8, b"\0" * 8, b"\0" * 8, b"\x7f\xf8" + b"\0" * 6)],
                "last": {"keys": b"", "columns": [("f", b"")]},
            }
        ],
    }
    saved.save(place, "made", good)
    assert saved.load(place, "made") == good
    with pytest.raises(saved.Unusable, match="other sources or options"):
        saved.load(place, "other")
    path = place / saved.STATE_FILE
    head, _, body = path.read_bytes().partition(b"\n")
    for case, change in HOSTILE.items():
        if isinstance(change, bytes):
            data = change
        else:
            state = json.loads(body)["state"]
            if change is None:
                state = [state]
            for name, value in (change or {}).items():
                if value is DROP:
                    del state[name]
                else:
                    state[name] = value
            new_body = json.dumps({"made_for": "made", "state": state}).encode()
            header = json.loads(head)
            header["digest"] = saved.body_digest(new_body)
            data = json.dumps(header).encode() + b"\n" + new_body
        path.write_bytes(data)
        with pytest.raises(saved.Unusable) as found:
            saved.load(place, "made")
        assert "\n" not in str(found.value), case


def test_a_spool_that_does_not_hold_what_was_saved_is_refused(tmp_path):
    """The console and system-metric spool kept beside the state: read back as saved, past
    bytes a round that did not end wrote; refused when shorter or changed."""
    path = tmp_path / saved.SPOOL_FILE
    source = SimpleNamespace(path=tmp_path / "run-a.wandb")
    payloads = [bytes([n]) * 3000 for n in range(7)]  # (two segments and a buffer)
    spools = Spools.kept(path)
    writer = spools.writer(source)  # type: ignore[arg-type]
    for payload in payloads:
        writer.write(payload)
    spools.sync()
    state = spools.state()
    spools.close()
    with open(path, "ab") as stream:
        stream.write(b"\x09\x00\x00\x00left over" * 10)
    again = Spools.kept(path, state)
    assert list(again.read(source)) == payloads  # type: ignore[arg-type]
    again.writer_of(source.path).write(b"more")  # type: ignore[union-attr]
    assert list(again.read(source)) == [*payloads, b"more"]  # type: ignore[arg-type]
    again.close()
    data = path.read_bytes()
    assert len(data) >= state["end"] > 0
    path.write_bytes(data[: state["end"] // 2])
    with pytest.raises(ValueError, match="shorter"):
        Spools.kept(path, state)
    changed = bytearray(data)
    changed[state["end"] // 2] ^= 1
    path.write_bytes(bytes(changed))
    with pytest.raises(ValueError, match="does not hold"):
        Spools.kept(path, state)
