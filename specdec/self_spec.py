"""Self-speculative decoding with KV reuse, the target's side: the draft is the target's own first k
layers plus an exit head, draft and target share one cache, and verification runs only the upper
layers. The drafter's side belongs to the early-exit draft kind (``distill.drafts.early_exit``).

One round, batch size 1 (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024):

1. draft   every fed token runs the target's layers 0..k-1 (writing their cache) and the exit
           head, which proposes the next token; the last proposal runs the shared layers too, so
           the layer-k hidden states of all of ``[x_n, d_1 .. d_g]`` are ready for the target;
2. verify  the target runs only its layers k..L-1 over those states: one forward of L-k layers;
3. accept / commit as for any draft (``decoder.speculative_generate``); every layer then holds
           the same positions, so rolling back is one crop of the shared cache.

The shared layers run on the target itself, so the keys and values they leave in the cache are
exactly the target's: the output is the target's (greedy identical, sampling exact).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from transformers import Cache, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from draftsmith.specdec.cache import SlotCache
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.stream import Verification, needs_row_padding
from draftsmith.specdec.tree_drafting import Tree


def run_layers(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache | None,
    layers: range,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states (B, Q, H) through the decoder layers ``layers`` of ``model``, writing their cache."""
    modules = model.get_decoder().layers[layers.start : layers.stop]
    return run_modules(model, modules, layers.start, hidden, position_ids, cache, attention_mask)


def run_modules(
    model: PreTrainedModel,
    modules: Sequence[torch.nn.Module],
    first: int,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache | None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states (B, Q, H) through decoder layers ``modules`` of ``model``'s architecture whose cache
    indices start at ``first`` (its own layers, or a draft's layer beside them), with ``model``'s causal
    mask and rotary embedding, writing their cache."""
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        layer_idx=first,
    )
    rotary = model.get_decoder().rotary_emb(hidden, position_ids=position_ids)
    for layer in modules:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
    return hidden


def two_rows(run: Callable, inputs: torch.Tensor, positions: torch.Tensor, cache_layers) -> torch.Tensor:
    """``run(inputs, positions)`` for one position, fed as two rows (the second a copy whose slot in
    ``cache_layers`` is dropped again), so that it computes exactly what the target's own two-row
    single-token steps compute (``stream.ModelStream``). Returns the first row's output."""
    out = run(torch.cat([inputs, inputs], 1), positions.repeat(1, 2))
    for layer in cache_layers:
        layer.crop(-1)
    return out[:, :1]


def crop_to(cache: Cache, keep: torch.Tensor) -> None:
    """Keep the first ``keep[0]`` positions of every layer (one sequence)."""
    dropped = cache.get_seq_length() - int(keep[0])
    if dropped > 0:
        cache.crop(-dropped)


class UpperLayersVerifier:
    """The target's layers k..L-1 over the layer-k states the drafter left, on the shared cache.

    ``widths`` as ``verify.TargetVerifier``'s: padding states after the real ones, dropped from
    the upper layers right after the forward.
    """

    def __init__(self, target: PreTrainedModel, k: int, cache: SlotCache, widths: Mapping[int, int]):
        self.target, self.k, self.cache = target, k, cache
        self.upper_layers = self.cache.layers[self.k : target.config.num_hidden_layers]
        self.pad, self.widths = needs_row_padding(target), widths

    def _logits(self, hidden: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """(1, Q, H) layer-k states -> (1, K, V) target logits."""
        layers = range(self.k, self.target.config.num_hidden_layers)
        hidden = run_layers(self.target, hidden, positions, self.cache, layers)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.target.get_output_embeddings()(self.target.get_decoder().norm(hidden))

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor) -> Verification:
        positions = torch.arange(reusable.shape[1], device=reusable.device)[None]
        return Verification(self._logits(reusable, positions, logits_to_keep=1))

    def verify(self, inputs: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor) -> Verification:
        """Logits (1, Q, V) over ``inputs`` (1, Q), from their layer-k states ``reusable`` (1, Q, H)."""
        q = inputs.shape[1]
        width = self.widths.get(q, q)
        first = self.upper_layers[0].get_seq_length()
        positions = torch.arange(first, first + width, device=inputs.device)[None]
        if self.pad and width == 1:
            return Verification(two_rows(self._logits, reusable, positions, self.upper_layers))
        hidden = torch.nn.functional.pad(reusable, (0, 0, 0, width - q))  # (1, width, H)
        logits = self._logits(hidden, positions)[:, :q]
        if width > q:
            for layer in self.upper_layers:
                layer.crop(q - width)  # the padding: every layer holds the same positions again
        return Verification(logits)

    def rollback(self, keep: torch.Tensor) -> None:
        crop_to(self.cache, keep)  # whichever of the pair rolls back first crops; the other finds it done

    def select(self, rows: torch.Tensor) -> None:
        """Nothing to do: the drafter selects the rows of the shared cache."""

    def verify_tree(self, last: int, tree: Tree) -> Verification:
        raise DraftsmithError(TREE_REFUSED)

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        raise DraftsmithError(TREE_REFUSED)


# A tree's nodes are drafted on a cache of their own, which a verifier sharing the draft's cannot hold.
TREE_REFUSED = "the upper layers verify chains on the cache they share with the draft; decode trees standalone"
