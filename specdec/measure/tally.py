"""What one decoder produced over one repeat: tokens, seconds, each call's stats and the target's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.specdec.decoder import DecodeStats


@dataclass
class Tally:
    """Tokens and seconds of one decoder over one repeat, and the stats of each of its calls."""

    tokens: int = 0
    seconds: float = 0.0
    stats: list[DecodeStats] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # the target's: each call's tokens per sequence

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, stats: DecodeStats) -> None:
        self.tokens += stats.new_tokens
        self.seconds += stats.total_time
        self.stats.append(stats)
