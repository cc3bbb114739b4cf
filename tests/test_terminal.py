"""The port of wandb-core's terminal emulator against what wandb-core itself wrote to
`output.log` for the same console records (tests/data/output_log_measured.json: measured
with `wandb sync` into the sink, progress bars, cursor moves, escapes, long lines, both
streams and wandb's logger)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wbmerge.terminal import MAX_LINE, TERMINAL_HEIGHT, output_log

MEASURED = json.loads((Path(__file__).parent / "data" / "output_log_measured.json").read_text())


@pytest.mark.parametrize("name", sorted(MEASURED["cases"]))
def test_output_log_is_what_wandb_core_wrote(name):
    console, written = MEASURED["cases"][name]
    assert output_log([(stream, text) for stream, text in console]) == written


def test_the_measured_cases_cover_what_the_emulator_acts_on():
    """The cases reach past the view, the open lines and a line's length, in both streams."""
    texts = "".join(text for console, _ in MEASURED["cases"].values() for _, text in console)
    assert all(acted_on in texts for acted_on in ("\r", "\x1b[A", "\x1b[B", "\r\n"))
    assert max(map(len, texts.split("\n"))) > MAX_LINE
    assert texts.count("\x1b[A") > TERMINAL_HEIGHT
    streams = {stream for console, _ in MEASURED["cases"].values() for stream, _ in console}
    assert streams == {"stdout", "stderr", "logger"}


@pytest.mark.parametrize(
    "console, written",
    [
        ([], ""),
        ([("stdout", "\n\n\n")], ""),  # (line feeds make no line until a character comes)
        ([("stdout", "a" + "\n" * 40 + "b")], "a\n" + "\n" * 31 + "b\n"),  # (a view of 32)
        ([("stdout", "abc\x1b"), ("stdout", "x")], "abc\x1bx\n"),  # (an escape it does not know)
        ([("stdout", "abc\x1b["), ("stdout", "[")], "abc\x1b[[\n"),
    ],
)
def test_output_log_by_the_rules_of_the_emulators_source(console, written):
    assert output_log(console) == written
