"""Without the compiled kernels (`WBMERGE_PURE=1`, or a build that skipped them) the core
reads, merges and counts exactly as with them: its tests pass on the Python twins."""

from __future__ import annotations

import os
import subprocess
import sys

from ..conftest import ROOT

# The tests of the framing, the records and the merge's rows: where the block walk and the
# history proof are used (the rest of the suite goes through the same two functions).
CORE = [
    "log/test_txlog.py",
    "log/test_walk_segments.py",
    "log/test_records.py",
    "merge/test_merged_rows.py",
]


def test_the_core_passes_on_the_python_twins_of_the_compiled_kernels():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-n",  # (one process: this test runs inside a worker of the suite already)
            "0",
            *(f"tests/{name}" for name in CORE),
        ],
        cwd=ROOT,
        env={**os.environ, "WBMERGE_PURE": "1"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1] and "skipped" not in result.stdout


def test_a_build_older_than_a_kernel_uses_its_python_twin():
    """An extension built before a kernel was added lacks it: the twin is used, and
    importing wbmerge does not fail."""
    from wbmerge.log.twins import twins

    ways, way = twins(len, "_records", "a_kernel_not_built")
    assert ways == {"python": len} and way == "python"
