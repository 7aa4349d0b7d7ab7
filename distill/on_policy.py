"""On-policy data (DistillSpec, Zhou et al. 2023; GKD, Agarwal et al. 2024): the draft answers
training prompts itself, and a fraction lambda of the micro-batches train on those answers, with
the teacher's distributions still coming from the target. Drafts then learn on the prefixes they
actually produce when drafting, not only on the target's.

The pool of draft answers is regenerated every ``refresh_steps`` optimizer steps from the current
draft. Which micro-batches are replaced is a pure function of (seed, step, micro-batch, process),
and the pool is saved with each checkpoint, so a resumed run makes the same choices.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.distill.data import Answering, collate, generate_responses, target_examples
from draftsmith.specdec.sampling import SamplingParams


def example_prompt(example: dict) -> list[int]:
    """The tokens before the first one the loss covers: the prompt the answer was given to."""
    first = example["loss_mask"].index(1)
    return example["input_ids"][: first + 1]


@dataclass(frozen=True)
class OnPolicySettings:
    """What the mixer does.

    fraction: the share of micro-batches replaced by draft answers (lambda).
    refresh_steps: optimizer steps between two regenerations of the pool.
    pool_size: draft answers in the pool, to as many training prompts.
    max_new_tokens, sampling, eos_ids: how the draft answers.
    seed: fixes which prompts, which micro-batches and which answers.
    batch_size, max_length: a replacing micro-batch's sequences, and their longest.
    """

    fraction: float
    refresh_steps: int
    pool_size: int
    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: frozenset[int]
    seed: int
    batch_size: int
    max_length: int


class OnPolicyMixer:
    """Draft answers to ``prompts`` mixed into training (``OnPolicySettings``); ``pad_id`` pads the
    micro-batches it makes, ``process_index`` makes each process's choices its own."""

    def __init__(self, prompts: list[list[int]], settings: OnPolicySettings, pad_id: int, process_index: int):
        self.prompts, self.settings = prompts, settings
        self.pad_id, self.process_index = pad_id, process_index
        self.pool: list[dict] = []

    def due(self, step: int) -> bool:
        return step % self.settings.refresh_steps == 0

    @torch.no_grad()
    def refresh(self, draft: PreTrainedModel, step: int, progress: bool) -> None:
        """Regenerate the pool: the draft's answers to ``pool_size`` training prompts drawn for this step."""
        s = self.settings
        rng = random.Random(f"{s.seed}-pool-{step}")
        chosen = rng.sample(self.prompts, min(s.pool_size, len(self.prompts)))
        was_training = draft.training
        draft.eval()
        answering = Answering(s.max_new_tokens, s.sampling, s.eos_ids, batch_size=16, seed=s.seed + step)
        answers = generate_responses(draft, chosen, answering, desc="draft answers", progress=progress)
        draft.train(was_training)
        self.pool = target_examples(chosen, answers, s.max_length)

    def maybe_replace(self, batch: dict, step: int, micro: int, device: torch.device) -> dict:
        """With probability ``fraction``, a micro-batch of draft answers instead of ``batch``."""
        rng = random.Random(f"{self.settings.seed}-{step}-{micro}-{self.process_index}")
        if not self.pool or rng.random() >= self.settings.fraction:
            return batch
        examples = [rng.choice(self.pool) for _ in range(self.settings.batch_size)]
        return {k: v.to(device) for k, v in collate(examples, self.pad_id).items()}

    def save(self, folder: Path) -> None:
        (folder / "on_policy_pool.json").write_text(json.dumps(self.pool))

    def load(self, folder: Path) -> None:
        path = folder / "on_policy_pool.json"
        self.pool = json.loads(path.read_text()) if path.is_file() else []
