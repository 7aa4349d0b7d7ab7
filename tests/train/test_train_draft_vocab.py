"""Training with the draft's head cut to the frequency-ranked tokens (draft.vocab) on configs/tiny.yaml."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.distill.data import collate
from draftsmith.distill.losses import acceptance_probability
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.draft_vocab import kept_ids, load_ranking, rank_tokens
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train import loop
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.eval_run import RunEvalSettings, evaluate_run
from draftsmith.train.examples import EpochSampler
from draftsmith.train.publish import publish

CUT = 40  # of the tiny target's 103 tokens (its training answers use 56)
PAD = EOS = 1  # the tiny tokenizer's pad and EOS id


def tiny_cfg(folder: Path, **overrides) -> DistillConfig:
    items = [f"output_dir={folder}"] + [f"{k}={v}" for k, v in overrides.items()]
    return load_config(DistillConfig, config_path("tiny"), items)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def cut_distributions(draft, target, batch: dict, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) logits over the full vocabulary: the target's, and the draft's with every token outside ``keep`` -inf."""
    with torch.no_grad():
        p = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        q = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    masked = torch.full_like(q, float("-inf"))
    masked[..., keep] = q[..., keep]
    return p, masked


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A 6-step TVD run with the head cut to 24 tokens, and the examples it trained and was measured on."""
    seen, build_examples = {}, loop.build_examples

    def capture(*args):
        seen["train"], seen["heldout"] = build_examples(*args)
        return seen["train"], seen["heldout"]

    patch = pytest.MonkeyPatch()
    patch.setattr(loop, "build_examples", capture)
    try:
        cfg = tiny_cfg(tmp_path_factory.mktemp("cut") / "run", train_draft_vocab=CUT, max_steps=6, log_steps=3)
        run_dir = loop.train(cfg).run_dir
    finally:
        patch.undo()
    return run_dir, seen["train"], seen["heldout"]


def test_cut_run_trains_with_the_ranking_it_saved_before_the_first_step(cut_run):
    run_dir, train_examples, _ = cut_run
    ranking = load_ranking(run_dir)
    assert ranking == rank_tokens(train_examples)  # counted on this run's training answers
    assert len(ranking) > CUT
    for folder in ("initial", "checkpoint-6"):  # every draft carries the cut it was trained with
        assert load_ranking(run_dir / folder) == ranking[:CUT]
    alpha = {m["step"]: m["acceptance_rate"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    # The tiny (random) target spreads its mass over all 103 tokens, so a 40-token draft starts low and
    # gains slowly; measured over the full vocabulary: 0.503 -> 0.534 in 6 steps.
    assert alpha[6] > alpha[0] + 0.02


def test_first_loss_is_the_cut_drafts_exact_tvd_and_heldout_alpha_is_measured_over_the_full_vocabulary(cut_run):
    run_dir, train_examples, heldout = cut_run
    target, _ = tiny_target(seed=0, num_hidden_layers=4, hidden_size=64)
    draft = AutoModelForCausalLM.from_pretrained(run_dir / "initial")
    keep = kept_ids(load_ranking(run_dir)[:CUT], {EOS})
    # Step 1 trains on the first 8 examples of epoch 0's order, with the initial draft's weights: its
    # loss is the mean over their answer tokens of TVD(p, q_cut) = 1 - sum_x min(p(x), q_cut(x)).
    first = [train_examples[i] for i in list(EpochSampler(len(train_examples), seed=0))[:8]]
    batch = collate(first, PAD)
    p, q = cut_distributions(draft, target, batch, keep)
    want = float((1 - acceptance_probability(q, p))[batch["loss_mask"]].mean())
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "losses.jsonl")}
    assert losses[1] == pytest.approx(want, rel=1e-5)
    batch = collate(heldout, PAD)
    p, q = cut_distributions(draft, target, batch, keep)
    want_alpha = float(acceptance_probability(q, p)[batch["loss_mask"]].mean())
    assert read_jsonl(run_dir / "metrics.jsonl")[0]["acceptance_rate"] == pytest.approx(want_alpha, rel=1e-5)


def test_eval_run_and_publish_decode_with_the_trained_cut(cut_run, tmp_path):
    run_dir, _, _ = cut_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to five."}\n')
    report = evaluate_run(run_dir, RunEvalSettings(prompts, gammas=[2], max_new_tokens=16, progress=False))
    assert report["draft_vocab"] == CUT  # the run's own cut when none is asked for
    assert report["results"]["checkpoint-6"]["0.0"]["greedy_match"] == 1.0
    draft_dir = publish(run_dir / "checkpoint-6", tmp_path / "draft")
    assert load_ranking(draft_dir) == load_ranking(run_dir)[:CUT]


def test_cut_with_a_full_teacher_cache_trains_as_with_the_live_teacher(tmp_path):
    common = {"train_draft_vocab": CUT, "max_steps": 3, "save_steps": 3, "log_steps": 3}
    live = loop.train(tiny_cfg(tmp_path / "live", **common)).run_dir
    cached = loop.train(tiny_cfg(tmp_path / "cached", teacher_cache="true", teacher_top_k=103, **common)).run_dir
    a, b = read_jsonl(live / "losses.jsonl"), read_jsonl(cached / "losses.jsonl")
    assert [y["loss"] for y in b] == pytest.approx([x["loss"] for x in a], rel=2e-3)  # float16 log-probs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train_draft_vocab": -1}, "draft.vocab must be >= 0"),
        ({"train_draft_vocab": 8, "draft_kind": "early_exit"}, "early_exit drafts share the target's head"),
    ],
)
def test_bad_train_draft_vocab_is_refused(tmp_path, overrides, message):
    with pytest.raises(DraftsmithError, match=message):
        tiny_cfg(tmp_path / "run", **overrides)
