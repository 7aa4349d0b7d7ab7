"""A measurement's results as types: the figures of one set of runs, a pair's report, and what
``transformers`` measured beside it.

Each type writes itself as JSON (``to_json``) with the keys ``draftsmith eval --json`` has always
written, so the files the commands write stay readable by what read them before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Spread:
    """Median, min and max of a figure over repeats."""

    median: float
    min: float
    max: float


@dataclass(frozen=True)
class TimeSplit:
    """Seconds of a speculative run by phase."""

    prefill: float
    draft: float
    verify: float
    other: float


@dataclass(frozen=True)
class PairFigures:
    """alpha, tau, c, v, tokens/s and both speedups of one set of runs (a repeat, a category, or overall).

    acceptance_by_position: of chain rounds only; nodes_per_round: of token-tree rounds only;
    paused_share: the sequence rounds that did not draft because the pacer found drafting did not pay;
    guesses, guesses_accepted: the lookup-guess tokens the rounds verified, and kept (not in alpha);
    lookup_rounds: the sequence rounds that verified a lookup continuation instead of drafting.
    """

    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    target_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float | None
    cost_ratio_c: float
    verify_ratio_v: float
    predicted_speedup: float | None
    efficiency: float | None
    nodes_per_round: float | None
    proposed: int
    accepted: int
    acceptance_by_position: list[float] | None
    paused_share: float | None
    time_split_s: TimeSplit
    guesses: int = 0
    guesses_accepted: int = 0
    lookup_rounds: int = 0

    def to_json(self) -> dict:
        return {name: plain(value) for name, value in fields_of(PairFigures, self).items()}


@dataclass(frozen=True)
class HFFigures:
    """``transformers`` beside the bundled decoder: plain and assisted generation's tokens/s, and the
    assistant's drafted tokens per round that had room for gamma."""

    generate_tokens_per_s: float
    assisted_tokens_per_s: float
    assisted_rounds: int
    drafted_per_round: float | None
    drafted_histogram: dict[str, int]

    def to_json(self) -> dict:
        return {f"hf_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class MeasuredUnder:
    """The settings a pair was measured under."""

    gamma: int
    tree: str | None
    batch_size: int
    max_new_tokens: int
    repeats: int
    prompts: int
    temperature: float
    top_k: int | None
    top_p: float | None
    verify_widths: dict[str, int]


@dataclass(frozen=True)
class Compiled:
    """Whether the decoders ran compiled; then the warm-up's seconds and the graphs it compiled."""

    compile: bool = False
    compile_s: float | None = None
    compiled_graphs: int | None = None


@dataclass(frozen=True, kw_only=True)
class PairReport(PairFigures):
    """A pair measured side by side: the overall figures (of the median repeat; the speedup from the
    median tokens/s of each decoder), their spread over repeats, greedy identity, the figures per
    category, what ``transformers`` measured when asked, the settings, and whether it ran compiled.

    kind_figures: what the draft's kind adds (``DraftKind.decoding_report``); source: what
    ``draftsmith eval`` measured (target, draft, device, dtype, ...), both written as top-level keys.
    """

    speedup_per_repeat: list[float]
    speedup_spread: Spread | None
    cost_ratio_c_spread: Spread | None
    greedy_match: float | None
    per_category: dict[str, PairFigures]
    hf: HFFigures | None = None
    under: MeasuredUnder | None = None
    compiled: Compiled = Compiled()
    kind_figures: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)

    @property
    def gamma(self) -> int:
        return self.under.gamma

    def to_json(self) -> dict:
        out = super().to_json()
        out.update(
            speedup_per_repeat=self.speedup_per_repeat,
            speedup_spread=plain(self.speedup_spread),
            cost_ratio_c_spread=plain(self.cost_ratio_c_spread),
            greedy_match=self.greedy_match,
            per_category={name: figures.to_json() for name, figures in self.per_category.items()},
        )
        if self.hf is not None:
            out.update(self.hf.to_json())
        if self.under is not None:
            out.update(plain(self.under))
            out.update(plain(self.compiled))
        return {**out, **self.kind_figures, **self.source}


def plain(value):
    """A dataclass as a dict of its fields (recursively); anything else as it is."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def fields_of(cls, value) -> dict:
    """``value``'s attributes named as ``cls``'s fields: what builds a ``cls`` from a wider result."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}


@dataclass(frozen=True, kw_only=True)
class EngineReport:
    """The target alone against the target with a draft in a serving engine (vLLM), on the same prompts.

    Tokens/s are medians over the repeats (``speedup_spread``: [min, max] of the repeats' speedups);
    alpha, tau and the per-position acceptance come from the engine's own counters over every
    round of every repeat; ``drafts`` are the engine's drafting rounds. The servers' settings are
    kept as they started them.
    """

    acceptance_rate: float | None
    acceptance_per_position: list[float]
    mean_accepted_tokens: float | None
    target_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    speedup_per_repeat: list[float]
    speedup_spread: list[float]
    target_tokens_per_s_per_repeat: list[float]
    spec_tokens_per_s_per_repeat: list[float]
    drafts: int
    proposed: int
    accepted: int
    greedy_match: float | None
    gamma: int
    batch_size: int
    max_new_tokens: int
    repeats: int
    prompts: int
    temperature: float
    top_k: int | None
    top_p: float | None
    baseline_server: dict
    speculative_server: dict
    engine: str = "vllm"

    def to_json(self) -> dict:
        out = {"engine": self.engine}
        out.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "engine")
        return out
