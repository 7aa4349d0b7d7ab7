"""Lookup guesses in paused rounds: the guess is the token after the latest repeat of the sequence's
last n-gram; verified in the row a row-exact pause pads anyway, kept only where the target agrees."""

import itertools
import time

import pytest
import torch

from draftsmith.distill.drafts import KINDS
from draftsmith.distill.drafts.kind import DraftSettings
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.lookup import lookup_continuation, with_guesses
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer
from draftsmith.specdec.proposal import Proposal
from draftsmith.specdec.verify import TargetVerifier
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_longest_repeated_ngram_wins_and_its_latest_occurrence():
    # last 3 tokens (7, 8, 9) occurred at 1..3 and were followed by 4; the bigram (8, 9) also at 6..7 (then 5)
    assert lookup_continuation([6, 7, 8, 9, 4, 1, 8, 9, 5, 7, 8, 9], 1) == ([4], 3)
    # no trigram repeat: the bigram (8, 9) last occurred before 5
    assert lookup_continuation([6, 8, 9, 4, 1, 8, 9, 5, 2, 8, 9], 1) == ([5], 2)
    # only the last token repeats: what followed its latest earlier occurrence
    assert lookup_continuation([3, 1, 3, 2, 5, 3], 1) == ([2], 1)
    assert lookup_continuation([1, 2, 3], 1) == ([], 0)  # nothing repeats
    assert lookup_continuation([4], 1) == ([], 0) and lookup_continuation([], 1) == ([], 0)
    assert lookup_continuation([5, 5], 1) == ([5], 1)  # a run guesses itself
    assert lookup_continuation([1, 2, 3, 1, 2, 3, 1, 2], 1, max_ngram=1) == ([3], 1)


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


class RowClock:
    """``time.perf_counter`` for the decoder's clock: a millisecond per read, plus ``step`` seconds for
    each verification forward and ``row`` for each input row it carries beyond the first, whatever
    the machine does (``verify`` is wrapped to add them)."""

    def __init__(self, step: float, row: float):
        self.now, self.step, self.row = 0.0, step, row

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now

    def wrap(self, verify):
        def timed_verify(verifier, inputs, valid, reusable=None):
            self.now += self.step + self.row * (inputs.shape[1] - 1)
            return verify(verifier, inputs, valid, reusable)

        return timed_verify


@pytest.mark.parametrize("kind", ["lm", "eagle3"])
def test_guesses_follow_the_measured_cost_of_a_verification_row(monkeypatch, kind):
    # The same decoding, once on a clock where a verification row costs little beside a step and once
    # where it costs two steps (a guess can then never pay: k guesses emit at most k tokens for 2k
    # steps). The pacer prices guesses from the forwards it timed, so the first verifies many and the
    # second none; the output is the target's either way.
    target = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    prompt = [[0, 5, 9, 4, 5, 9, 4, 5, 9, 4]]
    expected = target_generate(target, prompt, 40)[0]
    options = {"eagle3": {"aux_layers": [1, 2, 3]}}
    torch.manual_seed(0)
    settings = DraftSettings(kind=kind, layers="1", options=options.get(kind, {}))
    draft = KINDS[kind].build(settings, target, tiny_tokenizer(32), target.device).eval()
    counts = {}
    for name, row in (("cheap", 0.01), ("dear", 2.0)):
        clock = RowClock(step=1.0, row=row)
        monkeypatch.setattr(time, "perf_counter", clock)
        monkeypatch.setattr(TargetVerifier, "verify", clock.wrap(TargetVerifier.verify))  # both kinds verify with it
        out, stats = speculative_generate(target, draft, prompt, 40, DecodeOptions(gamma=2, pace=True))
        monkeypatch.undo()
        assert out == expected, name
        counts[name] = stats
    assert counts["cheap"].guesses_accepted >= 10  # 12 of 13 (lm), 15 of 20 (eagle3)
    assert counts["dear"].guesses == 0 and counts["dear"].lookup_rounds == 0
    # dear rows price drafting's wider verification too: most rounds are plain steps there
    assert counts["cheap"].seq_rounds < counts["dear"].seq_rounds and counts["dear"].paused > counts["cheap"].paused
