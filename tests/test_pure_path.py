"""Without the compiled kernels (`WBMERGE_PURE=1`, or a build that skipped them) the core
reads, merges and counts exactly as with them: its tests pass on the Python twins."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import ROOT

# The tests of the framing, the records, the merge's rows and the pass-through: where the
# block walk and the history proof are used. (Uploads take the same code paths after.)
CORE = ["test_txlog.py", "test_walk_segments.py", "test_records.py", "test_merged_rows.py",
        "test_passthrough.py", "test_steps.py", "test_sentrows.py", "test_items.py"]  # fmt: skip


def test_the_core_passes_on_the_python_twins_of_the_compiled_kernels():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         *(f"tests/{name}" for name in CORE)],
        cwd=ROOT, env={**os.environ, "WBMERGE_PURE": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1] and "skipped" not in result.stdout
