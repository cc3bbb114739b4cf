"""The tests' reference for `wbmerge.wandbcore.terminal`: wandb-core's terminal emulator and console
model (0.31: core/internal/terminalemulator, runconsolelogs) transcribed character by
character, as plainly as its Go source reads, with no runs, regexes or shortcuts. The port
takes text a run at a time for speed; the tests compare the two on random consoles.
"""

from __future__ import annotations

HEIGHT = 32  # maxTerminalLines: the view, and the lines still open to change
LINE_LENGTH = 4096  # maxTerminalLineLength


class ReferenceModel:
    """Every line made, in order; only the last `HEIGHT` can still change."""

    def __init__(self) -> None:
        self.first = 0  # the number of the first line still open
        self.open: list[list[str]] = []
        self.all: list[list[str]] = []

    def next_line(self, content: str = "") -> int:
        number = self.first + len(self.open)
        line = list(content)
        self.open.append(line)
        self.all.append(line)
        if len(self.open) > HEIGHT:
            self.first += 1
            del self.open[0]
        return number

    def put(self, number: int, offset: int, char: str) -> None:
        if number < self.first or offset >= LINE_LENGTH:
            return
        line = self.open[number - self.first]
        while offset >= len(line):
            line.append(" ")
        line[offset] = char


class ReferenceTerminal:
    def __init__(self, model: ReferenceModel) -> None:
        self.model = model
        self.view: list[int] = []
        self.x = self.y = 0
        self.escape = ""

    def write(self, text: str) -> None:
        for char in text:
            if not self.escape:
                if char == "\r":
                    self.x = 0
                elif char == "\n":
                    self.x = 0
                    self.down()
                elif char == "\x1b":
                    self.escape = char
                else:
                    self.put(char)
            elif self.escape == "\x1b" and char == "[":
                self.escape = "\x1b["
            elif self.escape == "\x1b[" and char == "A":
                self.escape = ""
                self.y = max(self.y - 1, 0)
            elif self.escape == "\x1b[" and char == "B":
                self.escape = ""
                self.down()
            else:  # a sequence it does not know: its characters are written as they are
                for written in self.escape + char:
                    self.put(written)
                self.escape = ""

    def put(self, char: str) -> None:
        while self.y >= len(self.view):
            self.view.append(self.model.next_line())
        self.model.put(self.view[self.y], self.x, char)
        self.x += 1

    def down(self) -> None:
        self.y += 1
        if self.y >= HEIGHT:
            if self.view:
                del self.view[0]
            self.y -= 1


def reference_output_log(console: list[tuple[str, str]]) -> tuple[str, int]:
    """`output.log` and its line count for `(stream, text)` records, by the reference."""
    model = ReferenceModel()
    terminals = {"stdout": ReferenceTerminal(model), "stderr": ReferenceTerminal(model)}
    for stream, text in console:
        if stream == "logger":
            for line in text.removesuffix("\n").split("\n"):
                model.next_line(line)
        else:
            terminals[stream].write(text)
    return "".join("".join(line) + "\n" for line in model.all), len(model.all)
