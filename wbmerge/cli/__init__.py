"""The `wbmerge` command line, on top of every stage: a thin click layer over `wbmerge.api`.

`commands` holds the click group and one command per API function; `sink` the commands of
the local sink (`wbmerge sink serve`, `wbmerge sink show`); `exits` how a failure is said:
one line on stderr and an exit status that tells bad input from a failed upload.
"""

from .commands import main

__all__ = ["main"]
