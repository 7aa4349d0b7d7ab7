"""Row-exact decoding: in bfloat16 a verification forward gives the logits of single-token steps, bit for bit.

The model has the default target's layer widths (hidden 576, MLP 1536): the one-row kernels of
those shapes sum in another order than the multi-row ones, which a smaller toy model would not show.
"""

import pytest
import torch

from draftsmith.specdec.attention import EXACT, use_exact_attention
from draftsmith.specdec.cache import make_cache
from draftsmith.specdec.decoder import _Stream, speculative_generate, target_generate
from tests.helpers import noisy_copy, tiny_llama


@pytest.fixture(scope="module")
def wide_pair():
    target = tiny_llama(vocab=1024, layers=4, hidden=576, sharpness=0.3)
    draft = noisy_copy(target, 0.05)
    return target.to(torch.bfloat16), draft.to(torch.bfloat16)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_block_of_tokens_scores_exactly_as_single_token_steps(wide_pair):
    target, _ = wide_pair
    mismatches = 0
    with torch.inference_mode():
        for seed in range(6):
            tokens = _tokens(60 + 7 * seed, seed)
            prompt, block = tokens[:, :-5], tokens[:, -5:]
            steps = _Stream(target, 1, 128, "slot", row_exact=True)
            steps.forward(prompt, torch.ones_like(prompt, dtype=torch.bool))
            single = torch.cat(
                [steps.forward(block[:, i : i + 1], torch.ones(1, 1, dtype=torch.bool)) for i in range(5)], 1
            )
            together = _Stream(target, 1, 128, "slot", row_exact=True)
            together.forward(prompt, torch.ones_like(prompt, dtype=torch.bool))
            mismatches += int(
                not torch.equal(single, together.forward(block, torch.ones_like(block, dtype=torch.bool)))
            )
    assert target.config._attn_implementation == EXACT
    assert mismatches == 0


def test_bfloat16_greedy_speculative_output_is_the_targets(wide_pair):
    target, draft = wide_pair
    for seed, length in enumerate((5, 30, 70)):
        prompt = _tokens(length, 10 + seed)[0].tolist()
        want, _ = target_generate(target, [prompt], 80)
        for gamma, widths in ((1, None), (3, None), (4, {2: 4, 3: 4, 4: 6, 5: 6})):
            got, stats = speculative_generate(target, draft, [prompt], 80, gamma=gamma, verify_widths=widths)
            assert got == want, (seed, gamma, widths)
            assert 0 < stats.accepted < stats.proposed


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
    from draftsmith.distill.early_exit import EarlyExitDraft
    from draftsmith.specdec.self_spec import self_speculative_generate

    target, _ = wide_pair
    draft = EarlyExitDraft(target, 3, adapter=False).eval()
    for seed, length in enumerate((9, 50)):
        prompt = _tokens(length, 20 + seed)[0].tolist()
        want, _ = target_generate(target, [prompt], 60)
        for gamma in (1, 3):
            got, stats = self_speculative_generate(target, draft, [prompt], 60, gamma=gamma)
            assert got == want, (seed, gamma)
            assert stats.accepted > 0
