"""Process settings for the passes that stream records (merge, export, report).

They allocate millions of short-lived objects and arrays and keep few of them:
- CPython's cyclic collector runs a pass every 700 allocations by default; in a shared
  merge those passes took about 30 % of the time and found nothing (none of what we make
  is in a reference cycle). Reference counting still frees everything at once.
- glibc's malloc gives arrays of more than its (adaptive) mmap threshold pages of their own
  and returns freed memory at the top of the heap to the kernel; every new array of a read
  then touches fresh pages, each a page fault. Keeping freed memory for the next read took
  a shared merge of 8 ranks x 20k steps from 123k page faults to 34k (0.25 s of system time
  less), without raising its peak memory.
Both are put back as they were (glibc's documented defaults) when the pass ends.

A process that runs for days (a follow) also keeps glibc to one malloc arena
(`one_malloc_arena`).
"""

from __future__ import annotations

import ctypes
import gc
import resource
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import WbmergeError

# mallopt parameters (malloc.h); what a pass sets (MALLOC_KEEP) and what it puts back after
# (MALLOC_DEFAULTS, glibc's documented defaults)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
MALLOC_KEEP = {_M_MMAP_THRESHOLD: 64 << 20, _M_TRIM_THRESHOLD: 512 << 20, _M_TOP_PAD: 16 << 20}
MALLOC_DEFAULTS = {
    _M_MMAP_THRESHOLD: 128 << 10,
    _M_TRIM_THRESHOLD: 128 << 10,
    _M_TOP_PAD: 128 << 10,
}


def _mallopt() -> ctypes._CFuncPtr | None:
    """glibc's `mallopt`, or None where the C library has none (macOS) or ignores it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


# glibc's `mallopt(parameter, value)` (1 on success), None where there is none: the one
# call through which a pass changes malloc's settings.
MALLOPT = _mallopt()


_depth = 0  # passes under way (a merge may report, say): the outermost one restores


@contextmanager
def streaming(threshold: int = 100_000) -> Iterator[None]:
    """Fewer collector passes, and freed memory kept for reuse, until the block ends."""
    global _depth
    old = gc.get_threshold()
    gc.set_threshold(threshold, old[1], old[2])
    if not _depth:
        _set_malloc(MALLOC_KEEP)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            _set_malloc(MALLOC_DEFAULTS)
        gc.set_threshold(*old)


def _set_malloc(settings: dict[int, int]) -> None:
    if MALLOPT is not None:
        for parameter, value in settings.items():
            MALLOPT(parameter, value)


def one_malloc_arena() -> bool:
    """Keep glibc's malloc to the one arena it starts with, from now on; False where there
    is no glibc to tell.

    glibc gives a thread that allocates while another holds the arena an arena of its own,
    up to 8 per core, and each arena keeps the memory its busiest moment needed. A follow
    starts new threads each round (uploads, reads), so its memory grew by about a round's
    peak with each new arena: a shared follow of 8 ranks x 20 metrics adding 10,000 steps a
    round went from 277 to 423 MB in 5 rounds, while the objects it kept stayed the same.
    With one arena it stayed at 254-266 MB. The threads mostly wait (on the uploader, the
    server, the GIL), so they hardly contend for the one arena.
    """
    return MALLOPT is not None and MALLOPT(_M_ARENA_MAX, 1) == 1


def allow_open_files(needed: int) -> None:
    """Let this process hold `needed` more files open than it does now (plus a margin).

    A shared merge keeps every rank's log open: 1,024 files at 1,024 ranks, plus its own,
    past the usual soft limit of 1,024. The soft limit is raised
    up to the hard limit, which any process may do; past the hard limit it says so in one
    line instead of failing with "Too many open files" midway.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256  # the files already open, the uploader's pipes, and a margin
    if want <= soft or soft == resource.RLIM_INFINITY:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise WbmergeError(
            f"this merge keeps {needed} files open, more than this shell allows ({hard}); "
            f"raise the hard limit to {want} (`ulimit -Hn`, or the limits of the job's container)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
