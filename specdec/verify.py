"""Verification and acceptance: the target scores a round's draft tokens in one forward, and the
acceptance rule keeps a prefix of them (``sampling.accept_greedy`` / ``sampling.accept_sampled``).

A verifier keeps the target's state across rounds and answers the round loop
(``decoder.speculative_generate``): ``prefill(tokens, valid, reusable)`` gives the logits after
each prompt, ``verify(inputs, valid, reusable)`` the logits (B, Q, V) of a verification forward over
``[x_n, d_1 .. d_g]``, both as a ``Verification`` that also carries the hidden states the drafter
asked for (its ``feature_layers``, computed in the same forward and nothing else); ``rollback`` /
``select`` as a drafter's; ``verify_tree`` / ``commit_tree`` for token-tree rounds. ``reusable`` is
what the draft computed that the target can start from (``drafters.Proposal.reusable``), or None.
Two implement it: ``TargetVerifier`` (the whole target on its own cache, here) and
``self_spec.UpperLayersVerifier`` (the target's layers above those the draft shares).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.clock import Clock
from draftsmith.specdec.compiled import make_stream
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.proposal import Proposal
from draftsmith.specdec.sampling import SamplingParams, accept_greedy, accept_sampled, process_logits
from draftsmith.specdec.stream import Verification, decoding_threads
from draftsmith.specdec.tree_drafting import Tree, keep_target_path, verify_tree


class Verifier(Protocol):
    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor | None) -> Verification:
        """The logits after each prompt (B, 1, V), hidden states at every prompt row."""
        ...

    def verify(self, inputs: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor | None) -> Verification: ...

    def rollback(self, keep: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...

    def verify_tree(self, last: int, tree: Tree) -> Verification:
        """One forward over ``[x_n, nodes...]`` of the one sequence (``tree_drafting.verify_tree``)."""
        ...

    def commit_tree(self, tree: Tree, path: list[int]) -> None: ...


def verification_inputs(last: torch.Tensor, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
    """``[x_n, d_1 .. d_G]`` (B, G+1) from the last committed tokens (B,), and which are real (B, G+1)."""
    inputs = torch.cat([last[:, None], proposal.tokens], 1)
    valid = torch.arange(inputs.shape[1], device=inputs.device)[None, :] <= proposal.counts[:, None]
    return inputs, valid


class TargetVerifier:
    """The whole target on its own cache. ``widths``: run a verification over q inputs as one over
    ``widths[q]`` (``DecodeOptions.verify_widths``); the padding sits after the real inputs, where
    no real query attends to it, and the next rollback drops it. ``compiled``: verification forwards
    are compiled graphs (``compiled.CompiledStream``), one per width. ``feature_layers``: the target
    layers whose entering hidden states every forward also returns (the drafter's). ``row_exact``:
    a forward of one token for one sequence steps as a verification would (``stream``)."""

    def __init__(
        self,
        target: PreTrainedModel,
        batch_size: int,
        capacity: int,
        cache_kind: str,
        widths: Mapping[int, int],
        compiled: bool = False,
        feature_layers: tuple[int, ...] = (),
        row_exact: bool = True,
    ):
        self.stream = make_stream(
            target, batch_size, capacity, cache_kind, role="target", compiled=compiled, row_exact=row_exact
        )
        self.widths = widths
        self.feature_layers = feature_layers

    @classmethod
    def for_options(
        cls,
        target: PreTrainedModel,
        batch_size: int,
        capacity: int,
        options: DecodeOptions,
        compiled: bool = False,
        feature_layers: tuple[int, ...] = (),
    ) -> TargetVerifier:
        """The verifier ``options`` ask for: their cache kind (the device's default when unset) and
        verification widths (none for a token tree, whose width is its node count)."""
        cache_kind = options.cache_kind or default_cache_kind(target.device)
        widths = options.verify_widths if options.tree is None else {}
        # A forward of one token for one sequence is a round where nothing drafts: paused, or the
        # last token of an answer; paused rounds step as plain decoding does when exact_pauses is off.
        row_exact = not options.pace or options.exact_pauses
        return cls(target, batch_size, capacity, cache_kind, widths, compiled, feature_layers, row_exact)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, reusable: None = None) -> Verification:
        """Logits after each prompt (B, 1, V)."""
        return self.stream.forward_features(tokens, valid, self.feature_layers, logits_to_keep=1)

    def verify(self, inputs: torch.Tensor, valid: torch.Tensor, reusable: None = None) -> Verification:
        """Logits (B, Q, V) of the target over ``inputs`` (B, Q) on top of its cache."""
        q = inputs.shape[1]
        pad = self.widths.get(q, q) - q
        padded_valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        out = self.stream.forward_features(torch.nn.functional.pad(inputs, (0, pad)), padded_valid, self.feature_layers)
        return Verification(out.logits[:, :q], {i: h[:, :q] for i, h in out.hidden.items()})

    def rollback(self, keep: torch.Tensor) -> None:
        self.stream.rollback(keep)

    def select(self, rows: torch.Tensor) -> None:
        self.stream.select(rows)

    def verify_tree(self, last: int, tree: Tree) -> Verification:
        return verify_tree(self.stream, last, tree, self.feature_layers)

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        keep_target_path(self.stream, tree, path)


def accept(
    proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_accepted (B,), next token (B,)) by the greedy or the sampling rule; target_logits (B, G+1, V).

    The next token is the target's correction at the first rejection, or the bonus token after a
    fully accepted proposal.
    """
    if sampling.greedy:
        return accept_greedy(proposal.tokens, target_logits, proposal.counts)
    target_probs = process_logits(target_logits, sampling)
    return accept_sampled(proposal.tokens, proposal.probs, target_probs, proposal.counts, generator)


def choose_verify_widths(cost: Mapping[int, float], max_tokens: int) -> dict[int, int]:
    """For each verification size q <= max_tokens, the cheapest width w >= q among those timed in
    ``cost`` (seconds per forward of w tokens), where it saves at least 10 %; sizes where padding
    does not pay are left out (the decoder then runs q as is)."""
    widths = {}
    for q in range(1, max_tokens + 1):
        best = min((w for w in cost if w >= q), key=cost.__getitem__)
        if cost[best] < 0.9 * cost[q]:
            widths[q] = best
    return widths


@torch.inference_mode()
def tune_verify_widths(
    model: PreTrainedModel, max_tokens: int, context: int = 128, reps: int = 5, compiled: bool = False
) -> dict[int, int]:
    """Verification widths for ``model`` on this machine (``choose_verify_widths``): every width up to
    ``max_tokens + 4`` timed on a ``context``-token cache, the median of ``reps`` forwards
    (``compiled``: of compiled forwards, each width run twice first: compilation, graph capture)."""
    device = model.device
    clock = Clock(device)
    capacity = context + max_tokens + 8
    stream = make_stream(model, 1, capacity, default_cache_kind(device), role="target", compiled=compiled)
    prompt = torch.arange(1, context + 1, device=device)[None] % model.config.vocab_size
    cost = {}
    with decoding_threads(model):
        stream.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
        for width in range(1, max_tokens + 5):
            x = torch.ones(1, width, dtype=torch.long, device=device)
            times = []
            for _ in range(reps + 2 if compiled else reps):
                clock.lap()
                stream.forward(x, torch.ones_like(x, dtype=torch.bool))
                times.append(clock.lap())
                stream.rollback(torch.tensor([context], device=device))
            cost[width] = sorted(times[-reps:])[reps // 2]
    return choose_verify_widths(cost, max_tokens)
