"""The training-side helper, run the way a rank runs it: in its own process, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from wbmerge.errors import WbmergeError
from wbmerge.identify import discover, scan
from wbmerge.training import RankInfo, resolve_job_id


def run_rank(tmp_path, code, **env):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(code))
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK", "WORLD"))
    }
    full_env.update(WANDB_DIR=str(tmp_path), WANDB_SILENT="true", **env)
    return subprocess.run(
        [sys.executable, str(script)], env=full_env, capture_output=True, text=True, timeout=120
    )


TOPOLOGY = dict(
    RANK="3",
    WORLD_SIZE="4",
    LOCAL_RANK="1",
    LOCAL_WORLD_SIZE="2",
    GROUP_RANK="1",
    TORCHELASTIC_RUN_ID="job-42",
    TORCHELASTIC_RESTART_COUNT="1",
)


def test_init_writes_offline_run_that_describes_its_rank(tmp_path):
    result = run_rank(
        tmp_path,
        """
        import wbmerge
        run = wbmerge.init(project="p", config={"lr": 0.1})
        assert run.offline, "must be offline by default"
        for i in range(3):
            run.log({"loss": 1.0 / (i + 1)})
        print("hello from rank 3")
        run.finish()
        """,
        **TOPOLOGY,
    )
    assert result.returncode == 0, result.stderr
    [run] = discover([tmp_path])
    assert run.rank_source == "wbmerge"
    assert run.rank == RankInfo(3, 1, 4, 2, 1, restart=1, job_id="job-42")
    assert run.label == "worker-1-rank-1"
    assert (run.run_dir / "files" / "output_worker-1-rank-1.log").exists()
    stats = scan(run)
    assert stats.history_rows == 3 and stats.complete and stats.exit_code == 0


def test_rank_config_is_the_one_argument_for_plain_wandb_init(tmp_path):
    result = run_rank(
        tmp_path,
        """
        import wandb, wbmerge
        run = wandb.init(project="p", mode="offline", config=wbmerge.rank_config({"lr": 0.1}))
        assert run.config["lr"] == 0.1
        run.log({"x": 1})
        run.finish()
        """,
        **TOPOLOGY,
    )
    assert result.returncode == 0, result.stderr
    [run] = discover([tmp_path])
    assert run.rank == RankInfo(3, 1, 4, 2, 1, restart=1, job_id="job-42")


def test_single_process_gets_a_run_and_a_fresh_job_id(tmp_path):
    result = run_rank(
        tmp_path,
        """
        import wbmerge
        run = wbmerge.init(project="p")
        run.log({"x": 1})
        run.finish()
        """,
    )
    assert result.returncode == 0, result.stderr
    [run] = discover([tmp_path])
    assert (run.rank.rank, run.rank.world_size, run.label) == (0, 1, "rank-0")
    assert run.job_id


def test_explicit_mode_is_respected(tmp_path):
    result = run_rank(
        tmp_path,
        """
        import wbmerge
        run = wbmerge.init(project="p", mode="disabled")
        assert run.disabled
        """,
        **TOPOLOGY,
    )
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("wandb/offline-run-*"))


def test_many_ranks_without_a_shared_job_id_is_an_error():
    info = RankInfo(1, 1, 2, 2, 0)
    with pytest.raises(WbmergeError, match="no job id"):
        resolve_job_id(info)
    assert resolve_job_id(info, "given") == "given"
    assert resolve_job_id(RankInfo(0, 0, 2, 2, 0, job_id="elastic")) == "elastic"


def test_flush_every_puts_a_rarely_logging_rank_on_disk_while_it_runs(tmp_path):
    """wandb writes the file in 32 KiB blocks and every 15 s: a rank logging three rows
    reaches the disk only at the next flush; with flush_every=0.5 within about a second."""
    release = tmp_path / "release"
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import pathlib, time
            import wbmerge
            run = wbmerge.init(project="p", flush_every=0.5)
            for i in range(3):
                run.log({{"loss": 1.0 / (i + 1)}})  # each call commits its row
            print("logged", flush=True)
            deadline = time.monotonic() + 60
            while not pathlib.Path({str(release)!r}).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            run.finish()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK", "WORLD"))}
    env.update(WANDB_DIR=str(tmp_path), WANDB_SILENT="true", **TOPOLOGY)
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "logged"
        deadline = time.monotonic() + 8  # well below wandb's own 15 s flush
        rows = 0
        while rows < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
            runs = [r for r in discover([tmp_path]) if r.has_run_record]
            rows = scan(runs[0]).history_rows if runs else 0
        assert rows == 3
        assert not scan(runs[0]).complete  # read while the rank still runs
        release.touch()
        assert proc.wait(timeout=60) == 0
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("seconds", [0, -1.5, "5", True])
def test_flush_every_must_be_a_positive_number(seconds):
    import wbmerge

    with pytest.raises(WbmergeError, match="flush_every must be a positive number"):
        wbmerge.init(project="p", flush_every=seconds)


@pytest.mark.parametrize("before", [None, "/elsewhere/data"])
def test_the_callers_wandb_data_dir_is_back_once_the_run_finishes(tmp_path, before):
    """`wbmerge.init` points WANDB_DATA_DIR into the run's directory while the run lives
    (its artifacts' staging travels with it); after `run.finish()`, `wandb.finish()` or a
    `with` block the process has its own value again, or none, as before the run."""
    env = {} if before is None else {"WANDB_DATA_DIR": before}
    result = run_rank(
        tmp_path,
        """
        import json, os
        import wandb, wbmerge
        seen = []
        for end in ("run.finish", "wandb.finish", "with"):
            if end == "with":
                with wbmerge.init(project="p") as run:
                    seen.append((os.environ.get("WANDB_DATA_DIR"), run.settings.sync_dir))
            else:
                run = wbmerge.init(project="p")
                seen.append((os.environ.get("WANDB_DATA_DIR"), run.settings.sync_dir))
                run.finish() if end == "run.finish" else wandb.finish()
            seen.append(os.environ.get("WANDB_DATA_DIR"))
        print(json.dumps(seen))
        """,
        **env,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for during, after in zip(seen[0::2], seen[1::2], strict=True):
        data_dir, sync_dir = during
        assert data_dir == os.path.join(sync_dir, "wandb-data")  # (while the run lives)
        assert after == before
