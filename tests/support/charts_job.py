"""One rank of a job that logs custom charts and labelled boxes and masks (run as a script).

`python -m tests.support.charts_job DIR RANK WORLD` writes, with real wandb, the offline
run of rank RANK of a WORLD-rank job under DIR, as each process of a DDP job writes its
own: `wandb.plot.line`, `scatter` and `confusion_matrix` charts, and an image with boxes
and a mask whose classes are named, at each of three steps; its config holds what differs
per rank in one job (a seed, a data shard) and what the ranks share (`lr`). `--lr LR`
gives another learning rate: another experiment's run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import wandb

BOX_CLASSES = {0: "cat", 1: "dog"}
MASK_CLASSES = {0: "background", 1: "road", 2: "car"}
STEPS = 3


def image(rank: int, step: int) -> wandb.Image:
    pixels = np.full((8, 8, 3), 10 * rank + step, dtype=np.uint8)
    box = {
        "position": {"minX": 0.1, "maxX": 0.5, "minY": 0.2, "maxY": 0.6},
        "class_id": rank % 2,
        "box_caption": f"rank {rank}",
    }
    mask = np.zeros((8, 8), dtype=np.uint8)
    mask[: 1 + rank, :] = 1 + rank % 2
    return wandb.Image(
        pixels,
        boxes={"predictions": {"box_data": [box], "class_labels": BOX_CLASSES}},
        masks={"segmentation": {"mask_data": mask, "class_labels": MASK_CLASSES}},
    )


def main(root: Path, rank: int, world: int, lr: float, job: str) -> None:
    # (a Table's artifact is staged in wandb's data directory: kept in the job's own)
    os.environ["WANDB_DATA_DIR"] = str(root / f"wandb-data-{rank}")
    run = wandb.init(
        mode="offline",
        dir=root,
        project="charts",
        group=job,
        name=f"rank-{rank}",
        config={
            "rank": rank,
            "world_size": world,
            "lr": lr,
            "seed": 1000 + rank,
            "data_shard": f"shard-{rank:02d}",
        },
    )
    for step in range(STEPS):
        xs = list(range(step + 3))
        curve = wandb.Table(data=[[x, rank + x * 0.5] for x in xs], columns=["x", "y"])
        run.log(
            {
                "loss": 1.0 / (step + 1) + rank,
                "charts/val_curve": wandb.plot.line(curve, "x", "y", title=f"rank {rank}"),
                "charts/spread": wandb.plot.scatter(curve, "x", "y", title="spread"),
                "eval/confusion": wandb.plot.confusion_matrix(
                    y_true=[0, 1, rank % 2], preds=[0, 1, 1], class_names=["cat", "dog"]
                ),
                "eval/detection": image(rank, step),
            },
            step=step,
        )
    run.finish()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--job", default="charts-job")
    args = parser.parse_args()
    main(args.root, args.rank, args.world, args.lr, args.job)
