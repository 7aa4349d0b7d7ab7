"""A drafter kind defined here, in test code only, registered at run time, goes through the ordinary
commands: it trains (reading the target's hidden states from the teacher's forward), decodes
exactly, checkpoints, reloads, is ranked by eval-run and is published. Nothing outside this module
names it: that is what makes a new kind one module and one registry line.

The kind: a fresh linear head on the target's final hidden state at position t, predicting the
token at t + 2 (the target's own logits there already give t + 1). Each round it proposes one
token from the state the last verification left, so it needs the verifier's hidden states
(``Drafter.observe``) to draft at all.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.cli import main
from draftsmith.distill import drafts
from draftsmith.distill.drafts.kind import Batch, DraftModel, KindBase, Predictions
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.drafters import Proposal, Verification, draft_chain
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import ROOT, TreeShape
from draftsmith.specdec.tree_drafting import Tree
from draftsmith.specdec.verify import TargetVerifier
from draftsmith.train.config import load_run_config
from tests.helpers import assert_fits, sample_spec, tiny_llama

META, WEIGHTS = "last_state.json", "last_state.safetensors"


class LastStateHead(DraftModel):
    """hidden state of the target at t (B, ..., H) -> logits for the token at t + 2 (B, ..., V)."""

    def __init__(self, target):
        super().__init__()
        self.config, self.generation_config = target.config, copy.deepcopy(target.generation_config)
        self.layer = target.config.num_hidden_layers  # hidden_states[L]: the final, normed state
        self.proj = nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=False)
        self.to(device=target.device, dtype=target.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)

    def decoding_pair(self, target, batch_size, capacity, options):
        verifier = TargetVerifier(target, batch_size, capacity, "slot", {}, feature_layers=(self.layer,))
        return verifier, LastStateDrafter(self)


class LastStateDrafter:
    """One proposal per round, from the target state the last verification left at the committed text."""

    def __init__(self, head: LastStateHead):
        self.head, self.feature_layers = head, (head.layer,)
        self.state: torch.Tensor | None = None  # (B, H)

    def prefill(self, tokens, valid):
        return None

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        hidden = verification.hidden[self.head.layer]  # (B, Q, H)
        last = (kept.long() * torch.arange(kept.shape[1], device=kept.device)).argmax(-1)  # (B,) last kept row
        self.state = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def propose(self, sequences, budget, options, generator) -> Proposal:
        return draft_chain(lambda token, active: self.head(self.state), budget.clamp(max=1), options, generator)

    def rollback(self, keep):
        """Nothing: the drafter keeps no cache."""

    def select(self, rows):
        self.state = self.state[rows]

    def propose_tree(self, sequence, shape: TreeShape, max_depth: int) -> Tree:
        tree = Tree(steps=1)
        if max_depth >= 1:
            top = self.head(self.state[0]).float().log_softmax(-1).topk(shape.branching[0])
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                tree.tokens.append(token)
                tree.parents.append(ROOT)
                tree.path_logprob.append(logprob)
        return tree

    def commit_tree(self, tree, path):
        """Nothing: no cache to compact."""


class LastStateKind(KindBase):
    name, model_class = "last_state", LastStateHead

    def build(self, settings, target, tokenizer, device):
        return LastStateHead(target).train()

    def teacher_layers(self, draft):
        return (draft.layer,)

    def training_forward(self, draft, model, batch: Batch) -> Predictions:
        (hidden,) = batch.teacher_hidden.values()  # (B, T, H): the one layer this kind asked for
        # The state at t - 1 predicts the token at t + 1, which the teacher's distribution at t is
        # about; every loss row is an answer token, never a sequence's first.
        before = hidden.flatten(0, 1).index_select(0, batch.rows - 1)  # (M, H)
        logits = draft(before)  # (M, V)
        return Predictions(logits if batch.head_ids is None else logits[:, batch.head_ids])

    def save(self, draft, state, tokenizer, folder: Path, target_name: str) -> None:
        save_file({"proj.weight": draft.proj.weight.detach().contiguous().cpu()}, folder / WEIGHTS)
        (folder / META).write_text(json.dumps({"target": target_name, "layer": draft.layer}))
        tokenizer.save_pretrained(folder)

    def files(self):
        return (META, WEIGHTS)

    def load(self, folder: Path, target, device, dtype):
        head = LastStateHead(target)
        head.load_state_dict(load_file(folder / WEIGHTS, device=str(target.device)))
        return head.eval()


@pytest.fixture
def registered():
    drafts.register(LastStateKind())
    yield
    del drafts.KINDS["last_state"]


def test_the_kind_decodes_exactly_greedy_and_in_trees():
    target = tiny_llama(vocab=32, layers=2, sharpness=8.0)
    head = LastStateHead(target).eval()
    prompts = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6]]
    want, _ = target_generate(target, prompts, 20)
    got, stats = speculative_generate(target, head, prompts, 20, options=DecodeOptions(gamma=1))
    assert got == want
    # One proposal per round (none in a last round that may emit only the target's token), plus the prefill.
    assert stats.rounds <= stats.draft_forwards <= stats.rounds + 1
    # One token per round of every sequence, but none in a round that may emit only one more token.
    assert stats.seq_rounds - len(prompts) <= stats.proposed <= stats.seq_rounds
    tree, tree_stats = speculative_generate(
        target, head, prompts[:1], 20, options=DecodeOptions(tree=TreeShape.parse("3"))
    )
    assert tree == want[:1]
    assert tree_stats.tree_nodes % 3 == 0 and 3 * (tree_stats.rounds - 1) <= tree_stats.tree_nodes


def test_the_kind_samples_as_the_target_does():
    small = tiny_llama(vocab=12, layers=3, sharpness=3.0, seed=0)
    head = LastStateHead(small).eval()
    torch.nn.init.normal_(head.proj.weight, std=0.5)  # a draft that is sometimes right, sometimes not
    params = SamplingParams(temperature=1.0, top_k=8)
    first, second, stats = sample_spec(small, head, params, gamma=1, samples=1500)
    assert 0 < stats.accepted < stats.proposed
    assert_fits(small, params, first, second)


def test_a_registered_kind_trains_checkpoints_ranks_and_publishes(registered, tmp_path, capsys):
    run = tmp_path / "run"
    common = ["--config", "tiny", f"output_dir={run}", "draft.kind=last_state", "optim.max_steps=6", "save.steps=3"]
    assert main(["distill", *common, "optim.lr=0.01", "log.steps=3"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 3, 6]
    assert metrics[-1]["acceptance_rate"] > metrics[0]["acceptance_rate"] + 0.05  # it learned from the states
    ckpt = run / "checkpoint-6"
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "draftsmith.json",
        "last_state.json",
        "last_state.safetensors",
        *(["special_tokens_map.json"] if (ckpt / "special_tokens_map.json").is_file() else []),
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert load_run_config(run).draft.kind == "last_state"
    assert main(["eval-run", str(run), "--gammas", "1", "--max-new-tokens", "12", "--limit", "2"]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    matches = [r["0.0"]["greedy_match"] for r in report["results"].values()]  # each a share of prompts
    assert matches == [1.0] * len(report["results"])  # every prompt identical, for every checkpoint
    out = tmp_path / "published"
    assert main(["publish", str(run), "--out", str(out)]) == 0
    assert (out / "last_state.safetensors").is_file() and drafts.KINDS["last_state"].read_serving(out).gamma == 1
    assert f"draftsmith eval --target tiny --draft {out.resolve()} --gamma 1" in (out / "README.md").read_text()
