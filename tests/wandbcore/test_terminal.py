"""The port of wandb-core's terminal emulator against what wandb-core itself wrote to
`output.log` for the same console records (tests/data/output_log_measured.json: measured
with `wandb sync` into the sink, progress bars, cursor moves, escapes, long lines, both
streams and wandb's logger)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from wbmerge.wandbcore import Console
from wbmerge.wandbcore.terminal import MAX_LINE, TERMINAL_HEIGHT, output_log

from ..support.emulator_reference import reference_output_log

MEASURED = json.loads((Path(__file__).parents[1] / "data" / "output_log_measured.json").read_text())


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


ESC = "\x1b"
PIECES = [
    "a",
    "é",
    "😀",
    "\n",
    "\r",
    ESC,
    "[",
    "A",
    "B",
    "C",
    ESC + "[",
    ESC + "[A",
    ESC + "[B",
    ESC + "[C",
    ESC + "[\n",
    ESC + "\n",
    ESC + "\r",
    ESC + ESC,
    ESC + "[" + ESC,
    "\r\n",
]
# Runs around the port's bound of 1,024 repeats per step, past the view and a line's length.
LONG_PIECES = [
    ESC + "[A" * 1023,
    ESC + "[A" * 1025,
    ESC + "[B" * 2049,
    (ESC + "x") * 1025,
    (ESC + "[C") * 1030,
    "\n" * 33,
    "\n" * 2000,
    "\r" * 1500,
    "x" * 4097,
]


def random_console(rng: random.Random) -> list[tuple[str, str]]:
    """Records of both streams and the logger, escapes begun at a record's end and ended in
    the next, and now and then a run longer than any the port takes in one step."""
    records = []
    for _ in range(rng.randint(0, 14)):
        pieces = [
            rng.choice(LONG_PIECES if rng.random() < 0.05 else PIECES)
            for _ in range(rng.randint(0, 30))
        ]
        if rng.random() < 0.3:
            pieces.append(rng.choice([ESC, ESC + "["]))
        records.append((rng.choice(["stdout", "stdout", "stderr", "logger"]), "".join(pieces)))
    return records


@pytest.mark.parametrize("seed", range(4))
def test_the_port_writes_and_counts_as_the_emulator_character_by_character(seed):
    """The port takes runs of line feeds, cursor moves and plain text in one step each;
    the tests' reference (tests/support/emulator_reference.py) takes one character at a time, as
    wandb-core does. 100 random consoles per seed; the count alone (`keep_text=False`) too."""
    rng = random.Random(seed)
    for _ in range(100):
        console = random_console(rng)
        written, lines = reference_output_log(console)
        counted = Console(keep_text=False)
        for stream, text in console:
            counted.write(stream, text)
        assert (output_log(console), counted.lines) == (written, lines), console
