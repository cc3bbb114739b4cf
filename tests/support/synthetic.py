"""Synthetic offline runs of any size, written with our own writer, for benchmarks and scale tests.

The records have the shapes real wandb 0.31 writes (see fixtures/): a header, a run record
carrying the `wbmerge` block, system-metric `stats` with `/l:<label>` keys, and for every
step a `summary` and a `history` record of `metrics` float values, plus console lines.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from wbmerge.log import LogWriter, pb
from wbmerge.training import METADATA_KEY, RankInfo


def write_rank(
    root: Path,
    info: RankInfo,
    steps: int,
    metrics: int = 20,
    stats_every: int = 100,
    print_every: int = 50,
    seed: int = 0,
    key_labels: tuple[str, ...] = (),
    exit_code: int = 0,
    config: dict[str, object] | None = None,
) -> Path:
    """Write one rank's offline run under `root/wandb/`; returns the `.wandb` path.

    With `key_labels`, every metric is written once per label as `{key}/{label}`: the shape
    of a merged shared run, for tests of what displays it. `exit_code`: the exit record's
    (a run that failed, for torch elastic to start again). `config`: keys of the run's
    config besides `lr` and the rank's `wbmerge` block.
    """
    run_id = f"syn{info.rank:04d}r{info.restart}{seed:x}"
    run_dir = root / "wandb" / f"offline-run-20260101_000000-{run_id}"
    (run_dir / "files").mkdir(parents=True, exist_ok=True)
    path = run_dir / f"run-{run_id}.wandb"
    rnd = random.Random(hash((seed, info.rank, info.restart)))
    start = 1_767_225_600.0 + info.restart * 3600
    label = info.label
    keys = [f"train/metric_{m:02d}" for m in range(metrics)]
    if key_labels:
        keys = [f"{key}/{lab}" for key in keys for lab in key_labels]
    with open(path, "wb") as stream, LogWriter(stream) as writer:
        num = 0

        def emit(record: pb.Record) -> None:
            nonlocal num
            num += 1
            record.num = num
            writer.write(record.SerializeToString())

        header = pb.Record()
        header.header.version_info.producer = "wbmerge-synthetic"
        emit(header)
        run = pb.Record()
        run.run.run_id = run_id
        run.run.project = "synthetic"
        run.run.start_time.FromNanoseconds(int(start * 1e9))
        for key, value in (
            ("lr", 0.001),
            (METADATA_KEY, info.to_metadata()),
            *(config or {}).items(),
        ):
            item = run.run.config.update.add()
            item.key, item.value_json = key, json.dumps(value)
        emit(run)
        for step in range(steps):
            now = start + step * 0.1
            if step % stats_every == 0:
                stats = pb.Record()
                stats.stats.timestamp.FromNanoseconds(int(now * 1e9))
                for name in ("cpu", "memory_percent", "proc.memory.rssMB"):
                    item = stats.stats.item.add()
                    item.key, item.value_json = f"{name}/l:{label}", repr(rnd.random() * 100)
                emit(stats)
            values = [(k, repr(rnd.random())) for k in keys]
            values += [
                ("_step", str(step)),
                ("_runtime", repr(now - start)),
                ("_timestamp", repr(now)),
            ]
            summary = pb.Record()
            for key, value in values:
                item = summary.summary.update.add()
                item.nested_key.append(key)
                item.value_json = value
            emit(summary)
            history = pb.Record()
            for key, value in values:
                item = history.history.item.add()
                item.nested_key.append(key)
                item.value_json = value
            history.history.step.num = step
            emit(history)
            if step % print_every == 0:
                out = pb.Record()
                out.output_raw.line = f"rank {info.rank} step {step}\n"
                out.output_raw.timestamp.FromNanoseconds(int(now * 1e9))
                emit(out)
        exit_record = pb.Record()
        exit_record.exit.exit_code = exit_code
        exit_record.exit.runtime = int(steps * 0.1)
        emit(exit_record)
    return path


def write_job(
    root: Path,
    nodes: int,
    nproc: int,
    steps: int,
    metrics: int = 20,
    job_id: str = "synthetic-job",
) -> list[Path]:
    """A whole job: `nodes * nproc` ranks, each a separate offline run."""
    world = nodes * nproc
    paths = []
    for rank in range(world):
        info = RankInfo(rank, rank % nproc, world, nproc, rank // nproc, job_id=job_id)
        paths.append(write_rank(root, info, steps, metrics))
    return paths
