"""`python -m wbmerge.cli` is the `wbmerge` command, as `python -m wbmerge` is."""

from .commands import main

main(prog_name="wbmerge")
