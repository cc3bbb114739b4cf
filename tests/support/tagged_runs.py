"""Real offline runs with tags, groups, job types and a failed exit, for the sink's run
filters (run as a script: `python -m tests.support.tagged_runs DIR`).

Each run logs `loss` at steps 0..4; run `t-b` ends with exit code 1 (state failed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import wandb

RUNS = {
    "t-a": {"group": "g1", "job_type": "train", "tags": ["base", "ddp"], "exit_code": 0},
    "t-b": {"group": "g1", "job_type": "eval", "tags": ["ddp"], "exit_code": 1},
    "t-c": {"group": "g2", "job_type": "train", "tags": [], "exit_code": 0},
}


def main(root: Path) -> None:
    for run_id, spec in RUNS.items():
        run = wandb.init(
            mode="offline",
            dir=root,
            project="filters",
            id=run_id,
            group=spec["group"],
            job_type=spec["job_type"],
            tags=spec["tags"],
        )
        for step in range(5):
            run.log({"loss": 1.0 / (step + 1)}, step=step)
        run.finish(exit_code=spec["exit_code"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
