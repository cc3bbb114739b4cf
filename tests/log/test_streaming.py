"""The process settings of a streaming pass (`runtime.streaming`) hold during it and are put back."""

import gc
import os
import platform

import pytest

from wbmerge import runtime as module
from wbmerge.runtime import streaming


@pytest.fixture
def mallopt_calls(monkeypatch):
    calls = []
    real = module.MALLOPT
    monkeypatch.setattr(module, "MALLOPT", lambda p, v: calls.append((p, v)) or real(p, v))
    return calls


def test_settings_hold_during_the_pass_and_are_put_back(mallopt_calls):
    before = gc.get_threshold()
    with streaming():
        assert gc.get_threshold()[0] == 100_000
        assert sorted(mallopt_calls) == sorted(module.MALLOC_KEEP.items())
    assert gc.get_threshold() == before
    assert sorted(mallopt_calls[3:]) == sorted(module.MALLOC_DEFAULTS.items())


def test_a_pass_within_a_pass_leaves_the_outer_settings_alone(mallopt_calls):
    with streaming():
        with streaming():
            pass
        assert gc.get_threshold()[0] == 100_000
        assert len(mallopt_calls) == 3  # only the outermost pass sets and restores
    assert len(mallopt_calls) == 6


def test_settings_are_put_back_when_the_pass_fails(mallopt_calls):
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), streaming():
        raise RuntimeError("the merge failed")
    assert gc.get_threshold() == before
    assert sorted(mallopt_calls[3:]) == sorted(module.MALLOC_DEFAULTS.items())
    with streaming():  # the failed pass is over: the next one is the outermost again
        assert sorted(mallopt_calls[6:]) == sorted(module.MALLOC_KEEP.items())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_settings():
    for parameter, value in module.MALLOC_KEEP.items():
        assert module.MALLOPT(parameter, value) == 1  # mallopt returns 1 on success
    for parameter, value in module.MALLOC_DEFAULTS.items():
        assert module.MALLOPT(parameter, value) == 1


# Threads that allocate at once (blocks past pymalloc's 512 bytes come from glibc), then
# glibc's own account of its arenas (`malloc_info`: a <heap nr=...> element per arena).
THREADS_THEN_ARENAS = """
import ctypes, sys, threading
from wbmerge.runtime import one_malloc_arena
if sys.argv[1] == "one":
    assert one_malloc_arena()
started = threading.Barrier(4)
def allocate():
    blocks = [bytearray(4096) for _ in range(200)]
    started.wait()
    blocks += [bytearray(4096) for _ in range(200)]
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
out = ctypes.c_void_p(libc.fdopen(1, b"w"))
libc.malloc_info(0, out)
libc.fflush(out)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
@pytest.mark.parametrize("arenas, most", [("default", None), ("one", 1)])
def test_a_follower_keeps_malloc_to_one_arena_however_many_threads_allocate(arenas, most):
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", THREADS_THEN_ARENAS, arenas],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    heaps = len(re.findall(r'<heap nr="\d+">', out))
    if most is None:
        assert heaps > 1  # (each thread took an arena of its own)
    else:
        assert heaps == most
