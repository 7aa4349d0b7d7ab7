"""Training with the draft's head cut to a token subset: the cut logits, the teacher on the subset, the losses."""

import math

import pytest
import torch

from draftsmith.distill import teacher_cache
from draftsmith.distill.losses import (
    LOSSES,
    acceptance_probability,
    densify_topk,
    forward_kl,
    subset_token_losses,
    token_losses,
)
from draftsmith.distill.vocab_cut import loss_rows, loss_rows_head, subset_labels, teacher_log_probs
from draftsmith.specdec.errors import DraftsmithError
from tests.helpers import tiny_llama


def test_cut_head_gives_the_full_heads_logits_at_the_loss_rows_and_kept_ids_and_trains_only_their_rows():
    model = tiny_llama(vocab=40, seed=3)
    ids = torch.tensor([7, 1, 30, 12, 2])
    tokens = torch.tensor([[3, 8, 13, 21, 5], [9, 9, 4, 0, 33]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 1, 1]], dtype=torch.bool)
    rows = loss_rows(loss_mask)
    assert rows.tolist() == [1, 2, 4, 5, 8, 9]
    with torch.no_grad():
        full = model(tokens).logits  # (2, 5, 40)
    with loss_rows_head(model, rows, ids):
        cut = model(tokens).logits  # (6, 5)
    assert cut.shape == (6, 5)
    torch.testing.assert_close(cut.detach(), full[loss_mask][:, ids])
    cut.sum().backward()  # after the block, as the trainer's backward runs
    grad = model.lm_head.weight.grad  # (40, H)
    assert sorted(torch.nonzero(grad.abs().sum(-1)).flatten().tolist()) == [1, 2, 7, 12, 30]
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)  # the head is back
    assert model(tokens).logits.shape == (2, 5, 40)
    assert list(model.state_dict()) == list(tiny_llama(vocab=40, seed=3).state_dict())


# One position, V = 5: the target's p = (0.5, 0.2, 0.15, 0.1, 0.05); the head is cut to S = {0, 2, 3},
# where the draft's q = (0.6, 0.3, 0.1). p(S) = 0.75: 0.25 of the target's mass is out of the draft's reach.
P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
S = torch.tensor([0, 2, 3])
Q = torch.tensor([0.6, 0.3, 0.1])


def cut_loss(name: str, **kwargs) -> float:
    student = Q.log().view(1, 1, 3)  # logits whose softmax is Q
    teacher = P.log()[S].view(1, 1, 3)  # log p on S, normalized over all 5 tokens
    mask = torch.ones(1, 1, dtype=torch.bool)
    return float(subset_token_losses(name, student, teacher, mask, **kwargs)[0, 0])


def test_cut_losses_by_hand():
    # TVD over the full vocabulary: 0.5 (|0.5-0.6| + |0.15-0.3| + |0.1-0.1| + 0.2 + 0.05) = 0.25 = 1 - (0.5+0.15+0.1)
    assert cut_loss("tvd") == pytest.approx(0.25, abs=1e-6)
    # reverse KL(q || p) = 0.6 ln(0.6/0.5) + 0.3 ln(0.3/0.15) + 0.1 ln(1): finite, q is 0 outside S
    assert cut_loss("reverse_kl") == pytest.approx(0.6 * math.log(1.2) + 0.3 * math.log(2), abs=1e-6)
    assert cut_loss("reverse_kl") == pytest.approx(0.31733709, abs=1e-6)
    # forward KL against p given S: p_S = (2/3, 1/5, 2/15)
    assert cut_loss("forward_kl") == pytest.approx(0.02750493, abs=1e-6)
    # JSD(beta 1/2) over all 5 tokens, m = (p + q) / 2 (= p / 2 outside S): 0.5 KL(p||m) + 0.5 KL(q||m)
    assert cut_loss("jsd", jsd_beta=0.5) == pytest.approx(0.10166169, abs=1e-6)
    # expected accepted tokens of a 1-token round: alpha = sum_S min(p, q) = 0.75
    assert cut_loss("accepted_length", gamma=1) == pytest.approx(-0.75, abs=1e-6)


def test_cut_tvd_is_one_minus_the_acceptance_of_the_cut_draft_over_the_full_vocabulary():
    gen = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(2, 4, 30, generator=gen) * 2, torch.randn(2, 4, 30, generator=gen) * 2
    ids = torch.tensor([4, 9, 0, 17, 22, 29, 3])
    masked = torch.full_like(student, float("-inf"))
    masked[..., ids] = student[..., ids]  # the cut draft as it decodes: zero probability elsewhere
    mask = torch.ones(2, 4, dtype=torch.bool)
    for temp in (1.0, 0.7):
        tvd = subset_token_losses("tvd", student[..., ids], teacher_log_probs(teacher, ids, temp), mask, temp)
        torch.testing.assert_close(tvd, 1 - acceptance_probability(masked, teacher, temp))
        fkl = subset_token_losses("forward_kl", student[..., ids], teacher_log_probs(teacher, ids, temp), mask, temp)
        torch.testing.assert_close(fkl, forward_kl(student[..., ids], teacher[..., ids], temp))


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_with_every_token_kept_is_the_full_heads(name):
    gen = torch.Generator().manual_seed(2)
    teacher, student = torch.randn(2, 5, 11, generator=gen) * 2, torch.randn(2, 5, 11, generator=gen) * 2
    mask = torch.tensor([[1, 1, 1, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    ids = torch.randperm(11, generator=gen)  # every token, in another order
    want = token_losses(name, student, teacher, mask, 1.5, jsd_beta=0.3, gamma=3)
    got = subset_token_losses(name, student[..., ids], teacher_log_probs(teacher, ids, 1.5), mask, 1.5, 0.3, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert bool((got[~mask] == 0).all())


def test_labels_become_cut_head_columns_and_those_outside_are_ignored():
    labels = torch.tensor([[7, 3, -100, 12], [2, 7, 5, -100]])
    got = subset_labels(labels, torch.tensor([12, 7, 2]), vocab_size=20)
    assert got.tolist() == [[1, -100, -100, 0], [2, 1, -100, -100]]


@pytest.mark.parametrize(("top_k", "temperature"), [(4, 1.0), (4, 2.0), (10, 0.5)])
def test_cached_teacher_on_the_kept_ids_is_the_dense_caches(top_k, temperature):
    gen = torch.Generator().manual_seed(3)
    logprobs_full = torch.log_softmax(torch.randn(6, 10, generator=gen) * 2, -1)  # (M, V)
    top = torch.topk(logprobs_full, top_k, dim=-1)
    ids = torch.tensor([8, 0, 5, 2, 9])
    dense = densify_topk(top.indices, top.values, 10)  # (M, V)
    want = torch.log_softmax(dense / temperature, -1)[:, ids]
    got = teacher_cache.topk_teacher(top.indices, top.values, 10, ids, temperature).dense()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cache_is_named_by_content_and_entries_are_found_by_content(tmp_path):
    examples = [
        {"input_ids": [0, 5, 6, 7, 1], "loss_mask": [0, 1, 1, 1, 0]},
        {"input_ids": [0, 9, 8, 1], "loss_mask": [0, 0, 1, 0]},
        {"input_ids": [0, 5, 6, 7, 1], "loss_mask": [0, 1, 1, 1, 0]},  # a repeat is run once
    ]
    key = teacher_cache.cache_key("t", torch.float32, examples, 3, 1.0)
    assert teacher_cache.cache_key("t", torch.float32, examples[::-1], 3, 1.0) == key
    assert teacher_cache.cache_key("t", torch.bfloat16, examples, 3, 1.0) != key
    assert teacher_cache.cache_key("t", torch.float32, examples[:2], 3, 1.0) != key
    model = tiny_llama(vocab=12, seed=4)
    folder = teacher_cache.build(
        model, examples, tmp_path / key, teacher_cache.StoreFormat(3), batch_size=2, progress=False
    )
    meta = (folder / "meta.json").read_text()
    assert '"examples": 2' in meta and '"tokens": 4' in meta
    second, first = teacher_cache.Store(folder).lookup([examples[1], examples[0]])
    assert first[0].shape == (3, 3) and second[0].shape == (1, 3)
    with torch.no_grad():
        logits = model(torch.tensor([examples[0]["input_ids"]])).logits[0, 1:4]  # its 3 loss positions
    want = torch.topk(torch.log_softmax(logits, -1), 3, dim=-1)
    assert first[0].tolist() == want.indices.tolist()
    torch.testing.assert_close(first[1], want.values, atol=1e-3, rtol=0)  # float16 in the cache
    with pytest.raises(DraftsmithError, match="lacks 1 of these examples"):
        teacher_cache.Store(folder).lookup([{"input_ids": [0, 2, 1], "loss_mask": [0, 1, 0]}])
