"""``transformers`` ``generate`` and assisted generation, timed on stock models at the same gamma.

transformers 5.x takes the assisted-generation settings from the *assistant's* ``generation_config``
(``num_assistant_tokens``, ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``;
defaults 20 tokens, a heuristic schedule, a 0.4 confidence cut); a ``num_assistant_tokens=`` passed
to ``generate`` is ignored. ``configure_assistant`` sets gamma there, and ``AssistedRounds`` counts
from the models' own calls how many tokens the assistant drafted in each round, so a comparison can
check that it ran at gamma. ``HFComparison`` holds the stock copies of a pair and what was timed on them.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.report import HFFigures
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.sampling import SamplingParams


def configure_assistant(config: GenerationConfig, gamma: int) -> None:
    """Make an assistant draft exactly ``gamma`` tokens per round: constant schedule, no confidence cut."""
    config.num_assistant_tokens = gamma
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


@dataclass
class Round:
    """One round of assisted generation: tokens the assistant drafted, and how many the remaining
    length allowed (transformers drafts at most ``max_length - current_length - 1``)."""

    drafted: int
    room: int
    ended_with_eos: bool


@dataclass
class AssistedRounds:
    """Counts each round's drafted tokens from the models' own calls while installed (a with-block).

    The target runs one forward per round over its candidates, with ``logits_to_keep`` = drafted + 1
    (transformers' own candidate length); the assistant runs one forward per drafted token.
    """

    target: PreTrainedModel
    assistant: PreTrainedModel
    max_length: int
    eos_ids: frozenset[int]
    rounds: list[Round] = field(default_factory=list)
    assistant_calls: int = 0

    def __enter__(self) -> AssistedRounds:
        self._handles = [
            self.target.register_forward_pre_hook(self._on_target, with_kwargs=True),
            self.assistant.register_forward_pre_hook(self._on_assistant),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_assistant(self, _module, _args) -> None:
        self.assistant_calls += 1

    def _on_target(self, _module, _args, kwargs) -> None:
        ids = kwargs["input_ids"]  # (1, T): the last committed token (all of them in round 1) and the candidates
        drafted = kwargs["logits_to_keep"] - 1
        cache = kwargs.get("cache")
        length = (cache.get_seq_length() if cache is not None else 0) + ids.shape[1] - drafted
        room = self.max_length - length - 1
        ended_with_eos = drafted > 0 and int(ids[0, -1]) in self.eos_ids
        self.rounds.append(Round(drafted=drafted, room=room, ended_with_eos=ended_with_eos))

    def short_rounds(self, gamma: int) -> int:
        """Rounds that drafted fewer than ``gamma`` tokens though the length allowed it and the draft did not end."""
        return sum(r.drafted < min(gamma, r.room) and not r.ended_with_eos for r in self.rounds)

    def check(self, gamma: int) -> None:
        """Refuse a run whose rounds were not at ``gamma``, or whose counts disagree with the assistant's calls."""
        drafted = [r.drafted for r in self.rounds]
        if self.short_rounds(gamma) or any(d > gamma for d in drafted):
            raise DraftsmithError(
                f"transformers' assisted generation drafted {drafted} tokens per round, not {gamma}: the "
                "assistant's generation_config must set num_assistant_tokens, the constant schedule and "
                "assistant_confidence_threshold 0 (configure_assistant)"
            )
        if sum(drafted) != self.assistant_calls:
            raise DraftsmithError(
                f"transformers verified {sum(drafted)} candidates but the assistant ran {self.assistant_calls} times"
            )


def hf_generate(
    target: PreTrainedModel,
    ids: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams,
    eos_ids: frozenset[int],
    assistant: PreTrainedModel | None = None,
) -> list[int]:
    """Run ``transformers`` ``generate`` (assisted when ``assistant`` is given, with the settings of its
    own generation config); return the new tokens."""
    kwargs: dict = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": sorted(eos_ids),
        "pad_token_id": sorted(eos_ids)[0],
    }
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p
        )
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    x = torch.tensor([ids], device=target.device)
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    return out[0, len(ids) :].tolist()


@dataclass
class HFComparison:
    """Stock ``transformers`` copies of the pair (loaded apart from the models the bundled decoder
    runs, which it switches to row-exact attention) and what was timed on them."""

    target: PreTrainedModel
    assistant: PreTrainedModel
    tallies: dict[str, Tally] = field(default_factory=lambda: {"generate": Tally(), "assisted": Tally()})
    rounds: list[Round] = field(default_factory=list)

    def time_prompt(self, ids: list[int], settings: MeasureSettings) -> None:
        """``transformers`` generate and assisted generation on one prompt, as ``settings`` decode it."""
        for name, assistant in (("generate", None), ("assisted", self.assistant)):
            rounds = AssistedRounds(self.target, self.assistant, len(ids) + settings.max_new_tokens, settings.eos_ids)
            start = time.perf_counter()
            with rounds if assistant is not None else contextlib.nullcontext():
                new = hf_generate(
                    self.target,
                    ids,
                    settings.max_new_tokens,
                    sampling=settings.options.sampling,
                    eos_ids=settings.eos_ids,
                    assistant=assistant,
                )
            self.tallies[name].tokens += len(new)
            self.tallies[name].seconds += time.perf_counter() - start
            if assistant is not None:
                rounds.check(settings.options.gamma)
                self.rounds += rounds.rounds

    def report(self, gamma: int) -> HFFigures:
        """tokens/s of both, and the assistant's drafted tokens per round that had room for ``gamma``."""
        full = [r.drafted for r in self.rounds if r.room >= gamma and not r.ended_with_eos]
        histogram: dict[str, int] = defaultdict(int)
        for r in self.rounds:
            histogram[str(r.drafted)] += 1
        return HFFigures(
            generate_tokens_per_s=self.tallies["generate"].tokens_per_s,
            assisted_tokens_per_s=self.tallies["assisted"].tokens_per_s,
            assisted_rounds=len(self.rounds),
            drafted_per_round=sum(full) / len(full) if full else None,
            drafted_histogram=dict(sorted(histogram.items())),
        )
