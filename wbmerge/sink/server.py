"""The sink's HTTP server (aiohttp, bound to 127.0.0.1): upload API, read API, pages, faults.

Who may do what: every request must name a loopback Host (`access`), may not hide a path
separator in percent-encoding, and may not come from another site's page in a browser.
Every request needs the sink's own API key (`access.ApiKey`, HTTP basic auth `api:<key>`,
as wandb sends it and as a browser asks for it), the pages and their read API included:
other users of the machine reach the same port. A file PUT instead needs the token of its
upload URL (wandb-core sends those no key), and a GET of an artifact file or manifest may
bring the read token of the download URL the public API's queries handed out instead
(wandb fetches those without the key, as W&B's pre-signed URLs). Fault injection needs the
key and a sink started with `--allow-faults` (or `--fault`).

Every response carries `X-Content-Type-Options: nosniff` and a Content-Security-Policy
that allows no scripts, and stored run files are sent as downloads, so that an uploaded
`.html` or `.svg` never runs as a page of the sink's origin.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from aiohttp import web

from ..errors import WbmergeError
from ..safepaths import check_out_file
from . import access, pages, protocol
from .artifact_values import ArtifactError
from .faults import FaultPlan, parse_fault, without_metric_definitions
from .names import DEFAULT_ENTITY
from .store import Store
from .wandblike import LikeWandb, Throttle, retry_after

STORE = web.AppKey("store", Store)
FAULTS = web.AppKey("faults", FaultPlan)
FAULTS_ALLOWED = web.AppKey("faults_allowed", bool)
THROTTLE = web.AppKey("throttle", Throttle)
# (a request's key: the part of `_wandb` the `nometrics` or `nocharts` fault drops from it)
WITHOUT_METRICS = "without_metrics"
ENCODED_SEPARATORS = ("%2f", "%5c", "%00")  # "/", "\\" and NUL hidden in a path segment
BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="wbmerge sink", charset="UTF-8"'}
# The pages are server-rendered HTML with one inline stylesheet and inline SVG charts: no
# scripts, images, fonts, frames or forms, so nothing else is allowed.
PAGE_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
FILE_POLICY = "default-src 'none'; sandbox"  # a run file, should a browser show it anyway
# A browser's fetch metadata: requests from pages of other sites (which include other ports
# of 127.0.0.1, i.e. other users' servers) are refused.
FOREIGN_FETCH_SITES = ("cross-site", "same-site")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Where files are PUT with the token of their upload URL instead of the key.
UPLOAD_PREFIXES = ("/storage/", "/artifact-storage/")


def _refuse(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse foreign Host names (DNS rebinding) and encoded separators before anything runs."""
    if not access.is_loopback_host(request.headers.get("Host")):
        return _refuse(403, "the Host header must name the loopback (127.0.0.1, localhost, [::1])")
    if _from_another_site(request):
        return _refuse(403, "requests from other sites' pages are refused; open the sink's URL")
    raw_path = request.rel_url.raw_path.lower()
    if any(encoded in raw_path for encoded in ENCODED_SEPARATORS):
        return _refuse(400, "percent-encoded path separators are not allowed")
    try:
        return await handler(request)
    except RecursionError:  # a JSON value given (or stored from a request) nested too deeply
        return _refuse(400, "a JSON value is nested too deeply to read")
    except web.RequestPayloadError as exc:  # a declared Content-Encoding that does not decode
        return _refuse(400, f"bad request body: {str(exc).strip()}")


def _from_another_site(request: web.Request) -> bool:
    """True for a browser's request made by a page that is not the sink's (CSRF): its fetch
    metadata says so, or (for older browsers) it changes something and names another Origin.
    wandb-core and other programs send neither header."""
    if request.headers.get("Sec-Fetch-Site", "").lower() in FOREIGN_FETCH_SITES:
        return True
    origin = request.headers.get("Origin")
    return (
        request.method not in SAFE_METHODS
        and origin is not None
        and origin != f"{request.scheme}://{request.host}"
    )


@web.middleware
async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse (401) every request without the sink's key, before it reads or writes
    anything; a file PUT is checked by its upload URL's token instead (`put_file`)."""
    if request.method == "PUT" and request.path.startswith(UPLOAD_PREFIXES):
        return await handler(request)
    if (
        request.method in ("GET", "HEAD")
        and request.path.startswith("/artifact-storage/")
        and "read" in request.query
    ):
        return await handler(request)  # (its read token is checked in get_artifact_file)
    if not request.app[STORE].api_key.accepts(request.headers.get("Authorization")):
        return _refuse(
            401,
            "this needs the sink's API key (HTTP basic auth, user api): the key "
            "`wbmerge sink serve` printed, kept in the data directory's api-key file",
            BASIC_CHALLENGE,
        )
    return await handler(request)


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """No sniffing and no scripts, on every response (errors too)."""
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers.setdefault("Content-Security-Policy", PAGE_POLICY)
    response.headers.setdefault("Cache-Control", "no-store")


def _kind(request: web.Request, body: bytes) -> str:
    path = request.path
    if path == "/graphql":
        try:
            payload = protocol.decode_body(body)
            return f"graphql:{protocol.operation_name(payload)}"
        except (ValueError, OSError, protocol.ProtocolError):
            return "graphql:?"
    if path.endswith("/file_stream"):
        try:
            files = protocol.decode_body(body).get("files") or {}
            history = (files.get("wandb-history.jsonl") or {}).get("content")
        except (ValueError, OSError, AttributeError, protocol.ProtocolError):
            history = None
        return "file_stream:history" if history else "file_stream"
    if path.startswith(UPLOAD_PREFIXES):
        return "storage"
    return "other"


@web.middleware
async def fault_injection(request: web.Request, handler: Any) -> web.StreamResponse:
    plan = request.app[FAULTS]
    if not plan.faults or request.path.startswith(("/api/", "/static/")):
        return await handler(request)
    body = await request.read()
    for fault in plan.next(_kind(request, body)):
        if fault.delay:
            await asyncio.sleep(fault.delay)
        while fault.action == "hold" and plan.holds(fault):
            await asyncio.sleep(0.05)
        if fault.action == "drop":
            if request.transport is not None:
                request.transport.abort()  # the client sees a connection reset mid-request
            raise asyncio.CancelledError
        if fault.status:
            return web.json_response(
                {"errors": [{"message": f"injected fault {fault.status}"}]},
                status=fault.status,
                headers={"Retry-After": "0"} if fault.status == 429 else None,
            )
        if fault.action == "lose":  # (acknowledged as file_stream does, nothing kept)
            return web.json_response({"exitcode": None, "limits": {}})
        if fault.action == "nometrics":
            request[WITHOUT_METRICS] = "m"
        if fault.action == "nocharts":
            request[WITHOUT_METRICS] = "visualize"
    return await handler(request)


@web.middleware
async def throttle(request: web.Request, handler: Any) -> web.StreamResponse:
    """W&B's rate limits, when modelled (`wandblike`): a request past them is answered 429
    with the whole seconds to wait in `Retry-After`, and does nothing."""
    limits = request.app.get(THROTTLE)
    if limits is None:
        return await handler(request)
    m = request.match_info
    body = await request.read()
    if request.path == "/graphql":
        try:
            variables = protocol.decode_body(body).get("variables") or {}
            project = variables.get("project") or variables.get("projectName")
            place = (_entity(variables), project, None) if project else None
        except (ValueError, OSError, AttributeError, protocol.ProtocolError):
            place = None  # (refused by the handler, which says why)
    elif request.path.endswith("/file_stream") and "run" in m:  # (not an unknown path)
        place = (m["entity"], m["project"], m["run"])
    else:
        place = None
    if place is not None and isinstance(place[0], str) and isinstance(place[1], str):
        wait = limits.admit(place[0], place[1], place[2], len(body))
        if wait is not None:
            return web.json_response(
                {"errors": [{"message": "rate limit exceeded"}]},
                status=429,
                headers={"Retry-After": retry_after(wait)},
            )
    return await handler(request)


def _entity(variables: dict) -> object:
    return variables.get("entity") or variables.get("entityName") or DEFAULT_ENTITY


async def graphql(request: web.Request) -> web.Response:
    try:
        payload = protocol.decode_body(await request.read())
        if request.get(WITHOUT_METRICS) and isinstance(payload, dict):
            without_metric_definitions(payload.get("variables") or {}, request[WITHOUT_METRICS])
        answer = protocol.graphql(request.app[STORE], payload, _base_url(request))
    except protocol.ProtocolError as exc:
        return web.json_response({"errors": [{"message": str(exc)}]}, status=exc.status)
    except (ValueError, OSError) as exc:
        return web.json_response({"errors": [{"message": f"bad request: {exc}"}]}, status=400)
    return web.json_response(answer)


async def file_stream(request: web.Request) -> web.Response:
    m = request.match_info
    try:
        body = protocol.decode_body(await request.read())
        answer = protocol.file_stream(request.app[STORE], m["entity"], m["project"], m["run"], body)
    except protocol.ProtocolError as exc:
        return _refuse(exc.status, str(exc))
    except (ValueError, OSError) as exc:
        return _refuse(400, f"bad request: {exc}")
    return web.json_response(answer)


def _run_file(request: web.Request) -> tuple[str, str, str, str]:
    m = request.match_info
    return m["entity"], m["project"], m["run"], m["name"]


async def put_file(request: web.Request) -> web.Response:
    """Store an uploaded file: only with the token of its upload URL (see `access`)."""
    store = request.app[STORE]
    token = request.query.get("token")
    if not store.upload_tokens.check(token, *_run_file(request)):
        status = 403 if token else 401
        return _refuse(status, "a file PUT needs the upload URL that CreateRunFiles handed out")
    try:
        store.save_file(*_run_file(request), await request.read())
    except ValueError as exc:
        return _refuse(400, str(exc))
    except OSError as exc:
        return _refuse(409, f"cannot store the file: {exc.strerror or exc}")
    return web.Response(status=200)


async def get_file(request: web.Request) -> web.StreamResponse:
    """A stored file, as a download: a run's `.html` or `.svg` never opens as a page."""
    try:
        path = request.app[STORE].file_path(*_run_file(request))
    except ValueError as exc:
        return _refuse(400, str(exc))
    if not path.is_file():
        raise web.HTTPNotFound()
    download = urllib.parse.quote(path.name, safe="")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"attachment; filename*=UTF-8''{download}",
            "Content-Security-Policy": FILE_POLICY,
        },
    )


def _artifact_file(request: web.Request) -> tuple[int, str | None]:
    """The version and file (None: the manifest) of an artifact storage URL, or of a
    `/api/artifacts/{entity}/{project}/{version}/files/{name}` download."""
    m = request.match_info
    if "artifact" in m:
        return int(m["artifact"]), m.get("name")
    found = request.app[STORE].artifacts.find(m["entity"], m["project"], m["version"])
    if found is None:
        raise web.HTTPNotFound()
    return found, m["name"]


async def put_artifact_file(request: web.Request) -> web.Response:
    """Keep a file (or the manifest) of an artifact version: only with the token of its
    upload URL, and only if it is what the manifest says (`artifacts`)."""
    store = request.app[STORE]
    artifact, name = _artifact_file(request)
    token = request.query.get("token")
    if not store.upload_tokens.check_artifact(token, artifact, name):
        status = 403 if token else 401
        return _refuse(status, "an artifact file PUT needs the upload URL the sink handed out")
    data = await request.read()
    try:
        if name is None:
            store.artifacts.receive_manifest(artifact, data)
        else:
            store.artifacts.receive_file(artifact, name, data)
    except ArtifactError as exc:
        return _refuse(exc.status, str(exc))
    except ValueError as exc:
        return _refuse(400, str(exc))
    except OSError as exc:
        return _refuse(409, f"cannot store the file: {exc.strerror or exc}")
    return web.Response(status=200)


async def get_artifact_file(request: web.Request) -> web.StreamResponse:
    """A stored file (or the manifest) of an artifact version, as a download."""
    store = request.app[STORE]
    artifacts = store.artifacts
    artifact, name = _artifact_file(request)
    if "read" in request.query:
        token, expires = request.query.get("read"), request.query.get("expires")
        if not store.upload_tokens.check_read(token, artifact, name, expires, time.time()):
            return _refuse(403, "this download URL is not the sink's, or it has expired")
    try:
        path = (
            artifacts.manifest_path(artifact)
            if name is None
            else artifacts.file_path(artifact, name)
        )
    except ValueError as exc:
        return _refuse(400, str(exc))
    if path is None or not path.is_file():
        raise web.HTTPNotFound()
    download = urllib.parse.quote((name or "wandb_manifest.json").rsplit("/", 1)[-1], safe="")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"attachment; filename*=UTF-8''{download}",
            "Content-Security-Policy": FILE_POLICY,
        },
    )


async def api_artifact(request: web.Request) -> web.Response:
    """A version (`name:alias`, `name:vN`, or `name` for its latest) with its files."""
    m = request.match_info
    artifacts = request.app[STORE].artifacts
    found = artifacts.find(m["entity"], m["project"], m["version"])
    if found is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": "no such artifact version"}), content_type="application/json"
        )
    return web.json_response(artifacts.version(found, files=True))


async def telemetry(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({})


async def api_runs(request: web.Request) -> web.Response:
    q = request.query
    return web.json_response(request.app[STORE].runs(q.get("entity"), q.get("project")))


async def api_run(request: web.Request) -> web.Response:
    m = request.match_info
    run = request.app[STORE].run(m["entity"], m["project"], m["run"], full=True)
    if run is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": "no such run"}), content_type="application/json"
        )
    for key in ("raw_config", "raw_summary", "history_tail", "events_tail"):
        run.pop(key, None)
    return web.json_response(run)


async def api_like_wandb(request: web.Request) -> web.Response:
    """Which of W&B's behaviours the sink models, and how many requests it answered 429."""
    limits = request.app.get(THROTTLE)
    throttled = dict(limits.refused) if limits is not None else {}
    return web.json_response(
        {"behaviours": request.app[STORE].like.describe(), "throttled": throttled}
    )


async def api_faults(request: web.Request) -> web.Response:
    """The fault plan (GET) or a new one (POST): with the API key, on a sink that allows it."""
    if not request.app[FAULTS_ALLOWED]:
        return _refuse(403, "fault injection is off: start the sink with --allow-faults")
    plan = request.app[FAULTS]
    if request.method == "POST":
        try:
            specs = (await request.json()).get("faults", [])
            plan.replace([parse_fault(s) for s in specs])
        except (ValueError, AttributeError, TypeError) as exc:
            return _refuse(400, f"bad fault plan: {exc}")
    return web.json_response(plan.summary())


def _base_url(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def make_app(
    data_dir: str | Path,
    faults: list[str] | None = None,
    allow_faults: bool = False,
    like: LikeWandb | None = None,
) -> web.Application:
    """The sink's application; faults can be set later only if `allow_faults` or `faults`.
    `like` says which of W&B's behaviours it models (none: the ideal server)."""
    app = web.Application(
        middlewares=[guard, require_key, throttle, fault_injection],
        client_max_size=protocol.MAX_BODY,
    )
    app[STORE] = Store(data_dir, like)
    if like is not None and like.limits is not None:
        app[THROTTLE] = Throttle(like.limits)
    app[FAULTS] = FaultPlan([parse_fault(s) for s in faults or []])
    app[FAULTS_ALLOWED] = allow_faults or bool(faults)
    app.router.add_post("/graphql", graphql)
    app.router.add_post("/files/{entity}/{project}/{run}/file_stream", file_stream)
    app.router.add_put("/storage/{entity}/{project}/{run}/{name:.+}", put_file)
    app.router.add_get("/storage/{entity}/{project}/{run}/{name:.+}", get_file)
    version = "/artifact-storage/{artifact:[0-9]{1,18}}"
    app.router.add_put(version + "/manifest", put_artifact_file)
    app.router.add_get(version + "/manifest", get_artifact_file)
    app.router.add_put(version + "/files/{name:.+}", put_artifact_file)
    app.router.add_get(version + "/files/{name:.+}", get_artifact_file)
    app.router.add_post("/sdk/{tail:.*}", telemetry)
    app.router.add_get("/api/artifacts/{entity}/{project}/{version}", api_artifact)
    app.router.add_get(
        "/api/artifacts/{entity}/{project}/{version}/files/{name:.+}", get_artifact_file
    )
    app.router.add_get("/api/runs", api_runs)
    app.router.add_get("/api/runs/{entity}/{project}/{run}", api_run)
    app.router.add_route("*", "/api/faults", api_faults)
    app.router.add_get("/api/like-wandb", api_like_wandb)
    pages.add_routes(app, STORE)
    app.on_response_prepare.append(security_headers)
    app.on_cleanup.append(_close_store)
    return app


async def _close_store(app: web.Application) -> None:
    app[STORE].close()


def write_port_file(port_file: Path, port: int) -> None:
    """Write `port` to `port_file` whole (a scratch file renamed over it). The scratch file
    is made anew, never through a link another user planted at its name in a shared
    directory (which would make a sink run as root overwrite the file it names): one
    found there is removed first, the link itself."""
    check_out_file(port_file, "--port-file")
    scratch = Path(f"{port_file}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        scratch.unlink(missing_ok=True)
        fd = os.open(scratch, flags, 0o600)
        with open(fd, "w") as out:
            out.write(str(port))
        scratch.replace(port_file)
    except OSError as exc:
        raise WbmergeError(
            f"--port-file {port_file}: cannot write {scratch} ({exc.strerror or exc})"
        ) from None


def serve(
    data_dir: str | Path,
    port: int = 8765,
    faults: list[str] | None = None,
    port_file: str | Path | None = None,
    allow_faults: bool = False,
    like: LikeWandb | None = None,
) -> None:
    """Run the sink on 127.0.0.1 until interrupted; port 0 picks a free port.

    Everything the sink writes is its owner's alone (umask 077); its start-up lines give
    the API key, as the settings for wandb and as a link for a browser."""
    os.umask(0o077)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)  # connections queue from now on, so announcing the port is safe
    bound = sock.getsockname()[1]
    app = make_app(data_dir, faults, allow_faults, like)
    if port_file:
        write_port_file(Path(port_file), bound)
    key = app[STORE].api_key.key
    print(
        f"wbmerge sink: http://127.0.0.1:{bound}  (pid {os.getpid()}; data: {data_dir})\n"
        f"  for wandb:   export WANDB_BASE_URL=http://127.0.0.1:{bound} WANDB_API_KEY={key}\n"
        f"  in a browser: http://api:{key}@127.0.0.1:{bound}/  (user api, the key as password)",
        flush=True,
    )
    if like is not None and like.describe():
        print(f"  like W&B: {like.describe()}", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None, handle_signals=True)
