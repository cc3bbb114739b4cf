"""What the user chose for a merge, the same for every target of a job, and the check of
the one option a user spells as a format, `--key-format`."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path

from ..analyse import PerRank
from ..errors import WbmergeError

DEFAULT_KEY_FORMAT = "{key}/{label}"

# A field's format spec in --key-format: an alignment (with its fill) and a width of at
# most 3 digits. Any other spec is refused before it is used: a width of 99999999999 made
# every key a string of that many characters (MemoryError). A precision is read, to be
# refused by name: it cuts a key or label longer than it short.
_KEY_SPEC = re.compile(r"(.?[<>^])?(?P<width>\d{0,3})(\.(?P<precision>\d{1,3}))?")
# A key and a label a format is tried on, to show what a precision cuts.
_SAMPLES = {"key": "train/loss", "label": "rank-3"}


def check_key_format(key_format: str) -> str:
    """`key_format` when it is a format of the fields {key} and {label} only (each with at
    most a small format spec, see `_KEY_SPEC`, and no conversion) that keeps both whole;
    else WbmergeError saying why."""
    try:
        fields = [
            (name, conversion, spec)
            for _, name, spec, conversion in string.Formatter().parse(key_format)
            if name is not None
        ]
    except ValueError as exc:
        raise WbmergeError(f"bad --key-format {key_format!r}: {exc}") from None
    bad = f"bad --key-format {key_format!r}"
    for name, conversion, spec in fields:
        if name not in ("key", "label"):
            raise WbmergeError(f"{bad}: no field {{{name}}} (it may use {{key}} and {{label}})")
        if conversion is not None:
            raise WbmergeError(
                f"{bad}: {{{name}!{conversion}}} converts the {name}; a field may have only "
                "an alignment and a width of up to 3 digits (e.g. {label:>8})"
            )
        if not _KEY_SPEC.fullmatch(spec or ""):
            raise WbmergeError(
                f"{bad}: {{{name}}} may have at most an alignment and a width of up to 3 "
                "digits (e.g. {label:>8})"
            )
        sample = _SAMPLES[name]
        try:
            formatted = format(sample, spec)
        except ValueError as exc:
            raise WbmergeError(f"{bad}: {exc}") from None
        which = "the keys of two ranks" if name == "label" else "two keys"
        if sample not in formatted:
            cut = formatted.strip()
            raise WbmergeError(
                f"{bad}: {{{name}:{spec}}} cuts the {name} short ({sample!r} becomes "
                f"{cut!r}), so {which} could be one"
            )
        if _KEY_SPEC.fullmatch(spec or "")["precision"] is not None:
            # (one that keeps this sample whole cuts a longer one: `.6` makes rank-10 rank-1)
            raise WbmergeError(
                f"{bad}: {{{name}:{spec}}} has a precision, which cuts any longer {name} "
                f"short, so {which} could be one; give an alignment and a width only "
                "(e.g. {label:>8})"
            )
    try:
        sample = key_format.format(**_SAMPLES)
    except (IndexError, KeyError, ValueError) as exc:
        raise WbmergeError(f"{bad}: {exc}") from None
    if _SAMPLES["key"] not in sample or _SAMPLES["label"] not in sample:
        raise WbmergeError(f"--key-format {key_format!r} must contain {{key}} and {{label}}")
    return key_format


@dataclass
class MergeOptions:
    project: str | None = None
    entity: str | None = None
    key_format: str = DEFAULT_KEY_FORMAT
    run_mode: str = "auto"
    rank_scope: str = "global"
    job_id: str = ""
    skew_metrics: bool = False
    rank_stats: bool = False  # shared mode: per-step statistics across ranks (`rowstats`)
    per_rank: PerRank = field(default_factory=PerRank)  # shared mode: keys labelled per rank
    # Where saved files (`wandb.save` links) may also be read, beside the directory each
    # rank ran in (`savedfiles`); it changes where files are found, never what is merged.
    files_from: tuple[Path, ...] = ()
    # A record of a kind this wbmerge does not know: "refuse" (one line) or "copy" it as it is.
    unknown_records: str = "refuse"
    # Whether the run is staged while its ranks still write (a follow's round before the
    # last): a shared run then leaves the other ranks' config for the last round, since
    # what differs from the primary's may not differ once the primary sets it (`rankconfig`).
    live: bool = False

    @property
    def copy_unknown(self) -> bool:
        return self.unknown_records == "copy"
