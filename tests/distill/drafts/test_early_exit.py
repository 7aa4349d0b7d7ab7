"""The early-exit kind: self-speculative decoding with KV reuse (the draft shares the target's
cache and its first k layers) is exact, with and without the adapter layer, and equals the same
draft decoded standalone."""

import pytest
import torch

from draftsmith.distill.drafts.early_exit import EarlyExitDraft, shared_layers_pair
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.drafters import PairedDraft
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.verify import verification_inputs
from tests.helpers import FIT_TOKENS, SAMPLING_PROMPTS, assert_fits, tiny_llama

PROMPTS = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, layers=4, sharpness=8.0)


def test_the_early_exit_draft_builds_its_own_decoding_pair(target):
    assert isinstance(EarlyExitDraft(target, 2), PairedDraft)
    assert not isinstance(target, PairedDraft)  # a plain causal LM decodes standalone


@pytest.mark.parametrize("adapter", [True, False])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_identical_to_target_and_to_the_standalone_path(target, gamma, adapter):
    draft = EarlyExitDraft(target, 2, adapter=adapter)
    proposed = accepted = 0
    for prompt in PROMPTS:
        ref = target_generate(target, [prompt], 25)[0]
        reused, stats = speculative_generate(target, draft, [prompt], 25, options=DecodeOptions(gamma=gamma))
        standalone, plain_stats = speculative_generate(
            target, draft, [prompt], 25, options=DecodeOptions(gamma=gamma, draft_options={"kv_reuse": False})
        )
        assert reused == standalone == ref
        assert (stats.proposed, stats.accepted) == (plain_stats.proposed, plain_stats.accepted)
        assert stats.new_tokens == 25 and stats.target_forwards == stats.rounds + 1
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    assert 0 < accepted < proposed  # a draft that is sometimes wrong


def test_padded_verification_with_kv_reuse_is_exact(target):
    draft = EarlyExitDraft(target, 2)
    for prompt in PROMPTS:
        ref = target_generate(target, [prompt], 25)[0]
        plain, plain_stats = speculative_generate(target, draft, [prompt], 25, options=DecodeOptions(gamma=3))
        widths = {1: 2, 2: 4, 3: 4, 4: 7}
        padded, stats = speculative_generate(
            target, draft, [prompt], 25, options=DecodeOptions(gamma=3, verify_widths=widths)
        )
        assert padded == plain == ref
        assert (stats.proposed, stats.accepted) == (plain_stats.proposed, plain_stats.accepted)


def test_eos_and_short_budgets(target):
    draft = EarlyExitDraft(target, 3)
    full = target_generate(target, [PROMPTS[0]], 20)[0][0]
    eos = full[6]
    out, _ = speculative_generate(target, draft, [PROMPTS[0]], 20, options=DecodeOptions(gamma=7), eos_ids={eos})
    assert out[0] == full[: full.index(eos) + 1]
    for n in (1, 2, 3):
        got, _ = speculative_generate(target, draft, [PROMPTS[1]], n, options=DecodeOptions(gamma=7))
        assert got == target_generate(target, [PROMPTS[1]], n)[0]


def test_refuses_what_a_shared_cache_cannot_do(target):
    draft = EarlyExitDraft(target, 2)
    with pytest.raises(
        DraftsmithError, match="one sequence at a time; use --batch-size 1 or --draft-option kv_reuse=false"
    ):
        speculative_generate(target, draft, PROMPTS[:2], 5)
    with pytest.raises(DraftsmithError, match="KV reuse uses the slot cache"):
        speculative_generate(target, draft, PROMPTS[:1], 5, options=DecodeOptions(cache_kind="static"))
    with pytest.raises(DraftsmithError, match="needs 1 <= k < 4 target layers, got 4"):
        EarlyExitDraft(target, 4, adapter=False)
    batched, _ = speculative_generate(
        target, draft, PROMPTS[:2], 5, options=DecodeOptions(draft_options={"kv_reuse": False})
    )
    assert batched == target_generate(target, PROMPTS[:2], 5)[0]


def test_verification_runs_only_the_upper_layers_and_gives_the_targets_logits(target):
    draft, prompt, gamma = EarlyExitDraft(target, 3), torch.tensor([PROMPTS[2]]), 3
    verifier, drafter = shared_layers_pair(target, draft, 1, 64, DecodeOptions(gamma=gamma))
    rows = {}  # decoder layer index -> token rows it ran during verification
    hooks = [
        layer.register_forward_hook(lambda m, args, out, i=i: rows.__setitem__(i, rows.get(i, 0) + args[0].shape[1]))
        for i, layer in enumerate(target.model.layers)
    ]
    with torch.inference_mode():
        verifier.prefill(prompt, prompt > -1, drafter.prefill(prompt, prompt > -1))
        proposal = drafter.propose(
            [PROMPTS[2] + [5]], torch.tensor([gamma]), DecodeOptions(gamma=gamma, confidence_threshold=0.0), None
        )
        rows.clear()
        inputs, valid = verification_inputs(torch.tensor([5]), proposal)
        logits = verifier.verify(inputs, valid, proposal.reusable).logits
        for hook in hooks:
            hook.remove()
        full = target(input_ids=torch.cat([prompt, inputs], 1)).logits[:, -(gamma + 1) :]
    assert rows == {3: gamma + 1}  # layers 0-2 ran while drafting; only layer 3 verifies
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_sampling_matches_the_target():
    small = tiny_llama(vocab=12, layers=3, sharpness=3.0, seed=0)
    draft = EarlyExitDraft(small, 1)
    params = SamplingParams(temperature=1.0, top_k=8)
    options = DecodeOptions(gamma=3, sampling=params)
    generator = torch.Generator().manual_seed(0)

    def one_sample() -> list[int]:
        prompt = SAMPLING_PROMPTS[0]
        out, _ = speculative_generate(small, draft, [prompt], FIT_TOKENS, options=options, generator=generator)
        return out[0]

    assert_fits(small, params, torch.tensor([one_sample() for _ in range(1500)]))
