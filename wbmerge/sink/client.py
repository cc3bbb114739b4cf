"""A small client of the sink's read API, for tests and scripts."""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from typing import Any


class SinkClient:
    """Reads runs, stored files and faults with the sink's API key (`access.read_api_key`)."""

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

    def set_faults(self, specs: list[str]) -> dict:
        """Replace the sink's fault plan (a sink started with --allow-faults or --fault)."""
        body = json.dumps({"faults": specs}).encode()
        return json.loads(self._request("/api/faults", body, "POST"))

    def faults(self) -> dict:
        return self._get("/api/faults")
