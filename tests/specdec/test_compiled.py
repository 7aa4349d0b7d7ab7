"""Compiled decoding (``specdec.compiled``): the same logits and the same tokens as eager decoding, graphs
compiled once per architecture and reused by every model of it, static caches pooled, and clear
refusals where decoding stays eager. Exactness of whole runs is in test_decoder_greedy / _sampling."""

import pytest
import torch

from draftsmith.distill.drafts.early_exit import EarlyExitDraft
from draftsmith.specdec.cache import slot_mask
from draftsmith.specdec.compiled import CompiledStream, compiled_graphs, static_cache
from draftsmith.specdec.decoder import decodes_compiled, speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt
from draftsmith.specdec.stream import ModelStream
from draftsmith.specdec.tree import TreeShape
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

PROMPTS = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4]]


@pytest.fixture(scope="module")
def target(device):
    return tiny_llama(vocab=32, sharpness=8.0).to(device)


def test_slot_mask_lets_each_query_see_live_slots_up_to_its_own_and_itself():
    # Two sequences, 5 slots: the second has a hole in slot 1; the forward's queries sit in slots 3-4,
    # and slot 4 of the first sequence is padding.
    slot_pos = torch.tensor([[0, 1, 2, 3, -1], [0, -1, 1, 2, 3]])
    mask = slot_mask(slot_pos, torch.tensor([3, 4]), torch.float32)
    assert mask.shape == (2, 1, 2, 5)
    seen = (mask[:, 0] == 0).int().tolist()
    assert seen == [
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],  # the padding query sees the live slots and itself
        [[1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
    ]
    assert mask.min().item() == torch.finfo(torch.float32).min


def test_compiled_steps_give_the_eager_logits_through_rollback_and_finished_rows(target):
    """Prefill, two draft-like steps, a ragged verification, a rollback, a row leaving the batch."""
    eager = ModelStream(target, 2, 40, "slot")
    compiled = CompiledStream(target, 2, 40, role="target")
    tokens = torch.tensor([[0, 5, 7, 9], [1, 1, 0, 3]], device=target.device)
    valid = torch.tensor([[True] * 4, [False, False, True, True]], device=target.device)
    one = torch.ones(2, 1, dtype=torch.bool, device=target.device)
    with torch.inference_mode():
        logits = [(s.forward(tokens, valid, logits_to_keep=1), s) for s in (eager, compiled)]
        steps = [
            (torch.tensor([[4], [6]]), one),
            (torch.tensor([[2, 8, 9], [3, 0, 0]]), torch.tensor([[True] * 3, [True, False, False]])),
        ]
        for step, step_valid in steps:
            for stream in (eager, compiled):
                out = stream.forward(step.to(target.device), step_valid.to(target.device))
                logits.append((out, stream))
        for stream in (eager, compiled):
            stream.rollback(torch.tensor([6, 5], device=target.device))  # drop the last two of the first row
            stream.select(torch.tensor([0], device=target.device))  # the second sequence finished
            logits.append((stream.forward(torch.tensor([[11]], device=target.device), one[:1]), stream))
        assert compiled.lengths == eager.lengths == [7]
    pairs = [(a, b) for (a, sa), (b, sb) in zip(logits[0::2], logits[1::2], strict=True)]
    assert [a.shape for a, _ in pairs] == [(2, 1, 32), (2, 1, 32), (2, 3, 32), (1, 1, 32)]
    for eager_logits, compiled_logits in pairs:
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert compiled.tracker.pos.shape == (2,)  # the finished row stayed in the compiled batch


def test_a_new_model_of_the_same_architecture_reuses_the_compiled_graphs(target):
    """Checkpoints of one run share an architecture: only the first pays for compilation."""
    prompts = PROMPTS[:2]
    reference = [target_generate(target, [p], 20, DecodeOptions(compile=False))[0][0] for p in prompts]
    first = noisy_copy(target, noise=0.3)
    out, _ = speculative_generate(target, first, prompts, 20, options=DecodeOptions(gamma=3, compile=True))
    assert out == reference
    graphs = compiled_graphs()
    for seed in (2, 3):
        checkpoint = noisy_copy(target, noise=0.3, seed=seed)
        out, stats = speculative_generate(target, checkpoint, prompts, 20, options=DecodeOptions(gamma=3, compile=True))
        assert out == reference
        assert 0 < stats.accepted < stats.proposed
    assert compiled_graphs() == graphs


@torch.inference_mode()  # as the decoder runs: a pooled cache holds inference tensors
def test_static_caches_are_pooled_per_model_role_and_batch(device):
    target = tiny_llama(vocab=32, sharpness=8.0).to(device)  # its own model: the shared one has pooled caches
    cache = static_cache(target, "target", 2, 50)
    assert cache.layers[0].max_cache_len == 64  # a power of two, at least 64
    assert static_cache(target, "target", 2, 64) is cache  # large enough: the same tensors again
    assert static_cache(target, "draft", 2, 50) is not cache  # the target drafting for itself needs two
    assert static_cache(target, "target", 3, 50) is not cache
    bigger = static_cache(target, "target", 2, 65)
    assert bigger.layers[0].max_cache_len == 128
    assert static_cache(target, "target", 2, 50) is bigger  # the larger one replaced it


def test_compiled_baseline_matches_eager_when_sequences_finish_apart(target):
    eos = 7
    eager, _ = target_generate(target, PROMPTS, 30, DecodeOptions(compile=False), eos_ids={eos})
    compiled, stats = target_generate(target, PROMPTS, 30, DecodeOptions(compile=True), eos_ids={eos})
    assert compiled == eager
    assert len({len(seq) for seq in eager}) > 1  # rows finished at different steps
    assert stats.new_tokens == sum(len(seq) for seq in eager)


def test_compiled_is_the_default_on_cuda_only(target):
    draft = noisy_copy(target, noise=0.3)
    assert decodes_compiled(target, draft, DecodeOptions()) == (target.device.type == "cuda")
    assert decodes_compiled(target, draft, DecodeOptions(compile=False)) is False
    assert decodes_compiled(target, EarlyExitDraft(target, k=1), DecodeOptions()) is False  # shares the target's cache
    assert (
        decodes_compiled(
            target, EarlyExitDraft(target, k=1), DecodeOptions(draft_options={"kv_reuse": False}, compile=True)
        )
        is True
    )


def test_where_decoding_stays_eager_compiling_is_refused_in_one_line(target):
    with pytest.raises(DraftsmithError, match=r"token trees decode eager; leave out compile \(--no-compile\)"):
        DecodeOptions(compile=True, tree=TreeShape.parse("2,1"))
    with pytest.raises(DraftsmithError, match="an early-exit draft sharing the target's cache decodes eager"):
        speculative_generate(target, EarlyExitDraft(target, k=1), [[0, 5]], 4, options=DecodeOptions(compile=True))


def test_bfloat16_on_a_cpu_decodes_eager_to_stay_row_exact():
    model = tiny_llama(vocab=32).to(torch.bfloat16)
    with pytest.raises(DraftsmithError, match="compiled decoding on a CPU runs in float32; bfloat16 decodes eager"):
        speculative_generate(model, model, [[0, 5]], 4, options=DecodeOptions(compile=True))
    with pytest.raises(DraftsmithError, match="pass --no-compile, or --dtype float32"):
        target_generate(model, [[0, 5]], 4, DecodeOptions(compile=True))


def test_evaluation_reports_compile_time_apart_and_compiles_nothing_for_a_second_checkpoint(target):
    tokenizer = tiny_tokenizer(32)
    prompts = [Prompt(str(i), "c", [[{"role": "user", "content": text}]]) for i, text in enumerate(["w5 w7", "w9"])]
    settings = MeasureSettings(
        prompts, options=DecodeOptions(gamma=3, compile=True), max_new_tokens=16, repeats=1, progress=False
    )
    first = evaluate_pair(target, noisy_copy(target, noise=0.3), tokenizer, settings)
    second = evaluate_pair(target, noisy_copy(target, noise=0.3, seed=2), tokenizer, settings)
    for report in (first, second):
        assert report.compiled.compile is True
        assert report.greedy_match == 1.0
        assert report.compiled.compile_s > 0
    assert second.compiled.compiled_graphs == 0  # the first checkpoint's graphs serve the second
