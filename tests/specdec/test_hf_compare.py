"""The transformers side of ``--compare-hf``: stock models, and exactly gamma draft tokens per round."""

import copy

import pytest

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.hf_compare import AssistedRounds, HFComparison, configure_assistant, hf_generate
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt
from draftsmith.specdec.sampling import SamplingParams
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

PROMPT = [0, 4, 9, 5, 6]
NEW_TOKENS = 20
NO_EOS = frozenset({31})  # never the argmax of these prompts, so no round ends on an EOS


def assisted_rounds(target, assistant):
    with AssistedRounds(target, assistant, max_length=len(PROMPT) + NEW_TOKENS, eos_ids=NO_EOS) as rounds:
        new = hf_generate(target, PROMPT, NEW_TOKENS, sampling=SamplingParams(0.0), eos_ids=NO_EOS, assistant=assistant)
    return new, rounds


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_configured_assistant_drafts_gamma_tokens_every_round(gamma):
    target = tiny_llama(sharpness=8.0)
    draft = noisy_copy(target, noise=0.3)
    configure_assistant(draft.generation_config, gamma)
    new, rounds = assisted_rounds(target, draft)
    assert len(new) == NEW_TOKENS
    drafted = [r.drafted for r in rounds.rounds]
    # Every round drafts gamma, except where fewer tokens are left to generate (transformers drafts
    # at most max_length - length - 1).
    assert drafted == [min(gamma, r.room) for r in rounds.rounds]
    assert drafted.count(gamma) >= 3 and rounds.short_rounds(gamma) == 0
    assert rounds.assistant_calls == sum(drafted)  # one assistant forward per drafted token
    rounds.check(gamma)


def test_unconfigured_assistant_is_caught():
    target = tiny_llama(sharpness=8.0)
    draft = noisy_copy(target, noise=0.3)  # transformers' defaults: 20 tokens, heuristic schedule, 0.4 cut
    _, rounds = assisted_rounds(target, draft)
    assert [r.drafted for r in rounds.rounds] != [min(3, r.room) for r in rounds.rounds]
    with pytest.raises(DraftsmithError, match="not 3: the assistant's generation_config must set"):
        rounds.check(3)


def test_compare_hf_times_stock_models_at_gamma():
    target = tiny_llama(sharpness=8.0)
    draft = noisy_copy(target, noise=0.3)
    stock = HFComparison(copy.deepcopy(target), copy.deepcopy(draft))  # made before the decoder runs
    turns = [[[{"role": "user", "content": f"w{4 + i} w{9 + i}"}]] for i in range(3)]
    prompts = [Prompt(id=str(i), category="chat", turns=t) for i, t in enumerate(turns)]
    settings = MeasureSettings(
        prompts, options=DecodeOptions(gamma=3), max_new_tokens=16, eos_ids=NO_EOS, repeats=1, progress=False
    )
    report = evaluate_pair(target, draft, tiny_tokenizer(), settings, compare_hf=stock, tune_verify=False)
    # The bundled decoder switched its own models to row-exact attention; the stock copies kept sdpa.
    assert target.config._attn_implementation != "sdpa" and draft.config._attn_implementation != "sdpa"
    assert stock.target.config._attn_implementation == stock.assistant.config._attn_implementation == "sdpa"
    assert stock.assistant.generation_config.num_assistant_tokens == 3
    assert stock.assistant.generation_config.num_assistant_tokens_schedule == "constant"
    assert stock.assistant.generation_config.assistant_confidence_threshold == 0
    assert report.hf.drafted_per_round == 3.0
    assert report.hf.assisted_rounds == len(stock.rounds) > 3 * 3
    assert report.hf.generate_tokens_per_s > 0 and report.hf.assisted_tokens_per_s > 0
