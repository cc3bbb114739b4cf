"""The end-to-end tests upload to a sink that behaves like W&B (`sink serve --like-wandb`:
a write cursor, counts 1 s late, sampled history, W&B's rate limits), so that what they
prove holds for a server like W&B's, not only for an exact one. Tests elsewhere that need
the exact server (counts at once, every request taken) keep the ideal `sink`.
`WBMERGE_TEST_SINK=ideal` runs these on the ideal sink too, to tell the two apart."""

from __future__ import annotations

import pytest


@pytest.fixture
def sink(tmp_path_factory, request):
    """A real sink like W&B on a free loopback port, with a fresh data dir."""
    from ..conftest import chosen_like
    from ..support.sinktools import SinkProcess, like_wandb_by_default

    like = chosen_like(request, like_wandb_by_default())
    process = SinkProcess(tmp_path_factory.mktemp("sink") / "data", like=like)
    process.data_dir.mkdir()
    process.start()
    yield process
    process.stop()
