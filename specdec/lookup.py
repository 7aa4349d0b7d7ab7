"""Lookup guesses: the tokens that followed the sequence's latest n-gram where it occurred before, in
the prompt or the answer so far (prompt lookup), verified beside or instead of the draft's tokens.

Answers repeat their prompt and themselves (names, numbers, code, a translated sentence's proper
nouns, a summary's phrases), and a verification forward costs little more per extra row on the
target (a row-exact step of one sequence already carries two rows). So a round verifies tokens
copied from the sequence itself:

- where the sequence's last ``STRONG_NGRAM`` or more tokens occurred before, the continuation of
  that occurrence instead of the draft's tokens (a lookup round: on the quickstart's draft and its
  held-out answers such a continuation's first token was the target's 0.47 of the time after a
  repeated bigram and 0.61 after a trigram, the draft's 0.27);
- in a round the pacer pauses, the continuation of any repeated n-gram, in the row a row-exact
  pause pads anyway and after it;
- after a drafted chain, the continuation of the sequence with the chain, where that repeats
  ``STRONG_NGRAM`` tokens or more (a guess there counts only where the whole chain was kept).

Where the copy is the target's text the round emits those tokens too; ``benchmarks/pacing.py``
counts how often they are on real answers.

A guess is a proposal with q one-hot on its token, so the acceptance rule keeps the output exact:
greedy keeps it iff it is the target's argmax; sampling keeps it with probability p(guess) and
otherwise draws from p without it, renormalized, which is the target's distribution. Guesses are
not the draft's tokens: acceptance counts (alpha) and the pacer's estimate of the draft leave them out.
"""

from __future__ import annotations

import dataclasses

import torch

from draftsmith.specdec.proposal import Proposal

MAX_NGRAM = 3  # the longest n-gram looked up; shorter ones are tried when it has not occurred
STRONG_NGRAM = 2  # a repeat at least this long is verified instead of a draft, or after a drafted chain


def lookup_continuation(sequence: list[int], length: int, max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """Up to ``length`` tokens that followed an earlier occurrence of ``sequence``'s last n tokens, for
    the longest n <= ``max_ngram`` that occurred before: the latest occurrence followed by ``length``
    tokens, else the latest one (in a run such as ``a b a b a`` the latest is followed by one token
    only, an earlier one by more); and n. ([], 0) when not even the last token occurred before, or
    ``length`` is 0."""
    size = len(sequence)
    if length < 1:
        return [], 0
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = sequence[size - n :]
        first, latest = tail[0], None
        for start in range(size - n - 1, -1, -1):
            if sequence[start] == first and sequence[start : start + n] == tail:
                if start + n + length <= size:
                    return sequence[start + n : start + n + length], n
                latest = latest if latest is not None else sequence[start + n :]
        if latest is not None:
            return latest, n
    return [], 0


def with_guesses(proposal: Proposal, guesses: list[list[int]]) -> Proposal:
    """``proposal`` with ``guesses[b]`` appended after row b's proposed tokens, q one-hot on each
    guess where the proposal carries q (its confidence, the draft's, is padded with zeros)."""
    added = [len(g) for g in guesses]
    if not any(added):
        return proposal
    device = proposal.counts.device
    counts = proposal.counts.tolist()
    width = max(c + a for c, a in zip(counts, added, strict=True))
    grow = max(width - proposal.tokens.shape[1], 0)
    tokens = torch.nn.functional.pad(proposal.tokens, (0, grow))
    probs = proposal.probs
    if probs is not None:  # some row drew its tokens from q: the guesses' q is one-hot
        probs = torch.nn.functional.pad(probs, (0, 0, 0, grow))
    for row, (start, guess) in enumerate(zip(counts, guesses, strict=True)):
        if guess:
            span = slice(start, start + len(guess))
            tokens[row, span] = torch.tensor(guess, dtype=torch.long, device=device)
            if probs is not None:
                probs[row, span] = 0
                probs[row, span].scatter_(-1, tokens[row, span, None], 1.0)
    confidence = proposal.confidence
    if confidence is not None:
        confidence = torch.nn.functional.pad(confidence, (0, grow))
    counts = proposal.counts + torch.tensor(added, dtype=proposal.counts.dtype, device=device)
    return dataclasses.replace(proposal, tokens=tokens, counts=counts, probs=probs, confidence=confidence)
