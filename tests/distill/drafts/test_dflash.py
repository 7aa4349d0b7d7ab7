"""DFlash drafts (``distill.drafts.dflash``): exact decoding, anchored-block training, the DFlash layout.

Exactness: greedy output is the target's own (chains at several gammas, ragged batches, token
trees); sampled output fits the target's own conditionals (the tests' helpers, float64), and the
negative controls (always accept, correction from p) fail the same fit. The drafts decoded here are
trained for a few seconds on the tiny target's own distributions (``fitted_draft``), so they agree
with it sometimes and not always.

Training: block position k of the block anchored at a computes exactly what drafting after the
committed x_0..x_a computes, and reads no target state at or past a; ``draftsmith distill`` trains
the kind on the tiny target, eval-run ranks it, publish writes the layout vLLM reads, checked field by
field here, by vLLM's own config parser and by a real server in the ``vllm`` tests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.distill import vocab_cut
from draftsmith.distill.drafts import kind_of_folder
from draftsmith.distill.drafts.dflash import KIND, DFlashDraft, DFlashDrafter, block_targets, default_target_layer_ids
from draftsmith.distill.drafts.kind import Batch, DraftSettings, Serving
from draftsmith.distill.losses import row_losses
from draftsmith.specdec import verify
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.stream import Verification
from draftsmith.specdec.tree import TreeShape
from draftsmith.specdec.vllm_client import complete_batch, read_spec_counters
from draftsmith.specdec.vllm_server import ServeOptions, group_alive, serve
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from tests.helpers import (
    always_accept,
    assert_fits,
    correct_from_p,
    fit_forward_kl,
    named_tiny_llama,
    sample_spec,
    sampled_fit,
    tiny_llama,
    tiny_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MASK = 31  # an id the random training text below never holds
PROMPTS = [[0, 5, 9, 4], [0, 7], [0, 3, 3, 8, 2, 6, 11, 2]]


def teacher_batch(target, draft: DFlashDraft, ids: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """A training batch of every position after the first of ``ids`` (B, T), the target's states at
    the draft's feature layers, and the target's log-probs at its loss rows (M, V)."""
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, 0] = False
    rows = vocab_cut.loss_rows(loss_mask)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    hidden = {i: out.hidden_states[i] for i in KIND.teacher_layers(draft)}
    return Batch(ids, torch.ones_like(ids), loss_mask, rows, None, hidden), out.logits.flatten(0, 1)[rows].log_softmax(
        -1
    )


def fitted_draft(target, steps: int = 60, seed: int = 0, block_size: int = 6) -> DFlashDraft:
    """A draft trained briefly on the target's distributions over random text (forward KL, Adam),
    through the kind's own build and training forward."""
    settings = DraftSettings(kind="dflash", layers="1", options={"mask_token_id": MASK, "block_size": block_size})
    torch.manual_seed(seed)
    draft = KIND.build(settings, target, None, target.device)
    generator = torch.Generator().manual_seed(seed)

    def next_batch():
        return teacher_batch(target, draft, torch.randint(2, MASK, (8, 20), generator=generator))

    return fit_forward_kl(KIND, draft, next_batch, steps)


@pytest.fixture(scope="module")
def target():
    return named_tiny_llama(vocab=32, layers=4, sharpness=8.0)


@pytest.fixture(scope="module")
def draft(target):
    return fitted_draft(target)


# ---- the pieces ---------------------------------------------------------------------------------


def test_target_layers_are_z_labs_default_and_checked():
    assert default_target_layer_ids(30, 1) == (15,)
    assert default_target_layer_ids(30, 2) == (1, 27)  # SmolLM2-135M, two draft layers
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B draft
    assert default_target_layer_ids(4, 2) == (1,)  # 1 .. n-3 collapses on a small target
    with pytest.raises(DraftsmithError, match="increasing target layer ids in 0..2"):
        DFlashDraft(tiny_llama(layers=4), 1, [3], 4, MASK)  # the last layer's output is never handed over


def test_block_k_scores_the_teacher_k_minus_1_rows_after_its_anchor_in_the_same_sequence():
    loss_mask = torch.tensor([[False, True, True, True, False], [False, False, True, True, True]])
    rows = vocab_cut.loss_rows(loss_mask)  # flat 1, 2, 3, 7, 8, 9
    anchors, valid = torch.tensor([[1, 3], [2, 0]]), torch.tensor([[True, True], [True, False]])
    index, teacher, k = block_targets(rows, anchors, valid, 5, 4)
    assert rows[teacher].tolist() == [1, 2, 3, 3, 7, 8, 9]  # a+k-1, loss rows only, never past the sequence
    assert k.tolist() == [1, 2, 3, 1, 1, 2, 3]
    assert index.tolist() == [1, 2, 3, 5, 9, 10, 11]  # flat into (B, A, width)


def test_block_position_k_computes_what_drafting_after_the_anchor_computes(target):
    """Training's block at anchor a, mask k == the drafter's q_k after observing x_0..x_a (the context
    rows 0..a-1), and changing the target's states at or after a changes nothing."""
    draft = fitted_draft(target, steps=3)
    ids = torch.randint(2, MASK, (1, 12), generator=torch.Generator().manual_seed(4))
    batch, _ = teacher_batch(target, draft, ids)
    anchor, width = 6, 5
    with torch.no_grad():
        trained = draft(ids, batch.attention_mask, batch.teacher_hidden, torch.tensor([[anchor]]), width)
        trained = draft.lm_head(trained[0, 0, 1:])  # (width-1, V)
        later = {i: h.clone() for i, h in batch.teacher_hidden.items()}
        for h in later.values():
            h[:, anchor:] = torch.randn_like(h[:, anchor:])
        moved = draft.lm_head(draft(ids, batch.attention_mask, later, torch.tensor([[anchor]]), width)[0, 0, 1:])
        drafter = DFlashDrafter(draft, 1, 32)
        states = {i: h[:, :anchor] for i, h in batch.teacher_hidden.items()}
        drafter.observe(Verification(torch.zeros(1, 1, 32), states), torch.ones(1, anchor, dtype=torch.bool))
        drafted = drafter.round_logits([ids[0, : anchor + 1].tolist()], torch.tensor([True]), width - 1)[0]
    assert torch.allclose(trained, drafted, atol=1e-5)
    assert torch.allclose(trained, moved, atol=1e-5)


def test_a_block_trains_under_bfloat16_autocast_as_in_float32(target):
    """Mixed precision (optim.mixed_precision: auto on a CPU with native bfloat16): float32 weights,
    bfloat16 matmuls. The context rows a block may not see are masked in the scores' own dtype."""
    draft = fitted_draft(target, steps=1)
    ids = torch.randint(2, MASK, (2, 12), generator=torch.Generator().manual_seed(5))
    batch, _ = teacher_batch(target, draft, ids)
    anchors = torch.tensor([[2, 6], [3, 7]])
    with torch.no_grad():
        full = draft(ids, batch.attention_mask, batch.teacher_hidden, anchors, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = draft(ids, batch.attention_mask, batch.teacher_hidden, anchors, 4)
    assert torch.isfinite(mixed).all()
    assert torch.allclose(mixed.float(), full, atol=0.1, rtol=0.05)


def test_settings_the_kind_cannot_use_are_refused_by_name():
    with pytest.raises(DraftsmithError, match="need draft.options.mask_token_id"):
        KIND.check(DraftSettings(kind="dflash"))
    with pytest.raises(DraftsmithError, match="leave out draft.lora_r"):
        KIND.check(DraftSettings(kind="dflash", lora_r=8, options={"mask_token_id": 16}))
    with pytest.raises(DraftsmithError, match="leave out draft.vocab"):
        KIND.check(DraftSettings(kind="dflash", train_draft_vocab=100, options={"mask_token_id": 16}))
    with pytest.raises(DraftsmithError, match="'block' is not an option of dflash drafts.*'block_size'"):
        KIND.check(DraftSettings(kind="dflash", options={"mask_token_id": 16, "block": 4}))
    with pytest.raises(DraftsmithError, match="accepted_length's windows"):
        KIND.check(DraftSettings(kind="dflash", loss="accepted_length", options={"mask_token_id": 16}))


# ---- exact decoding -----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_chains_are_the_targets_own_output_alone_and_in_a_ragged_batch(target, draft, gamma):
    for length in (1, 3, 30):
        want, _ = target_generate(target, PROMPTS, length)
        got, stats = speculative_generate(target, draft, PROMPTS, length, options=DecodeOptions(gamma=gamma))
        assert got == want, length
        for prompt, expected in zip(PROMPTS, want, strict=True):
            alone, _ = speculative_generate(target, draft, [prompt], length, options=DecodeOptions(gamma=gamma))
            assert alone == [expected]
    assert 0 < stats.accepted < stats.proposed  # right sometimes, not always
    assert stats.draft_forwards <= stats.rounds + 1  # at most one draft forward a round (and the prefill's count)


@pytest.mark.parametrize("shape", ["3,2,1", "1,1,1,1", "2,2,2:5"])
def test_greedy_trees_are_the_targets_own_output(target, draft, shape):
    options = DecodeOptions(tree=TreeShape.parse(shape))
    accepted = proposed = 0
    for prompt in PROMPTS:
        want, _ = target_generate(target, [prompt], 30)
        got, stats = speculative_generate(target, draft, [prompt], 30, options=options)
        assert got == want
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    assert 0 < accepted < proposed


def test_the_draft_refuses_compiled_decoding_by_name(target, draft):
    with pytest.raises(DraftsmithError, match="DFlash draft decodes eager; pass --no-compile"):
        speculative_generate(target, draft, PROMPTS[:1], 4, options=DecodeOptions(compile=True))


# ---- sampling: the target's distribution, and broken rules that fail the same fit ----------------


@pytest.fixture(scope="module")
def small():
    target = tiny_llama(vocab=12, layers=4, sharpness=3.0, seed=0)
    settings = DraftSettings(kind="dflash", layers="1", options={"mask_token_id": 11, "block_size": 4})
    torch.manual_seed(0)
    draft = KIND.build(settings, target, None, target.device)
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(25):
        batch, teacher = teacher_batch(target, draft, torch.randint(2, 11, (8, 16), generator=generator))
        predicted = KIND.training_forward(draft, draft, batch)
        loss = (row_losses("forward_kl", predicted.logits, teacher[predicted.teacher_rows]) * predicted.weights).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return target, draft.eval()


@pytest.mark.parametrize(
    ("params", "gamma"),
    [(SamplingParams(1.0), 1), (SamplingParams(1.0), 3), (SamplingParams(0.7, top_k=5), 3)],
    ids=["t1-g1", "t1-g3", "t0.7-k5-g3"],
)
def test_sampled_output_is_distributed_as_the_targets(small, params, gamma):
    target, draft = small
    a, b, stats = sample_spec(target, draft, params, gamma, seed=gamma)
    assert_fits(target, params, a, b)
    assert 0 < stats.accepted < stats.proposed


@pytest.mark.parametrize("control", ["always accept", "correct from p"])
def test_broken_rules_fail_the_same_fit(small, monkeypatch, control):
    target, draft = small
    params = SamplingParams(0.7, top_k=5)
    monkeypatch.setattr(verify, "accept_sampled", always_accept if control == "always accept" else correct_from_p)
    a, b, _ = sample_spec(target, draft, params, 3)
    assert max(sampled_fit(target, params, (a, b)).values()) > 10


# ---- the run: distill, checkpoint, resume, eval-run, publish ------------------------------------

KIND_OPTIONS = {"mask_token_id": 2, "block_size": 4}  # <unk>: the character data has none


def tiny_run(folder, **overrides):
    items = {"output_dir": str(folder), "draft_kind": "dflash", "draft_layers": "1", "kind_options": KIND_OPTIONS}
    items |= {"max_steps": 10, "save_steps": 5, "log_steps": 5, **overrides}
    return load_config(
        DistillConfig,
        config_path("tiny"),
        [f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in items.items()],
    )


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())}


def check_layout(folder, hidden: int, layers: int) -> dict:
    """The folder holds the DFlash layout vLLM 0.32 loads, field by field; returns config.json."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["hidden_size"] == config["target_hidden_size"] == hidden
    assert config["num_hidden_layers"] == layers
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids", "causal"}
    assert config["dflash_config"]["causal"] is False
    tensors = load_file(folder / "model.safetensors")
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in tensors)  # vLLM shares the target's
    width = len(config["dflash_config"]["target_layer_ids"]) * hidden
    assert tensors["fc.weight"].shape == (hidden, width)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    mask = torch.load(folder / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == config["dflash_config"]["mask_token_id"] and mask["embedding"].shape == (hidden,)
    return config


def test_the_kind_trains_checkpoints_resumes_ranks_and_publishes(tmp_path):
    run = train(tiny_run(tmp_path / "run")).run_dir
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 5, 10]
    assert metrics[-1]["acceptance_rate"] > metrics[0]["acceptance_rate"] + 0.1  # 0.40 -> 0.59 when written
    ckpt = run / "checkpoint-10"
    assert kind_of_folder(ckpt) is KIND
    check_layout(ckpt, hidden=64, layers=1)
    killed = tiny_run(tmp_path / "killed")  # stopped after step 7, resumed from checkpoint-5
    train(killed, stop_at_step=7)
    train(killed)
    assert losses(tmp_path / "killed") == losses(run)  # the same anchors drawn, the same updates
    first, second = (
        load_file(ckpt / "model.safetensors"),
        load_file(tmp_path / "killed/checkpoint-10/model.safetensors"),
    )
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert main(["eval-run", str(run), "--gammas", "1,3", "--max-new-tokens", "12", "--limit", "2"]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    matches = [r["0.0"]["greedy_match"] for r in report["results"].values()]  # each a share of prompts
    assert matches == [1.0] * len(report["results"])  # every prompt identical, for every checkpoint
    out = tmp_path / "published"
    assert main(["publish", str(run), "--out", str(out)]) == 0
    check_layout(out, hidden=64, layers=1)
    assert KIND.engine_config(out) == {"method": "dflash", "model": str(out)}
    assert KIND.read_serving(out).gamma == json.loads((run / "best.json").read_text())["best_gamma"]


def test_from_the_feature_store_it_runs_no_target_forward_and_learns_what_the_live_run_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))  # no store another test built
    live = train(tiny_run(tmp_path / "live", max_steps=3, save_steps=3, log_steps=3)).run_dir
    exact = {"teacher_cache": "true", "teacher_top_k": 103, "teacher_cache_dtype": "float32"}
    stored = train(tiny_run(tmp_path / "stored", max_steps=3, save_steps=3, log_steps=3, **exact)).run_dir
    summary = json.loads((stored / "train_summary.json").read_text())
    assert (summary["teacher_forwards"], summary["teacher"]) == (0, "store")
    assert list(losses(stored).values()) == pytest.approx(list(losses(live).values()), rel=1e-3)
    meta = json.loads((Path(summary["store"]) / "meta.json").read_text())
    assert meta["layers"] == [3]  # the output of target layer 2 (the middle one): what a 1-layer draft reads


def test_the_export_drafts_as_the_draft_did_and_a_broken_folder_is_refused(target, draft, tmp_path):
    KIND.export(draft, tiny_tokenizer(target.config.vocab_size), tmp_path, Serving(gamma=3))
    config = check_layout(tmp_path, hidden=target.config.hidden_size, layers=1)
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [2], "causal": False}
    loaded = KIND.load(tmp_path, target, target.device, target.dtype)
    want, _ = speculative_generate(target, draft, PROMPTS, 20, options=DecodeOptions(gamma=3))
    got, _ = speculative_generate(target, loaded, PROMPTS, 20, options=DecodeOptions(gamma=3))
    assert got == want
    assert torch.equal(loaded.mask_embedding, draft.mask_embedding)
    config["dflash_config"]["causal"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftsmithError, match="dflash_config.causal is not written as false"):
        KIND.check_export(tmp_path)


@pytest.mark.vllm
def test_vllms_own_parser_reads_the_export(engine, target, draft, tmp_path):
    """vLLM 0.32's own config path for a dflash draft, in its environment: the draft config it reads,
    the architecture EAGLEConfig gives it, the model class its registry maps that to, the aux layers the
    target runner hands over and the attention it builds (non-causal)."""
    KIND.export(draft, tiny_tokenizer(target.config.vocab_size), tmp_path, Serving(gamma=3))
    script = (
        "import json, sys\n"
        "from vllm.transformers_utils.config import get_config\n"
        "from vllm.transformers_utils.configs.eagle import EAGLEConfig\n"
        "from vllm.model_executor.models.registry import ModelRegistry\n"
        "from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal\n"
        "config = get_config(sys.argv[1], trust_remote_code=False)\n"
        "eagle = EAGLEConfig(config, method='dflash', model_type='eagle')\n"
        "arch = eagle.architectures\n"
        "model_class = ModelRegistry._try_load_model_cls(arch[0])\n"
        "print(json.dumps({'architectures': arch, 'class': model_class.__name__,\n"
        "    'aux': [i + 1 for i in eagle.dflash_config['target_layer_ids']],\n"
        "    'mask': eagle.dflash_config['mask_token_id'], 'non_causal': dflash_has_any_non_causal(eagle)}))\n"
    )
    done = subprocess.run([engine.command[0], "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {
        "architectures": ["DFlashDraftModel"],
        "class": "DFlashQwen3ForCausalLM",
        "aux": list(draft.feature_layers),
        "mask": MASK,
        "non_causal": True,
    }


# ---- the default target: exact in our decoder, served by vLLM -----------------------------------

QUESTIONS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]
MAX_TOKENS = 24
GAMMA = 3


@pytest.fixture(scope="module")
def default():
    """The default target in float32, the prompts, its greedy answers, and a DFlash draft trained on them."""
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = eos_token_ids(model, tokenizer)
    reference = [target_generate(model, [p], MAX_TOKENS, eos_ids=eos)[0][0] for p in prompts]
    sequences = [p + a for p, a in zip(prompts, reference, strict=True)]
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss_mask[row, len(prompt) - 1 : len(sequence) - 1] = True
    settings = DraftSettings(kind="dflash", layers="1", options={"mask_token_id": 16, "block_size": GAMMA + 1})
    torch.manual_seed(0)
    draft = KIND.build(settings, model, tokenizer, model.device)
    rows = vocab_cut.loss_rows(loss_mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    teacher = out.logits.flatten(0, 1)[rows].float()
    batch = Batch(ids, attention, loss_mask, rows, None, {i: out.hidden_states[i] for i in KIND.teacher_layers(draft)})
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(120):
        predicted = KIND.training_forward(draft, draft, batch)
        losses = row_losses("forward_kl", predicted.logits, teacher[predicted.teacher_rows])
        loss = (losses * predicted.weights).sum() / len(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, tokenizer, prompts, eos, reference, draft.eval()


@pytest.mark.slow
def test_on_the_default_target_chains_and_trees_are_the_targets_own_output(default):
    model, _, prompts, eos, reference, draft = default
    assert draft.target_layer_ids == (15,)
    got, stats = speculative_generate(model, draft, prompts, MAX_TOKENS, DecodeOptions(gamma=GAMMA), eos_ids=eos)
    assert got == reference
    assert stats.accepted > 0  # 6 of 172 when written: 120 steps do not make it memorize the answers
    tree = DecodeOptions(tree=TreeShape.parse("2,2,1"))
    for prompt, expected in zip(prompts, reference, strict=True):
        assert speculative_generate(model, draft, [prompt], MAX_TOKENS, tree, eos_ids=eos)[0] == [expected]


@pytest.fixture(scope="module")
def dflash_server(engine, default, tmp_path_factory):
    model, tokenizer, *_, draft = default
    folder = tmp_path_factory.mktemp("dflash-draft")
    KIND.export(draft, tokenizer, folder, Serving(gamma=GAMMA))
    log = tmp_path_factory.mktemp("vllm-logs") / "dflash.log"
    options = ServeOptions(dtype="float32", eager=True, threads=1)
    speculative = KIND.engine_config(folder)
    with serve(DEFAULT_TARGET, options, speculative=speculative, gamma=GAMMA, engine=engine, log_path=log) as server:
        yield server
    assert not group_alive(server.process.pid)


@pytest.mark.vllm
def test_vllm_serves_the_published_draft_exactly_and_accepts_its_drafts(dflash_server, default):
    model, _, prompts, eos, reference, draft = default
    before = read_spec_counters(dflash_server)
    answers, _ = complete_batch(dflash_server, prompts, MAX_TOKENS, batch_size=1)
    grown = read_spec_counters(dflash_server) - before
    assert [a.token_ids for a in answers] == reference
    assert grown.drafts > 0 and grown.draft_tokens == GAMMA * grown.drafts
    assert grown.accepted > 0
