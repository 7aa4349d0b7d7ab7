"""What theory predicts: the speedup of chain and token-tree rounds, and the per-position alpha behind a tau.

Leviathan et al. 2023 (Theorem 3.8): with per-position acceptance alpha, gamma draft tokens per
round, a draft step costing c target single-token steps and a verification forward costing v, a
round emits ``(1 - alpha^(gamma+1)) / (1 - alpha)`` tokens for ``gamma c + v`` steps.
"""

from __future__ import annotations

import math

from draftsmith.specdec.decoder import DecodeStats


def predicted_speedup(alpha: float, gamma: float, c: float, v: float = 1.0, forwards: float | None = None) -> float:
    """Expected speedup ``(1 - alpha^(gamma+1)) / ((1 - alpha) (forwards c + v))``.

    Leviathan et al. 2023, Theorem 3.8 (there ``v = 1`` and ``forwards = gamma``); ``v`` is the cost
    of the verification forward over gamma+1 tokens in single-token steps, ``forwards`` the draft
    forwards a round of gamma tokens takes (default gamma: one per token; a parallel draft takes one).
    At ``alpha = 1`` the limit is ``(gamma+1) / (forwards c + v)``.
    """
    expected_tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / ((gamma if forwards is None else forwards) * c + v)


def predicted_tree_speedup(spec: DecodeStats, c: float, v: float, calls: int) -> float | None:
    """Expected speedup of token-tree rounds: tau tokens per round for the round's draft forwards
    (one per level, each c single-token target steps) and one verification (v steps).

    There is no closed form in alpha as for chains (which tokens a tree offers depends on the draft's
    whole distribution), so tau is the measured one; ``spec`` sums ``calls`` decoding calls, whose
    draft prefills are not steps."""
    tau = spec.mean_accepted_tokens
    if tau is None or not spec.rounds or math.isnan(c) or math.isnan(v):
        return None
    draft_steps = (spec.draft_forwards - calls) / spec.rounds
    return tau / (draft_steps * c + v)


def acceptance_by_position(round_counts: list[tuple[int, int]], gamma: int) -> list[float | None]:
    """Per draft position j = 1..gamma, the share of rounds that reached j with a proposal there whose
    token j was accepted: ``P(d_j accepted | d_1 .. d_{j-1} accepted)``, from each round's
    (proposed, accepted) counts (``DecodeStats.round_counts``); None where no round reached j."""
    shares = []
    for j in range(1, gamma + 1):
        reached = [accepted >= j for proposed, accepted in round_counts if proposed >= j and accepted >= j - 1]
        shares.append(sum(reached) / len(reached) if reached else None)
    return shares


def alpha_from_tau(tau: float, gamma: int) -> float:
    """The per-position acceptance rate a that gives ``tau = (1 - a^(gamma+1)) / (1 - a)`` tokens per round.

    The measured acceptance rate (accepted / proposed) counts the draft tokens after the first
    rejection of a round as proposed, so for gamma > 1 it is lower than the chance that one
    position is accepted; this inverts the i.i.d. model of Leviathan et al. instead (bisection).
    At gamma = 1 both are the same number.
    """
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (gamma + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
