"""The parallel draft kind (PARD): one draft forward proposes K tokens, the output stays the target's.

Greedy identity in chains, trees, batch 1 and ragged batches; sampled output fits the target's own
distribution (chi-square, reference computed in the tests' helpers in float64), and broken rules,
including one of this kind's own (reporting another mask row's q), fail the same fit; one draft
forward per round, counted; the masks never stay in the draft's cache; the training layout gives a
mask chain what decoding gives it; training through ``draftsmith distill`` raises the acceptance of
positions 2..K; the published folder is what vLLM's parallel drafting loads (a real server, marked).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.cli import main
from draftsmith.distill import data as ddata
from draftsmith.distill.drafts import kind_of_folder, load_draft, parallel
from draftsmith.distill.drafts.kind import Batch, DraftSettings, Serving
from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.distill.drafts.parallel import (
    KIND,
    ChainSettings,
    ParallelDraft,
    chain_layout,
    cod_depths,
    draft_weights,
    gold_probs,
    loss_runs,
    mask_weights,
    position_acceptance,
)
from draftsmith.specdec import draft_vocab, proposal, verify
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.theory import predicted_speedup
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt, encode_chat, read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.stream import left_pad
from draftsmith.specdec.tree import TreeShape
from draftsmith.specdec.vllm_client import complete_batch, read_spec_counters
from draftsmith.specdec.vllm_server import ServeOptions, serve
from draftsmith.train.config import load_run_config
from draftsmith.train.models import load_target
from draftsmith.train.speedup import measure_draft
from tests.helpers import (
    always_accept,
    assert_fits,
    check_card_usage,
    correct_from_p,
    fit_scores,
    noisy_copy,
    sample_spec,
    sampled_fit,
    target_conditionals,
    tiny_llama,
    tiny_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster on a shared CPU

V, MASK = 32, 31  # the tiny targets never write token 31 in these prompts; it is only a mask
PROMPTS = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, layers=2, sharpness=8.0)


@pytest.fixture(scope="module")
def draft(target):
    """A draft that is often right at the next token and sometimes further on."""
    return ParallelDraft(noisy_copy(target, noise=0.3), MASK).eval()


def greedy(target, prompts, n):
    return target_generate(target, prompts, n)[0]


# ---- one forward, K proposals, no mask left behind ----------------------------------------------------


def test_one_draft_forward_per_round_gives_k_proposals(target, draft):
    widths = []  # input width of every draft forward
    hook = draft.lm.register_forward_hook(
        lambda m, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out, stats = speculative_generate(target, draft, [PROMPTS[2]], 30, options=DecodeOptions(gamma=5))
    finally:
        hook.remove()
    assert out == greedy(target, [PROMPTS[2]], 30)
    # The prefill, then one forward per round; none in a last round that may emit only one token.
    assert len(widths) == stats.draft_forwards and stats.rounds <= stats.draft_forwards <= stats.rounds + 1
    assert widths[0] == len(PROMPTS[2])
    # Each round reads the unread committed tokens (the accepted drafts and the target's token) and 4 masks.
    # Rounds near max_new_tokens draft fewer (fewer masks); the others read 1 to 6 tokens and 4 masks.
    full = [w for w in widths[1:] if w >= 5]
    assert len(full) >= stats.rounds - 3 and all(w <= 6 + 4 for w in full)
    assert widths[1] == 1 + 4  # the first round has only the target's first token to read
    # Every round but the last ones (max_new_tokens near) proposes all 5 tokens.
    assert stats.proposed >= 5 * (stats.rounds - 2) and 0 < stats.accepted < stats.proposed


def test_propose_reads_the_unread_tokens_and_masks_in_one_forward_and_crops_the_masks(target, draft):
    sequence = PROMPTS[0] + [12, 3, 6]
    verifier, drafter = draft.decoding_pair(target, 1, 64, DecodeOptions(gamma=4))
    with torch.inference_mode():
        tokens = torch.tensor([PROMPTS[0]])
        drafter.prefill(tokens, tokens >= 0)
        proposal = drafter.propose([sequence], torch.tensor([4]), DecodeOptions(gamma=4), None)
        # The draft's own logits over [sequence, m, m, m], in one plain forward, give the same 4 tokens.
        plain = draft.lm(input_ids=torch.tensor([sequence + [MASK] * 3])).logits[0, -4:].argmax(-1)
    assert proposal.steps == 1 and proposal.counts.tolist() == [4] and proposal.probs is None
    assert proposal.tokens[0].tolist() == plain.tolist()
    # The cache holds the committed tokens, no mask: as a fresh prefill of them would.
    assert drafter.stream.lengths == [len(sequence)] and drafter.stream.tracker.length == len(sequence)
    fresh = copy.deepcopy(drafter.stream)
    fresh.rollback(torch.tensor([0]))
    with torch.inference_mode():
        fresh.forward(torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.bool))
    for mine, theirs in zip(drafter.stream.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys[:, :, : len(sequence)], theirs.keys[:, :, : len(sequence)])
        torch.testing.assert_close(mine.values[:, :, : len(sequence)], theirs.values[:, :, : len(sequence)])


def test_budgets_and_dynamic_gamma_cut_each_chain(target, draft):
    sequences = [PROMPTS[0] + [4], PROMPTS[1] + [9], PROMPTS[2] + [2]]
    options = DecodeOptions(gamma=4, confidence_threshold=0.6)
    _, drafter = draft.decoding_pair(target, 3, 64, options)
    with torch.inference_mode():
        drafter.prefill(*left_pad(PROMPTS, torch.device("cpu")))
        budget = torch.tensor([4, 0, 2])
        proposal = drafter.propose(sequences, budget, options, None)
        logits = torch.stack(
            [draft.lm(input_ids=torch.tensor([s + [MASK] * 3])).logits[0, -4:] for s in sequences]
        )  # (3, 4, V)
    sure = logits.softmax(-1).max(-1).values >= 0.6  # (3, 4)
    leading = sure.long().cumprod(1).sum(1)
    assert proposal.counts.tolist() == torch.minimum(budget, leading + 1).tolist()
    assert proposal.steps == 1
    # The sequence with nothing to draft read nothing; the others read their unread token.
    assert drafter.stream.lengths == [len(PROMPTS[0]) + 1, len(PROMPTS[1]), len(PROMPTS[2]) + 1]


# ---- greedy identity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_identical_to_the_target_batch_1_and_ragged(target, draft, gamma):
    want = greedy(target, PROMPTS, 25)
    for prompt, reference in zip(PROMPTS, want, strict=True):
        out, stats = speculative_generate(target, draft, [prompt], 25, options=DecodeOptions(gamma=gamma))
        assert out == [reference] and stats.rounds <= stats.draft_forwards <= stats.rounds + 1
    batched, stats = speculative_generate(target, draft, PROMPTS, 25, options=DecodeOptions(gamma=gamma))
    assert batched == want
    assert 0 < stats.accepted < stats.proposed


def test_compiled_decoding_is_greedy_identical_too(target, draft):
    # The drafter's forward over [unread, masks] and the crop run on the compiled static-cache stream.
    want = greedy(target, PROMPTS, 25)
    options = DecodeOptions(gamma=4, compile=True)
    assert speculative_generate(target, draft, PROMPTS, 25, options=options)[0] == want
    assert [speculative_generate(target, draft, [p], 25, options=options)[0][0] for p in PROMPTS] == want


def test_a_draft_equal_to_the_target_still_only_guesses_past_the_first_token(target):
    # At the next token it is the target; at a mask it is the target reading an unused token.
    same = ParallelDraft(copy.deepcopy(target), MASK).eval()
    out, stats = speculative_generate(target, same, [PROMPTS[0]], 20, options=DecodeOptions(gamma=3))
    assert out == greedy(target, [PROMPTS[0]], 20)
    assert stats.accepted >= stats.rounds - 1  # the first proposal of every round (but maybe the last) is right


def test_greedy_with_dynamic_gamma_eos_and_short_budgets(target, draft):
    options = DecodeOptions(gamma=5, confidence_threshold=0.5)
    got, stats = speculative_generate(target, draft, PROMPTS, 25, options=options)
    assert got == greedy(target, PROMPTS, 25)
    assert stats.proposed < 5 * stats.seq_rounds  # the threshold cut some chains
    full = greedy(target, [PROMPTS[0]], 20)[0]
    eos = full[6]
    out, _ = speculative_generate(target, draft, [PROMPTS[0]], 20, options=DecodeOptions(gamma=6), eos_ids={eos})
    assert out[0] == full[: full.index(eos) + 1]
    for n in (1, 2, 3):
        assert speculative_generate(target, draft, PROMPTS, n, options=DecodeOptions(gamma=6))[0] == greedy(
            target, PROMPTS, n
        )


@pytest.mark.parametrize("shape", ["3", "3,2,1", "2,2,2,2", "3,2,2,1:6"])
def test_token_trees_are_greedy_identical_with_one_draft_forward_per_round(target, draft, shape):
    tree = TreeShape.parse(shape)
    for prompt in PROMPTS:
        out, stats = speculative_generate(target, draft, [prompt], 25, options=DecodeOptions(tree=tree))
        assert out == greedy(target, [prompt], 25)
        assert stats.rounds <= stats.draft_forwards <= stats.rounds + 1


# ---- sampling is exact -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    """A 12-token target, and a parallel draft that is sometimes right at every position."""
    model = tiny_llama(vocab=12, sharpness=3.0, seed=0)
    return model, ParallelDraft(noisy_copy(model, noise=0.3), 11).eval()


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_sampled_output_follows_the_target(small, gamma):
    target, draft = small
    params = SamplingParams(temperature=1.0)
    a, b, stats = sample_spec(target, draft, params, gamma)
    assert_fits(target, params, a, b)
    assert 0 < stats.accepted < stats.proposed and stats.draft_forwards <= stats.rounds + 1


@pytest.mark.parametrize("params", [SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)], ids=["k5", "p0.8"])
def test_sampled_output_follows_the_target_with_temperature_topk_topp(small, params):
    target, draft = small
    a, b, _ = sample_spec(target, draft, params, 3, seed=1)
    assert_fits(target, params, a, b)


def test_greedy_drafting_and_dynamic_gamma_stay_exact_when_sampling(small):
    target, draft = small
    params = SamplingParams(temperature=1.0)
    a, b, _ = sample_spec(target, draft, params, 4, seed=2, draft_greedy=True)
    assert_fits(target, params, a, b)
    a, b, stats = sample_spec(target, draft, params, 4, seed=3, confidence_threshold=0.5)
    assert_fits(target, params, a, b)
    assert stats.proposed < 4 * stats.seq_rounds


def test_sampled_trees_follow_the_target(small):
    # Trees decode one sequence per call: one prompt, four tokens (a full round of the two levels
    # and the bonus, then the next round's first), 1000 samples.
    target, draft = small
    params = SamplingParams(temperature=1.0, top_k=8)
    options = DecodeOptions(tree=TreeShape.parse("3,2"), sampling=params)
    generator = torch.Generator().manual_seed(0)
    prompt, accepted = [0, 4, 9], 0
    samples = []
    for _ in range(1000):
        out, stats = speculative_generate(target, draft, [prompt], 4, options, generator=generator)
        samples.append(out[0])
        accepted += stats.accepted
    samples = torch.tensor(samples)
    scores = fit_scores(samples, target_conditionals(target, prompt, samples, params))
    assert max(scores.values()) < 4, scores
    assert accepted > 0


def raw_q(real_step):
    """The draft samples from its processed q but reports its raw softmax."""

    def step(logits, options, generator):
        token, _, confident, confidence = real_step(logits, options, generator)
        return token, logits.float().softmax(-1), confident, confidence

    return step


@pytest.mark.parametrize("control", ["always accept", "correct from p", "raw q", "first row's q"])
def test_broken_rules_fail_the_same_fit(small, monkeypatch, control):
    target, draft = small
    params = SamplingParams(0.7, top_k=5)
    if control in ("always accept", "correct from p"):
        monkeypatch.setattr(verify, "accept_sampled", always_accept if control == "always accept" else correct_from_p)
    elif control == "raw q":
        monkeypatch.setattr(proposal, "draft_step", raw_q(proposal.draft_step))  # the chain loop's draws
    else:
        monkeypatch.setattr(
            parallel.ParallelDrafter, "propose", reported_as_first_row(parallel.ParallelDrafter.propose)
        )
    a, b, _ = sample_spec(target, draft, params, 3)
    scores = sampled_fit(target, params, (a, b))
    assert max(scores.values()) > 10, scores


def reported_as_first_row(propose):
    """The proposal's q for every position replaced by the q of its first position."""

    def wrapped(self, sequences, budget, options, generator):
        proposal = propose(self, sequences, budget, options, generator)
        if proposal.probs is not None:  # None: nothing was drafted
            proposal.probs = proposal.probs[:, :1].expand_as(proposal.probs).clone()
        return proposal

    return wrapped


# ---- training: the chain layout, the conditional drop, the weights ---------------------------------------


def test_loss_runs_count_consecutive_loss_rows():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert loss_runs(mask).tolist() == [[0, 3, 2, 1, 0, 1], [2, 1, 0, 0, 0, 0]]


def test_conditional_drop_keeps_a_shrinking_share_of_chains_each_with_its_earlier_steps():
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 5:37] = True  # 32 loss rows
    mask[1, 0:16] = True  # 16
    depth, inclusion = cod_depths(mask, 4, 0.5, 0.0, torch.Generator().manual_seed(0))
    runs = loss_runs(mask)
    for step, share in ((1, 0.5), (2, 0.25), (3, 0.125)):
        assert (depth >= step).sum(1).tolist() == [round(share * 32), round(share * 16)]
        assert bool((runs[depth >= step] >= step + 1).all())  # every kept step has its teacher row
    assert bool((depth[~mask] == -1).all()) and bool((depth[mask] >= 0).all())
    # Step 1 draws 16 of the 31 rows of row 0 that have a next loss row; step 2, 8 of those 16 that qualify.
    qualified = ((depth >= 1) & (runs >= 3)).sum(1)
    assert inclusion[0, 1] == pytest.approx(16 / 31) and inclusion[0, 2] == pytest.approx(16 / 31 * 8 / qualified[0])
    everything, certain = cod_depths(mask, 4, 1.0, 1.0)
    assert torch.equal(everything, torch.where(mask, (runs - 1).clamp(max=3), -1)) and bool((certain == 1).all())


def test_a_mask_chain_in_training_sees_what_it_sees_when_drafting(draft):
    ids = torch.tensor([[0, 5, 7, 9, 4, 12, 3, 1, 1], [0, 3, 8, 8, 2, 6, 10, 11, 4]])
    attention = torch.tensor([[1] * 7 + [0, 0], [1] * 9])
    loss = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    rows = loss.flatten().nonzero()[:, 0]
    depth, _ = cod_depths(loss, 4, 1.0, 1.0)
    chains = chain_layout(ids, attention, rows, depth, MASK)
    with torch.no_grad():
        logits = draft.lm(
            input_ids=chains.input_ids, attention_mask=chains.attention, position_ids=chains.positions
        ).logits.flatten(0, 1)[chains.rows]  # (M + E, V)
        plain = draft.lm(input_ids=ids, attention_mask=attention).logits.flatten(0, 1)[rows]
        torch.testing.assert_close(logits[: len(rows)], plain, rtol=1e-5, atol=1e-5)  # the ordinary predictions
        width = ids.shape[1]
        for i, (anchor, step) in enumerate(zip(chains.anchor.tolist(), chains.step.tolist(), strict=True)):
            row, t = divmod(anchor, width)
            drafting = ids[row, : t + 1].tolist() + [MASK] * step  # what the drafter feeds
            alone = draft.lm(input_ids=torch.tensor([drafting])).logits[0, -1]
            torch.testing.assert_close(logits[len(rows) + i], alone, rtol=1e-5, atol=1e-5)
    # Every chain that fits: row 0 has anchors 2..5 (4 loss rows), row 1 anchors 3..7.
    assert sorted(zip(chains.anchor.tolist(), chains.step.tolist(), strict=True)) == sorted(
        [(a, s) for a in range(2, 6) for s in range(1, 6 - a)]
        + [(9 + a, s) for a in range(3, 8) for s in range(1, min(4, 8 - a))]
    )


def one_chain(steps: int, anchor: int = 0) -> parallel.Chains:
    """The layout fields the weights read: one chain of ``steps`` masks at ``anchor``."""
    width = 4 + steps
    return parallel.Chains(
        input_ids=torch.zeros(1, width, dtype=torch.long),
        positions=torch.zeros(1, width, dtype=torch.long),
        attention=torch.ones(1, 1, width, width, dtype=torch.bool),
        rows=torch.arange(width),
        anchor=torch.full((steps,), anchor),
        step=torch.arange(1, steps + 1),
    )


def test_draft_weights_are_the_acceptance_of_the_earlier_steps_at_least_the_floor_over_the_chance_of_being_kept():
    # One sequence of 4 positions, loss rows 0..3; chains at anchor 0 (steps 1, 2) and anchor 1 (step 1).
    rows = torch.tensor([0, 1, 2, 3])
    chains = one_chain(2)
    chains.anchor, chains.step = torch.tensor([0, 0, 1]), torch.tensor([1, 2, 1])
    alpha = torch.tensor([0.5, 0.8, 0.9, 0.4, 0.6, 0.3, 0.7])  # 4 ordinary rows, then the 3 masks
    inclusion = torch.tensor([[1.0, 0.5, 0.25]], dtype=torch.float64)
    weights = draft_weights(alpha, rows, chains, inclusion, cells=4, k=3, floor=0.0)
    torch.testing.assert_close(weights, torch.tensor([0.5 / 0.5, 0.5 * 0.6 / 0.25, 0.8 / 0.5]))
    floored = draft_weights(alpha, rows, chains, inclusion, cells=4, k=3, floor=0.4)
    torch.testing.assert_close(floored, torch.tensor([0.5 / 0.5, 0.4 / 0.25, 0.8 / 0.5]))


def weights_for(scheme: str, alpha: list[float], gold: list[float], floor: float = 0.1) -> list[float]:
    """The weights ``scheme`` gives one chain of len(alpha) - 1 masks anchored at loss row 0 of a
    sequence of 4 loss rows whose true tokens have target probability ``gold``, the draft's current
    acceptance being ``alpha`` (the ordinary prediction, then the masks); nothing dropped."""
    steps = len(alpha) - 1
    chains = one_chain(steps)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    rows = torch.arange(4)
    teacher = torch.full((4, 16), 1e-9)
    teacher[rows, ids[0, 1:]] = torch.tensor(gold)  # p of each row's true next token
    batch = Batch(ids, torch.ones_like(ids), torch.ones(1, 5, dtype=torch.bool), rows, None, {}, teacher.log())
    logits = torch.zeros(4 + steps, 16)
    teacher_rows = torch.cat([rows, torch.arange(1, steps + 1)])
    settings = ChainSettings(k=steps + 1, chain_weights=scheme, weight_floor=floor)
    inclusion = torch.ones(1, steps + 1, dtype=torch.float64)
    if scheme == "draft":  # the draft's acceptance: position 1 at every loss row, then the masks
        acceptances = torch.tensor([alpha[0]] * 4 + alpha[1:])
        return draft_weights(acceptances, rows, chains, inclusion, cells=5, k=steps + 1, floor=floor).tolist()
    return mask_weights(settings, logits, chains, teacher_rows, inclusion, batch, 16).tolist()


def test_each_scheme_weighs_the_masks_of_a_chain_as_its_source_does():
    # Acceptances as measured on a parallel draft trained by the draft's own acceptance: position 1 at
    # 0.2, the masks at 0.138, 0.051, 0.038; the target's probability of the true tokens 0.9, 0.8, 0.7.
    alpha, gold = [0.2, 0.138, 0.051, 0.038], [0.9, 0.8, 0.7, 0.6]
    # Without a floor the draft's acceptance starves the deep masks: 0.2, 0.0276, 0.0014.
    assert weights_for("draft", alpha, gold, floor=0.0) == pytest.approx([0.2, 0.2 * 0.138, 0.2 * 0.138 * 0.051])
    assert weights_for("draft", alpha, gold) == pytest.approx([0.2, 0.1, 0.1])
    # PARD: every kept mask row at full weight.
    assert weights_for("equal", alpha, gold) == [1.0, 1.0, 1.0]
    # PARD-2: the target's probability of the tokens the earlier steps stand for, whatever the draft does.
    assert weights_for("target", alpha, gold) == pytest.approx([0.9, 0.72, 0.504])
    assert weights_for("target", alpha, [0.9, 0.1, 0.7, 0.6], floor=0.2) == pytest.approx([0.9, 0.2, 0.2])


def test_gold_probabilities_read_the_true_next_token_over_the_cut_head():
    ids = torch.tensor([[3, 5, 7, 9]])
    rows = torch.tensor([0, 1, 2])  # true next tokens 5, 7, 9
    head = torch.tensor([5, 9, 2])  # 7 is not in the cut
    teacher = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.5, 0.4]]).log()  # over the cut's columns
    batch = Batch(ids, torch.ones_like(ids), torch.ones(1, 4, dtype=torch.bool), rows, head, {}, teacher)
    assert gold_probs(batch, 16).tolist() == pytest.approx([0.6, 0.0, 0.5])


def tiny_batch(target):
    """Two target answers (8 loss rows each) after two prompts, right-padded, with the teacher's log-probs."""
    prompts = [[0, 5, 7, 9], [0, 3, 8]]
    answers = target_generate(target, prompts, 8)[0]
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [1] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    loss = torch.zeros(ids.shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        loss[row, len(prompt) - 1 : len(prompt) + 7] = True  # predicting each answer token
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def test_the_training_forward_gives_next_token_predictions_first_then_weighted_chain_steps(target, draft):
    data = tiny_batch(target)
    rows = data["loss_mask"].flatten().nonzero()[:, 0]
    with torch.no_grad():
        teacher = target(input_ids=data["input_ids"]).logits.flatten(0, 1)[rows].log_softmax(-1)  # (M, V)
    batch = Batch(data["input_ids"], data["attention_mask"], data["loss_mask"], rows, teacher_log_probs=teacher)
    model = copy.deepcopy(draft).train()
    torch.manual_seed(0)
    depth, _ = cod_depths(data["loss_mask"], 6, 0.7, 0.2)  # the drop the forward will draw
    torch.manual_seed(0)
    predicted = KIND.training_forward(model, model, batch)
    m = len(rows)
    with torch.no_grad():
        plain = model.lm(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits.flatten(0, 1)
    torch.testing.assert_close(predicted.logits[:m], plain[rows], rtol=1e-5, atol=1e-5)
    assert predicted.teacher_rows[:m].tolist() == list(range(m)) and bool((predicted.weights[:m] == 1).all())
    # k = 6 and the default drop over 8 loss rows per answer: steps 1..5 keep round(8 * max(0.7^b, 0.2)) =
    # 6, 4, 3, 2, 2 chains, or fewer where fewer kept chains have loss rows left.
    kept = [int((depth >= step).sum()) for step in range(1, 6)]
    assert len(predicted.logits) == m + sum(kept) and kept[:3] == [12, 8, 6] and kept[3] <= 4
    assert bool((predicted.weights[m:] > 0).all()) and predicted.logits.requires_grad
    model.eval()
    assert KIND.training_forward(model, model, batch).teacher_rows is None  # held-out alpha: the next token only


def tied_llama(vocab: int = V) -> LlamaForCausalLM:
    """A random 2-layer Llama whose head is its input embedding (as SmolLM2's is)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


def test_frozen_embeddings_still_train_the_mask_row_and_the_saved_folder_is_a_plain_model(tmp_path):
    target = tied_llama()
    settings = DraftSettings(kind="parallel", layers="1", freeze_embeddings=True, options={"mask_token_id": MASK})
    draft = KIND.build(settings, target, tiny_tokenizer(V), torch.device("cpu"))
    matrix = draft.lm.get_input_embeddings().weight
    assert draft.lm.get_output_embeddings().weight is matrix and not matrix.requires_grad
    assert draft.mask_row.requires_grad and torch.equal(draft.mask_row, matrix[MASK])
    before = matrix.detach().clone()

    data = tiny_batch(target)
    rows = data["loss_mask"].flatten().nonzero()[:, 0]
    with torch.no_grad():
        teacher = target(input_ids=data["input_ids"]).logits.flatten(0, 1)[rows].log_softmax(-1)
    batch = Batch(data["input_ids"], data["attention_mask"], data["loss_mask"], rows, teacher_log_probs=teacher)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.0)
    torch.manual_seed(0)
    predicted = KIND.training_forward(draft, draft, batch)
    log_q = predicted.logits.log_softmax(-1)
    p = teacher[predicted.teacher_rows]
    loss = ((p.exp() * (p - log_q)).sum(-1) * predicted.weights).sum() / len(rows)  # forward KL
    loss.backward()
    optimizer.step()

    assert torch.equal(matrix, before)  # every row of the frozen matrix (and so of the tied head) as it was
    moved = (draft.mask_row - before[MASK]).abs().max()
    assert moved > 1e-3  # Adam's first step moves each coordinate by about lr
    # The drafter feeds the masks through the model's own embedding: it reads the trained row.
    with torch.no_grad():
        embedded = draft.lm.get_input_embeddings()(torch.tensor([[5, MASK]]))
    assert torch.equal(embedded[0, 1], draft.mask_row.detach()) and torch.equal(embedded[0, 0], before[5])

    for name, state in (("full-state", draft.state_dict()), ("live", None)):
        KIND.save(draft, state, tiny_tokenizer(V), tmp_path / name, "tiny")
        saved = load_draft(str(tmp_path / name), target, torch.device("cpu"), torch.float32)
        weight = saved.lm.get_input_embeddings().weight
        assert saved.mask_row is None and saved.lm.get_output_embeddings().weight is weight
        assert torch.equal(weight[MASK], draft.mask_row.detach())
        others = torch.arange(V) != MASK
        assert torch.equal(weight[others], before[others])
        assert "mask_row" not in load_file(tmp_path / name / "model.safetensors")
    # Trainable embeddings: the matrix holds the mask row and learns it with the rest.
    trainable_matrix = dataclasses.replace(settings, freeze_embeddings=False)
    unfrozen = KIND.build(trainable_matrix, target, tiny_tokenizer(V), torch.device("cpu"))
    assert unfrozen.mask_row is None and unfrozen.lm.get_input_embeddings().weight.requires_grad


# ---- saving, publishing, serving ----------------------------------------------------------------------


def test_published_folder_is_a_plain_model_naming_its_mask_and_reloads_as_a_parallel_draft(target, draft, tmp_path):
    KIND.export(draft, tiny_tokenizer(V), tmp_path, Serving(gamma=4))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["pard_token"] == config["mask_token_id"] == MASK and config["vocab_size"] == V
    assert kind_of_folder(tmp_path) is KIND
    assert KIND.engine_config(tmp_path) == {"method": "draft_model", "model": str(tmp_path), "parallel_drafting": True}
    loaded = load_draft(str(tmp_path), target, torch.device("cpu"), torch.float32)
    assert isinstance(loaded, ParallelDraft) and loaded.mask_token_id == MASK
    options = DecodeOptions(gamma=4)
    mine, mine_stats = speculative_generate(target, draft, PROMPTS, 20, options=options)
    theirs, their_stats = speculative_generate(target, loaded, PROMPTS, 20, options=options)
    assert mine == theirs and (mine_stats.proposed, mine_stats.accepted) == (their_stats.proposed, their_stats.accepted)
    assert KIND.architecture(tmp_path)[0] == "parallel-llama"


def test_a_folder_with_a_head_cut_decodes_with_it_exactly(target, draft, tmp_path):
    KIND.export(draft, tiny_tokenizer(V), tmp_path, Serving(gamma=4))
    kept = [4, 9, 12, 3, 6, 2, 10, 7]
    draft_vocab.save_ranking(tmp_path, kept)
    loaded = load_draft(str(tmp_path), target, torch.device("cpu"), torch.float32)
    assert loaded.head_ids == [*kept, 1]  # and the target's EOS
    _, drafter = loaded.decoding_pair(target, 1, 64, DecodeOptions(gamma=4))
    with torch.inference_mode():
        drafter.prefill(torch.tensor([PROMPTS[2]]), torch.ones(1, len(PROMPTS[2]), dtype=torch.bool))
        proposal = drafter.propose([PROMPTS[2] + [5]], torch.tensor([4]), DecodeOptions(gamma=4), None)
    assert set(proposal.tokens[0].tolist()) <= set(loaded.head_ids)
    out, stats = speculative_generate(target, loaded, PROMPTS, 20, options=DecodeOptions(gamma=4))
    assert out == greedy(target, PROMPTS, 20) and stats.accepted > 0


def test_settings_are_checked_by_name():
    with pytest.raises(DraftsmithError, match="need draft.options.mask_token_id"):
        KIND.check(DraftSettings(kind="parallel"))
    with pytest.raises(DraftsmithError, match="'mask_id' is not an option of parallel drafts.*mask_token_id"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_id": 3}))
    with pytest.raises(DraftsmithError, match="k must be >= 2"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3, "k": 1}))
    with pytest.raises(DraftsmithError, match="leave out draft.lora_r"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3}, lora_r=8))
    with pytest.raises(DraftsmithError, match="weight their chain steps for accepted length themselves"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3}, loss="accepted_length"))
    with pytest.raises(DraftsmithError, match="chain_weights must be one of equal, target, draft, got 'pard'"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3, "chain_weights": "pard"}))
    with pytest.raises(DraftsmithError, match=r"weight_floor must be in \[0, 1\], got 1.5"):
        KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3, "weight_floor": 1.5}))
    KIND.check(DraftSettings(kind="parallel", options={"mask_token_id": 3, "k": 8, "cod_ratio": 0.8}))
    pard2 = {"mask_token_id": 3, "chain_weights": "target", "weight_floor": 0.0}
    KIND.check(DraftSettings(kind="parallel", options=pard2))
    with pytest.raises(DraftsmithError, match="mask_token_id must be a vocabulary id"):
        ParallelDraft(tiny_llama(vocab=V), V)


# ---- training through the ordinary commands ------------------------------------------------------------


def heldout_answers(target, tokenizer, count: int = 16) -> dict:
    """The target's greedy answers (32 tokens) to built-in evaluation prompts, as a right-padded batch
    whose loss rows predict the answer tokens."""
    prompts = [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(ddata.EVAL_PROMPTS)[:count]]
    answers = target_generate(target, prompts, 32, eos_ids={tokenizer.eos_token_id})[0]
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    loss = torch.zeros(ids.shape, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        loss[row, len(prompt) - 1 : len(prompt) + len(answer) - 1] = True
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def test_distill_raises_the_acceptance_of_positions_2_to_k_and_the_draft_ranks_and_publishes(tmp_path):
    run = tmp_path / "run"
    kind = ["draft.kind=parallel", "draft.options={mask_token_id: 2, k: 4}"]  # <unk>: the character data has none
    steps = ["optim.max_steps=10", "save.steps=10", "log.steps=10", "draft.vocab=48"]  # a cut head too
    common = ["--config", "tiny", f"output_dir={run}", *kind, *steps]
    assert main(["distill", *common]) == 0
    checkpoint = run / "checkpoint-10"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["pard_token"] == config["mask_token_id"] == 2 and kind_of_folder(checkpoint) is KIND
    assert config["vocab_size"] == 103  # the whole head is saved; the folder carries the cut it trained with

    target, tokenizer = load_target(load_run_config(run), torch.device("cpu"))
    batch = heldout_answers(target, tokenizer)
    drafts = [
        load_draft(str(run / name), target, torch.device("cpu"), torch.float32) for name in ("initial", "checkpoint-10")
    ]
    assert all(len(d.head_ids) == 48 + 1 for d in drafts)  # the 48 tokens and the EOS: as it trained
    before, after = (position_acceptance(draft, target, batch, 4) for draft in drafts)
    # Measured: [0.52, 0.34, 0.34, 0.34] -> [0.59, 0.47, 0.47, 0.47] (positions 1..4; position j is chain step j-1).
    assert bool((after[1:] > before[1:] + 0.1).all()), (before, after)
    assert after[0] > before[0]

    assert main(["eval-run", str(run), "--gammas", "3", "--max-new-tokens", "12", "--limit", "2"]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    matches = [r["0.0"]["greedy_match"] for r in report["results"].values()]  # each a share of prompts
    assert matches == [1.0] * len(report["results"])  # every prompt identical, for every checkpoint
    out = tmp_path / "published"
    assert main(["publish", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["pard_token"] == 2 and kind_of_folder(out) is KIND
    text = check_card_usage(out, KIND, json.loads((run / "best.json").read_text())["best_gamma"])
    assert "'parallel_drafting': True" in text and "mask token 2" in text


# The first 3 losses of configs/tiny.yaml trained as a parallel draft with frozen embeddings and the
# default ``chain_weights`` (float32, the tiny config's seed), from losses.jsonl of the run below on a
# 2-core x86 CPU (torch 2.13 CPU build).
PINNED_CHAIN_LOSSES = [1.2921321392059326, 1.3026052713394165, 1.099622368812561]


def test_a_tiny_parallel_run_has_pinned_losses_and_learns_only_the_mask_row_of_its_frozen_embeddings(tmp_path):
    run = tmp_path / "run"
    kind = ["draft.kind=parallel", "draft.options={mask_token_id: 2, k: 4}", "draft.freeze_embeddings=true"]
    steps = ["optim.max_steps=3", "save.steps=3", "log.steps=3"]
    assert main(["distill", "--config", "tiny", f"output_dir={run}", *kind, *steps]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(PINNED_CHAIN_LOSSES, abs=1e-5)
    before, after = (load_file(run / name / "model.safetensors") for name in ("initial", "checkpoint-3"))
    assert "mask_row" not in after  # a plain model folder
    matrix, trained = before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]
    others = torch.arange(len(matrix)) != 2
    assert torch.equal(trained[others], matrix[others]) and not torch.equal(trained[2], matrix[2])


# ---- the default target, and a real vLLM server ------------------------------------------------------

QUESTIONS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]
SMOL_MASK = 16  # <empty_output>: a special token SmolLM2's answers never contain


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The default target in float32, its first two layers as an (untrained) parallel draft published
    into a folder, the questions as token ids and the target's greedy answers (24 tokens)."""

    target = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    draft = ParallelDraft(truncate_target(target, 2), SMOL_MASK).eval()
    folder = tmp_path_factory.mktemp("parallel-draft")
    KIND.export(draft, tokenizer, folder, Serving(gamma=3))
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = eos_token_ids(target, tokenizer)
    reference = [target_generate(target, [p], 24, eos_ids=eos)[0][0] for p in prompts]
    return target, draft, folder, prompts, eos, reference


@pytest.mark.slow
def test_greedy_identical_on_the_default_target_in_chains_batches_and_trees(smol):
    target, draft, _, prompts, eos, reference = smol
    for prompt, want in zip(prompts, reference, strict=True):
        out, stats = speculative_generate(target, draft, [prompt], 24, options=DecodeOptions(gamma=3), eos_ids=eos)
        assert out == [want] and stats.draft_forwards <= stats.rounds + 1
    batched, stats = speculative_generate(target, draft, prompts, 24, options=DecodeOptions(gamma=4), eos_ids=eos)
    assert batched == reference and stats.accepted > 0
    tree = DecodeOptions(tree=TreeShape.parse("3,2,1"))
    assert speculative_generate(target, draft, prompts[:1], 24, options=tree, eos_ids=eos)[0] == reference[:1]


@pytest.mark.vllm
def test_vllm_serves_the_published_draft_with_parallel_drafting(smol, engine, tmp_path):
    target, draft, folder, prompts, eos, reference = smol
    speculative = KIND.engine_config(folder)
    assert speculative["parallel_drafting"] is True
    options = ServeOptions(dtype="float32", eager=True, threads=1)
    with serve(
        DEFAULT_TARGET, options, speculative=speculative, gamma=3, engine=engine, log_path=tmp_path / "log"
    ) as server:
        before = read_spec_counters(server)
        answers, _ = complete_batch(server, prompts, 24, batch_size=1)
        grown = read_spec_counters(server) - before
    assert [a.token_ids for a in answers] == reference  # greedy output is the target's
    assert grown.drafts > 0 and grown.draft_tokens == 3 * grown.drafts and len(grown.accepted_per_position) == 3
    assert grown.accepted > 0  # the counters moved: the first position's guesses are often right
    # vLLM's rounds are the bundled decoder's: the same proposals from the same one forward per round.
    bundled = [speculative_generate(target, draft, [p], 24, DecodeOptions(gamma=3), eos_ids=eos)[1] for p in prompts]
    assert grown.drafts == sum(stats.rounds for stats in bundled)
    assert grown.accepted == sum(stats.accepted for stats in bundled)


def test_an_untrained_parallel_draft_is_named_on_the_command_line(target):
    draft = load_draft("parallel:1:30", target, torch.device("cpu"), torch.float32)
    assert isinstance(draft, ParallelDraft) and draft.mask_token_id == 30 and draft.config.num_hidden_layers == 1
    assert KIND.from_spec("truncate:1", target) is None
    with pytest.raises(DraftsmithError, match="parallel:LAYERS:MASK_ID"):
        KIND.from_spec("parallel:2", target)


def test_eval_run_charges_a_parallel_round_one_draft_forward(target, draft):
    # The predicted speedup of a round of gamma tokens costs one draft step of c, not gamma of them,
    # and so does the gamma measure_draft picks by it.
    prompts = [Prompt(str(i), "writing", [[{"role": "user", "content": f"w{3 + i} w{9 + i}"}]]) for i in range(2)]
    settings = MeasureSettings(prompts, max_new_tokens=16, repeats=1, progress=False)
    report = measure_draft(target, draft, tiny_tokenizer(V), settings, [1, 3])
    gamma, c, v = report.best_gamma, report.cost_ratio_c, report.verify_ratio_v
    one = predicted_speedup(report.acceptance_rate, gamma, c, v, forwards=1)
    assert report.predicted_speedup == pytest.approx(one)
    if gamma > 1:
        assert one > predicted_speedup(report.acceptance_rate, gamma, c, v)
    at_base = report.at_base_gamma  # gamma 3: one draft forward per round of 3 proposals
    assert at_base.predicted_speedup == pytest.approx(
        predicted_speedup(at_base.acceptance_rate, 3, at_base.cost_ratio_c, at_base.verify_ratio_v, 1)
    )
    # The result as speedup_report.json keeps it (the lookup-guess counts since guesses took rounds).
    figures = {"acceptance_rate", "mean_accepted_tokens", "cost_ratio_c", "verify_ratio_v", "predicted_speedup"}
    figures |= {"speedup", "target_tokens_per_s", "spec_tokens_per_s", "greedy_match", "speedup_spread"}
    figures |= {"paused_share", "acceptance_by_position", "guesses", "guesses_accepted", "lookup_rounds"}
    figures |= {"by_category"}  # acceptance and speedup per prompt category
    written = json.loads(json.dumps(report.to_json()))
    assert set(written) == figures | {"temperature", "best_gamma", "measured_cost_ratio", "alpha_per_position"} | {
        "base_gamma",
        "at_base_gamma",
        "predicted_by_gamma",
    }
    assert set(written["at_base_gamma"]) == figures and set(written["predicted_by_gamma"]) == {"1", "3"}
