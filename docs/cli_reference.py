"""Write the command-line reference (docs/cli.md) from the commands' own `--help`.

    python docs/cli_reference.py          # rewrite docs/cli.md
    python docs/cli_reference.py --check  # exit 1 when docs/cli.md is not what --help says

The page is made from click's help text, so it says what the installed commands take; the
test suite runs `--check`, which fails when a command or option changed and the page was
not made again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

PAGE = Path(__file__).resolve().parent / "cli.md"

INTRO = """# Command line

Every command and option, as `--help` prints them (this page is made from them by
`python docs/cli_reference.py`). The other pages say what the options do and why.
"""


def commands(
    command: click.Command, path: tuple[str, ...], parent: click.Context | None = None
) -> Iterator[tuple[tuple[str, ...], click.Context]]:
    """Every command under `command`, depth first, each with the context its help needs."""
    settings = {"terminal_width": 100, **command.context_settings}
    ctx = command.context_class(command, info_name=path[-1], parent=parent, **settings)
    yield path, ctx
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from commands(sub, (*path, name), ctx)


def page() -> str:
    from wbmerge.cli import main

    parts = [INTRO]
    for path, ctx in commands(main, ("wbmerge",)):
        parts.append(f"## {' '.join(path)}\n\n```text\n{ctx.command.get_help(ctx).rstrip()}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    text = page()
    if sys.argv[1:] == ["--check"]:
        if PAGE.read_text() != text:
            sys.exit("docs/cli.md is not what --help says: run python docs/cli_reference.py")
    else:
        PAGE.write_text(text)
