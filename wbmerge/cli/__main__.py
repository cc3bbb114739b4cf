"""`python -m wbmerge.cli` is the `wbmerge` command, as `python -m wbmerge` is."""

from .commands import main

if __name__ == "__main__":
    main(prog_name="wbmerge")
