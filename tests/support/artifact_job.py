"""One rank of a small distributed job that logs artifacts, for the merge's artifact tests
(run as a script, one process per rank, with torchrun's variables set by the caller).

`python -m tests.support.artifact_job ROOT RANK POLICY` writes, with real wandb
offline and `wbmerge.init` (as the README's recipe), the rank's run under ROOT (its working
directory; the caller sets torchrun's RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID). The rank logs a `model` artifact `ckpt` of its own weights
(`rank {RANK} weights`, plus a file in a subdirectory, metadata and the alias `best`) and,
on rank 0 only, a `wandb.Table` holding a `wandb.Image` as history key `samples`. POLICY
is wandb's `add_file` policy: `mutable` (copied into wandb's artifact staging directory)
or `immutable` (the manifest names the user's own file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import wandb

import wbmerge


def weights_text(rank: int) -> str:
    """The content of rank `rank`'s weights file (the tests compare what arrived with it)."""
    return f"rank {rank} weights\n" * 40


def main(root: Path, rank: int, policy: str) -> None:
    run = wbmerge.init(project="arts", dir=root, config={"seed": rank})
    source = root / "source"
    source.mkdir(exist_ok=True)
    (source / "weights.bin").write_text(weights_text(rank))
    checkpoint = wandb.Artifact("ckpt", type="model", metadata={"rank": rank})
    checkpoint.add_file(str(source / "weights.bin"), policy=policy)
    checkpoint.add_file(str(source / "weights.bin"), name="nested/copy.bin", policy=policy)
    run.log_artifact(checkpoint, aliases=["best"])
    if rank == 0:
        pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
        table = wandb.Table(columns=["step", "image"])
        table.add_data(1, wandb.Image(pixels))
        run.log({"samples": table, "loss": 0.5})
    run.log({"loss": 0.25 + rank})
    run.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
