"""The acceptance rule and logit processing as pure functions."""

import pytest
import torch

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    process_logits,
    residual_distribution,
)
from tests.helpers import chi_square_z, reference_probs


def random_dist(shape, gen, sparsity=0.0):
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if sparsity:
        logits[torch.rand(shape, generator=gen, dtype=torch.float64) < sparsity] = float("-inf")
        logits[..., 0] = 0.0  # at least one token stays possible
    return logits.softmax(-1)


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_acceptance_plus_residual_reproduces_p_exactly(sparsity):
    gen = torch.Generator().manual_seed(0)
    p = random_dist((200, 50), gen, sparsity)
    q = random_dist((200, 50), gen, sparsity)
    ratio = torch.where(q > 0, p / q, torch.zeros_like(p))
    kept = q * ratio.clamp(max=1.0)  # q(x) min(1, p(x)/q(x))
    reject_mass = 1 - torch.minimum(p, q).sum(-1, keepdim=True)
    rebuilt = kept + reject_mass * residual_distribution(p, q)
    torch.testing.assert_close(rebuilt, p, atol=1e-6, rtol=0)


def test_residual_falls_back_to_p_when_q_covers_p():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    assert torch.equal(residual_distribution(p, p.clone()), p)


def test_process_logits_temperature_topk_topp():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    plain = process_logits(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(plain, logits.softmax(-1))
    hot = process_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, (logits / 2).softmax(-1))
    top2 = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.cat([torch.tensor([[4.0, 3.0]]).softmax(-1), torch.zeros(1, 3)], 1)
    torch.testing.assert_close(top2, expected)
    # softmax of [4,3,2,1,0] = .636, .234, .086, .032, .012: top-p 0.8 keeps the first two (0.87 >= 0.8)
    nucleus = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (nucleus > 0).tolist() == [[True, True, False, False, False]]
    # top-p smaller than the top token's mass still keeps that token
    tiny = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert tiny.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8), SamplingParams(0.5, 3, 0.6)],
    ids=["t1", "t0.7-k5", "t1.3-p0.8", "t0.5-k3-p0.6"],
)
def test_process_logits_agrees_with_the_tests_float64_reference(params):
    logits = torch.randn(500, 30, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(
        process_logits(logits, params).double(),
        reference_probs(logits, params.temperature, params.top_k, params.top_p),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": 1.0, "top_p": 0.0}, "top-p must be in (0, 1]"),
        ({"temperature": 1.0, "top_p": 1.5}, "top-p must be in (0, 1]"),
        ({"temperature": 1.0, "top_k": -1}, "top-k must be >= 0"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(DraftsmithError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs)


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = torch.full((2, 4, 10), -5.0)
    target_choice = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]])
    logits.scatter_(2, target_choice[..., None], 5.0)
    drafts = torch.tensor([[3, 4, 9], [3, 4, 5]])
    n, nxt = accept_greedy(drafts, logits, torch.tensor([3, 3]))
    assert n.tolist() == [2, 3]
    assert nxt.tolist() == [5, 6]  # correction at the mismatch; bonus after all three
    n, nxt = accept_greedy(drafts, logits, torch.tensor([1, 2]))  # fewer proposed (dynamic gamma)
    assert n.tolist() == [1, 2]
    assert nxt.tolist() == [4, 5]


def test_greedy_disjoint_draft_accepts_nothing():
    logits = torch.zeros(1, 3, 8)
    logits[0, :, 7] = 1.0
    n, nxt = accept_greedy(torch.tensor([[0, 1]]), logits, torch.tensor([2]))
    assert n.tolist() == [0] and nxt.tolist() == [7]


def test_sampled_disjoint_supports_accept_nothing_and_correct_from_p():
    p = torch.zeros(500, 2, 6)
    p[..., :3] = 1 / 3
    q = torch.zeros(500, 1, 6)
    q[..., 3:] = 1 / 3
    gen = torch.Generator().manual_seed(0)
    d = torch.multinomial(q[:, 0], 1, generator=gen)
    n, nxt = accept_sampled(d, q, p, torch.full((500,), 1), gen)
    assert n.sum().item() == 0
    assert set(nxt.tolist()) <= {0, 1, 2}  # the residual is p itself here


def test_sampled_draft_with_zero_probability_on_targets_choice():
    # The target puts everything on token 2; the draft never proposes it. Every token is rejected and
    # the correction is always 2.
    p = torch.zeros(300, 3, 5)
    p[..., 2] = 1.0
    q = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]).expand(300, 2, 5).clone()
    gen = torch.Generator().manual_seed(1)
    d = torch.multinomial(q.reshape(-1, 5), 1, generator=gen).reshape(300, 2)
    n, nxt = accept_sampled(d, q, p, torch.full((300,), 2), gen)
    assert n.sum().item() == 0 and set(nxt.tolist()) == {2}


def test_sampled_identical_distributions_accept_everything_and_take_bonus():
    gen = torch.Generator().manual_seed(2)
    p = random_dist((400, 4, 7), gen).float()
    d = torch.multinomial(p[:, :3].reshape(-1, 7), 1, generator=gen).reshape(400, 3)
    n, _ = accept_sampled(d, p[:, :3], p, torch.full((400,), 3), gen)
    assert n.tolist() == [3] * 400


# ---- Goodness of fit of one round's first emitted token, and the negative controls -----------------


def first_token_counts(accept, p_logits, q_logits, params, n, gen, raw_q=False):
    """Draft d ~ q (processed), run ``accept``, count the first emitted token over n trials; also
    return the reference p (``reference_probs``, not the decoder's processing)."""
    q = process_logits(q_logits, params).expand(n, -1)
    p = process_logits(p_logits, params).expand(n, -1)
    d = torch.multinomial(q, 1, generator=gen)  # (n, 1)
    q_given = q_logits.float().softmax(-1).expand(n, -1) if raw_q else q
    n_acc, nxt = accept(d, q_given[:, None], torch.stack([p, p], 1), torch.ones(n, dtype=torch.long), gen)
    first = torch.where(n_acc > 0, d[:, 0], nxt)
    reference = reference_probs(p_logits[0], params.temperature, params.top_k, params.top_p)
    return torch.bincount(first, minlength=p.shape[-1]), reference


def always_accept(d, q, p, n_proposed, gen):
    return n_proposed.clone(), torch.multinomial(p[:, -1], 1, generator=gen).squeeze(1)


def resample_from_p(d, q, p, n_proposed, gen):
    p_d = p[:, 0].gather(1, d).squeeze(1)
    q_d = q[:, 0].gather(1, d).squeeze(1)
    keep = torch.rand(d.shape[0], generator=gen) * q_d < p_d
    correction = torch.multinomial(p[:, 0], 1, generator=gen).squeeze(1)  # wrong: should be the residual
    return keep.long(), correction


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-k5", "t1.3-p0.8"])
def test_first_token_fits_target_and_negative_controls_fail(params):
    gen = torch.Generator().manual_seed(3)
    p_logits = torch.randn(1, 12, generator=gen) * 2
    q_logits = p_logits + torch.randn(1, 12, generator=gen) * 2  # a mediocre draft
    n = 40_000
    counts, p = first_token_counts(accept_sampled, p_logits, q_logits, params, n, gen)
    assert chi_square_z(counts, p) < 4
    for control in (always_accept, resample_from_p):
        counts, p = first_token_counts(control, p_logits, q_logits, params, n, gen)
        assert chi_square_z(counts, p) > 10, control.__name__
    if params.top_k or params.temperature != 1.0 or params.top_p < 1:
        counts, p = first_token_counts(accept_sampled, p_logits, q_logits, params, n, gen, raw_q=True)
        assert chi_square_z(counts, p) > 10, "raw instead of processed q"
