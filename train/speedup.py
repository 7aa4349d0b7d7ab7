"""Every checkpoint's real speedup: measured with the bundled decoder, the best gamma chosen, the best
checkpoint marked, and the report written as JSON, Markdown and a plot.

For each draft and temperature: measure alpha, c and v at a base gamma (4, or the middle of the list);
predict the speedup of every gamma in the list from those (v grows linearly with the verified tokens);
then measure at the predicted best gamma to confirm. Token-tree shapes, when given, are each measured
(there is no closed form to predict them from alpha); the tree that measured fastest is chosen over
the chain when it measured faster than the chain at its best gamma (``best_tree``). The checkpoint
with the highest measured speedup (of its chosen decoding) at the first temperature listed is the
best; ``best.json`` in the run folder says which.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.drafters import round_forwards
from draftsmith.specdec.files import atomic_path, write_text
from draftsmith.specdec.matmul import uses_column_products
from draftsmith.specdec.measure.engine_compare import filled
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.report import PairReport, Spread, fields_of, plain
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.theory import alpha_from_tau, predicted_speedup
from draftsmith.specdec.tree import TreeShape
from draftsmith.train import batch_schedule

REPORT = "speedup_report.json"
BEST = "best.json"  # the best draft of a run: {"checkpoint": name, ...}
# What a report keeps of the chain measured at one batch size (``batch_size_entry``).
BATCH_SIZE_KEYS = ("best_gamma", "speedup", "speedup_spread", "acceptance_rate", "mean_accepted_tokens")
BATCH_SIZE_KEYS += ("predicted_speedup", "predicted_by_gamma", "cost_ratio_c", "verify_ratio_v")
BATCH_SIZE_KEYS += ("target_tokens_per_s", "spec_tokens_per_s", "greedy_match", "paused_share")


@dataclass(frozen=True)
class GammaFigures:
    """What the report keeps of a measurement at one gamma or tree shape (``nodes_per_round``: trees only)."""

    acceptance_rate: float | None
    mean_accepted_tokens: float | None
    cost_ratio_c: float
    verify_ratio_v: float
    predicted_speedup: float | None
    speedup: float | None
    target_tokens_per_s: float
    spec_tokens_per_s: float
    greedy_match: float | None
    speedup_spread: Spread | None
    paused_share: float | None
    acceptance_by_position: list[float] | None
    guesses: int = 0  # lookup-guess tokens verified beside the draft's (``specdec.lookup``)
    guesses_accepted: int = 0
    lookup_rounds: int = 0
    by_category: dict | None = None  # per prompt category: acceptance rate, per position, and speedup

    @classmethod
    def of(cls, report: PairReport):
        """The figures of ``report`` this class keeps."""
        return cls(**figures_of(cls, report))

    def to_json(self) -> dict:
        return {name: plain(value) for name, value in fields_of(GammaFigures, self).items()}


def figures_of(cls, report: PairReport) -> dict:
    """The fields of ``cls`` (``GammaFigures`` or a subclass) taken from ``report``, its categories'
    acceptance and speedup as ``by_category``."""
    names = [f.name for f in dataclasses.fields(cls) if f.name != "by_category"]
    by_category = {
        name: {
            "acceptance_rate": figures.acceptance_rate,
            "acceptance_by_position": figures.acceptance_by_position,
            "speedup": figures.speedup,
        }
        for name, figures in report.per_category.items()
    }
    return {**{name: getattr(report, name) for name in names}, "by_category": by_category}


@dataclass(frozen=True)
class TreeFigures(GammaFigures):
    nodes_per_round: float | None = None

    def to_json(self) -> dict:
        return {**super().to_json(), "nodes_per_round": self.nodes_per_round}


@dataclass(frozen=True, kw_only=True)
class DraftMeasurement(GammaFigures):
    """One draft at one temperature: the figures measured at the best gamma (``predicted_speedup``
    there from the alpha measured at it), how the best gamma was chosen, and, with token trees, each
    shape's figures and the shape chosen over the chain (``best_tree``, None keeps the chain).

    measured_cost_ratio: c as the run at the base gamma measured it (``cost_ratio_c``,
    ``cost_ratio_c_spread``); alpha_per_position: estimated from tau at the base gamma."""

    temperature: float
    best_gamma: int
    measured_cost_ratio: dict
    alpha_per_position: float
    base_gamma: int
    at_base_gamma: GammaFigures
    predicted_by_gamma: dict[str, float]
    trees: dict[str, TreeFigures] | None = None
    best_tree: str | None = None

    def to_json(self) -> dict:
        """The result as ``speedup_report.json`` keeps it (``trees`` and ``best_tree`` only when measured)."""
        out = {"temperature": self.temperature, "best_gamma": self.best_gamma}
        out.update(GammaFigures.to_json(self))
        for name in ("measured_cost_ratio", "alpha_per_position", "base_gamma", "at_base_gamma", "predicted_by_gamma"):
            out[name] = plain(getattr(self, name))
        if self.trees is not None:
            out["trees"] = {shape: figures.to_json() for shape, figures in self.trees.items()}
            out["best_tree"] = self.best_tree
        return out


def measure_draft(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    settings: MeasureSettings,
    gammas: list[int],
    *,
    trees: tuple[TreeShape, ...] = (),
) -> DraftMeasurement:
    """The best gamma for one draft, and alpha, tau, c, v and the speedup measured there; with ``trees``,
    each shape's figures (``trees``) and the shape chosen over the chain, if any (``best_tree``).

    settings: what is measured; its options give the sampling (the temperature the result names),
    their gamma is each of ``gammas`` in turn. Every figure comes from runs of this draft with the
    target-only decoder interleaved (``evaluate_pair``): nothing is timed once and reused, so the
    drafts of a run are compared by ratios each measured in its own minutes. The run at the base
    gamma drafts in every round (the figures theory predicts from); the run at the best gamma
    decodes as the options say (with ``pace``, as a user's decoding pauses where drafting does not
    pay)."""
    base = 4 if 4 in gammas else sorted(gammas)[len(gammas) // 2]

    def run(**options) -> PairReport:
        at = dataclasses.replace(settings, options=dataclasses.replace(settings.options, **options))
        return evaluate_pair(target, draft, tokenizer, at)

    first = run(gamma=base, pace=False)
    # The prediction needs the per-position acceptance, which accepted / proposed understates for
    # gamma > 1 (tokens after a rejection count as proposed); tau at the base gamma gives it.
    alpha = alpha_from_tau(first.mean_accepted_tokens or 1.0, base)
    cost = cost_by_gamma(draft, gammas, base, first, run)
    v = first.verify_ratio_v
    predicted = {
        g: predicted_speedup(alpha, g, cost(g), 1 + (v - 1) * g / base, round_forwards(draft, g)) for g in gammas
    }
    best_gamma = max(predicted, key=predicted.get)
    paced = settings.options.pace and settings.options.tree is None
    confirmed = first if best_gamma == base and not paced else run(gamma=best_gamma)
    measured_alpha = confirmed.acceptance_rate
    # Every sequence drafting every round, at the alpha measured at the best gamma, with that run's c and
    # v; a paced run's own v mixes in plain steps, so it takes them as the base gamma's run gives them there.
    predicted_at_best = (
        None
        if measured_alpha is None
        else predicted_speedup(
            measured_alpha,
            best_gamma,
            cost(best_gamma) if paced else confirmed.cost_ratio_c,
            1 + (v - 1) * best_gamma / base if paced else confirmed.verify_ratio_v,
            round_forwards(draft, best_gamma),
        )
    )
    # A tree is drafted on the draft's own cache (a kind whose draft shares the target's drafts it standalone).
    measured = {t.text: TreeFigures.of(run(tree=t)) for t in trees}
    speedups = {shape: figures.speedup for shape, figures in measured.items()}
    result = DraftMeasurement(
        **{**figures_of(GammaFigures, confirmed), "predicted_speedup": predicted_at_best},
        temperature=settings.options.sampling.temperature,
        best_gamma=best_gamma,
        measured_cost_ratio={
            "cost_ratio_c": first.cost_ratio_c,
            "cost_ratio_c_spread": plain(first.cost_ratio_c_spread),
        },
        alpha_per_position=alpha,
        base_gamma=base,
        at_base_gamma=GammaFigures.of(first),
        predicted_by_gamma={str(g): p for g, p in predicted.items()},
        trees=measured or None,
        best_tree=choose_tree(speedups, confirmed.speedup) if trees else None,
    )
    return result


def confirm_draft(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    settings: MeasureSettings,
    best_gamma: int,
    tree: str | None = None,
) -> dict:
    """The chosen draft measured once more as it was chosen, side by side with the target alone: as a
    token tree of shape ``tree`` when a tree was chosen over the chain (``best_tree``), else as a
    chain at its best gamma. The figures as the report keeps them, with ``tree`` when one ran.

    Choosing the fastest of several drafts by measured speedup favours, among drafts of about equal
    worth, the one whose measurement ran on its luckiest minutes: the highest of several noisy figures
    sits above the chosen draft's own mean. A measurement taken after the choice carries no such
    bias, so it is the figure the model card and the quickstart's summary give (``card_figures``)."""
    shape = None if tree is None else TreeShape.parse(tree)
    options = dataclasses.replace(settings.options, gamma=best_gamma, tree=shape)
    measured = evaluate_pair(target, draft, tokenizer, dataclasses.replace(settings, options=options))
    if tree is None:
        return GammaFigures.of(measured).to_json()
    return TreeFigures.of(measured).to_json() | {"tree": tree}


def measure_batch_size(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    settings: MeasureSettings,
    gammas: list[int],
    batch_size: int,
) -> dict:
    """The gamma to draft at ``batch_size``, chosen as eval-run chooses it at batch 1 (``measure_draft``:
    alpha, c and v measured at the base gamma, here with ``batch_size`` sequences per batch, predict
    each of ``gammas``, and the best one is measured, both runs beside the target alone in the same
    minutes). The prompts fill whole batches (``engine_compare.filled``: one category, repeated in
    order when fewer than a batch). Returns the entry the report keeps (``batch_size_entry``)."""
    prompts = filled(settings.prompts, batch_size) if batch_size > 1 else settings.prompts
    at_size = dataclasses.replace(settings, prompts=prompts, batch_size=batch_size)
    measured = measure_draft(target, draft, tokenizer, at_size, gammas).to_json()
    under = {"dtype": str(target.dtype).removeprefix("torch."), "matmul": product_form(target)}
    return batch_size_entry(measured, batch_size, len(prompts), under)


def product_form(model: torch.nn.Module) -> str:
    """How ``model``'s few-row products run (``specdec.matmul``), as reports name it."""
    return "columns" if uses_column_products(model) else "linear"


def batch_size_entry(measured: dict, batch_size: int, prompts: int, under: dict) -> dict:
    """What a report keeps of a draft at one batch size: its chain's figures at the best gamma
    (``measured``, as ``DraftMeasurement.to_json`` writes them), the batch size, the prompts decoded,
    what the pair ran in (``under``: dtype and few-row product form), and ``gamma``: the best gamma,
    or 0 where drafting there measured slower than the target alone (``batch_schedule.gamma_that_pays``)."""
    gamma = batch_schedule.gamma_that_pays(measured["best_gamma"], measured["speedup"])
    figures = {key: measured.get(key) for key in BATCH_SIZE_KEYS}
    return {"batch_size": batch_size, "prompts": prompts, **under, "gamma": gamma, **figures}


def batch_one_entry(result: dict, prompts: int, under: dict) -> dict:
    """Batch 1's entry (``batch_size_entry``) from a draft's own measurement at batch 1, with no run of
    its own: its chain at the best gamma, as measured again once chosen (``card_figures``) unless that
    second run was a token tree (transformers and vLLM draft the chain)."""
    return batch_size_entry(result if result.get("best_tree") else card_figures(result), 1, prompts, under)


def schedule_of(by_batch_size: dict[str, dict]) -> list[tuple[int, int, int]]:
    """vLLM's batch-size ranges (``batch_schedule.schedule_ranges``) of a report's entries by batch size."""
    return batch_schedule.schedule_ranges({int(size): entry["gamma"] for size, entry in by_batch_size.items()})


def card_figures(result: dict) -> dict:
    """A draft's figures at one temperature as a card gives them: its confirmation's (``confirm_draft``)
    where it was measured again once chosen, with the speedup it was chosen by as ``chosen_speedup``;
    else the figures it was chosen by. A figure the second run could not give (no draft token
    proposed: no acceptance rate) stays the first run's."""
    if "confirmation" not in result:
        return result
    again = {k: v for k, v in result["confirmation"].items() if v is not None}
    return {**result, **again, "chosen_speedup": chosen_figures(result)["speedup"]}


def does_not_pay(name: str, speedup: float | None) -> str | None:
    """A plain line when ``name`` measured slower than the target alone (speedup below 1.0), else None:
    a user must not read such a draft as one that makes decoding faster."""
    if speedup is None or speedup >= 1.0:
        return None
    return (
        f"{name} does not pay here: it measured {speedup:.2f}x the target alone, so decoding without it is "
        "faster on this machine (the pacer stops drafting where it sees that; train longer or on more data)"
    )


def cost_by_gamma(
    draft: torch.nn.Module, gammas: list[int], base: int, first: PairReport, run
) -> Callable[[int], float]:
    """c as a function of gamma, for predicting each gamma from the run at the base gamma (``first``).

    A draft that proposes one token per forward costs the same per forward at every gamma: c is the
    base run's. A draft that proposes a block in one forward (``round_forwards`` below gamma) pays
    for a forward over the whole block, so its c grows with gamma: it is also measured at the
    smallest gamma (``run``) and taken as linear in gamma through the two measurements."""
    c_base = first.cost_ratio_c
    low = min(gammas)
    if round_forwards(draft, base) == base or low == base:
        return lambda gamma: c_base
    c_low = run(gamma=low).cost_ratio_c
    slope = (c_base - c_low) / (base - low)
    return lambda gamma: max(c_low + slope * (gamma - low), 1e-6)


def choose_tree(tree_speedups: dict[str, float], chain_speedup: float) -> str | None:
    """The tree shape that measured the highest speedup, when it beats the chain at its best gamma
    (``chain_speedup``); None keeps the chain (a tie too: transformers and vLLM run chains)."""
    fastest = max(tree_speedups, key=tree_speedups.get)
    return fastest if tree_speedups[fastest] > chain_speedup else None


def chosen_figures(result: dict) -> dict:
    """The figures of the decoding a measurement chose: its best tree's, else the chain's at the best gamma."""
    return result["trees"][result["best_tree"]] if result.get("best_tree") else result


def load_report(run_dir: Path) -> dict:
    path = run_dir / REPORT
    return json.loads(path.read_text()) if path.is_file() else {"results": {}}


def write_report(run_dir: Path, report: dict) -> str | None:
    """Write the JSON, Markdown and plot, and best.json; return the best draft's name."""
    results = report["results"]
    first_temp = str(report["temperatures"][0])
    candidates = {name: r[first_temp] for name, r in results.items() if first_temp in r}
    best, note = choose_best(candidates) if candidates else (None, None)
    report["best"], report["best_note"] = best, note
    write_text(run_dir / REPORT, json.dumps(report, indent=2))
    if best is not None:
        info = {"checkpoint": best, "temperature": float(first_temp), **candidates[best]}
        write_text(run_dir / BEST, json.dumps(info, indent=2))
    write_text(run_dir / "speedup_report.md", _markdown(report))
    _plot(run_dir, report)
    return best


def choose_best(candidates: dict[str, dict]) -> tuple[str, str | None]:
    """The best draft: walking the drafts by step, a later one replaces the current choice only when
    its lowest repeat beats the choice's highest (its lead exceeds the measured spread). Each draft is
    judged by the decoding it chose (``chosen_figures``). Returns the name and, when the highest median
    speedup was not chosen for that reason, a note saying so."""
    speedup = {name: chosen_figures(r)["speedup"] for name, r in candidates.items()}

    def low_high(name: str) -> tuple[float, float]:
        spread = chosen_figures(candidates[name]).get("speedup_spread")
        return (spread["min"], spread["max"]) if spread else (speedup[name], speedup[name])

    order = sorted(candidates, key=lambda n: candidates[n]["step"])
    best = order[0]
    for name in order[1:]:
        if low_high(name)[0] > low_high(best)[1]:
            best = name
    leader = max(order, key=speedup.get)
    if leader == best:
        return best, None
    return best, (
        f"{leader} measured the highest speedup ({speedup[leader]:.2f}) but within the spread over "
        f"repeats of the earlier {best} ({speedup[best]:.2f}), so {best} is kept"
    )


def _markdown(report: dict) -> str:
    trees = report["trees"]
    lines = [
        f"# Speedup report: {report['run']}",
        "",
        f"Target `{report['target']}`, prompts `{report['prompts']}`, {report['max_new_tokens']} new tokens, "
        f"hardware: {report['hardware']}{_precision(report)}. Speedup = speculative tokens/s / target-only "
        "tokens/s, measured at the best gamma (chosen from measured alpha and c, then measured).",
        "",
        "| draft | step | temperature | alpha | tau | c | best gamma | target tokens/s | predicted | measured speedup "
        "| greedy match |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if trees:
        lines[2] += (
            f" Token trees measured: {', '.join(trees)}; the fastest is chosen over the chain only when it "
            "measured faster (**chosen**)."
        )
        lines[4] += " fastest tree: speedup, nodes per round |"
        lines[5] += "---|"
    if report.get("best_note"):
        lines[4:4] = [f"Best draft: {report['best']}. {report['best_note']}.", ""]
    lines[4:4] = _shared_lines(report)
    best = report["results"].get(report.get("best"), {}).get(str(report["temperatures"][0]), {})
    if "confirmation" in best:
        again = card_figures(best)
        decoding = f"as token tree {again['tree']}" if again.get("tree") else f"at gamma {best['best_gamma']}"
        lines[4:4] = [
            f"{report['best']}, measured again once chosen (the figure its model card gives): speedup "
            f"{again['speedup']:.2f} {decoding}, alpha {again['acceptance_rate']:.3f}, against "
            f"{again['chosen_speedup']:.2f} in the measurement it was chosen by.",
            "",
        ]
    for name, by_temp in sorted(report["results"].items(), key=lambda kv: kv[1][next(iter(kv[1]))]["step"]):
        for temp, r in by_temp.items():
            match = "-" if r["greedy_match"] is None else f"{r['greedy_match']:.0%}"
            mark = " **best**" if name == report.get("best") and temp == str(report["temperatures"][0]) else ""
            lines.append(
                f"| {name}{mark} | {r['step']} | {temp} | {r['acceptance_rate']:.3f} | "
                f"{r['mean_accepted_tokens']:.2f} | {r['cost_ratio_c']:.3f} | {r['best_gamma']} | "
                f"{r['target_tokens_per_s']:.1f} | {r['predicted_speedup']:.2f} | "
                f"{r['speedup']:.2f}{_range(r)} | {match} |" + (f" {_tree_cell(r)} |" if trees else "")
            )
    return "\n".join(lines + _batch_size_lines(report)) + "\n"


def batch_size_rows(entries: dict[str, dict]) -> list[str]:
    """A Markdown table of a draft's entries by batch size (``batch_size_entry``)."""
    rows = [
        "| batch size | dtype | prompts | best gamma | alpha | measured speedup | gamma served |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, e in sorted(entries.items(), key=lambda item: int(item[0])):
        alpha = "-" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.3f}"
        prompts = "-" if e["prompts"] is None else e["prompts"]
        rows.append(
            f"| {size} | {e['dtype']} | {prompts} | {e['best_gamma']} | {alpha} | {e['speedup']:.2f}{_range(e)} | "
            f"{e['gamma']} |"
        )
    return rows


def _batch_size_lines(report: dict) -> list[str]:
    """The best draft's gamma per batch size (``by_batch_size``), when it was chosen at more than batch 1."""
    temperature = str(report["temperatures"][0])
    best = report["results"].get(report.get("best"), {}).get(temperature, {})
    entries = best.get("by_batch_size", {})
    if len(entries) < 2:
        return []
    ranges = batch_schedule.format_ranges(schedule_of(entries))
    lines = [
        "",
        f"{report['best']} at each batch size (temperature {temperature}; its gamma chosen there as at batch 1, "
        "beside the target alone at that size; gamma 0 where drafting measured slower than the target alone). "
        f"vLLM's `{batch_schedule.SCHEDULE_KEY}`: `{ranges}`.",
        "",
        *batch_size_rows(entries),
    ]
    engine = report.get("engine_schedule")
    if engine and engine["checkpoint"] == report["best"] and str(engine["temperature"]) == temperature:
        lines += [
            "",
            f"In vLLM {engine['engine_version']} ({engine['dtype']}; every gamma of {engine['gammas']} measured beside "
            f"the target alone): `{batch_schedule.format_ranges(engine[batch_schedule.SCHEDULE_KEY])}`.",
            "",
            "| batch size | speedup by gamma | fastest gamma | gamma served |",
            "|---|---|---|---|",
        ]
        for size, e in sorted(engine["by_batch_size"].items(), key=lambda item: int(item[0])):
            each = ", ".join(f"{g}: {x:.2f}" for g, x in e["speedup_by_gamma"].items())
            lines.append(f"| {size} | {each} | {e['best_gamma']} | {e['gamma']} |")
    return lines


def _precision(report: dict) -> str:
    """The dtype and the form of few-row products (``specdec.matmul``) the drafts were measured in."""
    parts = [report["dtype"]] if report.get("dtype") else []
    if report.get("matmul"):
        parts.append(f"few-row products: {report['matmul']}")
    return f", {', '.join(parts)}" if parts else ""


def _shared_lines(report: dict) -> list[str]:
    """How the drafts were measured: each beside its own target-only runs, and how the best is chosen."""
    return [
        "Each draft is timed side by side with the target alone: the two decoders run interleaved batch by "
        "batch in the same minutes, so every ratio (speedup, c, v) is its own run's. A later draft is marked "
        "best only when its lowest repeat beats the earlier choice's highest"
        + (" (one repeat measures no spread: --repeats 3 gives one)." if report["repeats"] == 1 else "."),
        "",
    ]


def _tree_cell(result: dict) -> str:
    """The fastest tree of a measurement: shape, speedup (min-max) and nodes per round, marked when chosen."""
    trees = result["trees"]
    shape = max(trees, key=lambda t: trees[t]["speedup"])
    t = trees[shape]
    chosen = " **chosen**" if result["best_tree"] == shape else ""
    nodes = "-" if t["nodes_per_round"] is None else f"{t['nodes_per_round']:.1f}"
    return f"{shape}: {t['speedup']:.2f}{_range(t)}, {nodes}{chosen}"


def _range(result: dict) -> str:
    """`` (min-max)`` of the speedup over repeats, when they differ."""
    spread = result.get("speedup_spread")
    if not spread or spread["min"] == spread["max"]:
        return ""
    return f" ({spread['min']:.2f}-{spread['max']:.2f})"


def _plot(run_dir: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_s) = plt.subplots(1, 2, figsize=(10, 4))
    for temp in map(str, report["temperatures"]):
        rows = sorted((r[temp]["step"], r[temp]) for r in report["results"].values() if temp in r)
        if not rows:
            continue
        steps = [s for s, _ in rows]
        ax_a.plot(steps, [r["acceptance_rate"] for _, r in rows], marker="o", label=f"T={temp}")
        chosen = [chosen_figures(r) for _, r in rows]
        speedups = [f["speedup"] for f in chosen]
        spreads = [f.get("speedup_spread") or {"min": x, "max": x} for f, x in zip(chosen, speedups, strict=True)]
        low = [x - s["min"] for x, s in zip(speedups, spreads, strict=True)]
        high = [s["max"] - x for x, s in zip(speedups, spreads, strict=True)]
        ax_s.errorbar(steps, speedups, yerr=[low, high], marker="o", capsize=3, label=f"T={temp}")
    ax_a.set(xlabel="step", ylabel="acceptance rate alpha", title="acceptance")
    ax_s.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_s.set(xlabel="step", ylabel="measured speedup", title="speedup (best gamma or tree; bars: min-max)")
    for ax in (ax_a, ax_s):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(run_dir / "speedup.png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
