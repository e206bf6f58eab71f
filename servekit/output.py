"""The one channel a command's work speaks through, with levels: info, note and warning lines, progress (a line a
terminal rewrites in place, else a line when the stage changes), and a build's step lines."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

# What a function takes to speak through: print, a test's list.append, an Output (its call is a line at info level).
Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Output:
    """Call it (or `info`) for a line; `note`, `warn`, `progress` and `step` for the other levels. `progress` goes to
    a live status where the command line gives one; else a line each time the stage changes, or every `every_s`."""

    def __init__(self, write: Callable[[str], None] = _stderr, prefix: str = "",
                 live: Callable[[str], None] | None = None, step: Callable[[str], None] | None = None,
                 every_s: float = 20.0) -> None:
        self._write, self.prefix, self._live, self._step, self.every_s = write, prefix, live, step, every_s
        self._shown: tuple[str, float] = ("", 0.0)  # the last progress stage printed, and when

    def __call__(self, text: str) -> None:
        self.info(text)

    def info(self, text: str) -> None:
        self._write(f"{self.prefix}{text}")

    def note(self, text: str) -> None:
        self._write(f"{self.prefix}note: {text}")

    def warn(self, text: str) -> None:
        self._write(f"{self.prefix}warning: {text}")

    def progress(self, text: str) -> None:
        if self._live:
            self._live(text)
            return
        stage = text.split(": ", 1)[-1]
        if stage != self._shown[0] or time.monotonic() - self._shown[1] >= self.every_s:
            self._write(f"{self.prefix}  {text}")
            self._shown = (stage, time.monotonic())

    def step(self, line: str) -> None:
        """A line of a build's output: shown by the step printer the command line gave, else not at all (the log
        keeps every line)."""
        if self._step:
            self._step(line)

    def child(self, prefix: str) -> Output:
        return Output(self._write, self.prefix + prefix, self._live, self._step, self.every_s)


def as_output(say: Say | None) -> Output:
    """`say` as an Output: a plain function (a test's list.append, print) writes every level's line."""
    if isinstance(say, Output):
        return say
    return Output(write=say) if say else Output()
