"""End to end: real wandb ranks log offline while `wbmerge sync --follow` runs beside them.

Three ranks (`follow_rank.py`, real wandb 0.31 through `wbmerge.init`) write one job while
the follower uploads into the sink on 127.0.0.1. While they train the sink must hold one
merged run that is running and grows; at the end every step exactly once with every value
each rank logged, the final state and exit code of the one-shot rules, and the follower
gone by itself with exit code 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ..support.sinktools import console_text

RANK_SCRIPT = Path(__file__).parents[1] / "support" / "follow_rank.py"
JOB_ID = "follow-e2e"
WORLD = 3
STEPS = 40
DEADLINE = 150.0  # seconds: the whole job and follow, far above the ~30 s they take


def start_rank(rank: int, live: Path, sink, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in sink.env.items() if k != "WANDB_SILENT"}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID=JOB_ID,
        WANDB_DIR=str(live),
        WANDB_SILENT="true",
        WANDB_MODE="offline",
    )
    cmd = [sys.executable, str(RANK_SCRIPT), str(STEPS), "0.25", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_follower(live: Path, sink, state: Path, *extra: str) -> subprocess.Popen:
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "sync",
        str(live),
        "--run-mode",
        "shared",
        "--follow",
        "--interval",
        "1",
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def merged_run(sink) -> dict | None:
    runs = [r for r in sink.client.runs() if r["id"] == JOB_ID]
    return sink.client.run(runs[0]["entity"], runs[0]["project"], JOB_ID) if runs else None


def watch(sink, procs: list[subprocess.Popen], follower: subprocess.Popen) -> list[dict]:
    """The merged run as the sink holds it, sampled while any rank still trains."""
    samples = []
    deadline = time.monotonic() + DEADLINE
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the ranks did not finish"
        assert follower.poll() is None, follower.communicate()
        run = merged_run(sink)
        if run is not None:
            samples.append({"state": run["state"], "rows": len(run["history"])})
        time.sleep(0.5)
    return samples


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def expected_value(rank: int, step: int) -> float:
    return rank + step / 1000


def test_follow_a_training_job_with_a_late_and_a_crashing_rank(make_sink, tmp_path):
    """Rank 2 starts 4 s late (its rows hold the merged rows back until it logs); rank 1
    raises at step 20 (wandb writes exit code 1: a crashed non-primary rank, whose rows up
    to the crash are kept); rank 0 finishes: the merged run finishes with exit code 0."""
    sink = make_sink()
    live = tmp_path / "live"
    live.mkdir()
    # (a crashed rank that is not restarted: the run waits 2 s for a restart, not 60)
    follower = start_follower(live, sink, tmp_path / "state", "--restart-grace", "2")
    ranks = [start_rank(0, live, sink), start_rank(1, live, sink, "--crash-at", "20")]
    try:
        time.sleep(4)
        ranks.append(start_rank(2, live, sink))
        samples = watch(sink, ranks, follower)
        out, err = follower.communicate(timeout=DEADLINE)
    finally:
        stop([*ranks, follower])
    assert follower.returncode == 0, err
    assert [p.returncode for p in ranks] == [0, 1, 0]
    # While training: one merged run, running, whose rows grew.
    running = [s["rows"] for s in samples if s["state"] == "running"]
    assert len({r for r in running if r > 0}) >= 2, samples
    assert running == sorted(running)
    assert "running" in out and "finished" in out
    # At the end: every step once, every value each rank logged, the primary's exit code.
    run = merged_run(sink)
    assert run is not None and (run["state"], run["exit_code"]) == ("finished", 0)
    rows = run["history"]
    assert [row["_step"] for row in rows] == list(range(STEPS))
    for row in rows:
        step = row["_step"]
        logged = {r for r in range(WORLD) if r != 1 or step < 20}
        values = {k: v for k, v in row.items() if k.startswith("loss/")}
        assert values == {f"loss/rank-{r}": expected_value(r, step) for r in logged}
    assert {line for line in console_text(run["console"]) if " at step " in line} >= {
        f"[rank-{r}] rank {r} at step {s}" for r in range(WORLD) for s in (0, 10)
    }
    # A one-shot sync of the same runs afterwards has nothing left to do.
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    again = subprocess.run(
        [sys.executable, "-m", "wbmerge.cli", "sync", str(live), "--run-mode", "shared"],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert again.returncode == 0, again.stderr
    assert "already synced" in again.stdout


def test_follow_ends_after_the_idle_timeout_when_a_rank_is_killed(make_sink, tmp_path):
    """Rank 1 is SIGKILLed at step 15 (no exit record: it never finishes). The follower
    ends by itself after --idle-timeout, naming rank 1, with the one-shot sync's result."""
    sink = make_sink()
    live = tmp_path / "live"
    live.mkdir()
    follower = start_follower(live, sink, tmp_path / "state", "--idle-timeout", "4")
    ranks = [
        start_rank(0, live, sink),
        start_rank(1, live, sink, "--kill-at", "15"),
        start_rank(2, live, sink),
    ]
    try:
        watch(sink, ranks, follower)
        out, err = follower.communicate(timeout=DEADLINE)
    finally:
        stop([*ranks, follower])
    assert follower.returncode == 0, err
    assert f"Never finished: job {JOB_ID}: rank(s) 1" in err
    run = merged_run(sink)
    assert run is not None and (run["state"], run["exit_code"]) == ("finished", 0)
    rows = run["history"]
    assert [row["_step"] for row in rows] == list(range(STEPS))
    killed_rows = [row["_step"] for row in rows if "loss/rank-1" in row]
    assert killed_rows == list(range(len(killed_rows))) and 0 < len(killed_rows) <= 15
    for row in rows:
        for rank in range(WORLD):
            if f"loss/rank-{rank}" in row:
                assert row[f"loss/rank-{rank}"] == expected_value(rank, row["_step"])
