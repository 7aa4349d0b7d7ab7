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
from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.distill.data import Answering, collate, generate_responses, target_examples
from draftsmith.specdec.sampling import SamplingParams


def example_prompt(example: dict) -> list[int]:
    """The tokens before the first one the loss covers: the prompt the answer was given to."""
    first = example["loss_mask"].index(1)
    return example["input_ids"][: first + 1]


class OnPolicyMixer:
    def __init__(
        self,
        prompts: list[list[int]],
        fraction: float,
        refresh_steps: int,
        pool_size: int,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_ids: frozenset[int],
        seed: int,
        batch_size: int,
        max_length: int,
        pad_id: int,
        process_index: int,
    ):
        self.prompts, self.fraction, self.refresh_steps = prompts, fraction, refresh_steps
        self.pool_size, self.max_new_tokens, self.sampling = pool_size, max_new_tokens, sampling
        self.eos_ids, self.seed, self.batch_size, self.max_length = eos_ids, seed, batch_size, max_length
        self.pad_id, self.process_index = pad_id, process_index
        self.pool: list[dict] = []

    def due(self, step: int) -> bool:
        return step % self.refresh_steps == 0

    @torch.no_grad()
    def refresh(self, draft: PreTrainedModel, step: int, progress: bool) -> None:
        """Regenerate the pool: the draft's answers to ``pool_size`` training prompts drawn for this step."""
        rng = random.Random(f"{self.seed}-pool-{step}")
        chosen = rng.sample(self.prompts, min(self.pool_size, len(self.prompts)))
        was_training = draft.training
        draft.eval()
        answering = Answering(self.max_new_tokens, self.sampling, self.eos_ids, batch_size=16, seed=self.seed + step)
        answers = generate_responses(draft, chosen, answering, desc="draft answers", progress=progress)
        draft.train(was_training)
        self.pool = target_examples(chosen, answers, self.max_length)

    def maybe_replace(self, batch: dict, step: int, micro: int, device: torch.device) -> dict:
        """With probability ``fraction``, a micro-batch of draft answers instead of ``batch``."""
        rng = random.Random(f"{self.seed}-{step}-{micro}-{self.process_index}")
        if not self.pool or rng.random() >= self.fraction:
            return batch
        examples = [rng.choice(self.pool) for _ in range(self.batch_size)]
        return {k: v.to(device) for k, v in collate(examples, self.pad_id).items()}

    def save(self, folder: Path) -> None:
        (folder / "on_policy_pool.json").write_text(json.dumps(self.pool))

    def load(self, folder: Path) -> None:
        path = folder / "on_policy_pool.json"
        self.pool = json.loads(path.read_text()) if path.is_file() else []
