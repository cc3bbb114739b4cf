"""A real offline run that logs a distributed artifact (run as a script).

`python -m tests.support.distributed_artifact_run DIR` writes, with real wandb, an offline run
`dist` under DIR that upserts two parts of the dataset artifact `shards` (`a.txt` and
`b.txt`, as two ranks would) under one `distributed_id`, then finishes it, as W&B's guide
to distributed artifacts has each rank and then one of them do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import wandb

PARTS = {"a.txt": "part a\n", "b.txt": "part b, longer\n"}


def main(root: Path) -> None:
    run = wandb.init(mode="offline", dir=root, project="arts", id="dist")
    for name, text in PARTS.items():
        (root / name).write_text(text)
        part = wandb.Artifact("shards", type="dataset")
        part.add_file(str(root / name))
        run.upsert_artifact(part, distributed_id="job-1")
    run.finish_artifact(wandb.Artifact("shards", type="dataset"), distributed_id="job-1")
    run.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
