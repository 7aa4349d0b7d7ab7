"""Plain-text tables of a measurement, and the spread of a figure over repeats."""

from __future__ import annotations

import math
import statistics

from draftsmith.specdec.measure.report import PairReport, Spread


def spread(values: list[float | None]) -> Spread | None:
    """Median, min and max of a figure over repeats (None when a repeat measured nothing)."""
    if not values or any(v is None or math.isnan(v) for v in values):
        return None
    return Spread(statistics.median(values), min(values), max(values))


def fmt(x: float | None, spec: str = ".3f") -> str:
    """A figure for a plain-text table; ``-`` for one not measured."""
    return "-" if x is None else format(x, spec)


def format_table(report: PairReport) -> str:
    """A plain-text table of the report, overall and per category."""
    head = (
        f"{'':<16}{'alpha':>8}{'tau':>7}{'target t/s':>12}{'spec t/s':>10}"
        f"{'speedup':>9}{'predicted':>10}{'c':>7}{'v':>7}"
    )
    lines = [head, "-" * len(head)]
    rows = [("overall", report)] + list(report.per_category.items())
    for name, r in rows:
        lines.append(
            f"{name[:15]:<16}{fmt(r.acceptance_rate):>8}{fmt(r.mean_accepted_tokens, '.2f'):>7}"
            f"{fmt(r.target_tokens_per_s, '.1f'):>12}{fmt(r.spec_tokens_per_s, '.1f'):>10}"
            f"{fmt(r.speedup, '.2f'):>9}{fmt(r.predicted_speedup, '.2f'):>10}"
            f"{fmt(r.cost_ratio_c, '.2f'):>7}{fmt(r.verify_ratio_v, '.2f'):>7}"
        )
    under = report.under
    drafted = f"gamma={under.gamma}"
    if under.tree:
        drafted = f"tree={under.tree} ({fmt(report.nodes_per_round, '.1f')} nodes per round)"
    lines.append(
        f"{drafted} batch={under.batch_size} temperature={under.temperature} "
        f"repeats={under.repeats} prompts={under.prompts}"
    )
    if under.repeats > 1 and report.speedup_spread is not None:
        lines.append(
            f"speedup over {under.repeats} repeats: min {report.speedup_spread.min:.2f}, "
            f"max {report.speedup_spread.max:.2f}"
        )
    if report.greedy_match is not None:
        lines.append(f"greedy output identical to the target's: {report.greedy_match:.0%} of prompts")
    if report.compiled.compile:
        lines.append(
            f"compiled decoding: {report.compiled.compile_s:.1f} s of warm-up compiled "
            f"{report.compiled.compiled_graphs} graphs (not part of any tokens/s)"
        )
    if report.hf is not None:
        hf = report.hf
        lines.append(
            f"transformers generate: {hf.generate_tokens_per_s:.1f} t/s, "
            f"assisted generation: {hf.assisted_tokens_per_s:.1f} t/s "
            f"(stock models; {hf.drafted_per_round or 0:.2f} tokens drafted per round, gamma {under.gamma})"
        )
    return "\n".join(lines)
