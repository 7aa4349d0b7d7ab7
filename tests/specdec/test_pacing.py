"""Pacing: a sequence stops drafting where drafting does not pay, tries again now and then, and the
output stays the target's for every kind of draft."""

import itertools
import random
import time

import pytest
import torch

from draftsmith.distill.drafts import KINDS
from draftsmith.distill.drafts.kind import DraftSettings
from draftsmith.specdec.decoder import remembered, speculative_generate, target_generate
from draftsmith.specdec.drafters import LMDrafter
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import CALIBRATED_AFTER, Average, PaceMemory, Pacer, PaceSettings, expected_tokens
from draftsmith.specdec.proposal import draft_chain
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.verify import TargetVerifier
from tests.helpers import assert_fits, noisy_copy, sample_spec, tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[0, 5, 9, 4], [0, 7], [0, 3, 3, 8, 2, 6, 11, 2]]


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(vocab=32, layers=4, sharpness=8.0)
    model.name_or_path = "tests/tiny-llama"
    return model


class TickClock:
    """``time.perf_counter`` advancing one tick per read: every lap of the decoder's clock is one tick,
    so a drafting round costs two (draft, verify) and a plain round one, whatever the machine does."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def timed_pacer(
    gamma: int,
    draft: float,
    verify: float,
    step: float | None,
    alpha_counts=(0.0, 0.0),
    guess_tokens=0,
    forced=False,
    **settings,
) -> Pacer:
    """A pacer that has timed a drafting round (``draft`` seconds to the verification, whose forward over
    gamma + 1 rows took ``verify``) and, unless ``step`` is None, a plain one-row forward of ``step``."""
    pacer = Pacer(gamma, 1, PaceSettings(**settings), guess_tokens, forced)
    pacer.draft_s.add(draft)
    pacer.forward_s[gamma + 1] = Average(value=verify)
    if step is not None:
        pacer.forward_s[1] = Average(value=step)
    pacer.accepted[0], pacer.rejected[0] = alpha_counts
    return pacer


def test_drafting_pays_when_expected_tokens_outrun_its_cost():
    # gamma 4: alpha 0.5 gives 1.9375 tokens a round; the round costs 0.4 + 1.2 = 1.6 steps of 1.0.
    assert expected_tokens(0.5, 4) == pytest.approx(1.9375)
    # counts (1, 1) plus the prior's (0.5, 1): alpha 1.5 / 3.5 gives 1.72 tokens, more than 1.6.
    assert timed_pacer(4, 0.4, 1.2, 1.0, (1.0, 1.0)).alpha(0) == pytest.approx(1.5 / 3.5)
    assert timed_pacer(4, 0.4, 1.2, 1.0, (1.0, 1.0)).drafting_pays(0)
    # counts (1, 3): alpha 1.5 / 5.5 gives 1.37 tokens for the same 1.6 steps: a plain step is faster.
    assert not timed_pacer(4, 0.4, 1.2, 1.0, (1.0, 3.0)).drafting_pays(0)
    # Before a plain step is timed, the step is taken as costly as a verification (1.2): alpha 3/7
    # pays 1.72 * 1.2 = 2.07 against 1.6, which a margin of 1 lets draft on; with the default margin,
    # 1.5 (1.5 * 1.6 = 2.4), the next round is a plain one that times the step, and alpha 4.5 / 5.5
    # (3.49 * 1.2 = 4.2) drafts on without it. Counts (1, 5): 1.5 / 7.5 gives 1.25 tokens, 1.5 < 1.6.
    assert timed_pacer(4, 0.4, 1.2, None, (1.0, 1.0), margin=1.0).drafting_pays(0)
    assert not timed_pacer(4, 0.4, 1.2, None, (1.0, 5.0), margin=1.0).drafting_pays(0)
    assert not timed_pacer(4, 0.4, 1.2, None, (1.0, 1.0)).drafting_pays(0)
    assert timed_pacer(4, 0.4, 1.2, None, (4.0, 0.0)).drafting_pays(0)
    # Before any round is timed every sequence drafts; its estimate is the prior's.
    fresh = Pacer(4, batch_size=1)
    assert fresh.drafting_pays(0) and fresh.alpha(0) == pytest.approx(1 / 3)


def test_a_few_unlucky_rounds_do_not_pause_a_draft_that_pays():
    # gamma 1, c 0.13, v 1.0: drafting pays above alpha 0.13. A sequence that has seen acceptance 0.3
    # over 20 rounds keeps drafting through 5 rejections in a row (its estimate is still 0.22); one
    # that never agreed is paused after its third rejection (decayed to 2.91: 0.5 / 4.41 < 0.13,
    # where after two, 0.5 / 3.47 still pays).
    pacer = timed_pacer(1, 0.13, 1.0, 1.0)
    for kept in [1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0] + [0] * 5:
        pacer.record([0], torch.tensor([1]), torch.tensor([kept]), draft_s=0.13, verify_s=1.0, rows=2)
    assert pacer.alpha(0) == pytest.approx(0.2166, abs=1e-4) and pacer.drafting_pays(0)
    never = timed_pacer(1, 0.13, 1.0, 1.0)
    paused_after = None
    for rounds in range(1, 10):
        never.record([0], torch.tensor([1]), torch.tensor([0]), draft_s=0.13, verify_s=1.0, rows=2)
        if paused_after is None and not never.drafting_pays(0):
            paused_after = rounds
    assert paused_after == 3


def test_a_paused_sequence_probes_again_and_acceptance_is_decayed_counts():
    # a probe every 3 paused rounds, whatever came of them (no probe budget: the back-off alone)
    pacer = timed_pacer(2, 1.0, 1.0, 1.0, (0.0, 3.0), probe_every=3, backoff=1.0, probe_budget=0.0)
    assert [pacer.drafts([0])[0] for _ in range(8)] == [False, False, False, True, False, False, False, True]
    pacer.record([0], torch.tensor([2]), torch.tensor([2]), draft_s=1.0, verify_s=1.0, rows=3)
    # counts decay by 0.97 per drafting round: accepted 0 * 0.97 + 2, rejected 3 * 0.97 + 0, each
    # with the prior's (0.5, 1) added
    assert pacer.alpha(0) == pytest.approx((2 + 0.5) / (2 + 0.5 + 2.91 + 1))
    pacer.record([0], torch.tensor([0]), torch.tensor([0]), draft_s=0.0, verify_s=0.5, rows=1)
    # a plain round times the one-row forward, and its bookkeeping apart
    assert pacer.forward(1) == pytest.approx(0.7 * 1.0 + 0.3 * 0.5) and pacer.idle_s.value == 0.0


def test_rounds_are_compared_over_the_same_span_and_a_resumed_round_never_raises_the_draft_time():
    # A plain round's time is its lap from the previous verification (the bookkeeping every round
    # pays) plus its verification, as a drafting round's is: 0.1 + 1.0 here, not 1.0.
    pacer = timed_pacer(1, 0.3, 1.05, None, (0.0, 0.0))
    pacer.record([0], torch.tensor([0]), torch.tensor([0]), draft_s=0.1, verify_s=1.0, rows=1)
    assert pacer.idle_s.value + pacer.forward(1) == pytest.approx(1.1)
    # at the prior's 1/3 a round emits 1.333 tokens: 1.333 * 1.1 = 1.467 beats the drafting round's
    # 0.3 + 1.05 = 1.35, where the forward alone (1.333 * 1.0) would not have
    assert pacer.drafting_pays(0)
    pacer.rejected[0] = 10.0
    assert pacer.drafts([0]) == [False]
    pacer.paused_for[0] = pacer.probe_interval(0)
    assert pacer.drafts([0]) == [True] and pacer.resuming
    # the probe's draft forward also reads the paused rounds' tokens: 0.9 s leaves the estimate as
    # it was; a quick one lowers it
    pacer.record([0], torch.tensor([1]), torch.tensor([0]), draft_s=0.9, verify_s=1.05, rows=2)
    assert pacer.draft_s.value == pytest.approx(0.3)
    pacer.paused_for[0] = pacer.probe_interval(0)
    pacer.drafts([0])
    pacer.record([0], torch.tensor([1]), torch.tensor([0]), draft_s=0.1, verify_s=1.05, rows=2)
    assert pacer.draft_s.value == pytest.approx(0.7 * 0.3 + 0.3 * 0.1)
    # a drafting round after a drafting round counts as timed
    pacer.accepted[0] = 100.0
    assert pacer.drafts([0]) == [True] and not pacer.resuming
    pacer.record([0], torch.tensor([1]), torch.tensor([1]), draft_s=0.9, verify_s=1.05, rows=2)
    assert pacer.draft_s.value == pytest.approx(0.7 * 0.24 + 0.3 * 0.9)


def test_probes_that_find_drafting_still_not_paying_come_ever_later_until_one_pays():
    # backoff 2, probe_max 12: after probes that leave drafting not paying, 3, 6, 12, 12 paused rounds
    # come between them; a probe whose round makes drafting pay resets the interval to probe_every.
    pacer = timed_pacer(1, 0.13, 1.0, 1.0, (0.0, 5.0), probe_every=3, backoff=2.0, probe_max=12, probe_budget=0.0)
    gaps, paused = [], 0
    while len(gaps) < 4:
        if pacer.drafts([0])[0]:
            gaps.append(paused)
            paused = 0
            pacer.record([0], torch.tensor([1]), torch.tensor([0]), draft_s=0.13, verify_s=1.0, rows=2)
        else:
            paused += 1
    assert gaps == [3, 6, 12, 12]
    for _ in range(12):
        assert not pacer.drafts([0])[0]
    assert pacer.drafts([0])[0]  # the fifth probe is accepted many times over: drafting pays again
    pacer.record([0], torch.tensor([1]), torch.tensor([1]), draft_s=0.13, verify_s=1.0, rows=2)
    pacer.accepted[0] += 10.0
    assert pacer.drafts([0])[0] and pacer.probes[0] == 0
    pacer.rejected[0] += 100.0  # and it stops paying again: the next probe comes after probe_every
    assert [pacer.drafts([0])[0] for _ in range(4)] == [False, False, False, True]


def test_the_drafts_own_confidence_centres_the_prior():
    # gamma 1, c 0.13, v 1.0: drafting pays above alpha 0.13. The prior is 6 counts split as the
    # draft's mean probability of its verified tokens (decayed like the outcomes).
    def after(outcomes, sure, **settings):
        pacer = timed_pacer(1, 0.13, 1.0, 1.0, **settings)
        for kept in outcomes:
            pacer.record([0], torch.tensor([1]), torch.tensor([kept]), 0.13, 1.0, 2, torch.tensor([[sure]]))
        return pacer

    # A draft unsure of its token (0.05) whose first proposal is rejected: 0.3 / 7 = 0.043, paused
    # at once; the fixed prior would draft again (0.5 / 2.5 = 0.2).
    unsure = after([0], 0.05)
    assert unsure.alpha(0) == pytest.approx(0.3 / 7) and not unsure.drafting_pays(0)
    assert after([0], 0.05, confidence=0.0).drafting_pays(0)
    # A draft that gives its tokens 0.5 drafts on through three rejections in a row (3 / 8.91 = 0.34);
    # the fixed prior pauses it (0.5 / 4.41 = 0.11).
    sure = after([0, 0, 0], 0.5)
    assert sure.alpha(0) == pytest.approx(3 / (3 + 2.9127 + 3), abs=1e-4) and sure.drafting_pays(0)
    assert not after([0, 0, 0], 0.5, confidence=0.0).drafting_pays(0)
    # gamma 3: the tokens verification judged are the accepted ones and the first rejected (0.4 and
    # 0.2 here; the third, never judged, does not count), so the prior's centre is 0.3.
    chain = timed_pacer(3, 0.13, 1.0, 1.0)
    chain.record([0], torch.tensor([3]), torch.tensor([1]), 0.4, 1.0, 4, torch.tensor([[0.4, 0.2, 0.9]]))
    assert chain.prior(0) == pytest.approx((6 * 0.3, 6 * 0.7))
    # No confidence given (a drafter that does not report it): the fixed prior.
    plain = timed_pacer(3, 0.13, 1.0, 1.0)
    plain.record([0], torch.tensor([3]), torch.tensor([1]), 0.4, 1.0, 4)
    assert plain.prior(0) == (0.5, 1.0) and plain.alpha(0) == pytest.approx(1.5 / 3.5)


def test_a_paced_proposal_carries_the_drafts_probability_of_each_token():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    probs = logits.softmax(-1)

    def next_logits(token, active):
        return logits

    budget = torch.tensor([2, 1])
    greedy = draft_chain(next_logits, budget, DecodeOptions(gamma=2, pace=True), None)
    assert greedy.tokens[:, 0].tolist() == [0, 2]
    assert torch.allclose(greedy.confidence[:, 0], probs.max(-1).values)
    assert draft_chain(next_logits, budget, DecodeOptions(gamma=2), None).confidence is None
    sampling = DecodeOptions(gamma=2, pace=True, sampling=SamplingParams(temperature=1.0))
    sampled = draft_chain(next_logits, budget, sampling, torch.Generator().manual_seed(0))
    drawn = sampled.tokens[:, 0]
    assert torch.allclose(sampled.confidence[:, 0], probs.gather(-1, drawn[:, None])[:, 0])


def decode(target, draft, prompts, gamma, pace, guesses=True, **sampling):
    options = DecodeOptions(gamma=gamma, pace=pace, guesses=guesses, sampling=SamplingParams(**sampling))
    return speculative_generate(target, draft, prompts, 24, options, generator=torch.Generator().manual_seed(0))


def test_a_draft_that_never_agrees_is_paused_and_a_perfect_one_at_most_once(target, monkeypatch):
    monkeypatch.setattr(time, "perf_counter", TickClock())
    expected = target_generate(target, PROMPTS, 24)[0]
    bad = noisy_copy(target, 3.0)
    out, stats = decode(target, bad, PROMPTS, gamma=3, pace=True)
    assert out == expected
    unpaced = decode(target, bad, PROMPTS, gamma=3, pace=False)[1]
    assert stats.paused > 0 and unpaced.paused == 0
    assert stats.proposed < unpaced.proposed and stats.draft_forwards < unpaced.draft_forwards
    # A perfect draft is paused at most once per sequence (a plain round that times a step). Without
    # lookup guesses: these answers end in runs of one token, which guesses copy as well as it drafts.
    out, stats = decode(target, target, PROMPTS, gamma=3, pace=True, guesses=False)
    assert out == expected and stats.paused <= len(PROMPTS)
    assert stats.accepted == stats.proposed  # a draft equal to the target: every round emits gamma + 1


def every_kind(target) -> dict[str, torch.nn.Module]:
    """An untrained draft of each registered kind for the tiny target, built by the kind itself."""
    options = {"eagle3": {"aux_layers": [1, 2, 3]}, "parallel": {"mask_token_id": 31}, "dflash": {"mask_token_id": 31}}
    drafts = {}
    for name, kind in KINDS.items():
        torch.manual_seed(0)
        settings = DraftSettings(kind=name, layers="1", options=options.get(name, {}))
        drafts[name] = kind.build(settings, target, tiny_tokenizer(32), target.device).eval()
    return drafts


@pytest.mark.parametrize("gamma", [1, 3])
def test_every_kind_stays_greedy_identical_through_paused_rounds(target, monkeypatch, gamma):
    # Pause every other round after the first, whatever the figures: a drafter must catch up on the
    # tokens of paused rounds (and a draft sharing the target's cache must not miss them).
    schedule = itertools.cycle([True, False, True, True, False, False, True])
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: next(schedule))
    for name, draft in every_kind(target).items():
        for prompt in PROMPTS:  # one at a time: a draft sharing the target's cache decodes batch 1
            out, stats = decode(target, draft, [prompt], gamma=gamma, pace=True)
            assert out == target_generate(target, [prompt], 24)[0], name
            assert stats.paused > 0, name


@pytest.mark.parametrize("kind", ["eagle3", "parallel"])
def test_a_round_where_every_sequence_is_paused_runs_no_draft_forward(target, monkeypatch, kind):
    # Paused from the third round on (the pacer still probes now and then): the drafter keeps what the
    # verifier gives it and runs nothing until it drafts again (an EAGLE-3 head builds the waiting
    # rows in that proposal's first forward), so its layers run as often per drafting round as when
    # it is never paused. (A DFlash drafter projects each round's committed rows into its context
    # cache as they come, a few one-row projections; an LM reads its prompt before the first round.)
    draft = every_kind(target)[kind]
    layers = [m for m in draft.modules() if isinstance(m, torch.nn.Linear)]
    # probes every 4 paused rounds (no back-off): drafting rounds enough that the prompt's forward,
    # shared by all of them, weighs in both runs alike; no lookup guesses, which would change how
    # many rounds (and probes) the answer takes between the two runs
    options = DecodeOptions(
        gamma=2, pace=True, pace_settings=PaceSettings(backoff=1.0, probe_budget=0.0), guesses=False
    )

    def linear_calls_per_drafting_round(schedule) -> tuple[float, int]:
        monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: next(schedule))
        calls = []
        hooks = [m.register_forward_pre_hook(lambda module, args: calls.append(1)) for m in layers]
        try:
            out, stats = speculative_generate(target, draft, [PROMPTS[2]], 24, options)
        finally:
            for hook in hooks:
                hook.remove()
        assert out == target_generate(target, [PROMPTS[2]], 24)[0]
        return len(calls) / (stats.rounds - stats.paused), stats.paused

    paused_run, paused = linear_calls_per_drafting_round(itertools.chain([True, True], itertools.repeat(False)))
    drafting_run, none = linear_calls_per_drafting_round(itertools.repeat(True))
    assert paused >= 10 and none == 0
    assert paused_run <= 1.25 * drafting_run


def test_paused_sampling_is_distributed_as_the_target(target, monkeypatch):
    # Each sequence of the batch pauses at random rounds: ragged budgets, some rows verifying x_n alone.
    coin = random.Random(0)
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: coin.random() < 0.5)
    params = SamplingParams(temperature=1.0)
    first, second, stats = sample_spec(target, noisy_copy(target, 0.8), params, gamma=3, pace=True, guesses=True)
    assert stats.paused > 1000 and stats.proposed > 1000
    assert stats.guesses > 500  # rounds verify lookup guesses too, q one-hot beside rows drawn from q
    assert_fits(target, params, first, second)


def test_paused_rounds_keep_their_drafter_time_out_of_the_draft_step_cost(target, monkeypatch):
    # One tick per lap of the decoder's clock: every round's draft phase is one tick, drafting or not.
    # A round in which nothing drafts has no draft step, so its tick must not be charged to c's draft
    # time (for an early-exit draft that time is the target's own lower layers).
    monkeypatch.setattr(time, "perf_counter", TickClock())
    schedule = itertools.cycle([True, False, False])
    monkeypatch.setattr(Pacer, "drafting_pays", lambda self, seq: next(schedule))
    out, stats = decode(target, noisy_copy(target, 0.8), [PROMPTS[2]], gamma=3, pace=True)
    assert out == target_generate(target, [PROMPTS[2]], 24)[0]
    drafting_rounds = len(stats.round_counts)  # a round with no draft: paused, or no room left for one
    assert stats.paused > 0 and 0 < drafting_rounds <= stats.rounds - stats.paused
    assert stats.draft_time == pytest.approx(drafting_rounds)
    assert stats.paused_draft_time == pytest.approx(stats.rounds - drafting_rounds)


def test_pace_settings_are_decode_options_and_bad_ones_are_refused(target):
    # No back-off: a sequence whose draft never agrees probes every 4 paused rounds, not 4, 8, 16, 32.
    waits = {}
    for name, settings in (("back-off", PaceSettings()), ("none", PaceSettings(backoff=1.0))):
        pacer = Pacer(1, 1, settings)
        pacer.probes[0] = 3
        waits[name] = pacer.probe_interval(0)
    assert waits == {"back-off": 32, "none": 4}
    options = DecodeOptions(gamma=1, pace=True, pace_settings=PaceSettings(backoff=1.0))
    out, stats = speculative_generate(target, noisy_copy(target, 3.0), [PROMPTS[0]], 24, options)
    assert out == target_generate(target, [PROMPTS[0]], 24)[0] and stats.paused > 0
    for bad, message in (
        ({"probe_every": 0}, "probe_every must be an integer >= 1"),
        ({"decay": 1.5}, "decay must be in"),
        ({"prior": (-1.0, 1.0)}, "prior must be two counts"),
        ({"confidence": -1.0}, "confidence must be a count >= 0"),
        ({"backoff": 0.5}, "backoff must be >= 1"),
        ({"probe_every": 8, "probe_max": 4}, "probe_max \\(4\\) must be at least probe_every \\(8\\)"),
    ):
        with pytest.raises(DraftsmithError, match=message):
            PaceSettings(**bad)
    with pytest.raises(DraftsmithError, match="pace_settings must be a PaceSettings"):
        DecodeOptions(pace=True, pace_settings={"backoff": 1.0})


def test_widths_never_timed_are_interpolated_or_extrapolated_from_those_timed():
    pacer = Pacer(3, 1)
    assert pacer.forward(2) is None  # nothing timed yet
    pacer.forward_s[4] = Average(value=1.3)
    # one width timed: a narrower forward costs at most as much, a wider one is taken as no dearer
    assert pacer.forward(1) == 1.3 and pacer.forward(6) == 1.3
    pacer.forward_s[1] = Average(value=1.0)
    assert pacer.forward(2) == pytest.approx(1.1) and pacer.forward(3) == pytest.approx(1.2)
    assert pacer.forward(7) == pytest.approx(1.6)  # along the two widest: 0.1 a row
    pacer.forward_s[5] = Average(value=1.2)  # noise: never cheaper with more rows past the widest
    assert pacer.forward(7) == pytest.approx(1.2)


def test_continuations_are_settled_against_the_tokens_committed_after_them():
    pacer = Pacer(1, 2, guess_tokens=3)
    pacer.note(0, 4, [7, 8, 9], strong=True)
    pacer.settle(0, [1, 2, 3, 4, 7, 8], finished=False)  # not yet past the continuation: it waits
    assert pacer.gains[0].seen == 0 and len(pacer.pending[0]) == 1
    pacer.settle(0, [1, 2, 3, 4, 7, 8, 5], finished=False)  # two of three were the target's
    assert pacer.gains[0].hits == [1.0, 1.0, 0.0] and pacer.strong_gains[0].hits == [1.0, 1.0, 0.0]
    assert pacer.pending[0] == [] and pacer.guess_gain(0) == pytest.approx(2 / 2)  # one phantom round kept none
    assert pacer.guess_gain(0, guesses=1) == pytest.approx(1 / 2)
    pacer.note(1, 2, [3, 3], strong=False)
    pacer.settle(1, [0, 0, 3], finished=True)  # the answer ended after one of them
    assert pacer.gains[1].hits == [1.0, 0.0, 0.0] and pacer.strong_gains[1].seen == 0


def test_guess_rows_are_verified_where_their_cost_pays_and_not_where_it_does_not():
    # gamma 3; a one-row forward takes 1.0 s, a verification of 4 rows 1.15 s (rows cost 0.05 each)
    # or 2.8 s (0.6 each); the widths between are interpolated. The draft never agrees: paused.
    def pacer_with(rows_cost: float, counts=(0.0, 5.0)) -> Pacer:
        return timed_pacer(3, 0.4, 1.0 + 3 * rows_cost, 1.0, counts, guess_tokens=3, confidence=0.0)

    cheap, dear = pacer_with(0.05), pacer_with(0.6)
    assert cheap.forward(2) == pytest.approx(1.05) and dear.forward(2) == pytest.approx(1.6)
    for pacer in (cheap, dear):
        assert not pacer.drafting_pays(0) and pacer.paused_guesses(0, 3) == 0  # nothing kept yet: no guesses
        pacer.record_guess(0, 1, strong=False)  # a round whose continuation's first token was the target's
        assert pacer.guess_gain(0) == pytest.approx(0.5)  # with one phantom round that kept none
    # cheap rows: one guess emits 1.5 tokens for 1.05 s (1.43 a second), more than the plain round's 1.0;
    # dear rows: 1.5 tokens for 1.6 s (0.94) is less
    assert cheap.paused_guesses(0, 3) == 1 and dear.paused_guesses(0, 3) == 0
    # where every guess is kept (2.9 tokens of 3), three pay in both: 3.9 tokens for 1.15 s or 2.8 s
    for pacer in (cheap, dear):
        for _ in range(30):
            pacer.record_guess(0, 3, strong=False)
        assert pacer.paused_guesses(0, 3) == 3
    forced = timed_pacer(3, 0.4, 10.0, 1.0, guess_tokens=3, forced=True)  # DecodeOptions.guesses=True
    assert forced.paused_guesses(0, 3) == 3 and forced.lookup_guesses(0, 2) == 2 and forced.chain_guesses(0, 1, 1) == 1


def test_a_sequence_whose_text_repeats_itself_pauses_for_its_lookup_guesses():
    # gamma 1, alpha 2 / 4.5: 1.44 tokens per drafting round of 0.13 + 1.05 s, 1.22 a second, against
    # one token for a one-row forward of 1.0 s: drafting pays. A forward of 4 rows takes 1.15 s.
    pacer = timed_pacer(1, 0.13, 1.05, 1.0, (1.5, 1.5), guess_tokens=3, confidence=0.0)
    pacer.forward_s[4] = Average(value=1.15)
    assert pacer.alpha(0) == pytest.approx(2 / 4.5) and pacer.drafting_pays(0)
    # with one guess kept every other round, a paused round emits 1.5 tokens for 1.05 s: 1.43 a second
    pacer.record_guess(0, 1, strong=False)
    assert pacer.paused_rate(0) == pytest.approx(1.5 / 1.05) and not pacer.drafting_pays(0)
    for kept in [0, 0, 0, 1, 0, 0, 0]:
        pacer.record_guess(0, kept, strong=False)
    decay, hits, seen = PaceSettings().decay, 0.0, 0.0
    for kept in [1, 0, 0, 0, 1, 0, 0, 0]:
        hits, seen = decay * hits + kept, decay * seen + 1
    assert pacer.guess_gain(0, 1) == pytest.approx(hits / (seen + 1))  # decayed as the acceptance counts are
    assert pacer.guess_gain(0) < 0.25 and pacer.drafting_pays(0)  # a quarter of a token a round: draft


def test_lookup_rounds_and_guesses_after_a_chain_follow_the_cost_of_rows():
    # gamma 3, alpha 3.5 / 6: 2.12 tokens a drafting round of 0.4 s plus a verification of 4 rows,
    # 1.15 s where rows are cheap, 2.8 s where dear. Continuations of long repeats were the target's
    # two tokens out of three, every time: 0.95 and 1.9 tokens kept of one and two guesses.
    def pacer_with(rows_cost: float) -> Pacer:
        pacer = timed_pacer(3, 0.4, 1.0 + 3 * rows_cost, 1.0, (3.0, 1.5), guess_tokens=3, confidence=0.0)
        for _ in range(30):
            pacer.record_guess(0, 2, strong=True)
        return pacer

    cheap, dear = pacer_with(0.05), pacer_with(0.6)
    assert cheap.guess_gain(0, 2, strong=True) == pytest.approx(1.905, abs=1e-3)
    # a lookup round of two guesses emits 2.9 tokens for 1.1 s (cheap) or 2.2 s (dear): either beats a
    # drafting round (1.37 and 0.66 a second), and the third guess, never kept, is left out
    assert cheap.lookup_guesses(0, 3) == 2 and dear.lookup_guesses(0, 3) == 2
    # after three drafted tokens (all kept with 0.2), two guesses add 0.2 * 1.9 tokens for two rows:
    # 0.1 s more where rows are cheap, 1.2 s where dear; only the cheap chain carries them
    assert cheap.forward(6) == pytest.approx(1.25) and dear.forward(6) == pytest.approx(4.0)
    assert cheap.chain_guesses(0, 3, 3) == 2 and dear.chain_guesses(0, 3, 3) == 0


def test_a_probe_of_a_costly_draft_comes_only_as_often_as_its_loss_allows():
    # gamma 3, a verification of 4 rows 1.15 s, a plain step 1.0 s; the draft never agrees (alpha
    # 0.5 / 6.5: a drafting round emits 1.083 tokens). Drafting costs 1.5 s a round where each draft
    # forward runs the target's own lower layers (0.5 s), 0.3 s for a small draft.
    tau = expected_tokens(0.5 / 6.5, 3)
    costly = timed_pacer(3, 1.5, 1.15, 1.0, (0.0, 5.0))
    # a probe takes 2.65 s for what paused rounds emit in 1.083 s: 1.567 s lost, which within 2 % of
    # the paused rounds' time (1.0 s each) needs 79 of them before it
    assert costly.probe_loss(0) == pytest.approx(2.65 - tau) and costly.probe_interval(0) == 79
    cheap = timed_pacer(3, 0.3, 1.15, 1.0, (0.0, 5.0))
    assert cheap.probe_loss(0) == pytest.approx(1.45 - tau) and cheap.probe_interval(0) == 19
    assert timed_pacer(3, 1.5, 1.15, 1.0, (0.0, 5.0), probe_budget=0.0).probe_interval(0) == 4  # the back-off
    paying = timed_pacer(3, 0.3, 1.15, 1.0, (20.0, 1.0))
    assert paying.probe_loss(0) == 0.0 and paying.probe_interval(0) == 4
    with pytest.raises(DraftsmithError, match="probe_budget must be a share"):
        PaceSettings(probe_budget=1.0)


class CostClock:
    """``time.perf_counter`` for the decoder's clock: a microsecond per read, plus the cost model's
    seconds, which the wrapped verifier and drafter add: ``step`` a verification forward, ``row`` each
    row past the first, ``draft`` each draft forward."""

    def __init__(self, step: float, row: float, draft: float):
        self.now, self.step, self.row, self.draft = 0.0, step, row, draft

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def verify(self, verify):
        def priced(verifier, inputs, valid, reusable=None):
            self.now += self.step + self.row * (inputs.shape[1] - 1)
            return verify(verifier, inputs, valid, reusable)

        return priced

    def propose(self, propose):
        def priced(drafter, sequences, budget, options, generator):
            proposal = propose(drafter, sequences, budget, options, generator)
            self.now += self.draft * proposal.steps
            return proposal

        return priced


@pytest.mark.parametrize("kind", ["early_exit", "dflash", "lm"])
def test_a_draft_that_does_not_pay_is_paused_to_within_three_percent_of_the_target_alone(target, monkeypatch, kind):
    # Under a cost model where a draft forward costs half a target step (an early-exit draft running
    # the target's own lower layers; a DFlash draft's block forward), an untrained draft never pays:
    # after its first round it drafts only in probes, which come as seldom as their loss requires, and
    # the rounds cost at most 3 % more than the target's own steps would (one step a token).
    options = {"dflash": {"mask_token_id": 31}}
    torch.manual_seed(0)
    settings = DraftSettings(kind=kind, layers="1", options=options.get(kind, {}))
    draft = KINDS[kind].build(settings, target, tiny_tokenizer(32), target.device).eval()
    verifier, drafter = draft.decoding_pair(target, 1, 64, DecodeOptions()) if kind != "lm" else (None, None)
    verifier_class = type(verifier) if verifier is not None else TargetVerifier
    drafter_class = type(drafter) if drafter is not None else LMDrafter
    clock = CostClock(step=1.0, row=0.05, draft=0.5)
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(verifier_class, "verify", clock.verify(verifier_class.verify))
    monkeypatch.setattr(drafter_class, "propose", clock.propose(drafter_class.propose))
    prompt = [[0, 5, 9, 4, 7, 3, 8]]
    out, stats = speculative_generate(target, draft, prompt, 200, DecodeOptions(gamma=3, pace=True, guesses=False))
    monkeypatch.undo()
    assert out == target_generate(target, prompt, 200)[0]
    rounds_s = stats.draft_time + stats.paused_draft_time + stats.verify_time + stats.other_time
    target_s = stats.round_tokens * 1.0  # the target alone: one step a token after the prompt's
    drafting = stats.rounds - stats.paused
    # 4 drafting rounds of 199 (early exit, lm: 0.99 and 0.98 of the target's time), 9 of a DFlash
    # draft, whose block forward costs one draft forward and so loses less a probe (0.97)
    assert stats.paused / stats.rounds > 0.95 and drafting <= 10, kind
    assert target_s / rounds_s >= 0.97, kind


def test_a_pacer_starts_from_the_timings_and_calibration_earlier_calls_learned():
    memory = PaceMemory()
    first = Pacer(1, 1, PaceSettings(), memory=memory)
    assert first.drafting_rate(0) is None  # nothing timed yet
    # A draft sure of its tokens (0.6) whose tokens the target keeps a third as often (0.2).
    for round_ in range(CALIBRATED_AFTER):
        kept = int(round_ % 5 == 0)
        first.record([0], torch.tensor([1]), torch.tensor([kept]), 0.13, 1.0, 2, torch.tensor([[0.6]]))
    first.record([0], torch.tensor([0]), torch.tensor([0]), 0.02, 0.9, 1)  # a plain round
    assert memory.judged == CALIBRATED_AFTER and memory.kept == 7
    assert memory.calibration() == pytest.approx(7 / (0.6 * CALIBRATED_AFTER))
    # The next call's pacer has the timings at once, and scales its sequences' confidence prior.
    second = Pacer(1, 1, PaceSettings(), memory=memory)
    assert second.draft_s.value == pytest.approx(0.13) and second.forward(1) == pytest.approx(0.9)
    assert second.drafting_rate(0) is not None
    second.record([0], torch.tensor([1]), torch.tensor([0]), 0.13, 1.0, 2, torch.tensor([[0.6]]))
    calibrated = 0.6 * memory.calibration()
    assert second.prior(0) == pytest.approx((6 * calibrated, 6 * (1 - calibrated)))
    # Another batch size keeps its own timings (a wider batch's forward costs more).
    assert Pacer(1, 4, PaceSettings(), memory=memory).draft_s.value is None
    # Before CALIBRATED_AFTER judged tokens the confidence stands as it is.
    young = PaceMemory()
    young.record([0.6], 0)
    assert young.calibration() == 1.0


def test_later_calls_of_the_same_pair_draft_less_where_drafting_does_not_pay(target, monkeypatch):
    # Short answers under a cost model where the draft does not pay (a draft forward half a target
    # step, an untrained draft): each call alone spends its first rounds timing both kinds of round
    # and learning that its draft's confidence overstates it; calls that remember spend that once.
    torch.manual_seed(0)
    draft = KINDS["lm"].build(DraftSettings(kind="lm", layers="1"), target, tiny_tokenizer(32), target.device).eval()
    clock = CostClock(step=1.0, row=0.05, draft=0.5)
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(TargetVerifier, "verify", clock.verify(TargetVerifier.verify))
    monkeypatch.setattr(LMDrafter, "propose", clock.propose(LMDrafter.propose))

    def drafting_rounds(remember: bool) -> list[int]:
        options = DecodeOptions(gamma=3, pace=True, guesses=False, pace_settings=PaceSettings(remember=remember))
        rounds = []
        for prompt in PROMPTS * 2:
            out, stats = speculative_generate(target, draft, [prompt], 12, options)
            assert out == target_generate(target, [prompt], 12)[0]
            rounds.append(stats.rounds - stats.paused)
        return rounds

    alone = drafting_rounds(remember=False)  # the default
    assert remembered(target, draft, DecodeOptions(gamma=3, pace=True)).timings == {}
    assert not PaceSettings().remember
    together = drafting_rounds(remember=True)
    # alone: every call drafts its first round at a loss; together: only the first call does
    assert alone == [1] * 6 and together == [1, 0, 0, 0, 0, 0]
    assert remembered(target, draft, DecodeOptions(gamma=3, pace=True)).timings[1].draft_s.value is not None
    # Another gamma (other costs) starts from its own memory.
    assert remembered(target, draft, DecodeOptions(gamma=2, pace=True)).timings == {}
