"""Self-speculative decoding with KV reuse: the draft is the target's own first k layers plus an exit
head, and draft and target share one cache.

One round, batch size 1 (Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et al. 2024):

1. draft   every fed token runs the target's layers 0..k-1 (writing their cache) and the exit
           head, which proposes the next token; the last proposal runs the shared layers too, so
           the layer-k hidden states of all of ``[x_n, d_1 .. d_g]`` are ready for the target;
2. verify  the target runs only its layers k..L-1 over those states: one forward of L-k layers;
3. accept / commit as for any draft (``decoder.speculative_generate``); every layer then holds
           the same positions, so rolling back is one crop of the shared cache.

The decoder runs the shared layers itself, on the target, so the keys and values they leave in the
cache are exactly the target's: the output is the target's (greedy identical, sampling exact). A
draft only has to satisfy ``EarlyExit``: say where it exits and turn layer-k states into logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch
from transformers import Cache, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from draftsmith.specdec.attention import use_exact_attention
from draftsmith.specdec.cache import SlotCache, select_batch
from draftsmith.specdec.drafters import Proposal, draft_step, stack_proposal
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.stream import decoding_threads, needs_row_padding, standard_strides_into_head
from draftsmith.specdec.timing import Clock
from draftsmith.specdec.verify import TargetVerifier


@runtime_checkable
class EarlyExit(Protocol):
    """A draft made of the target's first ``k`` decoder layers (shared, frozen) and an exit head.

    ``config.num_hidden_layers`` counts the cache layers the pair needs: the target's L, plus any
    the exit head writes itself (at indices L and up). ``exit_logits`` turns layer-k hidden states
    (B, Q, H) into draft logits (B, K, V), writing the head's own cache layers; with
    ``with_head=False`` it only writes them (a token the draft reads but does not predict from).
    """

    k: int
    config: PreTrainedConfig

    def exit_logits(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache | None,
        *,
        logits_to_keep: int = 0,
        with_head: bool = True,
    ) -> torch.Tensor | None: ...


def run_layers(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache | None,
    layers: range,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states (B, Q, H) through the decoder layers ``layers`` of ``model``, writing their cache."""
    decoder = model.get_decoder()
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        layer_idx=layers.start,
    )
    rotary = decoder.rotary_emb(hidden, position_ids=position_ids)
    for layer in decoder.layers[layers.start : layers.stop]:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
    return hidden


def _two_rows(run: Callable, inputs: torch.Tensor, positions: torch.Tensor, cache_layers) -> torch.Tensor:
    """``run(inputs, positions)`` for one position, fed as two rows (the second a copy whose slot in
    ``cache_layers`` is dropped again), so that it computes exactly what the target's own two-row
    single-token steps compute (``stream.ModelStream``). Returns the first row's output."""
    out = run(torch.cat([inputs, inputs], 1), positions.repeat(1, 2))
    for layer in cache_layers:
        layer.crop(-1)
    return out[:, :1]


def _crop_to(cache: Cache, keep: torch.Tensor) -> None:
    """Keep the first ``keep[0]`` positions of every layer (one sequence)."""
    dropped = cache.get_seq_length() - int(keep[0])
    if dropped > 0:
        cache.crop(-dropped)


class SharedLayersDrafter:
    """An ``EarlyExit`` draft as drafter, on the cache it shares with the target (one sequence)."""

    def __init__(self, target: PreTrainedModel, draft: EarlyExit, capacity: int):
        self.target, self.draft, self.k = target, draft, draft.k
        self.cache = SlotCache(draft.config.num_hidden_layers, capacity)
        self.pad = needs_row_padding(target)

    def _positions(self, count: int) -> torch.Tensor:
        first = self.cache.get_seq_length()
        return torch.arange(first, first + count, device=self.target.device)[None]

    def _lower(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens (1, Q) through the shared layers (1, Q, H); one token as two rows in 16-bit dtypes."""

        def run(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            embeds = self.target.get_decoder().embed_tokens(ids)
            return run_layers(self.target, embeds, pos, self.cache, range(0, self.k))

        if self.pad and tokens.shape[1] == 1:
            return _two_rows(run, tokens, positions, self.cache.layers[: self.k])
        return run(tokens, positions)

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens (1, Q) the draft sees but predicts nothing from; their layer-k states (1, Q, H)."""
        positions = self._positions(tokens.shape[1])
        hidden = self._lower(tokens, positions)
        self.draft.exit_logits(hidden, positions, self.cache, with_head=False)
        return hidden

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.read(tokens)

    def propose(
        self,
        sequences: list[list[int]],
        budget: torch.Tensor,
        options: DecodeOptions,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Up to ``budget[0]`` tokens; ``reusable`` holds the layer-k states of ``[x_n, d_1 .. d_g]``."""
        feed = torch.tensor([sequences[0][self.cache.get_seq_length() :]], device=self.target.device)
        drafted, probs, states = [], [], []
        for _ in range(int(budget[0])):
            positions = self._positions(feed.shape[1])
            hidden = self._lower(feed, positions)  # (1, Q, H)
            states.append(hidden[:, -1:])
            logits = self.draft.exit_logits(hidden, positions, self.cache, logits_to_keep=1)[:, -1]
            token, q, confident = draft_step(logits, options, generator)  # (1,), (1, V) or None
            drafted.append(token)
            if q is not None:
                probs.append(q)
            feed = token[:, None]
            if confident is not None and not bool(confident):
                break
        states.append(self.read(feed)[:, -1:])  # the last proposal (or x_n): the target needs its state
        proposal = stack_proposal(drafted, probs, torch.tensor([len(drafted)], device=self.target.device))
        proposal.reusable = torch.cat(states, 1)  # (1, g+1, H)
        return proposal

    def rollback(self, keep: torch.Tensor) -> None:
        _crop_to(self.cache, keep)

    def select(self, rows: torch.Tensor) -> None:
        select_batch(self.cache, rows)


class UpperLayersVerifier:
    """The target's layers k..L-1 over the layer-k states the drafter left, on the shared cache.

    ``widths`` as ``verify.TargetVerifier``'s: padding states after the real ones, dropped from
    the upper layers right after the forward.
    """

    def __init__(self, target: PreTrainedModel, drafter: SharedLayersDrafter, widths: Mapping[int, int]):
        self.target, self.k, self.cache = target, drafter.k, drafter.cache
        self.upper_layers = self.cache.layers[self.k : target.config.num_hidden_layers]
        self.pad, self.widths = drafter.pad, widths

    def _logits(self, hidden: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """(1, Q, H) layer-k states -> (1, K, V) target logits."""
        layers = range(self.k, self.target.config.num_hidden_layers)
        hidden = run_layers(self.target, hidden, positions, self.cache, layers)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.target.get_output_embeddings()(self.target.get_decoder().norm(hidden))

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(reusable.shape[1], device=reusable.device)[None]
        return self._logits(reusable, positions, logits_to_keep=1)[:, -1]

    def verify(self, inputs: torch.Tensor, valid: torch.Tensor, reusable: torch.Tensor) -> torch.Tensor:
        """Logits (1, Q, V) over ``inputs`` (1, Q), from their layer-k states ``reusable`` (1, Q, H)."""
        q = inputs.shape[1]
        width = self.widths.get(q, q)
        first = self.upper_layers[0].get_seq_length()
        positions = torch.arange(first, first + width, device=inputs.device)[None]
        if self.pad and width == 1:
            return _two_rows(self._logits, reusable, positions, self.upper_layers)
        hidden = torch.nn.functional.pad(reusable, (0, 0, 0, width - q))  # (1, width, H)
        logits = self._logits(hidden, positions)[:, :q]
        if width > q:
            for layer in self.upper_layers:
                layer.crop(q - width)  # the padding: every layer holds the same positions again
        return logits

    def rollback(self, keep: torch.Tensor) -> None:
        _crop_to(self.cache, keep)  # whichever of the pair rolls back first crops; the other finds it done

    def select(self, rows: torch.Tensor) -> None:
        """Nothing to do: the drafter selects the rows of the shared cache."""


def shared_layers_pair(
    target: PreTrainedModel, draft: EarlyExit, batch_size: int, capacity: int, options: DecodeOptions
) -> tuple[UpperLayersVerifier, SharedLayersDrafter]:
    """Verifier and drafter sharing one cache, for an ``EarlyExit`` draft of ``target``."""
    if batch_size != 1:
        raise DraftsmithError("KV reuse decodes one sequence at a time; use --batch-size 1 or --no-kv-reuse")
    if options.cache_kind not in (None, "slot"):
        raise DraftsmithError("KV reuse uses the slot cache; drop --cache or use --no-kv-reuse")
    if not 1 <= draft.k < target.config.num_hidden_layers:
        layers = target.config.num_hidden_layers
        raise DraftsmithError(f"an early-exit draft shares 1..{layers - 1} of the target's layers, not {draft.k}")
    use_exact_attention(target)
    standard_strides_into_head(target)
    drafter = SharedLayersDrafter(target, draft, capacity)
    return UpperLayersVerifier(target, drafter, options.verify_widths), drafter


@torch.inference_mode()
def measure_verify_saving(
    target: PreTrainedModel, draft: EarlyExit, gamma: int, context: int = 128, reps: int = 9
) -> dict[str, float]:
    """Time one verification pass over gamma+1 tokens with KV reuse and without, on the same context.

    With reuse the pass is the draft's shared layers for the last token plus the target's layers
    k..L-1 over all gamma+1; without, the full target over gamma+1. Returns both (median seconds)
    and the fraction of verification time saved.
    """
    device, clock = target.device, Clock(target.device)
    vocab = target.config.vocab_size
    prompt = torch.arange(1, context + 1, device=device)[None] % vocab
    tokens = torch.arange(context + 1, context + gamma + 2, device=device)[None] % vocab
    valid, prompt_valid = torch.ones_like(tokens, dtype=torch.bool), torch.ones_like(prompt, dtype=torch.bool)
    keep = torch.tensor([context], device=device)
    upper, shared = shared_layers_pair(target, draft, 1, context + gamma + 2, DecodeOptions(gamma=gamma))
    full = TargetVerifier(target, 1, context + gamma + 2, "slot", widths={})
    times: dict[str, list[float]] = {"reuse": [], "full": []}
    with decoding_threads(target):
        upper.prefill(prompt, prompt_valid, shared.prefill(prompt, prompt_valid))
        full.prefill(prompt, prompt_valid)
        for _ in range(reps):
            drafted = shared.read(tokens[:, :gamma])  # done while drafting, before verification starts
            clock.lap()
            upper.verify(tokens, valid, torch.cat([drafted, shared.read(tokens[:, gamma:])], 1))
            times["reuse"].append(clock.lap())
            shared.rollback(keep)
            full.verify(tokens, valid)
            times["full"].append(clock.lap())
            full.rollback(keep)
    reuse, full_s = sorted(times["reuse"])[reps // 2], sorted(times["full"])[reps // 2]
    return {"verify_s_kv_reuse": reuse, "verify_s_full": full_s, "verify_time_saved": 1 - reuse / full_s}
