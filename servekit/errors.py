"""The errors the command line turns into one line and an exit code, never a traceback.

Every error of ours is a ServekitError: its message is the line the user reads (what, where, how to fix), its
`exit_code` the command's. The root and UserError live in the image's package (servekit/image/errors.py), whose own
errors are of it too; the host's kinds are here.
"""

from __future__ import annotations

from typing import Any

from servekit.image.errors import ServekitError, UserError

__all__ = ["BootFailed", "CheckFailed", "EnvironmentProblem", "ServekitError", "UserError"]


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
