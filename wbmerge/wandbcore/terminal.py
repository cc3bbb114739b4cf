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

# What a terminal acts on, a run at a time: characters written as they are, escapes it
# does not know (written too, characters and all), line feeds, carriage returns, cursor
# moves up (ESC [ A) and down (ESC [ B), and an escape begun at the end of a record. Runs
# keep hostile text (50 MB of cursor moves) from costing a step per character. A repeated
# group is bounded (`{1,1024}`): unbounded, Python's `re` keeps state for each repetition
# (3.4 GB for 30 MB of text); a repeated character class keeps none.
_TOKENS = re.compile(
    r"(?P<text>[^\r\n\x1b]+|(?:\x1b[^\[]|\x1b\[[^AB]){1,1024})|(?P<down>\n+)|(?P<back>\r+)"
    r"|(?P<up>(?:\x1b\[A){1,1024})|(?P<below>(?:\x1b\[B){1,1024})|(?P<begun>\x1b\[?)",
    re.DOTALL,
)


class ConsoleModel:
    """The lines of one run's console, both terminals' and the logger's.

    Only the last `TERMINAL_HEIGHT` lines can still change; they are kept as lists of
    characters, so that writing one character costs one. The lines above them are closed:
    counted, and kept only when the text is wanted, so that counting a console holds no
    more of it than those open lines."""

    def __init__(self, keep_text: bool = True) -> None:
        self.made = 0  # lines made so far
        self.open: deque[list[str]] = deque()  # the last lines made, at most TERMINAL_HEIGHT
        self.closed: list[str] | None = [] if keep_text else None

    def new_line(self, content: str = "") -> int:
        self.open.append(list(content) if self.closed is not None else [])
        self.made += 1
        if len(self.open) > TERMINAL_HEIGHT:
            line = self.open.popleft()
            if self.closed is not None:
                self.closed.append("".join(line))
        return self.made - 1

    def write(self, number: int, offset: int, text: str) -> None:
        """Write `text` into line `number` from `offset` on (padding with blanks), unless
        the line is no longer open to change; characters past `MAX_LINE` are dropped. (A
        console only counted writes nothing: what a line holds makes no line.)"""
        index = number - (self.made - len(self.open))
        if index < 0 or self.closed is None:
            return
        text = text[: max(0, MAX_LINE - offset)]
        if not text:
            return
        line = self.open[index]
        if len(line) < offset:
            line.extend(" " * (offset - len(line)))
        line[offset : offset + len(text)] = text

    def text(self) -> str:
        """`output.log`: every line, each ended by a line feed."""
        assert self.closed is not None, "the text of a console only counted"
        open_lines = ("".join(line) for line in self.open)
        return "".join(f"{line}\n" for lines in (self.closed, open_lines) for line in lines)


class Terminal:
    """One stream's terminal, writing into a `ConsoleModel`."""

    def __init__(self, model: ConsoleModel) -> None:
        self.model = model
        self.view: list[int] = []  # the numbers of the lines in view, top first
        self.x = self.y = 0
        self.escape = ""  # the escape sequence begun and not yet ended

    def write(self, text: str) -> None:
        while self.escape and text:  # (an escape begun at the end of the last record)
            text = self._escaped(text)
        for match in _TOKENS.finditer(text):
            kind, token = match.lastgroup, match.group()
            if kind == "text":
                self._put(token)
            elif kind == "down":
                self.x = 0
                self._down(len(token))
            elif kind == "back":
                self.x = 0
            elif kind == "up":
                self._up(len(token) // 3)
            elif kind == "below":
                self._down(len(token) // 3)
            else:  # (only at the end of the text: the next record ends it)
                self.escape = token

    def _escaped(self, text: str) -> str:
        """Take the first character of `text` into the escape sequence begun; the rest."""
        char, rest = text[0], text[1:]
        if self.escape == "\x1b" and char == "[":
            self.escape = "\x1b["
        elif self.escape == "\x1b[" and char in "AB":
            self.escape = ""
            if char == "B":
                self._down(1)
            else:
                self._up(1)
        else:  # not a sequence it knows: written as it is, the character too
            printed, self.escape = self.escape + char, ""
            self._put(printed)
        return rest

    def _up(self, lines: int) -> None:
        self.y = max(0, self.y - lines)

    def _down(self, lines: int) -> None:
        """Move the cursor `lines` down; past the view's bottom line, each scrolls it."""
        y = self.y + lines
        if y >= TERMINAL_HEIGHT:
            del self.view[: y - (TERMINAL_HEIGHT - 1)]  # (those that have scrolled out)
            y = TERMINAL_HEIGHT - 1
        self.y = y

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
