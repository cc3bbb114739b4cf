"""Reader throughput on a synthetic ~100 MB `.wandb` file from our writer (issue 2 targets).

    python bench/bench_txlog.py [--mb 100] [--repeat 5]

Reports the median of --repeat runs, on one core, of:
  framing + CRC only (raw payloads, no protobuf): target >= 200 MB/s
  framing + protobuf parse of every record:        target >= 150k records/s
  the count an upload is verified against (`content.read_staged`: every row's `_step`,
  system-metric rows, console lines), as a ratio to framing alone
and, as a baseline measured in the same invocation, a plain `read()` of the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import synthetic
from wbmerge.log import records, txlog
from wbmerge.training import RankInfo
from wbmerge.wandbcore import content


def timed(fn, repeat):
    times = []
    result = None
    for _ in range(repeat):
        began = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # ~1.8 kB of records (history + summary) per step with 20 metrics
        steps = int(args.mb * 1e6 / 1800)
        path = synthetic.write_rank(Path(tmp), RankInfo(0, 0, 1, 1, 0, job_id="b"), steps)
        size = path.stat().st_size

        def raw_read():
            with open(path, "rb") as f:
                while f.read(1 << 20):
                    pass

        def framing():
            n = 0
            for _ in txlog.read_payloads(path):
                n += 1
            return n

        def parsing():
            n = 0
            for _ in records.read_records(path):
                n += 1
            return n

        def counting():
            return len(content.read_staged(path).history_steps)

        t_raw, _ = timed(raw_read, args.repeat)
        t_frame, count = timed(framing, args.repeat)
        t_parse, _ = timed(parsing, args.repeat)
        t_count, _ = timed(counting, args.repeat)
        result = {
            "file_mb": round(size / 1e6, 1),
            "records": count,
            "raw_read_mb_s": round(size / 1e6 / t_raw),
            "framing_crc_mb_s": round(size / 1e6 / t_frame),
            "framing_parse_records_s": round(count / t_parse),
            "framing_vs_raw_read": round(t_frame / t_raw, 2),
            "count_mb_s": round(size / 1e6 / t_count),
            "count_vs_framing": round(t_count / t_frame, 2),
            "repeat": args.repeat,
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
