"""A real offline run that logs artifacts, for the sink's artifact tests (run as a script).

`python -m tests.support.artifact_run DIR RUN_ID WEIGHTS_TEXT [POLICY [DIGEST]]` writes, with
real wandb, an offline run under DIR that logs a `model` artifact `ckpt` (the weights text as
two files, metadata and the alias `best`) and a `wandb.Table` holding a `wandb.Image` as
history key `samples`. (An offline run cannot use an artifact: wandb refuses `use_artifact`
offline.) POLICY is wandb's `add_file` policy (`mutable`, the default, or `immutable`: the
manifest names DIR/source/weights.bin itself); DIGEST the artifact's digest algorithm
(`MD5`, the default, or `XXH128`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import wandb


def main(
    root: Path, run_id: str, weights: str, policy: str = "mutable", digest: str = "MD5"
) -> None:
    run = wandb.init(mode="offline", dir=root, project="arts", id=run_id)
    source = root / "source"
    source.mkdir(exist_ok=True)
    (source / "weights.bin").write_text(weights)
    checkpoint = wandb.Artifact(
        "ckpt", type="model", metadata={"epoch": 3, "note": "<b>x</b>"}, digest_algorithm=digest
    )
    checkpoint.add_file(str(source / "weights.bin"), policy=policy)
    checkpoint.add_file(str(source / "weights.bin"), name="nested/copy.bin", policy=policy)
    run.log_artifact(checkpoint, aliases=["best"])
    pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    table = wandb.Table(columns=["step", "image"])
    table.add_data(1, wandb.Image(pixels))
    run.log({"samples": table, "loss": 0.5})
    run.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
