"""A compiled fast path and its Python twin, chosen once at import.

Each compiled function in `_walk.c` and `_records.c` has a Python twin that gives the same
answers, slower: the tests compare the two, and the twin runs where the extension is not
built. `WBMERGE_PURE=1` in the environment makes wbmerge use the twins although the
extensions are built.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import TypeVar

F = TypeVar("F")


def twins(python: F, module: str, name: str) -> tuple[dict[str, F], str]:
    """The ways to do one job, by name ("python" always; "compiled": `name` of the extension
    `module` of this package, when it is built and wanted), and the one to use."""
    ways = {"python": python}
    if not os.environ.get("WBMERGE_PURE"):
        try:
            ways["compiled"] = getattr(import_module(f".{module}", __package__), name)
        except (ImportError, AttributeError):  # (not built, or built before `name` was)
            pass
    return ways, "compiled" if "compiled" in ways else "python"
