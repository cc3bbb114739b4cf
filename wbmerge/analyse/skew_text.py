"""`wbmerge report` for people: a table per metric, outliers highlighted on a terminal."""

from __future__ import annotations

import math

import click

from .skew import JobReport, MetricReport


def format_report(reports: list[JobReport], color: bool = False) -> str:
    lines = []
    for job in reports:
        count = len(job.metrics)
        lines.append(
            f"job {job.job_id}: {job.world_size} ranks, {count} metric{'s' * (count != 1)}"
        )
        flagged = [m for m in job.metrics if m.outliers]
        for metric in flagged:
            names = ", ".join(_rank_name(metric, r) for r in metric.outliers)
            lines.append(_style(f"  outlier in {metric.key}: {names}", color, fg="red", bold=True))
        lines.append("")
        for metric in job.metrics:
            lines.extend(_metric_lines(metric, color))
            lines.append("")
    return "\n".join(lines)


def _metric_lines(metric: MetricReport, color: bool) -> list[str]:
    head = f"{metric.key} ({metric.kind})"
    if metric.spread_mean is not None:
        where = f" over {metric.aligned_steps} aligned steps" if metric.aligned_steps else ""
        head += f"  spread {metric.spread_mean:.1%} mean, {metric.spread_max:.1%} max{where}"
    if metric.slowest is not None:
        head += f"  slowest {_rank_name(metric, metric.slowest)}"
        head += f", fastest {_rank_name(metric, metric.fastest)}"
    lines = [head, f"  {'rank':<16}{'mean':>14}{'last':>14}{'min':>14}{'max':>14}"]
    for stats in metric.ranks:
        row = f"  {stats.label:<16}" + "".join(
            f"{_number(v):>14}" for v in (stats.mean, stats.last, stats.min, stats.max)
        )
        if stats.rank in metric.outliers:
            row = _style(row + "  <- outlier", color, fg="red", bold=True)
        lines.append(row)
    if metric.across_ranks:
        lines.append(_across_line(metric))
    return lines


def _across_line(metric: MetricReport) -> str:
    stats = metric.across_ranks or {}
    return (
        f"  across {stats['count']} rank{'s' if stats['count'] != 1 else ''} "
        f"at step {stats['step']}: "
        f"min {_number(stats['min'])} ({_rank_name(metric, stats['min_rank'])}), "
        f"median {_number(stats['median'])}, "
        f"max {_number(stats['max'])} ({_rank_name(metric, stats['max_rank'])}), "
        f"mean {_number(stats['mean'])}"
    )


def _rank_name(metric: MetricReport, rank: int) -> str:
    label = next((s.label for s in metric.ranks if s.rank == rank), "")
    return f"rank {rank} ({label})" if label and label != f"rank-{rank}" else f"rank {rank}"


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.6g}"


def _style(text: str, color: bool, **style: object) -> str:
    return click.style(text, **style) if color else text
