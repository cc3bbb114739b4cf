"""What merging one target found besides the records it wrote, and the warnings it gives
about the sources: damage, a crash without an exit record, a record that is not protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from ..log.proto import pb
from ..log.txlog import ReadReport
from ..plan import Source
from ..wandbcore.content import StagedContent


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
