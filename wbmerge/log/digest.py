"""64-bit hashes of many byte spans at once, for order-independent digests (sums of them).

The source check tallies every history value of a run as a count and a sum of hashes; a
hash a value at a time in Python costs more than reading the value. Here a read's spans
are hashed in one compiled call (`_records.c`): XXH64 with a seed, so the xxHash
library's own `xxh64_intdigest`, a span at a time, is the Python twin with the same
numbers (used where the compiled module is not built or not wanted).

XXH64 is fast, not secret: with a known seed, values whose hash sums collide can be
searched for (under a minute of CPU for two pairs of numbers). A caller whose digests must
not be fooled takes a fresh random seed (`random_seed`) for each comparison, as Python's
own `hash` takes one for each process.
"""

from __future__ import annotations

import secrets

import numpy as np
import xxhash

from .twins import twins


def _python_hashes(data: bytes, starts: np.ndarray, ends: np.ndarray, seed: int) -> bytes:
    view = memoryview(data)
    hashed = [
        xxhash.xxh64_intdigest(view[start:end], seed)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    return np.array(hashed, np.uint64).tobytes()


# The ways `span_hashes` can hash, by name: "python" always, "compiled" when built.
HASHERS, DEFAULT_HASHER = twins(_python_hashes, "_records", "hashes")


def random_seed() -> int:
    """A seed no input can have been chosen against."""
    return secrets.randbits(64)


def span_hashes(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    seed: int = 0,
    hasher: str = DEFAULT_HASHER,
) -> np.ndarray:
    """The XXH64 with `seed` of each `data[starts[i]:ends[i]]`, as uint64; ValueError for
    a span outside `data` or a seed that is not 64 bits."""
    _check_seed(seed)
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    if len(starts) != len(ends):
        raise ValueError("starts and ends must be of one size")
    if len(starts) and ((starts < 0) | (starts > ends) | (ends > len(data))).any():
        raise ValueError("a span outside the data")
    return np.frombuffer(HASHERS[hasher](data, starts, ends, seed), np.uint64)


def hash_of(value: bytes, seed: int = 0) -> int:
    """The hash `span_hashes` with `seed` gives the one span `value`."""
    _check_seed(seed)
    return xxhash.xxh64_intdigest(value, seed)


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 1 << 64:
        raise ValueError("a seed must be 64 bits")


def sums_by_code(codes: np.ndarray, hashes: np.ndarray, size: int) -> np.ndarray:
    """The sum (mod 2**64) of the `hashes` of each code `0..size-1`, as uint64: in two
    exact float halves (`bincount` adds floats; a half of 32 bits summed over fewer than
    2**21 items stays below 2**53), which is several times faster than `np.add.at`."""
    sums = np.zeros(size, np.uint64)
    step = 1 << 20
    for at in range(0, len(codes), step):
        part, hashed = codes[at : at + step], hashes[at : at + step]
        low = np.bincount(part, (hashed & 0xFFFFFFFF).astype(np.float64), size)
        high = np.bincount(part, (hashed >> np.uint64(32)).astype(np.float64), size)
        sums += low.astype(np.uint64) + (high.astype(np.uint64) << np.uint64(32))
    return sums
