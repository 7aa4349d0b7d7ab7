"""EAGLE-3 heads (``distill.drafts.eagle3``): exact decoding, training-time test, the speculators layout.

Exactness: greedy output is the target's own (chains at several gammas, ragged batches, token trees,
a cut vocabulary); sampled output fits the target's own conditionals, computed in float64 by the
tests' helpers, and the negative controls (always accept, correction from p, the raw q reported, q
reported over draft ids instead of mapped through d2t) fail the same fit. The heads decoded here are
trained for a few seconds on the tiny target's own distributions (``fitted_head``), so they agree
with it sometimes and not always.

Training: the training forward of step j at position t computes exactly what drafting token j+1
after position t computes, and reads no target feature past t - 1 (a step fed the target's features
would); ``draftsmith distill`` trains the kind on the tiny target (held-out alpha rises), eval-run
ranks it, publish writes the layout vLLM reads, checked field by field here and by vLLM's own parser
and a real server in the ``vllm`` tests.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.distill import vocab_cut
from draftsmith.distill.data import EVAL_PROMPTS
from draftsmith.distill.drafts import eagle3, kind_of_folder
from draftsmith.distill.drafts.eagle3 import KIND, EagleHead, default_aux_layers, ttt_mask, unroll
from draftsmith.distill.drafts.kind import Batch, DraftSettings, Serving
from draftsmith.distill.losses import row_losses
from draftsmith.specdec import draft_vocab, proposal, verify
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import TreeShape
from draftsmith.specdec.vllm_client import complete_batch, read_spec_counters
from draftsmith.specdec.vllm_server import ServeOptions, group_alive, serve
from tests.helpers import (
    SAMPLING_PROMPTS,
    always_accept,
    assert_fits,
    check_card_usage,
    correct_from_p,
    fit_forward_kl,
    fit_scores,
    named_tiny_llama,
    sample_spec,
    sampled_fit,
    target_conditionals,
    tiny_llama,
    tiny_tokenizer,
)

# Tiny models run many small kernels: on a machine other jobs load, two OpenMP threads spin-wait on each
# other and run some 30x slower than one (the commands the training test runs set their own threads).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = [1, 2, 3]  # a 4-layer tiny target: its last three layers (default_aux_layers)
PROMPTS = [[0, 5, 9, 4], [0, 7], [0, 3, 3, 8, 2, 6, 11, 2]]


def teacher_batch(target, ids: torch.Tensor, vocab: torch.Tensor | None) -> tuple[Batch, torch.Tensor]:
    """A training batch of every position after the first of ``ids`` (B, T), with the target's hidden
    states and its argmax at the loss rows, and the target's log-probs there (M, N or V), normalized over all V."""
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, 0] = False
    rows = vocab_cut.loss_rows(loss_mask)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    log_probs = out.logits.flatten(0, 1)[rows].log_softmax(-1)
    hidden = {i: out.hidden_states[i] for i in AUX}
    batch = Batch(ids, torch.ones_like(ids), loss_mask, rows, vocab, hidden, teacher_argmax=log_probs.argmax(-1))
    return batch, log_probs if vocab is None else log_probs[:, vocab]


def fitted_head(target, vocab: list[int] | None = None, steps: int = 80, seed: int = 0) -> EagleHead:
    """A head trained briefly with training-time test (forward KL, Adam) on the target's distributions
    over random text, through the kind's own build and training forward."""
    cut = torch.tensor(vocab) if vocab is not None else None
    settings = DraftSettings(kind="eagle3", options={"aux_layers": AUX}, train_draft_vocab=len(vocab or []))
    torch.manual_seed(seed)
    head = KIND.build(settings, target, None, target.device)
    generator = torch.Generator().manual_seed(seed)

    def next_batch():
        return teacher_batch(target, torch.randint(2, target.config.vocab_size, (16, 20), generator=generator), cut)

    return fit_forward_kl(KIND, head, next_batch, steps)


@pytest.fixture(scope="module")
def target():
    return named_tiny_llama(vocab=32, layers=4, sharpness=8.0)


@pytest.fixture(scope="module")
def head(target):
    return fitted_head(target)


# ---- the pieces ---------------------------------------------------------------------------------


def test_aux_layers_are_vllms_default_or_the_last_three_of_a_small_target():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M: vLLM's (2, n//2, n-3)
    assert default_aux_layers(7) == (2, 3, 4)
    assert default_aux_layers(6) == (3, 4, 5)  # (2, 3, 3) would repeat a layer
    assert default_aux_layers(4) == (1, 2, 3)
    with pytest.raises(DraftsmithError, match="reads three target layers"):
        default_aux_layers(2)
    with pytest.raises(DraftsmithError, match="three increasing target layer ids in 0..3"):
        EagleHead.from_target(tiny_llama(layers=4), [3, 2, 1])
    with pytest.raises(DraftsmithError, match="three increasing target layer ids in 0..3"):
        EagleHead.from_target(tiny_llama(layers=4), [1, 2, 4])  # hidden_states[4] is the normed output


def test_unroll_scores_step_j_against_the_teacher_j_rows_on_in_the_same_sequence():
    # Two sequences of T = 6; loss rows at t = 2..5 of the first and t = 1..3 of the second.
    rows = torch.tensor([2, 3, 4, 5, 7, 8, 9])
    plan = unroll(rows, 6, 3)
    assert [a.tolist() for a in plan.anchors] == [[2, 3, 4, 5, 7, 8, 9], [2, 3, 4, 7, 8], [2, 3, 7]]
    # Row 5 + 1 = 6 is the second sequence's t = 0: not the same sequence, not scored.
    assert [t.tolist() for t in plan.teacher] == [[0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 5, 6], [2, 3, 6]]


def test_ttt_mask_lets_step_j_see_the_causal_prefix_and_its_own_diagonal():
    key_ok = torch.tensor([[False, True, True, False]])  # index 0 pairs no feature; index 3 is padding
    mask = ttt_mask(key_ok, 2, torch.float32)[0, 0] == 0  # (T, 3T) visible
    assert mask.shape == (4, 12)
    # Step 0's block: causal over the existing keys, plus each query's own key.
    assert mask[:, :4].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    # Steps 1 and 2: the diagonal only.
    assert torch.equal(mask[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[:, 8:], torch.eye(4, dtype=torch.bool))
    # A later step from index 2 on: queries 2 and 3, step 0's keys all there, the steps' own from 2 on.
    later = ttt_mask(key_ok, 2, torch.float32, start=2)[0, 0] == 0
    assert later.shape == (2, 4 + 2 * 2)
    assert torch.equal(later[:, :4], mask[2:, :4])
    assert torch.equal(later[:, 4:6], torch.eye(2, dtype=torch.bool))
    assert torch.equal(later[:, 6:], torch.eye(2, dtype=torch.bool))
    assert torch.equal(ttt_mask(key_ok, 0, torch.float32, start=2), ttt_mask(key_ok, 0, torch.float32))


def test_later_steps_skip_the_prompt_rows_and_predict_what_they_predicted_over_every_row(target):
    """Steps >= 1 run from the first answer row of the batch on: with prompts of 5 and 8 tokens and
    right padding, every step's predictions equal those of a batch whose loss rows start at index 1
    (steps >= 1 then run over every row), taken at the same anchors."""
    head = fitted_head(target, steps=5)
    head.train()
    head.ttt_steps = 3
    ids = torch.randint(2, 32, (2, 16), generator=torch.Generator().manual_seed(4))
    attention = torch.ones_like(ids)
    attention[0, 13:] = 0
    answers = torch.zeros_like(ids, dtype=torch.bool)
    answers[0, 5:12] = True
    answers[1, 8:15] = True
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    hidden = {i: out.hidden_states[i] for i in AUX}
    everywhere = attention.bool().clone()
    everywhere[:, 0] = False
    everywhere[:, -1] = False

    short_rows = vocab_cut.loss_rows(answers)
    with torch.no_grad():
        short = KIND.training_forward(head, head, Batch(ids, attention, answers, short_rows, None, hidden))
        full_rows = vocab_cut.loss_rows(everywhere)
        full = KIND.training_forward(head, head, Batch(ids, attention, everywhere, full_rows, None, hidden))
    short_plan, full_plan = unroll(short_rows, 16, 3), unroll(full_rows, 16, 3)
    offset_short = offset_full = 0
    for step in range(3):
        short_anchors, full_anchors = short_plan.anchors[step], full_plan.anchors[step]
        assert len(short_anchors) > 0
        where = torch.searchsorted(full_anchors, short_anchors)
        assert torch.equal(full_anchors[where], short_anchors)
        got = short.logits[offset_short : offset_short + len(short_anchors)]
        want = full.logits[offset_full + where]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        offset_short += len(short_anchors)
        offset_full += len(full_anchors)


# ---- exact decoding -----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_chains_are_the_targets_own_output_alone_and_in_a_ragged_batch(target, head, gamma):
    for length in (1, 3, 30):
        want, _ = target_generate(target, PROMPTS, length)
        got, stats = speculative_generate(target, head, PROMPTS, length, options=DecodeOptions(gamma=gamma))
        assert got == want, length
        for prompt, expected in zip(PROMPTS, want, strict=True):
            alone, _ = speculative_generate(target, head, [prompt], length, options=DecodeOptions(gamma=gamma))
            assert alone == [expected]
    assert 0 < stats.accepted < stats.proposed  # a head that is right sometimes, not always


@pytest.mark.parametrize("shape", ["3,2,1", "1,1,1,1", "2,2,2:5"])
def test_greedy_trees_are_the_targets_own_output(target, head, shape):
    options = DecodeOptions(tree=TreeShape.parse(shape))
    accepted = proposed = 0
    for prompt in PROMPTS:
        want, _ = target_generate(target, [prompt], 30)
        got, stats = speculative_generate(target, head, [prompt], 30, options=options)
        assert got == want
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    assert 0 < accepted < proposed


def test_a_cut_vocabulary_drafts_its_tokens_only_and_stays_exact(target):
    vocab = [3, 1, 8, 5, 9, 11, 2, 20, 4, 6, 7, 30]  # unsorted, as the trainer's frequency ranking gives them
    cut = fitted_head(target, vocab=vocab, steps=40)
    features = torch.randn(2, 5, target.config.hidden_size)
    with torch.no_grad():
        probs = cut.target_logits(features).softmax(-1)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert float(probs[..., outside].abs().max()) == 0.0  # q is zero outside the draft vocabulary
    assert torch.allclose(probs.sum(-1), torch.ones(2, 5))
    want, _ = target_generate(target, PROMPTS, 30)
    got, stats = speculative_generate(target, cut, PROMPTS, 30, options=DecodeOptions(gamma=3))
    assert got == want
    assert 0 < stats.accepted < stats.proposed


def test_the_head_refuses_compiled_decoding_by_name(target, head):
    with pytest.raises(DraftsmithError, match="EAGLE-3 head decodes eager; pass --no-compile"):
        speculative_generate(target, head, PROMPTS[:1], 4, options=DecodeOptions(compile=True))


# ---- sampling: the target's distribution, and broken rules that fail the same fit ----------------

V_SMALL = 12
SMALL_VOCAB = [4, 0, 9, 1, 5, 11, 2, 7, 3]  # 9 of 12 ids: q is zero on 6, 8 and 10


@pytest.fixture(scope="module")
def small():
    target = tiny_llama(vocab=V_SMALL, layers=4, sharpness=3.0, seed=0)
    return target, fitted_head(target, vocab=SMALL_VOCAB, steps=25)


@pytest.mark.parametrize(
    ("params", "gamma"),
    [
        (SamplingParams(1.0), 1),
        (SamplingParams(1.0), 3),
        (SamplingParams(1.0), 7),
        (SamplingParams(0.7, top_k=5), 3),
        (SamplingParams(1.3, top_p=0.8), 3),
    ],
    ids=["t1-g1", "t1-g3", "t1-g7", "t0.7-k5-g3", "t1.3-p0.8-g3"],
)
def test_sampled_output_is_distributed_as_the_targets(small, params, gamma):
    target, head = small
    a, b, stats = sample_spec(target, head, params, gamma, seed=gamma)
    assert_fits(target, params, a, b)
    assert 0 < stats.accepted < stats.proposed


def test_sampled_trees_are_distributed_as_the_targets(small):
    target, head = small
    params, prompt, length = SamplingParams(1.0), SAMPLING_PROMPTS[0], 5  # two rounds of a depth-2 tree
    generator = torch.Generator().manual_seed(3)
    options = DecodeOptions(tree=TreeShape.parse("3,2"), sampling=params)
    rows, accepted = [], 0
    for _ in range(1500):
        out, stats = speculative_generate(target, head, [prompt], length, options, generator=generator)
        rows.append(out[0])
        accepted += stats.accepted
    assert accepted > 0
    samples = torch.tensor(rows)
    scores = fit_scores(samples, target_conditionals(target, prompt, samples, params))
    assert max(scores.values()) < 4, scores


def reported(make_q):
    """A draft step that draws its token as the real one does but reports ``make_q(logits, q)``."""
    real_step = proposal.draft_step

    def step(logits, options, generator):
        token, q, confident, confidence = real_step(logits, options, generator)
        return token, make_q(logits, q), confident, confidence

    return step


def raw_q(logits, q):
    return logits.float().softmax(-1)  # before temperature and top-k


def unmapped_q(logits, q):
    """q over draft ids 0..N-1, as if d2t were not applied: the mass of target id SMALL_VOCAB[i] at i."""
    return torch.nn.functional.pad(q[:, SMALL_VOCAB], (0, V_SMALL - len(SMALL_VOCAB)))


@pytest.mark.parametrize("control", ["always accept", "correct from p", "raw q", "q not mapped by d2t"])
def test_broken_rules_fail_the_same_fit(small, monkeypatch, control):
    target, head = small
    params = SamplingParams(0.7, top_k=5)
    if control == "raw q":
        monkeypatch.setattr(proposal, "draft_step", reported(raw_q))
    elif control == "q not mapped by d2t":
        monkeypatch.setattr(proposal, "draft_step", reported(unmapped_q))
    else:
        monkeypatch.setattr(verify, "accept_sampled", always_accept if control == "always accept" else correct_from_p)
    a, b, _ = sample_spec(target, head, params, 3)
    assert max(sampled_fit(target, params, (a, b)).values()) > 10


# ---- training-time test -------------------------------------------------------------------------


def test_step_j_at_position_t_computes_what_drafting_token_j_plus_1_after_t_computes(target):
    head = fitted_head(target, steps=5)
    head.train()
    head.ttt_steps = 4
    ids = torch.randint(2, 32, (2, 14), generator=torch.Generator().manual_seed(1))
    batch, _ = teacher_batch(target, ids, None)
    with torch.no_grad():
        predicted = KIND.training_forward(head, head, batch)
    plan = unroll(batch.rows, 14, 4)
    head.eval()
    sequence, t = 1, 6  # drafting after x_t: the head's rows 0..t-1 from the target's features, then its own
    features = {i: h[sequence : sequence + 1] for i, h in batch.teacher_hidden.items()}
    drafted = drafting_logits(head, ids[sequence], features, t, steps=4)
    flat, offset = sequence * 14 + t, 0
    for step, anchors in enumerate(plan.anchors):
        row = offset + int((anchors == flat).nonzero())
        assert torch.allclose(predicted.logits[row], drafted[step], atol=1e-5), step
        offset += len(anchors)


@torch.no_grad()
def drafting_logits(head: EagleHead, ids: torch.Tensor, features: dict, t: int, steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits of steps 0..steps-1 after position t, computed as decoding does it: the
    head's rows p = 0..t-1 pair the target's g_p with x_{p+1}; step j > 0 reads x_{t+j} (fed as if the
    drafts were right) with the previous step's output, one row further on, on the head's cache."""
    stream = eagle3.EagleDrafter(head, 1, 64)
    fused = head.fuse(features)  # (1, T, H)
    tokens = ids[None, 1 : t + 1]
    logits, hidden = stream._forward(tokens, torch.ones_like(tokens, dtype=torch.bool), fused[:, :t], 1)
    out = [head.draft_logits(hidden[0, -1])]
    for step in range(1, steps):
        token = ids[None, t + step : t + step + 1]
        _, hidden = stream._forward(token, torch.ones_like(token, dtype=torch.bool), hidden[:, -1:])
        out.append(head.draft_logits(hidden[0, -1]))
    return out


def test_steps_after_the_first_read_the_heads_own_features_not_the_targets(target):
    """Every prediction anchored at position t must be blind to the target's features at positions
    >= t: step j's input is the head's own output there. A step j fed the target's feature g_{t+j-1}
    (teacher forcing on features) would change when those are perturbed."""
    head = fitted_head(target, steps=5)
    head.train()
    head.ttt_steps = 4
    ids = torch.randint(2, 32, (1, 16), generator=torch.Generator().manual_seed(2))
    batch, _ = teacher_batch(target, ids, None)
    t = 7
    perturbed = Batch(**{**batch.__dict__, "teacher_hidden": dict(batch.teacher_hidden)})
    for layer in AUX:
        changed = batch.teacher_hidden[layer].clone()
        changed[:, t:] += torch.randn_like(changed[:, t:])
        perturbed.teacher_hidden[layer] = changed
    with torch.no_grad():
        before = KIND.training_forward(head, head, batch)
        after = KIND.training_forward(head, head, perturbed)
    plan = unroll(batch.rows, 16, 4)
    anchors = torch.cat(plan.anchors)
    blind = anchors <= t  # predictions from rows built before position t
    assert int(blind.sum()) == 4 * t
    assert torch.equal(before.logits[blind], after.logits[blind])
    assert not torch.allclose(before.logits[anchors == t + 1], after.logits[anchors == t + 1])  # step 0 reads g_t


def test_weights_decay_by_step_and_rows_whose_target_argmax_is_outside_the_vocabulary_weigh_zero(target):
    vocab = list(range(2, 14))
    head = fitted_head(target, vocab=vocab, steps=1)
    head.train()
    head.out_of_vocab = {"loss_rows": 0, "masked": 0}
    ids = torch.randint(2, 32, (3, 12), generator=torch.Generator().manual_seed(3))
    batch, _ = teacher_batch(target, ids, torch.tensor(vocab))
    predicted = KIND.training_forward(head, head, batch)
    with torch.no_grad():
        argmax = target(input_ids=ids).logits.flatten(0, 1)[batch.rows].argmax(-1)
    inside = (argmax >= 2) & (argmax < 14)
    steps = torch.cat([torch.full((len(a),), j) for j, a in enumerate(unroll(batch.rows, 12, 3).anchors)])
    assert torch.allclose(predicted.weights, 0.8**steps * inside[predicted.teacher_rows])
    assert 0 < int((~inside).sum()) < len(inside)
    assert head.out_of_vocab == {"loss_rows": len(inside), "masked": int((~inside).sum())}


# ---- the kind through the commands --------------------------------------------------------------


def test_settings_the_kind_cannot_use_are_refused_by_name():
    with pytest.raises(DraftsmithError, match="accepted_length's windows assume one prediction per position"):
        KIND.check(DraftSettings(kind="eagle3", loss="accepted_length"))
    with pytest.raises(DraftsmithError, match="leave out draft.lora_r"):
        KIND.check(DraftSettings(kind="eagle3", lora_r=8))
    with pytest.raises(DraftsmithError, match="'ttt_step' is not an option of eagle3 drafts.*'ttt_steps'"):
        KIND.check(DraftSettings(kind="eagle3", options={"ttt_step": 3}))
    with pytest.raises(DraftsmithError, match="step_decay must be in"):
        KIND.check(DraftSettings(kind="eagle3", options={"step_decay": 1.5}))


def test_the_kind_trains_checkpoints_ranks_and_publishes(tmp_path):
    run = tmp_path / "run"
    common = ["--config", "tiny", f"output_dir={run}", "draft.kind=eagle3", "draft.vocab=30"]
    assert main(["distill", *common, "optim.max_steps=10", "save.steps=5", "log.steps=5", "optim.lr=0.003"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 5, 10]
    assert metrics[-1]["acceptance_rate"] > metrics[0]["acceptance_rate"] + 0.05  # 0.29 -> 0.41 when written
    ckpt = run / "checkpoint-10"
    assert {"config.json", "model.safetensors", "eagle3_training.json", "draft_vocab.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert kind_of_folder(ckpt) is KIND
    counts = json.loads((ckpt / "eagle3_training.json").read_text())
    assert counts["draft_vocab_size"] == 31  # 30 tokens and the EOS id
    assert 0 < counts["masked"] < counts["loss_rows"]
    assert main(["eval-run", str(run), "--gammas", "1,2", "--max-new-tokens", "12", "--limit", "2"]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    matches = [r["0.0"]["greedy_match"] for r in report["results"].values()]  # each a share of prompts
    assert matches == [1.0] * len(report["results"])  # every prompt identical, for every checkpoint
    out = tmp_path / "published"
    assert main(["publish", str(run), "--out", str(out)]) == 0
    config = check_layout(out, hidden=64, vocab=len(json.loads((ckpt / "draft_vocab.json").read_text())["token_ids"]))
    best = json.loads((run / "best.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == best["best_gamma"]
    assert KIND.engine_config(out) == {"method": "eagle3", "model": str(out)}
    text = check_card_usage(out, KIND, best["best_gamma"])  # vLLM only: transformers cannot run the head
    assert "EAGLE-3 head" in text and "draft_init" not in text


# ---- the speculators layout ---------------------------------------------------------------------


def check_layout(folder, hidden: int, vocab: int | None) -> dict:
    """The folder holds the speculators EAGLE-3 layout vLLM 0.32 loads, field by field (``vocab``: the
    draft vocabulary's size without EOS when cut, None for the full vocabulary); returns config.json."""
    config = json.loads((folder / "config.json").read_text())
    assert "model_type" not in config  # vLLM recognises the format by its absence and speculators_config
    assert config["speculators_model_type"] == "eagle3"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and not layer["tie_word_embeddings"]
    assert config["norm_before_residual"] is False and config["norm_output"] is False
    assert config["target_hidden_size"] == hidden
    ids = config["eagle_aux_hidden_state_layer_ids"]
    assert len(ids) == 3 and ids == sorted(set(ids))
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3"
    assert speculators["default_proposal_method"] == speculators["proposal_methods"][0]["proposal_type"]
    assert speculators["verifier"]["name_or_path"]
    tensors = load_file(folder / "model.safetensors")
    size = config["draft_vocab_size"]
    heads, kv_heads, head_dim = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    shapes = {
        "fc.weight": (hidden, 3 * hidden),
        "layers.0.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": (layer["intermediate_size"], hidden),
        "layers.0.mlp.up_proj.weight": (layer["intermediate_size"], hidden),
        "layers.0.mlp.down_proj.weight": (hidden, layer["intermediate_size"]),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.hidden_norm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (size, hidden),
    }
    if vocab is not None:
        shapes |= {"d2t": (size,), "t2d": (layer["vocab_size"],)}
        assert size >= vocab
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        target_ids = torch.arange(size) + tensors["d2t"]
        assert torch.equal(target_ids, target_ids.sort().values)  # ascending, as speculators writes them
        assert torch.equal(tensors["t2d"].nonzero()[:, 0], target_ids)
    else:
        assert size == layer["vocab_size"]
    if "embed_tokens.weight" in tensors:
        shapes["embed_tokens.weight"] = (layer["vocab_size"], hidden)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == shapes
    return config


def test_the_export_holds_the_layout_and_drafts_as_the_head_did(target, head, tmp_path):
    vocab = [5, 3, 9, 1, 12, 7, 30, 2, 4]
    cut = fitted_head(target, vocab=vocab, steps=20)
    for name, model, size in (("full", head, None), ("cut", cut, len(vocab))):
        folder = tmp_path / name
        KIND.export(model, tiny_tokenizer_for(target), folder, Serving(gamma=3))
        config = check_layout(folder, hidden=target.config.hidden_size, vocab=size)
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert kind_of_folder(folder) is KIND
        loaded = KIND.load(folder, target, target.device, torch.float32)
        assert sorted(loaded.vocab.tolist()) == sorted(model.vocab.tolist())
        for options in (DecodeOptions(gamma=3), DecodeOptions(tree=TreeShape.parse("2,2"))):
            want = speculative_generate(target, model, PROMPTS[:1], 20, options=options)[1]
            got = speculative_generate(target, loaded, PROMPTS[:1], 20, options=options)[1]
            assert (got.proposed, got.accepted) == (want.proposed, want.accepted)


def test_a_folder_vllm_would_misread_is_refused_by_name(target, head, tmp_path):
    KIND.export(head, tiny_tokenizer_for(target), tmp_path, Serving(gamma=2))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(DraftsmithError, match="a top-level model_type"):
        KIND.load(tmp_path, target, target.device, torch.float32)
    del config["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftsmithError, match="norm_before_residual is not written as false"):
        KIND.check_export(tmp_path)


def tiny_tokenizer_for(target):
    return tiny_tokenizer(target.config.vocab_size)


@pytest.mark.vllm
def test_vllms_own_parser_reads_the_export(engine, target, head, tmp_path):
    """vLLM 0.32's speculators config checks and conversion, run in its environment: the engine's
    speculative config and the draft's architecture are what we meant."""
    KIND.export(head, tiny_tokenizer_for(target), tmp_path, Serving(gamma=4))
    script = (
        "import json, sys\n"
        "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig\n"
        "config = json.load(open(sys.argv[1]))\n"
        "speculative = SpeculatorsConfig.extract_vllm_speculative_config(config)\n"
        "layer = SpeculatorsConfig.extract_transformers_pre_trained_config(dict(config))\n"
        "print(json.dumps({'speculative': speculative, 'architectures': layer['architectures'],\n"
        "    'aux': layer['eagle_aux_hidden_state_layer_ids'], 'norm_before_residual': layer['norm_before_residual'],\n"
        "    'draft_vocab_size': layer['draft_vocab_size']}))\n"
    )
    done = subprocess.run(
        [engine.command[0], "-c", script, str(tmp_path / "config.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {
        "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
        "architectures": ["Eagle3LlamaForCausalLM"],
        "aux": AUX,
        "norm_before_residual": False,
        "draft_vocab_size": target.config.vocab_size,
    }


# ---- the default target: exact in our decoder, served by vLLM -----------------------------------

QUESTIONS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]
MAX_TOKENS = 24
GAMMA = 3


def memorized_head(model, prompts: list[list[int]], answers: list[list[int]], steps: int = 150) -> EagleHead:
    """A head for ``model`` trained on its own greedy ``answers`` to ``prompts`` until it drafts them
    (training-time test, forward KL; its vocabulary the answers' tokens). Its token embedding is all
    zeros, so it drafts from the target's features alone: accepted often only when they reach it from
    the right layers at the right positions."""
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss_mask[row, len(prompt) - 1 : len(sequence) - 1] = True  # rows whose next token is an answer's
    vocab = torch.tensor(sorted({token for answer in answers for token in answer}))
    torch.manual_seed(0)
    head = KIND.build(DraftSettings(kind="eagle3", train_draft_vocab=len(vocab)), model, None, model.device)
    with torch.no_grad():
        head.embed_tokens.weight.zero_()
    head.own_embeddings = True  # saved with the head, so vLLM keeps it instead of sharing the target's
    rows = vocab_cut.loss_rows(loss_mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    teacher = out.logits.flatten(0, 1)[rows][:, vocab].float()  # forward KL renormalizes over the vocabulary
    hidden = {i: out.hidden_states[i] for i in KIND.teacher_layers(head)}
    argmax = out.logits.flatten(0, 1)[rows].argmax(-1)
    batch = Batch(ids, attention, loss_mask, rows, vocab, hidden, teacher_argmax=argmax)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        predicted = KIND.training_forward(head, head, batch)
        losses = row_losses("forward_kl", predicted.logits, teacher[predicted.teacher_rows])
        loss = (losses * predicted.weights).sum() / len(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def default():
    """The default target in float32, the prompts as token ids, its greedy answers (the reference) and
    a head that learned them."""
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = eos_token_ids(model, tokenizer)
    reference = [target_generate(model, [p], MAX_TOKENS, eos_ids=eos)[0][0] for p in prompts]
    return model, tokenizer, prompts, eos, reference, memorized_head(model, prompts, reference)


@pytest.mark.slow
def test_on_the_default_target_chains_and_trees_are_the_targets_own_output(default):
    model, _, prompts, eos, reference, head = default
    assert head.aux_layers == (2, 15, 27)
    got, stats = speculative_generate(model, head, prompts, MAX_TOKENS, DecodeOptions(gamma=GAMMA), eos_ids=eos)
    assert got == reference
    assert stats.acceptance_rate > 0.5  # it drafts the answers it learned
    tree = DecodeOptions(tree=TreeShape.parse("2,2,1"))
    for prompt, expected in zip(prompts, reference, strict=True):
        assert speculative_generate(model, head, [prompt], MAX_TOKENS, tree, eos_ids=eos)[0] == [expected]


@pytest.mark.slow
def test_eval_measures_a_published_head_with_the_gamma_it_carries(default, tmp_path):
    model, tokenizer, *_, head = default
    KIND.export(head, tokenizer, tmp_path / "head", Serving(gamma=2))
    draft_vocab.save_ranking(tmp_path / "head", head.vocab.tolist())  # publish writes the run's cut beside it
    report = tmp_path / "eval.json"
    args = ["--draft", str(tmp_path / "head"), "--prompts", str(EVAL_PROMPTS), "--limit", "1", "--repeats", "1"]
    assert main(["eval", *args, "--max-new-tokens", "16", "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert figures["greedy_match"] == 1.0
    assert (figures["gamma_source"], figures["draft_vocab"]) == ("generation_config.json", 0)  # its own vocabulary
    assert figures["aux_layers"] == [2, 15, 27] and figures["draft_vocab_size"] == len(head.vocab)


@pytest.fixture(scope="module")
def eagle_server(engine, default, tmp_path_factory):
    model, tokenizer, *_, head = default
    folder = tmp_path_factory.mktemp("eagle3-head")
    KIND.export(head, tokenizer, folder, Serving(gamma=GAMMA))
    log = tmp_path_factory.mktemp("vllm-logs") / "eagle3.log"
    options = ServeOptions(dtype="float32", eager=True, threads=1)  # no torch.compile warm-up
    speculative = KIND.engine_config(folder)
    with serve(DEFAULT_TARGET, options, speculative=speculative, gamma=GAMMA, engine=engine, log_path=log) as server:
        yield server
    assert not group_alive(server.process.pid)


@pytest.mark.vllm
def test_vllm_serves_the_published_head_exactly_and_accepts_its_drafts(eagle_server, default):
    model, _, prompts, eos, reference, head = default
    before = read_spec_counters(eagle_server)
    answers, _ = complete_batch(eagle_server, prompts, MAX_TOKENS, batch_size=1)
    grown = read_spec_counters(eagle_server) - before
    assert [a.token_ids for a in answers] == reference
    assert grown.drafts > 0 and grown.draft_tokens == GAMMA * grown.drafts
    assert grown.accepted > 0
    # The head drafts the answers it learned from the target's features alone (its token embedding is
    # zero), in vLLM as in the bundled decoder, only if they come from the right layers at the right
    # positions and its ids through d2t.
    options = DecodeOptions(gamma=GAMMA)
    bundled = [speculative_generate(model, head, [p], MAX_TOKENS, options, eos_ids=eos)[1] for p in prompts]
    ours = sum(stats.accepted for stats in bundled)
    assert grown.accepted >= 0.7 * grown.draft_tokens and ours >= 0.7 * sum(stats.proposed for stats in bundled)
    # The same rounds; vLLM always drafts gamma tokens, the bundled decoder fewer in a round that may
    # emit fewer, so vLLM accepts up to gamma more per answer.
    assert grown.drafts == sum(stats.rounds for stats in bundled)
    assert ours <= grown.accepted <= ours + GAMMA * len(prompts)
