"""What wandb-core makes of a run's console records, the lines the server counts and the
`output.log` it writes: its terminal emulator, ported (wandb-core 0.31:
core/internal/terminalemulator, runconsolelogs). Pure.

wandb-core keeps one list of console lines per run, and writes two terminals into it, one
for stdout and one for stderr. Each terminal has a cursor and a view of the last
`TERMINAL_HEIGHT` lines it made:

- a character is written at the cursor, which moves right; the line under the cursor is
  made (with the blank lines above it) only when a character is written on it;
- `\\n` moves the cursor to the start of the next line (the view scrolls at its bottom),
  `\\r` to the start of its line, ESC [ A and ESC [ B one line up and down; any other
  escape is written as it is, characters and all;
- a line keeps its first `MAX_LINE` characters, and only the last `TERMINAL_HEIGHT`
  lines of the run can still change: a cursor above them writes nothing;
- each line of wandb's logger (an `output_logger` record) is a line of its own.

`output.log` is every line, in the order they were made, each ended by `\\n`. Example:
stdout "epoch 1: 50%\\repoch 1: 100%\\n" and then stderr "warning\\n" make the lines
"epoch 1: 100%" and "warning", so `output.log` holds "epoch 1: 100%\\nwarning\\n".
The server counts those lines as the run's console lines (measured with `wandb sync` into
the sink, progress bars and cursor moves too).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

TERMINAL_HEIGHT = 32  # wandb-core's `maxTerminalLines`: the view, and the lines still open
MAX_LINE = 4096  # wandb-core's `maxTerminalLineLength`: characters a line keeps

# A run of characters written as they are, or one character that may be acted on.
_TOKENS = re.compile(r"[^\r\n\x1b]+|.", re.DOTALL)


class ConsoleModel:
    """The lines of one run's console, both terminals' and the logger's.

    Only the last `TERMINAL_HEIGHT` lines can still change. The lines above them are
    closed: counted, and kept only when the text is wanted, so that counting a console
    holds no more of it than those open lines."""

    def __init__(self, keep_text: bool = True) -> None:
        self.made = 0  # lines made so far
        self.open: deque[str] = deque()  # the last lines made, at most TERMINAL_HEIGHT
        self.closed: list[str] | None = [] if keep_text else None

    def new_line(self, content: str = "") -> int:
        self.open.append(content)
        self.made += 1
        if len(self.open) > TERMINAL_HEIGHT:
            line = self.open.popleft()
            if self.closed is not None:
                self.closed.append(line)
        return self.made - 1

    def write(self, number: int, offset: int, text: str) -> None:
        """Write `text` into line `number` from `offset` on (padding with blanks), unless
        the line is no longer open to change; characters past `MAX_LINE` are dropped."""
        index = number - (self.made - len(self.open))
        if index < 0:
            return
        text = text[: max(0, MAX_LINE - offset)]
        if not text:
            return
        line = self.open[index].ljust(offset)
        self.open[index] = line[:offset] + text + line[offset + len(text) :]

    def text(self) -> str:
        """`output.log`: every line, each ended by a line feed."""
        assert self.closed is not None, "the text of a console only counted"
        return "".join(line + "\n" for lines in (self.closed, self.open) for line in lines)


class Terminal:
    """One stream's terminal, writing into a `ConsoleModel`."""

    def __init__(self, model: ConsoleModel) -> None:
        self.model = model
        self.view: list[int] = []  # the numbers of the lines in view, top first
        self.x = self.y = 0
        self.escape = ""  # the escape sequence begun and not yet ended

    def write(self, text: str) -> None:
        for match in _TOKENS.finditer(text):
            token = match.group()
            while self.escape and token:
                token = self._escaped(token)
            if not token:
                continue
            if token == "\r":
                self.x = 0
            elif token == "\n":
                self.x = 0
                self._down()
            elif token == "\x1b":
                self.escape = token
            else:
                self._put(token)

    def _escaped(self, token: str) -> str:
        """Take the first character of `token` into the escape sequence begun; the rest."""
        char, rest = token[0], token[1:]
        if self.escape == "\x1b" and char == "[":
            self.escape = "\x1b["
        elif self.escape == "\x1b[" and char in "AB":
            self.escape = ""
            if char == "B":
                self._down()
            elif self.y > 0:
                self.y -= 1
        else:  # not a sequence it knows: written as it is, the character too
            printed, self.escape = self.escape + char, ""
            self._put(printed)
        return rest

    def _down(self) -> None:
        self.y += 1
        if self.y >= TERMINAL_HEIGHT:
            if self.view:
                del self.view[0]
            self.y -= 1

    def _put(self, chars: str) -> None:
        while self.y >= len(self.view):
            self.view.append(self.model.new_line())
        self.model.write(self.view[self.y], self.x, chars)
        self.x += len(chars)


class Console:
    """A run's console as wandb-core makes it, fed its records in the order logged.
    `keep_text=False` only counts its lines."""

    def __init__(self, keep_text: bool = True) -> None:
        self.model = ConsoleModel(keep_text)
        self.terminals = {"stdout": Terminal(self.model), "stderr": Terminal(self.model)}

    def write(self, stream: str, text: str) -> None:
        """Add one record's text: stream "stdout", "stderr" or "logger" (a line of wandb's
        logger)."""
        if stream == "logger":
            for line in text.removesuffix("\n").split("\n"):
                self.model.new_line(line)
        else:
            self.terminals[stream].write(text)

    @property
    def lines(self) -> int:
        """The lines of `output.log` so far (the server's count of the console's lines)."""
        return self.model.made

    def text(self) -> str:
        """`output.log` as wandb-core writes it."""
        return self.model.text()


def output_log(console: Iterable[tuple[str, str]]) -> str:
    """The `output.log` wandb-core writes of a run's console: `(stream, text)` in the order
    logged (see `Console.write`)."""
    made = Console()
    for stream, text in console:
        made.write(stream, text)
    return made.text()
