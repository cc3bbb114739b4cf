"""`wbmerge report --html`: one self-contained page, checked against the source values and
rendered by a real headless Chromium."""

from __future__ import annotations

import re
import statistics
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.training import RankInfo

from ..conftest import MANIFEST, job_dir
from ..sink.test_sink_page import chromium, needs_chromium
from ..support.ranklogs import exit_record, history_record, rank_log
from .test_report import by_rank

pytestmark = pytest.mark.e2e

HOSTILE = "<script>document.title='owned'</script><img src=x onerror=alert(1)>"


class Page(HTMLParser):
    """The elements of a page with their attributes, and its text, as a browser reads
    them; every metric section with its lines and table rows."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.metrics: dict[str, dict] = {}
        self.places: dict[int, list[str]] = {}  # rank -> the cells of its row
        self._metric: dict | None = None
        self._row: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = dict(attrs)
        self.tags.append((tag, found))
        if tag == "table" and found.get("class") == "places":
            self._metric = None
            self._in_places = True
        elif tag == "tr" and "data-rank" in found and getattr(self, "_in_places", False):
            self._row = {"cells": []}
            self.places[int(found["data-rank"])] = self._row["cells"]
        if tag == "section" and "data-key" in found:
            self._metric = {"lines": {}, "rows": {}, "kind": found["data-kind"]}
            self.metrics[found["data-key"]] = self._metric
        elif self._metric is not None and tag == "polyline" and "data-rank" in found:
            points = [tuple(map(float, p.split(","))) for p in found["points"].split()]
            self._metric["lines"][int(found["data-rank"])] = (found["class"], points)
        elif self._metric is not None and tag == "tr" and "data-rank" in found:
            self._row = {"class": found.get("class"), "cells": []}
            self._metric["rows"][int(found["data-rank"])] = self._row

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        elif tag == "table":
            self._in_places = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._row is not None:
            self._row["cells"].append(data)


def write_report(tmp_path, job: str, *args: str) -> Page:
    out = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(job_dir(job)), "--html", str(out), *args])
    assert result.exit_code == 0, result.output
    return Page(out.read_text())


def test_the_page_draws_every_ranks_values_and_marks_the_slow_one(tmp_path):
    page = write_report(tmp_path, "slow_rank")
    source = by_rank("slow_rank", "train/samples_per_sec")
    metric = page.metrics["train/samples_per_sec"]
    assert sorted(metric["lines"]) == sorted(source) == [0, 1, 2]
    lo = min(v for values in source.values() for _, v in values)
    hi = max(v for values in source.values() for _, v in values)
    for rank, values in source.items():
        kind, points = metric["lines"][rank]
        assert kind == ("outlier" if rank == 2 else "rank")
        values = [v for _, v in sorted(values)]
        assert len(points) == len(values) == MANIFEST["jobs"]["slow_rank"]["steps"]
        xs = [x for x, _ in points]
        assert xs == sorted(xs) and len(set(xs)) == len(xs)  # one point per step, in order
        # Higher on the page where the value is higher: the line follows the values.
        for (_, y1), (_, y2), v1, v2 in zip(points, points[1:], values, values[1:], strict=False):
            if abs(v2 - v1) > (hi - lo) * 0.01:
                assert (y2 < y1) == (v2 > v1)
        # The skew table: the source's count, mean, last, min and max.
        row = metric["rows"][rank]
        want = [len(values), statistics.fmean(values), values[-1], min(values), max(values)]
        assert row["cells"][1:6] == [f"{v:.6g}" for v in want]
        assert (row["class"] == "outlier") == (rank == 2)
        assert ("outlier" in "".join(row["cells"][6:])) == (rank == 2)
    assert "outlier in train/samples_per_sec: rank 2" in page.text
    # Other metrics single out no rank.
    for key, other in page.metrics.items():
        if key != "train/samples_per_sec":
            assert all(kind == "rank" for kind, _ in other["lines"].values()), key


def test_the_page_shows_ranks_nodes_and_the_spread_over_steps(tmp_path):
    page = write_report(tmp_path, "two_nodes_2x2", "-m", "train/loss")
    job = MANIFEST["jobs"]["two_nodes_2x2"]
    nproc = job["nproc"]
    assert "job fx-two-nodes-2x2: 4 of 4 ranks on 2 nodes" in page.text
    # node, host, rank, label, local rank, restarts: as the job was launched
    assert {
        rank: (cells[0], cells[2], cells[3], cells[4], cells[5])
        for rank, cells in page.places.items()
    } == {
        rank: (
            str(rank // nproc),
            str(rank),
            f"worker-{rank // nproc}-rank-{rank % nproc}",
            str(rank % nproc),
            "0",
        )
        for rank in range(job["nodes"] * nproc)
    }
    # The spread chart: one point per step all ranks logged.
    spreads = [a for tag, a in page.tags if tag == "polyline" and a.get("data-label") == "spread"]
    (spread,) = spreads
    assert len(spread["points"].split()) == MANIFEST["jobs"]["two_nodes_2x2"]["steps"]


def test_the_page_needs_nothing_from_the_network_and_runs_no_script(tmp_path):
    page = write_report(tmp_path, "slow_rank")
    tags = {tag for tag, _ in page.tags}
    assert not tags & {"script", "img", "iframe", "link", "object", "embed"}
    for _, attrs in page.tags:
        for name, value in attrs.items():
            assert not name.startswith("on"), name
            assert not re.match(r"\s*(https?:|//|javascript:)", value or "") or (
                value == "http://www.w3.org/2000/svg"  # (SVG's namespace, never fetched)
            ), (name, value)
    (policy,) = [a["content"] for tag, a in page.tags if a.get("http-equiv")]
    assert policy == "default-src 'none'; style-src 'unsafe-inline'"


def test_names_from_the_runs_are_text_on_the_page(tmp_path):
    for rank in range(3):
        info = RankInfo(rank, rank, 3, 3, 0, job_id=HOSTILE)
        with rank_log(tmp_path / "runs", info, f"h{rank}", "p") as log:
            for step in range(4):
                value = 1.0 + step + (10 if rank == 2 else 0)
                log.write(history_record([(HOSTILE, str(value)), ("_step", str(step))], step))
            log.write(exit_record(0))
    out = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "runs"), "--html", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "<script" not in text and "<img" not in text
    page = Page(text)
    assert HOSTILE in page.metrics  # the key, read back as text
    assert any(HOSTILE in piece for piece in page.text)


def test_a_page_is_never_written_into_a_run_directory(tmp_path):
    run_dir = next(job_dir("slow_rank").glob("wandb/offline-run-*"))
    out = run_dir / "files" / "report.html"
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "--html", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert "inside the run directory" in result.stderr


@needs_chromium
def test_chromium_renders_the_ranks_and_marks_the_slow_one(tmp_path):
    out = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(job_dir("slow_rank")), "--html", str(out)])
    assert result.exit_code == 0, result.output
    shown = chromium(tmp_path, "--dump-dom", out.as_uri())
    dom = shown.stdout
    assert "<body>" in dom, shown.stderr[-2000:]
    for label in ("rank-0", "rank-1", "rank-2"):
        assert f"&#9632; {label}" in dom or f"■ {label}" in dom
    assert "rank-2 ◀ outlier" in dom
    assert "outlier in train/samples_per_sec: rank 2" in dom
    shot = tmp_path / "report.png"
    chromium(tmp_path, "--window-size=1200,900", f"--screenshot={shot}", out.as_uri())
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(set(data[100:20000])) > 200  # charts, not a blank page
