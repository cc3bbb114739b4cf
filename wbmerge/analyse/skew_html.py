"""`wbmerge report --html`: the report as one page that needs nothing but itself.

For each job: its ranks and nodes; for each metric a chart with a line per rank (the
outlier ranks drawn thick, red and dashed, and named as outliers in the legend), for a
history metric a chart of the spread across ranks at each step, and the skew table. The
page has no script and loads nothing (inline CSS and SVG, a Content-Security-Policy that
allows nothing else), so it opens offline and every name in it is text, escaped.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from pathlib import Path

from .. import safepaths
from ..errors import WbmergeError
from .parquet import _run_directory_holding
from .skew import JobReport, MetricReport, RankPlace

OUTLIER_COLOR = "#d62728"
COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
MAX_POINTS = 2000  # a line of more values draws every n-th (its last kept)
POLICY = "default-src 'none'; style-src 'unsafe-inline'"
STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px} h3{font-size:13px;margin:0 0 4px 0}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:right;font-size:13px} th{background:#f4f4f4} td.name,th.name{text-align:left}
tr.outlier td{color:#d62728;font-weight:bold} .charts{display:flex;flex-wrap:wrap;gap:14px}
.chart{border:1px solid #ddd;padding:6px} .legend span{margin-right:10px;font-size:12px}
.warning{color:#a60} .flag{color:#d62728;font-weight:bold}
"""


def format_html(reports: Sequence[JobReport]) -> str:
    """The page of `reports` made with `series=True` (their values and places)."""
    body = "".join(_job(job) for job in reports) or "<p>no job found</p>"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{POLICY}\">"
        f"<title>wbmerge report</title><style>{STYLE}</style></head><body>{body}</body></html>"
    )


def write_html(reports: Sequence[JobReport], out: str | Path) -> Path:
    """Write the page to `out`, replacing a regular file there whole; never inside a run
    directory (sources are never written) nor through a link planted at its name."""
    out = Path(out)
    if out.is_dir():
        raise WbmergeError(f"--html {out} is a directory; give a file name such as report.html")
    safepaths.check_out_file(out, "--html")
    run_dir = _run_directory_holding(out, "--html")
    if run_dir is not None:
        raise WbmergeError(
            f"--html {out} is inside the run directory {run_dir}; write the report outside "
            "the runs (sources are never written)"
        )
    scratch = out.with_name(f".{out.name}.partial")
    page = format_html(reports).encode()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch.unlink(missing_ok=True)
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as file:
            file.write(page)
        os.replace(scratch, out)
    except OSError as exc:
        raise WbmergeError(f"--html: cannot write {out} ({exc.strerror or exc})") from None
    finally:
        scratch.unlink(missing_ok=True)
    return out


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.6g}"


def _job(job: JobReport) -> str:
    nodes = sorted({place.worker for place in job.places})
    parts = [
        f"<section class='job' data-job='{_e(job.job_id)}'>",
        f"<h1>job {_e(job.job_id)}: {len(job.places)} of {job.world_size} ranks on "
        f"{len(nodes)} node{'s' * (len(nodes) != 1)}</h1>",
    ]
    parts += [f"<p class='warning'>{_e(line)}</p>" for line in [*job.warnings, *job.damage]]
    for metric in job.metrics:
        for rank in metric.outliers:
            parts.append(
                f"<p class='flag'>outlier in {_e(metric.key)}: {_e(_rank_name(metric, rank))}</p>"
            )
    parts.append(_places(job.places))
    parts += [_metric(metric) for metric in job.metrics]
    parts.append("</section>")
    return "".join(parts)


def _places(places: list[RankPlace]) -> str:
    rows = "".join(
        f"<tr data-rank='{p.rank}'><td>{p.worker}</td><td class='name'>{_e(p.host or '-')}</td>"
        f"<td>{p.rank}</td><td class='name'>{_e(p.label)}</td><td>{p.local_rank}</td>"
        f"<td>{p.restarts}</td></tr>"
        for p in sorted(places, key=lambda p: (p.worker, p.local_rank, p.rank))
    )
    head = (
        "<tr><th>node</th><th class='name'>host</th><th>rank</th><th class='name'>label</th>"
        "<th>local rank</th><th>restarts</th></tr>"
    )
    return f"<h2>ranks and nodes</h2><table class='places'>{head}{rows}</table>"


def _rank_name(metric: MetricReport, rank: int) -> str:
    label = next((s.label for s in metric.ranks if s.rank == rank), "")
    return f"rank {rank} ({label})" if label and label != f"rank-{rank}" else f"rank {rank}"


def _metric(metric: MetricReport) -> str:
    head = f"{metric.key} ({metric.kind})"
    facts = []
    if metric.spread_mean is not None:
        where = f" over {metric.aligned_steps} aligned steps" if metric.aligned_steps else ""
        facts.append(f"spread {metric.spread_mean:.1%} mean, {metric.spread_max:.1%} max{where}")
    if metric.slowest is not None and metric.fastest is not None:
        facts.append(
            f"slowest {_rank_name(metric, metric.slowest)}, "
            f"fastest {_rank_name(metric, metric.fastest)}"
        )
    charts = [_values_chart(metric)]
    if metric.spread_series is not None and metric.spread_series[0]:
        steps, spread = metric.spread_series
        line = {"spread": list(zip(steps, spread, strict=True))}
        charts.append(_chart("spread across ranks by step", line, {}, "step"))
    return (
        f"<section class='metric' data-key='{_e(metric.key)}' data-kind='{_e(metric.kind)}'>"
        f"<h2>{_e(head)}</h2><p>{_e('; '.join(facts))}</p>"
        f"<div class='charts'>{''.join(charts)}</div>{_table(metric)}</section>"
    )


def _values_chart(metric: MetricReport) -> str:
    series = metric.series or {}
    labels = {stats.rank: stats.label for stats in metric.ranks}
    if metric.kind == "history":
        lines = {rank: list(zip(*series[rank], strict=True)) for rank in series}
        axis = "step"
    else:  # system metrics: seconds since the job's first sample
        starts = [order[0] for order, _ in series.values() if order]
        origin = min(starts) if starts else 0.0
        lines = {
            rank: [(at - origin, value) for at, value in zip(*series[rank], strict=True)]
            for rank in series
        }
        axis = "seconds"
    named = {labels.get(rank, f"rank-{rank}"): line for rank, line in lines.items()}
    flagged = {labels.get(rank, f"rank-{rank}"): rank for rank in metric.outliers}
    ranks = {labels.get(rank, f"rank-{rank}"): rank for rank in lines}
    return _chart("values by rank", named, flagged, axis, ranks)


def _chart(
    title: str,
    lines: dict[str, list[tuple[float, float]]],
    flagged: dict[str, int],
    axis: str,
    ranks: dict[str, int] | None = None,
    w: int = 560,
    h: int = 220,
) -> str:
    points = [
        (x, y) for line in lines.values() for x, y in line if math.isfinite(x) and math.isfinite(y)
    ]
    if not points:
        return f"<div class='chart'><h3>{_e(title)}</h3><p>(no finite values)</p></div>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1 = x1 if x1 > x0 else x0 + 1
    y0, y1 = (y0, y1) if y1 > y0 else (y0 - 1, y1 + 1)
    pad = 56

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - pad - 10)

    def sy(y: float) -> float:
        return h - 22 - (y - y0) / (y1 - y0) * (h - 34)

    svg = [
        f"<svg width='{w}' height='{h}' xmlns='http://www.w3.org/2000/svg' role='img'>",
        f"<rect x='{pad}' y='8' width='{w - pad - 10}' height='{h - 30}' fill='#fafafa' "
        "stroke='#ccc'/>",
        f"<text x='2' y='16' font-size='10'>{_number(y1)}</text>",
        f"<text x='2' y='{h - 22}' font-size='10'>{_number(y0)}</text>",
        f"<text x='{pad}' y='{h - 6}' font-size='10'>{_number(x0)}</text>",
        f"<text x='{w // 2 - 20}' y='{h - 6}' font-size='10'>{_e(axis)}</text>",
        f"<text x='{w - 70}' y='{h - 6}' font-size='10'>{_number(x1)}</text>",
    ]
    legend = []
    plain = 0
    for label in sorted(lines, key=_natural):
        line = [(x, y) for x, y in lines[label] if math.isfinite(x) and math.isfinite(y)]
        outlier = label in flagged
        color = OUTLIER_COLOR if outlier else COLORS[plain % len(COLORS)]
        plain += not outlier
        stride = max(1, math.ceil(len(line) / MAX_POINTS))
        drawn = line[::stride] if line[-1:] == line[::stride][-1:] else [*line[::stride], line[-1]]
        rank = "" if ranks is None else f" data-rank='{ranks[label]}'"
        marks = f" class='outlier'{rank}" if outlier else f" class='rank'{rank}"
        width, dash = ("3", " stroke-dasharray='6 3'") if outlier else ("1.5", "")
        if len(drawn) == 1:
            x, y = drawn[0]
            svg.append(f"<circle{marks} cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='{color}'/>")
        elif drawn:
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in drawn)
            svg.append(
                f"<polyline{marks} data-label='{_e(label)}' fill='none' stroke='{color}' "
                f"stroke-width='{width}'{dash} points='{coords}'><title>{_e(label)}"
                f"{' (outlier)' if outlier else ''}</title></polyline>"
            )
        if ranks is not None:
            legend.append(
                f"<span style='color:{color}'>&#9632; {_e(label)}"
                f"{' &#9664; outlier' if outlier else ''}</span>"
            )
    svg.append("</svg>")
    return (
        f"<div class='chart'><h3>{_e(title)}</h3>{''.join(svg)}"
        f"<div class='legend'>{''.join(legend)}</div></div>"
    )


def _table(metric: MetricReport) -> str:
    head = (
        "<tr><th class='name'>rank</th><th>values</th><th>mean</th><th>last</th><th>min</th>"
        "<th>max</th><th class='name'></th></tr>"
    )
    rows = []
    for stats in metric.ranks:
        notes = []
        if stats.rank in metric.outliers:
            notes.append("outlier")
        if stats.rank == metric.slowest:
            notes.append("slowest")
        marked = " class='outlier'" if stats.rank in metric.outliers else ""
        cells = "".join(
            f"<td>{_number(v)}</td>" for v in (stats.mean, stats.last, stats.min, stats.max)
        )
        rows.append(
            f"<tr{marked} data-rank='{stats.rank}'><td class='name'>{_e(stats.label)}</td>"
            f"<td>{stats.count}</td>{cells}<td class='name'>{_e(', '.join(notes))}</td></tr>"
        )
    return f"<table class='skew'>{head}{''.join(rows)}</table>"


def _natural(label: str) -> list:
    parts = []
    for piece in label.replace("-", " ").replace("_", " ").split():
        parts.append((0, int(piece), "") if piece.isdigit() else (1, 0, piece))
    return parts
