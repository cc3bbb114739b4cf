"""`wbmerge sync --follow`: the follower's CPU per round, and the lag of a logged value.

    python bench/bench_follow.py cpu              # 8 ranks x 20 metrics, 10 rounds
    python bench/bench_follow.py cpu --steps 2000 --rounds 5
    python bench/bench_follow.py lag              # real wandb ranks at two logging rates
    python bench/bench_follow.py lag-held --held 160000   # the lag once a run holds 160k steps

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
    python bench/bench_follow.py cpu --run-mode new --steps 40000 --rounds 4
                                  # pass-through runs, one per rank (`rows`, `added`, `read_mb`
                                  # summed over them; `continued` of every one)

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
from wbmerge.log import LogWriter, pb  # noqa: E402
from wbmerge.merge import stage  # noqa: E402
from wbmerge.sync import MergeRequest, plan_jobs  # noqa: E402
from wbmerge.training import RankInfo  # noqa: E402
from wbmerge.upload import Credentials, ServerClient  # noqa: E402


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


def bench_cpu(
    steps: int, rounds: int, ranks: int, scratch_merge: bool = True, run_mode: str = "shared"
) -> list[dict]:
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
        request = MergeRequest([live], run_mode=run_mode, project="follow-bench")
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
                targets = report.targets  # (one shared run, or a run per rank for `new`)
                merge = None
                if scratch_merge:
                    began = time.process_time()
                    (job,) = plan_jobs(request)
                    for target in job.targets:
                        stage(target, scratch / f"stage-{number}", job.options(request))
                    merge = round(time.process_time() - began, 2)
                    shutil.rmtree(scratch / f"stage-{number}")
                results.append(
                    {
                        "round": number,
                        "source_mb": round(
                            sum(p.stat().st_size for p in (live.rglob("*.wandb"))) / 1e6, 1
                        ),
                        "rows": sum(t.rows for t in targets),
                        "added": sum(t.added for t in targets),
                        "final": all(t.final for t in targets),
                        "continued": all(t.continued for t in targets),
                        "read_mb": round(sum(t.bytes_read for t in targets) / 1e6, 1),
                        "saved_state_mb": round(
                            sum(p.stat().st_size for p in (scratch / "state").glob("follow/*/*"))
                            / 1e6,
                            2,
                        ),
                        "wall_s": round(wall, 2),
                        "follower_cpu_s": round(own, 2),
                        "uploader_cpu_s": round(children, 2),
                        "merge_from_scratch_cpu_s": merge,
                        "follower_peak_mb": round(peak, 1),
                        "follower_rss_mb": round(rss, 1),
                    }
                )
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


def bench_lag(
    pace: float, steps: int, metrics: int, ranks: int, interval: float, flush_every: float | None
) -> dict:
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
        [
            sys.executable,
            "-m",
            "wbmerge.cli",
            "sync",
            str(live),
            "--run-mode",
            "shared",
            "--follow",
            "--interval",
            str(interval),
            "--quiet",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs = []
    seen: dict[int, float] = {}
    try:
        for rank in range(ranks):
            rank_env = dict(
                env,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                GROUP_RANK="0",
                TORCHELASTIC_RUN_ID="lag-bench",
            )
            cmd = [
                sys.executable,
                str(script),
                str(pace),
                str(steps),
                "-" if flush_every is None else str(flush_every),
                str(metrics),
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=rank_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
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
            "pace_s": pace,
            "metrics": metrics,
            "ranks": ranks,
            "interval_s": interval,
            "flush_every_s": flush_every,
            "rows": len(lags),
            "lag_median_s": round(statistics.median(lags), 1),
            "lag_max_s": round(max(lags), 1),
            "follower_exit": follower.returncode,
        }
    finally:
        for proc in [*procs, follower]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        sink.stop()
        shutil.rmtree(scratch, ignore_errors=True)


class LiveRank:
    """One rank's log written by our own writer and kept open, so that rows can be added
    while a follower reads it: `held` rows first (their `t` in the past), then live rows
    whose `t` is the time they are written, each flushed to the file at once."""

    def __init__(self, live: Path, info: RankInfo, metrics: int) -> None:
        run_id = f"held{info.rank:04d}"
        run_dir = live / f"offline-run-20260101_000000-{run_id}"
        run_dir.mkdir(parents=True)
        self.stream = open(run_dir / f"run-{run_id}.wandb", "wb")
        self.writer = LogWriter(self.stream)
        self.num, self.step, self.metrics = 0, 0, metrics
        header = pb.Record()
        header.header.version_info.producer = "wbmerge-bench"
        self.emit(header)
        run = pb.Record()
        run.run.run_id, run.run.project = run_id, "follow-lag"
        run.run.start_time.FromNanoseconds(time.time_ns())
        item = run.run.config.update.add()
        item.key, item.value_json = "wbmerge", json.dumps(info.to_metadata())
        self.emit(run)

    def emit(self, record: pb.Record) -> None:
        self.num += 1
        record.num = self.num
        self.writer.write(record.SerializeToString())

    def row(self, t: float) -> None:
        history = pb.Record()
        values = [(f"m{i:02d}", repr(self.step * i)) for i in range(self.metrics - 1)]
        values += [("t", repr(t)), ("_step", str(self.step)), ("_timestamp", repr(t))]
        for key, value in values:
            item = history.history.item.add()
            item.nested_key.append(key)
            item.value_json = value
        history.history.step.num = self.step
        self.emit(history)
        self.step += 1

    def flush(self) -> None:
        self.writer.flush()
        self.stream.flush()

    def finish(self) -> None:
        end = pb.Record()
        end.exit.exit_code = 0
        self.emit(end)
        self.writer.close()
        self.stream.close()


def bench_lag_held(
    held: int, ranks: int, metrics: int, pace: float, seconds: float, interval: float
) -> dict:
    """The lag of values logged once each rank's run holds `held` steps: the ranks' logs
    are written up to `held` at once, a follower syncs them, then every rank adds a row
    every `pace` seconds for `seconds`, and the server is asked for the new rows only."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-lag-held-"))
    sink = SinkProcess(scratch / "sink")
    (scratch / "sink").mkdir()
    sink.start()
    live = scratch / "live"
    live.mkdir()
    writers = [
        LiveRank(live, RankInfo(r, r, ranks, ranks, 0, 0, "lag-held"), metrics)
        for r in range(ranks)
    ]
    for writer in writers:
        for _ in range(held):
            writer.row(1_767_225_600.0)
        writer.flush()
    env = {**sink.env, "WBMERGE_STATE_DIR": str(scratch / "state")}
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wbmerge.cli",
            "follow",
            str(live),
            "--run-mode",
            "shared",
            "--interval",
            str(interval),
            "--quiet",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = ServerClient(Credentials(env["WANDB_BASE_URL"], env["WANDB_API_KEY"]))
    seen: dict[int, float] = {}
    logged: dict[int, float] = {}
    try:
        began = time.monotonic()
        # (a shared row is sent once every running rank has passed its step, and the last
        # row waits while no row is left out: the held rows are in once row held - 2 is)
        while not (runs := sink.client.runs()) or not client.history_page(
            runs[0]["entity"], runs[0]["project"], runs[0]["id"], (held - 2, held - 1), 1
        ):
            if follower.poll() is not None:
                raise RuntimeError(f"the follower ended: {follower.stderr.read()[-2000:]}")
            time.sleep(1.0)
        caught_up = time.monotonic() - began
        run = runs[0]

        def poll() -> None:
            start = max(seen, default=held - 2) + 1
            rows = client.history_page(
                run["entity"], run["project"], run["id"], (start, 2**62), 10_000
            )
            now = time.time()
            for row in rows:
                step = row["_step"]
                if step not in seen:
                    seen[step] = now
                    logged[step] = max(v for k, v in row.items() if k.startswith("t/"))

        end = time.monotonic() + seconds
        next_row = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_row:
                for writer in writers:
                    writer.row(time.time())
                    writer.flush()
                next_row += pace
            poll()
            time.sleep(min(0.25, pace))
        added = writers[0].step - held
        for writer in writers:
            writer.finish()
        finished = time.monotonic()
        deadline = finished + 5 * interval + 600
        while follower.poll() is None and time.monotonic() < deadline:
            poll()
            time.sleep(0.5)
        ended = time.monotonic() - finished
        poll()
        if len(seen) != added + 1:  # (the live rows, and the held row that waited for them)
            raise RuntimeError(f"{len(seen)} of {added + 1} rows arrived after the held ones")
        live_steps = sorted(s for s in seen if s >= held)
        lag = {s: seen[s] - logged[s] for s in live_steps}  # (the live rows)
        lags = sorted(lag.values())
        slowest = max(live_steps, key=lag.get)
        return {
            "held_steps": held,
            "ranks": ranks,
            "metrics": metrics,
            "pace_s": pace,
            "interval_s": interval,
            "first_sync_s": round(caught_up, 1),
            "live_rows": added,
            "lag_median_s": round(statistics.median(lags), 1),
            "lag_max_s": round(max(lags), 1),
            # (which live row waited longest, counted from the first: the first rows may
            # wait for the first sync's check of the held rows, the last for the last round)
            "lag_max_row": slowest - held,
            "lag_first_s": round(lag[live_steps[0]], 1),
            "lag_last_s": round(lag[live_steps[-1]], 1),
            # from the ranks' exit records to the follower's end (its last round verified)
            "follower_end_s": round(ended, 1),
            "follower_exit": follower.returncode,
        }
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait(timeout=30)
        client.close()
        sink.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--steps", type=int, default=20_000)
    cpu.add_argument("--rounds", type=int, default=10)
    cpu.add_argument("--ranks", type=int, default=8)
    cpu.add_argument(
        "--run-mode",
        choices=("shared", "new", "auto"),
        default="shared",
        help="new: a pass-through run per rank; auto: rank 0's",
    )
    cpu.add_argument(
        "--no-scratch-merge",
        action="store_true",
        help="skip the merge from scratch after each round (long at 100k steps)",
    )
    lag = sub.add_parser("lag")
    lag.add_argument("--ranks", type=int, default=2)
    lag.add_argument("--interval", type=float, default=10.0)
    lag.add_argument("--duration", type=float, default=60.0, help="seconds each rank logs")
    lag.add_argument("--flush-every", type=float, default=2.0)
    held = sub.add_parser("lag-held")
    held.add_argument("--held", type=int, default=160_000, help="steps each rank holds first")
    held.add_argument("--ranks", type=int, default=8)
    held.add_argument("--metrics", type=int, default=20)
    held.add_argument("--pace", type=float, default=0.5, help="seconds between a rank's rows")
    held.add_argument("--seconds", type=float, default=120.0, help="how long rows are added")
    held.add_argument("--interval", type=float, default=10.0)
    args = parser.parse_args()
    if args.what == "lag-held":
        print(
            json.dumps(
                bench_lag_held(
                    args.held, args.ranks, args.metrics, args.pace, args.seconds, args.interval
                )
            ),
            flush=True,
        )
        return
    if args.what == "cpu":
        bench_cpu(args.steps, args.rounds, args.ranks, not args.no_scratch_merge, args.run_mode)
        return
    fast, slow = 0.05, 5.0
    for pace, metrics, flush in (
        (fast, 20, None),
        (slow, 1, None),
        (slow, 1, args.flush_every),
    ):
        steps = max(2, int(args.duration / pace))
        print(
            json.dumps(bench_lag(pace, steps, metrics, args.ranks, args.interval, flush)),
            flush=True,
        )


if __name__ == "__main__":
    main()
