"""Self-speculative decoding with KV reuse (an early-exit draft sharing the target's cache) is exact."""

import pytest
import torch

from draftsmith.distill.early_exit import EarlyExitDraft
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.self_spec import self_speculative_generate
from tests.helpers import chi_square_z, tiny_llama
from tests.specdec.test_decoder_sampling import exact_joint, fit_scores

PROMPTS = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, layers=4, sharpness=8.0)


@pytest.mark.parametrize("adapter", [True, False])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_identical_to_target_and_to_the_standalone_path(target, gamma, adapter):
    draft = EarlyExitDraft(target, 2, adapter=adapter).eval()
    for prompt in PROMPTS:
        ref = target_generate(target, [prompt], 25)[0]
        reused, stats = self_speculative_generate(target, draft, [prompt], 25, gamma=gamma)
        standalone, plain_stats = speculative_generate(target, draft, [prompt], 25, gamma=gamma)
        assert reused == standalone == ref
        assert (stats.proposed, stats.accepted) == (plain_stats.proposed, plain_stats.accepted)
        assert stats.new_tokens == 25 and stats.target_forwards == stats.rounds + 1


def test_eos_and_short_budgets(target):
    draft = EarlyExitDraft(target, 3).eval()
    full = target_generate(target, [PROMPTS[0]], 20)[0][0]
    eos = full[6]
    out, _ = self_speculative_generate(target, draft, [PROMPTS[0]], 20, gamma=7, eos_ids={eos})
    assert out[0] == full[: full.index(eos) + 1]
    for n in (1, 2, 3):
        assert (
            self_speculative_generate(target, draft, [PROMPTS[1]], n, gamma=7)[0]
            == target_generate(target, [PROMPTS[1]], n)[0]
        )


def test_refuses_batches(target):
    with pytest.raises(DraftsmithError, match="one sequence at a time"):
        self_speculative_generate(target, EarlyExitDraft(target, 2), PROMPTS[:2], 5)


def test_sampling_matches_the_target():
    small = tiny_llama(vocab=12, layers=3, sharpness=3.0, seed=0)
    draft = EarlyExitDraft(small, 1).eval()
    params = SamplingParams(temperature=1.0, top_k=8)
    gen = torch.Generator().manual_seed(0)
    samples = torch.tensor(
        [
            self_speculative_generate(small, draft, [[0, 4, 9]], 5, gamma=3, sampling=params, generator=gen)[0][0][:4]
            for _ in range(1500)
        ]
    )
    scores = fit_scores(samples, exact_joint(small, [0, 4, 9], params))
    assert all(z < 4 for z in scores.values()), scores
    assert chi_square_z(torch.bincount(samples[:, 1], minlength=12), torch.full((12,), 1 / 12)) > 10  # not uniform


def test_verify_saving_is_measured(target):
    from draftsmith.specdec.self_spec import measure_verify_saving

    result = measure_verify_saving(target, EarlyExitDraft(target, 2).eval(), gamma=3, context=16, reps=3)
    assert result["verify_s_kv_reuse"] > 0 and result["verify_s_full"] > 0
    assert result["verify_time_saved"] == pytest.approx(1 - result["verify_s_kv_reuse"] / result["verify_s_full"])
