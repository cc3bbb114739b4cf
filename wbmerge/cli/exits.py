"""How the command line says what went wrong: one line on stderr, and the exit status.

Bad input is `wbmerge: error: ...` and exit 2 (click's usage errors too, which it would
give in four lines); input left out is a `wbmerge: warning: ...` line; a bug says so in
one line as well, with how to get its traceback. No traceback reaches a user.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from ..errors import InputWarning, Terminated, WbmergeError


def one_line_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input is one line on stderr and exit 2; a bug says so, still without a traceback.

    Input left out (InputWarning) is one `wbmerge: warning:` line each. A failure that is
    not a WbmergeError is first traced to a hostile run (a record with a valid checksum
    but invalid protobuf, which the fast readers do not parse): that is bad input, exit 2.
    """

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always", InputWarning)
                warnings.showwarning = _show_warning
                return func(*args, **kwargs)
        except WbmergeError as exc:
            for line in getattr(exc, "lines", None) or [str(exc)]:
                click.echo(f"wbmerge: error: {printable(line)}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo(_stopped("interrupted"), err=True)
            sys.exit(130)
        except BrokenPipeError:  # the reader of stdout went away (`wbmerge ... | head -1`)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (for the exit)
            sys.exit(141)  # as a tool stopped by SIGPIPE exits
        except Terminated:
            click.echo(_stopped("terminated"), err=True)
            sys.exit(143)
        except Exception as exc:  # the last line of defence of the CLI
            if os.environ.get("WBMERGE_DEBUG"):
                raise
            hostile = _hostile_input(kwargs.get("paths"))
            if hostile:
                click.echo(f"wbmerge: error: {hostile}", err=True)
                sys.exit(2)
            click.echo(
                f"wbmerge: internal error: {type(exc).__name__}: {printable(str(exc))} "
                "(rerun with WBMERGE_DEBUG=1 for a traceback)",
                err=True,
            )
            sys.exit(70)

    return wrapper


def _stopped(how: str) -> str:
    """The line of a command stopped by a signal: a sync keeps the runs it verified."""
    context = click.get_current_context(silent=True)
    if context is not None and context.info_name == "sync":
        return f"wbmerge: {how}; runs verified so far stay recorded"
    return f"wbmerge: {how}"


def _show_warning(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
    if issubclass(category, InputWarning):
        click.echo(f"wbmerge: warning: {printable(str(message))}", err=True)
    else:
        _default_show_warning(message, category, *args, **kwargs)


_default_show_warning = warnings.showwarning


def _hostile_input(paths: Any) -> str | None:
    if not paths:
        return None
    from ..identify import find_invalid_records

    try:
        return find_invalid_records(paths)
    except Exception:  # the input cannot even be listed: report the first failure
        return None


# A path whose name is not UTF-8 reaches Python as text holding lone surrogates (PEP 383),
# which no UTF-8 output may hold: each is printed escaped instead.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a name that is not UTF-8 (`os.fsencode`'s)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"


def _escape_unencodable(error: UnicodeError) -> tuple[str, int]:
    """The codec error handler of the command's output (`wbmerge-escape`): what its
    encoding cannot hold (a lone surrogate, in UTF-8) printed escaped, as `printable`."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    text = error.object[error.start : error.end]
    escaped = "".join(
        _escaped(match) if (match := _SURROGATE.fullmatch(char)) else f"\\u{ord(char):04x}"
        for char in text
    )
    return escaped, error.end


codecs.register_error("wbmerge-escape", _escape_unencodable)


def escape_unencodable_output() -> None:
    """Make stdout and stderr print what their encoding cannot hold escaped: a label or
    name read from a run may hold a lone surrogate (JSON can spell one), which would
    otherwise stop a command halfway through its output."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="wbmerge-escape")


def printable(text: str) -> str:
    """`text` as UTF-8 can hold it: a byte of a file name that is not UTF-8 as `\\xff`,
    any other lone surrogate as `\\udXXX`."""
    return _SURROGATE.sub(_escaped, text)


def printable_json(value: object) -> str:
    """`value` as indented JSON that is valid UTF-8: every string `printable`."""
    return json.dumps(_printable_values(value), indent=2)


def _printable_values(value: object) -> object:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable_values(k): _printable_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable_values(item) for item in value]
    return value


_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # (click 8.2 and later)


class OneLineUsage(click.Group):
    """The group of commands, its usage errors one line too (click gives them four: usage,
    a hint, a blank line and the error), naming the help to read."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        escape_unencodable_output()
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS as exc:  # (a group given no command: its help, as click shows it)
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            if exc.ctx is not None:
                where = ["wbmerge", *_commands_of(exc.ctx)]
            else:  # (an option's missing value: click names no command, the arguments do)
                where = self._commands_in(kwargs.get("args", args[0] if args else sys.argv[1:]))
            click.echo(
                f"wbmerge: error: {exc.format_message()} (see {' '.join(where)} --help)", err=True
            )
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"wbmerge: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("wbmerge: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def _commands_in(self, args: list[str]) -> list[str]:
        """The command path the arguments name: `merge --out` gives ["wbmerge", "merge"]."""
        path, group = ["wbmerge"], self
        for arg in args:
            command = group.commands.get(arg) if isinstance(group, click.Group) else None
            if command is None:
                break
            path.append(arg)
            group = command
        return path


def _commands_of(context: click.Context) -> list[str]:
    """The names of the commands below the group, as typed (`sink serve`), whatever name
    the program was started under (`python -m wbmerge.sink` is `wbmerge sink serve`)."""
    names = []
    while context.parent is not None:
        names.append(context.info_name or "")
        context = context.parent
    return names[::-1]
