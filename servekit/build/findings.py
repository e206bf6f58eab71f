"""What a check of the matrix found: problems (which fail it) and notes (said, not failing)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def extend(self, other: Findings) -> None:
        self.problems += other.problems
        self.notes += other.notes
