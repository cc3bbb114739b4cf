"""The child processes of `wbmerge.flyte`: `python -m wbmerge.flyte rank SPEC` is one rank
started by the local-mode launcher; `python -m wbmerge.flyte merge|follow REQUEST RESULT`
is one merge started by the merge task, or one follow started by the follow task
(`child.run_in_child` is the task's side)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from wbmerge.errors import WbmergeError


def child_main(kind: str, spec_path: str, result_path: str) -> None:
    """`python -m wbmerge.flyte merge|follow REQUEST RESULT`: one merge or follow, its
    answer as JSON."""
    from wbmerge.upload import state_dir

    request = json.loads(Path(spec_path).read_text())
    if request.get("worker") is not None:
        os.environ["WBMERGE_STATE_DIR"] = str(state_dir() / f"worker-{request['worker']}")
    try:
        if kind == "follow":
            from wbmerge.flyte.follow_task import follow_main

            answer: dict = follow_main(request)
        else:
            from wbmerge.flyte.merge_task import merge_and_upload

            answer = merge_and_upload(request)
    except WbmergeError as exc:
        answer = {"error": str(exc), "exit_code": exc.exit_code}
    for line in answer.get("warnings", []):
        print(f"wbmerge: warning: {line}", file=sys.stderr)
    Path(result_path).write_text(json.dumps(answer))


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        from wbmerge.flyte.launcher import rank_main

        rank_main(sys.argv[2])
    elif sys.argv[1:2] in (["merge"], ["follow"]):
        child_main(sys.argv[1], sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m wbmerge.flyte rank SPEC | merge|follow REQUEST RESULT")
