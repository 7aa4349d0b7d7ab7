"""What a drafter hands the round loop: the draft tokens of a round (``Proposal``), and the one
autoregressive chain loop every drafter that drafts token by token shares (``draft_chain``).

It sits below both sides of a round: the drafters (``drafters``, the kinds' own) build proposals,
verification (``verify``) reads them; neither side imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import process_logits, sample


@dataclass
class Proposal:
    """The draft tokens of one round and what the acceptance rule needs to know about them."""

    tokens: torch.Tensor  # (B, G) drafted tokens; a row's entries after counts[b] are not proposed
    probs: torch.Tensor | None  # (B, G, V) processed q each token was drawn from; None: argmax (q one-hot)
    counts: torch.Tensor  # (B,) tokens proposed per sequence, <= G
    # (B, G+1, H): hidden states of the verification inputs [x_n, d_1 .. d_G] after the layers the
    # draft shares with the target, when it does (the target starts from them); else None.
    reusable: torch.Tensor | None = None
    # (B, G): the draft's probability of each drafted token (processed q when sampling, softmax when
    # greedy), the evidence pacing reads before any verification; None when the round was not paced.
    confidence: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        """Draft forwards the round took (one per drafted position)."""
        return self.tokens.shape[1]


def draft_step(
    logits: torch.Tensor, options: DecodeOptions, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One draft token from draft logits (B, V): (token (B,), q (B, V) or None, confident (B,) or
    None, confidence (B,) or None).

    q is the processed distribution the token was drawn from, None when the draft took its argmax
    (q is then one-hot). ``confident`` is whether ``max q`` reaches the confidence threshold;
    ``confidence`` (with ``options.pace``) is the probability the draft gave its token. Both are
    judged on the processed distribution, as when sampling (a greedy draft: the plain softmax).
    """
    sampling = options.sampling
    if sampling.greedy or options.draft_greedy:
        token, q = logits.argmax(-1), None
    else:
        q = process_logits(logits, sampling)
        token = sample(q, generator)
    if options.confidence_threshold is None and not options.pace:
        return token, q, None, None
    judged = q
    if judged is None:
        judged = logits.float().softmax(-1) if sampling.greedy else process_logits(logits, sampling)
    confident = None
    if options.confidence_threshold is not None:
        confident = judged.max(-1).values >= options.confidence_threshold
    confidence = judged.gather(-1, token[:, None])[:, 0].float() if options.pace else None
    return token, q, confident, confidence


def stack_proposal(
    drafted: list[torch.Tensor],
    probs: list[torch.Tensor],
    counts: torch.Tensor,
    confidence: list[torch.Tensor] | None = None,
) -> Proposal:
    """A ``Proposal`` from per-step tokens (B,), q (B, V) (empty when drafted greedily) and the
    draft's probability of each token (B,) (empty or None when not computed)."""
    empty = torch.zeros(len(counts), 0, dtype=torch.long, device=counts.device)
    tokens = torch.stack(drafted, 1) if drafted else empty
    return Proposal(
        tokens=tokens,
        probs=torch.stack(probs, 1) if probs else None,
        counts=counts,
        confidence=torch.stack(confidence, 1) if confidence else None,
    )


# next_logits(token, active): the draft's logits (B, V) for its next position. token (B,): the
# token just drafted, to feed first (None on the first call: the drafter feeds what it has not read);
# active (B,) bool: the sequences still drafting (the others feed padding).
NextLogits = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]


def draft_chain(
    next_logits: NextLogits, budget: torch.Tensor, options: DecodeOptions, generator: torch.Generator | None
) -> Proposal:
    """Up to ``budget[b]`` (B,) tokens per sequence, one ``next_logits`` call per position.

    A sequence stops after its budget, or (dynamic gamma) after a token whose ``max q`` is below the
    confidence threshold; the chain ends when every sequence has stopped, so the last drafted token
    is fed only when another one is drafted after it."""
    active = budget > 0
    counts = torch.zeros_like(budget)
    drafted: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    confidence: list[torch.Tensor] = []
    token = None
    for i in range(int(budget.max()) if len(budget) else 0):
        token, q, confident, sure = draft_step(next_logits(token, active), options, generator)
        drafted.append(token)
        if q is not None:
            probs.append(q)
        if sure is not None:
            confidence.append(sure)
        counts += active.long()
        if confident is not None:
            active &= confident
        active &= budget > i + 1
        if not bool(active.any()):
            break
    return stack_proposal(drafted, probs, counts, confidence)
