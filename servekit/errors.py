"""The errors the command line turns into one line and an exit code, never a traceback.

Every error of ours is a ServekitError: its message is the line the user reads (what, where, how to fix), its
`exit_code` the command's. The one other kind the command line reads as bad input is the boundary's `Refused`
(exit 2), which the image's own code raises and which therefore cannot import this module.
"""

from __future__ import annotations

from typing import Any


class ServekitError(Exception):
    """The root of our errors: the message is what the user should read; `exit_code` what the command exits with."""

    exit_code = 1


class UserError(ServekitError):
    """Bad input or usage: exit 2. The message says what, where and how to fix it."""

    exit_code = 2


class CheckFailed(ServekitError):
    """A check ran and found a problem: exit 1."""

    exit_code = 1


class EnvironmentProblem(ServekitError):
    """Something the machine lacks (an engine, an index, a base image): exit 1, with the fix."""

    exit_code = 1


class BootFailed(EnvironmentProblem):
    """A server did not come up: why (`reason`), the log line that said so and the log's last lines."""

    def __init__(self, reason: str, line: str, last_lines: list[str]) -> None:
        super().__init__(f"{reason}: {line}" if line else reason)
        self.reason, self.line, self.last_lines = reason, line, last_lines
        self.boot: Any = None  # serve.boot.Boot, where the failure came from a boot: its memory samples up to it
