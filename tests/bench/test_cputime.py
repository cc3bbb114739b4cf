"""The CPU split of the end-to-end benchmark: wbmerge's own processes against the uploader's."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from bench import cputime
from wbmerge.upload import STANDBY

PYTHON = sys.executable


def test_wbmerge_s_uploader_process_is_the_uploader_s():
    assert cputime.is_uploader([PYTHON, "-c", STANDBY])
    assert cputime.is_uploader(["/venv/bin/wandb", "sync", "-p", "p", "run"])
    assert cputime.is_uploader(["/wandb/bin/wandb-core", "--pid", "12"])
    assert not cputime.is_uploader([PYTHON, "-I", "/src/wbmerge/upload/relayprocess.py", "url"])
    assert not cputime.is_uploader([PYTHON, "-c", "import wandb"])
    assert not cputime.is_uploader([])


def test_a_tree_without_the_hook_is_all_the_uploader_s():
    runner = {
        "top": 10,
        "reaped": [{"pid": 10, "comm": "wandb", "cpu": 3.0}, {"pid": 12, "comm": "x", "cpu": 0.5}],
        "left": [{"pid": 13, "comm": "wandb-core", "cpu": 0.25}],
    }
    assert cputime.split(runner, None) == (None, 3.75)


def test_the_uploader_s_part_is_what_its_processes_used_wherever_they_were_reaped():
    # wbmerge (pid 10, 4.0 s with all it reaped) reaped the relay (0.5 s) and one uploader
    # process (2.0 s, with its wandb-core); a second uploader process outlived wbmerge and
    # the runner reaped it (1.0 s), and a wandb-core that outlived its uploader (0.75 s);
    # a helper of wbmerge's that outlived it (0.25 s) is still running.
    runner = {
        "top": 10,
        "reaped": [
            {"pid": 10, "comm": "python", "cpu": 4.0},
            {"pid": 21, "comm": "python", "cpu": 1.0},
            {"pid": 30, "comm": "wandb-core", "cpu": 0.75},
        ],
        "left": [{"pid": 40, "comm": "python", "cpu": 0.25}],
    }
    hook = {
        "started": {
            "11": [PYTHON, "-I", "relayprocess.py", "http://127.0.0.1:1"],
            "20": [PYTHON, "-c", STANDBY],
            "21": [PYTHON, "-c", STANDBY],
            "40": [PYTHON, "-c", "pass"],
        },
        "reaped": {"11": 0.5, "20": 2.0},
    }
    own, uploader = cputime.split(runner, hook)
    assert uploader == pytest.approx(2.0 + 1.0 + 0.75)
    assert own == pytest.approx(4.0 - 2.0 + 0.25)  # wbmerge itself 1.5, relay 0.5, helper 0.25


BURN = "import time\ndef burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s:\n        pass\n"


def test_a_real_tree_is_split_by_the_kernel_s_accounting(tmp_path):
    """A command run under the hook burns 0.2 s and starts a helper that burns 0.2 s, and an
    uploader (`wandb`) that burns 0.3 s and a wandb-core it never waits for, which burns
    0.3 s: only the runner reaps that one, and it is counted as the uploader's."""
    orphan = BURN + textwrap.dedent(
        """
        import ctypes
        ctypes.CDLL(None).prctl(15, b"wandb-core", 0, 0, 0)  # PR_SET_NAME
        burn(0.3)
        """
    )
    wandb = tmp_path / "wandb"
    wandb.write_text(
        f"#!{PYTHON}\n"
        + BURN
        + f"import subprocess\nsubprocess.Popen([{PYTHON!r}, '-c', {orphan!r}])\nburn(0.3)\n"
    )
    wandb.chmod(0o755)
    (tmp_path / "treejob.py").write_text(
        BURN
        + textwrap.dedent(
            f"""
            import subprocess
            helper = subprocess.Popen([{PYTHON!r}, "-c", {BURN + "burn(0.2)"!r}])
            uploader = subprocess.Popen([{str(wandb)!r}, "sync"])
            burn(0.2)
            assert helper.wait() == 0 and uploader.wait() == 0
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done, stderr = cputime.run_measured(
        [PYTHON, "-m", "treejob"], env, str(tmp_path), timeout=60, hooked=True
    )
    assert done.returncode == 0, stderr
    assert done.left == 0
    # each part holds its burns and the start of its Python processes (two each)
    assert 0.4 <= done.own < 0.4 + 0.3
    assert 0.6 <= done.uploader < 0.6 + 0.3
    assert done.seconds >= 0.4  # until the command ended, not the orphan
