"""The sink's page for people, rendered by a real headless Chromium and looked at."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request

import pytest

from wbmerge.training import RankInfo

from ..conftest import ROOT, job_dir
from ..support import synthetic
from ..support.sinktools import copy_runs, expected_from_log, wandb_sync

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def fetch(sink, path):
    """A page as a browser gets it after the sink's sign-in (user `api`, the key)."""
    request = urllib.request.Request(sink.url + path, headers={"Authorization": sink.auth})
    with urllib.request.urlopen(request) as response:
        return response.read().decode()


def signed_in_url(sink, path):
    """The link `wbmerge sink serve` prints: the key in the URL, as basic auth."""
    return f"http://api:{sink.api_key}@{sink.url.removeprefix('http://')}{path}"


def chromium(tmp_path, *args):
    assert CHROMIUM, "CI must have chromium: .ci/run installs it"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="needs Debian's chromium (`apt-get install chromium`; .ci/run installs it)",
)


def test_run_page_has_one_chart_per_metric_and_a_line_per_rank(sink, tmp_path):
    # A run whose keys are labelled per rank, as a shared merge writes them.
    labels = ("rank-0", "rank-1", "rank-2")
    logs = [
        synthetic.write_rank(
            tmp_path, RankInfo(0, 0, 3, 3, 0, job_id="pg"), 30, metrics=2, key_labels=labels
        )
    ]
    runs = copy_runs(job_dir("media") / "wandb", tmp_path / "media")
    assert (
        wandb_sync(
            sink, [*sorted(runs.glob("offline-run-*")), logs[0].parent], "-p", "pg"
        ).returncode
        == 0
    )
    run_id = expected_from_log(logs[0]).run_id
    page = fetch(sink, f"/local/pg/runs/{run_id}")
    charts = re.findall(r"<div class='chart'><h3>([^<]+)</h3>(.*?)</div></div>", page)
    by_title = dict(charts)
    assert {"train/metric_00", "train/metric_01"} <= set(by_title)
    for title in ("train/metric_00", "train/metric_01"):
        assert by_title[title].count("<polyline") == 3  # one line per rank label
        assert all(f"&#9632; {label}<" in by_title[title] for label in labels)
    # system metrics keep their /l:<label> suffix: one chart per metric, a line per label
    assert "system.cpu" in by_title and "rank-0" in by_title["system.cpu"]
    index = fetch(sink, "/")
    assert f"/local/pg/runs/{run_id}" in index


@needs_chromium
def test_screenshot_in_headless_chromium(sink, tmp_path):
    runs = copy_runs(job_dir("slow_rank") / "wandb", tmp_path / "wandb")
    assert wandb_sync(sink, sorted(runs.glob("offline-run-*")), "-p", "shot").returncode == 0
    run_id = sink.client.runs(project="shot")[0]["id"]
    shot = tmp_path / "run-page.png"
    result = chromium(
        tmp_path,
        "--window-size=1400,1000",
        f"--screenshot={shot}",
        signed_in_url(sink, f"/local/shot/runs/{run_id}"),
    )
    assert shot.exists(), result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 1000)
    # a page of charts is not blank: many distinct colours in the image
    assert len(set(data[100:20000])) > 200
    keep = ROOT / "build" / "run-page.png"  # for people to look at after a run
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)


@needs_chromium
def test_chromium_finds_no_script_in_a_page_of_hostile_values(sink, tmp_path):
    """What a browser makes of a run whose names and values are HTML: text, no elements."""
    hostile = "<script>document.title='owned'</script><img src=x onerror=alert(1)>"
    query = (
        "mutation UpsertBucket($name: String, $project: String, $displayName: String, "
        "$groupName: String, $summaryMetrics: JSONString, $config: JSONString) { x }"
    )
    variables = {
        "project": "h",
        "name": "r",
        "displayName": hostile,
        "groupName": hostile,
        "summaryMetrics": json.dumps({hostile: hostile}),
        "config": json.dumps({"lr": {"value": hostile}}),
    }
    request = urllib.request.Request(
        sink.url + "/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Authorization": sink.auth, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as response:
        assert response.status == 200
    for path in ("/local/h/runs/r", "/"):
        result = chromium(tmp_path, "--dump-dom", signed_in_url(sink, path))
        dom = result.stdout
        assert "<body>" in dom, result.stderr[-2000:]
        assert "<script" not in dom and "<img" not in dom and "owned" not in dom.split("<body>")[0]
        assert "&lt;script&gt;document.title='owned'&lt;/script&gt;" in dom
