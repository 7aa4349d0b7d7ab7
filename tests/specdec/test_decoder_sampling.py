"""Sampled speculative decoding is distributed exactly as sampling from the target (SPEC.md section 6).

The reference is exact, not sampled: the target's joint distribution over the first four generated
tokens is enumerated over all V^3 prefixes. Thousands of sequences are decoded in one ragged batch
(two prompts of different lengths, interleaved), so the test also holds per sequence in a batch.
"""

import pytest
import torch

from draftsmith.specdec import decoder as decoder_module
from draftsmith.specdec.decoder import speculative_generate
from draftsmith.specdec.sampling import SamplingParams, process_logits
from tests.helpers import chi_square_z, noisy_copy, tiny_llama

V = 12
PROMPTS = ([0, 4, 9], [0, 7, 7, 2, 5, 3])
N = 3000  # samples per prompt


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, sharpness=3.0, seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "weak": tiny_llama(vocab=V, sharpness=3.0, seed=5),  # unrelated model
        "medium": noisy_copy(target, noise=0.5),
        "strong": noisy_copy(target, noise=0.1),
    }


@torch.no_grad()
def exact_joint(model, prompt, params, depth=4):
    """P(t1..t_depth | prompt) as a (V,)*depth tensor, by enumerating every prefix."""
    joint = torch.ones(())
    for k in range(depth):
        prefixes = torch.cartesian_prod(*[torch.arange(V)] * k) if k > 1 else torch.arange(V)[:, None]
        if k == 0:
            prefixes = torch.zeros(1, 0, dtype=torch.long)
        inputs = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
        logits = model(input_ids=inputs).logits[:, -1]
        cond = process_logits(logits, params).double().reshape(*([V] * k), V)
        joint = joint[..., None] * cond
    return joint


def fit_scores(samples: torch.Tensor, joint: torch.Tensor) -> dict:
    """z-scores of positions 1, 2, 3 (0-based) and of the pair (1, 2) against the exact joint."""
    scores = {}
    for pos in (1, 2, 3):
        marginal = joint.sum(dim=[d for d in range(4) if d != pos])
        scores[f"pos{pos}"] = chi_square_z(torch.bincount(samples[:, pos], minlength=V), marginal)
    pair = joint.sum(dim=(0, 3))
    scores["pair12"] = chi_square_z(torch.bincount(samples[:, 1] * V + samples[:, 2], minlength=V * V), pair)
    return scores


def sample_spec(target, draft, params, gamma, seed=0, **kw):
    prompts = [PROMPTS[i % 2] for i in range(2 * N)]
    gen = torch.Generator().manual_seed(seed)
    out, stats = speculative_generate(
        target, draft, prompts, max_new_tokens=9, gamma=gamma, sampling=params, generator=gen, **kw
    )
    tokens = torch.tensor([o[:4] for o in out])
    return tokens[0::2], tokens[1::2], stats


def assert_fits(target, params, samples_a, samples_b):
    for prompt, samples in zip(PROMPTS, (samples_a, samples_b), strict=True):
        scores = fit_scores(samples, exact_joint(target, prompt, params))
        assert all(z < 4 for z in scores.values()), scores


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("quality", ["weak", "medium", "strong"])
def test_matches_target_for_each_draft_quality(target, drafts, quality, gamma):
    params = SamplingParams(temperature=1.0)
    a, b, stats = sample_spec(target, drafts[quality], params, gamma)
    assert_fits(target, params, a, b)
    assert stats.proposed > 0


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize(
    "params", [SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)], ids=["t0.7-k5", "t1.3-p0.8"]
)
def test_matches_target_with_temperature_topk_topp(target, drafts, params, gamma):
    a, b, _ = sample_spec(target, drafts["medium"], params, gamma, seed=1)
    assert_fits(target, params, a, b)


def test_greedy_drafting_and_dynamic_gamma_stay_exact(target, drafts):
    params = SamplingParams(temperature=1.0)
    a, b, _ = sample_spec(target, drafts["medium"], params, 4, seed=2, draft_greedy=True)
    assert_fits(target, params, a, b)
    a, b, stats = sample_spec(target, drafts["medium"], params, 4, seed=3, confidence_threshold=0.5)
    assert_fits(target, params, a, b)
    assert stats.proposed < 4 * stats.seq_rounds  # the threshold did cut some rounds short


def test_acceptance_rate_tracks_draft_quality(target, drafts):
    params = SamplingParams(temperature=1.0)
    rates = {q: sample_spec(target, drafts[q], params, 3)[2].acceptance_rate for q in ("weak", "medium", "strong")}
    assert rates["weak"] < rates["medium"] < rates["strong"]


def test_always_accept_fails_the_same_fit(target, drafts, monkeypatch):
    def always_accept(d, q, p, n_proposed, generator=None):
        return n_proposed.clone(), torch.multinomial(p[torch.arange(len(d)), n_proposed], 1, generator=generator)[:, 0]

    monkeypatch.setattr(decoder_module, "accept_sampled", always_accept)
    params = SamplingParams(temperature=1.0)
    a, _, _ = sample_spec(target, drafts["weak"], params, 3)
    scores = fit_scores(a, exact_joint(target, PROMPTS[0], params))
    assert max(scores.values()) > 10, scores


def test_padded_verification_stays_exact(target, drafts):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a, b, _ = sample_spec(target, drafts["medium"], params, 3, seed=4, verify_widths={2: 4, 3: 4, 4: 8})
    assert_fits(target, params, a, b)
