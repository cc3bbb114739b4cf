"""The server's rows read fast mean what `json` reads: orjson's way against the reference on
hostile and edge texts (equal values and equal types, or the same error), and a read-back
through each way still fails on a row the server lost or a value it changed."""

from __future__ import annotations

import base64
import json
import math
import os
import struct
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from wbmerge.log import LogWriter, pb
from wbmerge.upload import Credentials, Delivery, ServerClient, serverjson
from wbmerge.upload import serverclient as server_module
from wbmerge.verify import history_row, rows_not_held
from wbmerge.wandbcore import read_staged

FAST = serverjson.WAYS["orjson"]  # (orjson is a dependency: its way must be there)
REFERENCE = serverjson.WAYS["json"]


def outcome(way, text):
    """What a way makes of `text`: ("value", it) or ("error", its type and message)."""
    try:
        return ("value", way(text))
    except (ValueError, RecursionError) as exc:
        return ("error", type(exc), str(exc))


def identical(a, b) -> bool:
    """Equal values of equal types all the way down: floats bit for bit (NaN is NaN, -0.0 is
    not 0.0), objects key by key in the same order. A loop, for values nested 900 deep."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if type(x) is float:
            if struct.pack("<d", x) != struct.pack("<d", y):
                return False
        elif type(x) is dict:
            if list(x) != list(y):
                return False
            pending += [(x[k], y[k]) for k in x]
        elif type(x) is list or type(x) is tuple:
            if len(x) != len(y):
                return False
            pending += list(zip(x, y, strict=True))
        elif x != y:
            return False
    return True


def assert_alike(text):
    fast, reference = outcome(FAST, text), outcome(REFERENCE, text)
    assert identical(fast, reference), (text[:200], fast, reference)


# ---- texts: the tokens wandb writes, and those a hostile server could ----------------------

NUMBERS = st.from_regex(
    r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?", fullmatch=True
)
EDGES = st.sampled_from(
    [
        "NaN",
        "Infinity",
        "-Infinity",
        "-0.0",
        "-0",
        "0.0",
        "1e400",
        "-1e400",
        "1e-400",
        "true",
        "false",
        "null",
        str(2**63 - 1),
        str(2**63),
        str(2**64 - 1),
        str(2**64),
        str(2**64 + 1),
        str(-(2**63)),
        str(-(2**63) - 1),
        str(10**30),
        str(-(10**30)),
        "9007199254740993",
        "1.7976931348623157e308",
        "1.7976931348623159e308",
        "5e-324",
        "9223372036854775808.0",
        "18446744073709551616e0",
        "nan",
        "inf",
        "01",
        "1.",
        ".5",
    ]
)
CHARACTERS = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
ESCAPES = st.one_of(
    st.integers(0, 0xFFFF).map(lambda code: f"\\u{code:04x}"),  # lone surrogates among them
    st.integers(0xD800, 0xDFFF).map(lambda code: f"\\u{code:04X}"),
    st.sampled_from(['\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\x", "\\"]),
)
STRINGS = st.one_of(
    st.lists(st.one_of(CHARACTERS.filter(lambda c: c not in '"\\'), ESCAPES), max_size=12).map(
        lambda parts: '"' + "".join(parts) + '"'
    ),
    st.tuples(st.text(CHARACTERS, max_size=12), st.booleans()).map(
        lambda s: json.dumps(s[0], ensure_ascii=s[1])
    ),
)
KEYS = st.one_of(
    st.sampled_from(['"_step"', '"\\u005fstep"', '"a"', '"b"', '"a/b"', '"\\ud800"', '""']),
    STRINGS,
)
SPACE = st.sampled_from(["", " ", "\n\t ", "\r"])


def containers(children):
    arrays = st.tuples(st.lists(children, max_size=5), SPACE).map(
        lambda t: "[" + f",{t[1]}".join(t[0]) + "]"
    )
    objects = st.lists(st.tuples(KEYS, children), max_size=6).map(
        lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
    )
    return st.one_of(arrays, objects)


INTEGERS = st.integers(-(2**80), 2**80).map(str)  # (orjson reads those past 64 bits as floats)
VALUES = st.recursive(st.one_of(NUMBERS, INTEGERS, EDGES, STRINGS), containers, max_leaves=30)
DEEP = st.tuples(st.integers(0, 1500), st.sampled_from(["[", '{"a":', '[{"b":']), VALUES).map(
    lambda t: (
        t[0] * t[1] + t[2] + t[0] * "".join({"[": "]", "{": "}"}.get(c, "") for c in t[1])[::-1]
    )
)
ROWS = st.lists(st.tuples(KEYS, VALUES), max_size=8).map(
    lambda pairs: (
        '{"_step":1,' + ",".join(f"{k}:{v}" for k, v in pairs) + "}" if pairs else '{"_step":1}'
    )
)


def mutated(texts):
    """A text with one character cut or put in, so that texts not quite JSON are read too."""
    return st.tuples(
        texts,
        st.integers(0, 10**6),
        st.sampled_from(["", "}", "]", ",", '"', "\x00", "\ud800", "NaN"]),
    ).map(
        lambda t: (
            t[0][: t[1] % (len(t[0]) + 1)] + t[2] + t[0][t[1] % (len(t[0]) + 1) + (t[2] == "") :]
        )
    )


@given(st.one_of(VALUES, ROWS, DEEP, mutated(VALUES), mutated(ROWS), st.text(CHARACTERS)))
@example('{"_step": 3, "loss": NaN, "up": Infinity, "down": -Infinity, "zero": -0.0}')
@example('{"big": 18446744073709551616, "small": -9223372036854775809, "most": 9.3e18}')
@example('{"far": 1e400, "near": -1e400, "tiny": 1e-400}')
@example("[" * 300 + "]" * 300)
@example("[" * 1200 + "]" * 1200)
@example('{"a": 1, "b": 2, "a": 3}')
@example('{"s": "\\ud800 \\udfff \\ud83d\\ude00 \\u00e9"}')
def test_the_fast_way_reads_every_text_as_json_does(text):
    assert_alike(text)


@given(
    st.one_of(VALUES, ROWS, mutated(ROWS)),
    st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-8-sig"]),
)
def test_the_fast_way_reads_every_answer_as_json_does(text, encoding):
    """Answers come as bytes: json detects UTF-16 and UTF-32 and takes encoded surrogates."""
    assert_alike(text.encode(encoding, "surrogatepass"))


@pytest.mark.parametrize(
    "text, value",
    [
        ('{"_step": 3, "loss": NaN}', {"_step": 3, "loss": math.nan}),
        ('{"up": Infinity, "down": -Infinity}', {"up": math.inf, "down": -math.inf}),
        ('{"zero": -0.0, "int": -0}', {"zero": -0.0, "int": 0}),
        ('{"big": 18446744073709551616}', {"big": 2**64}),  # an int, not orjson's float
        ('{"small": -9223372036854775809}', {"small": -(2**63) - 1}),
        ('{"most": 18446744073709551615}', {"most": 2**64 - 1}),
        ('{"far": 1e400, "near": 1e-400}', {"far": math.inf, "near": 0.0}),
        ('{"a": 1, "b": 2, "a": 3}', {"a": 3, "b": 2}),  # the last one, at the first's place
        ('{"s": "\\ud800", "t": "\\ud83d\\ude00"}', {"s": "\ud800", "t": "\U0001f600"}),
        ("[" * 300 + "1" + "]" * 300, "deep"),
    ],
)
def test_hostile_rows_are_read_as_json_reads_them(text, value):
    if value == "deep":
        value = 1
        for _ in range(300):
            value = [value]
    for way in (FAST, REFERENCE):
        assert identical(way(text), value), way


def test_nesting_json_cannot_read_is_refused_by_both_ways():
    text = "[" * 100_000 + "]" * 100_000  # (orjson reads it; json cannot)
    assert outcome(FAST, text)[:2] == outcome(REFERENCE, text)[:2] == ("error", RecursionError)


def test_plain_rows_are_read_without_json_and_hostile_ones_by_it(monkeypatch):
    """The fast way is taken (but with `WBMERGE_PURE=1`), by the client too: json reads
    only the rows orjson cannot read alike."""
    assert serverjson.WAY == ("json" if os.environ.get("WBMERGE_PURE") else "orjson")
    assert server_module.loads is serverjson.WAYS[serverjson.WAY]
    read = []
    monkeypatch.setattr(
        serverjson, "json", SimpleNamespace(loads=lambda t: read.append(t) or json.loads(t))
    )
    plain = '{"_step": 7, "loss": 0.25, "acc": {"top1": [1, 2.5]}, "name": "x\\u00e9"}'
    assert FAST(plain) == {"_step": 7, "loss": 0.25, "acc": {"top1": [1, 2.5]}, "name": "xé"}
    assert read == []
    for hostile in ('{"loss": NaN}', '{"big": 18446744073709551616}', '{"s": "\\udc00"}'):
        FAST(hostile)
    assert len(read) == 3


# ---- the read-back, through each way, against a server that lost or changed a row ----------

STEPS = 40
NAN_STEP, INF_STEP, BIG_STEP, NESTED_STEP = 5, 9, 13, 17


def write_log(root: Path) -> Path:
    """A staged log of `STEPS` rows: plain floats, and at some steps NaN, Infinity, an int
    past 64 bits and a nested object holding NaN and -0.0."""
    path = root / "run-readback.wandb"
    with open(path, "wb") as stream, LogWriter(stream) as writer:
        records = [pb.Record(), pb.Record()]
        records[0].header.version_info.producer = "test"
        records[1].run.run_id = "readback"
        for step in range(STEPS):
            items = [("_step", str(step)), ("loss", repr(1 / (step + 3))), ("lr", "0.001")]
            items += {
                NAN_STEP: [("acc", "NaN")],
                INF_STEP: [("grad", "Infinity"), ("low", "-Infinity")],
                BIG_STEP: [("tokens", str(2**70))],
                NESTED_STEP: [("eval", '{"a": [1, -0.0, NaN], "b": 2.5}')],
            }.get(step, [])
            record = pb.Record()
            for key, value in items:
                item = record.history.item.add()
                item.nested_key.append(key)
                item.value_json = value
            record.history.step.num = step
            records.append(record)
        records.append(pb.Record())
        records[-1].exit.exit_code = 0
        for num, record in enumerate(records, 1):
            record.num = num
            writer.write(record.SerializeToString())
    return path


def post_rows(sink, run_id: str, rows: dict[int, dict]) -> None:
    """History lines at their offsets (rows by offset), as wandb-core writes them."""
    auth = "Basic " + base64.b64encode(f"api:{sink.env['WANDB_API_KEY']}".encode()).decode()
    for offset, row in rows.items():
        body = {"files": {"wandb-history.jsonl": {"offset": offset, "content": [json.dumps(row)]}}}
        request = urllib.request.Request(
            f"{sink.url}/files/local/readback/{run_id}/file_stream",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": auth},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200


def changed(rows: list[dict], step: int, key: str, value: object) -> dict[int, dict]:
    return {i: ({**row, key: value} if i == step else row) for i, row in enumerate(rows)}


FAULTS = {
    "intact": (lambda rows: dict(enumerate(rows)), None),
    "a row lost": (
        lambda rows: {i: row for i, row in enumerate(rows) if i != 21},
        "the server lacks 1 of 40 rows sent (steps 21)",
    ),
    "a float's last digit": (
        lambda rows: changed(rows, 30, "loss", math.nextafter(rows[30]["loss"], 1.0)),
        f"the row at step 30 holds 'loss' = {math.nextafter(1 / 33, 1.0)!r}",
    ),
    "NaN to null": (lambda rows: changed(rows, NAN_STEP, "acc", None), "holds 'acc' = None"),
    "Infinity to the largest float": (
        lambda rows: changed(rows, INF_STEP, "grad", 1.7976931348623157e308),
        "holds 'grad' = 1.7976931348623157e+308",
    ),
    # (read as orjson reads it, 2**70 + 1 would be the float 2.0**70: equal to what was sent)
    "an int past 64 bits, off by one": (
        lambda rows: changed(rows, BIG_STEP, "tokens", 2**70 + 1),
        f"holds 'tokens' = {2**70 + 1}",
    ),
    "NaN to null inside an object": (
        lambda rows: changed(rows, NESTED_STEP, "eval", {"a": [1, -0.0, None], "b": 2.5}),
        "the row at step 17 holds 'eval'",
    ),
}


@pytest.mark.parametrize("way", sorted(serverjson.WAYS))
def test_the_read_back_fails_on_a_lost_row_or_a_changed_value_through_each_way(
    sink, tmp_path, monkeypatch, way
):
    log = write_log(tmp_path)
    rows = [history_row(log, i) for i in range(STEPS)]
    assert math.isnan(rows[NAN_STEP]["acc"]) and rows[BIG_STEP]["tokens"] == 2**70
    read = []
    monkeypatch.setattr(
        server_module, "loads", lambda text: read.append(text) or serverjson.WAYS[way](text)
    )
    client = ServerClient(Credentials(sink.url, sink.env["WANDB_API_KEY"]))
    try:
        for n, (fault, (lines, problem)) in enumerate(FAULTS.items()):
            run_id = f"{way}{n}"
            post_rows(sink, run_id, lines(rows))
            held = client.held("local", "readback", run_id)
            delivery = Delivery(run_id, tmp_path, log, "key", "fingerprint")
            problems = rows_not_held(client, "local", "readback", delivery, held, read_staged(log))
            if problem is None:
                assert problems == [], fault
            else:
                assert len(problems) == 1 and problem in problems[0], (fault, problems)
    finally:
        client.close()
    rows_read = sum(isinstance(text, str) and text.startswith('{"_step"') for text in read)
    assert rows_read >= STEPS * len(FAULTS) - 1, "every row was read by this way"
