"""`records.proven_history` proves history records valid without protobuf; protobuf's parse
is its reference. A record it proves must parse; wandb's own records must be proven (else the
fast path would be a slow path); a string is proven exactly when it is valid UTF-8. The
`_step` it reads on the way must be `sentrows.item_step`'s, where it reads one."""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.log import pb, records, txlog
from wbmerge.wandbcore import item_step

from ..support.ranklogs import history_record
from ..support.steprows import ODD_ROWS
from .test_records import LOGS, any_record


def frames_of(payloads: list[bytes]) -> txlog.Frames:
    """`payloads` as one read's records, laid end to end."""
    ends = np.cumsum([len(p) for p in payloads], dtype=np.int64)
    return txlog.Frames(b"".join(payloads), ends - [len(p) for p in payloads], ends)


def proven(payloads: list[bytes]) -> list[bool]:
    frames = frames_of(payloads)
    return records.proven_history(frames, np.arange(len(payloads))).proven.tolist()


def parses(payload: bytes) -> bool:
    try:
        pb.Record.FromString(payload)
    except DecodeError:
        return False
    return True


def test_every_history_record_of_the_fixtures_is_proven_if_and_only_if_it_parses():
    checked = 0
    for path in LOGS:
        for read in records.read_indexed(path):
            which = read.history
            if not len(which):
                continue
            found = records.proven_history(read.frames, which).proven.tolist()
            for index, ok in zip(which.tolist(), found, strict=True):
                assert ok == parses(read.frames.payload(index)), (path, index)
                checked += 1
    assert checked > 500


def history(items: list[tuple[bytes, bytes]], step: int | None = 7, key_field: int = 2) -> bytes:
    """A history record written byte by byte: items of raw key and value bytes."""

    def field(tag: bytes, value: bytes) -> bytes:
        return tag + bytes([len(value)]) + value

    tag = b"\x0a" if key_field == 1 else b"\x12"
    body = b"".join(field(b"\x0a", field(tag, k) + field(b"\x82\x01", v)) for k, v in items)
    if step is not None:
        body += field(b"\x12", b"\x08" + bytes([step]))
    return b"\x08\x01" + field(b"\x12", body)


def valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")  # (strict: no surrogates, overlong forms or code points past U+10FFFF)
    except UnicodeDecodeError:
        return False
    return True


EDGES = [
    b"",
    b"loss",
    "é".encode(),
    "€".encode(),
    "𝄞".encode(),
    b"\xf4\x8f\xbf\xbf",  # U+10FFFF
    b"\xf4\x90\x80\x80",
    b"\xed\xa0\x80",
    b"\xed\x9f\xbf",
    b"\xc0\xaf",
    b"\xc1\xbf",
    b"\xe0\x80\xaf",
    b"\xe0\xa0\x80",
    b"\xf0\x80\x80\xaf",
    b"\xf0\x90\x80\x80",
    b"\xf5\x80\x80\x80",
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xe2\x82",
    b"\xf0\x9d\x84",
    b"ab\xc3",
    b"\xc3\x28",
]


def test_a_string_is_proven_exactly_when_it_is_utf8_as_protobuf_reads_it():
    for raw in EDGES:
        for record in (history([(raw, b"1")]), history([(b"k", b'"' + raw + b'"')], key_field=1)):
            assert parses(record) == valid_utf8(raw), raw
            assert proven([record]) == [valid_utf8(raw)], raw


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=6), st.binary(max_size=6)), max_size=4))
def test_random_bytes_in_keys_and_values_are_proven_as_protobuf_parses(items):
    record = history(items)
    assert proven([record]) == [parses(record)]


@st.composite
def damaged(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A record (`test_records.any_record`) and whether it was damaged: a byte changed,
    dropped, or added, or the record cut short."""
    payload = draw(any_record())
    how = draw(st.sampled_from(["none", "change", "drop", "add", "cut"]))
    if how == "none" or not payload:
        return payload, False
    at = draw(st.integers(0, len(payload) - 1))
    if how == "change":
        payload = payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :]
    elif how == "drop":
        payload = payload[:at] + payload[at + 1 :]
    elif how == "add":
        payload = payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at:]
    else:
        payload = payload[:at]
    return payload, True


@settings(max_examples=500, deadline=None)
@given(st.lists(damaged(), min_size=20, max_size=60))
def test_a_proven_record_parses_whatever_was_done_to_it(cases):
    payloads = [payload for payload, _ in cases]
    found = proven(payloads)
    for payload, ok in zip(payloads, found, strict=True):
        if ok:
            assert parses(payload), payload
    # wandb's shape (history, `num` first, no field after it), left whole, is proven
    whole = [
        p
        for (p, hurt) in cases
        if not hurt
        and (r := pb.Record.FromString(p)).WhichOneof("record_type") == "history"
        and r.num
        and not r.uuid
        and p.startswith(b"\x08")
    ]
    if whole:
        assert all(proven(whole))


def test_damage_is_refused_often_enough_to_check_the_proof():
    # The property above would pass trivially if damage never made a record invalid, or if
    # the proof never proved one: count both over a fixed sample of damaged records.
    rng = np.random.default_rng(7)
    sample = [history([(b"_step", b"5"), (b"loss", b"0.5")]) for _ in range(400)]
    outcomes = {"proven": 0, "refused": 0}
    for payload in sample:
        at = int(rng.integers(0, len(payload)))
        hurt = payload[:at] + bytes([int(rng.integers(0, 256))]) + payload[at + 1 :]
        ok = proven([hurt])[0]
        outcomes["proven"] += ok
        outcomes["refused"] += not parses(hurt)
        if ok:
            assert parses(hurt)
    assert outcomes["proven"] > 50 and outcomes["refused"] > 100, outcomes


def steps_read(payloads: list[bytes]) -> list[int | None | str]:
    """The `_step` the proof reads of each record: an integer, None for none, or "unknown"
    where it leaves the record to the reference (`sentrows.item_step`)."""
    proof = records.proven_history(frames_of(payloads), np.arange(len(payloads)))
    return [
        (step if has else None) if known else "unknown"
        for known, has, step in zip(
            proof.step_known.tolist(), proof.has_step.tolist(), proof.steps.tolist(), strict=True
        )
    ]


def test_the_proof_reads_the_step_of_every_row_wandb_wrote_as_the_reference():
    checked = 0
    for path in LOGS:
        for read in records.read_indexed(path):
            payloads = list(map(read.frames.payload, read.history.tolist()))
            if payloads:
                assert steps_read(payloads) == list(map(item_step, payloads)), path
                checked += len(payloads)
    assert checked > 500


def test_the_proof_leaves_each_odd_step_that_is_no_plain_integer_to_the_reference():
    payloads = [history_record(items, field) for items, field, _, _ in ODD_ROWS]
    found = steps_read(payloads)
    # The rows whose last `_step` item is not a plain integer (see tests/support/steprows.py):
    # `40.0`, `true`, `_step.x`, `not json`, `"x"`, `+360`, `1e3`, 20 digits, two lists,
    # `-NaN`, `NaN`; then objects, lists and `-nan` after an integer; then typed values that
    # are no integer (a float, text, a bool, none, JSON text).
    unknown = [4, 9, 12, 14, 15, 16, 17, 18, 20, 21, 22, 23, *range(32, 41), *range(44, 50)]
    assert [i for i, step in enumerate(found) if step == "unknown"] == unknown
    for step, (_, _, item, _) in zip(found, ODD_ROWS, strict=True):
        assert step in ("unknown", item)


STEP_TEXTS = st.one_of(
    st.integers(-(2**64), 2**64).map(str),
    st.text(alphabet=" \t\n-+.0123456789eEIN", max_size=22),
    st.sampled_from(["true", "null", '"7"', "[7]", "{}", "NaN", "-Infinity", "7.0"]),
)
STEP_PATHS = st.sampled_from([["_step"], "_step", ["_step", "x"], ["x", "_step"], ["loss"]])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(STEP_PATHS, STEP_TEXTS), max_size=4))
def test_a_step_the_proof_reads_is_the_references(items):
    payload = history_record(items, None)
    (found,) = steps_read([payload])
    assert found in ("unknown", item_step(payload))


def test_the_proof_reads_most_random_steps_itself_and_leaves_some():
    # The property above would pass trivially if the proof never read a step: count both
    # outcomes over a fixed sample of single `_step` items.
    rng = np.random.default_rng(11)
    texts = [str(int(v)) for v in rng.integers(-(2**62), 2**62, 300)]
    texts += [f"{v}.5" for v in rng.integers(0, 1000, 100)]
    found = steps_read([history_record([(["_step"], t)], None) for t in texts])
    assert found[:300] == [int(t) for t in texts[:300]]
    assert found[300:] == ["unknown"] * 100


TYPED = st.one_of(
    st.fixed_dictionaries({"integer": st.integers(-(2**63), 2**63 - 1)}),
    st.fixed_dictionaries({"number": st.floats(allow_nan=False)}),
    st.fixed_dictionaries({"boolean": st.booleans()}),
    st.fixed_dictionaries({"none": st.just(0)}),
    st.fixed_dictionaries({"text": st.text(max_size=4)}),
    st.fixed_dictionaries({"json": st.sampled_from(["7", "7.0", "{}", "x", '"7"'])}),
)


@st.composite
def typed_records(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A history record whose items may carry typed values (as wandb writes them with
    `x_history_value_encoding="json,typed"`), and whether a byte of it was then changed."""
    items = draw(
        st.lists(
            st.tuples(STEP_PATHS, st.sampled_from(["", "5", "x"]), st.lists(TYPED, max_size=2)),
            min_size=1,
            max_size=4,
        )
    )
    # (of two typed values, the one set second replaces the first, as protobuf reads it)
    merged = [
        (path, text, {k: v for d in typed for k, v in d.items()}) for path, text, typed in items
    ]
    payload = history_record(merged, None, num=1)
    if not draw(st.booleans()):
        return payload, False
    at = draw(st.integers(0, len(payload) - 1))
    return payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :], True


@settings(max_examples=500, deadline=None)
@given(st.lists(typed_records(), min_size=10, max_size=30))
def test_typed_values_are_proven_and_their_steps_read_as_the_reference(cases):
    payloads = [payload for payload, _ in cases]
    found = steps_read(payloads)
    valid = proven(payloads)
    for (payload, hurt), ok, step in zip(cases, valid, found, strict=True):
        if not hurt:
            assert ok, payload  # wandb's typed records take the compiled path
        if ok:
            assert parses(payload), payload
            assert step in ("unknown", item_step(payload)), payload


def test_a_run_wandb_writes_with_typed_values_takes_the_compiled_path(tmp_path):
    from ..training.test_training import run_rank

    code = """
    import wbmerge
    run = wbmerge.init(project="p")
    for step in range(40):
        run.log({"loss": step / 3, "name": f"s{step}", "ok": step % 2 == 0})
    run.finish()
    """
    env = dict(RANK="0", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="typed")
    result = run_rank(tmp_path, code, WANDB_X_HISTORY_VALUE_ENCODING="json,typed", **env)
    assert result.returncode == 0, result.stderr
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    read = next(r for r in records.read_indexed(log) if len(r.history))
    payloads = list(map(read.frames.payload, read.history.tolist()))
    assert pb.Record.FromString(payloads[0]).history.item[0].WhichOneof("value") is not None
    assert steps_read(payloads) == list(range(40)) == list(map(item_step, payloads))
