"""Lookup guesses in paused rounds: the guess is the token after the latest repeat of the sequence's
last n-gram; verified in the row a row-exact pause pads anyway, kept only where the target agrees."""

import itertools

import pytest
import torch

from draftsmith.distill.drafts import KINDS
from draftsmith.distill.drafts.kind import DraftSettings
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.lookup import lookup_guess, with_guesses
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer
from draftsmith.specdec.proposal import Proposal
from tests.helpers import noisy_copy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_longest_repeated_ngram_wins_and_its_latest_occurrence():
    # last 3 tokens (7, 8, 9) occurred at 1..3 and were followed by 4; the bigram (8, 9) also at 6..7 (then 5)
    assert lookup_guess([6, 7, 8, 9, 4, 1, 8, 9, 5, 7, 8, 9]) == 4
    # no trigram repeat: the bigram (8, 9) last occurred before 5
    assert lookup_guess([6, 8, 9, 4, 1, 8, 9, 5, 2, 8, 9]) == 5
    # only the last token repeats: what followed its latest earlier occurrence
    assert lookup_guess([3, 1, 3, 2, 5, 3]) == 2
    assert lookup_guess([1, 2, 3]) is None  # nothing repeats
    assert lookup_guess([4]) is None and lookup_guess([]) is None
    assert lookup_guess([5, 5]) == 5  # a run guesses itself
    assert lookup_guess([1, 2, 3, 1, 2, 3, 1, 2], max_ngram=1) == 3


def test_guesses_fill_only_rows_that_proposed_nothing_with_q_one_hot():
    # rows 0 and 2 drafted 2 and 1 tokens from q; row 1 was paused, row 3 paused without a guess
    probs = torch.full((4, 2, 10), 0.1)
    proposal = Proposal(torch.tensor([[3, 4], [0, 0], [5, 0], [0, 0]]), probs, torch.tensor([2, 0, 1, 0]))
    guessed_proposal, guessed = with_guesses(proposal, [None, 7, None, None])
    assert guessed.tolist() == [False, True, False, False]
    assert guessed_proposal.tokens.tolist() == [[3, 4], [7, 0], [5, 0], [0, 0]]
    assert guessed_proposal.counts.tolist() == [2, 1, 1, 0]
    assert guessed_proposal.probs[1, 0].tolist() == [0.0] * 7 + [1.0] + [0.0] * 2
    assert torch.equal(guessed_proposal.probs[0], probs[0]) and torch.equal(proposal.probs, torch.full((4, 2, 10), 0.1))
    # a round where nobody drafted gets a column for the guesses; greedy proposals keep q implicit (one-hot)
    empty = Proposal(torch.zeros(2, 0, dtype=torch.long), None, torch.tensor([0, 0]))
    widened, guessed = with_guesses(empty, [None, 9])
    assert widened.tokens.tolist() == [[0], [9]] and widened.counts.tolist() == [0, 1] and widened.probs is None
    assert with_guesses(empty, [None, None])[0] is empty
    with pytest.raises(ValueError, match="proposed nothing"):
        with_guesses(proposal, [1, None, None, None])


def test_paused_rounds_verify_guesses_and_stay_greedy_identical(monkeypatch):
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    prompts = [[0, 5, 9, 4, 5, 9, 4, 5], [0, 7, 3, 7, 3, 7]]  # repetitive: lookups find their n-grams
    expected = target_generate(target, prompts, 24)[0]
    draft = noisy_copy(target, 3.0)

    def run(pause_guess: bool):
        schedule = itertools.cycle([True, False, False, False])
        monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: next(schedule))
        options = DecodeOptions(gamma=2, pace=True, pause_guess=pause_guess)
        return speculative_generate(target, draft, prompts, 24, options)

    out, stats = run(True)
    plain_out, plain = run(False)
    assert out == expected and plain_out == expected
    assert plain.guesses == 0 and stats.guesses > 0 and stats.paused > 0
    assert 0 < stats.guesses_accepted <= stats.guesses  # the target kept some
    # kept guesses are tokens a round emitted beyond its own one: the answer took fewer rounds
    assert stats.seq_rounds < plain.seq_rounds
    # alpha counts the draft's proposals only
    assert stats.proposed == sum(p for p, _ in stats.round_counts)
    assert stats.accepted == sum(a for _, a in stats.round_counts)
    assert stats.round_tokens == stats.seq_rounds + stats.accepted + stats.guesses_accepted


def test_no_guess_without_room_for_two_tokens_or_for_a_drafter_that_reuses_its_states(monkeypatch):
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: False)
    prompt = [[0, 5, 9, 4, 5, 9, 4, 5]]
    options = DecodeOptions(gamma=2, pace=True)
    # two new tokens: the prompt's forward gives the first, the one round has room for one more only
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), prompt, 2, options)
    assert out == target_generate(target, prompt, 2)[0] and stats.rounds == 1 and stats.guesses == 0
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), prompt, 12, options)
    assert out == target_generate(target, prompt, 12)[0] and stats.guesses > 0
    # an early-exit draft's verification starts from the shared layers' states it computed itself
    early_exit = KINDS["early_exit"].build(DraftSettings(kind="early_exit", layers="1"), target, None, target.device)
    out, stats = speculative_generate(target, early_exit.eval(), prompt, 12, options)
    assert out == target_generate(target, prompt, 12)[0] and stats.paused > 0 and stats.guesses == 0
