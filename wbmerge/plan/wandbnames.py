"""W&B's rules for the names a run is filed under: one place, read by the planner and the sink.

`wbmerge sync` checks a run id, project and entity before it uploads anything, and the sink
checks the same names when a request brings them. Both read the rules here, so a name one
accepts the other accepts too (they disagreed once: the planner refused `%` in a run id that
the sink took, and took a `\\` the sink refused).

The rules are wandb's own (its settings refuse a project name holding any of `/\\#?%:` or
longer than 128 characters, and a run id that is empty, starts or ends with whitespace, or
holds any of `:;,#?/'`), with two additions that W&B's pages and paths need:

- `%` in a run id: wandb-core 0.31 puts a run id in its file_stream URL as it is, so `exp%1`
  reads as a broken escape there (a server answers 405 and `wandb sync` retries until stopped).
- `\\` in a run id: it is a path separator on other systems, and every run id becomes a
  folder name somewhere (in the sink, in exports); for the same reason `.`, `..` and
  control characters are no run id.
"""

from __future__ import annotations

RUN_ID_RESERVED = ":;,#?/'%\\"
PROJECT_RESERVED = "/\\#?%:"  # also held for entities: both are parts of every run's URL
NAME_MAX_CHARS = 128  # wandb's limit for project names, used for entities too
# Every name becomes a folder's name somewhere (in the sink, in exports): what Linux file
# systems hold in one path component, as UTF-8.
NAME_MAX_BYTES = 255


def run_id_problem(run_id: str) -> str | None:
    """Why W&B refuses `run_id` as a run id, or None when it accepts it."""
    if not run_id or run_id != run_id.strip():
        return "empty or surrounded by whitespace"
    reserved = sorted(set(run_id) & set(RUN_ID_RESERVED))
    if reserved:
        return f"W&B run ids cannot contain {' '.join(reserved)}"
    if run_id in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in run_id):
        return "not a name a URL path can hold"
    if len(run_id.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        return f"longer than {NAME_MAX_BYTES} bytes"
    return None


def name_problem(kind: str, name: str) -> str | None:
    """Why W&B refuses `name` as a project or entity name (`kind`), or None."""
    reserved = sorted(set(name) & set(PROJECT_RESERVED))
    if reserved:
        return f"W&B refuses {' '.join(reserved)} in {kind} names"
    if name in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "not a name a URL path can hold"
    if len(name) > NAME_MAX_CHARS:
        return f"longer than W&B's {NAME_MAX_CHARS} characters"
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        return f"longer than {NAME_MAX_BYTES} bytes"
    return None
