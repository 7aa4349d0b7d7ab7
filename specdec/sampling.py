"""Logit processing and the acceptance rule of speculative sampling.

The rule is Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"):
draft token ``d ~ q`` is kept with probability ``min(1, p(d) / q(d))``; at the first rejection one
token is drawn from the residual ``normalize(max(0, p - q))``. Kept-or-corrected tokens are then
distributed exactly as ``p``, because for every ``x``::

    q(x) * min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * residual(x) = min(p, q)(x) + max(0, p - q)(x) = p(x)

Exactness needs ``q`` to be the very distribution ``d`` was drawn from, so the same temperature,
top-k and top-p processing is applied to draft and target logits by ``process_logits``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.specdec.errors import DraftsmithError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax), and top-k/top-p are ignored."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise DraftsmithError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise DraftsmithError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise DraftsmithError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p: (..., V) logits -> (..., V) float32 probs.

    Top-p keeps the smallest prefix of tokens (by descending probability) whose mass reaches
    ``top_p``, always including the most likely token. Ties at the top-k boundary are all kept.
    """
    if params.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding takes the argmax of raw logits")
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p - q))`` over the last dim: (..., V), (..., V) -> (..., V).

    Where ``p <= q`` everywhere (so a rejection has probability 0) the residual is undefined; ``p``
    is returned there so that the caller never samples from an all-zero row.
    """
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def accept_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, n_proposed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep ``d_i`` while it equals the target's argmax.

    draft_tokens (B, G); target_logits (B, G+1, V), row i conditioned on d_1..d_i; n_proposed (B,)
    tokens actually drafted per sequence (<= G). Returns ``n_accepted`` (B,) and the next token
    (B,): the target's argmax at the first mismatch, or the bonus token after ``n_proposed``.
    """
    choice = target_logits.argmax(-1)  # (B, G+1)
    g = draft_tokens.shape[1]
    in_range = torch.arange(g, device=draft_tokens.device)[None, :] < n_proposed[:, None]
    matches = (draft_tokens == choice[:, :g]) & in_range
    n_accepted = matches.long().cumprod(1).sum(1)
    next_token = choice.gather(1, n_accepted[:, None]).squeeze(1)
    return n_accepted, next_token


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    n_proposed: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept ``d_i`` iff ``r_i < min(1, p_i(d_i) / q_i(d_i))``, ``r_i ~ U(0, 1)``.

    draft_tokens (B, G); draft_probs (B, G, V), the processed q each d_i was drawn from, or None
    when the draft chose greedily (q one-hot at d_i, so the test is ``r_i < p_i(d_i)``);
    target_probs (B, G+1, V) processed p; n_proposed (B,). Returns ``n_accepted`` (B,) and the
    next token (B,): drawn from the residual ``normalize(max(0, p - q))`` at the first rejection,
    or from ``p_{n+1}`` (the bonus) when all proposed tokens were accepted.
    """
    batch, g = draft_tokens.shape
    device = draft_tokens.device
    p_of_d = target_probs[:, :g].gather(2, draft_tokens[..., None]).squeeze(2)  # (B, G)
    if draft_probs is None:
        q_of_d = torch.ones_like(p_of_d)
    else:
        q_of_d = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    r = torch.rand(batch, g, device=device, generator=generator)
    # r < p/q  <=>  r * q < p  (q > 0 because d was drawn from q); this also covers min(1, .).
    keep = (r * q_of_d < p_of_d) & (torch.arange(g, device=device)[None, :] < n_proposed[:, None])
    n_accepted = keep.long().cumprod(1).sum(1)

    rows = torch.arange(batch, device=device)
    p_next = target_probs[rows, n_accepted]  # (B, V)
    rejected = n_accepted < n_proposed
    if g > 0:
        at = n_accepted.clamp(max=g - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, draft_tokens[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at]
        dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    else:
        dist = p_next
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return n_accepted, next_token


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from (B, V) probabilities -> (B,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def choose_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token per row from raw logits (B, V) -> (B,): the argmax when greedy, else a sample of
    the processed distribution."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(process_logits(logits, params), generator)
