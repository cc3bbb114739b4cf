"""The README's two set-up commands are the ones CI and users run."""

from __future__ import annotations

import re

from ..conftest import ROOT


def setup_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("```bash") < 40  # right under the title
    assert len(setup_commands()) == 2


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup_commands()[1] in ci.splitlines()


def test_main_job_script_exists():
    first = setup_commands()[0]
    script = re.search(r"bash (\S+)", first)[1]
    assert (ROOT / script).is_file()


def test_the_quickstart_leaves_runs_it_did_not_make(tmp_path):
    # `bash examples/quickstart.sh .` in a training project must not wipe its ./wandb.
    import subprocess

    project = tmp_path / "project"
    (project / "wandb" / "offline-run-1").mkdir(parents=True)
    (project / "wandb" / "offline-run-1" / "run-1.wandb").write_bytes(b"mine")
    script = ROOT / "examples" / "quickstart.sh"
    result = subprocess.run(
        ["bash", str(script), str(project)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "was not made by this script and is left as it is" in result.stderr
    assert (project / "wandb" / "offline-run-1" / "run-1.wandb").read_bytes() == b"mine"
