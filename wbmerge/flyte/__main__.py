"""The child processes of `wbmerge.flyte`: `python -m wbmerge.flyte rank SPEC` is one rank
started by the local-mode launcher; `python -m wbmerge.flyte merge|follow REQUEST RESULT`
is one merge started by the merge task, or one follow started by the follow task."""

import sys

if sys.argv[1:2] == ["rank"]:
    from wbmerge.flyte.launcher import rank_main

    rank_main(sys.argv[2])
elif sys.argv[1:2] in (["merge"], ["follow"]):
    from wbmerge.flyte.merge_task import child_main

    child_main(sys.argv[1], sys.argv[2], sys.argv[3])
else:
    sys.exit("usage: python -m wbmerge.flyte rank SPEC | merge|follow REQUEST RESULT")
