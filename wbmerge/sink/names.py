"""Which entity, project, run and file names a request may carry, checked before any is used.

Every name a request brings (in its path, in GraphQL variables, in a `.wandb` file that
`wandb sync` uploads) becomes part of a path under the sink's data directory, so each must
be one safe path component, or, for a file, a relative path of safe components. The rules
are W&B's own, read from `wbmerge.plan` so that the sink and `wbmerge sync` accept the same
names, tightened so that no name can climb out of its folder: `.` and `..`, backslashes,
NUL and other control characters are refused everywhere.
"""

from __future__ import annotations

from ..plan import NAME_MAX_BYTES, NAME_MAX_CHARS, PROJECT_RESERVED, RUN_ID_RESERVED

DEFAULT_ENTITY = "local"  # the entity of requests that name none
COMPONENT_MAX_BYTES = NAME_MAX_BYTES
FILE_NAME_MAX_BYTES = 1024

_PROJECT_RESERVED = set(PROJECT_RESERVED)
_RUN_ID_RESERVED = set(RUN_ID_RESERVED)


class BadName(ValueError):
    """A name that is not a safe path component (or, for files, a safe relative path)."""


def _check_component(kind: str, value: object, reserved: set[str], max_bytes: int) -> str:
    if not isinstance(value, str) or not value:
        raise BadName(f"{kind} must be a non-empty string")
    if value in (".", ".."):
        raise BadName(f"{kind} {value!r} is not allowed")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadName(f"{kind} {value!r} holds a control character")
    found = sorted(set(value) & reserved)
    if found:
        raise BadName(f"{kind} {value!r} holds reserved characters {''.join(found)!r}")
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise BadName(f"{kind} {value[:40]!r}... is longer than {max_bytes} bytes")
    return value


def _check_name(kind: str, value: object, reserved: set[str]) -> str:
    """A name W&B gives at most `NAME_MAX_CHARS` characters, and one safe path component."""
    if isinstance(value, str) and len(value) > NAME_MAX_CHARS:
        raise BadName(f"{kind} is longer than {NAME_MAX_CHARS} characters")
    return _check_component(kind, value, reserved, COMPONENT_MAX_BYTES)


def check_entity(value: object) -> str:
    return _check_name("entity", value, _PROJECT_RESERVED)


def check_project(value: object) -> str:
    return _check_name("project", value, _PROJECT_RESERVED)


def check_run_id(value: object) -> str:
    run_id = _check_component("run id", value, _RUN_ID_RESERVED, COMPONENT_MAX_BYTES)
    if run_id != run_id.strip():
        raise BadName(f"run id {run_id!r} starts or ends with whitespace")
    return run_id


def check_run_path(entity: object, project: object, run_id: object) -> tuple[str, str, str]:
    """The three names that locate a run, each checked; BadName for the first bad one."""
    return check_entity(entity), check_project(project), check_run_id(run_id)


def check_file_name(value: object) -> str:
    """A run file's name: a relative path of `/`-separated safe components.

    Refused: absolute paths, empty components (`a//b`, a trailing `/`), `.` and `..`,
    backslashes (a path separator elsewhere), NUL and other control characters.
    """
    if not isinstance(value, str) or not value:
        raise BadName("file name must be a non-empty string")
    if len(value.encode("utf-8", "surrogatepass")) > FILE_NAME_MAX_BYTES:
        raise BadName(f"file name is longer than {FILE_NAME_MAX_BYTES} bytes")
    if value.startswith("/"):
        raise BadName(f"file name {value!r} is an absolute path")
    for part in value.split("/"):
        if not part:
            raise BadName(f"file name {value!r} has an empty path component")
        _check_component("file name", part, {"\\"}, COMPONENT_MAX_BYTES)
    return value


# W&B's artifact names hold no `/` and its aliases and types no `/` or `:` (wandb's
# validators); `:` is refused in names too, since `name:alias` is how a version is named.
_ARTIFACT_RESERVED = set("/\\:")


def check_artifact_name(value: object) -> str:
    """An artifact's (collection's) name: one safe component, at most 128 characters."""
    return _check_name("artifact name", value, _ARTIFACT_RESERVED)


def check_artifact_type(value: object) -> str:
    return _check_name("artifact type", value, _ARTIFACT_RESERVED)


def check_alias(value: object) -> str:
    return _check_name("alias", value, _ARTIFACT_RESERVED)
