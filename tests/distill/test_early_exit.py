"""The early-exit draft is what the decoder's KV reuse expects, and decodes exactly with it."""

import pytest

from draftsmith.distill.early_exit import EarlyExitDraft
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.self_spec import EarlyExit
from tests.helpers import tiny_llama

PROMPTS = [[0, 5, 7, 9], [0, 8, 8, 8, 8, 8, 2, 11, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, layers=4, sharpness=8.0)


@pytest.mark.parametrize("adapter", [True, False])
def test_early_exit_draft_decodes_exactly_with_and_without_kv_reuse(target, adapter):
    draft = EarlyExitDraft(target, 2, adapter=adapter).eval()
    assert isinstance(draft, EarlyExit)
    proposed = accepted = 0
    for prompt in PROMPTS:
        want, _ = target_generate(target, [prompt], 20)
        reused, stats = speculative_generate(target, draft, [prompt], 20, options=DecodeOptions(gamma=3))
        standalone, plain = speculative_generate(
            target, draft, [prompt], 20, options=DecodeOptions(gamma=3, kv_reuse=False)
        )
        assert reused == standalone == want
        assert (stats.proposed, stats.accepted) == (plain.proposed, plain.accepted)
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    assert 0 < accepted < proposed
