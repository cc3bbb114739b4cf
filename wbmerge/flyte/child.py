"""The merge and follow tasks' child process, seen from the task: start it, wait, read its
answer.

A merge or a follow runs in a child process of its task (`python -m wbmerge.flyte KIND
REQUEST RESULT`, whose side is `__main__`), so that a task cancelled by Flyte can stop it
and everything it started, and so that its state directory is its own. The request and
the answer travel as JSON files in a scratch directory.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from ..errors import WbmergeError

_CHILD_OUTPUT_LINES = 5  # of a crashed child's output, shown in the task's error


async def run_in_child(kind: str, request: dict) -> list[str]:
    """Run `python -m wbmerge.flyte KIND` on `request` (a merge, or a follow); its warnings go
    to the task's log, a bad input comes back as the child's one-line error."""
    with tempfile.TemporaryDirectory(prefix=f"wbmerge-{kind}-") as scratch:
        spec = Path(scratch) / "request.json"
        result = Path(scratch) / "result.json"
        spec.write_text(json.dumps(request))
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "wbmerge.flyte",
            kind,
            str(spec),
            str(result),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await child.communicate()
        finally:
            if child.returncode is None:  # the task was cancelled: so is its child, which
                child.terminate()  # stops its uploader and cleans up on SIGTERM
                try:
                    await asyncio.wait_for(child.wait(), 30)
                except asyncio.TimeoutError:
                    child.kill()
                    await child.wait()
        text = output.decode(errors="replace")
        sys.stderr.write(text)
        if not result.exists():
            tail = " | ".join(text.strip().splitlines()[-_CHILD_OUTPUT_LINES:])
            raise RuntimeError(f"the {kind} stopped (exit {child.returncode}): {tail}")
        answer = json.loads(result.read_text())
    if "error" in answer:
        raise WbmergeError(answer["error"], exit_code=answer.get("exit_code", 2))
    return answer["links"]
