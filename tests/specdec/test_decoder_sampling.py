"""Sampled speculative decoding is distributed exactly as sampling from the target.

The reference is each sampled sequence's own conditionals p(x_t | x_<t) under the target, processed
by a float64 temperature / top-k / top-p written in the tests (``helpers.reference_probs``), not by
the decoder's ``process_logits``: a change applied alike to p and q would otherwise pass unnoticed.
Positions 0..6 are checked, alone and in pairs, so at gamma 3 the bonus token after a fully
accepted round lies inside the window. Thousands of sequences are decoded in one ragged batch (two
prompts of different lengths, interleaved), so the fit also holds per sequence of a batch. The
negative controls break one piece of the rule each and must fail the same fit. The fits run on every
device, eagerly and compiled (``DecodeOptions.compile``).
"""

import pytest
import torch

from draftsmith.specdec import proposal, verify
from draftsmith.specdec.sampling import SamplingParams, accept_sampled
from tests.helpers import assert_fits, noisy_copy, sample_spec, sampled_fit, tiny_llama

V = 12
TOP_K = SamplingParams(0.7, top_k=5)
TOP_P = SamplingParams(1.3, top_p=0.8)
MODES = {"eager": False, "compiled": True}


@pytest.fixture(scope="module")
def target(device):
    return tiny_llama(vocab=V, sharpness=3.0, seed=0).to(device)


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "weak": tiny_llama(vocab=V, sharpness=3.0, seed=5).to(target.device),  # unrelated model
        "medium": noisy_copy(target, noise=0.5),
        "strong": noisy_copy(target, noise=0.1),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("quality", ["weak", "medium", "strong"])
def test_matches_target_for_each_draft_quality(target, drafts, quality, gamma, mode):
    params = SamplingParams(temperature=1.0)
    a, b, stats = sample_spec(target, drafts[quality], params, gamma, compile=MODES[mode])
    assert_fits(target, params, a, b)
    assert 0 < stats.accepted < stats.proposed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("params", [TOP_K, TOP_P], ids=["t0.7-k5", "t1.3-p0.8"])
def test_matches_target_with_temperature_topk_topp(target, drafts, params, gamma, mode):
    a, b, _ = sample_spec(target, drafts["medium"], params, gamma, seed=1, compile=MODES[mode])
    assert_fits(target, params, a, b)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_every_cache_kind_samples_exactly(target, drafts, cache_kind):
    a, b, stats = sample_spec(target, drafts["medium"], TOP_P, 3, seed=5, cache_kind=cache_kind, compile=False)
    assert_fits(target, TOP_P, a, b)
    assert stats.accepted > 0


@pytest.mark.parametrize("mode", MODES)
def test_greedy_drafting_and_dynamic_gamma_stay_exact(target, drafts, mode):
    params = SamplingParams(temperature=1.0)
    a, b, _ = sample_spec(target, drafts["medium"], params, 4, seed=2, draft_greedy=True, compile=MODES[mode])
    assert_fits(target, params, a, b)
    a, b, stats = sample_spec(
        target, drafts["medium"], params, 4, seed=3, confidence_threshold=0.5, compile=MODES[mode]
    )
    assert_fits(target, params, a, b)
    assert stats.proposed < 4 * stats.seq_rounds  # the threshold did cut some rounds short


def test_acceptance_rate_tracks_draft_quality(target, drafts):
    params = SamplingParams(temperature=1.0)
    rates = {q: sample_spec(target, drafts[q], params, 3)[2].acceptance_rate for q in ("weak", "medium", "strong")}
    assert rates["weak"] < rates["medium"] < rates["strong"]


@pytest.mark.parametrize("mode", MODES)
def test_padded_verification_stays_exact(target, drafts, mode):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    widths = {2: 4, 3: 4, 4: 8}
    a, b, _ = sample_spec(target, drafts["medium"], params, 3, seed=4, verify_widths=widths, compile=MODES[mode])
    assert_fits(target, params, a, b)


# ---- Negative controls: each breaks one piece of the rule and must fail the same fit ----------------


def always_accept(tokens, q, p, counts, generator=None):
    rows = torch.arange(len(tokens))
    return counts.clone(), torch.multinomial(p[rows, counts], 1, generator=generator)[:, 0]


def correct_from_p(tokens, q, p, counts, generator=None):
    """The acceptance test is right, but a rejection is corrected from p instead of the residual."""
    n_accepted, _ = accept_sampled(tokens, q, p, counts, generator)
    return n_accepted, torch.multinomial(p[torch.arange(len(tokens)), n_accepted], 1, generator=generator)[:, 0]


def raw_q(real_step):
    """The draft samples from its processed q but reports its raw softmax to the acceptance rule."""

    def step(logits, options, generator):
        token, _, confident, confidence = real_step(logits, options, generator)
        return token, logits.float().softmax(-1), confident, confidence

    return step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("control", ["always accept", "correct from p", "raw q"])
def test_broken_rules_fail_the_same_fit(target, drafts, monkeypatch, control, mode):
    if control == "raw q":
        monkeypatch.setattr(proposal, "draft_step", raw_q(proposal.draft_step))
    else:
        monkeypatch.setattr(verify, "accept_sampled", always_accept if control == "always accept" else correct_from_p)
    a, b, _ = sample_spec(target, drafts["weak"], TOP_K, 3, compile=MODES[mode])
    scores = sampled_fit(target, TOP_K, (a, b))
    assert max(scores.values()) > 10, scores
