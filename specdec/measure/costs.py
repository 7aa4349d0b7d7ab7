"""The cost ratios: c = one draft step / one target single-token step, v = one verification forward /
one target single-token step.

``step_costs`` takes both from the stats of a target-only run and a speculative run on the same
prompts (as ``evaluate_pair`` measures them); ``measure_cost_ratio`` times c on its own, for a draft
that is not being evaluated as a pair (during training). With a token tree a draft step is one
forward over a level's nodes and a verification the one forward over all the tree's nodes.
"""

from __future__ import annotations

import math
import statistics

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.clock import eval_mode
from draftsmith.specdec.decoder import DecodeStats, speculative_generate, target_generate
from draftsmith.specdec.drafters import PairedDraft
from draftsmith.specdec.options import DecodeOptions


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token decoding step of ``model`` reads: its linear layers' weights and
    biases, each shared tensor once (a head tied to the embeddings is read as the head); the
    embedding rows and norms it reads are a few kilobytes."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for tensor in (module.weight, module.bias):
                if tensor is not None:
                    tensors.setdefault(tensor.data_ptr(), tensor)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def sum_stats(stats: list[DecodeStats]) -> DecodeStats:
    """The counters and timings of several decoding calls added up."""
    total = DecodeStats()
    for s in stats:
        for name in total.__dataclass_fields__:
            setattr(total, name, getattr(total, name) + getattr(s, name))
    return total


def single_step_time(baseline: DecodeStats) -> float:
    """Seconds of one single-token step of a target-only run (prefill excluded); nan without steps."""
    return baseline.verify_time / baseline.rounds if baseline.rounds else math.nan


def step_costs(baseline: DecodeStats, spec: DecodeStats, calls: int) -> tuple[float, float]:
    """(c, v) from a target-only run and a speculative run on the same prompts, each the sum of
    ``calls`` decoding calls: c = one draft step / one target step, v = one verification / one
    target step. The draft's prefill forwards (one per call) are not steps."""
    step = single_step_time(baseline)
    draft_steps = spec.draft_forwards - calls
    c = spec.draft_time / draft_steps / step if draft_steps else math.nan
    v = spec.verify_time / spec.rounds / step if spec.rounds else math.nan
    return c, v


def measure_cost_ratio(
    target: PreTrainedModel, draft: torch.nn.Module, prompt_len: int = 32, steps: int = 16, repeats: int = 3
) -> float:
    """c = one draft decoding step / one target decoding step, each timed decoding alone (as the
    target-only baseline decodes), for a draft that is not being evaluated as a pair. A draft that
    decodes with its own pair (``drafters.PairedDraft``: it may need the target's hidden states) is
    timed drafting in that pair instead: its draft time per draft forward (``step_costs``' c).

    The two are timed side by side: ``repeats`` rounds of one target run then one draft run, c the
    median of the rounds' ratios, so a slow minute on a shared machine lands on both sides of a ratio."""
    prompt = [[t % target.config.vocab_size for t in range(1, prompt_len + 1)]]
    if isinstance(draft, PairedDraft):

        def draft_step() -> float:
            return paired_step_time(target, draft, prompt, steps)
    else:

        def draft_step() -> float:
            return alone_step_time(draft, prompt, steps, warm=False)

    with eval_mode(target, draft):
        target_generate(target, prompt, 4)  # warm-up of both, not timed
        draft_step()
        ratios = []
        for _ in range(repeats):
            target_step = alone_step_time(target, prompt, steps, warm=False)
            ratios.append(draft_step() / target_step)
    return statistics.median(ratios)


def alone_step_time(model: torch.nn.Module, prompt: list[list[int]], steps: int, warm: bool = True) -> float:
    """Seconds of one single-token step of ``model`` decoding ``prompt`` alone, after a warm-up (``warm``)."""
    if warm:
        target_generate(model, prompt, 4)
    return single_step_time(target_generate(model, prompt, steps + 1)[1])


def paired_step_time(target: PreTrainedModel, draft: torch.nn.Module, prompt: list[list[int]], steps: int) -> float:
    """Seconds of one draft forward of ``draft`` drafting for ``target`` in its own pair, after a warm-up."""
    options = DecodeOptions(gamma=4, compile=False)
    speculative_generate(target, draft, prompt, 4, options)
    spec = speculative_generate(target, draft, prompt, steps + 1, options)[1]
    return spec.draft_time / max(spec.draft_forwards - 1, 1)  # the prefill's forward is not a step
