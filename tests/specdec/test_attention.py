"""Row-exact decoding: in bfloat16 a verification forward gives the logits of single-token steps, bit for bit.

The model has the default target's layer widths (hidden 576, MLP 1536): the one-row kernels of
those shapes sum in another order than the multi-row ones, which a smaller toy model would not show.
On a CPU that emulates bfloat16 the decoder runs 16-bit forwards on one thread
(``stream.decoding_threads``), so the block test runs under the same setting.
"""

import pytest
import torch

from draftsmith.distill.drafts.early_exit import EarlyExitDraft
from draftsmith.specdec.attention import EXACT, use_exact_attention
from draftsmith.specdec.cache import make_cache
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer
from draftsmith.specdec.stream import ModelStream, decoding_threads
from draftsmith.specdec.tree import TreeShape
from tests.helpers import noisy_copy, tiny_llama


@pytest.fixture(scope="module")
def wide_pair():
    target = tiny_llama(vocab=1024, layers=4, hidden=576, sharpness=0.3)
    draft = noisy_copy(target, 0.05)
    return target.to(torch.bfloat16), draft.to(torch.bfloat16)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


def _all(tokens: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(tokens, dtype=torch.bool)


def test_a_block_of_tokens_scores_exactly_as_single_token_steps(wide_pair):
    target, _ = wide_pair
    mismatches = 0
    with torch.inference_mode(), decoding_threads(target):
        for seed in range(6):
            tokens = _tokens(60 + 7 * seed, seed)
            prompt, block = tokens[:, :-5], tokens[:, -5:]
            steps = ModelStream(target, 1, 128, "slot", row_exact=True)
            steps.forward(prompt, _all(prompt))
            single = torch.cat([steps.forward(block[:, i : i + 1], _all(block[:, :1])) for i in range(5)], 1)
            together = ModelStream(target, 1, 128, "slot", row_exact=True)
            together.forward(prompt, _all(prompt))
            mismatches += int(not torch.equal(single, together.forward(block, _all(block))))
    assert target.config._attn_implementation == EXACT
    assert mismatches == 0


def test_bfloat16_greedy_speculative_output_is_the_targets(wide_pair):
    target, draft = wide_pair
    for seed, length in enumerate((5, 30, 70)):
        prompt = _tokens(length, 10 + seed)[0].tolist()
        want, _ = target_generate(target, [prompt], 80, row_exact=True)
        for gamma, widths in ((1, {}), (3, {}), (4, {2: 4, 3: 4, 4: 6, 5: 6})):
            options = DecodeOptions(gamma=gamma, verify_widths=widths)
            got, stats = speculative_generate(target, draft, [prompt], 80, options=options)
            assert got == want, (seed, gamma, widths)
            assert 0 < stats.accepted < stats.proposed


def _step_widths(model: torch.nn.Module) -> list[int]:
    """Records the input width of every forward of ``model``; returns the (growing) list."""
    widths: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return widths


def test_the_timed_baseline_steps_one_row_and_the_reference_two():
    """Plain decoding a user of the target alone gets runs a step of one sequence as one row, and that is
    what a speedup is timed against; the output the speculative decoder reproduces bit for bit steps as
    its verifications compute (two rows in bfloat16). In float32 both are one row."""
    model = tiny_llama(vocab=512, layers=2, hidden=64)
    prompt = _tokens(12, 3)[0].remainder(512).tolist()
    for dtype, exact_width in ((torch.bfloat16, 2), (torch.float32, 1)):
        model = model.to(dtype)
        widths = _step_widths(model)
        plain, _ = target_generate(model, [prompt], 6)
        assert widths == [12] + [1] * 5
        widths.clear()
        exact, _ = target_generate(model, [prompt], 6, row_exact=True)
        assert widths == [12] + [exact_width] * 5
        model._forward_pre_hooks.clear()
    assert plain == exact  # a toy model of this width has no near-ties to split


def test_a_paused_round_is_row_exact_unless_pauses_are_plain(monkeypatch):
    """Paced decoding: a round where the one sequence does not draft steps the target two rows, as a
    verification computes (the default), and the output is the row-exact target's bit for bit; with
    exact_pauses off it steps one row, as the target alone does. Unpaced, the last token's draft-less
    round is row-exact."""
    assert DecodeOptions(pace=True).exact_pauses
    target = tiny_llama(vocab=512, layers=2, hidden=64)
    draft = noisy_copy(target, 0.5).to(torch.bfloat16)
    target = target.to(torch.bfloat16)
    prompt = _tokens(12, 4)[0].remainder(512).tolist()
    reference, _ = target_generate(target, [prompt], 24, row_exact=True)
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: False)  # paused but for the probes
    widths = _step_widths(target)
    for exact in (False, True):
        widths.clear()
        options = DecodeOptions(gamma=1, pace=True, exact_pauses=exact)
        out, stats = speculative_generate(target, draft, [prompt], 24, options=options)
        assert stats.paused > 10 and widths[0] == 12
        assert widths.count(1) == (0 if exact else stats.paused)
        assert min(widths[1:]) == (2 if exact else 1)
        if exact:
            assert out == reference
    widths.clear()
    speculative_generate(target, draft, [prompt], 24, options=DecodeOptions(gamma=3))
    assert min(widths[1:]) >= 2


def test_exact_attention_leaves_a_static_cache_to_sdpa_and_stays_correct():
    model = tiny_llama(vocab=512, layers=2, hidden=64)
    use_exact_attention(model)
    tokens = _tokens(40, 0) % 512
    with torch.inference_mode():
        cache = make_cache("static", model.config, 64)
        model(input_ids=tokens[:, :35], cache=cache, use_cache=True)
        single = [
            model(input_ids=tokens[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1] for i in range(35, 40)
        ]
        cache = make_cache("static", model.config, 64)
        model(input_ids=tokens[:, :35], cache=cache, use_cache=True)
        together = model(input_ids=tokens[:, 35:], cache=cache, use_cache=True).logits[0]
    torch.testing.assert_close(torch.stack(single), together, rtol=1e-5, atol=1e-5)


def test_bfloat16_self_speculative_output_is_the_targets(wide_pair):
    target, _ = wide_pair
    draft = EarlyExitDraft(target, 3, adapter=False)
    for seed, length in enumerate((9, 50)):
        prompt = _tokens(length, 20 + seed)[0].tolist()
        want, _ = target_generate(target, [prompt], 60, row_exact=True)
        for gamma, widths in ((1, {}), (3, {}), (3, {1: 2, 2: 4, 3: 4, 4: 6})):
            options = DecodeOptions(gamma=gamma, verify_widths=widths)
            got, stats = speculative_generate(target, draft, [prompt], 60, options=options)
            assert got == want, (seed, gamma, widths)
            assert stats.accepted > 0


def test_bfloat16_greedy_tree_output_is_the_targets(wide_pair):
    target, draft = wide_pair
    for seed, length in enumerate((7, 45)):
        prompt = _tokens(length, 30 + seed)[0].tolist()
        want, _ = target_generate(target, [prompt], 50, row_exact=True)
        for shape in ("3,2,1,1", "3,2,2,1:8"):
            options = DecodeOptions(tree=TreeShape.parse(shape))
            got, stats = speculative_generate(target, draft, [prompt], 50, options=options)
            assert got == want, (seed, shape)
            assert 0 < stats.accepted < stats.proposed
