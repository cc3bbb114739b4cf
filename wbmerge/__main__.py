"""`python -m wbmerge` is the `wbmerge` command."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="wbmerge")
