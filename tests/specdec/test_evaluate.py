"""The speedup model: per-position acceptance recovered from tokens per round."""

import pytest

from draftsmith.specdec.evaluate import alpha_from_tau, predicted_speedup


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
