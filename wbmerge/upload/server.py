"""What the server holds: the two read-only GraphQL queries wandb itself makes.

`Viewer` is what wandb asks to check a key (and it names the key's default entity);
`RunResumeStatus` is what wandb-core asks before it resumes a run: the run's history,
system-metric ("events") and console ("log") line counts and its last history line. These
reads are all wbmerge asks of the server; every upload goes through `wandb sync`.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..errors import WbmergeError
from .credentials import Credentials

PREFLIGHT_TIMEOUT = 10.0  # seconds: an unreachable server fails within this, in one line

VIEWER = "query Viewer { viewer { id entity username } }"

# The query of wandb-core's resume (core/api/graphql/query_run_resume_status.graphql).
RUN_RESUME_STATUS = """query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) {
    id name entity { id name }
    bucket(name: $name, missingOk: true) {
      id name summaryMetrics displayName logLineCount historyLineCount eventsLineCount
      historyTail eventsTail config tags wandbConfig(keys: ["t"])
    }
  }
}"""


class ServerError(WbmergeError):
    """The server could not be asked, or refused: exit 1, as for a failed upload."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


@dataclass(frozen=True)
class Held:
    """What the server holds of one run (all zero when it has no such run)."""

    exists: bool = False
    history_lines: int = 0
    events_lines: int = 0
    log_lines: int = 0
    last_step: int | None = None  # `_step` of the last history line, when it has one
    last_row: dict | None = None  # the last history line itself


class ServerClient:
    """Asks one W&B server (or the sink) what it holds, with a bounded wait per request."""

    def __init__(self, credentials: Credentials, timeout: float = PREFLIGHT_TIMEOUT) -> None:
        self.url = credentials.base_url + "/graphql"
        token = base64.b64encode(f"api:{credentials.api_key}".encode()).decode()
        self._auth = f"Basic {token}"
        self.timeout = timeout

    def _query(self, query: str, variables: dict[str, Any], name: str) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables, "operationName": name})
        request = urllib.request.Request(
            self.url,
            data=body.encode(),
            headers={"Authorization": self._auth, "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise ServerError(f"{self.url} refused the API key (HTTP {exc.code})") from None
            raise ServerError(f"{self.url} answered HTTP {exc.code} to {name}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"cannot reach W&B at {self.url}: {reason}") from None
        except ValueError:
            raise ServerError(f"{self.url} answered {name} with something not JSON") from None
        if not isinstance(answer, dict) or answer.get("errors") or "data" not in answer:
            errors = answer.get("errors") if isinstance(answer, dict) else answer
            raise ServerError(f"{self.url} refused {name}: {str(errors)[:200]}")
        return answer["data"] or {}

    def viewer_entity(self) -> str | None:
        """Check that the server answers and takes the key; returns the key's default entity."""
        viewer = self._query(VIEWER, {}, "Viewer").get("viewer") or {}
        entity = viewer.get("entity")
        return entity if isinstance(entity, str) and entity else None

    def held(self, entity: str | None, project: str, run_id: str) -> Held:
        """RunResumeStatus of one run, as counts and the last step."""
        variables = {"project": project, "entity": entity, "name": run_id}
        data = self._query(RUN_RESUME_STATUS, variables, "RunResumeStatus")
        bucket = (data.get("model") or {}).get("bucket")
        if not bucket:
            return Held()
        last_row = _last_row(bucket.get("historyTail"))
        return Held(
            exists=True,
            history_lines=int(bucket.get("historyLineCount") or 0),
            events_lines=int(bucket.get("eventsLineCount") or 0),
            log_lines=int(bucket.get("logLineCount") or 0),
            last_step=_step(last_row),
            last_row=last_row,
        )


def _last_row(history_tail: object) -> dict | None:
    """The last line of `historyTail` (a JSON list of JSON lines), as a dict."""
    try:
        lines = json.loads(history_tail) if isinstance(history_tail, str) else []
        last = json.loads(lines[-1]) if lines else None
    except (ValueError, TypeError, IndexError):
        return None
    return last if isinstance(last, dict) else None


def _step(row: dict | None) -> int | None:
    step = (row or {}).get("_step")
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None
