"""What a server's log line says of a failed boot: the reasons the boot's watcher and the engines give, the specific
before the general."""

from __future__ import annotations

import re

from servekit.errors import BootFailed

# vLLM prefixes its lines with the process and level: "(EngineCore pid=25) ERROR 11-29 09:01:47 [core.py:1433] ".
VLLM_PREFIX = r"^(?:\([\w-]+ pid=\d+\) (?:ERROR|CRITICAL) [^\[]*\[[^\]]+\] )?"
# (pattern, reason): the first line that matches ends the wait; the specific ones come first.
FAILURE_PATTERNS = [
    (re.compile(r"CUDA out of memory|torch\.OutOfMemoryError"), "out of memory"),
    (re.compile(r"No available memory for the cache blocks"), "out of memory (no room for the KV cache)"),
    (re.compile(r"UVA is not available"), "UVA is not available (WSL2: pinned memory is off)"),
    (re.compile(r"device not ready", re.I), "device not ready (WSL2: expandable_segments must be off)"),
    (re.compile(r"launcher: refusing to start: .+"), "launcher refused"),
    (re.compile(VLLM_PREFIX + r"(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): \S"), "error"),
    (re.compile(r"EngineCore failed to start"), "EngineCore failed to start"),
    (re.compile(VLLM_PREFIX + r"Traceback \(most recent call last\)"), "traceback"),
]


def classify(line: str) -> tuple[str, str] | None:
    """(reason, the matching text) when a log line means the boot has failed."""
    if " WARNING " in line[:60]:
        return None
    for pattern, reason in FAILURE_PATTERNS:
        match = pattern.search(line)
        if match:
            return reason, line.strip()[-400:]
    return None


def prepare_failure(lines: list[str], exit_code: int) -> BootFailed:
    """A prepare step that exited `exit_code`, as the watcher says a boot's failure (a refused knob: "launcher
    refused"), else by its last line."""
    found = next(filter(None, map(classify, lines)), None)
    reason, line = found or (f"prepare failed (exit {exit_code})", (lines or [""])[-1])
    return BootFailed(reason, line, lines[-12:])
