"""The console spool of a shared merge: every source reads back exactly what it was given,
in order, however the sources' writes interleave in the one file they share."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.merge import Spools

# (source number, payload) in the order pass 1 writes them
writes = st.lists(st.tuples(st.integers(0, 4), st.binary(max_size=40)), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(writes, st.integers(1, 64))
def test_each_source_reads_back_its_payloads_in_order(tmp_path_factory, written, segment):
    scratch = tmp_path_factory.mktemp("spool")
    sources = [SimpleNamespace(path=Path(f"/runs/{n}.wandb")) for n in range(5)]
    with Spools(scratch, segment=segment) as spools:
        writers = {}
        for number, payload in written:
            if number not in writers:
                writers[number] = spools.writer(sources[number])
            writers[number].write(payload)
        for number, source in enumerate(sources):
            if number in writers:
                want = [payload for n, payload in written if n == number]
                assert list(spools.read(source)) == want


def test_a_payload_larger_than_a_segment_comes_back_whole(tmp_path):
    source = SimpleNamespace(path=Path("/runs/0.wandb"))
    big = bytes(range(256)) * 100
    with Spools(tmp_path, segment=1024) as spools:
        writer = spools.writer(source)
        writer.write(b"a")
        writer.write(big)
        writer.write(b"")
        writer.write(b"z")
        assert list(spools.read(source)) == [b"a", big, b"", b"z"]
