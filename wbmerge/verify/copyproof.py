"""Whether a staged log is its one source log copied, proved by bytes rather than by values.

A pass-through (`new`, `auto`) copies a clean log's blocks as they are after its head, the
blocks up to the end of its run record, which it writes again with the run record
rewritten (`merge.passthrough.write_spliced`). Reading both logs again value by value to
count what they hold costs about as much as the upload. Here the check finds, on its own,
where the two logs' bytes are the same to their ends, compares those bytes, and reads only
the heads before them: each record equal byte for byte, but for run records whose config
says the same to the source check (what `sourcecheck` folds of it: its config updates but
the uncounted keys, its removals, and its `_wandb` entries keyed by a history key).

Why that proves what the value-by-value check would find: both sides of that check are
folds over a log's records, in order, by the same reader; a chunk never crosses a block
boundary, so from a block boundary on the reader makes the same records of the same bytes,
given the record the head leaves open (compared too). Two logs whose records are the same
but for run records with the same effect on the fold fold to the same holdings, and a
pass-through of one primary rank expects what its source's records fold to. Nothing of
the merge is trusted: where the bytes are the same is found by comparing them, from the
ends of both files, and a log that is not such a copy is simply not proved (the caller
then counts value by value).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..log import BLOCK_SIZE, read_head, record_kind

# Blocks compared at a time, from the ends of the two logs toward their starts.
_WINDOW_BLOCKS = 32
# The longest head read into memory (its records compared one by one); a log whose bytes
# differ further in is not proved here.
HEAD_LIMIT = 256 * BLOCK_SIZE


def copied_alike(
    source: Path,
    staged: Path,
    same_run: Callable[[bytes, bytes], bool],
    head_limit: int = HEAD_LIMIT,
) -> bool:
    """Whether `staged` holds `source`'s records, in their order, each byte for byte but
    for run records that `same_run` (the source's, the staged one) says change the same.
    False when that is not proved: the logs differ, either is damaged in its head, or they
    differ beyond `head_limit` bytes from their starts."""
    with open(source, "rb") as source_stream, open(staged, "rb") as staged_stream:
        source_size = os.fstat(source_stream.fileno()).st_size
        staged_size = os.fstat(staged_stream.fileno()).st_size
        shift = staged_size - source_size
        if shift % BLOCK_SIZE:  # the copied blocks end the staged log at their own offsets
            return False
        shift_blocks = shift // BLOCK_SIZE
        common = _first_common_block(source_stream, staged_stream, source_size, shift_blocks)
        source_head, staged_head = common, common + shift_blocks
        if max(source_head, staged_head) * BLOCK_SIZE > head_limit:
            return False
        source_records = read_head(source_stream, source_head)
        staged_records = read_head(staged_stream, staged_head)
    if source_records is None or staged_records is None:
        return False  # (damaged or short: the reader may not make the same records)
    (source_payloads, source_open), (staged_payloads, staged_open) = source_records, staged_records
    if source_open != staged_open or len(source_payloads) != len(staged_payloads):
        return False
    for logged, written in zip(source_payloads, staged_payloads, strict=True):
        if logged != written and not (
            record_kind(logged) == record_kind(written) == "run" and same_run(logged, written)
        ):
            return False
    return True


def _first_common_block(
    source: BinaryIO, staged: BinaryIO, source_size: int, shift_blocks: int
) -> int:
    """The first block of `source` from which its bytes are the staged log's from `shift_blocks`
    blocks later, to the end of both; never block 0 (the file header is read as the head)."""
    source_blocks = -(-source_size // BLOCK_SIZE)
    lowest = max(1, 1 - shift_blocks)  # (both logs' block 0 is head)
    first = source_blocks
    while first > lowest:
        low = max(lowest, first - _WINDOW_BLOCKS)
        source.seek(low * BLOCK_SIZE)
        staged.seek((low + shift_blocks) * BLOCK_SIZE)
        size = min(first * BLOCK_SIZE, source_size) - low * BLOCK_SIZE
        ours, theirs = source.read(size), staged.read(size)
        if ours == theirs and len(ours) == size:
            first = low
            continue
        # the last block of the window that differs: the common part begins after it
        for block in range(first - 1, low - 1, -1):
            at = (block - low) * BLOCK_SIZE
            if ours[at : at + BLOCK_SIZE] != theirs[at : at + BLOCK_SIZE]:
                return block + 1
        return low  # (unreachable: the window differs somewhere)
    return first
