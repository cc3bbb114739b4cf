"""A small client of the sink's read API, for tests and scripts."""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from typing import Any

ARTIFACT_VERSION_FILES = """
query ArtifactVersionFiles($entity: String!, $project: String!, $name: String!, $after: String) {
  project(name: $project, entityName: $entity) {
    artifact(name: $name) {
      id digest state versionIndex
      files(after: $after, first: 1000) {
        edges { node { name sizeBytes md5 } }
        pageInfo { endCursor hasNextPage }
      }
    }
  }
}
"""


class SinkClient:
    """Reads runs, artifacts, stored files and faults with the sink's API key (`access.read_api_key`)."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def _request(self, path: str, data: bytes | None = None, method: str = "GET") -> bytes:
        token = base64.b64encode(f"api:{self.api_key}".encode()).decode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
            method=method,
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()

    def _get(self, path: str) -> Any:
        return json.loads(self._request(path))

    def runs(self, entity: str | None = None, project: str | None = None) -> list[dict]:
        query = urllib.parse.urlencode(
            {k: v for k, v in (("entity", entity), ("project", project)) if v}
        )
        return self._get("/api/runs" + (f"?{query}" if query else ""))

    def run(self, entity: str, project: str, run_id: str) -> dict:
        quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, run_id))
        return self._get(f"/api/runs/{quoted}")

    def file(self, entity: str, project: str, run_id: str, name: str) -> bytes:
        """A stored run file's bytes."""
        quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, run_id))
        return self._request(f"/storage/{quoted}/{urllib.parse.quote(name)}")

    def artifact(self, entity: str, project: str, version: str) -> dict:
        """An artifact version (`name:alias`, `name:vN`, or `name` for its latest) with its
        files, as `/api/artifacts` gives it."""
        quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, version))
        return self._get(f"/api/artifacts/{quoted}")

    def artifact_file(self, entity: str, project: str, version: str, path: str) -> bytes:
        """The stored bytes of a file of an artifact version."""
        quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, version))
        return self._request(f"/api/artifacts/{quoted}/files/{urllib.parse.quote(path)}")

    def graphql(self, query: str, variables: dict[str, Any]) -> dict:
        """The answer to one GraphQL request (its operation named in `query`)."""
        body = json.dumps({"query": query, "variables": variables}).encode()
        return json.loads(self._request("/graphql", body, "POST"))

    def committed_files(self, entity: str, project: str, version: str) -> dict | None:
        """What W&B's schema says of a version (`project.artifact(name)`), read with the
        GraphQL query `ArtifactVersionFiles` page by page: its id, digest, state and
        versionIndex, and {path: (sizeBytes, md5)} of its files; None if there is none.
        The query asks only for fields W&B's own schema has, so that the same check can
        read a version back from W&B."""
        found: dict | None = None
        cursor = None
        while True:
            answer = self.graphql(
                ARTIFACT_VERSION_FILES,
                {"entity": entity, "project": project, "name": version, "after": cursor},
            )
            artifact = answer["data"]["project"]["artifact"]
            if artifact is None:
                return None
            if found is None:
                found = {k: artifact[k] for k in ("id", "digest", "state", "versionIndex")}
                found["files"] = {}
            for edge in artifact["files"]["edges"]:
                node = edge["node"]
                found["files"][node["name"]] = (node["sizeBytes"], node["md5"])
            if not artifact["files"]["pageInfo"]["hasNextPage"]:
                return found
            cursor = artifact["files"]["pageInfo"]["endCursor"]

    def set_faults(self, specs: list[str]) -> dict:
        """Replace the sink's fault plan (a sink started with --allow-faults or --fault)."""
        body = json.dumps({"faults": specs}).encode()
        return json.loads(self._request("/api/faults", body, "POST"))

    def like_wandb(self) -> dict:
        """Which of W&B's behaviours the sink models (`behaviours`) and the requests it
        answered 429 by kind (`throttled`: `file_stream`, `graphql`)."""
        return self._get("/api/like-wandb")

    def faults(self) -> dict:
        return self._get("/api/faults")
