"""The check that a run's artifacts are committed on the server reads untrusted answers:
whatever shape they take, it gives a line for the run (which is then not recorded and is
sent again), never a traceback, and a server that pages forever is asked a bounded number
of times. Good answers are tested end to end against the sink in test_merged_artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wbmerge.merge import LoggedArtifact
from wbmerge.upload import Delivery
from wbmerge.verify import artifactcheck
from wbmerge.verify.artifactcheck import artifacts_missing

from ..upload.test_server_client import GraphQLDouble, client_of, serving

CHECKPOINT = LoggedArtifact("ckpt", "0" * 32, (("weights.bin", 5, "XUFAKrxLKna5cZ2REBfFkg=="),))


def delivery() -> Delivery:
    return Delivery(
        "run",
        Path("/nonexistent"),
        Path("/nonexistent/run-run.wandb"),
        "key",
        "fp",
        artifacts=[CHECKPOINT],
    )


def versions_answer(nodes: object, page: object = None) -> bytes:
    page = {"endCursor": None, "hasNextPage": False} if page is None else page
    run = {"artifacts": {"edges": nodes, "pageInfo": page}}
    return json.dumps({"data": {"project": {"run": run}}}).encode()


def node(state: str = "COMMITTED", digest: str = "0" * 32, version: object = 0) -> dict:
    return {
        "node": {
            "id": "QQ==",
            "digest": digest,
            "state": state,
            "versionIndex": version,
            "artifactSequence": {"name": "ckpt"},
        }
    }


HOSTILE = {
    "not-json": b"<html>",
    "data-a-list": b'{"data": []}',
    "edges-not-a-list": versions_answer({"a": 1}),
    "edge-not-an-object": versions_answer([5]),
    "node-a-string": versions_answer([{"node": "x"}]),
    "more-pages-no-cursor": versions_answer([], {"hasNextPage": True, "endCursor": ""}),
    "deep": b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize(
    "server", [{"answer": a} for a in HOSTILE.values()], indirect=True, ids=HOSTILE.keys()
)
def test_an_answer_of_another_shape_is_a_line_for_the_run(server):
    (line,) = artifacts_missing(client_of(server, retry_budget=0), "me", "p", delivery())
    assert line.startswith("artifacts could not be verified: ") or line.startswith(
        "artifact 'ckpt' with digest"  # (an empty answer: no such run)
    )


@pytest.fixture
def server(request):
    yield from serving(GraphQLDouble, dict(request.param))


ENDLESS = versions_answer([], {"hasNextPage": True, "endCursor": "again"})


@pytest.mark.parametrize("server", [{"answer": ENDLESS}], indirect=True)
def test_a_server_that_pages_forever_is_asked_a_bounded_number_of_times(server, monkeypatch):
    monkeypatch.setattr(artifactcheck, "MAX_PAGES", 5)  # (100 in use: the same code path)
    (line,) = artifacts_missing(client_of(server), "me", "p", delivery())
    assert "over 5 pages" in line
    assert len(server.seen) == 5


PENDING = versions_answer([node(state="PENDING"), node(digest="1" * 32), node(version="0")])


@pytest.mark.parametrize("server", [{"answer": PENDING}], indirect=True)
def test_versions_not_committed_or_of_other_content_do_not_count(server):
    """A pending version of the digest, a committed one of another digest, and one whose
    version index is not a number leave the artifact missing."""
    assert artifacts_missing(client_of(server), "me", "p", delivery()) == [
        f"artifact 'ckpt' with digest {'0' * 32} is not committed under the run (it is PENDING)"
    ]
