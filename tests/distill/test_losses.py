"""Losses against torch's own references and hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.distill import teacher_cache
from draftsmith.distill.losses import (
    LOSSES,
    acceptance_probability,
    accepted_length,
    cross_entropy,
    densify_topk,
    forward_kl,
    jsd,
    reverse_kl,
    row_losses,
    token_losses,
    topk_forward_kl,
    tvd,
)


@pytest.fixture
def logits():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 11, generator=gen) * 2, torch.randn(2, 5, 11, generator=gen) * 2


def test_forward_and_reverse_kl_match_f_kl_div(logits):
    s, t = logits
    log_q, log_p = F.log_softmax(s, -1), F.log_softmax(t, -1)
    ref_fwd = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    ref_rev = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(forward_kl(s, t), ref_fwd)
    torch.testing.assert_close(reverse_kl(s, t), ref_rev)
    # temperature divides both sides' logits
    torch.testing.assert_close(forward_kl(s, t, temperature=2.0), forward_kl(s / 2, t / 2))


def test_tvd_and_acceptance_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    s, t = q.log()[None, None], p.log()[None, None]
    assert tvd(s, t).item() == pytest.approx(0.5 * (0.3 + 0.1 + 0.4))
    assert acceptance_probability(s, t).item() == pytest.approx(0.2 + 0.2 + 0.2)
    assert tvd(s, t).item() == pytest.approx(1 - acceptance_probability(s, t).item())


def test_jsd_by_hand_and_symmetry(logits):
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.1, 0.3, 0.6])
    m = 0.5 * (p + q)
    expected = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    assert jsd(q.log()[None, None], p.log()[None, None]).item() == pytest.approx(expected.item(), rel=1e-5)
    s, t = logits
    torch.testing.assert_close(jsd(s, t, beta=0.5), jsd(t, s, beta=0.5))
    assert (jsd(s, t, beta=0.5) <= math.log(2) + 1e-6).all()
    with pytest.raises(ValueError, match="beta must be in"):
        jsd(s, t, beta=1.0)


def test_identical_distributions_give_zero(logits):
    s, _ = logits
    for fn in (forward_kl, reverse_kl, jsd, tvd):
        assert fn(s, s.clone()).abs().max().item() < 1e-5
    assert acceptance_probability(s, s.clone()).sub(1).abs().max().item() < 1e-5


def test_accepted_length_by_hand():
    # alpha per position = 1, 0.5, 1, 0 (mask cuts the last). gamma 2 from t=0: 1 + 1*0.5 = 1.5.
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    s, t = q.log()[None], p.clamp(min=1e-30).log()[None]
    mask = torch.tensor([[True, True, True, False]])
    loss = accepted_length(s, t, mask, gamma=2)
    expected = -torch.tensor([[1 + 0.5, 0.5 + 0.5 * 1, 1 + 0, 0]]) / 2
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)


def test_cross_entropy_ignores_negative_labels(logits):
    s, _ = logits
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    ce = cross_entropy(s, labels)
    assert ce[0, 0].item() == 0
    ref = F.cross_entropy(s[1], labels[1], reduction="none")
    torch.testing.assert_close(ce[1], ref)


def test_densify_topk_keeps_topk_and_spreads_the_rest():
    p = torch.tensor([0.6, 0.25, 0.1, 0.05])
    top = torch.topk(p.log(), 2)
    dense = densify_topk(top.indices[None, None], top.values[None, None], 4).exp()[0, 0]
    torch.testing.assert_close(dense, torch.tensor([0.6, 0.25, 0.075, 0.075]))
    # with k = V it is the distribution itself
    full = torch.topk(p.log(), 4)
    torch.testing.assert_close(densify_topk(full.indices, full.values, 4).exp(), p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_are_zero_and_gradients_flow(name, logits):
    s, t = logits
    s = s.clone().requires_grad_(True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, -2:] = False
    losses = token_losses(name, s, t, mask, gamma=3)
    assert (losses[:, -2:] == 0).all()
    losses.sum().backward()
    assert s.grad[:, :3].abs().sum() > 0
    if name != "accepted_length":  # its windows look ahead only into valid positions, not back
        assert s.grad[:, -2:].abs().sum() == 0


@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("width", [5, 12, 40])
def test_forward_kl_against_a_top_k_teacher_equals_the_dense_teachers_in_value_and_gradient(temperature, width):
    # 6 rows, top-5 entries over a 60-token vocabulary, on a head of `width` columns: row 0's five
    # tokens have no column (index width), row 1's all do (with width 5 they are every column, so no
    # column holds the spread mass), the others a mix.
    gen = torch.Generator().manual_seed(3)
    vocab, k = 60, 5
    ids = torch.randperm(vocab, generator=gen)[:width]  # the head's columns, in column order
    indices = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(6)])
    outside = torch.tensor([t for t in range(vocab) if t not in set(ids.tolist())])
    indices[0] = outside[:k]
    indices[1] = ids[:k]
    logprobs = torch.log_softmax(torch.randn(6, vocab, generator=gen) * 2, -1).gather(1, indices)
    teacher = teacher_cache.topk_teacher(indices, logprobs, vocab, ids, temperature)
    dense = torch.log_softmax(densify_topk(indices, logprobs, vocab) / temperature, -1)[:, ids]  # the dense cache's
    torch.testing.assert_close(teacher.dense(), dense)
    assert (teacher.columns[0] == width).all() and (teacher.columns[1] < width).all()

    logits = torch.randn(6, width, generator=gen, requires_grad=True)
    sparse_loss = topk_forward_kl(logits, teacher, temperature)
    (grad_sparse,) = torch.autograd.grad((sparse_loss * torch.arange(1.0, 7.0)).sum(), logits)
    dense_loss = row_losses("forward_kl", logits, dense, temperature)
    (grad_dense,) = torch.autograd.grad((dense_loss * torch.arange(1.0, 7.0)).sum(), logits)
    assert float(dense_loss.detach().min()) > 0.01  # the distributions differ on every row
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_sparse, grad_dense, rtol=1e-4, atol=1e-6)
    rows = torch.tensor([4, 0, 4])
    torch.testing.assert_close(teacher.index_select(0, rows).dense(), dense[rows])
