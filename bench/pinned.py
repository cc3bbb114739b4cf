"""Run one measured piece of work in a fresh Python process pinned to one core.

`code` is the body of the child: it gets `args` (strings) and `out` (a scratch directory)
and sets `result` (a dict); the child adds the seconds `code` took (after its imports:
put imports first and mark the start with `began = time.perf_counter()`) and its peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, os, resource, sys, time
from pathlib import Path
os.sched_setaffinity(0, {{0}})
args, out = sys.argv[2:], Path(sys.argv[1])
began = None
{code}
seconds = time.perf_counter() - began
print(json.dumps({{**result, "seconds": seconds,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


# The baseline both benchmarks divide by: reading every record of a job (framing, CRC,
# record kind) and doing nothing with it, in the same kind of process.
READ_ONLY = """
from wbmerge.log.txlog import read_payloads
from wbmerge.log.records import record_kind
began = time.perf_counter()
for log in sorted(Path(args[0]).rglob("run-*.wandb")):
    for payload in read_payloads(log):
        record_kind(payload)
result = {}
"""


def run_pinned(code: str, *args: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD.format(code=code), out, *args],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
