"""Frequency-ranked drafting: a draft head cut to the frequent tokens keeps decoding exact."""

import pytest
import torch

from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.draft_vocab import SubsetHeadDraft, load_ranking, rank_tokens, save_ranking
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import TreeShape
from tests.helpers import assert_fits, noisy_copy, sample_spec, tiny_llama


def test_ranking_counts_learned_next_tokens_only(tmp_path):
    examples = [
        {"input_ids": [9, 9, 4, 5, 5], "loss_mask": [0, 1, 1, 1, 0]},  # next tokens 4, 5, 5 count; 9 never does
        {"input_ids": [3, 4, 7], "loss_mask": [1, 1, 0]},  # 4, 7
    ]
    ranking = rank_tokens(examples)
    assert ranking[:2] == [4, 5] or ranking[:2] == [5, 4]
    assert sorted(ranking) == [4, 5, 7]
    save_ranking(tmp_path, ranking)
    assert load_ranking(tmp_path) == ranking
    with pytest.raises(DraftsmithError, match="draft_vocab.json not found"):
        load_ranking(tmp_path / "missing")


def test_subset_logits_are_the_drafts_on_the_kept_tokens_and_minus_inf_elsewhere():
    draft = tiny_llama(vocab=40, seed=2)
    keep = [5, 1, 30, 7]
    cut = SubsetHeadDraft(draft, keep, always={2})
    ids = torch.tensor([[3, 8, 13, 21]])
    with torch.no_grad():
        full, sub = draft(ids).logits, cut(ids).logits
    kept = torch.tensor(sorted([*keep, 2]))
    torch.testing.assert_close(sub[..., kept], full[..., kept])
    others = torch.ones(40, dtype=torch.bool)
    others[kept] = False
    assert bool(torch.isinf(sub[..., others]).all())
    with pytest.raises(DraftsmithError, match="0..39"):
        SubsetHeadDraft(draft, [40])


@pytest.mark.parametrize("shape", [None, "2,1,1", "3,2,1:6"])  # a chain, a fixed tree, a dynamic tree
def test_greedy_output_unchanged_with_a_cut_head(shape):
    target = tiny_llama(vocab=64, layers=2, hidden=32, sharpness=3.0)
    draft = SubsetHeadDraft(noisy_copy(target, 0.3), list(range(0, 64, 2)))
    prompt = [0, 5, 9, 33]
    want, _ = target_generate(target, [prompt], 40)
    options = DecodeOptions(gamma=3) if shape is None else DecodeOptions(tree=TreeShape.parse(shape))
    got, stats = speculative_generate(target, draft, [prompt], 40, options=options)
    assert got == want
    assert stats.accepted > 0


def test_sampling_stays_exact_with_a_cut_head():
    target = tiny_llama(vocab=12, sharpness=3.0, seed=0)
    draft = SubsetHeadDraft(noisy_copy(target, noise=0.5), [0, 1, 2, 3, 5, 8])
    params = SamplingParams(temperature=1.0)
    a, b, stats = sample_spec(target, draft, params, 3)
    assert_fits(target, params, a, b)
    assert 0 < stats.accepted < stats.proposed
