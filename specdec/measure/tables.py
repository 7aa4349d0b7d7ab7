"""Plain-text tables of a measurement, and the spread of a figure over repeats."""

from __future__ import annotations

import math
import statistics


def spread(values: list[float | None]) -> dict | None:
    """Median, min and max of a figure over repeats (None when a repeat measured nothing)."""
    if not values or any(v is None or math.isnan(v) for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(x: float | None, spec: str = ".3f") -> str:
    """A figure for a plain-text table; ``-`` for one not measured."""
    return "-" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    """A plain-text table of the report, overall and per category."""
    head = (
        f"{'':<16}{'alpha':>8}{'tau':>7}{'target t/s':>12}{'spec t/s':>10}"
        f"{'speedup':>9}{'predicted':>10}{'c':>7}{'v':>7}"
    )
    lines = [head, "-" * len(head)]
    rows = [("overall", report)] + list(report["per_category"].items())
    for name, r in rows:
        lines.append(
            f"{name[:15]:<16}{fmt(r['acceptance_rate']):>8}{fmt(r['mean_accepted_tokens'], '.2f'):>7}"
            f"{fmt(r['target_tokens_per_s'], '.1f'):>12}{fmt(r['spec_tokens_per_s'], '.1f'):>10}"
            f"{fmt(r['speedup'], '.2f'):>9}{fmt(r['predicted_speedup'], '.2f'):>10}"
            f"{fmt(r['cost_ratio_c'], '.2f'):>7}{fmt(r['verify_ratio_v'], '.2f'):>7}"
        )
    drafted = f"gamma={report['gamma']}"
    if report["tree"]:
        drafted = f"tree={report['tree']} ({fmt(report['nodes_per_round'], '.1f')} nodes per round)"
    lines.append(
        f"{drafted} batch={report['batch_size']} temperature={report['temperature']} "
        f"repeats={report['repeats']} prompts={report['prompts']}"
    )
    if report["repeats"] > 1 and report["speedup_spread"] is not None:
        low, high = report["speedup_spread"]["min"], report["speedup_spread"]["max"]
        lines.append(f"speedup over {report['repeats']} repeats: min {low:.2f}, max {high:.2f}")
    if report["greedy_match"] is not None:
        lines.append(f"greedy output identical to the target's: {report['greedy_match']:.0%} of prompts")
    if report["compile"]:
        lines.append(
            f"compiled decoding: {report['compile_s']:.1f} s of warm-up compiled {report['compiled_graphs']} graphs "
            "(not part of any tokens/s)"
        )
    if "hf_generate_tokens_per_s" in report:
        lines.append(
            f"transformers generate: {report['hf_generate_tokens_per_s']:.1f} t/s, "
            f"assisted generation: {report['hf_assisted_tokens_per_s']:.1f} t/s "
            f"(stock models; {report['hf_drafted_per_round'] or 0:.2f} tokens drafted per round, "
            f"gamma {report['gamma']})"
        )
    return "\n".join(lines)
