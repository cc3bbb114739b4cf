"""A follow's saved state forged field by field (`follow.saved`): every value of the right
type, the file's hash made anew, yet not what the follower saved. Whatever the state says,
a follower started again either goes on exactly as from the true state, or drops it with
one line naming the file and merges from scratch; and the server ends exactly as a
one-shot sync of the files makes it, with no run the files do not name.

Each mode's follow (a shared run; `new`, a pass-through run per rank) is run once to a
saved state after two rounds, and the server, the state directory and the files are kept;
each case starts from a copy of them, forges one field of one run's state and follows the
job to its end.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from wbmerge.follow import Follower, round_lines, saved
from wbmerge.log import pb
from wbmerge.sync import MergeRequest

from ..support import synthetic
from ..support.sinktools import SinkProcess
from .test_follow import (
    UPLOAD_TIMEOUT,
    assert_same_run,
    assert_same_runs,
    one_shot,
    sink_runs,
    use_sink,
)
from .test_follow_incremental import Growing

FORGED_RANK = 1  # (in `shared`, not the primary; in `new`, the run of this rank is forged)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("forged-job")
    synthetic.write_job(root, 2, 2, 300, metrics=6, job_id="forged")
    return root


class Kept:
    """A mode's follow stopped after two rounds: the server, the state and the files as
    they were then, and what the follow must show after the next round and at its end."""

    def __init__(self, root: Path, job: Path, run_mode: str) -> None:
        self.root, self.job = root, job
        self.request = MergeRequest(paths=[root / "live"], run_mode=run_mode)
        self.sink = SinkProcess(root / "sink")
        with pytest.MonkeyPatch.context() as patch:
            started: list[SinkProcess] = []
            self.want = one_shot(patch, _sinks(root, started), job, self.request, root)
            started[0].stop()
            self.sink.start()
            self._env(patch)
            (root / "live").mkdir()
            growing = Growing(job, root / "live")
            with Follower(self.request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
                for fraction in (0.2, 0.4):
                    growing.grow(fraction)
                    report = follower.round()
                    assert [t.status for t in report.targets] == ["sent"] * len(report.targets)
        self.sink.stop()
        self.port = int(self.sink.url.rsplit(":", 1)[1])
        for name in ("sink", "state", "live"):
            shutil.copytree(root / name, root / f"kept-{name}")
        self.next_round: dict | None = None  # the runs after the next round, true state

    def _env(self, patch: pytest.MonkeyPatch) -> None:
        use_sink(patch, self.sink)
        patch.setenv("WBMERGE_STATE_DIR", str(self.root / "state"))

    def restore(self, patch: pytest.MonkeyPatch) -> Path:
        """Server, state and files as they were kept (the files copied: their saved
        device and inode left out, as a follower saves them before it read a file); the
        path of the state to forge."""
        self.sink.stop()
        for name in ("sink", "state", "live"):
            shutil.rmtree(self.root / name, ignore_errors=True)
            shutil.copytree(self.root / f"kept-{name}", self.root / name)
        states = sorted((self.root / "state").glob(f"follow/*/{saved.STATE_FILE}"))
        for path in states:
            rewrite(path, self._new_identities)
        self.sink.port = self.port
        self.sink.start()
        self._env(patch)
        mine = f"syn{FORGED_RANK:04d}r00"
        [path] = [
            p
            for p in states
            if self.request.run_mode == "shared"
            or any(mine in name for name, _ in read_state(p)["spool"]["writers"])
        ]
        return path

    @staticmethod
    def _new_identities(state: dict) -> None:
        for _, reader in state["readers"]:
            for source in reader["sources"]:
                if source["identity"] is not None:
                    source["identity"] = None  # (checked by its digest alone: a copy)

    def follow_on(self) -> tuple[list, dict]:
        """Follow the job from the state restored: a round with the files grown, then the
        last one. The reports of both, and the runs after the first."""
        growing = Growing(self.job, self.root / "live")
        reports = []
        with Follower(self.request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
            growing.grow(0.6)
            reports.append(follower.round())
            runs = sink_runs(self.sink)
            growing.grow(1.0)
            reports.append(follower.round())
        return reports, runs


def _sinks(root: Path, started: list) -> Callable[[], SinkProcess]:
    def start() -> SinkProcess:
        sink = SinkProcess(root / "one-shot-sink")
        started.append(sink)
        return sink.start()  # type: ignore[return-value]

    return start


def read_state(path: Path) -> dict:
    return json.loads(path.read_bytes().partition(b"\n")[2])["state"]


def rewrite(path: Path, change: Callable[[dict], None]) -> None:
    """`change` the state saved in `path`, its hash made anew (as a forger would)."""
    head, _, body = path.read_bytes().partition(b"\n")
    content = json.loads(body)
    change(content["state"])
    body = json.dumps(content).encode()
    header = json.loads(head)
    header["digest"] = saved.body_digest(body)
    path.write_bytes(json.dumps(header).encode() + b"\n" + body)


@pytest.fixture(scope="module")
def kept(job, tmp_path_factory):
    made: dict[str, Kept] = {}

    def get(run_mode: str) -> Kept:
        if run_mode not in made:
            made[run_mode] = Kept(tmp_path_factory.mktemp(f"kept-{run_mode}"), job, run_mode)
        return made[run_mode]

    yield get
    for one in made.values():
        one.sink.stop()


# Forged values, each of the right type (the file's checks pass) and wrong.
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def record(**fields) -> bytes:
    found = pb.Record(**fields)
    return found.SerializeToString()


def config_record(key: str, value: str) -> bytes:
    found = pb.Record()
    item = found.config.update.add()
    item.key, item.value_json = key, value
    return found.SerializeToString()


def row(step: int, value: str = "0.5", key: str = "train/metric_00") -> bytes:
    found = pb.Record()
    found.history.step.num = step
    item = found.history.item.add()
    item.key, item.value_json = "_step", str(step)
    item = found.history.item.add()
    item.key, item.value_json = key, value
    return found.SerializeToString()


def changed_row(payload: str, step_by: int = 0) -> str:
    """A row of the state with its first metric's value changed (and its step moved)."""
    found = pb.Record.FromString(unb64(payload))
    found.history.step.num += step_by
    for item in found.history.item:
        if item.key == "_step" or list(item.nested_key) == ["_step"]:
            item.value_json = str(found.history.step.num)
        elif not item.key.startswith("_"):
            item.value_json = "12345.5"
            break
    return b64(found.SerializeToString())


def changed_run(payload: str, *, run_id: str | None = None, config: str | None = None) -> str:
    found = pb.Record.FromString(unb64(payload))
    if run_id is not None:
        found.run.run_id = run_id
    if config is not None:
        item = found.run.config.update.add()
        item.key, item.value_json = config, '"forged"'
    return b64(found.SerializeToString())


def flipped(text: str) -> str:
    data = bytearray(unb64(text))
    data[len(data) // 2] ^= 0x5A
    return b64(bytes(data))


def rank_of(state: dict, rank: int = FORGED_RANK) -> dict:
    return dict(state["ranks"])[rank]


def reader_of(state: dict) -> dict:
    readers = dict(state["readers"])
    return readers[FORGED_RANK if FORGED_RANK in readers else 0]["sources"][0]


def setter(path: str, value: Callable[[dict], object]) -> Callable[[dict], None]:
    """A change of the value at `path` (dots; `ranks.*` the forged rank's, `readers.*.`
    its first source) to `value(state)`. (A case's name is the path, then what it forges
    when a field has several cases.)"""

    def change(state: dict) -> None:
        new = value(state)
        parts = path.split(".")
        if parts[0] == "ranks":
            rank_of(state)[parts[2]] = new
        elif parts[0] == "readers" and parts[2] == "sources":
            reader_of(state)[parts[4]] = new
        elif parts[0] == "readers":
            dict(state["readers"])[FORGED_RANK if len(state["readers"]) > 1 else 0][parts[2]] = new
        elif len(parts) == 2:
            state[parts[0]][parts[1]] = new
        else:
            state[parts[0]] = new

    return change


BOTH = {
    "rounds": lambda s: s["rounds"] + 7,
    "rows_sent": lambda s: s["rows_sent"] - 1,
    "held": lambda s: changed_row(s["held"]),
    "step_runs": lambda s: [[s["step_runs"][0][0] + 1, s["step_runs"][0][1]]],
    "last_row": lambda s: changed_row(s["last_row"]),
    "last_row (none)": lambda s: None,
    "held (not a record)": lambda s: b64(b"\x0a\xff\xff"),
    "readers.*.current": lambda s: 1,
    "readers.*.sources.*.offset": lambda s: reader_of(s)["offset"] + 32768,
    "readers.*.sources.*.resume": lambda s: reader_of(s)["resume"] - 100,
    "readers.*.sources.*.partial": lambda s: [b64(b"\x08\x01")],
    "readers.*.sources.*.digest": lambda s: flipped(reader_of(s)["digest"]),
    "readers.*.sources.*.identity": lambda s: [1, 2],
    "readers.*.sources.*.started": lambda s: not reader_of(s)["started"],
    "readers.*.sources.*.ended": lambda s: not reader_of(s)["ended"],
    "readers.*.sources.*.size_at_end": lambda s: 12345,
    "readers.*.sources.*.exit_seen": lambda s: not reader_of(s)["exit_seen"],
    "readers.*.sources.*.head": lambda s: flipped(reader_of(s)["head"]),
    "spool.end": lambda s: s["spool"]["end"] + 10,
    "spool.digest": lambda s: flipped(s["spool"]["digest"]),
    "spool.writers": lambda s: [
        [name, [[], [], flipped(w[2])]] for name, w in s["spool"]["writers"]
    ],
}

SHARED = {
    **BOTH,
    "others_sent": lambda s: [*s["others_sent"], b64(config_record("forged", '"yes"'))],
    "others_sent (not a record)": lambda s: [b64(b"\x0a\xff\xff")],
    "ranks.*.known": lambda s: [b64(b"\x12\x0ftrain/forged_00"), *rank_of(s)["known"][1:]],
    "ranks.*.summary": lambda s: [[k, b64(b"\x82\x01\x0412.5")] for k, _ in rank_of(s)["summary"]],
    "ranks.*.exit": lambda s: b64(record(exit=pb.RunExitRecord(exit_code=3))),
    "ranks.*.steps": lambda s: [rank_of(s)["steps"][0] + 40, rank_of(s)["steps"][1]],
    "ranks.*.seq": lambda s: rank_of(s)["seq"] + 5,
    "ranks.*.last_key": lambda s: [10**9],
    "ranks.*.last_rows": lambda s: 10**6,
    "ranks.*.globs": lambda s: [b64(b"\x0a\x02zz")],
    "ranks.*.named": lambda s: ["train/metric_00"],
    "ranks.*.spool": lambda s: None,
    "pending.steps": lambda s: [10**6],
    "pending.ranks": lambda s: [FORGED_RANK],
    "pending.labelled": lambda s: [b64(row(10**6))],
    "pending.names": lambda s: [["train/metric_00"]],
    "pending.reserved": lambda s: [b64(b"")],
    "events": lambda s: [[[1, 1, FORGED_RANK, 1], b64(b"\x0a\xff\xff")]],
    "seen": lambda s: [b64(config_record("forged", "1"))],
    "across": lambda s: [
        {
            "statistics": ["min"],
            "keys": [],
            "pending": [],
            "last": {"keys": "", "columns": [["f", ""]]},
        }
    ],
}

PASSTHROUGH = {
    **BOTH,
    "head": lambda s: [s["head"][0], changed_run(s["head"][1], run_id="victim-run")],
    "head (config)": lambda s: [s["head"][0], changed_run(s["head"][1], config="forged")],
    "before_run": lambda s: [b64(config_record("forged", '"yes"'))],
    "waiting": lambda s: [["config", -1, b64(config_record("forged", '"yes"'))]],
    "waiting (a row)": lambda s: [["history", 10**6, b64(row(10**6))]],
    "steps": lambda s: [s["steps"][0] + 50, 0],
    "summary": lambda s: [
        [["train/forged"], False, b64(b"\x12\x0ctrain/forged\x82\x01\x011")],
        *s["summary"],
    ],
}

CASES = [("shared", name) for name in SHARED] + [("new", name) for name in PASSTHROUGH]


def leaf_fields(shape: object, prefix: str = "") -> set[str]:
    """The names of a state's fields (`saved.STATE`), a map's or list's entries as `*`."""
    if isinstance(shape, dict):
        found = set()
        for name, inner in shape.items():
            deeper = leaf_fields(inner, f"{prefix}{name}.")
            found |= deeper or {prefix + name}
        return found
    if isinstance(shape, tuple) and shape[0] in ("int_map", "str_map", "list"):
        if isinstance(shape[1], dict):
            return leaf_fields(shape[1], f"{prefix}*.")
    return set()


def test_every_field_is_forged():
    """The table forges every field of both shapes of state (statistics across ranks are
    forged whole: `MergedRankStats.restore` checks their parts)."""
    for shape, table in ((saved.STATE, SHARED), (saved.PASSTHROUGH, PASSTHROUGH)):
        fields = {f for f in leaf_fields(shape) if not f.startswith("across.")} | {"across"}
        fields -= {"across"} if shape is saved.PASSTHROUGH else set()
        forged = {name.split(" ")[0] for name in table}
        assert fields <= forged, fields - forged


@pytest.mark.parametrize(("run_mode", "name"), CASES)
def test_a_forged_state_goes_on_as_the_true_one_or_is_dropped(run_mode, name, kept, monkeypatch):
    base = kept(run_mode)
    if base.next_round is None:  # (the true state: the runs after its next round)
        base.restore(monkeypatch)
        reports, runs = base.follow_on()
        first, last = reports
        assert first.warnings == [], round_lines(first)
        assert all(t.status == "sent" and t.continued for t in first.targets)
        assert last.done, round_lines(last)
        assert_same_runs(base.sink, base.want)
        base.next_round = runs
    table = SHARED if run_mode == "shared" else PASSTHROUGH
    path = base.restore(monkeypatch)
    rewrite(path, setter(name.split(" ")[0], table[name]))
    reports, runs = base.follow_on()
    first, last = reports
    assert all(t.status == "sent" for t in first.targets), round_lines(first)
    dropped = [w for w in first.warnings if "merged from scratch" in w]
    if dropped:  # one line, naming the file, and the run merged from scratch
        [line] = dropped
        assert str(path) in line and "\n" not in line
        assert [t.continued for t in first.targets].count(False) == 1
    else:  # or it goes on exactly as from the true state
        assert first.warnings == []
        assert all(t.continued for t in first.targets)
        assert sorted(runs) == sorted(base.next_round)
        for run_id, run in runs.items():
            assert_same_run(run, base.next_round[run_id])
    assert last.done, round_lines(last)
    assert_same_runs(base.sink, base.want)


def test_wbmerge_follow_says_which_state_it_dropped(kept, monkeypatch):
    """`wbmerge follow` from a state whose last row sent is missing (it raised IndexError
    out of a round: "internal error", exit 70, on every restart): one line on stderr
    naming the file, and the follow ends with the runs exact."""
    base = kept("shared")
    path = base.restore(monkeypatch)
    rewrite(path, setter("last_row", lambda s: None))
    growing = Growing(base.job, base.root / "live")
    growing.grow(0.6)
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "follow",
        str(base.root / "live"),
        "--run-mode",
        "shared",
        "--interval",
        "0.5",
    ]
    follower = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # (said once the first round is verified)
        assert "running" in first, first + follower.stderr.read()  # type: ignore[union-attr]
        growing.grow(1.0)
        _, stderr = follower.communicate(timeout=UPLOAD_TIMEOUT)
    finally:
        follower.kill()
    assert follower.returncode == 0, stderr
    [line] = [line for line in stderr.splitlines() if "merged from scratch" in line]
    assert str(path) in line and "does not fit" in line
    assert "internal error" not in stderr
    assert_same_runs(base.sink, base.want)
