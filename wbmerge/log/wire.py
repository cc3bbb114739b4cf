"""Just enough of the protocol-buffer wire format to move history and summary items as bytes.

A shared merge touches every value of every rank. Parsing each record into a message and
building a new one costs microseconds a value in Python; relabelling needs only the key
fields of an item, so items are split into their key part and their value part, the key
part is rewritten once per distinct key (cached), and the value bytes travel untouched.

An item (`HistoryItem`, `SummaryItem`) is `key` (1) and/or `nested_key` (2) fields followed
by its value fields (`value_json`, 16). wandb writes fields in number order; an item in
another order is put in that order first (by protobuf itself), so the split is always exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .proto import pb

RECORD_HISTORY = 2
RECORD_SUMMARY = 3
_KEY_TAG = 0x0A  # field 1, length-delimited
_NESTED_TAG = 0x12  # field 2, length-delimited
_ITEM_TAG = b"\x0a"  # HistoryRecord.item = 1, SummaryRecord.update = 1
_STEP_TAG = b"\x12"  # HistoryRecord.step = 2
_VALUE_TAG = b"\x82\x01"  # value_json = 16
_SMALL = [bytes([n]) for n in range(128)]
_STEP_HEADS = [(size, bytes((0x12, size + 1, 0x08))) for size in range(1, 11)]


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode the varint at `pos`; returns (value, position after it)."""
    byte = data[pos]
    if byte < 0x80:
        return byte, pos + 1
    result = byte & 0x7F
    shift = 7
    pos += 1
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def skip_field(data: bytes, pos: int, wire: int) -> int:
    """The position after a field's value of wire type `wire` starting at `pos`."""
    if wire == 0:
        return varint(data, pos)[1]
    if wire == 2:
        length, pos = varint(data, pos)
        return pos + length
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire}")


def submessage(payload: bytes, field: int) -> tuple[int, int] | None:
    """The (start, end) span of top-level length-delimited `field` of a message, if any."""
    pos, end = 0, len(payload)
    if end > 3 and payload[0] == 0x08:  # wandb writes `num` first
        pos = 1
        while pos < end - 2 and payload[pos] & 0x80:
            pos += 1
        if payload[pos + 1] == (field << 3 | 2):
            return _span(payload, pos + 2)
        pos = 0
    while pos < end:
        tag, pos = varint(payload, pos)
        if tag >> 3 == field and tag & 7 == 2:
            length, pos = varint(payload, pos)
            return pos, pos + length
        pos = skip_field(payload, pos, tag & 7)
    return None


def _span(payload: bytes, pos: int) -> tuple[int, int]:
    length = payload[pos]
    if length < 0x80:
        return pos + 1, pos + 1 + length
    length, pos = varint(payload, pos)
    return pos, pos + length


def history_region(payload: bytes) -> tuple[int, bytes]:
    """(step, item fields) of a history record. wandb writes the items, then the step field
    last: that is looked for at the end; a record in any other shape is parsed by protobuf.
    A record without a step field (wandb 0.16 and older) has its step in its `_step` item."""
    span = _history_span(payload) or submessage(payload, RECORD_HISTORY)
    if span is None:
        raise ValueError("not a history record")
    start, end = span
    if end - start >= 2 and payload[end - 2 : end] == b"\x12\x00":
        if _items_end_at(payload, start, end - 2):
            return 0, payload[start : end - 2]
    for size, head in _STEP_HEADS:  # step { num: a varint of `size` bytes }
        field = end - size - 3
        if field >= start and payload[field : field + 3] == head:
            step, after = varint(payload, field + 3)
            if after == end and _items_end_at(payload, start, field):
                return step, payload[start:field]
    history = pb.Record.FromString(payload).history
    region = pb.HistoryRecord(item=history.item).SerializeToString()
    if history.HasField("step"):
        return history.step.num, region
    return _step_item(history.item), region


def _items_end_at(payload: bytes, pos: int, end: int) -> bool:
    """Whether `payload[pos:end]` is item fields only, the last ending exactly at `end`: what
    makes the bytes after them a field of the record, not the inside of an item."""
    try:
        while pos < end:
            if payload[pos] != _KEY_TAG:  # (HistoryRecord.item: field 1, as a key field)
                return False
            length, pos = varint(payload, pos + 1)
            pos += length
    except IndexError:
        return False
    return pos == end


def _step_item(history_items: Iterable[pb.HistoryItem]) -> int:
    """The step of a history record without a `step` field, as wandb before wandb-core
    (0.16) writes them: its `_step` item (the last one, as a JSON integer), else 0. A
    `_step` that is not a whole number from 0 to 2**63 - 1 counts as absent."""
    step = 0
    for item in history_items:
        if (list(item.nested_key) or [item.key]) == ["_step"]:
            try:
                number = json.loads(item.value_json)
            except (ValueError, RecursionError):  # (nested past json's limit)
                continue
            if type(number) is int and 0 <= number < 1 << 63:
                step = number
    return step


def _history_span(payload: bytes) -> tuple[int, int] | None:
    """The history span of a record as wandb writes it (`num`, then `history` last), or None."""
    if payload[0] != 0x08:
        return None
    pos = 1
    while payload[pos] & 0x80:
        pos += 1
    if payload[pos + 1] != 0x12:
        return None
    start, end = _span(payload, pos + 2)
    return (start, end) if end == len(payload) else None


def region_items(region: bytes) -> list[bytes]:
    """The raw items of a region of item fields (field 1; `history_region`'s result)."""
    found = []
    pos, end = 0, len(region)
    while pos < end:
        tag, pos = varint(region, pos)
        if tag == _KEY_TAG:
            length, pos = varint(region, pos)
            found.append(region[pos : pos + length])
            pos += length
        else:
            pos = skip_field(region, pos, tag & 7)
    return found


def summary_items(payload: bytes) -> tuple[list[bytes], list[bytes]]:
    """(updated items, removed items) of a serialized Record holding a summary record."""
    span = submessage(payload, RECORD_SUMMARY)
    if span is None:
        raise ValueError("not a summary record")
    pos, end = span
    updates: list[bytes] = []
    removes: list[bytes] = []
    while pos < end:
        tag, start = varint(payload, pos)
        if tag in (_KEY_TAG, _NESTED_TAG):
            length, start = varint(payload, start)
            pos = start + length
            (updates if tag == _KEY_TAG else removes).append(payload[start:pos])
        else:
            pos = skip_field(payload, start, tag & 7)
    return updates, removes


def split_item(item: bytes) -> tuple[bytes, bytes]:
    """(key part, value part) of an item: its key fields and everything after them."""
    pos = 0
    end = len(item)
    while pos < end:
        tag = item[pos]
        if tag != _KEY_TAG and tag != _NESTED_TAG:
            break
        length = item[pos + 1]
        if length < 0x80:
            pos += 2 + length
        else:
            length, pos = varint(item, pos + 1)
            pos += length
    rest = item[pos:]
    if not _in_order(rest):
        return split_item(pb.HistoryItem.FromString(item).SerializeToString())
    return item[:pos], rest


def _in_order(rest: bytes) -> bool:
    """True when no key field hides among the value fields (wandb never writes that)."""
    pos, end = 0, len(rest)
    while pos < end:
        tag, pos = varint(rest, pos)
        if tag == _KEY_TAG or tag == _NESTED_TAG:
            return False
        pos = skip_field(rest, pos, tag & 7)
    return True


def key_path(key_part: bytes) -> list[str]:
    """The key path of an item's key part: `nested_key` if any, else `[key]`.

    Raises ValueError unless `key_part` is exactly key fields: this is what proves a key
    part found by the batch path (`items`) to be one.
    """
    key = ""
    nested = []
    pos, end = 0, len(key_part)
    while pos < end:
        tag = key_part[pos]
        if tag != _KEY_TAG and tag != _NESTED_TAG:
            raise ValueError("not a key field")
        length, start = varint(key_part, pos + 1)
        pos = start + length
        if pos > end:
            raise ValueError("key field runs past its item")
        text = key_part[start:pos].decode()
        if tag == _KEY_TAG:
            key = text
        else:
            nested.append(text)
    if not nested and pos == 0:
        raise ValueError("an item without a key")
    return nested or [key]


def key_part(path: list[str] | tuple[str, ...]) -> bytes:
    """The key part of an item with key path `path`, written as `nested_key` fields."""
    return b"".join(string_field(_NESTED_TAG, name) for name in path)


def string_field(tag: int, text: str) -> bytes:
    data = text.encode()
    return bytes([tag]) + encode_varint(len(data)) + data


def value_part(value_json: str) -> bytes:
    data = value_json.encode()
    return _VALUE_TAG + encode_varint(len(data)) + data


def value_json(value: bytes) -> bytes:
    """The JSON text of a value part written by wandb (`value_json` only)."""
    if not value.startswith(_VALUE_TAG):
        return b""
    length, pos = varint(value, 2)
    return value[pos : pos + length]


def item_field(key: bytes, value: bytes) -> bytes:
    """One item as field 1 of its record: tag, length, key part, value part."""
    return _ITEM_TAG + encode_varint(len(key) + len(value)) + key + value


def history_record(items: list[bytes], step: int) -> bytes:
    """A serialized Record holding a history record of the item fields `items` (pieces of
    concatenated fields), joined once with the record's head and step."""
    return b"".join(history_pieces(items, step)[0])


def history_pieces(items: list[bytes], step: int) -> tuple[list[bytes], int]:
    """`history_record` as pieces to join, and their total length: for a caller that joins
    many records at once."""
    step_field = _STEP_TAG + (b"\x00" if step == 0 else _with_length(b"\x08" + encode_varint(step)))
    size = sum(map(len, items)) + len(step_field)
    head = b"\x12" + encode_varint(size)
    return [head, *items, step_field], len(head) + size


def summary_record(items: bytes) -> bytes:
    """A serialized Record holding a summary record of the concatenated update fields."""
    return b"\x1a" + encode_varint(len(items)) + items


def _with_length(data: bytes) -> bytes:
    return encode_varint(len(data)) + data
