"""The sink's HTTP server (aiohttp, bound to 127.0.0.1): upload API, read API, pages, faults."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

from aiohttp import web

from . import pages, protocol
from .faults import FaultPlan, parse_fault
from .store import Store

STORE = web.AppKey("store", Store)
FAULTS = web.AppKey("faults", FaultPlan)


def _kind(request: web.Request, body: bytes) -> str:
    path = request.path
    if path == "/graphql":
        try:
            payload = protocol.decode_body(body, request.headers.get("Content-Encoding"))
            return f"graphql:{protocol.operation_name(payload)}"
        except (ValueError, OSError):
            return "graphql:?"
    if path.endswith("/file_stream"):
        return "file_stream"
    if path.startswith("/storage/"):
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
    return await handler(request)


async def graphql(request: web.Request) -> web.Response:
    try:
        protocol.check_auth(request.headers.get("Authorization"))
        payload = protocol.decode_body(
            await request.read(), request.headers.get("Content-Encoding")
        )
        answer = protocol.graphql(request.app[STORE], payload, _base_url(request))
    except protocol.ProtocolError as exc:
        return web.json_response({"errors": [{"message": str(exc)}]}, status=exc.status)
    except (ValueError, OSError) as exc:
        return web.json_response({"errors": [{"message": f"bad request: {exc}"}]}, status=400)
    return web.json_response(answer)


async def file_stream(request: web.Request) -> web.Response:
    m = request.match_info
    try:
        protocol.check_auth(request.headers.get("Authorization"))
        body = protocol.decode_body(await request.read(), request.headers.get("Content-Encoding"))
    except protocol.ProtocolError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    except (ValueError, OSError) as exc:
        return web.json_response({"error": f"bad request: {exc}"}, status=400)
    answer = protocol.file_stream(request.app[STORE], m["entity"], m["project"], m["run"], body)
    return web.json_response(answer)


async def put_file(request: web.Request) -> web.Response:
    m = request.match_info
    try:
        request.app[STORE].save_file(
            m["entity"], m["project"], m["run"], m["name"], await request.read()
        )
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.Response(status=200)


async def get_file(request: web.Request) -> web.StreamResponse:
    m = request.match_info
    try:
        path = request.app[STORE].file_path(m["entity"], m["project"], m["run"], m["name"])
    except ValueError:
        raise web.HTTPNotFound() from None
    if not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path)


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


async def api_faults(request: web.Request) -> web.Response:
    plan = request.app[FAULTS]
    if request.method == "POST":
        specs = (await request.json()).get("faults", [])
        try:
            plan.replace([parse_fault(s) for s in specs])
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(plan.summary())


def _base_url(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def make_app(data_dir: str | Path, faults: list[str] | None = None) -> web.Application:
    app = web.Application(middlewares=[fault_injection], client_max_size=1 << 30)
    app[STORE] = Store(data_dir)
    app[FAULTS] = FaultPlan([parse_fault(s) for s in faults or []])
    app.router.add_post("/graphql", graphql)
    app.router.add_post("/files/{entity}/{project}/{run}/file_stream", file_stream)
    app.router.add_put("/storage/{entity}/{project}/{run}/{name:.+}", put_file)
    app.router.add_get("/storage/{entity}/{project}/{run}/{name:.+}", get_file)
    app.router.add_post("/sdk/{tail:.*}", telemetry)
    app.router.add_get("/api/runs", api_runs)
    app.router.add_get("/api/runs/{entity}/{project}/{run}", api_run)
    app.router.add_route("*", "/api/faults", api_faults)
    pages.add_routes(app, STORE)
    app.on_cleanup.append(_close_store)
    return app


async def _close_store(app: web.Application) -> None:
    app[STORE].close()


def serve(
    data_dir: str | Path,
    port: int = 8765,
    faults: list[str] | None = None,
    port_file: str | Path | None = None,
) -> None:
    """Run the sink on 127.0.0.1 until interrupted; port 0 picks a free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)  # connections queue from now on, so announcing the port is safe
    bound = sock.getsockname()[1]
    app = make_app(data_dir, faults)
    if port_file:
        tmp = Path(str(port_file) + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)
    print(f"wbmerge sink: http://127.0.0.1:{bound}  (data: {data_dir})", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None, handle_signals=True)
