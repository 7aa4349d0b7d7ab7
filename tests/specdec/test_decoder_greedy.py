"""Greedy speculative decoding is token-for-token the target's greedy decoding (fp32, on every device).

Each case runs eagerly on each cache kind and compiled (``DecodeOptions.compile``: the decoding steps
of both models as compiled graphs over static caches); the reference is always the target's eager
greedy decoding.
"""

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from draftsmith.specdec.cache import CACHE_KINDS
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.verify import choose_verify_widths, tune_verify_widths
from tests.helpers import noisy_copy, tiny_llama

PROMPTS = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4], [0], [0, 9, 9, 1, 2]]
KINDS = [*CACHE_KINDS, "compiled"]  # eager on each cache kind, or compiled over a static cache
MODES = {"eager": False, "compiled": True}


def decoding(kind: str, **fields) -> DecodeOptions:
    """Options that decode eagerly on cache ``kind``, or compiled."""
    if kind == "compiled":
        return DecodeOptions(compile=True, **fields)
    return DecodeOptions(cache_kind=kind, compile=False, **fields)


@pytest.fixture(scope="module")
def target(device):
    return tiny_llama(vocab=32, sharpness=8.0).to(device)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, noise=0.3)


def alone(model, prompts, n, cache_kind=None, **kw):
    """The target's own eager greedy output for each prompt decoded alone."""
    kind = None if cache_kind == "compiled" else cache_kind
    return [target_generate(model, [p], n, DecodeOptions(cache_kind=kind, compile=False), **kw)[0][0] for p in prompts]


@pytest.mark.parametrize("cache_kind", KINDS)
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_batch_of_one_matches_target(target, draft, cache_kind, gamma):
    ref = alone(target, PROMPTS, 24, cache_kind=cache_kind)
    for prompt, expected in zip(PROMPTS, ref, strict=True):
        out, stats = speculative_generate(target, draft, [prompt], 24, options=decoding(cache_kind, gamma=gamma))
        assert out[0] == expected
        assert len(out[0]) == 24
        assert stats.new_tokens == 24
        assert stats.round_tokens == 23  # the first token comes from the prefill
        assert stats.target_forwards == stats.rounds + 1


@pytest.mark.parametrize("cache_kind", KINDS)
@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_ragged_batches_match_each_prompt_alone(target, draft, cache_kind, batch_size, gamma):
    prompts = PROMPTS[:batch_size]
    ref = alone(target, prompts, 30, cache_kind=cache_kind)
    options = decoding(cache_kind, gamma=gamma)
    out, stats = speculative_generate(target, draft, prompts, 30, options=options)
    assert out == ref
    assert 0 < stats.accepted < stats.proposed  # a draft of middling quality: ragged acceptance
    base, _ = target_generate(target, prompts, 30, options)
    assert base == ref  # the batched baseline is exact too


@pytest.mark.parametrize("mode", MODES)
def test_sequences_finish_at_different_rounds(target, draft, mode):
    eos = 7
    ref = alone(target, PROMPTS, 40, eos_ids={eos})
    lengths = [len(r) for r in ref]
    assert len(set(lengths)) > 1, "the fixture should make sequences end at different points"
    options = DecodeOptions(gamma=4, compile=MODES[mode])
    out, _ = speculative_generate(target, draft, PROMPTS, 40, options=options, eos_ids={eos})
    assert out == ref
    for seq in out:
        assert eos not in seq[:-1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_target_as_its_own_draft_emits_gamma_plus_one_per_round(target, gamma, mode):
    rounds = 4
    n = 1 + rounds * (gamma + 1)  # the prefill's token, then full rounds
    options = DecodeOptions(gamma=gamma, compile=MODES[mode])
    out, stats = speculative_generate(target, target, PROMPTS[:3], n, options=options)
    assert out == alone(target, PROMPTS[:3], n)
    assert stats.rounds == rounds
    assert stats.mean_accepted_tokens == gamma + 1
    assert stats.acceptance_rate == 1.0


class FarPositionsInverted(LlamaForCausalLM):
    """The target's weights, but rows at positions >= 30 get inverted logits (its least likely token)."""

    def forward(self, input_ids, position_ids, **kwargs):
        out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        far = position_ids.max(1).values >= 30
        out.logits = torch.where(far[:, None, None], -out.logits, out.logits)
        return out


def test_one_sequence_accepts_everything_and_another_nothing(target):
    draft = FarPositionsInverted(target.config).eval().to(target.device)
    draft.load_state_dict(target.state_dict())
    short, long = [0, 5, 7, 9], [0] + [3, 4, 5, 6] * 10  # positions 0..16 and 41..53
    ref = alone(target, [short, long], 12)
    options = DecodeOptions(gamma=3, compile=False)
    out, stats = speculative_generate(target, draft, [short, long], 12, options=options)
    assert out == ref
    assert stats.seq_accepted[0] == stats.seq_proposed[0] > 0
    assert stats.seq_accepted[1] == 0 and stats.seq_proposed[1] > 0


@pytest.mark.parametrize("mode", MODES)
def test_disjoint_draft_accepts_nothing(target, mode):
    hopeless = noisy_copy(target, noise=0.0)
    with torch.no_grad():
        hopeless.lm_head.weight.neg_()  # its argmax is the target's least likely token
    options = DecodeOptions(gamma=4, compile=MODES[mode])
    out, stats = speculative_generate(target, hopeless, PROMPTS[:2], 15, options=options)
    assert out == alone(target, PROMPTS[:2], 15)
    assert stats.accepted == 0 and stats.proposed > 0
    assert stats.mean_accepted_tokens == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_eos_inside_an_accepted_block_ends_the_output(target, mode):
    full = alone(target, [PROMPTS[0]], 20)[0]
    eos = full[5]  # a token the target emits in the middle of a block when it drafts for itself
    first = full.index(eos)
    options = DecodeOptions(gamma=7, compile=MODES[mode])
    out, stats = speculative_generate(target, target, [PROMPTS[0]], 20, options=options, eos_ids={eos})
    assert out[0] == full[: first + 1]
    assert stats.new_tokens == first + 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_max_new_tokens_smaller_than_gamma(target, draft, max_new, mode):
    options = DecodeOptions(gamma=7, compile=MODES[mode])
    out, stats = speculative_generate(target, draft, PROMPTS[:3], max_new, options=options)
    assert out == alone(target, PROMPTS[:3], max_new)
    assert all(len(o) == max_new for o in out)
    out_self, _ = speculative_generate(target, target, PROMPTS[:3], max_new, options=options)
    assert out_self == out


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_gamma_stays_exact_and_drafts_less(target, draft, mode):
    ref = alone(target, PROMPTS, 30)
    fixed, fixed_stats = speculative_generate(
        target, draft, PROMPTS, 30, options=DecodeOptions(gamma=6, compile=MODES[mode])
    )
    dynamic, dyn_stats = speculative_generate(
        target, draft, PROMPTS, 30, options=DecodeOptions(gamma=6, confidence_threshold=0.9, compile=MODES[mode])
    )
    assert fixed == dynamic == ref
    assert dyn_stats.proposed < fixed_stats.proposed
    assert dyn_stats.acceptance_rate > fixed_stats.acceptance_rate


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gamma": 0}, "gamma must be an integer >= 1, got 0"),
        ({"gamma": 2.5}, "gamma must be an integer >= 1, got 2.5"),
        ({"confidence_threshold": 1.5}, r"confidence threshold must be in \[0, 1\], got 1.5"),
        ({"confidence_threshold": -0.1}, r"confidence threshold must be in \[0, 1\], got -0.1"),
        ({"cache_kind": "paged"}, "unknown cache kind 'paged'"),
        ({"verify_widths": {3: 2}}, "a width >= q, got 3: 2"),
    ],
)
def test_bad_options_are_refused_once_with_one_error_type(fields, message):
    with pytest.raises(DraftsmithError, match=message):
        DecodeOptions(**fields)


def test_bad_prompts_are_refused(target):
    with pytest.raises(DraftsmithError, match="at least one token"):
        speculative_generate(target, target, [[]], 5)
    with pytest.raises(DraftsmithError, match="max_new_tokens must be >= 1"):
        speculative_generate(target, target, [[0, 1]], 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_padded_verification_is_exact(target, draft, batch_size, mode):
    prompts = PROMPTS[:batch_size]
    widths = {1: 3, 2: 4, 3: 4, 4: 8, 5: 8}
    ref = alone(target, prompts, 30)
    for gamma in (1, 2, 4):
        options = DecodeOptions(gamma=gamma, compile=MODES[mode])
        out, stats = speculative_generate(
            target, draft, prompts, 30, options=dataclasses.replace(options, verify_widths=widths)
        )
        plain, plain_stats = speculative_generate(target, draft, prompts, 30, options=options)
        assert out == plain == ref
        assert (stats.proposed, stats.accepted) == (plain_stats.proposed, plain_stats.accepted)


def test_verify_widths_pad_to_the_cheapest_wider_forward_when_it_saves_a_tenth():
    # Seconds per forward of w tokens, as a CPU whose BLAS is slow for 2-3 rows would time them.
    cost = {1: 1.0, 2: 1.6, 3: 1.5, 4: 1.2, 5: 1.25, 6: 1.7, 7: 1.3, 8: 1.9}
    assert choose_verify_widths(cost, 4) == {2: 4, 3: 4}
    assert choose_verify_widths(cost, 6) == {2: 4, 3: 4, 6: 7}
    assert choose_verify_widths({1: 1.0, 2: 1.0, 3: 1.0}, 2) == {}  # padding never pays: none


def test_tuned_widths_are_wider_than_their_sizes(target):
    widths = tune_verify_widths(target, 5, context=16, reps=3)
    assert all(1 <= q <= 5 and q < w <= 9 for q, w in widths.items())
    out, _ = speculative_generate(target, target, PROMPTS[:1], 12, options=DecodeOptions(gamma=4, verify_widths=widths))
    assert out == alone(target, PROMPTS[:1], 12)
