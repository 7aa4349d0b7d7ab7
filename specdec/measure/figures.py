"""A measurement's figures from its tallies: alpha, tau, c, v, tokens/s, measured and predicted speedup.

Speedup is the median speculative tokens/s over the median target-only tokens/s; the other figures
are those of the median repeat (by speedup), and the same figures are given per prompt category.
"""

from __future__ import annotations

import dataclasses
import statistics

from draftsmith.specdec.measure.costs import step_costs, sum_stats
from draftsmith.specdec.measure.hf_compare import HFComparison
from draftsmith.specdec.measure.report import PairFigures, PairReport, TimeSplit, fields_of
from draftsmith.specdec.measure.tables import spread
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.measure.theory import acceptance_by_position, predicted_speedup, predicted_tree_speedup


def pair_metrics(
    target: Tally, spec: Tally, gamma: int, tree: bool = False, forwards: int | None = None
) -> PairFigures:
    """alpha, tau, c, v and both speedups from the stats of one set of runs (``tree``: token-tree rounds;
    ``forwards``: the draft forwards of a chain round, default gamma, ``drafters.round_forwards``)."""
    base, sp = sum_stats(target.stats), sum_stats(spec.stats)
    alpha = sp.acceptance_rate
    c, v = step_costs(base, sp, calls=len(spec.stats))
    if tree:
        predicted = predicted_tree_speedup(sp, c, v, calls=len(spec.stats))
    else:
        predicted = predicted_speedup(alpha, gamma, c, v, forwards) if alpha is not None else None
    speedup = spec.tokens_per_s / target.tokens_per_s if target.tokens_per_s else None
    return PairFigures(
        acceptance_rate=alpha,
        mean_accepted_tokens=sp.mean_accepted_tokens,
        target_tokens_per_s=target.tokens_per_s,
        spec_tokens_per_s=spec.tokens_per_s,
        speedup=speedup,
        cost_ratio_c=c,
        verify_ratio_v=v,
        predicted_speedup=predicted,
        efficiency=speedup / predicted if speedup and predicted else None,
        nodes_per_round=sp.nodes_per_round,
        proposed=sp.proposed,
        accepted=sp.accepted,
        acceptance_by_position=None if tree else acceptance_by_position(sp.round_counts, gamma),
        paused_share=sp.paused / sp.seq_rounds if sp.seq_rounds else None,
        time_split_s=TimeSplit(sp.prefill_time, sp.draft_time + sp.paused_draft_time, sp.verify_time, sp.other_time),
        guesses=sp.guesses,
        guesses_accepted=sp.guesses_accepted,
        lookup_rounds=sp.lookup_rounds,
    )


def report_from_repeats(
    repeat_tallies: list[dict[str, Tally]],
    per_cat: dict[str, dict[str, Tally]],
    hf: HFComparison | None,
    greedy_matches: list[bool],
    gamma: int,
    tree: bool = False,
    forwards: int | None = None,
) -> PairReport:
    """The overall figures (alpha, c, v, ... of the median repeat; speedup from the median tokens/s
    of each decoder), greedy identity, and the figures per category."""
    per_repeat = [pair_metrics(t["target"], t["spec"], gamma, tree, forwards) for t in repeat_tallies]
    median = sorted(per_repeat, key=lambda r: r.speedup)[len(per_repeat) // 2]
    target_tps = statistics.median(r.target_tokens_per_s for r in per_repeat)
    spec_tps = statistics.median(r.spec_tokens_per_s for r in per_repeat)
    speedup = spec_tps / target_tps
    figures = dataclasses.replace(
        median,
        target_tokens_per_s=target_tps,
        spec_tokens_per_s=spec_tps,
        speedup=speedup,
        efficiency=speedup / median.predicted_speedup if median.predicted_speedup else median.efficiency,
    )
    return PairReport(
        **fields_of(PairFigures, figures),
        speedup_per_repeat=[r.speedup for r in per_repeat],
        speedup_spread=spread([r.speedup for r in per_repeat]),
        cost_ratio_c_spread=spread([r.cost_ratio_c for r in per_repeat]),
        greedy_match=sum(greedy_matches) / len(greedy_matches) if greedy_matches else None,
        per_category={
            cat: pair_metrics(t["target"], t["spec"], gamma, tree, forwards) for cat, t in sorted(per_cat.items())
        },
        hf=hf.report(gamma) if hf is not None else None,
    )
