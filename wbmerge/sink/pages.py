"""Pages for people: projects, groups and runs, with one server-rendered SVG chart per metric.

Run URLs are W&B's own (`/{entity}/{project}/runs/{id}`, `/{entity}/{project}/groups/{g}`),
so the links that `wbmerge sync` prints open here when the sink is the target.
Keys labelled per rank (`{key}/{label}`, system metrics `{name}/l:{label}`) are drawn as one
chart with a line per label.
"""

from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from typing import Any
from urllib.parse import quote

from aiohttp import web

_RANK_SUFFIX = re.compile(r"^(?P<key>.+)/(?P<label>rank-\d+|worker-\d+-rank-\d+)$")
_SYSTEM_SUFFIX = re.compile(r"^(?P<key>.+)/l:(?P<label>.+)$")
_HIDDEN = ("_step", "_runtime", "_timestamp", "_wandb")
COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
MAX_POINTS = 800

STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px} a{color:#1f5fbf}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;font-size:13px;vertical-align:top} th{background:#f4f4f4}
.charts{display:flex;flex-wrap:wrap;gap:14px} .chart{border:1px solid #ddd;padding:6px}
.chart h3{font-size:13px;margin:0 0 4px 0} .legend span{margin-right:10px;font-size:12px}
pre{background:#f7f7f7;padding:8px;max-height:320px;overflow:auto;font-size:12px}
.state-finished{color:#2a7}.state-failed{color:#c33}.state-running{color:#c80}
"""


def add_routes(app: web.Application, store_key: web.AppKey) -> None:
    async def index(request: web.Request) -> web.Response:
        return _page("wbmerge sink", index_html(request.app[store_key].runs()))

    async def run_page(request: web.Request) -> web.Response:
        m = request.match_info
        run = request.app[store_key].run(m["entity"], m["project"], m["run"], full=True)
        if run is None:
            raise web.HTTPNotFound(text="no such run")
        return _page(f"{run['id']} - wbmerge sink", run_html(run))

    async def group_page(request: web.Request) -> web.Response:
        m = request.match_info
        runs = [
            r
            for r in request.app[store_key].runs(m["entity"], m["project"])
            if r["group"] == m["group"]
        ]
        if not runs:
            raise web.HTTPNotFound(text="no such group")
        body = f"<h1>group {_e(m['group'])}</h1>" + _run_table(runs)
        return _page(f"group {m['group']} - wbmerge sink", body)

    app.router.add_get("/", index)
    app.router.add_get("/{entity}/{project}/runs/{run}", run_page)
    app.router.add_get("/{entity}/{project}/groups/{group}", group_page)


def _page(title: str, body: str) -> web.Response:
    text = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>"
    )
    return web.Response(text=text, content_type="text/html")


def _e(value: Any) -> str:
    """A value as HTML text or attribute (in either quotes): every value a page shows
    came from a request, so none is written unescaped."""
    return html.escape(str(value), quote=True)


def _href(*parts: str) -> str:
    """A link to one of the sink's pages: each part percent-quoted, then escaped."""
    return _e("/" + "/".join(quote(part, safe="") for part in parts))


def index_html(runs: list[dict]) -> str:
    """The body of the index page: runs by project, their groups, a table of the runs."""
    if not runs:
        return "<h1>wbmerge sink</h1><p>No runs yet. Upload with <code>wbmerge sync</code>.</p>"
    by_project: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for run in runs:
        by_project[(run["entity"], run["project"])].append(run)
    parts = ["<h1>wbmerge sink</h1>"]
    for (entity, project), members in by_project.items():
        parts.append(f"<h2>{_e(entity)}/{_e(project)}</h2>")
        groups = sorted({r["group"] for r in members if r["group"]})
        if groups:
            links = ", ".join(
                f"<a href='{_href(entity, project, 'groups', g)}'>{_e(g)}</a>" for g in groups
            )
            parts.append(f"<p>groups: {links}</p>")
        parts.append(_run_table(members))
    return "".join(parts)


def _run_table(runs: list[dict]) -> str:
    rows = ["<tr><th>run</th><th>group</th><th>job type</th><th>state</th><th>exit code</th></tr>"]
    for r in runs:
        href = _href(r["entity"], r["project"], "runs", r["id"])
        rows.append(
            f"<tr><td><a href='{href}'>{_e(r['display_name'] or r['id'])}</a> ({_e(r['id'])})</td>"
            f"<td>{_e(r['group'] or '')}</td><td>{_e(r['job_type'] or '')}</td>"
            f"<td class='state-{_e(r['state'])}'>{_e(r['state'])}</td>"
            f"<td>{_e('' if r['exit_code'] is None else r['exit_code'])}</td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


def run_html(run: dict) -> str:
    """The body of a run's page (`Store.run(..., full=True)`): facts, charts, tables, files."""
    facts = [f"state <b class='state-{_e(run['state'])}'>{_e(run['state'])}</b>"]
    if run["exit_code"] is not None:
        facts.append(f"exit code {_e(run['exit_code'])}")
    if run["group"]:
        facts.append(f"group {_e(run['group'])}")
    if run["job_type"]:
        facts.append(f"job type {_e(run['job_type'])}")
    parts = [
        f"<h1>{_e(run['display_name'] or run['id'])} <small>({_e(run['entity'])}/"
        f"{_e(run['project'])}/{_e(run['id'])})</small></h1>",
        f"<p>{', '.join(facts)}</p>",
    ]
    parts.append("<h2>Charts</h2>" + _charts(run["history"], "_step", _RANK_SUFFIX))
    parts.append(
        "<h2>System metrics</h2>" + _charts(run["system_metrics"], "_timestamp", _SYSTEM_SUFFIX)
    )
    parts.append("<h2>Summary</h2>" + _kv_table(run["summary"]))
    parts.append("<h2>Config</h2>" + _kv_table(run["config"]))
    console = "\n".join(run["console"][-400:])
    parts.append(f"<h2>Console ({len(run['console'])} lines)</h2><pre>{_e(console)}</pre>")
    for role in ("logged", "used"):
        if run.get("artifacts", {}).get(role):
            parts.append(f"<h2>Artifacts {role}</h2>" + _artifact_table(run["artifacts"][role]))
    if run["files"]:
        folder = "/".join(quote(run[k], safe="") for k in ("entity", "project", "id"))
        items = "".join(
            f"<li><a href='/storage/{_e(folder)}/{_e(quote(f))}'>{_e(f)}</a></li>"
            for f in run["files"]
        )
        note = "<p>Stored files open as downloads.</p>"
        parts.append(f"<h2>Files</h2>{note}<ul>{items}</ul>")
    return "".join(parts)


def _artifact_table(versions: list[dict]) -> str:
    """A table of artifact versions: name:version, type, digest, state, files."""
    rows = [
        "<tr><th>artifact</th><th>type</th><th>digest</th><th>state</th><th>aliases</th>"
        "<th>files</th></tr>"
    ]
    for v in versions:
        files = "".join(
            f"<li>{_e(f['name'])} ({_e('not arrived' if f['size'] is None else f['size'])}"
            f"{'' if f['size'] is None else ' bytes'})</li>"
            for f in v.get("files", [])
        )
        rows.append(
            f"<tr><td>{_e(v['name'])}:{_e(v['version'] or 'pending')}</td><td>{_e(v['type'])}</td>"
            f"<td><code>{_e(v['digest'])}</code></td><td>{_e(v['state'])}</td>"
            f"<td>{_e(', '.join(v['aliases']))}</td>"
            f"<td>{_e(v['file_count'])}<ul>{files}</ul></td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


def _kv_table(values: dict) -> str:
    rows = [
        f"<tr><th>{_e(k)}</th><td>{_e(_short(v))}</td></tr>"
        for k, v in sorted(values.items())
        if not k.startswith("_wandb")
    ]
    return "<table>" + "".join(rows) + "</table>" if rows else "<p>(none)</p>"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) < 200 else text[:197] + "..."


def _charts(rows: list[dict], x_key: str, suffix: re.Pattern) -> str:
    """One chart per metric; labelled keys become one line per label in their base chart."""
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    origin = None
    for row in rows:
        x = row.get(x_key)
        if not isinstance(x, int | float):
            continue
        if x_key == "_timestamp":  # seconds since the first sample, not epoch seconds
            origin = x if origin is None else origin
            x -= origin
        for key, value in row.items():
            if key.startswith(_HIDDEN) or isinstance(value, bool):
                continue
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            match = suffix.match(key)
            base, label = (match["key"], match["label"]) if match else (key, "")
            series[base][label].append((float(x), float(value)))
    if not series:
        return "<p>(no numeric metrics)</p>"
    charts = [_svg_chart(name, lines) for name, lines in sorted(series.items())]
    return "<div class='charts'>" + "".join(charts) + "</div>"


def _svg_chart(
    title: str, lines: dict[str, list[tuple[float, float]]], w: int = 420, h: int = 180
) -> str:
    points = [p for line in lines.values() for p in line]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    pad = 36

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - pad - 8)

    def sy(y: float) -> float:
        return h - 18 - (y - y0) / (y1 - y0) * (h - 30)

    svg = [
        f"<svg width='{w}' height='{h}' xmlns='http://www.w3.org/2000/svg' role='img'>",
        f"<rect x='{pad}' y='8' width='{w - pad - 8}' height='{h - 26}' fill='#fafafa' "
        "stroke='#ccc'/>",
        f"<text x='2' y='16' font-size='10'>{_num(y1)}</text>",
        f"<text x='2' y='{h - 18}' font-size='10'>{_num(y0)}</text>",
        f"<text x='{pad}' y='{h - 4}' font-size='10'>{_num(x0)}</text>",
        f"<text x='{w - 60}' y='{h - 4}' font-size='10'>{_num(x1)}</text>",
    ]
    legend = []
    for i, (label, line) in enumerate(sorted(lines.items(), key=lambda kv: _natural(kv[0]))):
        color = COLORS[i % len(COLORS)]
        line = sorted(line)
        step = max(1, len(line) // MAX_POINTS)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line[::step])
        if len(line) == 1:
            x, y = line[0]
            svg.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='{color}'/>")
        else:
            svg.append(
                f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{coords}'/>"
            )
        if label:
            legend.append(f"<span style='color:{color}'>&#9632; {_e(label)}</span>")
    svg.append("</svg>")
    return (
        f"<div class='chart'><h3>{_e(title)}</h3>{''.join(svg)}"
        f"<div class='legend'>{''.join(legend)}</div></div>"
    )


def _num(v: float) -> str:
    return f"{v:.4g}"


def _natural(label: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]
