"""The part of W&B's API that `wandb sync` (wandb-core 0.31) uses, answered from a `Store`.

GraphQL operations are told apart by their operation name; every answer has exactly the
fields the uploader reads. Unknown operations get a GraphQL error, never a guess.
"""

from __future__ import annotations

import json
import mimetypes
import re
import urllib.parse
import zlib
from typing import Any

from . import artifact_api, public_api
from .artifact_values import ArtifactError
from .names import DEFAULT_ENTITY, BadName, check_file_name, check_run_path
from .store import Store

FEATURES = ["FILESTREAM_GZIP"]  # so the tests exercise gzip-encoded file_stream bodies
# The most bytes a request body may hold, as sent (the server's limit) and once gunzipped: a
# few kilobytes of gzip can stand for gigabytes.
MAX_BODY = 1 << 30

_OPERATION = re.compile(r"\b(?:query|mutation)\s+(\w+)")


class ProtocolError(Exception):
    """A request the sink cannot answer; `status` is the HTTP status to send."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def checked_run_path(entity: object, project: object, run_id: object) -> tuple[str, str, str]:
    """The names of a run from a request, or ProtocolError(400): they become paths on disk."""
    try:
        return check_run_path(entity, project, run_id)
    except BadName as exc:
        raise ProtocolError(str(exc)) from None


def checked_file_names(names: object) -> list[str]:
    """A request's list of run file names, each a safe relative path, or ProtocolError(400)."""
    if not isinstance(names, list):
        raise ProtocolError("files must be a list of file names")
    try:
        return [check_file_name(name) for name in names]
    except BadName as exc:
        raise ProtocolError(str(exc)) from None


def decode_body(data: bytes, limit: int = MAX_BODY) -> Any:
    """A request's JSON body, gunzipped first where it is gzip: ValueError when it is not
    valid, ProtocolError(413) when it would be larger than `limit` bytes unzipped.

    The server has undone a `Content-Encoding: gzip` the request declared already (up to
    `MAX_BODY`); wandb-core sends file_stream bodies gzipped without declaring it, so a
    body is known by gzip's first two bytes."""
    if data[:2] == b"\x1f\x8b":
        data = gunzip(data, limit)
    try:
        return json.loads(data or b"{}")
    except RecursionError:  # nested past Python's limit: bad input, not the sink's fault
        raise ValueError("JSON nested too deeply") from None


def gunzip(data: bytes, limit: int) -> bytes:
    """The bytes of gzip `data` (one member or several, as `gzip.decompress` reads it), never
    more than `limit` of them held: ProtocolError(413) past it, ValueError for bad gzip."""
    out = bytearray()
    while True:
        inflater = zlib.decompressobj(wbits=31)  # (31: gzip's header and trailer)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as exc:
            raise ValueError(f"bad gzip body: {exc}") from None
        if len(out) > limit:
            raise ProtocolError(f"request body larger than {limit} bytes unzipped", 413)
        if not inflater.eof:
            raise ValueError("bad gzip body: it ends inside its data")
        data = inflater.unused_data
        if not data:
            return bytes(out)


def operation_name(payload: object) -> str:
    if not isinstance(payload, dict):
        return ""
    name = payload.get("operationName")
    if name:
        return str(name)
    match = _OPERATION.search(payload.get("query") or "")
    return match[1] if match else ""


def graphql(store: Store, payload: dict[str, Any], base_url: str) -> dict[str, Any]:
    """Answer one GraphQL request; ProtocolError(400) for a body of the wrong shape."""
    if not isinstance(payload, dict):
        raise ProtocolError("a GraphQL body must be a JSON object")
    name = operation_name(payload)
    variables = payload.get("variables") or {}
    if not isinstance(variables, dict):
        raise ProtocolError("GraphQL variables must be a JSON object")
    reader = public_api.HANDLERS.get(name)
    if reader is not None:
        try:
            return {"data": reader(store, variables, base_url, str(payload.get("query") or ""))}
        except public_api.QueryError as exc:
            return {"errors": [{"message": f"{name}: {exc}"}]}
    handler = _HANDLERS.get(name) or artifact_api.HANDLERS.get(name)
    if handler is None:
        return {"errors": [{"message": f"operation {name or '?'} is not supported by this sink"}]}
    try:
        return {"data": handler(store, variables, base_url)}
    except ArtifactError as exc:
        raise ProtocolError(str(exc), exc.status) from None


def _entity(variables: dict[str, Any]) -> str:
    return variables.get("entity") or variables.get("entityName") or DEFAULT_ENTITY


def _upsert_bucket(store: Store, v: dict[str, Any], base_url: str) -> dict:
    name = v.get("name") or v.get("id")
    if not name:
        raise ProtocolError("UpsertBucket needs a run name")
    entity, project, name = checked_run_path(_entity(v), v.get("project") or "uncategorized", name)
    run = store.upsert_run(entity, project, name, v)
    return {
        "upsertBucket": {
            "bucket": {
                "id": f"{entity}/{project}/{name}",
                "name": name,
                "displayName": run.get("display_name") or name,
                "description": run.get("notes") or "",
                "config": run.get("raw_config") or "{}",
                "sweepName": None,
                "historyLineCount": run.get("history_line_count", 0),
                "project": {
                    "id": f"{entity}/{project}",
                    "name": project,
                    "entity": {"id": entity, "name": entity},
                },
            },
            "inserted": True,
        }
    }


def _server_features(store: Store, v: dict[str, Any], base_url: str) -> dict:
    return {"serverInfo": {"features": [{"name": f, "isEnabled": True} for f in FEATURES]}}


def _viewer(store: Store, v: dict[str, Any], base_url: str) -> dict:
    return {
        "viewer": {
            "id": "local-viewer",
            "entity": DEFAULT_ENTITY,
            "username": DEFAULT_ENTITY,
            "flags": None,
            "teams": {"edges": []},
        }
    }


def _create_run_files(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """Upload URLs that carry the token of their file (wandb-core sends them no API key)."""
    entity, project, run = checked_run_path(
        _entity(v), v.get("project") or "uncategorized", v.get("run")
    )
    run_url = _storage_url(base_url, entity, project, run)
    return {
        "createRunFiles": {
            "runID": f"{entity}/{project}/{run}",
            "uploadHeaders": [],
            "files": [
                {
                    "name": f,
                    "uploadUrl": f"{run_url}/{urllib.parse.quote(f)}?token="
                    + store.upload_tokens.token(entity, project, run, f),
                }
                for f in checked_file_names(v.get("files") or [])
            ],
        }
    }


def _storage_url(base_url: str, entity: str, project: str, run: str) -> str:
    """Where a run's files are put (with a token) and read (with the API key), as W&B's
    storage is: a file's name is appended, quoted."""
    quoted = "/".join(urllib.parse.quote(p, safe="") for p in (entity, project, run))
    return f"{base_url}/storage/{quoted}"


def _run_resume_status(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """What the run holds, as W&B answers wandb-core's resume query.

    wbmerge's exactly-once upload relies on three things W&B does and the sink must too:
    each line count is the next line number a client writes (here the highest stored
    offset + 1), the same count UpsertBucket reports as `historyLineCount`; `historyTail`
    is a JSON list holding the last history line; lines are kept by offset, so lines sent
    again at their offsets replace themselves instead of adding rows.
    """
    entity, project, name = checked_run_path(
        _entity(v), v.get("project") or "uncategorized", v.get("name")
    )
    run = store.reported_run(entity, project, name)
    bucket = None
    if run is not None:
        bucket = {
            "id": f"{entity}/{project}/{run['id']}",
            "name": run["id"],
            "summaryMetrics": run["raw_summary"],
            "displayName": run["display_name"] or run["id"],
            "logLineCount": run["console_line_count"],
            "historyLineCount": run["history_line_count"],
            "eventsLineCount": run["events_line_count"],
            "historyTail": json.dumps([run["history_tail"]] if run["history_tail"] else []),
            "eventsTail": json.dumps([run["events_tail"]] if run["events_tail"] else []),
            "config": run["raw_config"],
            "notes": run["notes"],
            "tags": run["tags"],
            "wandbConfig": json.dumps({}),
        }
    return {
        "model": {
            "id": f"{entity}/{project}",
            "name": project,
            "entity": {"id": entity, "name": entity},
            "bucket": bucket,
        }
    }


def _run_files(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """A run's state, names and a page of its files, as W&B answers `RunFiles` (wbmerge's
    and `run.files()`'s): `fileLimit` files after the cursor `fileCursor` (here the index
    of the last one sent), only those named in `fileNames` or matching `pattern` (SQL
    LIKE) when given, each with its MD5 and the URL it is read from."""
    entity, project, name = checked_run_path(
        _entity(v), v.get("project") or "uncategorized", v.get("name")
    )
    if v.get("upload"):
        raise ProtocolError("RunFiles: this sink gives no upload URLs to read queries")
    run, files = store.run(entity, project, name), store.file_sizes(entity, project, name)
    if run is None or files is None:
        return {"project": {"run": None}}
    file_count = len(files)  # (a field of the run: all its files, as W&B counts them)
    names, pattern = v.get("fileNames") or [], v.get("pattern")
    if names:
        wanted = set(checked_file_names(names))
        files = [(file, size) for file, size in files if file in wanted]
    elif pattern is not None:
        if not isinstance(pattern, str):
            raise ProtocolError("RunFiles: pattern must be a string")
        if len(pattern) > 1024:
            raise ProtocolError("RunFiles: pattern is longer than 1024 characters")
        files = [(file, size) for file, size in files if like(pattern, file)]
    cursor, limit = v.get("fileCursor"), v.get("fileLimit")
    start = (
        int(cursor) + 1 if isinstance(cursor, str) and re.fullmatch(r"[0-9]{1,9}", cursor) else 0
    )
    limit = limit if isinstance(limit, int) and 0 < limit <= 1000 else 50
    page = files[start : start + limit]
    run_url = _storage_url(base_url, entity, project, name)
    times = store.file_times(entity, project, name)
    edges = []
    for i, (file, size) in enumerate(page):
        url = f"{run_url}/{urllib.parse.quote(file)}"
        node = {
            "id": f"{entity}/{project}/{name}/{file}",
            "name": file,
            "sizeBytes": size,
            "md5": store.file_md5(entity, project, name, file),
            "url": url,
            "directUrl": url,
            "mimetype": mimetypes.guess_type(file)[0] or "application/octet-stream",
            "updatedAt": public_api.iso_time(times.get(file, run["updated"])),
        }
        edges.append({"node": node, "cursor": str(start + i)})
    end = edges[-1]["cursor"] if edges else None
    info = {"endCursor": end, "hasNextPage": start + limit < len(files)}
    return {
        "project": {
            "internalId": public_api.project_id(entity, project),
            "run": {
                "state": run["state"],
                "displayName": run["display_name"] or run["id"],
                "group": run["group"],
                "jobType": run["job_type"],
                "fileCount": file_count,
                "files": {"edges": edges, "pageInfo": info},
            },
        }
    }


def like(pattern: str, text: str) -> bool:
    """SQL LIKE (`%` any run of characters, `_` any one), in time proportional to the
    lengths' product at worst: no regular expression, which a pattern of many `%` could
    make backtrack for ever."""
    p = t = 0
    star, resume = -1, 0  # where the last `%` was, and the text position it matched up to
    while t < len(text):
        if p < len(pattern) and pattern[p] in ("_", text[t]) and pattern[p] != "%":
            p, t = p + 1, t + 1
        elif p < len(pattern) and pattern[p] == "%":
            star, resume, p = p, t, p + 1
        elif star >= 0:
            resume += 1
            p, t = star + 1, resume
        else:
            return False
    return all(c == "%" for c in pattern[p:])


def _history_page(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """A page of a run's history rows by step, as W&B answers the public API's
    `HistoryPage` (`run.scan_history`): `history` is a list of JSON lines."""
    entity, project, run_id = checked_run_path(
        _entity(v), v.get("project") or "uncategorized", v.get("run")
    )
    bounds = [v.get(name) for name in ("minStep", "maxStep", "pageSize")]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise ProtocolError("minStep, maxStep and pageSize must be whole numbers")
    min_step, max_step, samples = bounds
    if not -(2**63) <= min_step <= max_step < 2**63:
        raise ProtocolError("minStep and maxStep must be int64 steps, minStep <= maxStep")
    if not 0 < samples <= 100_000:
        raise ProtocolError("pageSize must be from 1 to 100000")
    lines = store.history_page(entity, project, run_id, min_step, max_step, samples)
    run = None if lines is None else {"history": lines}
    return {"project": {"run": run}}


def _mark_run_files_uploaded(store: Store, v: dict[str, Any], base_url: str) -> dict:
    return {"markRunFilesUploaded": {"success": True}}


_HANDLERS = {
    "UpsertBucket": _upsert_bucket,
    "ServerFeaturesQuery": _server_features,
    "Viewer": _viewer,
    "CreateRunFiles": _create_run_files,
    "RunResumeStatus": _run_resume_status,
    "MarkRunFilesUploaded": _mark_run_files_uploaded,
    "RunFiles": _run_files,
    "HistoryPage": _history_page,
}


def file_stream(store: Store, entity: str, project: str, run: str, body: dict) -> dict:
    entity, project, run = checked_run_path(entity, project, run)
    if not isinstance(body, dict):
        raise ProtocolError("a file_stream body must be a JSON object")
    store.file_stream(entity, project, run, body)
    return {"exitcode": None, "limits": {}}
