"""What a follow says: a line per round, and why it ended when ranks never finished."""

from __future__ import annotations

from .rounds import RoundReport, TargetRound


def round_lines(report: RoundReport) -> list[str]:
    """The round's line (rows added per run), then the merge's warnings of the runs sent
    with their final state, and one line per run that failed."""
    parts = [_target_part(t) for t in report.targets]
    if report.waiting:
        parts.append(f"waiting for {len(report.waiting)}: {'; '.join(report.waiting)}")
    if not parts:
        parts.append("no runs yet")
    lines = [f"round {report.number}: {', '.join(parts)}", *report.warnings]
    for target in report.targets:
        if target.status == "failed":
            lines.append(
                f"round {report.number}: run {target.run_id} not complete on the server "
                f"({'; '.join(target.problems) or 'unknown'}); the next round tries again"
            )
    return lines


def _target_part(target: TargetRound) -> str:
    if target.status == "failed":
        return f"{target.run_id} failed ({target.rows} rows)"
    if target.final:
        state = "finished" if not target.exit_code else f"failed, exit {target.exit_code}"
    else:
        state = "running"
    if target.status == "unchanged":
        return f"{target.run_id} unchanged ({target.rows} rows, {state})"
    return f"{target.run_id} +{target.added} rows ({target.rows}, {state})"


def idle_warning(idle_timeout: float, unfinished: list[str]) -> str:
    """Why a follow ends before every rank finished, naming the ranks."""
    ranks = "; ".join(unfinished) or "none"
    return (
        f"no new records for {idle_timeout:.0f} s; ending the follow with a last sync. "
        f"Never finished: {ranks}"
    )
