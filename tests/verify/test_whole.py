"""Whether the server holds a run whole already, as pure functions of the staged run and
what the server shows: its counts, state, names, config, summary and files, and the files
wandb-core made, read back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from wbmerge.upload import Held, RunListing
from wbmerge.verify import made_files_stale, not_held_whole
from wbmerge.verify.whole import files_changed, files_expected, files_missing
from wbmerge.wandbcore import LoggedRun, StagedContent

STAGED = StagedContent(step_items=(0, 1, 2, 5, 9), events=3, console_lines=4)


@pytest.mark.parametrize(
    "staged_files, console, metadata, expected",
    [
        # wandb-core always puts the config and the summary, whatever the run holds
        ({}, 0, False, {"config.yaml": None, "wandb-summary.json": None}),
        # console output: output.log
        ({}, 4, False, {"config.yaml": None, "wandb-summary.json": None, "output.log": None}),
        # an environment record: wandb-metadata.json
        (
            {},
            0,
            True,
            {"config.yaml": None, "wandb-summary.json": None, "wandb-metadata.json": None},
        ),
        # the run's own files at their staged size; wandb's own names by name only (an old
        # wandb wrote them into files/, and wandb-core writes them again as it uploads)
        (
            {
                "media/a.png": 90,
                "requirements.txt": 12,
                "config.yaml": (40, "C=="),
            },
            0,
            False,
            {
                "media/a.png": 90,
                "requirements.txt": 12,
                "config.yaml": None,
                "wandb-summary.json": None,
            },
        ),
    ],
)
def test_files_expected_after_a_whole_upload(staged_files, console, metadata, expected):
    staged = StagedContent((0,), 0, console, metadata=metadata)
    assert files_expected(staged_files, staged) == expected


@pytest.mark.parametrize(
    "held, problems",
    [
        ({"a.png": 90, "config.yaml": 5, "extra.txt": 1}, []),  # more on the server is fine
        ({"a.png": 90}, ["file config.yaml not on the server"]),
        ({"a.png": 89, "config.yaml": 5}, ["file a.png holds 89 bytes of 90"]),
        ({}, ["file a.png not on the server", "file config.yaml not on the server"]),
    ],
)
def test_files_missing_names_each_file_absent_or_of_another_size(held, problems):
    assert files_missing({"a.png": 90, "config.yaml": None}, held) == problems


@pytest.mark.parametrize(
    "md5s, problems",
    [
        ({"a.png": "A==", "b.txt": "B==", "extra.txt": "X=="}, []),
        # the same size, other content: a later version whose upload failed
        ({"a.png": "A==", "b.txt": "C=="}, ["file b.txt is not the staged one (MD5)"]),
        ({"a.png": "A=="}, ["file b.txt is not the staged one (MD5)"]),  # (none given)
    ],
)
def test_files_changed_names_each_file_of_other_content(md5s, problems):
    listing = RunListing("finished", ("", "", ""), {"a.png": 90, "b.txt": 3}, md5s)
    assert files_changed({"a.png": "A==", "b.txt": "B=="}, listing) == problems


WHOLE = Held(
    True,
    5,
    3,
    4,
    9,
    summary_json=json.dumps({"loss": 0.5, "_step": 9}),
    config_json=json.dumps({"lr": {"value": 0.1}, "_wandb": {"value": {}}}),
    tags=("a", "b"),
)
LISTED = RunListing(
    "finished",
    ("n", "g", "train"),
    {"a.png": 90, "config.yaml": 5},
    {"a.png": "A==", "config.yaml": "C=="},
)
CONSOLE = b"epoch 0\nepoch 1\nepoch 2\ndone\n"
LOGGED = LoggedRun(("n", "g", "train"), ("a",), {"lr": 0.1}, {"loss": 0.5, "_runtime": 3}, CONSOLE)
UNNAMED = replace(LOGGED, names=("", "", ""))


@pytest.mark.parametrize(
    "held, listing, logged, exit_code, problems",
    [
        (WHOLE, LISTED, LOGGED, 0, []),
        (WHOLE, LISTED, UNNAMED, 0, []),  # names this upload leaves as they are
        (replace(WHOLE, events_lines=2), LISTED, UNNAMED, 0, ["system-metric rows 2 of 3"]),
        # an upload that ended before its last request, or ended as another exit code did
        (
            WHOLE,
            replace(LISTED, state="running"),
            UNNAMED,
            0,
            ["state 'running', a whole upload leaves finished"],
        ),
        (
            WHOLE,
            replace(LISTED, state="crashed"),
            UNNAMED,
            0,
            ["state 'crashed', a whole upload leaves finished"],
        ),
        (WHOLE, LISTED, UNNAMED, 1, ["state 'finished', a whole upload leaves failed"]),
        (
            WHOLE,
            replace(LISTED, state=""),
            UNNAMED,
            0,
            ["state 'unknown', a whole upload leaves finished"],
        ),
        (
            WHOLE,
            LISTED,
            replace(LOGGED, names=("n", "other", "eval")),
            0,
            ["group 'g', this upload gives 'other'", "job type 'train', this upload gives 'eval'"],
        ),
        # what was changed on the server since: tags, config and summary
        (replace(WHOLE, tags=("b",)), LISTED, UNNAMED, 0, ["tags not on the server: a"]),
        (
            replace(WHOLE, config_json=json.dumps({"lr": {"value": 0.2}})),
            LISTED,
            UNNAMED,
            0,
            ["config keys differ: lr"],
        ),
        (replace(WHOLE, config_json="{}"), LISTED, UNNAMED, 0, ["config keys differ: lr"]),
        (
            replace(WHOLE, summary_json=json.dumps({"_step": 9})),
            LISTED,
            UNNAMED,
            0,
            ["summary keys differ: loss"],
        ),
        (
            replace(WHOLE, summary_json="[not json"),
            LISTED,
            UNNAMED,
            0,
            ["summary keys differ: loss"],
        ),
        # a config kept without W&B's {"value": ...} wrapping, and wandb's own keys
        (replace(WHOLE, config_json=json.dumps({"lr": 0.1})), LISTED, UNNAMED, 0, []),
        (WHOLE, LISTED, replace(UNNAMED, summary={"loss": 0.5, "_step": 4}), 0, []),
        (
            WHOLE,
            replace(LISTED, sizes={"a.png": 90}),
            UNNAMED,
            0,
            ["file config.yaml not on the server"],
        ),
        (
            WHOLE,
            replace(LISTED, sizes={"a.png": 1, "config.yaml": 5}),
            UNNAMED,
            0,
            ["file a.png holds 1 bytes of 90"],
        ),
    ],
)
def test_not_held_whole_names_what_a_whole_upload_would_change(
    held, listing, logged, exit_code, problems
):
    expected = {"a.png": 90, "config.yaml": None}
    assert not_held_whole(STAGED, held, listing, expected, logged, exit_code) == problems


@pytest.mark.parametrize(
    "config_checked, problems",
    [
        (True, ["config keys not in the files: lr/rank-1"]),
        # a shared run: its labelled keys come and go as the ranks log (`Delivery.config_checked`)
        (False, []),
    ],
)
def test_a_config_key_no_record_sets_is_named_where_the_config_is_checked(config_checked, problems):
    """The server keeps a key once sent: an earlier upload's `lr/rank-1` stays."""
    held = replace(WHOLE, config_json=json.dumps({"lr": 0.1, "lr/rank-1": 0.2}))
    expected = {"a.png": 90, "config.yaml": None}
    found = not_held_whole(STAGED, held, LISTED, expected, UNNAMED, 0, config_checked)
    assert found == problems


SUMMARY = b'{"loss": 0.5, "_step": 9, "_runtime": 3.2, "_wandb": {"runtime": 3}}'
CONFIG = b"_wandb:\n    value:\n        cli_version: 0.31.0\nlr:\n    value: 0.1\n"
MADE = {"wandb-summary.json": SUMMARY, "config.yaml": CONFIG, "output.log": CONSOLE}


@pytest.mark.parametrize(
    "made, staged, logged, problems",
    [
        (MADE, STAGED, LOGGED, []),
        ({}, STAGED, LOGGED, []),  # (a file a whole upload would not make is not read)
        # a summary file of an upload of fewer rows, or of other values
        (
            {**MADE, "wandb-summary.json": b'{"loss": 0.5, "_step": 5}'},
            STAGED,
            LOGGED,
            ["wandb-summary.json from another upload: _step"],
        ),
        (
            {**MADE, "wandb-summary.json": b'{"loss": 0.5}'},
            STAGED,
            LOGGED,
            ["wandb-summary.json from another upload: _step"],
        ),
        (
            {**MADE, "wandb-summary.json": b'{"loss": 0.4, "_step": 9}'},
            STAGED,
            LOGGED,
            ["wandb-summary.json from another upload: loss"],
        ),
        (
            {**MADE, "wandb-summary.json": b"[1, 2"},
            STAGED,
            LOGGED,
            ["wandb-summary.json from another upload: loss, _step"],
        ),
        (
            {**MADE, "wandb-summary.json": b'{"loss": 0.5, "_step": 9, "x": "\xff"}'},
            STAGED,
            LOGGED,
            ["wandb-summary.json from another upload: loss, _step"],
        ),  # (not UTF-8)
        (
            {**MADE, "wandb-summary.json": None},
            STAGED,
            LOGGED,
            ["wandb-summary.json could not be read"],
        ),
        # a run without rows has no `_step` to check
        ({**MADE, "wandb-summary.json": b'{"loss": 0.5}'}, StagedContent((), 3, 4), LOGGED, []),
        # the config file: each staged key at its value, as wandb-core (Go's yaml.v3) writes
        # it: YAML 1.2, where 1e-05 is a float and a bare ISO time, = or << is a string
        (
            {**MADE, "config.yaml": b"lr:\n    value: 0.2\n"},
            STAGED,
            LOGGED,
            ["config.yaml from another upload: lr"],
        ),
        (
            {**MADE, "config.yaml": b"lr:\n    value: 1e-05\n"},
            STAGED,
            replace(LOGGED, config={"lr": 1e-05}),
            [],
        ),
        (
            {**MADE, "config.yaml": b'lr:\n    value: "1e-05"\n'},
            STAGED,
            replace(LOGGED, config={"lr": "1e-05"}),
            [],
        ),
        (
            {**MADE, "config.yaml": b"lr:\n    value: .nan\n"},
            STAGED,
            replace(LOGGED, config={"lr": float("nan")}),
            [],
        ),
        (
            {**MADE, "config.yaml": b"t:\n    value: 2024-05-06T07:08:09.123456\n"},
            STAGED,
            replace(LOGGED, config={"t": "2024-05-06T07:08:09.123456"}),
            [],
        ),
        (
            {**MADE, "config.yaml": b"op:\n    value: =\n<<:\n    value: 3\n"},
            STAGED,
            replace(LOGGED, config={"op": "=", "<<": 3}),
            [],
        ),
        (
            {**MADE, "config.yaml": b"- lr\n"},
            STAGED,
            LOGGED,
            ["config.yaml could not be read as a config"],
        ),
        (
            {**MADE, "config.yaml": b"lr: &a\n    value: 0.1\nb: *a\n"},
            STAGED,
            LOGGED,
            ["config.yaml could not be read as a config"],
        ),  # (aliases are not read)
        (
            {**MADE, "config.yaml": b"lr: [\n"},
            STAGED,
            LOGGED,
            ["config.yaml could not be read as a config"],
        ),
        (
            {**MADE, "config.yaml": b"lr: !!python/object:os.system {}\n"},
            STAGED,
            LOGGED,
            ["config.yaml could not be read as a config"],
        ),
        # the console file: what wandb-core writes of the staged console (`LoggedRun.console`)
        (
            {**MADE, "output.log": b"epoch 0\nepoch 1\nepoch 2\n"},
            STAGED,
            LOGGED,
            ["output.log from another upload: not the staged console"],
        ),
        (
            {**MADE, "output.log": b"epoch 0\nepoch 1\nepoch 2\nDONE\n"},
            STAGED,
            LOGGED,
            ["output.log from another upload: not the staged console"],
        ),  # (same lines, sizes)
        (
            {**MADE, "output.log": CONSOLE},
            STAGED,
            replace(LOGGED, console=b"\n" + CONSOLE),
            ["output.log from another upload: not the staged console"],
        ),
        ({**MADE, "output.log": None}, STAGED, LOGGED, ["output.log could not be read"]),
        (
            {**MADE},
            STAGED,
            replace(LOGGED, console=None),
            ["output.log not foretold: the console is over its limit"],
        ),
    ],
)
def test_made_files_stale_names_the_files_another_upload_made(made, staged, logged, problems):
    assert made_files_stale(made, staged, logged) == problems
