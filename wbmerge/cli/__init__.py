"""The `wbmerge` command line, on top of every stage: a thin click layer over `wbmerge.api`.

`commands` holds the click group and one command per API function; `sink` the commands of
the local sink (`wbmerge sink serve`, `wbmerge sink show`); `exits` how a failure is said:
one line on stderr and an exit status that tells bad input from a failed upload.

`main` is imported when first asked for: the commands import every stage (0.4 s of a
process's start), and the sink's own process (`python -m wbmerge.sink`) needs none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .commands import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:
    if name == "main":
        from .commands import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
