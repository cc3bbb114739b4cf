"""What merging one target found besides the records it wrote, and the warnings it gives
about the sources: damage, a crash without an exit record, a record that is not protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log import ReadReport, pb, skip_field, varint
from ..plan import Source
from ..wandbcore import StagedContent

_RECORD_FIELDS = frozenset(pb.Record.DESCRIPTOR.fields_by_number)


@dataclass
class Outcome:
    """What a target's merge returns to `stage`, which makes it part of `Staged`."""

    exit_code: int = 0
    history_rows: int = 0  # shared targets: merged rows written
    source_rows: int = 0  # shared targets: source rows read
    warnings: list[str] = field(default_factory=list)
    metrics: int = 0  # shared targets: distinct metric keys written (history and summary)
    bound_notice: str | None = None  # shared targets: more metrics than W&B recommends
    # what the staged log will put on the server, when the merge counted it on the way
    content: StagedContent | None = None


def damage_warnings(source: Source, report: ReadReport, complete: bool, primary: int) -> list[str]:
    """What to say about a source read with `report`; `complete`: it ended with an exit
    record (or a later restart follows it)."""
    where = f"rank {source.rank.rank} ({source.label}, restart {source.restart})"
    found = []
    if report.dropped_bytes:
        found.append(f"{where}: {report.describe()}; the readable records are kept")
    if not complete:
        role = "the primary" if source.rank.rank == primary else "a non-primary rank"
        found.append(
            f"{where} is {role} and ended without an exit record (killed?); "
            "its data up to the crash is kept"
        )
    return found


def is_record(payload: bytes) -> bool:
    """Whether `payload` is a valid Record. Records copied into the merged log without being
    parsed pass here, so that one with a valid checksum but invalid protobuf is dropped as
    damage (`not_a_record`), not handed to the uploader."""
    try:
        pb.Record.FromString(payload)
    except DecodeError:
        return False
    return True


def not_a_record(source: Source) -> str:
    """The warning for a record of `source` that `is_record` refused."""
    return f"{source.label}: a record with a valid checksum is not valid protobuf; left out"


def unknown_field(payload: bytes) -> int | None:
    """The number of the first top-level field of the Record `payload` that this wandb's
    Record does not have (a record kind of a newer wandb), or None. `payload` is a valid
    Record (`is_record`), so its tags can be walked."""
    pos, end = 0, len(payload)
    while pos < end:
        tag, pos = varint(payload, pos)
        if tag >> 3 not in _RECORD_FIELDS:
            return tag >> 3
        pos = skip_field(payload, pos, tag & 7)
    return None


def check_known(payload: bytes, source: Source, copy_unknown: bool) -> None:
    """Refuse (WbmergeError, one line) the record `payload` of `source` if it is of a kind
    this wbmerge does not know, unless `copy_unknown` (`--unknown-records copy`): the
    merge could only drop it, or copy it as it is to an uploader that may not know it
    either, and neither should happen silently."""
    field_number = unknown_field(payload)
    if field_number is not None and not copy_unknown:
        raise WbmergeError(
            f"{source.label}: {source.path} holds a record of a kind this wbmerge does not "
            f"know (Record field {field_number}; written by a newer wandb?); upgrade wbmerge, "
            "or pass --unknown-records copy to hand it to wandb's uploader as it is"
        )
