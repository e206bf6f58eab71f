"""Wait for a condition within a deadline: the one poll loop of the host tool's waits, through tenacity."""

from __future__ import annotations

from collections.abc import Callable

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed


def until(condition: Callable[[], bool], seconds: float, every: float) -> bool:
    """Ask `condition` every `every` s until it holds (True) or `seconds` have passed (False). An exception it raises
    ends the wait at once: a condition that can never hold (a process that exited) says so by raising."""
    try:
        Retrying(stop=stop_after_delay(seconds), wait=wait_fixed(every),
                 retry=retry_if_result(lambda held: not held))(condition)
        return True
    except RetryError:
        return False
