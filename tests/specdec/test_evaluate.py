"""The speedup model and the report: per-position acceptance recovered from tokens per round, cost
ratios from the decoders' timings, medians over repeats, the target timed beside every draft."""

import dataclasses
import json

import pytest
import torch

from draftsmith.specdec.decoder import DecodeStats, target_generate
from draftsmith.specdec.measure import runs
from draftsmith.specdec.measure.costs import step_costs
from draftsmith.specdec.measure.figures import report_from_repeats
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.measure.theory import acceptance_by_position, alpha_from_tau, predicted_speedup
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.13, 0.5, 0.87])
def test_alpha_from_tau_inverts_the_expected_tokens_per_round(alpha, gamma):
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert alpha_from_tau(tau, gamma) == pytest.approx(alpha, abs=1e-9)


def test_alpha_from_tau_clamps_impossible_values_and_matches_the_ratio_at_gamma_1():
    assert alpha_from_tau(0.7, 3) == pytest.approx(0.0, abs=1e-9)
    assert alpha_from_tau(9.0, 3) == pytest.approx(1.0, abs=1e-9)
    assert alpha_from_tau(1.3, 1) == pytest.approx(0.3)


def test_predicted_speedup_is_leviathans_formula_with_verification_cost():
    assert predicted_speedup(0.6, 3, 0.2, 1.0) == pytest.approx((1 - 0.6**4) / 0.4 / 1.6)
    assert predicted_speedup(1.0, 3, 0.2, 1.1) == pytest.approx(4 / 1.7)


def _tally(tokens: int, seconds: float, **stats) -> Tally:
    tally = Tally()
    tally.add(DecodeStats(new_tokens=tokens, total_time=seconds, **stats))
    return tally


def test_report_takes_the_speedup_from_median_rates_and_the_rest_from_the_median_repeat():
    # Target-only: single-token steps of 20 ms. Speculative: draft steps of 5 ms (c = 0.25) and
    # verifications of 30 ms (v = 1.5); alpha 0.75 in the median repeat.
    base = {"rounds": 99, "verify_time": 1.98}
    repeats = [
        {"target": _tally(100, 2.0, **base), "spec": _tally(100, 1.0, proposed=40, accepted=10)},  # 50, 100 t/s
        {
            "target": _tally(100, 2.5, **base),  # 40 t/s
            "spec": _tally(
                100, 1.0, proposed=40, accepted=30, draft_forwards=41, draft_time=0.2, rounds=20, verify_time=0.6
            ),  # 100 t/s
        },
        {"target": _tally(120, 2.0, **base), "spec": _tally(150, 1.0, proposed=40, accepted=20)},  # 60, 150 t/s
    ]
    report = report_from_repeats(repeats, per_cat={}, hf=None, greedy_matches=[True, False, True, True], gamma=4)
    assert report.target_tokens_per_s == pytest.approx(50.0)
    assert report.spec_tokens_per_s == pytest.approx(100.0)
    assert report.speedup == pytest.approx(2.0)  # median 100 / median 50, not the median ratio 2.5
    assert report.speedup_per_repeat == pytest.approx([2.0, 2.5, 2.5])
    assert report.acceptance_rate == pytest.approx(0.75)  # repeat 2 of 3 by speedup
    assert report.cost_ratio_c == pytest.approx(0.25)
    assert report.verify_ratio_v == pytest.approx(1.5)
    assert report.predicted_speedup == pytest.approx(0.7626953125 / 0.625)  # (1 - .75^5) / (.25 (4 .25 + 1.5))
    assert report.efficiency == pytest.approx(2.0 * 0.625 / 0.7626953125)
    assert report.greedy_match == 0.75
    assert report.per_category == {}


def test_step_costs_leave_out_each_calls_draft_prefill():
    baseline = DecodeStats(rounds=10, verify_time=0.5)  # 50 ms per target step
    spec = DecodeStats(draft_forwards=3 + 12, draft_time=0.12, rounds=4, verify_time=0.4)  # three calls
    assert step_costs(baseline, spec, calls=3) == pytest.approx((0.2, 2.0))


def test_every_pair_times_its_own_target_runs_interleaved_with_the_drafts(monkeypatch):
    target, tokenizer = tiny_llama(vocab=32, sharpness=8.0), tiny_tokenizer(32)
    prompts = [
        Prompt(str(i), category, [[{"role": "user", "content": f"w{3 + i} w{10 + i}"}]])
        for i, category in enumerate(["writing", "writing", "math"])
    ]
    settings = MeasureSettings(prompts, max_new_tokens=12, seed=0, repeats=2, progress=False)
    at_gamma_2 = dataclasses.replace(settings, options=DecodeOptions(gamma=2))
    calls = []
    target_generate_, speculative_generate_ = runs.target_generate, runs.speculative_generate
    monkeypatch.setattr(runs, "target_generate", lambda *a, **k: calls.append("T") or target_generate_(*a, **k))
    monkeypatch.setattr(
        runs, "speculative_generate", lambda *a, **k: calls.append("S") or speculative_generate_(*a, **k)
    )
    rates = []
    for noise in (0.2, 0.6):
        calls.clear()
        report = evaluate_pair(target, noisy_copy(target, noise), tokenizer, at_gamma_2)
        # The warm-up, then per repeat each of the three prompts (batch size 1): a target run beside a draft run.
        assert calls == ["T", "S"] * (1 + 2 * 3)
        assert report.greedy_match == 1.0
        assert "baseline_shared" not in report.to_json()
        rates.append(report.target_tokens_per_s)
    assert rates[0] != rates[1]  # the second draft's target runs were timed again, not reused


FIGURE_KEYS = {
    "acceptance_rate", "mean_accepted_tokens", "target_tokens_per_s", "spec_tokens_per_s", "speedup", "cost_ratio_c",
    "verify_ratio_v", "predicted_speedup", "efficiency", "nodes_per_round", "proposed", "accepted",
    "acceptance_by_position", "paused_share", "time_split_s", "guesses", "guesses_accepted", "lookup_rounds",
}  # fmt: skip
REPORT_KEYS = {
    "speedup_per_repeat", "speedup_spread", "cost_ratio_c_spread", "greedy_match", "per_category", "gamma", "tree",
    "batch_size", "max_new_tokens", "repeats", "prompts", "temperature", "top_k", "top_p", "verify_widths", "compile",
    "compile_s", "compiled_graphs",
}  # fmt: skip


def test_acceptance_by_position_counts_the_rounds_that_reached_each_position():
    # gamma 3: rounds accepting 3, 1, 0, 2 of 3, and one proposing 2 (a budget cut) accepting both.
    counts = [(3, 3), (3, 1), (3, 0), (3, 2), (2, 2)]
    # position 1: 4 of 5 rounds accepted it; position 2: of the 4 that reached it, 3 accepted;
    # position 3: of the 2 that reached it with a proposal there (the budget-cut round proposed none), 1.
    assert acceptance_by_position(counts, 3) == pytest.approx([4 / 5, 3 / 4, 1 / 2])
    assert acceptance_by_position([(1, 0)], 2) == [0.0, None]


def test_a_measurement_reports_the_decoders_acceptance_at_each_position():
    target, tokenizer = tiny_llama(vocab=32, sharpness=8.0), tiny_tokenizer(32)
    prompts = [Prompt(str(i), "writing", [[{"role": "user", "content": f"w{3 + i} w{10 + i}"}]]) for i in range(2)]
    settings = MeasureSettings(prompts, options=DecodeOptions(gamma=3), max_new_tokens=16, progress=False)
    perfect = evaluate_pair(target, target, tokenizer, settings)
    assert perfect.acceptance_by_position == [1.0, 1.0, 1.0]
    written = json.loads(json.dumps(perfect.to_json()))  # the keys `draftsmith eval --json` has always written
    assert set(written) == FIGURE_KEYS | REPORT_KEYS
    assert set(written["per_category"]["writing"]) == FIGURE_KEYS
    assert written["time_split_s"].keys() == {"prefill", "draft", "verify", "other"}
    spread = written["speedup_spread"]
    assert spread == {
        "median": spread["median"],
        "min": min(perfect.speedup_per_repeat),
        "max": max(perfect.speedup_per_repeat),
    }
    assert written["gamma"] == 3 and written["compile"] is False and written["compiled_graphs"] is None
    draft = noisy_copy(target, 0.3)
    noisy = evaluate_pair(target, draft, tokenizer, settings)
    first, second, _ = noisy.acceptance_by_position
    assert 0.5 < first < 1.0 and second < first  # measured 0.73 and 0.18 on these two prompts
    # At gamma 1 every round proposes one token: position 1's share is accepted / proposed.
    one = evaluate_pair(target, draft, tokenizer, dataclasses.replace(settings, options=DecodeOptions(gamma=1)))
    assert one.acceptance_by_position == [pytest.approx(one.acceptance_rate)]


def test_the_greedy_check_asks_the_row_exact_target_where_the_timed_baseline_differs():
    """The target-only runs are timed one row per step; in bfloat16 the speculative decoder reproduces
    the row-exact target instead, so where its output differs from the timed baseline's, an untimed
    row-exact run decides. In float32 the two baselines are one, and a difference is a mismatch."""
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab=tokenizer.vocab_size)
    prompt = [Prompt("0", "writing", [[{"role": "user", "content": "w3 w10"}]])]
    ids = [[5, 9, 14, 3, 7, 21]]
    for dtype, rescued in ((torch.bfloat16, True), (torch.float32, False)):
        model = target.to(dtype)
        pair = runs.PairRun(model, model, tokenizer, MeasureSettings(prompt, max_new_tokens=8, progress=False))
        exact = target_generate(model, ids, 8, row_exact=True)[0]
        other = [exact[0][:-1] + [(exact[0][-1] + 1) % tokenizer.vocab_size]]
        assert pair.greedy_identical(ids, base_out=other, spec_out=exact) == [rescued]
        assert pair.greedy_identical(ids, base_out=exact, spec_out=other) == [False]
        assert pair.greedy_identical(ids, base_out=exact, spec_out=exact) == [True]
