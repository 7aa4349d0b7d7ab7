"""Lookup guesses in paused rounds: the guess is the token after the latest repeat of the sequence's
last n-gram; verified in the row a row-exact pause pads anyway, kept only where the target agrees."""

import itertools

import pytest
import torch

from draftsmith.distill.drafts import KINDS
from draftsmith.distill.drafts.kind import DraftSettings
from draftsmith.specdec.decoder import speculative_generate, target_generate, verifies_guesses
from draftsmith.specdec.drafters import LMDrafter
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.lookup import lookup_continuation, lookup_guess, with_guesses
from draftsmith.specdec.matmul import use_column_products
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer
from draftsmith.specdec.proposal import Proposal
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

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


def test_the_continuation_is_what_followed_the_match_up_to_the_length_asked():
    sequence = [6, 7, 8, 9, 4, 1, 8, 9, 5, 7, 8, 9]
    assert lookup_continuation(sequence, 3) == ([4, 1, 8], 3)  # after the trigram (7, 8, 9) at 1..3
    assert lookup_continuation(sequence, 1) == ([4], 3) and lookup_continuation(sequence, 0) == ([], 0)
    assert lookup_continuation([5, 1, 2, 5], 4) == ([1, 2, 5], 1)  # it stops where the sequence does
    # a run: the latest occurrence of (3, 3, 3) is followed by one token, an earlier one by three
    assert lookup_continuation([1, 3, 3, 3, 3, 3, 3], 3) == ([3, 3, 3], 3)
    assert lookup_continuation([1, 2, 1, 2, 1], 3) == ([2, 1], 3)  # no occurrence of (1, 2, 1) followed by three
    assert lookup_continuation([1, 2, 3], 2) == ([], 0)


def test_guesses_follow_each_rows_proposed_tokens_with_q_one_hot():
    # rows 0 and 2 drafted 2 and 1 tokens from q; row 1 was paused, row 3 paused without a guess
    probs = torch.full((4, 2, 10), 0.1)
    confidence = torch.full((4, 2), 0.4)
    tokens, counts = torch.tensor([[3, 4], [0, 0], [5, 6], [0, 0]]), torch.tensor([2, 0, 1, 0])
    proposal = Proposal(tokens, probs, counts, None, confidence)
    guessed = with_guesses(proposal, [[8], [7, 2], [9, 1], []])
    assert guessed.tokens.tolist() == [[3, 4, 8], [7, 2, 0], [5, 9, 1], [0, 0, 0]]
    assert guessed.counts.tolist() == [3, 2, 3, 0]
    one_hot = lambda token: [0.0] * token + [1.0] + [0.0] * (9 - token)  # noqa: E731
    assert guessed.probs[0, 2].tolist() == one_hot(8) and guessed.probs[2, 1].tolist() == one_hot(9)
    assert guessed.probs[1, 0].tolist() == one_hot(7) and guessed.probs[1, 1].tolist() == one_hot(2)
    assert torch.equal(guessed.probs[0, :2], probs[0]) and torch.equal(proposal.probs, torch.full((4, 2, 10), 0.1))
    assert guessed.confidence.tolist()[0] == pytest.approx([0.4, 0.4, 0.0])  # the draft's own, guesses none
    assert proposal.counts.tolist() == [2, 0, 1, 0]  # the proposal itself is left as it was
    # a round where nobody drafted gets columns for the guesses; greedy proposals keep q implicit (one-hot)
    empty = Proposal(torch.zeros(2, 0, dtype=torch.long), None, torch.tensor([0, 0]))
    widened = with_guesses(empty, [[], [9]])
    assert widened.tokens.tolist() == [[0], [9]] and widened.counts.tolist() == [0, 1] and widened.probs is None
    assert with_guesses(empty, [[], []]) is empty
    with pytest.raises(DraftsmithError, match="guess_tokens must be an integer >= 1"):
        DecodeOptions(guess_tokens=0)


def test_paused_rounds_verify_guesses_and_stay_greedy_identical(monkeypatch):
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    prompts = [[0, 5, 9, 4, 5, 9, 4, 5], [0, 7, 3, 7, 3, 7]]  # repetitive: lookups find their n-grams
    expected = target_generate(target, prompts, 24)[0]
    draft = noisy_copy(target, 3.0)

    def run(guesses: bool, guess_tokens: int = 2):
        schedule = itertools.cycle([True, False, False, False])
        monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: next(schedule))
        options = DecodeOptions(gamma=2, pace=True, guesses=guesses, guess_tokens=guess_tokens)
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
    # one guess token a round against four: fewer verified and kept, the output the same
    out, one = run(True, guess_tokens=1)
    assert out == expected
    out, four = run(True, guess_tokens=4)
    assert out == expected and four.guesses > one.guesses and four.guesses_accepted > one.guesses_accepted
    assert four.seq_rounds < one.seq_rounds


def test_drafting_rounds_verify_guesses_after_the_chain_for_every_kind_that_takes_them(monkeypatch):
    # Never paused: guesses follow a drafted chain or take a round's place, and the drafter must read
    # the kept guesses (committed tokens it never proposed) before its next proposal.
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: True)
    prompt = [[0, 5, 9, 4, 5, 9, 4, 5, 9, 4]]
    expected = target_generate(target, prompt, 24)[0]
    masked = {"mask_token_id": 31}
    kind_options = {"eagle3": {"aux_layers": [1, 2, 3]}, "parallel": masked, "dflash": masked}
    for name, kind in KINDS.items():
        torch.manual_seed(0)
        settings = DraftSettings(kind=name, layers="1", options=kind_options.get(name, {}))
        draft = kind.build(settings, target, tiny_tokenizer(32), target.device).eval()
        for gamma in (1, 3):
            options = DecodeOptions(gamma=gamma, pace=True, guesses=True)
            out, stats = speculative_generate(target, draft, prompt, 24, options)
            assert out == expected, (name, gamma)
            assert stats.paused == 0
            assert stats.round_tokens == stats.seq_rounds + stats.accepted + stats.guesses_accepted
            if name == "early_exit":
                assert stats.guesses == 0 and stats.lookup_rounds == 0
            else:
                assert stats.guesses > 0 and (gamma > 1 or stats.guesses_accepted > 0), (name, gamma)
                # where the text repeats two tokens or more the round verifies their continuation instead
                assert 0 < stats.lookup_rounds < stats.rounds, (name, gamma)
                assert stats.proposed == sum(p for p, _ in stats.round_counts) <= gamma * stats.rounds


def test_no_guess_without_room_for_two_tokens_or_for_a_drafter_that_reuses_its_states(monkeypatch):
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: False)
    prompt = [[0, 5, 9, 4, 5, 9, 4, 5]]
    options = DecodeOptions(gamma=2, pace=True, guesses=True)
    # two new tokens: the prompt's forward gives the first, the one round has room for one more only
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), prompt, 2, options)
    assert out == target_generate(target, prompt, 2)[0] and stats.rounds == 1 and stats.guesses == 0
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), prompt, 12, options)
    assert out == target_generate(target, prompt, 12)[0] and stats.guesses > 0
    # an early-exit draft's verification starts from the shared layers' states it computed itself
    early_exit = KINDS["early_exit"].build(DraftSettings(kind="early_exit", layers="1"), target, None, target.device)
    out, stats = speculative_generate(target, early_exit.eval(), prompt, 12, options)
    assert out == target_generate(target, prompt, 12)[0] and stats.paused > 0 and stats.guesses == 0


def test_guesses_are_on_by_default_where_a_one_token_step_already_runs_two_rows():
    # bfloat16 pads a one-token step to two rows, and the float32 column form multiplies it as two
    # columns, so a guess rides where little more is paid; with torch's float32 linear a CPU's two-row
    # verification can cost far more than a step, so the default leaves guesses out
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    drafter = LMDrafter(noisy_copy(target, 3.0), 1, 64, "slot")
    paced = DecodeOptions(gamma=1, pace=True)
    assert not verifies_guesses(target, drafter, paced)
    assert verifies_guesses(target, drafter, DecodeOptions(gamma=1, pace=True, guesses=True))
    assert verifies_guesses(tiny_llama(vocab=32, layers=4).to(torch.bfloat16), drafter, paced)
    columns = tiny_llama(vocab=32, layers=4)
    use_column_products(columns, True)
    assert verifies_guesses(columns, drafter, paced)
    assert not verifies_guesses(columns, drafter, DecodeOptions(gamma=1, pace=True, guesses=False))
    assert not verifies_guesses(target, drafter, DecodeOptions(gamma=1, pace=True, guesses=False))
    assert not verifies_guesses(target, drafter, DecodeOptions(gamma=1, guesses=True))  # unpaced: every round drafts
    assert not verifies_guesses(target, drafter, DecodeOptions(gamma=1, pace=True, guesses=True, exact_pauses=False))
    prompt = [[0, 5, 9, 4, 5, 9, 4, 5, 9, 4]]
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), prompt, 16, paced)
    assert out == target_generate(target, prompt, 16)[0] and stats.guesses == 0 and stats.lookup_rounds == 0
