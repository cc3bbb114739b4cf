"""The docs: every command and option explained, the CLI page current, the site builds."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from ..conftest import ROOT

DOCS = ROOT / "docs"


def cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def long_options():
    from wbmerge.cli import main

    found = []
    for path, ctx in cli_reference().commands(main, ("wbmerge",)):
        for param in ctx.command.params:
            found += [(" ".join(path), opt) for opt in param.opts if opt.startswith("--")]
    return found


def test_the_command_line_page_is_what_help_says():
    result = subprocess.run(
        [sys.executable, str(DOCS / "cli_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command, option", long_options())
def test_every_option_is_explained_beyond_its_help(command, option):
    # The generated page lists every option by construction; the prose must say what it is for.
    prose = "\n".join(p.read_text() for p in DOCS.glob("*.md") if p.name != "cli.md")
    assert option in prose or option == "--help", f"{command} {option} is not in docs/"


def test_the_docs_build_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "def sync" not in (tmp_path / "api" / "index.html").read_text()
    assert "verified upload" in (tmp_path / "api" / "index.html").read_text()


def test_the_readme_is_a_page_not_a_manual():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert missing == []


def test_the_docs_state_the_name_rules_the_code_holds():
    """W&B's name rules live once, in `plan` (read by the planner and the sink); the page
    that tells users which names fail says the same characters and lengths."""
    from wbmerge.plan import NAME_MAX_BYTES, NAME_MAX_CHARS, PROJECT_RESERVED, RUN_ID_RESERVED

    text = (ROOT / "docs" / "sync.md").read_text()
    names = re.search(
        r"project or entity name W&B cannot take \(any of `([^`]+)`.*?over (\d+) characters\)", text
    )
    run_ids = re.search(r"a run id it cannot take \(.*?any of `([^`]+)`.*?over (\d+) bytes\)", text)
    assert names and run_ids, "docs/sync.md no longer states the name rules"
    assert sorted(names[1]) == sorted(PROJECT_RESERVED) and int(names[2]) == NAME_MAX_CHARS
    assert sorted(run_ids[1]) == sorted(RUN_ID_RESERVED) and int(run_ids[2]) == NAME_MAX_BYTES
