"""Runs written by older wandb read right: 0.16.6 (before wandb-core) and 0.19.11.

wandb 0.16 writes history items under `key` (not `nested_key`), no `step` field (the step is
only in the `_step` item), a logged dict as one item whose value is a JSON object, and its
exit record before the last history row and the only summary record. The expected values
here are read from the source records with protobuf; the steps are also checked against the
training loop, which logs step i as the i-th row. Until discovery identifies these runs by
their names, each test gives them their ranks in a copy: a `wbmerge` block added to the run
record (rank = the `rank` value the loop logs), every other record as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.log import LogWriter, pb, read_payloads, records, txlog, wire
from wbmerge.training import RankInfo

from ..conftest import MANIFEST, job_dir
from ..support.sinktools import console_text

OLD = sorted(name for name, job in MANIFEST["recipes"].items() if job["wandb_version"])
RESERVED = {"_step", "_runtime", "_timestamp", "_wandb"}


def item_path(item) -> list[str]:
    return list(item.nested_key) or [item.key]


def source_history(path: Path) -> list[tuple[int, dict[str, str]]]:
    """(step, {key joined with ".": JSON text}) of every history record, by protobuf: the
    step field when there is one, else the `_step` item."""
    rows = []
    for payload in read_payloads(path):
        record = pb.Record.FromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        values = {".".join(item_path(i)): i.value_json for i in record.history.item}
        step = record.history.step.num if record.history.HasField("step") else None
        rows.append((json.loads(values["_step"]) if step is None else step, values))
    return rows


def source_summary(path: Path) -> dict[str, str]:
    """The final summary: every summary record's updates folded in order."""
    folded: dict[str, str] = {}
    for payload in read_payloads(path):
        record = pb.Record.FromString(payload)
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                folded[".".join(item_path(item))] = item.value_json
    return folded


def logs(name: str) -> dict[int, Path]:
    """rank -> the job's .wandb file (the rank is what the loop logged)."""
    found = {}
    for path in sorted(job_dir(name).glob("wandb/offline-run-*/run-*.wandb")):
        ranks = {json.loads(values["rank"]) for _, values in source_history(path)}
        (rank,) = ranks
        found[rank] = path
    return found


def ranked_copy(name: str, dest: Path) -> dict[int, Path]:
    """The job's runs copied under dest, each run record given its rank as a `wbmerge` block
    (its place on its node from the launch manifest; a job whose other ranks wrote no run,
    as rank0-only, is taken as a job of the ranks that did)."""
    sources = logs(name)
    job = MANIFEST["recipes"][name]
    nproc = job["nproc"] if len(sources) == job["nodes"] * job["nproc"] else len(sources)
    copies = {}
    for rank, path in sources.items():
        worker, local = divmod(rank, nproc)
        info = RankInfo(rank, local, len(sources), nproc, worker, job_id=f"fx-{name}")
        target = dest / "wandb" / path.parent.name
        shutil.copytree(path.parent, target)
        with open(target / path.name, "wb") as stream, LogWriter(stream) as writer:
            for payload in read_payloads(path):
                record = pb.Record.FromString(payload)
                if record.WhichOneof("record_type") == "run":
                    block = json.dumps(info.to_metadata())
                    record.run.config.update.add(key="wbmerge", value_json=block)
                    payload = record.SerializeToString()
                writer.write(payload)
        copies[rank] = target / path.name
    return copies


def cli(*args: object, env: dict | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], env=env)
    assert result.exit_code == 0, result.output + result.stderr
    return result


@pytest.mark.parametrize("name", OLD)
def test_source_steps_are_the_loops_steps(name):
    """The reference reading itself: the i-th row is step i, as the loop logged it."""
    steps = MANIFEST["recipes"][name]["steps"]
    for path in logs(name).values():
        assert [step for step, _ in source_history(path)] == list(range(steps))


def test_wandb_0_16_writes_key_items_without_a_step_field():
    """What makes 0.16 different, so that the tests below test something."""
    (path, *_) = logs("wandb_0_16_6").values()
    kinds = []
    for payload in read_payloads(path):
        record = pb.Record.FromString(payload)
        kinds.append(record.WhichOneof("record_type"))
        if kinds[-1] == "history":
            assert not record.history.HasField("step")
            assert all(i.key and not i.nested_key for i in record.history.item)
    assert kinds.index("exit") < len(kinds) - 1 - kinds[::-1].index("history")
    assert kinds.count("summary") == 1 and kinds.index("summary") > kinds.index("exit")


@pytest.mark.parametrize("name", OLD)
def test_inspect_counts_rows_and_last_step(name):
    steps = MANIFEST["recipes"][name]["steps"]
    report = json.loads(cli("inspect", "--json", job_dir(name)).output)
    assert [(r["history_rows"], r["last_step"]) for r in report] == [(steps, steps - 1)] * 2


@pytest.mark.parametrize("name", OLD)
def test_the_array_reading_takes_each_rows_step(name):
    steps = MANIFEST["recipes"][name]["steps"]
    for path in logs(name).values():
        found = []
        for frames in txlog.read_frames(path):
            codes = records.kinds(frames)
            rows = records.history_rows(frames, np.flatnonzero(codes == records.code("history")))
            found.extend(rows.steps.tolist())
        assert found == list(range(steps))


@pytest.mark.parametrize("name", OLD)
def test_export_gives_every_value_at_its_step(tmp_path, name):
    copies = ranked_copy(name, tmp_path / "runs")
    out = tmp_path / "values.parquet"
    cli("export", tmp_path / "runs", "--out", out)
    table = pq.read_table(out).to_pylist()
    got = {
        (row["rank"], row["step"], row["key"]): row["value_json"] or repr(row["value"])
        for row in table
        if row["kind"] == "history"
    }
    expected = {}
    for rank, path in copies.items():
        for step, values in source_history(path):
            for key, text in values.items():
                if key in RESERVED:
                    continue
                value = json.loads(text)
                # a dict that 0.16 wrote as one value is its leaves, as 0.19 writes them
                leaves = value.items() if isinstance(value, dict) else [(None, value)]
                for leaf_key, leaf in leaves:
                    name = key if leaf_key is None else f"{key}.{leaf_key}"
                    number = isinstance(leaf, (int, float)) and not isinstance(leaf, bool)
                    whole = text if leaf_key is None else json.dumps(leaf)
                    expected[rank, step, name] = repr(float(leaf)) if number else whole
    assert got == expected
    assert {key for _, _, key in got} >= {"eval.loss", "eval.rank", "train/loss"}
    # and each value carries its row's time
    times = {
        (rank, step): json.loads(values["_timestamp"])
        for rank, path in copies.items()
        for step, values in source_history(path)
    }
    for row in table:
        if row["kind"] == "history":
            assert row["timestamp"] == times[row["rank"], row["step"]]


def labelled(key: str, label: str) -> str:
    """A key (nested parts joined with ".") as a shared merge labels it: its top level only,
    so that a logged dict stays whole (none of these keys has a "." of its own)."""
    top, *rest = key.split(".")
    return ".".join([f"{top}/{label}", *rest])


def merged_log(out: Path) -> Path:
    (path,) = out.glob("offline-run-*/run-*.wandb")
    return path


@pytest.mark.parametrize("name", OLD)
def test_shared_merge_labels_every_value_at_its_step(tmp_path, name):
    copies = ranked_copy(name, tmp_path / "runs")
    cli("merge", tmp_path / "runs", "--run-mode", "shared", "--out", tmp_path / "merged")
    merged = source_history(merged_log(tmp_path / "merged"))
    steps = MANIFEST["recipes"][name]["steps"]
    assert [step for step, _ in merged] == list(range(steps))
    expected: dict[int, dict[str, str]] = {step: {} for step in range(steps)}
    for rank, path in copies.items():
        for step, values in source_history(path):
            for key, text in values.items():
                if key not in RESERVED:
                    expected[step][labelled(key, f"rank-{rank}")] = text
    for step, values in merged:
        assert {k: v for k, v in values.items() if k not in RESERVED} == expected[step]
        assert json.loads(values["_step"]) == step
    # every rank's final summary, the keys set after the loop included
    summary = source_summary(merged_log(tmp_path / "merged"))
    for rank, path in copies.items():
        for key, text in source_summary(path).items():
            if key.split(".")[0] not in RESERVED:
                assert summary[labelled(key, f"rank-{rank}")] == text, key
        assert f"final/loss/rank-{rank}" in summary


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["shared", "new"])
def test_wandb_0_16_runs_arrive_in_the_sink(sink, tmp_path, mode):
    """`wandb sync` (0.31) takes the merged 0.16 runs: every row at its step, and the
    records 0.16 writes after its exit record (the last row, the summary) arrive too."""
    copies = ranked_copy("wandb_0_16_6", tmp_path / "runs")
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    cli(
        "sync",
        tmp_path / "runs",
        "--run-mode",
        mode,
        "-p",
        "old",
        "-e",
        "local",
        "--base-id",
        "B",
        env=env,
    )
    for rank, path in copies.items():
        run_id, label = ("B", f"/rank-{rank}") if mode == "shared" else (f"B-rank-{rank}", "")
        got = sink.client.run("local", "old", run_id)
        assert got["state"] == "finished"
        by_step = {row["_step"]: row for row in got["history"]}
        for step, values in source_history(path):
            for key, text in values.items():
                if key not in RESERVED:
                    top, *rest = key.split(".")  # (a dict arrives as nested values)
                    value = by_step[step][top + label]
                    for part in rest:
                        value = value[part]
                    assert value == json.loads(text), (step, key)
        for key, text in source_summary(path).items():
            if key.split(".")[0] not in RESERVED:
                assert got["summary"][key + label] == json.loads(text), key
        # the console (0.16 writes a line and its newline as two records), labelled in shared
        prefix = f"[rank-{rank}] " if mode == "shared" else ""
        lines = [prefix + line for line in source_console(path)]
        arrived = console_text(got["console"])
        assert [line for line in arrived if line.startswith(prefix)] == lines


def source_console(path: Path) -> list[str]:
    text = "".join(
        record.output_raw.line
        for record in map(pb.Record.FromString, read_payloads(path))
        if record.WhichOneof("record_type") == "output_raw"
    )
    return [line for line in text.split("\n") if line.strip()]


def test_a_step_less_record_takes_its_step_from_the_step_item():
    record = pb.Record()
    record.history.item.add(key="loss", value_json="0.5")
    record.history.item.add(key="_step", value_json="41")
    step, region = wire.history_region(record.SerializeToString())
    assert step == 41
    assert pb.HistoryRecord.FromString(region).item[0].key == "loss"


@pytest.mark.parametrize("text", ["1.5", "-3", "true", '"7"', "1e3", "nonsense", str(1 << 63)])
def test_a_step_item_that_is_not_a_step_counts_as_absent(text):
    record = pb.Record()
    record.history.item.add(key="_step", value_json=text)
    assert wire.history_region(record.SerializeToString())[0] == 0


@pytest.mark.parametrize("step", [0, 4])
def test_a_step_field_wins_over_the_step_item(step):
    """`step {}` (step 0, as wandb-core writes it) is a step field too."""
    record = pb.Record()
    record.history.item.add(nested_key=["_step"], value_json="9")
    record.history.step.SetInParent()
    record.history.step.num = step
    assert wire.history_region(record.SerializeToString())[0] == step


def write_one_rank_log(root: Path, run_id: str, records: list) -> None:
    """A one-rank job under `root/wandb`: a run record with its wbmerge block, `records`,
    and an exit record."""
    info = RankInfo(0, 0, 1, 1, 0, job_id=run_id)
    run_dir = root / "wandb" / f"offline-run-20260101_000000-{run_id}"
    run_dir.mkdir(parents=True)
    with open(run_dir / f"run-{run_id}.wandb", "wb") as stream, LogWriter(stream) as writer:
        record = pb.Record(num=1)
        record.run.run_id = run_id
        record.run.config.update.add(key="wbmerge", value_json=json.dumps(info.to_metadata()))
        writer.write(record.SerializeToString())
        for record in records:
            writer.write(record.SerializeToString())
        writer.write(pb.Record(exit=pb.RunExitRecord()).SerializeToString())


def test_export_names_a_key_once_whichever_way_it_is_written(tmp_path):
    """A history key written as `key` in some rows and as `nested_key` in others is one key,
    and every row's `_timestamp` is found, whichever way it was written."""
    records = []
    for step in range(6):
        record = pb.Record(num=2 + step)
        old_style = step % 2 == 0
        for key, text in [("loss", str(step / 4)), ("_timestamp", str(100 + step))]:
            if old_style:
                record.history.item.add(key=key, value_json=text)
            else:
                record.history.item.add(nested_key=[key], value_json=text)
        record.history.step.num = step
        records.append(record)
    write_one_rank_log(tmp_path, "mixed", records)
    out = tmp_path / "values.parquet"
    cli("export", tmp_path, "--out", out)
    rows = [r for r in pq.read_table(out).to_pylist() if r["kind"] == "history"]
    assert [(r["step"], r["key"], r["value"], r["timestamp"]) for r in rows] == [
        (step, "loss", step / 4, 100.0 + step) for step in range(6)
    ]
    names = pq.read_table(out).column("key").combine_chunks().dictionary.to_pylist()
    assert len(names) == len(set(names))  # (a name twice would be two keys to a reader)


def test_a_value_that_ends_like_a_step_field_is_not_taken_for_one(tmp_path):
    """A step-less record (as 0.16 writes them) whose last value ends in the bytes of a step
    field (`12 02 08 05`): protobuf reads no step field there, and neither may we."""
    records = []
    for step in range(3):
        record = pb.Record()
        record.history.item.add(key="loss", value_json=str(step))
        record.history.item.add(key="_step", value_json=str(step))
        record.history.item.add(key="tail", value_json="1\x12\x02\x08\x05")
        records.append(record)
    write_one_rank_log(tmp_path, "tail", records)
    report = json.loads(cli("inspect", "--json", tmp_path).output)
    assert [(r["history_rows"], r["last_step"]) for r in report] == [(3, 2)]
    out = tmp_path / "values.parquet"
    cli("export", tmp_path, "--out", out)
    rows = pq.read_table(out).to_pylist()
    assert sorted((r["step"], r["key"], r["value_json"] or r["value"]) for r in rows) == sorted(
        [(step, "loss", float(step)) for step in range(3)]
        + [(step, "tail", "1\x12\x02\x08\x05") for step in range(3)]
    )


def test_export_splits_a_dict_value_into_its_leaves_but_keeps_media_whole(tmp_path):
    info = RankInfo(0, 0, 1, 1, 0, job_id="dicts")
    run_dir = tmp_path / "wandb" / "offline-run-20260101_000000-dicts"
    run_dir.mkdir(parents=True)
    image = '{"_type": "image-file", "path": "media/a.png"}'
    logged = [
        ("a", '{"b": 1, "c": {"d": "x", "e": [1, 2]}, "f": {}}'),
        ("img", image),
        ("loss", "0.5"),
        ("flag", "true"),
    ]
    with open(run_dir / "run-dicts.wandb", "wb") as stream, LogWriter(stream) as writer:
        record = pb.Record(num=1)
        record.run.run_id = "dicts"
        record.run.config.update.add(key="wbmerge", value_json=json.dumps(info.to_metadata()))
        writer.write(record.SerializeToString())
        for step in range(2):
            record = pb.Record()
            for key, text in logged:
                record.history.item.add(key=key, value_json=text)
            record.history.item.add(key="_step", value_json=str(step))
            writer.write(record.SerializeToString())
        writer.write(pb.Record(exit=pb.RunExitRecord()).SerializeToString())
    out = tmp_path / "values.parquet"
    cli("export", tmp_path, "--out", out)
    rows = pq.read_table(out).to_pylist()
    got = [(r["step"], r["key"], r["value"], r["value_json"]) for r in rows]
    per_step = [
        ("a.b", 1.0, None),
        ("a.c.d", None, '"x"'),
        ("a.c.e", None, "[1, 2]"),
        ("a.f", None, "{}"),
        ("img", None, image),
        ("loss", 0.5, None),
        ("flag", None, "true"),
    ]
    assert sorted(got, key=str) == sorted(
        [(step, *entry) for step in range(2) for entry in per_step], key=str
    )
    assert [r["step"] for r in rows] == [0] * 7 + [1] * 7  # each leaf in its row's place
    cli("export", tmp_path, "--out", tmp_path / "wide.parquet", "--wide")
    wide = pq.read_table(tmp_path / "wide.parquet")
    assert wide.column("a.b").to_pylist() == [1.0, 1.0]
    assert wide.column("img").to_pylist() == [image, image]
