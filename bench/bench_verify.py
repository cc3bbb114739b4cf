"""What reading every row back costs after an upload, against the upload itself.

    python bench/bench_verify.py                    # 4,000 and 32,000 rows, 5 repeats
    python bench/bench_verify.py --rows 100000 --repeat 3

For each size, one synthetic run (`--rows` rows of 20 metrics, our own writer) is synced
once with `wbmerge sync --keep-staging` into a fresh local sink; then the check that
follows every upload (`verify.readback.rows_not_held`: every row read back by step, a page
of about 1,000 steps at a time, each step once, and the values of a sample of 64 rows) is
timed alone on the staged run, `--repeat` times, and so is `--verify full` (every row's
values). Reported: the median seconds of the sync and of each check, the check's CPU in
this process (the rest is the sink answering, on the same machine), and the ratio of each
check to the sync, as a markdown table. So is the check before the upload
(`verify.sourcecheck.source_shortfall`: the staged run against the rank's own log, every
value), which a sync runs on each staged run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_sync_e2e import start_sink  # noqa: E402  (the same local sink, started alike)

from tests.support import synthetic  # noqa: E402
from wbmerge.sink import read_api_key  # noqa: E402
from wbmerge.sync import MergeRequest, plan_jobs  # noqa: E402
from wbmerge.training import RankInfo  # noqa: E402
from wbmerge.upload import Credentials, Delivery, ServerClient  # noqa: E402
from wbmerge.verify import rows_not_held, source_shortfall  # noqa: E402
from wbmerge.wandbcore import read_staged  # noqa: E402


def measure(rows: int, repeat: int, work: Path, url: str, key: str) -> dict[str, float]:
    job = work / f"job-{rows}"
    synthetic.write_rank(job, RankInfo(0, 0, 1, 1, 0, 0, f"verify{rows}"), rows, metrics=20)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_BASE_URL=url,
        WANDB_API_KEY=key,
        WANDB_SILENT="true",
        WBMERGE_STATE_DIR=str(work / f"state-{rows}"),
    )
    staged = work / f"staged-{rows}"
    began = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wbmerge",
            "sync",
            str(job),
            "--run-mode",
            "auto",
            "-p",
            "bench",
            "-e",
            "local",
            "--base-id",
            f"v{rows}",
            "--keep-staging",
            str(staged),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    sync_seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"the sync of {rows} rows failed:\n{done.stderr[-2000:]}")
    [log] = staged.rglob("run-*.wandb")
    content = read_staged(log)
    client = ServerClient(Credentials(url, key))
    held = client.held("local", "bench", f"v{rows}")
    delivery = Delivery(f"v{rows}", log.parent, log, "bench", "bench")
    result = {"sync": sync_seconds}
    for name, every_value in (("sample", False), ("full", True)):
        walls, cpus = [], []
        for _ in range(repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            problems = rows_not_held(client, "local", "bench", delivery, held, content, every_value)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            if problems:
                raise SystemExit(f"the check of {rows} rows failed: {problems}")
        result[name], result[f"{name} cpu"] = statistics.median(walls), statistics.median(cpus)
    client.close()
    [job_plan] = plan_jobs(MergeRequest([job], run_mode="auto", base_id=f"v{rows}"))
    [target] = job_plan.targets
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        problems = source_shortfall(target, log)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if problems:
            raise SystemExit(f"the source check of {rows} rows failed: {problems}")
    result["source"], result["source cpu"] = statistics.median(walls), statistics.median(cpus)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4000, 32000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-verify-") as tmp:
        work = Path(tmp)
        sink, url = start_sink(work / "sink")  # (its data directory: work / "sink")
        try:
            key = read_api_key(work / "sink")
            results = {rows: measure(rows, args.repeat, work, url, key) for rows in args.rows}
        finally:
            sink.terminate()
            sink.wait(timeout=30)
    print(f"\nmedian of {args.repeat}, 20 metrics a row; check CPU is this process's alone:\n")
    print(
        "| rows | sync s | sample s | sample CPU s | full s | full CPU s | source s "
        "| source CPU s | sample / sync | full / sync | source / sync |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows, r in results.items():
        print(
            f"| {rows:,} | {r['sync']:.2f} | {r['sample']:.2f} | {r['sample cpu']:.2f} | "
            f"{r['full']:.2f} | {r['full cpu']:.2f} | {r['source']:.2f} | "
            f"{r['source cpu']:.2f} | {r['sample'] / r['sync']:.2f} | "
            f"{r['full'] / r['sync']:.2f} | {r['source'] / r['sync']:.2f} |"
        )


if __name__ == "__main__":
    main()
