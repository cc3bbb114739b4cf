"""Each option is declared once, as a `MergeRequest` field with its `Spelling`: these tests
fail when the API's keywords, the command line, the "given" checks or the ledger's
fingerprint drift from that declaration."""

from __future__ import annotations

import dataclasses
from typing import get_type_hints

import click
import pytest

from wbmerge.cli import main
from wbmerge.sync import MergeRequest, RequestOptions, plan_jobs, request_fields
from wbmerge.sync.request import merge_options_given, shared_only_given

from ..conftest import job_dir

FIELDS = request_fields()


def another_value(name: str, tmp_path):
    """A value of option `name` other than its default, of the right type."""
    option_type, _ = FIELDS[name]
    special = {
        "key_format": "{label}/{key}",
        "label_pattern": "rank_{rank}",
        "per_rank": ("none",),
        "files_from": (str(tmp_path),),
    }
    if name in special:
        return special[name]
    if option_type.is_flag:
        return True
    if option_type.choices is not None:
        return next(c for c in option_type.choices if c not in (None, option_type.default))
    if option_type.is_sequence:
        return ("x",)
    return "r.json" if option_type.is_path else "x"


def test_every_field_but_paths_is_an_option_with_a_spelling():
    names = [f.name for f in dataclasses.fields(MergeRequest)]
    assert names[0] == "paths" and list(FIELDS) == names[1:]
    for name, (_, spelling) in FIELDS.items():
        assert spelling.flags[0] == "--" + name.replace("_", "-") or name == "ranks_file", name
        assert spelling.help.endswith("."), name


def test_the_api_keywords_are_the_fields_with_their_types():
    request = get_type_hints(MergeRequest)
    assert get_type_hints(RequestOptions) == {k: v for k, v in request.items() if k != "paths"}


def commands_with_options():
    """(command path, click params by name) of every command taking request options."""
    found = []

    def walk(command, path):
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            params = {p.name: p for p in command.params}
            if set(params) & set(FIELDS):
                found.append((" ".join(path), params))

    walk(main, [])
    return found


@pytest.mark.parametrize("command, params", commands_with_options())
def test_the_command_line_spells_each_option_as_declared(command, params):
    for name, param in params.items():
        if name not in FIELDS:
            continue
        option_type, spelling = FIELDS[name]
        assert tuple(param.opts + param.secondary_opts) == spelling.flags or set(param.opts) == set(
            spelling.flags
        ), (command, name)
        if option_type.choices is not None:
            assert set(param.type.choices) == {c for c in option_type.choices if c is not None}
        assert param.is_flag == option_type.is_flag, (command, name)
        assert param.multiple == option_type.is_sequence or name == "label_pattern"
    if command in ("merge", "sync", "follow", "verify"):
        merge_options = set(FIELDS) - {"verify", "resend"}
        assert merge_options <= set(params), (command, merge_options - set(params))


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_an_option_is_given_exactly_where_its_spelling_says(name, tmp_path):
    _, spelling = FIELDS[name]
    request = MergeRequest(["."], **{name: another_value(name, tmp_path)})
    shaping = merge_options_given(request)
    shared = shared_only_given(request)
    assert shared == ([spelling.flags[0]] if spelling.shared_only else [])
    expected = [spelling.flags[0]] if spelling.shapes_merge or spelling.shared_only else []
    assert shaping == expected
    assert merge_options_given(MergeRequest(["."])) == shared_only_given(MergeRequest(["."])) == []


@pytest.fixture(scope="module")
def planned_job():
    request = MergeRequest([job_dir("one_node_4")], run_mode="shared")
    [job] = plan_jobs(request)
    return request, job


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_the_ledger_fingerprint_covers_exactly_the_options_declared_in_it(
    name, planned_job, tmp_path
):
    """A run synced with another value of a fingerprinted option is another upload (the
    ledger must not say "already synced"); any other option leaves the fingerprint."""
    request, job = planned_job
    _, spelling = FIELDS[name]
    changed = dataclasses.replace(request, **{name: another_value(name, tmp_path)})
    assert (job.ledger_settings(changed) != job.ledger_settings(request)) == spelling.fingerprint
