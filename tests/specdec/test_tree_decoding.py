"""Tree speculative decoding (``specdec.tree_drafting``) is exact: greedy output is the target's own,
sampled output is distributed as the target's, and after a round both caches hold exactly the
accepted sequence.

The sampled reference is each sequence's own conditionals under the target, processed in float64 by
the tests' own temperature / top-k / top-p (``helpers.reference_probs``), not by the decoder.
"""

import functools

import pytest
import torch

from draftsmith.distill.drafts.early_exit import EarlyExitDraft
from draftsmith.specdec import tree_drafting
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.drafters import LMDrafter
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams, choose_token
from draftsmith.specdec.stream import ModelStream
from draftsmith.specdec.tree import TreeShape, accept_tree_sampled
from draftsmith.specdec.verify import TargetVerifier
from tests.helpers import fit_scores, noisy_copy, target_conditionals, tiny_llama

PROMPTS = ([0, 5, 9], [0, 3, 3, 7, 2, 11, 4, 8], [0, 17] * 9)
SHAPES = ("3,2,1,1", "2,2,2", "1,1,1,1", "3,2,2,1:10", "4,2,2:6")


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, sharpness=4.0)
    return target, noisy_copy(target, 0.4)


def _tree(text: str, **fields) -> DecodeOptions:
    return DecodeOptions(tree=TreeShape.parse(text), **fields)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_output_is_the_targets(pair, shape):
    target, draft = pair
    for prompt in PROMPTS:
        for length in (1, 3, 40):
            want, _ = target_generate(target, [prompt], length)
            got, stats = speculative_generate(target, draft, [prompt], length, options=_tree(shape))
            assert got == want, (prompt, length)
    assert 0 < stats.accepted < stats.proposed
    assert stats.tree_nodes == stats.proposed


def test_a_draft_equal_to_the_target_accepts_the_full_depth_every_round(pair):
    target, _ = pair
    want, _ = target_generate(target, [PROMPTS[1]], 31)
    got, stats = speculative_generate(target, target, [PROMPTS[1]], 31, options=_tree("3,2,1,1"))
    assert got == want
    # 30 tokens after the prefill's first: 6 rounds of depth 4 plus the target's token = 5 each
    assert (stats.rounds, stats.accepted, stats.round_tokens) == (6, 24, 30)
    assert stats.tree_nodes == 6 * (3 + 6 + 6 + 6)
    assert stats.mean_accepted_tokens == 5.0
    assert stats.nodes_per_round == 21.0
    # draft forwards: a catch-up forward giving level 1, then levels 1..3 fed; plus the prefill
    assert stats.draft_forwards == 1 + 6 * 4


def test_dynamic_tree_keeps_the_budget(pair):
    target, draft = pair
    _, stats = speculative_generate(target, draft, [PROMPTS[2]], 40, options=_tree("3,2,2,1:7"))
    assert stats.tree_nodes <= 7 * stats.rounds
    assert stats.nodes_per_round > 3


def test_max_new_tokens_and_eos_inside_an_accepted_path(pair):
    target, _ = pair
    full, _ = target_generate(target, [PROMPTS[0]], 12)
    eos = full[0][6]  # the 7th token: inside the second round's accepted path (rounds emit 5)
    want, _ = target_generate(target, [PROMPTS[0]], 12, eos_ids={eos})
    got, stats = speculative_generate(target, target, [PROMPTS[0]], 12, options=_tree("3,2,1,1"), eos_ids={eos})
    assert got == want
    assert got[0][-1] == eos and len(got[0]) == full[0].index(eos) + 1
    for length in (2, 4, 7):
        got, stats = speculative_generate(target, target, [PROMPTS[0]], length, options=_tree("3,2,1,1"))
        assert got == [full[0][:length]]
        assert stats.round_tokens == length - 1


def _prefilled(model, tokens: list[int]) -> ModelStream:
    stream = ModelStream(model, 1, 64, "slot")
    x = torch.tensor([tokens])
    stream.forward(x, torch.ones_like(x, dtype=torch.bool))
    return stream


def _assert_cache_holds(stream: ModelStream, model, tokens: list[int]) -> None:
    fresh = _prefilled(model, tokens)
    assert stream.lengths == [len(tokens)] and stream.tracker.length == len(tokens)
    for layer, want in zip(stream.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(layer.keys[:, :, : len(tokens)], want.keys[:, :, : len(tokens)])
        torch.testing.assert_close(layer.values[:, :, : len(tokens)], want.values[:, :, : len(tokens)])


@pytest.mark.parametrize("shape", ["3,2,1,1", "3,2,2,1:8"])
def test_after_a_commit_both_caches_equal_a_fresh_prefill_of_the_accepted_sequence(pair, shape):
    target, draft = pair
    verifier, drafter = TargetVerifier(target, 1, 64, "slot", widths={}), LMDrafter(draft, 1, 64, "slot")
    sequence = list(PROMPTS[1])
    x = torch.tensor([sequence])
    drafter.prefill(x, torch.ones_like(x, dtype=torch.bool))
    prefilled = verifier.prefill(x, torch.ones_like(x, dtype=torch.bool)).logits[:, -1]
    sequence.append(int(choose_token(prefilled, SamplingParams())))
    paths = []
    with torch.inference_mode():
        for _ in range(4):
            tree = drafter.propose_tree(sequence, TreeShape.parse(shape), max_depth=4)
            logits = verifier.verify_tree(sequence[-1], tree).logits[0]
            path, token = tree_drafting.accept_tree(tree, logits, SamplingParams(), None)
            verifier.commit_tree(tree, path)
            drafter.commit_tree(tree, path)
            drafter_read = len(sequence) + len([n for n in path if n in tree.slots])
            sequence += [tree.tokens[n] for n in path] + [token]
            paths.append(len(path))
            _assert_cache_holds(verifier.stream, target, sequence[:-1])
            _assert_cache_holds(drafter.stream, draft, sequence[:drafter_read])
    assert max(paths) >= 2  # some rounds compacted a path of several nodes


def test_bad_tree_settings_are_clear_errors(pair):
    target, draft = pair
    with pytest.raises(DraftsmithError, match="one prompt at a time"):
        speculative_generate(target, draft, [[0, 4], [0, 5]], 4, options=_tree("2,1"))
    with pytest.raises(DraftsmithError, match="a token tree is drafted on the draft's own cache"):
        reuse = {"kv_reuse": True}  # an early-exit draft on the target's cache drafts chains only
        speculative_generate(target, EarlyExitDraft(target, 1), [[0, 4]], 4, options=_tree("2,1", draft_options=reuse))
    with pytest.raises(DraftsmithError, match="tree must be a TreeShape"):
        DecodeOptions(tree="3,2,1")
    with pytest.raises(DraftsmithError, match="--tree takes"):
        TreeShape.parse("3,x")


def test_an_early_exit_draft_drafts_trees_on_its_own_cache(pair):
    target, _ = pair
    want, _ = target_generate(target, [PROMPTS[1]], 20)
    for options in ({}, {"kv_reuse": False}):  # by default a tree is drafted standalone
        got, stats = speculative_generate(
            target, EarlyExitDraft(target, 1), [PROMPTS[1]], 20, options=_tree("2,2,1", draft_options=options)
        )
        assert got == want
        assert stats.accepted > 0


# Sampling: one prompt, batch 1 per call (trees decode one sequence), three positions checked.
V = 12
PROMPT = [0, 4, 9]
FIT = 3
SAMPLES = 1500


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(vocab=V, sharpness=3.0, seed=0)
    return target, noisy_copy(target, noise=0.3)


def _sample_tree(target, draft, params, shape: str, seed: int) -> tuple[torch.Tensor, int, int]:
    generator = torch.Generator().manual_seed(seed)
    options = _tree(shape, sampling=params)
    rows, accepted, proposed = [], 0, 0
    for _ in range(SAMPLES):
        out, stats = speculative_generate(target, draft, [PROMPT], FIT, options=options, generator=generator)
        rows.append(out[0])
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    return torch.tensor(rows), accepted, proposed


def _fit(target, params, samples) -> dict[str, float]:
    return fit_scores(samples, target_conditionals(target, PROMPT, samples, params))


@pytest.mark.parametrize(
    ("params", "shape"),
    [
        (SamplingParams(1.0), "3,2"),
        (SamplingParams(0.7, top_k=5), "3,1"),
        (SamplingParams(1.3, top_p=0.8), "2,2:3"),
    ],
    ids=["t1-fixed", "t0.7-k5-fixed", "t1.3-p0.8-dynamic"],
)
def test_sampled_output_fits_the_target(small_pair, params, shape):
    target, draft = small_pair
    samples, accepted, proposed = _sample_tree(target, draft, params, shape, seed=1)
    scores = _fit(target, params, samples)
    assert max(scores.values()) < 4, scores
    assert 0 < accepted < proposed


def test_siblings_accepted_without_renormalizing_fail_the_fit(small_pair, monkeypatch):
    target, draft = small_pair
    broken = functools.partial(accept_tree_sampled, renormalize=False)
    monkeypatch.setattr(tree_drafting, "accept_tree_sampled", broken)
    params = SamplingParams(1.0)
    samples, _, _ = _sample_tree(target, draft, params, "3,2", seed=1)
    assert max(_fit(target, params, samples).values()) > 6
