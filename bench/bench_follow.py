"""`wbmerge sync --follow`: the follower's CPU per round, and the lag of a logged value.

    python bench/bench_follow.py cpu              # 8 ranks x 20 metrics, 10 rounds
    python bench/bench_follow.py cpu --steps 2000 --rounds 5
    python bench/bench_follow.py lag              # real wandb ranks at two logging rates

`cpu`: a synthetic shared job of 8 ranks x 20 metrics x STEPS steps (our writer, the shapes
wandb 0.31 writes) appears in a live directory a tenth of each file at a time, cut at
arbitrary bytes; after each slice one round runs against a local sink. Reported per round:
wall seconds, the follower's own CPU seconds (discover, scan, merge, cut, remainder,
verify), the uploader's (`wandb sync` and wandb-core, the round's child processes), the
merged rows on the server, whether the round went on from the last one's merge
(`continued`), the bytes of the logs its merge read (`read_mb`), the size of the merge's
state saved in the state directory (`saved_state_mb`: state and spool), the follower's peak and current resident memory (the peak reset before each
round), and the CPU of one `stage()` of the same files (a merge from scratch, what every
round cost before rounds were incremental; `--no-scratch-merge` skips it).

    python bench/bench_follow.py cpu --steps 170000 --rounds 34 --no-scratch-merge
                                  # 5k steps a round, to 165k steps held

`lag`: real wandb ranks (`wbmerge.init`) log `t = time.time()` at a given rate while
`wbmerge sync --follow --interval I` runs; the sink is polled every 0.25 s and each step's
lag is the time from its `t` to the first poll that shows it. Two rates: 20 metrics every
50 ms (the file fills 32 KiB blocks within seconds), and one value every 5 s (only wandb's
flush timer writes it: every 15 s by default, every `--flush-every` seconds when set).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import synthetic  # noqa: E402
from tests.support.sinktools import SinkProcess  # noqa: E402
from wbmerge.follow import Follower  # noqa: E402
from wbmerge.merge import stage  # noqa: E402
from wbmerge.upload import MergeRequest, plan_jobs  # noqa: E402


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def grow(logs: list[Path], live: Path, fraction: float) -> None:
    for log in logs:
        dest = live / log.parent.name / log.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        have = dest.stat().st_size if dest.exists() else 0
        want = max(have, int(log.stat().st_size * fraction))
        with open(log, "rb") as source, open(dest, "ab") as out:  # (only the new slice)
            source.seek(have)
            out.write(source.read(want - have))


def _reset_peak_memory() -> None:
    """Start the process's peak resident memory (VmHWM) again from its current size, so
    that each round's peak is its own (Linux: 5 written to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as out:
        out.write("5")


def _memory_mb() -> tuple[float, float]:
    """The process's resident memory now and its peak since the last reset, in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def bench_cpu(steps: int, rounds: int, ranks: int, scratch_merge: bool = True) -> list[dict]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    sink = SinkProcess(scratch / "sink")
    (scratch / "sink").mkdir()
    sink.start()
    os.environ.update(sink.env)
    os.environ["WBMERGE_STATE_DIR"] = str(scratch / "state")
    try:
        synthetic.write_job(scratch / "job", 1, ranks, steps, metrics=20, job_id="follow-bench")
        logs = sorted((scratch / "job").rglob("run-*.wandb"))
        live = scratch / "live"
        request = MergeRequest([live], run_mode="shared", project="follow-bench")
        results = []
        with Follower(request, parallel=4, timeout=600) as follower:
            for number in range(1, rounds + 1):
                grow(logs, live, number / rounds)
                _reset_peak_memory()
                wall, own, children = time.perf_counter(), time.process_time(), _children_cpu()
                report = follower.round()
                wall = time.perf_counter() - wall
                own, children = time.process_time() - own, _children_cpu() - children
                rss, peak = _memory_mb()
                (target,) = report.targets
                merge = None
                if scratch_merge:
                    began = time.process_time()
                    (job,) = plan_jobs(request)
                    stage(job.targets[0], scratch / f"stage-{number}", job.options(request))
                    merge = round(time.process_time() - began, 2)
                    shutil.rmtree(scratch / f"stage-{number}")
                results.append({
                    "round": number, "source_mb": round(sum(p.stat().st_size for p in (live.rglob("*.wandb"))) / 1e6, 1),
                    "rows": target.rows, "added": target.added, "final": target.final,
                    "continued": target.continued, "read_mb": round(target.bytes_read / 1e6, 1),
                    "saved_state_mb": round(sum(p.stat().st_size for p in (scratch / "state").glob("follow/*/*")) / 1e6, 2),
                    "wall_s": round(wall, 2), "follower_cpu_s": round(own, 2),
                    "uploader_cpu_s": round(children, 2), "merge_from_scratch_cpu_s": merge,
                    "follower_peak_mb": round(peak, 1), "follower_rss_mb": round(rss, 1),
                })  # fmt: skip
                print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        sink.stop()
        shutil.rmtree(scratch, ignore_errors=True)


RANK = """
import os, sys, time
import wbmerge
pace, steps, flush = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
metrics = int(sys.argv[4])
run = wbmerge.init(project="follow-lag", **({"flush_every": float(flush)} if flush != "-" else {}))
for step in range(steps):
    values = {f"m{i:02d}": step * i for i in range(metrics - 1)}
    values["t"] = time.time()
    run.log(values)
    time.sleep(pace)
run.finish()
"""


def bench_lag(pace: float, steps: int, metrics: int, ranks: int, interval: float,
              flush_every: float | None) -> dict:  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="bench-lag-"))
    sink = SinkProcess(scratch / "sink")
    (scratch / "sink").mkdir()
    sink.start()
    live = scratch / "live"
    live.mkdir()
    script = scratch / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = {**sink.env, "WBMERGE_STATE_DIR": str(scratch / "state"), "WANDB_DIR": str(live)}
    follower = subprocess.Popen(
        [sys.executable, "-m", "wbmerge.cli", "sync", str(live), "--run-mode", "shared",
         "--follow", "--interval", str(interval), "--quiet"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    procs = []
    seen: dict[int, float] = {}
    try:
        for rank in range(ranks):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                            LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0",
                            TORCHELASTIC_RUN_ID="lag-bench")  # fmt: skip
            cmd = [sys.executable, str(script), str(pace), str(steps),
                   "-" if flush_every is None else str(flush_every), str(metrics)]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
        logged: dict[int, float] = {}

        def poll() -> None:
            now = time.time()
            for run in sink.client.runs():
                full = sink.client.run(run["entity"], run["project"], run["id"])
                for row in full["history"]:
                    step = row["_step"]
                    if step not in seen:
                        seen[step] = now
                        logged[step] = max(v for k, v in row.items() if k.startswith("t/"))

        ended = None
        while follower.poll() is None:
            if ended is None and all(p.poll() is not None for p in procs):
                ended = time.monotonic()
            if ended is not None and time.monotonic() - ended > 5 * interval + 60:
                raise RuntimeError("the follower did not end after the ranks")
            poll()
            time.sleep(0.25)
        poll()  # (the rows of the last round, sent just before the follower ended)
        if len(seen) != steps:
            raise RuntimeError(f"{len(seen)} of {steps} rows arrived")
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
        lags = sorted(seen[s] - logged[s] for s in seen)
        return {
            "pace_s": pace, "metrics": metrics, "ranks": ranks, "interval_s": interval,
            "flush_every_s": flush_every, "rows": len(lags),
            "lag_median_s": round(statistics.median(lags), 1), "lag_max_s": round(max(lags), 1),
            "follower_exit": follower.returncode,
        }  # fmt: skip
    finally:
        for proc in [*procs, follower]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        sink.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--steps", type=int, default=20_000)
    cpu.add_argument("--rounds", type=int, default=10)
    cpu.add_argument("--ranks", type=int, default=8)
    cpu.add_argument("--no-scratch-merge", action="store_true",
                     help="skip the merge from scratch after each round (long at 100k steps)")  # fmt: skip
    lag = sub.add_parser("lag")
    lag.add_argument("--ranks", type=int, default=2)
    lag.add_argument("--interval", type=float, default=10.0)
    lag.add_argument("--duration", type=float, default=60.0, help="seconds each rank logs")
    lag.add_argument("--flush-every", type=float, default=2.0)
    args = parser.parse_args()
    if args.what == "cpu":
        bench_cpu(args.steps, args.rounds, args.ranks, not args.no_scratch_merge)
        return
    fast, slow = 0.05, 5.0
    for pace, metrics, flush in (
        (fast, 20, None),
        (slow, 1, None),
        (slow, 1, args.flush_every),
    ):
        steps = max(2, int(args.duration / pace))
        print(json.dumps(bench_lag(pace, steps, metrics, args.ranks, args.interval, flush)),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
