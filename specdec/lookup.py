"""A free guess for a paused round: the token that followed the sequence's latest n-gram where it
occurred before, in the prompt or the answer so far (prompt lookup).

A round the pacer pauses still runs one target forward, and with row-exact pauses (the default) that
forward already carries two rows for one sequence: x_n and a padding row. Putting a guess in the
second row costs nothing more, and where the guess is the target's token the round emits two
tokens instead of one. Answers repeat their prompt and themselves (names, numbers, code, a
translated sentence's proper nouns, a summary's phrases); ``benchmarks/pacing.py`` counts how
often the guess is the target's token on real answers.

A guess is a proposal of one token with q one-hot on it, so the acceptance rule keeps the output
exact: greedy keeps it iff it is the target's argmax; sampling keeps it with probability p(guess) and
otherwise draws from p without it, renormalized, which is the target's distribution. It is not
the draft's token: acceptance counts (alpha) and the pacer's estimates leave it out.
"""

from __future__ import annotations

import dataclasses

import torch

from draftsmith.specdec.proposal import Proposal

MAX_NGRAM = 3  # the longest n-gram looked up; shorter ones are tried when it has not occurred


def lookup_guess(sequence: list[int], max_ngram: int = MAX_NGRAM) -> int | None:
    """The token after the latest earlier occurrence of ``sequence``'s last n tokens, for the longest
    n <= ``max_ngram`` that occurred before; None when not even the last token did."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = sequence[length - n :]
        first = tail[0]
        for start in range(length - n - 1, -1, -1):
            if sequence[start] == first and sequence[start : start + n] == tail:
                return sequence[start + n]
    return None


def with_guesses(proposal: Proposal, guesses: list[int | None]) -> tuple[Proposal, torch.Tensor]:
    """``proposal`` with ``guesses[b]`` as the one token of each row b that has a guess (those rows
    proposed nothing), q one-hot on it where the proposal carries q; and which rows are guesses (B,)."""
    device = proposal.counts.device
    guessed = torch.tensor([g is not None for g in guesses], dtype=torch.bool, device=device)
    if not bool(guessed.any()):
        return proposal, guessed
    rows = guessed.nonzero()[:, 0]
    if bool(proposal.counts[rows].any()):
        raise ValueError("a guess goes only to a row that proposed nothing")
    guess = torch.tensor([g for g in guesses if g is not None], dtype=torch.long, device=device)
    tokens = proposal.tokens
    tokens = torch.zeros(len(guesses), 1, dtype=torch.long, device=device) if tokens.shape[1] == 0 else tokens.clone()
    tokens[rows, 0] = guess
    counts = proposal.counts.clone()
    counts[rows] = 1
    probs = proposal.probs
    if probs is not None:  # some row drew its tokens from q: the guess rows' q is one-hot
        probs = probs.clone()
        probs[rows, 0] = 0
        probs[rows, 0, guess] = 1
    return dataclasses.replace(proposal, tokens=tokens, counts=counts, probs=probs), guessed
