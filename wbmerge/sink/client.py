"""A small client of the sink's read API, for tests and scripts."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

LOCAL_API_KEY = "local-" + "0" * 40


def local_api_key() -> str:
    """An API key of the form wandb requires, accepted by the sink (which checks no account)."""
    return LOCAL_API_KEY


class SinkClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base_url + path, timeout=30) as response:
            return json.loads(response.read())

    def runs(self, entity: str | None = None, project: str | None = None) -> list[dict]:
        query = urllib.parse.urlencode(
            {k: v for k, v in (("entity", entity), ("project", project)) if v}
        )
        return self._get("/api/runs" + (f"?{query}" if query else ""))

    def run(self, entity: str, project: str, run_id: str) -> dict:
        quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, run_id))
        return self._get(f"/api/runs/{quoted}")

    def set_faults(self, specs: list[str]) -> dict:
        request = urllib.request.Request(
            self.base_url + "/api/faults",
            data=json.dumps({"faults": specs}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def faults(self) -> dict:
        return self._get("/api/faults")
