"""The lean training step (heads at the loss rows only) against the old formula (heads at every position).

The old formula is composed here from the functions the trainer used before: the draft's and the
target's logits at every position (B, T, V), ``token_losses`` / ``subset_token_losses`` masked, and
the dense (B, T, V) teacher cache. The lean step must give the same loss and gradients for every
loss, with the full and the cut head, the live target and the top-k cache, with and without
cross-entropy mixed in; and the held-out alpha and the teacher cache the same values.
"""

import copy
import math

import pytest
import torch
from accelerate import Accelerator

from draftsmith.distill import teacher_cache, vocab_cut
from draftsmith.distill.data import collate
from draftsmith.distill.losses import (
    LOSSES,
    TopkTeacher,
    acceptance_probability,
    cross_entropy,
    densify_topk,
    row_token_losses,
    subset_token_losses,
    token_losses,
)
from draftsmith.distill.tiny import tiny_target
from draftsmith.train import examples as train_examples
from draftsmith.train.config import DistillConfig, LossSection, TeacherSection
from draftsmith.train.loop import LossHead, distill_step_loss, heldout_metrics
from tests.helpers import first_layers, noisy_copy

TINY = {"num_hidden_layers": 2, "hidden_size": 32}
IDS = torch.tensor([1, 7, 30, 12, 2, 40, 41, 42, 50, 60, 61, 70, 88, 99])  # a cut head: 14 of 103 tokens, EOS (1) kept
PAD = 1


@pytest.fixture(scope="module")
def models():
    """(target, draft): the tiny target (float32) and a noisy copy of its first layer, head trainable."""
    target, _ = tiny_target(seed=0, **TINY)
    target.requires_grad_(False).eval()
    draft = noisy_copy(first_layers(target, 1), noise=0.2).train().requires_grad_(True)
    return target, draft


def example(prompt: int, answer: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 103, (prompt + answer,), generator=gen).tolist()
    return {"input_ids": ids, "loss_mask": [0] * prompt + [1] * (answer - 1) + [0]}


# Prompts and answers of different lengths, so the batch is padded and most positions are not loss rows.
EXAMPLES = [example(6, 9, 0), example(3, 4, 1), example(9, 12, 2), example(4, 7, 3)]


def make_cfg(loss: str, ce_weight: float, cache: bool) -> DistillConfig:
    return DistillConfig(
        target="tiny",
        tiny_target=TINY,
        loss=LossSection(name=loss, temperature=1.3, jsd_beta=0.3, gamma=3, ce_weight=ce_weight),
        teacher=TeacherSection(cache=cache, top_k=8),
    )


def old_step_loss(cfg, draft, target, batch, ids, dense_teacher) -> torch.Tensor:
    """The trainer's step loss before the lean path: every head at every position of the batch."""
    mask = batch["loss_mask"]
    labels = torch.where(mask, batch["input_ids"].roll(-1, dims=1), -100)
    student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    args = (cfg.loss.temperature, cfg.loss.jsd_beta, cfg.loss.gamma)
    if ids is None:
        losses = token_losses(cfg.loss.name, student, dense_teacher, mask, *args)
    else:
        student = student[..., ids]  # (B, T, N)
        losses = subset_token_losses(cfg.loss.name, student, dense_teacher, mask, *args)
        labels = vocab_cut.subset_labels(labels, ids, target.config.vocab_size)
    if cfg.loss.ce_weight:
        losses = (1 - cfg.loss.ce_weight) * losses + cfg.loss.ce_weight * cross_entropy(student, labels)
    return losses.sum()


def old_teacher(cfg, target, batch, ids, entries) -> torch.Tensor:
    """The old teacher tensor: (B, T, V) logits or dense cache log-probs, or (B, T, N) log-probs on ``ids``."""
    vocab, temperature = target.config.vocab_size, cfg.loss.temperature
    if entries is None:
        with torch.no_grad():
            logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits if ids is None else vocab_cut.teacher_log_probs(logits, ids, temperature)
    mask = batch["loss_mask"]
    dense = torch.full((*mask.shape, vocab), -math.log(vocab))  # (B, T, V): uniform off the loss rows
    for row, (top_ids, top_logps) in enumerate(entries):
        dense[row, mask[row]] = densify_topk(top_ids, top_logps, vocab)
    return dense if ids is None else torch.log_softmax(dense / temperature, -1)[..., ids]


def gradients(draft) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    return grads


CASES = [(loss, 0.0) for loss in LOSSES] + [("forward_kl", 0.3), ("tvd", 0.5)]


@pytest.mark.parametrize("source", ["live", "cache", "sparse_cache"])
@pytest.mark.parametrize("cut", [False, True], ids=["full", "cut"])
@pytest.mark.parametrize(("loss", "ce_weight"), CASES)
def test_lean_step_loss_and_gradients_equal_the_old_formula(models, source, cut, loss, ce_weight):
    """sparse_cache: the cache's entries kept as top-k (a kind that does not read the teacher's
    log-probs); forward KL is then taken without a dense teacher, the other losses on its dense form."""
    target, draft = models
    cached = source != "live"
    cfg = make_cfg(loss, ce_weight, cache=cached)
    ids = IDS if cut else None
    train = copy.deepcopy(EXAMPLES)
    sparse = source == "sparse_cache"
    accelerator = Accelerator(cpu=True)
    settings = train_examples.teacher_settings(cfg, accelerator.device, ids, sparse=sparse)
    teacher = train_examples.teacher(cfg, target, (train, []), PAD, accelerator, settings)
    batch = collate(train, PAD)
    rows_given = teacher(batch, vocab_cut.loss_rows(batch["loss_mask"])).log_probs
    assert isinstance(rows_given, TopkTeacher) == (sparse and loss == "forward_kl")
    entries = None
    if cached:
        folder = teacher_cache.folder_for(train_examples.target_name(cfg), target.dtype, train, 8)
        entries = teacher_cache.Store(folder).lookup(train)

    old = old_step_loss(cfg, draft, target, batch, ids, old_teacher(cfg, target, batch, ids, entries))
    old.backward()
    old_grads = gradients(draft)
    lean = distill_step_loss(cfg, draft, teacher, batch, LossHead(draft, ids, target.config.vocab_size))
    lean.backward()
    lean_grads = gradients(draft)

    assert int(batch["loss_mask"].sum()) == 28 and batch["loss_mask"].numel() == 4 * 21  # 28 loss rows of 84
    assert abs(float(old.detach())) > 0.1
    assert float(lean.detach()) == pytest.approx(float(old.detach()), abs=1e-5, rel=1e-5)
    assert sorted(lean_grads) == sorted(old_grads)
    for name, grad in old_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert isinstance(draft.get_output_embeddings(), torch.nn.Linear)  # the head is back after the step


def test_accepted_length_at_the_rows_keeps_windows_over_consecutive_positions():
    # One sequence, 6 positions, loss rows 1..4: alpha there 0.5, 0.8, 1.0, 0.25 (others masked out).
    mask = torch.tensor([[False, True, True, True, True, False]])
    rows = vocab_cut.loss_rows(mask)
    p = torch.tensor([[0.5, 0.5], [0.8, 0.2], [0.3, 0.7], [0.25, 0.75]]).log()  # teacher on 2 columns
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.3, 0.7], [1.0, 0.0]]).clamp(min=1e-12).log()
    got = row_token_losses("accepted_length", q, p, mask, rows, gamma=2)
    # gamma 2: (alpha_t + alpha_t alpha_t+1) / 2, the window stopping at the mask's end
    expected = [-(0.5 + 0.5 * 0.8) / 2, -(0.8 + 0.8 * 1.0) / 2, -(1.0 + 1.0 * 0.25) / 2, -(0.25 + 0) / 2]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("cut", [False, True], ids=["full", "cut"])
def test_heldout_alpha_at_the_rows_equals_the_full_vocabulary_formula(models, cut):
    target, draft = models
    ids = IDS if cut else None
    batch = collate(EXAMPLES, PAD)
    with torch.no_grad():
        p = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        q = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if cut:
        q = torch.full_like(q, float("-inf")).index_copy(-1, IDS, q[..., IDS])  # the cut draft as it decodes
    expected = acceptance_probability(q, p)[batch["loss_mask"]].mean()
    got = heldout_metrics(draft, target, [batch], Accelerator(cpu=True), LossHead(draft, ids, target.config.vocab_size))
    assert got["acceptance_rate"] == pytest.approx(float(expected), abs=1e-6)
    assert 0.05 < got["acceptance_rate"] < 0.95
    assert draft.training


def test_heldout_evaluations_run_the_frozen_target_once_per_batch(models):
    target, draft = models[0], copy.deepcopy(models[1])  # this test changes the draft
    head = LossHead(draft, IDS, target.config.vocab_size)
    batches = [collate(EXAMPLES[:2], PAD), collate(EXAMPLES[2:], PAD)]
    calls = []
    hook = target.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        plain = heldout_metrics(draft, target, batches, Accelerator(cpu=True), head)
        memo: dict = {}
        first = heldout_metrics(draft, target, batches, Accelerator(cpu=True), head, memo)
        assert len(calls) == 4  # two evaluations, two batches each
        with torch.no_grad():
            weight = draft.model.layers[0].mlp.down_proj.weight
            weight.add_(0.5 * torch.randn_like(weight))  # as training steps would
        again = heldout_metrics(draft, target, batches, Accelerator(cpu=True), head, memo)
        assert len(calls) == 4  # the target's layers did not run again
        assert again["acceptance_rate"] == pytest.approx(
            heldout_metrics(draft, target, batches, Accelerator(cpu=True), head)["acceptance_rate"], abs=1e-6
        )
        assert again["acceptance_rate"] != first["acceptance_rate"]  # the draft's side is evaluated anew
        other = [batches[1], batches[0]]  # other input ids at the same places: the target runs again
        swapped = heldout_metrics(draft, target, other, Accelerator(cpu=True), head, memo)
        assert swapped["acceptance_rate"] == pytest.approx(again["acceptance_rate"], abs=1e-6)
        assert len(calls) == 6 + 2  # the two plain evaluations above, then the two new batches
    finally:
        hook.remove()
    assert plain["acceptance_rate"] == pytest.approx(first["acceptance_rate"], abs=1e-6)


def test_teacher_cache_built_at_the_rows_holds_the_top_k_of_the_full_log_softmax(models, tmp_path):
    target, _ = models
    folder = teacher_cache.build(
        target, EXAMPLES, tmp_path / "cache", teacher_cache.StoreFormat(5), batch_size=3, progress=False
    )
    entries = teacher_cache.load(folder)
    for example, (ids, logps) in zip(EXAMPLES, entries, strict=True):
        tokens = torch.tensor([example["input_ids"]])
        with torch.no_grad():
            log_p = torch.log_softmax(target(tokens).logits[0], -1)[
                torch.tensor(example["loss_mask"], dtype=torch.bool)
            ]
        top = torch.topk(log_p, 5, dim=-1)
        assert ids.shape == (sum(example["loss_mask"]), 5)
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(logps, top.values.half().float())


def test_kept_rows_of_a_frozen_head_are_copied_once_and_again_after_an_in_place_change():
    weight = torch.nn.Parameter(torch.randn(10, 4), requires_grad=False)
    ids = torch.tensor([3, 0, 7])
    first = vocab_cut.kept_rows(weight, ids, torch.float32)
    assert vocab_cut.kept_rows(weight, ids, torch.float32) is first  # no new copy at the next forward
    torch.testing.assert_close(first, weight[ids])
    with torch.no_grad():
        weight.mul_(2)  # as a load or an optimizer step would
    again = vocab_cut.kept_rows(weight, ids, torch.float32)
    assert again is not first
    torch.testing.assert_close(again, weight[ids])
    assert vocab_cut.kept_rows(weight, ids, torch.bfloat16).dtype == torch.bfloat16
    trained = torch.nn.Parameter(torch.randn(10, 4))
    rows = vocab_cut.kept_rows(trained, ids, torch.float32)
    rows.sum().backward()  # a trained head's gradient reaches its kept rows only
    assert trained.grad.abs().sum(-1).nonzero().flatten().tolist() == [0, 3, 7]
