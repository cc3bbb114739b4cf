"""The bytes of a `.wandb` file: framing, records, items, steps (the first stage's input).

`txlog` frames a transaction log (7-byte header, 32 KiB blocks of CRC-checked chunks) and
never looks inside a record; its block walk is compiled (`_walk.c`) with a Python twin
(`purewalk`). `proto` loads wandb's `Record` classes, `records` says what each payload is,
`wire` and `items` read history and summary items as bytes and as columns, and `steps` is
the step rule that merge, export and report share. Nothing here knows ranks, jobs or
servers: every later stage reads logs through this package.
"""

from importlib import import_module

from . import digest
from .kinds import KINDS, PassThrough, Shared, passthrough_rewrites, shared_kept
from .proto import item_path, pb
from .records import read_records, record_kind
from .steps import RESERVED, Steps, place_reads, restep
from .twins import twins
from .txlog import (
    BLOCK_SIZE,
    CHUNK_HEADER_SIZE,
    FILE_HEADER,
    FIRST,
    FULL,
    LAST,
    MIDDLE,
    Frames,
    LogWriter,
    ReadReport,
    Walked,
    read_frames,
    read_head,
    read_payloads,
    read_tail,
    walk_segments,
    write_payloads,
)
from .wire import skip_field, varint


def __getattr__(name: str) -> object:
    """`items`, imported when first asked for: it needs pyarrow (85 ms of a start), which a
    pass-through sync and the command line's start do without."""
    if name == "items":
        return import_module(".items", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KINDS",
    "PassThrough",
    "Shared",
    "passthrough_rewrites",
    "shared_kept",
    "BLOCK_SIZE",
    "CHUNK_HEADER_SIZE",
    "FILE_HEADER",
    "FIRST",
    "FULL",
    "Frames",
    "LAST",
    "LogWriter",
    "MIDDLE",
    "RESERVED",
    "ReadReport",
    "Steps",
    "Walked",
    "digest",
    "item_path",
    "items",
    "pb",
    "place_reads",
    "read_frames",
    "read_head",
    "read_payloads",
    "read_records",
    "read_tail",
    "record_kind",
    "records",
    "restep",
    "skip_field",
    "twins",
    "txlog",
    "varint",
    "walk_segments",
    "wire",
    "write_payloads",
]
