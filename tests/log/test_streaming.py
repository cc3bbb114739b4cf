"""The process settings of a streaming pass (`streaming`) hold during it and are put back."""

import gc
import platform

import pytest

from wbmerge import streaming as module
from wbmerge.streaming import streaming


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
