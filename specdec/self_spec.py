"""Self-speculative decoding with KV reuse: the draft is the target's first k layers plus an exit head
(``distill.early_exit.EarlyExitDraft``), and draft and target share one cache for those layers.

One round, batch size 1 (SPEC.md section 2, KV reuse (b)):

1. draft   each fed token runs the shared layers 0..k-1 (writing their cache, keeping the layer-k
           hidden state) and the exit head, which proposes the next token;
2. verify  the last proposal runs the shared layers too; then the target runs only its layers
           k..L-1 over the layer-k states of ``[x_n, d_1 .. d_g]``: one forward of L-k layers;
3. accept / correct exactly as ``decoder.speculative_generate`` (same ``sampling`` functions);
4. rollback every layer holds the same positions after a round, so one crop of the shared cache.

The draft's keys and values for layers 0..k-1 are exactly those the target would compute (same
weights, same inputs), so the output is the target's: greedy identical, sampling exact.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from draftsmith.specdec.attention import use_exact_attention
from draftsmith.specdec.cache import SlotCache
from draftsmith.specdec.decoder import (
    DecodeStats,
    _check_prompts,
    _choose,
    _Clock,
    _Outputs,
    accept,
    needs_row_padding,
    propose,
)
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import SamplingParams


def _upper_logits(
    target: PreTrainedModel, k: int, hidden: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int = 0
) -> torch.Tensor:
    """The target's layers k..L-1, norm and head over layer-k hidden states (1, Q, H) -> (1, K, V)."""
    decoder = target.get_decoder()
    mask = create_causal_mask(
        config=target.config,
        inputs_embeds=hidden,
        attention_mask=None,
        cache=cache,
        position_ids=positions,
        layer_idx=k,
    )
    rotary = decoder.rotary_emb(hidden, position_ids=positions)
    for layer in decoder.layers[k:]:
        hidden = layer(
            hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions, cache=cache, use_cache=True
        )
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    return target.get_output_embeddings()(decoder.norm(hidden))


def _two_rows(run, inputs: torch.Tensor, pos: torch.Tensor, cache_layers) -> torch.Tensor:
    """``run(inputs, pos)`` for one position, fed as two rows (the second a copy whose slot in
    ``cache_layers`` is dropped again), so that it computes exactly what the target's own two-row
    single-token steps compute (see ``decoder._Stream``). Returns the first row's output."""
    out = run(torch.cat([inputs, inputs], 1), pos.repeat(1, 2))
    for layer in cache_layers:
        layer.crop(-1)
    return out[:, :1]


def _lower_one(draft, token: int, pos: torch.Tensor, cache, pad: bool) -> torch.Tensor:
    """One token through the shared layers (1, 1, H); with ``pad`` as two rows (``_two_rows``)."""
    ids = torch.tensor([[token]], device=pos.device)
    if not pad:
        return draft.lower(ids, pos, cache)
    return _two_rows(lambda x, p: draft.lower(x, p, cache), ids, pos, cache.layers[: draft.k])


@torch.inference_mode()
def self_speculative_generate(
    target: PreTrainedModel,
    draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    gamma: int = 4,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    cache_kind: str | None = None,
    draft_greedy: bool = False,
    confidence_threshold: float | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Speculative decoding of one prompt with an early-exit draft that shares the target's cache."""
    _check_prompts(prompts, max_new_tokens)
    use_exact_attention(target)
    if len(prompts) != 1:
        raise DraftsmithError("KV reuse decodes one sequence at a time; use --batch-size 1 or --no-kv-reuse")
    if cache_kind not in (None, "slot"):
        raise DraftsmithError("KV reuse uses the slot cache; drop --cache or use --no-kv-reuse")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    device, k = target.device, draft.k
    pad = needs_row_padding(target)
    stats = DecodeStats(batch_size=1, seq_proposed=[0], seq_accepted=[0])
    clock = _Clock(device)
    start = clock.last
    out = _Outputs(1, max_new_tokens, set(eos_ids))
    prompt = prompts[0]
    cache = SlotCache(draft.config.num_hidden_layers, len(prompt) + max_new_tokens + gamma + 2)

    def positions(first: int, count: int) -> torch.Tensor:
        return torch.arange(first, first + count, device=device)[None]

    # Prefill: the shared layers once, then the adapter and the target's upper layers on top.
    ids = torch.tensor([prompt], device=device)
    pos = positions(0, len(prompt))
    hidden = draft.lower(ids, pos, cache)
    draft.exit_logits(hidden, pos, cache, with_head=False)
    logits = _upper_logits(target, k, hidden, pos, cache, logits_to_keep=1)[:, -1]
    stats.target_forwards += 1
    stats.draft_forwards += 1
    stats.new_tokens += out.emit(0, _choose(logits, sampling, generator).tolist())
    stats.prefill_time += clock.lap()

    while not out.done[0]:
        committed = len(prompt) + len(out.tokens[0])
        budget = min(gamma, out.remaining(0) - 1)
        # 1. Draft: every fed token's layer-k state is kept for the verification.
        feed, states, drafted, probs = out.tokens[0][-1], [], [], []
        for i in range(budget):
            pos = positions(committed - 1 + i, 1)
            h = _lower_one(draft, feed, pos, cache, pad)
            states.append(h)
            q_logits = draft.exit_logits(h, pos, cache, logits_to_keep=1)[:, -1]  # (1, V)
            token, q, confident = propose(q_logits, sampling, draft_greedy, confidence_threshold, generator)
            if q is not None:
                probs.append(q)
            drafted.append(token)
            feed = int(token)
            if confident is not None and not bool(confident):
                break
        stats.draft_forwards += len(drafted)
        stats.draft_time += clock.lap()

        # 2. Verify: the last token through the shared layers, then the target's upper layers only.
        g = len(drafted)
        pos = positions(committed - 1 + g, 1)
        h = _lower_one(draft, feed, pos, cache, pad)
        draft.exit_logits(h, pos, cache, with_head=False)
        states.append(h)
        if pad and g == 0:  # one row: through two, as in _lower_one
            upper = cache.layers[k : target.config.num_hidden_layers]
            target_logits = _two_rows(lambda x, p: _upper_logits(target, k, x, p, cache), h, pos, upper)
        else:
            target_logits = _upper_logits(target, k, torch.cat(states, 1), positions(committed - 1, g + 1), cache)
        stats.target_forwards += 1
        stats.verify_time += clock.lap()

        # 3-4. Accept and correct.
        d = torch.stack(drafted, 1) if g else torch.zeros(1, 0, dtype=torch.long, device=device)
        n_proposed = torch.tensor([g], device=device)
        n_accepted, next_token = accept(d, probs, target_logits, n_proposed, sampling, generator)
        n = int(n_accepted)
        kept = out.emit(0, d[0, :n].tolist() + [int(next_token)])
        stats.new_tokens += kept
        stats.round_tokens += kept
        stats.proposed += g
        stats.accepted += n
        stats.seq_proposed[0] += g
        stats.seq_accepted[0] += n
        # 5. Rollback: every layer holds [.., x_n, d_1 .. d_g]; keep up to d_n (the new token is pending).
        cache.crop(-(g - n))
        stats.rounds += 1
        stats.seq_rounds += 1
        stats.other_time += clock.lap()
    stats.total_time = clock.now() - start
    return out.tokens, stats


@torch.inference_mode()
def measure_verify_saving(target: PreTrainedModel, draft, gamma: int, context: int = 128, reps: int = 9) -> dict:
    """Time one verification pass over gamma+1 tokens with KV reuse and without, on the same context.

    With reuse the pass is the draft's shared layers for the last token plus the target's layers
    k..L-1 over all gamma+1; without, the full target over gamma+1. Returns both (median seconds)
    and the fraction of verification time saved.
    """
    device, clock = target.device, _Clock(target.device)
    prompt = torch.arange(1, context + 1, device=device)[None] % target.config.vocab_size
    tokens = torch.arange(context + 1, context + gamma + 2, device=device)[None] % target.config.vocab_size
    pos = torch.arange(context, context + gamma + 1, device=device)[None]
    shared = SlotCache(draft.config.num_hidden_layers, context + gamma + 2)
    context_pos = torch.arange(context, device=device)[None]
    hidden = draft.lower(prompt, context_pos, shared)
    draft.exit_logits(hidden, context_pos, shared, with_head=False)
    _upper_logits(target, draft.k, hidden, context_pos, shared, logits_to_keep=1)
    full = SlotCache(target.config.num_hidden_layers, context + gamma + 2)
    target(input_ids=prompt, cache=full, use_cache=True, logits_to_keep=1)
    times = {"reuse": [], "full": []}
    for _ in range(reps):
        # The draft has already run the shared layers for the first gamma tokens during drafting.
        states = draft.lower(tokens[:, :gamma], pos[:, :gamma], shared)
        draft.exit_logits(states, pos[:, :gamma], shared, with_head=False)
        clock.lap()
        last = draft.lower(tokens[:, gamma:], pos[:, gamma:], shared)
        draft.exit_logits(last, pos[:, gamma:], shared, with_head=False)
        _upper_logits(target, draft.k, torch.cat([states, last], 1), pos, shared)
        times["reuse"].append(clock.lap())
        shared.crop(-(gamma + 1))
        target(input_ids=tokens, position_ids=pos, cache=full, use_cache=True)
        times["full"].append(clock.lap())
        full.crop(-(gamma + 1))
    reuse, full_t = sorted(times["reuse"])[reps // 2], sorted(times["full"])[reps // 2]
    return {"verify_s_kv_reuse": reuse, "verify_s_full": full_t, "verify_time_saved": 1 - reuse / full_t}
