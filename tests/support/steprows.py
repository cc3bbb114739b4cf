"""History rows whose `_step` items are odd, in one sequence, with the `_step` each row's items
give (`sentrows.item_step`) and the `_step` wandb-core 0.31 sends it at after the rows above
it, from a run that starts at 0. The expectations are wandb-core's, measured with `wandb sync`
into the sink (`test_odd_input` checks them against it again), read top-down like the worked
example in `wbmerge/wandbcore/sentrows.py`: a row is sent at its item when that is an integer at least
one above the row before, else one above the row before.
"""

from __future__ import annotations

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

# (items, step field or None, item step, sent at). An item is (nested key, or a plain key,
# JSON text), and may end with its typed value as {field: value} (`ranklogs.history_record`).
ODD_ROWS = [
    ([(["loss"], "0.5"), (["_step"], "0")], 0, 0, 0),  # as wandb writes a row
    ([(["_step"], "1")], 1, 1, 1),
    ([(["_step"], "50")], 3, 50, 50),  # the step field is not read
    ([(["loss"], "1")], 80, None, 51),  # no `_step` item: one above the row before
    ([(["_step"], "40.0")], 90, None, 52),  # a float is no step
    ([(["_step"], "100"), (["_step"], "95")], None, 95, 95),  # the last `_step` item decides
    ([(["_step"], "5")], None, 5, 96),  # behind the row before
    ([(["_step"], " 300\n")], None, 300, 300),  # blanks around it
    ([(["_step"], "0301")], None, 301, 301),  # leading zeros: wandb-core's parser takes them
    ([(["_step"], "true")], None, None, 302),
    ([("_step", "310")], None, 310, 310),  # a plain key, as wandb 0.16 writes it
    ([(["a", "_step"], "400")], None, None, 311),  # `a._step` is not `_step`
    ([(["_step"], "320"), (["_step", "x"], "1")], None, None, 312),  # a path below `_step`
    ([(["_step", "x"], "1"), (["_step"], "330")], None, 330, 330),
    ([(["_step"], "340"), (["_step"], "not json")], None, 340, 340),  # an unparsed item: dropped
    ([(["_step"], "350"), (["_step"], '"x"')], None, None, 341),  # a string: parsed, no step
    ([(["_step"], "+360")], None, None, 342),
    ([(["_step"], "1e3")], None, None, 343),
    ([(["_step"], "00000000000000000400")], None, None, 344),  # longer than int64's text
    ([(["_step"], "0000000000000000400")], None, 400, 400),
    ([(["_step"], "410"), (["_step"], "[" * 600 + "]" * 600)], None, 410, 410),  # too deep
    ([(["_step"], "420"), (["_step"], "[" * 400 + "]" * 400)], None, None, 411),
    ([(["_step"], "430"), (["_step"], "-NaN")], None, 430, 430),  # Go's parser refuses it
    ([(["_step"], "NaN")], None, None, 431),
    ([(["x"], "1")] * 300 + [(["_step"], "1234567")], None, 1234567, 1234567),  # long lengths
    ([(["_step"], str(INT64_MAX))], None, INT64_MAX, INT64_MAX),
    ([(["loss"], "2")], None, None, INT64_MIN),  # one above int64's largest wraps around
    ([(["_step"], "-5")], None, -5, -5),
    ([(["_step"], str(INT64_MIN))], None, INT64_MIN, -4),
    ([], 7, None, -3),  # a row without items is a row too
    ([("ab\x05_step", "4")], None, None, -2),  # a key whose bytes end like `_step`
    ([(["_step"], "-0")], None, 0, 0),
    ([(["_step"], "10"), (["_step"], "{}")], None, 10, 10),  # an empty object puts nothing
    ([(["_step"], "20"), (["_step", "x"], "{}")], None, 20, 20),
    ([(["_step"], "30"), (["_step"], '{"a": {}}')], None, 30, 30),
    ([(["_step"], "40"), (["_step"], '{"a": 5}')], None, None, 31),  # `_step.a`: an object
    ([(["_step"], "50"), (["_step"], "[" * 501 + "1" + "]" * 501)], None, 50, 50),  # too deep
    ([(["_step"], "60"), (["_step"], "[" * 500 + "1" + "]" * 500)], None, None, 51),
    ([(["_step"], "70"), (["_step"], "[01]")], None, None, 52),  # a list to wandb-core
    ([(["_step"], "80"), (["_step"], "-nan")], None, 80, 80),
    ([(["_step"], "90"), (["_step"], "[Inf]")], None, None, 81),
    ([(["a"], "1"), (["a", "b"], "2"), (["_step"], "95")], None, 95, 95),  # `a` made an object
    # wandb writes a typed value beside the JSON text when told to; wandb-core reads it first
    ([(["_step"], "", {"integer": 200})], None, 200, 200),
    ([(["_step"], "600", {"integer": 300})], None, 300, 300),
    ([(["_step"], "700", {"number": 800.0})], None, None, 301),
    ([(["_step"], "700", {"text": "900"})], None, None, 302),
    ([(["_step"], "700", {"boolean": True})], None, None, 303),
    ([(["_step"], "700", {"none": 0})], None, None, 304),
    ([(["_step"], "700", {"json": "1000"})], None, 1000, 1000),
    ([(["_step"], "1100"), (["_step"], "", {"json": "{}"})], None, 1100, 1100),
    ([("", "1"), (["loss"], "2"), (["_step"], "1200")], None, 1200, 1200),  # no key: dropped
    ([(["s"], '"\\ud800\\u0041"'), (["_step"], "1300")], None, 1300, 1300),  # half a pair
    ([(["o"], '{"\\ud800": 1, "\\udc00": 2}'), (["_step"], "1400")], None, 1400, 1400),
]
