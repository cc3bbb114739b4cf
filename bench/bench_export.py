"""Export to Parquet on synthetic jobs from our own writer (issue 6 targets).

    python bench/bench_export.py                # 8 ranks x 20k steps x 20 metrics; 64 x 10k
    python bench/bench_export.py --scale 0.1    # a quick look

Each export runs in a fresh process pinned to one core, `--repeat` times; reported: median
seconds, source history rows per second, and peak RSS. The baseline, in the same
invocation and process shape, is reading the same logs record by record (framing, CRC,
record kind) without doing anything with them: the ratio shows what the export adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pinned import READ_ONLY, run_pinned  # noqa: E402

from tests.support import synthetic  # noqa: E402

EXPORT = """
from wbmerge.analyse.export import export
began = time.perf_counter()
export([args[0]], out / "x.parquet")
result = {}
"""


def run_once(job: Path, what: str) -> dict:
    return run_pinned(EXPORT if what == "export" else READ_ONLY, str(job))


def bench(job: Path, rows: int, repeat: int) -> dict:
    result = {}
    for what in ("read_only", "export"):
        runs = [run_once(job, what) for _ in range(repeat)]
        seconds = statistics.median(r["seconds"] for r in runs)
        result[what] = {
            "seconds": round(seconds, 2),
            "source_rows_per_s": round(rows / seconds),
            "peak_rss_mb": round(max(r["rss_mb"] for r in runs)),
        }
        print(f"  {what}: {result[what]}", flush=True)
    result["export_over_read"] = round(
        result["export"]["seconds"] / result["read_only"]["seconds"], 2
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the step counts")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results: dict = {"scale": args.scale, "repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-") as tmp:
        for name, (nodes, nproc, steps) in {
            "8x20k": (1, 8, int(20_000 * args.scale)),
            "64x10k": (8, 8, int(10_000 * args.scale)),
        }.items():
            job = Path(tmp) / name
            synthetic.write_job(job, nodes, nproc, steps, metrics=20, job_id=f"bench-{name}")
            rows = nodes * nproc * steps
            size = sum(p.stat().st_size for p in job.rglob("*.wandb")) / 1e6
            print(f"{name}: {rows} source history rows, {size:.0f} MB", flush=True)
            results[name] = bench(job, rows, args.repeat)
            results[name]["source_mb"] = round(size)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
