"""Merge and end-to-end sync on synthetic jobs from our own writer (issue 4 targets).

    python bench/bench_merge.py                 # 8 ranks x 20k steps x 20 metrics; 64 x 2k
    python bench/bench_merge.py --scale 0.1     # a quick look
    python bench/bench_merge.py --skip-e2e

For each job and run mode, the merge runs in a fresh process pinned to one core, `--repeat`
times; reported: median seconds, throughput (source MB/s for new/auto, source history rows/s
for shared) and that process's peak RSS. Peak RSS is also measured for the same 8-rank job at
a tenth of the steps, to show memory does not grow with the step count.
End to end: `wbmerge sync --run-mode new -n 8` against plain `wandb sync -n 8` of the raw rank
directories, into the same local sink, in the same invocation, taking turns at going first
(median, and their ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pinned import READ_ONLY, run_pinned  # noqa: E402

from tests.support import synthetic  # noqa: E402
from wbmerge.sink import read_api_key  # noqa: E402

MERGE = """
from wbmerge.sync import MergeRequest, merge_jobs
began = time.perf_counter()
staged = merge_jobs(MergeRequest([args[0]], run_mode=args[1]), out)
result = {"rows": sum(s.source_rows for s in staged)}
"""


def merge_once(job: Path, mode: str) -> dict:
    return run_pinned(MERGE, str(job), mode)


def source_mb(job: Path, mode: str) -> float:
    logs = sorted(job.rglob("run-*.wandb"))
    if mode == "auto":
        logs = [p for p in logs if "syn0000" in p.name]
    return sum(p.stat().st_size for p in logs) / 1e6


def bench_merge(job: Path, repeat: int) -> dict:
    """Each mode's median time, throughput, peak RSS, and its time over the baseline's
    (reading the same logs and nothing else), which machine noise moves much less."""
    baseline = statistics.median(run_pinned(READ_ONLY, str(job))["seconds"] for _ in range(repeat))
    result: dict = {"read_only_s": round(baseline, 2)}
    for mode in ("new", "auto", "shared"):
        runs = [merge_once(job, mode) for _ in range(repeat)]
        seconds = statistics.median(r["seconds"] for r in runs)
        entry = {"seconds": round(seconds, 2), "peak_rss_mb": round(max(r["rss_mb"] for r in runs))}
        if mode == "shared":
            entry["source_rows_per_s"] = round(runs[0]["rows"] / seconds)
        else:
            entry["source_mb_per_s"] = round(source_mb(job, mode) / seconds)
        if mode != "auto":  # auto reads one rank: no baseline to compare with
            entry["over_read_only"] = round(seconds / baseline, 2)
        result[mode] = entry
        print(f"  {mode}: {entry}", flush=True)
    return result


def start_sink(data: Path) -> tuple[subprocess.Popen, str]:
    port_file = data / "port"
    data.mkdir(parents=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wbmerge.sink",
            "--port",
            "0",
            "--data",
            str(data),
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while not port_file.exists():
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def bench_e2e(job: Path, repeat: int, work: Path) -> dict:
    proc, url = start_sink(work / "sink")
    env = {
        **os.environ,
        "WANDB_BASE_URL": url,
        "WANDB_API_KEY": read_api_key(work / "sink"),
        "WANDB_SILENT": "true",
    }
    wandb = str(Path(sys.executable).with_name("wandb"))
    ours, plain = [], []
    try:
        for i in range(repeat):
            copy = work / f"raw-{i}"
            shutil.copytree(job, copy)  # wandb sync writes beside the runs it reads
            dirs = [str(d) for d in sorted((copy / "wandb").glob("offline-run-*"))]
            plain_cmd = [wandb, "sync", "-p", f"plain{i}", "-e", "local", "-n", "8", *dirs]
            ours_cmd = [
                sys.executable,
                "-m",
                "wbmerge.cli",
                "sync",
                str(job),
                "--run-mode",
                "new",
                "-n",
                "8",
                "-p",
                f"ours{i}",
                "-e",
                "local",
                "--force",
            ]
            ours_env = {**env, "WBMERGE_STATE_DIR": str(work / "state")}
            # each goes first every other time: the sink fills up as the runs go on
            order = [(plain, plain_cmd, env), (ours, ours_cmd, ours_env)]
            for times, cmd, cmd_env in order if i % 2 == 0 else order[::-1]:
                began = time.perf_counter()
                subprocess.run(cmd, env=cmd_env, check=True, capture_output=True)
                times.append(time.perf_counter() - began)
    finally:
        proc.terminate()
    result = {
        "plain_wandb_sync_s": round(statistics.median(plain), 2),
        "wbmerge_sync_new_s": round(statistics.median(ours), 2),
    }
    result["ratio"] = round(result["wbmerge_sync_new_s"] / result["plain_wandb_sync_s"], 3)
    print(f"  e2e: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the step counts")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--e2e-repeat", type=int, default=4, help="even: each goes first as often")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    results: dict = {"scale": args.scale, "repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-") as tmp:
        work = Path(tmp)
        jobs = {
            "8x20k": (1, 8, int(20_000 * args.scale)),
            "8x2k": (1, 8, int(2_000 * args.scale)),
            "64x2k": (8, 8, int(2_000 * args.scale)),
        }
        for name, (nodes, nproc, steps) in jobs.items():
            began = time.perf_counter()
            synthetic.write_job(
                work / name, nodes, nproc, steps, metrics=20, job_id=f"bench-{name}"
            )
            size = sum(p.stat().st_size for p in (work / name).rglob("*.wandb")) / 1e6
            print(
                f"{name}: {nodes * nproc} ranks x {steps} steps, {size:.0f} MB "
                f"(written in {time.perf_counter() - began:.1f} s)",
                flush=True,
            )
            results[name] = {
                "source_mb": round(size),
                "merge": bench_merge(work / name, args.repeat),
            }
        if not args.skip_e2e:
            print("end to end, 8x20k, into the local sink:", flush=True)
            results["e2e_8x20k"] = bench_e2e(work / "8x20k", args.e2e_repeat, work / "e2e")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
