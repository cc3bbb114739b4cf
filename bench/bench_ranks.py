"""The shared merge scales with rows, not ranks: the same rows as few long ranks and as many
short ones.

    python bench/bench_ranks.py                 # 128k rows x 20 metrics as 8, 256, 1024 ranks
    python bench/bench_ranks.py --repeat 5 --rows 32000
    python bench/bench_ranks.py --ranks 8 256 --merge-args="--rank-stats"   # what it costs

Each job is written with `tests/support/synthetic.py`, then `wbmerge merge --run-mode shared` runs in
a fresh process pinned to one core, `--repeat` times, into a fresh directory each time; the
jobs take turns, so a machine's load that changes meanwhile does not move the ratios.
Reported: the median wall time of the command (its start-up included) and its CPU time
(user + system, which other work on a busy machine moves less), each with its ratio to the
8-rank job's, and the largest peak RSS of that process (`ru_maxrss` from `wait4`). Prints a
markdown table, then the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import synthetic  # noqa: E402

RANKS = (8, 256, 1024)
PER_NODE = 8


def merge_once(
    job: Path, out: Path, timeout: float, extra: list[str] | None = None
) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MB) of one `wbmerge merge --run-mode shared`
    of `job`, with the options `extra`."""
    command = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "merge",
        str(job),
        "--run-mode",
        "shared",
        "--out",
        str(out),
        *(extra or []),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    began = time.perf_counter()
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    deadline = began + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{' '.join(command)}: no result in {timeout} s")
        time.sleep(0.01)
    seconds = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128_000, help="source rows of each job")
    parser.add_argument("--metrics", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--merge-args", default="", help="more options of the merge, quoted")
    args = parser.parse_args()
    extra = shlex.split(args.merge_args)
    results = []
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-ranks-") as tmp:
        work = Path(tmp)
        jobs = {}
        for ranks in args.ranks:
            jobs[ranks] = work / f"job{ranks}"
            synthetic.write_job(
                jobs[ranks],
                ranks // PER_NODE,
                PER_NODE,
                args.rows // ranks,
                args.metrics,
                job_id=f"ranks{ranks}",
            )
        # The jobs take turns in each repeat, so a load that changes during the bench
        # falls on all of them alike, not on the ratio.
        runs: dict[int, list[tuple[float, float, float]]] = {ranks: [] for ranks in jobs}
        for i in range(args.repeat):
            for ranks, job in jobs.items():
                out = work / f"out{ranks}-{i}"
                runs[ranks].append(merge_once(job, out, args.timeout, extra))
                shutil.rmtree(out)
                print(f"  {ranks} ranks, run {i + 1}: {runs[ranks][-1]}", file=sys.stderr)
        for ranks, done in runs.items():
            results.append(
                {
                    "ranks": ranks,
                    "steps": args.rows // ranks,
                    "seconds": round(statistics.median(s for s, _, _ in done), 2),
                    "cpu_s": round(statistics.median(c for _, c, _ in done), 2),
                    "peak_rss_mb": round(max(rss for _, _, rss in done)),
                    "runs_s": [round(s, 2) for s, _, _ in done],
                }
            )
    base, base_cpu = results[0]["seconds"], results[0]["cpu_s"]
    shown = f" {args.merge_args}" if args.merge_args else ""
    print(
        f"{args.rows} rows x {args.metrics} metrics, `merge --run-mode shared{shown}`, "
        f"median of {args.repeat}, one core:\n"
    )
    first = f"vs {results[0]['ranks']} ranks"
    print(f"| ranks x steps | time (s) | {first} | CPU (s) | {first} | peak RSS (MB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in results:
        row["ratio"] = round(row["seconds"] / base, 2)
        row["cpu_ratio"] = round(row["cpu_s"] / base_cpu, 2)
        print(
            f"| {row['ranks']} x {row['steps']} | {row['seconds']:.2f} | {row['ratio']:.2f}x | "
            f"{row['cpu_s']:.2f} | {row['cpu_ratio']:.2f}x | {row['peak_rss_mb']} |"
        )
    print()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
