"""How wandb-core reads history rows and the `_step` it sends each at (`wbmerge.wandbcore.sentrows`),
as table tests.

The tables are wandb-core 0.31's behaviour as measured through `wandb sync` into the sink;
`tests/support/steprows.py` holds the rows, and `test_odd_input` sends them through the real
uploader again.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from wbmerge.log import pb
from wbmerge.upload import read_json
from wbmerge.wandbcore import item_step, json_value, sent_steps, sentrows, with_step
from wbmerge.wandbcore.sentrows import NOT_JSON, ROW_WAYS, bare_number, json_int

from ..support.ranklogs import history_record
from ..support.steprows import INT64_MAX, INT64_MIN, ODD_ROWS


@pytest.mark.parametrize(
    "text, value",
    [
        ("0", 0),
        ("-0", 0),
        ("42", 42),
        (" 42\n", 42),
        ("\t42\r", 42),
        ("0042", 42),
        ("-0042", -42),
        (str(INT64_MAX), INT64_MAX),
        (str(INT64_MIN), INT64_MIN),
        ("0000000000000000042", 42),  # 19 characters: as long as int64's largest
        ("00000000000000000042", None),  # 20: a float to wandb-core's parser
        ("9223372036854775808", None),  # one past int64's largest
        ("-9223372036854775809", None),
        ("+42", None),
        ("42.0", None),
        ("4e1", None),
        ("42x", None),
        ("4 2", None),
        ("-", None),
        ("1-2", None),
        ("", None),
        ('"42"', None),
        ("true", None),
        ("\u00a042", None),  # a blank JSON does not know
    ],
)
def test_json_int_reads_integers_as_wandb_cores_parser(text, value):
    assert json_int(text) == value


def test_item_step_and_sent_steps_follow_the_measured_rows():
    payloads = [history_record(items, field) for items, field, _, _ in ODD_ROWS]
    items = [item_step(payload) for payload in payloads]
    assert items == [item for _, _, item, _ in ODD_ROWS]
    assert sent_steps(items) == [sent for *_, sent in ODD_ROWS]


@pytest.mark.parametrize(
    "items, start, sent",
    [
        ([0, 1, None, 2, 9, None, 5], 0, [0, 1, 2, 3, 9, 10, 11]),  # the module's example
        ([], 0, []),
        ([None, None], 0, [0, 1]),
        ([0, 1, 2], 10, [10, 11, 12]),  # a run record's starting step moves rows behind it
        ([-5, None], -100, [-5, -4]),
        ([INT64_MAX, 6, None], 0, [INT64_MAX, 6, 7]),  # after int64's largest: int64's least
        ([INT64_MAX, None, INT64_MIN], 0, [INT64_MAX, INT64_MIN, INT64_MIN + 1]),
    ],
)
def test_sent_steps(items, start, sent):
    assert sent_steps(items, start) == sent


def test_with_step_makes_the_row_sent_at_that_step_and_keeps_its_other_items():
    payload = history_record(
        [(["loss"], "0.5"), (["_step"], "3"), (["_step", "x"], "1"), ("_step", '"y"'), ("a", "2")],
        3,
    )
    moved = pb.Record.FromString(with_step(payload, 17))
    assert item_step(with_step(payload, 17)) == 17
    assert moved.history.step.num == 17
    kept = {tuple(i.nested_key) or (i.key,): i.value_json for i in moved.history.item}
    assert kept == {("loss",): "0.5", ("a",): "2", ("_step",): "17"}


DEEP = 500  # a value inside 500 arrays is read; inside 501 it is refused


def nested(inner: object, depth: int) -> object:
    for _ in range(depth):
        inner = [inner]
    return inner


@pytest.mark.parametrize(
    "text, value",
    [
        ("0100", 100),
        ("01.5", 1.5),  # Python's json refuses leading zeros; wandb-core's parser takes them
        ("[01, -0]", [1, 0]),
        ('{"a": 01}', {"a": 1}),
        ("[1.]", [1.0]),
        ("Infinity", float("inf")),
        ("[-Inf]", [float("-inf")]),
        ("1e400", float("inf")),  # past a float's range: kept as infinite
        ("99999999999999999999", 1e20),  # past int64: a float
        ('{"a": [1, {"b": null}], "c": true}', {"a": [1, {"b": None}], "c": True}),
        (' \t"x"\n', "x"),
        ("[" * DEEP + "1" + "]" * DEEP, nested(1, DEEP)),
        ("[" * (DEEP + 1) + "]" * (DEEP + 1), nested([], DEEP)),  # an empty list at 501
        ("-nan", NOT_JSON),  # Go's float parser takes no sign before NaN
        ("nan", NOT_JSON),
        ("[" * (DEEP + 1) + "1" + "]" * (DEEP + 1), NOT_JSON),
        ("[1,]", NOT_JSON),
        ("[,1]", NOT_JSON),
        ('{"a":1,}', NOT_JSON),
        ("{]", NOT_JSON),
        ("[1 2]", NOT_JSON),
        ('"a\tb"', NOT_JSON),  # a control character inside a string
        ("+1", NOT_JSON),
        ("1-2", NOT_JSON),
        ("nul", NOT_JSON),
        ("truex", NOT_JSON),
        ("", NOT_JSON),
        ("  ", NOT_JSON),
    ],
)
def test_json_value_reads_as_wandb_cores_parser(text, value):
    for reference in (False, True):
        found = json_value(text, reference)
        assert found == value and type(found) is type(value), reference


def same_reading(a, b) -> bool:
    """The same value of the same type, floats bit for bit (NaN, -0.0); or both refused."""
    if a is NOT_JSON or b is NOT_JSON:
        return a is b
    if type(a) is float and type(b) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


# Texts of the characters a number token may hold, blanks and some of JSON's other ones.
NUMBERISH = st.text(alphabet="-0123456789.+eEIinfatyNul \t[]", max_size=30)


@given(
    st.one_of(
        NUMBERISH,
        st.floats().map(repr),
        st.floats().map(lambda f: format(f, ".17g")),
        st.integers(-(2**70), 2**70).map(str),
        st.integers(0, 10**25).map(lambda i: "0" * (i % 7) + str(i)),
        st.text(max_size=20),
    )
)
@example("NaN")
@example("-NaN")
@example("Infinity")
@example("-Inf")
@example("1e400")
@example("-0")
@example("-0.0")
@example("00000000000000000042")
@example("-")
@example("1-2")
@example("1e5.5")
def test_a_bare_number_is_read_as_the_parser_reads_it(text):
    assert same_reading(json_value(text), json_value(text, reference=True)), text


def test_metric_values_are_read_without_the_parser():
    """The shortcut is taken for the numbers wandb writes, and only for a number alone."""
    for text in (
        "0.1",
        repr(0.1 + 0.2),
        "-1e-07",
        "1.7976931348623157e+308",
        "42",
        "NaN",
        "Infinity",
        "-Infinity",
        str(INT64_MAX),
        "1e400",
    ):
        assert bare_number(text) is not None, text
    for text in (" 42", "42\n", "[1]", '"1"', "true", "null", ""):
        assert bare_number(text) is None, text
    assert bare_number("-nan") is NOT_JSON and bare_number("1-2") is NOT_JSON


def same_row(a: dict, b: dict) -> bool:
    """The same keys in the same order, each value read alike (`same_reading`), objects
    and lists item by item."""
    if list(a) != list(b):
        return False
    return all(same_value_read(a[key], b[key]) for key in a)


def same_value_read(a, b) -> bool:
    if type(a) is dict and type(b) is dict:
        return same_row(a, b)
    if type(a) is list and type(b) is list:
        return len(a) == len(b) and all(map(same_value_read, a, b))
    return same_reading(a, b)


def history_of(items: list[tuple[str | None, list[str], str]]) -> pb.HistoryRecord:
    """A history record of items (key, nested key, JSON text)."""
    history = pb.HistoryRecord()
    for key, nested, text in items:
        item = history.item.add()
        if key is not None:
            item.key = key
        item.nested_key.extend(nested)
        item.value_json = text
    return history


REFERENCE_ROW, FLAT_ROW = ROW_WAYS["reference"], ROW_WAYS["flat"]


@pytest.mark.parametrize(
    "items",
    [
        [(None, ["loss"], "0.5"), (None, ["_step"], "3"), (None, ["acc"], "NaN")],
        [("loss", [], "1"), ("loss", [], "2.5")],  # (the later item of a key wins)
        [("", [], "1"), (None, ["x"], "2")],  # (an item with no key is dropped)
        [(None, [""], "1")],  # (a nested key of one empty part is kept)
        [(None, ["a", "b"], "1"), (None, ["a"], "2")],  # (nested: the reference's)
        [(None, ["x"], "0042"), (None, ["y"], "Inf"), (None, ["z"], "+7")],
        [(None, ["x"], "-NaN"), (None, ["y"], "-Infinity"), (None, ["z"], "1e400")],
        [(None, ["x"], "9223372036854775808"), (None, ["y"], str(INT64_MIN))],
        [(None, ["x"], "1,2"), (None, ["y"], "3")],  # (a text of two values is refused)
        [(None, ["x"], ""), (None, ["y"], " 5\n"), (None, ["z"], "true")],
        [(None, ["x"], '"\\ud800"'), (None, ["y"], "1")],  # (Go reads a lone half as U+FFFD)
        [(None, ["x"], "[1, {}]"), (None, ["y"], '{"a": 1, "b": {}}')],
        [(None, ["x"], "null"), (None, ["y"], "-0"), (None, ["z"], "-0.0")],
    ],
)
def test_the_flat_row_is_the_reference_row(items):
    history = history_of(items)
    assert same_row(FLAT_ROW(history), REFERENCE_ROW(history)), items
    assert same_row(FLAT_ROW(history, "x"), REFERENCE_ROW(history, "x"))
    # (the read-back reads the texts with orjson where it reads them as json does)
    assert same_row(sentrows.record_row(record_of(history), read_json), REFERENCE_ROW(history))


def test_a_typed_value_is_read_by_the_reference():
    """wandb writes a typed value beside the JSON text when told to; wandb-core takes it."""
    history = history_of([(None, ["x"], "1"), (None, ["y"], "2")])
    history.item[1].integer = 5
    assert FLAT_ROW(history) == REFERENCE_ROW(history) == {"x": 1, "y": 5}


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "", "_step"]), NUMBERISH), max_size=6))
@example([("a", "1"), ("b", "1 ,2")])
@example([("a", "00"), ("b", "1]")])
def test_any_flat_row_is_the_reference_row(pairs):
    history = history_of([(None, [key], text) for key, text in pairs])
    assert same_row(FLAT_ROW(history), REFERENCE_ROW(history)), pairs
    row = sentrows.record_row(record_of(history), read_json)
    assert same_row(row, REFERENCE_ROW(history)), pairs


def test_a_row_read_by_a_reader_unlike_json_is_not_the_reference_row():
    """The comparison above sees a reader that reads a text otherwise than `json`: one that
    reads an integer past int64 as the float it rounds to (as orjson alone does) makes a
    row the reference does not."""

    def rounds_big_integers(text: str) -> object:
        return json.loads(
            text, parse_int=lambda digits: float(digits) if len(digits) > 18 else int(digits)
        )

    history = history_of([(None, ["x"], "9223372036854775807"), (None, ["y"], "1")])
    row = sentrows.record_row(record_of(history), rounds_big_integers)
    assert not same_row(row, REFERENCE_ROW(history))
    assert same_row(sentrows.record_row(record_of(history), read_json), REFERENCE_ROW(history))


def test_the_rows_wandb_writes_are_read_flat(monkeypatch):
    """The metrics of a row wandb writes take the flat way, not the reference's (which
    would be as right, at several times the cost)."""
    history = history_of([(None, [f"m{i}"], repr(i / 7)) for i in range(20)])
    calls = []
    original = sentrows.reference_row
    monkeypatch.setattr(sentrows, "reference_row", lambda *a: calls.append(a) or original(*a))
    row = FLAT_ROW(history)
    assert calls == [] and row == {f"m{i}": i / 7 for i in range(20)}


COMPILED_ITEMS = sentrows.FLAT_ITEMS.get("compiled")
needs_compiled = pytest.mark.skipif(COMPILED_ITEMS is None, reason="extension not built")


def record_of(history: pb.HistoryRecord, step: int | None = 3) -> bytes:
    record = pb.Record(num=9)
    record.history.CopyFrom(history)
    if step is not None:
        record.history.step.num = step
    return record.SerializeToString()


def read_record(payload: bytes):
    """A record's row by bytes (`record_row`) and by the reference, or the error of each."""
    outcomes = []
    for read in (sentrows.record_row, lambda p: REFERENCE_ROW(pb.Record.FromString(p).history)):
        try:
            outcomes.append(("row", read(payload)))
        except Exception as exc:  # (compared: both must raise alike)
            outcomes.append(("error", type(exc)))
    return outcomes


def assert_read_alike(payload: bytes) -> None:
    (way, got), (reference_way, want) = read_record(payload)
    assert way == reference_way, (payload, got, want)
    assert got == want if way == "error" else same_row(got, want), (payload, got, want)


# Item fields on the wire: tag, length, bytes (`key` 1, `nested_key` 2, `value_json` 16).
def wire_item(*fields: tuple[bytes, bytes]) -> bytes:
    body = b"".join(tag + bytes([len(value)]) + value for tag, value in fields)
    return b"\x0a" + bytes([len(body)]) + body


KEY, NESTED, TEXT = b"\x0a", b"\x12", b"\x82\x01"


def wire_record(*items: bytes, extra: bytes = b"") -> bytes:
    history = b"".join(items) + extra
    return b"\x08\x09\x12" + bytes([len(history)]) + history


@pytest.mark.parametrize(
    "payload",
    [
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1"))),
        wire_record(wire_item((KEY, b"a"), (KEY, b"b"), (TEXT, b"1"))),  # (the last key wins)
        wire_record(wire_item((NESTED, b"a"), (NESTED, b"b"), (TEXT, b"1"))),  # (a nested path)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1"), (TEXT, b"2"))),  # (the last text)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"2"))[:-1] + b"\x05\x07"),  # (typed)
        wire_record(wire_item((KEY, b""), (TEXT, b"1")), wire_item((KEY, b"y"), (TEXT, b"2"))),
        wire_record(wire_item((NESTED, b""), (TEXT, b"1"))),
        wire_record(wire_item((NESTED, b"x"))),  # (no text: dropped by the parser)
        wire_record(wire_item((NESTED, b"\xff"), (TEXT, b"1"))),  # (bad UTF-8: not protobuf)
        wire_record(wire_item((NESTED, b"\xed\xa0\x80"), (TEXT, b"1"))),  # (a surrogate)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1")), extra=b"\x12\x02\x08\x01" * 2),
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1")))
        + b"\x12\x04"
        + wire_item((NESTED, b"y")),  # (a second history field: merged by protobuf)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1")), extra=b"\xc2\x0c\x00"),  # (_info)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1"))) + b"\x28\x01",  # (another field)
        wire_record(wire_item((NESTED, b"x"), (TEXT, b"1")))[:-1],  # (cut short)
    ],
)
def test_a_record_read_by_its_bytes_is_read_as_protobuf_reads_it(payload):
    """The compiled reader takes only records in wandb's shape, each field once; a field
    set twice (protobuf keeps the last, or merges), a typed value, another field, bad
    UTF-8 or a cut record goes to protobuf, which decides (and raises where it raises)."""
    assert_read_alike(payload)


@needs_compiled
def test_a_typed_value_or_a_key_set_twice_is_never_read_by_the_bytes():
    """The faults a reader of the bytes could make: take the JSON text where wandb-core
    takes the typed value beside it, or the first of two keys where protobuf keeps the
    last."""
    typed = history_of([(None, ["x"], "1"), (None, ["y"], "2")])
    typed.item[1].integer = 5
    assert COMPILED_ITEMS(record_of(typed)) is None
    assert sentrows.record_row(record_of(typed)) == {"x": 1, "y": 5}
    twice = wire_record(wire_item((KEY, b"a"), (KEY, b"b"), (TEXT, b"1")))
    assert COMPILED_ITEMS(twice) is None
    assert sentrows.record_row(twice) == {"b": 1}


@needs_compiled
@pytest.mark.parametrize("step", [3, None])
def test_the_rows_wandb_writes_are_read_by_their_bytes(step):
    """A row as wandb writes it (with a step field, or none as wandb 0.16) is read in one
    compiled call, its names and texts those protobuf gives, and its row the reference's."""
    history = history_of([(None, [f"m{i}"], repr(i / 7)) for i in range(20)] + [("k", [], "1")])
    payload = record_of(history, step)
    keys, texts = COMPILED_ITEMS(payload)
    assert keys == [f"m{i}" for i in range(20)] + ["k"]
    assert texts == [repr(i / 7) for i in range(20)] + ["1"]
    assert same_row(sentrows.record_row(payload), REFERENCE_ROW(history))


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "", "_step"]), NUMBERISH), max_size=5),
    st.integers(0, 10**6),
    st.binary(max_size=3),
    st.booleans(),
)
def test_any_record_changed_by_a_byte_is_read_as_protobuf_reads_it(pairs, at, put, cut):
    """Records in wandb's shape with bytes put in or cut out: read by their bytes, each
    gives the reference's row, or the same error."""
    payload = record_of(history_of([(None, [key], text) for key, text in pairs]))
    at %= len(payload) + 1
    assert_read_alike(payload[:at] + put + payload[at + cut :])
