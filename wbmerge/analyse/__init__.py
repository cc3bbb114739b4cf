"""Looking at a job's runs without uploading them: columns, Parquet export, per-rank report.

`columns` reads one rank's values as columns, `parquet` exports every value of a job to
one Parquet file, `skew` (with `skew_text`, its text, and `skew_html`, its page) answers which rank is slow and by how
much, `rankstats` computes statistics across ranks, and `spread` is the one definition of
a metric's spread across ranks, which the shared merge's `--skew-metrics` uses too.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .rankstats import (
    STATS,
    AcrossRanks,
    PerRank,
    across_ranks,
    bound_notice,
    dense_ids,
    last_of_each,
    stat_key,
)
from .spread import spread_of

if TYPE_CHECKING:
    from .columns import per_value
    from .parquet import ExportResult, export
    from .skew import JobReport, outliers, report
    from .skew_html import format_html, write_html
    from .skew_text import format_report

# Imported on first use: these modules need pyarrow (85 ms of a start), which a
# pass-through sync and the command line's start do without.
_ON_FIRST_USE = {
    "per_value": "columns",
    "ExportResult": "parquet",
    "export": "parquet",
    "JobReport": "skew",
    "outliers": "skew",
    "report": "skew",
    "format_report": "skew_text",
    "format_html": "skew_html",
    "write_html": "skew_html",
}


def __getattr__(name: str) -> object:
    """A name of `_ON_FIRST_USE`, imported from its module when first asked for."""
    if name in _ON_FIRST_USE:
        return getattr(import_module(f".{_ON_FIRST_USE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AcrossRanks",
    "ExportResult",
    "JobReport",
    "PerRank",
    "STATS",
    "across_ranks",
    "bound_notice",
    "dense_ids",
    "export",
    "format_html",
    "format_report",
    "last_of_each",
    "outliers",
    "per_value",
    "report",
    "spread_of",
    "stat_key",
    "write_html",
]
