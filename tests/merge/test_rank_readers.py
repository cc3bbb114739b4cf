"""The shared merge's reader of many logs side by side gives each log's records exactly as
the transaction-log reader does, and the same damage report, whatever the read size and
whichever ranks are read in a turn: on the real fixtures, synthetic logs, restarts, and
copies cut short or with a byte changed (which it hands to the transaction-log reader)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from wbmerge.log import BLOCK_SIZE, CHUNK_HEADER_SIZE, ReadReport, read_payloads
from wbmerge.merge import RankReaders
from wbmerge.training import RankInfo

from ..conftest import fixture_logs
from ..support import synthetic


def expected(path: Path) -> tuple[list[bytes] | str, ReadReport]:
    report = ReadReport()
    try:
        return list(read_payloads(path, report)), report
    except Exception as exc:  # (a copy cut inside the file header)
        return type(exc).__name__, report


def damaged_copies(logs: list[Path], root: Path, rnd: random.Random) -> list[Path]:
    copies = []
    for i, path in enumerate(logs):
        data = path.read_bytes()
        for j in range(4):
            changed = bytearray(data[: rnd.randrange(len(data))] if j % 2 == 0 else data)
            if j % 2:
                changed[rnd.randrange(len(changed))] ^= 0x40
            copy = root / f"copy{i}-{j}.wandb"
            copy.write_bytes(bytes(changed))
            copies.append(copy)
    return copies


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("logs")
    written = [
        synthetic.write_rank(root, RankInfo(rank, rank, 3, 3, 0, job_id="readers"), steps, metrics)
        for rank, (steps, metrics) in enumerate([(50, 3), (400, 20), (1300, 60)])
    ]
    real = fixture_logs()[:6]
    copies = damaged_copies([*written, *real[:3]], root, random.Random(7))
    return [*real, *written, *copies]


def read_all(paths: dict[int, list[Path]], blocks: int, rnd: random.Random) -> tuple:
    """Every rank's payloads per source, and each source's report, read in random turns."""
    readers = RankReaders(paths)
    got = {k: [[] for _ in ps] for k, ps in paths.items()}
    reports = {}
    while live := readers.live():
        rnd.shuffle(live)
        frames, reads = readers.read(live[: rnd.randint(1, len(live))], blocks)
        at = 0
        for read in reads:
            got[read.rank][read.source] += [frames.payload(i) for i in range(at, at + read.records)]
            at += read.records
            if read.ended:
                reports[read.rank, read.source] = read.report
        assert at == len(frames)
    return got, reports


@pytest.mark.parametrize("blocks", [1, 2, 3, 8])
def test_each_rank_reads_as_the_transaction_log_reader(logs, blocks):
    rnd = random.Random(blocks)
    checked = fallen_back = 0
    for group in (logs[i : i + 7] for i in range(0, len(logs), 7)):
        # every third rank has two sources: a restart after its first
        paths = {k: [p] if k % 3 else [p, group[(k + 1) % len(group)]] for k, p in enumerate(group)}
        wanted = {k: [expected(p) for p in ps] for k, ps in paths.items()}
        if any(isinstance(w, str) for ws in wanted.values() for w, _ in ws):
            readers = RankReaders(paths)  # a log txlog refuses: the same error here
            with pytest.raises(Exception) as caught:
                while readers.live():
                    readers.read(readers.live(), blocks)
            errors = {w for ws in wanted.values() for w, _ in ws if isinstance(w, str)}
            assert type(caught.value).__name__ in errors
            readers.close()
            continue
        got, reports = read_all(paths, blocks, rnd)
        for k, ps in paths.items():
            for index, path in enumerate(ps):
                want, report = wanted[k][index]
                assert got[k][index] == want, path
                mine = reports[k, index]
                assert (mine.damaged, mine.describe()) == (report.damaged, report.describe())
                checked += 1
                fallen_back += report.damaged
    assert checked > 40 and fallen_back > 20  # intact logs and damaged ones both


def test_a_log_ending_in_a_cut_chunk_header_or_zeros_reads_as_the_transaction_log_reader(
    logs, tmp_path
):
    # A rank killed while its last chunk's header was being written leaves fewer than seven
    # bytes after its last whole chunk; a file system may leave zeros after the last write.
    # Either must be read as damage, exactly as the transaction-log reader reports it.
    data = logs[7].read_bytes()  # a synthetic log, several blocks long
    assert len(data) % BLOCK_SIZE > 64
    variants = [data[:-cut] for cut in range(1, 40)] + [data + bytes(n) for n in (1, 6, 7, 100)]
    paths = {}
    for i, variant in enumerate(variants):
        paths[i] = [tmp_path / f"variant-{i}.wandb"]
        paths[i][0].write_bytes(variant)
    got, reports = read_all(paths, 2, random.Random(3))
    tails = set()
    for k, (path,) in paths.items():
        want, report = expected(path)
        assert got[k][0] == want, path
        assert (reports[k, 0].damaged, reports[k, 0].describe()) == (
            report.damaged,
            report.describe(),
        )
        tails.add(report.truncated_bytes)
    # (one cut ends on a chunk boundary: that copy is intact, a log without its exit record)
    assert set(range(1, CHUNK_HEADER_SIZE)) <= tails  # cut inside a chunk header, or zeros
