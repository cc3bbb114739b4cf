"""Metric globs of a shared run: a rank's `define_metric("val/*", step_metric="epoch")`
bound to that rank's labelled keys, and to no other rank's.

wandb takes a glob only as a prefix with a trailing `*` (`define_metric` refuses any other
`*`: "glob suffixes only"), and wandb-core matches it by prefix: the `*` dropped, every key
that starts with the rest. A labelled glob is therefore right only when the label comes
before the key (`{label}/{key}`: `rank-0/val/*`) and no other rank's labelled keys can
start with the same text. Otherwise (the default `{key}/{label}`, where `val/*/rank-0` is
refused by wandb and matches nothing in wandb-core) the glob is written as what wandb-core
makes of it in the rank's own run: a definition by name for each key the rank logged that
the glob matches and that the rank did not define by name itself. Those keys are known
once every row is read, so the definitions follow the rows; the uploader puts every
definition into the run's config (`_wandb.m`) wherever it stands in the log.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Iterator

from ..analyse import PerRank
from ..log import pb


def label_prefixes(key_format: str, labels: Iterable[str]) -> dict[str, str] | None:
    """label -> the text its labelled keys start with, when a labelled key is that text
    followed by the key (the format ends with a plain `{key}`) and no label's text starts
    with another's; None when a labelled glob cannot select one rank's keys."""
    fields = list(string.Formatter().parse(key_format))
    literal, name, spec, conversion = fields[-1]
    if name != "key" or spec or conversion:
        return None
    prefixes = {label: key_format.format(key="", label=label) for label in labels}
    texts = sorted(prefixes.values())
    for text, following in zip(texts, texts[1:], strict=False):
        if following.startswith(text):  # (sorted: a prefix sorts right before its extensions)
            return None
    if any("*" in text for text in texts):
        return None
    return prefixes


def glob_definitions(
    globs: list[bytes],
    named: set[str],
    keys: Iterable[str],
    label: str,
    key_format: str,
    per_rank: PerRank,
    prefix: str | None,
) -> Iterator[bytes]:
    """The merged run's definitions for one rank's glob definitions `globs` (its records,
    in order): each glob labelled when `prefix` (the text the rank's labelled keys start
    with, from `label_prefixes`) is given, else one definition by name per key of `keys`
    (the rank's top-level keys) that a glob matches, not named by the rank (`named`: an
    explicit definition shadows globs in wandb-core) and kept per rank. A key several globs
    match takes the first glob defined, as every glob's definitions in order (wandb-core
    merges a redefinition into the one before). W&B's own keys (`_...`) are never bound."""
    records = [pb.Record.FromString(payload) for payload in globs]
    # (a `*` before the end: wandb never writes one, and would refuse it)
    records = [r for r in records if "*" not in r.metric.glob_name.removesuffix("*")]
    for record in records:
        _label_step(record.metric, label, key_format)
    if prefix is not None:
        for record in records:
            if not record.metric.glob_name.startswith("_"):
                record.metric.glob_name = prefix + record.metric.glob_name
            yield record.SerializeToString()
        return
    patterns = list(dict.fromkeys(record.metric.glob_name for record in records))
    for key in sorted(keys):
        if key.startswith("_") or key in named or not per_rank.keeps(key):
            continue
        chosen = next((p for p in patterns if key.startswith(p.removesuffix("*"))), None)
        if chosen is None:
            continue
        for record in records:
            if record.metric.glob_name == chosen:
                definition = pb.Record()
                definition.CopyFrom(record)
                definition.metric.glob_name = ""
                definition.metric.name = key_format.format(key=key, label=label)
                yield definition.SerializeToString()


def _label_step(metric: pb.MetricRecord, label: str, key_format: str) -> None:
    if metric.step_metric and not metric.step_metric.startswith("_"):
        metric.step_metric = key_format.format(key=metric.step_metric, label=label)
