"""Few-row products in the column form (``specdec.matmul``): the same numbers, the same modules, the
choice timed and kept, and greedy decoding through it still the target's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.specdec import matmul
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.draft_vocab import SubsetHeadDraft
from draftsmith.specdec.matmul import (
    MAX_ROWS,
    ColumnLinear,
    column_form_shapes,
    column_linear,
    column_shapes,
    use_column_products,
    uses_column_products,
)
from draftsmith.specdec.options import DecodeOptions
from tests.helpers import noisy_copy, tiny_llama


@pytest.mark.parametrize("rows", [1, 2, 3, 7, MAX_ROWS, MAX_ROWS + 1])
def test_column_form_computes_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(1, rows, 40, generator=gen)  # (B, Q, K) as a decoder layer hands it over
    out = column_linear(x, weight, bias)
    assert out.shape == (1, rows, 48)
    assert out.is_contiguous()  # attention takes its fast kernel only on standard strides
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_one_row_is_multiplied_as_two_equal_columns():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 32, generator=gen), torch.randn(1, 32, generator=gen)
    assert torch.equal(column_linear(x, weight), torch.mm(weight, torch.cat([x, x]).t()).t()[:1])


def test_bfloat16_weights_keep_linear():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 32, generator=gen).bfloat16(), torch.randn(2, 32, generator=gen).bfloat16()
    assert torch.equal(column_linear(x, weight), F.linear(x, weight))


def test_switching_keeps_parameters_state_and_copies():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert linears == 2 * 7 + 1  # q k v o gate up down per layer, the head
    assert use_column_products(model, True) is True
    assert sum(type(m) is ColumnLinear for m in model.modules()) == linears
    assert uses_column_products(model)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    twin = copy.deepcopy(model)
    assert sum(type(m) is ColumnLinear for m in twin.modules()) == linears
    assert use_column_products(model, False) is False
    assert not any(type(m) is ColumnLinear for m in model.modules())
    assert not uses_column_products(model)


def test_a_cut_head_switches_with_its_draft():
    draft = SubsetHeadDraft(tiny_llama(), [0, 1, 2, 5, 8])
    use_column_products(draft, True)
    assert type(draft.head) is ColumnLinear
    assert draft.weight.shape == (5, 32)


def test_small_models_are_not_timed(monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("a model that fits the CPU's caches was timed")

    monkeypatch.setattr(matmul, "_time_pass", fail)
    model = tiny_llama()
    assert use_column_products(model) is False
    assert not column_shapes(nn.Linear(1024, 1024).bfloat16())  # no float32 weights to time


@pytest.mark.parametrize(("columns_s", "expected"), [(0.5, True), (0.9, True), (0.95, False), (1.2, False)])
def test_the_column_form_is_chosen_per_shape_where_it_takes_at_most_nine_tenths(monkeypatch, columns_s, expected):
    calls = []

    def fake_pass(weights, inputs, columns):
        calls.append(columns)
        assert [tuple(w.shape) for w in weights] == [(1024, 1024), (512, 1024)] * 2  # in the order a forward reads
        # the square weights take columns_s of linear's time in the column form, the others 1.5 of it
        return {(1024, 1024): columns_s if columns else 1.0, (512, 1024): 1.5 if columns else 1.0}

    monkeypatch.setattr(matmul, "_time_pass", fake_pass)
    layers = [nn.Linear(1024, 1024), nn.Linear(1024, 512), nn.Linear(1024, 1024), nn.Linear(1024, 512)]
    model = nn.Sequential(*layers)  # 12 MiB of float32 weights
    assert use_column_products(model) is expected
    assert calls == [True, False] + [False, True] * 7  # a warm-up of each, then seven interleaved pairs
    assert [type(m) is ColumnLinear for m in layers] == [expected, False, expected, False]
    assert column_form_shapes(model) == ({(1024, 1024)} if expected else set())
    monkeypatch.setattr(matmul, "_time_pass", None)  # the choice is kept: no second timing
    assert use_column_products(model) is expected


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_output_through_the_column_form_is_the_targets(gamma):
    target = tiny_llama(vocab=32, sharpness=8.0)
    draft = noisy_copy(target, noise=0.3)
    prompts = [[0, 5, 7, 9], [0, 3], [0, 8, 8, 8, 8, 8, 2, 11, 4]]
    expected = [target_generate(target, [p], 24)[0][0] for p in prompts]  # torch's linear
    use_column_products(target, True)
    use_column_products(draft, True)
    for prompt, reference in zip(prompts, expected, strict=True):
        alone, _ = target_generate(target, [prompt], 24)
        out, stats = speculative_generate(target, draft, [prompt], 24, options=DecodeOptions(gamma=gamma))
        assert alone[0] == reference
        assert out[0] == reference
        assert stats.proposed > 0
    batch, _ = speculative_generate(target, draft, prompts, 24, options=DecodeOptions(gamma=gamma))
    assert batch == expected
