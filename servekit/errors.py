"""The errors the command line turns into one line and an exit code, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or usage: exit 2. The message says what, where and how to fix it."""

    exit_code = 2


class CheckFailed(Exception):
    """A check ran and found a problem: exit 1."""

    exit_code = 1


class EnvironmentProblem(Exception):
    """Something the machine lacks (an engine, an index, a base image): exit 1, with the fix."""

    exit_code = 1
