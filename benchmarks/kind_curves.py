"""Every registered drafter kind at the compute a user spends: each trained on the shipped data for a
few wall-clock budgets, each snapshot measured on held-out prompts.

Training: each kind's shipped config (``configs/smollm2-135m.yaml`` for the standalone LM,
``configs/smollm2-135m-KIND.yaml`` for the others, ``_`` written ``-``) on ``dataset: smollm2-self``,
with the config's own teacher settings (the kinds that read the target's features train from the
feature store where their config says so). One run per kind spends the largest budget as
``distill`` does with ``optim.max_minutes``: it times its first steps and plans as many as fit in
those minutes (its config's ``max_steps`` does not cap it: every kind trains for the same minutes),
its learning-rate schedule decaying to the planned last step. It is snapshotted (held-out alpha
logged, draft saved) when each budget of training-step minutes has passed: the smaller budgets are
points on that one run's curve, before its schedule has decayed. Set-up, a feature store's build,
held-out evaluations and checkpoint writing are not counted in the budget; they are reported
(``wall_s``). A config that fills its store during the first epoch (``teacher.cache_fill:
first_epoch``) builds it before training here, as the others do: a store is data, built once and
read by every later run, so no kind's budget pays for one. The machine's load is recorded around
each run.

Measured per snapshot, greedy, batch 1, on prompts never trained on (``distill/data/eval_prompts.jsonl``),
with eval-run's own measurement (``train.speedup.measure_draft``: each figure side by side with the
target alone): steps, tokens seen, held-out sum min(p, q) (the run's held-out alpha), the decoder's
acceptance at each draft position (``acceptance_by_position`` at the base gamma), c, v, the best gamma
and the measured speedup there (with the decoder's pacing, as a user decodes), the predicted speedup,
greedy identity, the lookup-guess tokens the paced run verified (and kept), and the speedup at the
best gamma once more with guesses off (the draft alone, so the kinds compare without lookup copies
mixed in; measured after the choice, side by side with the target as well). Written to
``benchmarks/results/kind_curves.json`` (``kind_curves_smoke.json`` with ``--smoke``)
with a PNG of alpha and speedup against minutes.

The default budgets (5, 15, 45 minutes) are for a CPU with native bfloat16; on one without (AVX2,
float32) pass smaller ones and the results say which were used.

Run (sum of the largest budget over the kinds, plus measuring, on 2 cores):
    .venv/bin/python benchmarks/kind_curves.py --budgets 5,15,45
Smoke test on the tiny target (a few minutes):
    .venv/bin/python benchmarks/kind_curves.py --smoke

The results file is rewritten after every kind, with the machine that kind ran on. A run that
stopped part-way goes on with ``--continue`` (same settings): finished kinds are kept, the kind it
was training starts again. ``--table`` prints the results as a markdown table (the one in
docs/benchmarks.md) and draws the plot again, running nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch
from common import PROMPTS, RESULTS, machine, save
from kind_runs import decoding_draft, train_snapshots

from draftsmith.distill.drafts import KINDS
from draftsmith.specdec.loading import cpu_has_native_bfloat16, eos_token_ids
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts
from draftsmith.train.config import DistillConfig, load_config, with_settings
from draftsmith.train.models import load_target
from draftsmith.train.speedup import confirm_draft, measure_draft

CONFIGS = Path(__file__).parents[1] / "configs"
UNCAPPED = 1_000_000  # max_steps under a budget of minutes: the budget alone sets the steps
# --smoke: configs/tiny.yaml as each kind, with the options a kind cannot do without there
SMOKE_OVERRIDES = {
    "lm": [],
    "early_exit": ["draft.layers=2"],
    "eagle3": ["draft.vocab=30"],
    "parallel": ["draft.options={mask_token_id: 2, k: 4}"],
    "dflash": ["draft.options={mask_token_id: 2, block_size: 4}"],
}


def kind_config(kind: str, smoke: bool) -> tuple[Path, list[str]]:
    """The shipped config a kind trains from, and the overrides that put it on the shipped data."""
    if smoke:
        return CONFIGS / "tiny.yaml", [f"draft.kind={kind}", *SMOKE_OVERRIDES.get(kind, [])]
    name = "smollm2-135m.yaml" if kind == "lm" else f"smollm2-135m-{kind.replace('_', '-')}.yaml"
    return CONFIGS / name, ["data.dataset=smollm2-self"]


def measure_snapshot(target, tokenizer, folder: Path, args) -> dict:
    """eval-run's measurement of one saved draft on the held-out prompts (greedy, batch 1, paced)."""
    eos = eos_token_ids(target, tokenizer)
    settings = MeasureSettings(
        read_prompts(PROMPTS)[: args.prompts],
        options=DecodeOptions(pace=True),
        max_new_tokens=args.max_new_tokens,
        eos_ids=eos,
        repeats=args.repeats,
        progress=False,
    )
    draft = decoding_draft(folder, target, eos)
    measured = measure_draft(target, draft, tokenizer, settings, args.gammas).to_json()
    # The draft alone: the best gamma again with lookup guesses off, so kinds compare without copies mixed in.
    alone = dataclasses.replace(settings, options=DecodeOptions(pace=True, guesses=False))
    draft_alone = confirm_draft(target, draft, tokenizer, alone, measured["best_gamma"])
    keys = ("cost_ratio_c", "verify_ratio_v", "speedup", "predicted_speedup", "greedy_match", "paused_share")
    return {
        "best_gamma": measured["best_gamma"],
        **{k: measured[k] for k in keys},
        "speedup_spread": measured["speedup_spread"],
        "guesses": measured["guesses"],
        "guesses_accepted": measured["guesses_accepted"],
        "speedup_guesses_off": draft_alone["speedup"],
        "greedy_match_guesses_off": draft_alone["greedy_match"],
        "alpha_per_position": measured["at_base_gamma"]["acceptance_by_position"],
        "base_gamma": measured["base_gamma"],
        "speedup_at_base_gamma_unpaced": measured["at_base_gamma"]["speedup"],
    }


def earlier_kinds(path: Path, settings: dict, dtype: str, parser) -> tuple[dict, dict]:
    """The finished kinds of the run ``--continue`` goes on with, and the machines they ran on."""
    if not path.is_file():
        parser.error(f"--continue: no earlier results at {path}")
    earlier = json.loads(path.read_text())

    def comparable(chosen: dict) -> dict:  # the kinds may differ: a continued run may add some
        return {k: v for k, v in json.loads(json.dumps(chosen)).items() if k != "kinds"}

    if (comparable(earlier["settings"]), earlier["dtype"]) != (comparable(settings), dtype):
        other = f"{earlier['settings']}, {earlier['dtype']}"
        parser.error(f"--continue: {path} was measured with other settings or dtype: {other}")
    kinds = {k: v for k, v in earlier.items() if k in KINDS}
    return kinds, {k: earlier.get("machines", {}).get(k, earlier.get("machine")) for k in kinds}


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_alpha, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    budgets = sorted({p["budget_minutes"] for points in curves.values() for p in points})
    for kind, points in curves.items():
        # at the minutes a kind trained: a run that reached its config's max_steps stops short of a budget
        minutes = [p["train_s"] / 60 for p in points]
        ax_alpha.plot(minutes, [p["alpha_per_position"][0] for p in points], marker="o", label=kind)
        ax_speed.plot(minutes, [p["speedup"] for p in points], marker="o", label=kind)
    ax_alpha.set(xlabel="training minutes", ylabel="greedy alpha at draft position 1", title="acceptance")
    ax_speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_speed.set(xlabel="training minutes", ylabel="measured speedup (best gamma)", title="speedup, side by side")
    for ax in (ax_alpha, ax_speed):
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: dict) -> str:
    """The results as a markdown table: one row per kind and budget."""
    lines = [
        "| kind | minutes | steps | tokens | held-out Σ min(p,q) | α by position (base γ) | c | best γ "
        "| speedup (predicted) | guesses (kept) | guesses off | greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in (k for k in KINDS if k in results):
        for p in results[kind]:
            alphas = " / ".join("–" if a is None else f"{a:.2f}" for a in p["alpha_per_position"])
            greedy = "identical" if p["greedy_match"] == 1.0 else f"{p['greedy_match']:.3f}"
            # results measured before the guess figures were recorded show a dash there
            guesses = f"{p['guesses']} ({p['guesses_accepted']})" if "guesses" in p else "–"
            alone = f"{p['speedup_guesses_off']:.2f}×" if "speedup_guesses_off" in p else "–"
            lines.append(
                f"| {kind} | {p['budget_minutes']:g} ({p['train_s'] / 60:.1f} trained) | {p['steps']} "
                f"| {p['tokens'] / 1000:.0f} k | {p['heldout_sum_min_pq']:.3f} | {alphas} | {p['cost_ratio_c']:.3f} "
                f"| {p['best_gamma']} | {p['speedup']:.2f}× ({p['predicted_speedup']:.2f}×) | {guesses} | {alone} "
                f"| {greedy} |"
            )
    return "\n".join(lines)


def arguments() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="5,15,45", help="training minutes of the snapshots (comma-separated)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="registered kinds to train (default: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/kind_curves"))
    parser.add_argument("--gammas", type=lambda s: [int(g) for g in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts of the speedup measurement")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny target, a few seconds of training each")
    parser.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on with the run whose results file and --out are there (same settings): keep its finished kinds",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every kind's run (draft.layers=0,29); repeatable; recorded in the results",
    )
    parser.add_argument(
        "--name",
        help="results file name under benchmarks/results (default kind_curves, kind_curves_smoke with --smoke)",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the results file (or --smoke's) as a markdown table and draw its plot again; run nothing",
    )
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    name = args.name or ("kind_curves_smoke" if args.smoke else "kind_curves")
    if args.table:
        results = json.loads((RESULTS / f"{name}.json").read_text())
        print(table(results))
        plot({k: v for k, v in results.items() if k in KINDS}, RESULTS / f"{name}.png")
        return
    budgets = sorted(float(b) for b in args.budgets.split(","))
    if args.smoke:
        budgets, args.prompts, args.max_new_tokens, args.repeats, args.gammas = [0.02, 0.05], 2, 16, 1, [1, 2]
    kept_out = ("out", "resume", "table", "name")
    settings = {k: v for k, v in vars(args).items() if k not in kept_out} | {"budgets": budgets}
    settings["steps"] = "planned for the largest budget"  # as optim.max_minutes plans them, max_steps uncapped
    dtype = torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    curves, machines = {}, {}
    if args.resume:
        curves, machines = earlier_kinds(RESULTS / f"{name}.json", settings, dtype_name, parser)
    elif args.out.exists():
        parser.error(f"{args.out} exists (an earlier run's drafts): remove it, pass another --out, or --continue")
    target = None
    for kind in args.kinds.split(","):
        if kind in curves:
            print(f"{kind}: measured by the earlier run, kept")
            continue
        if (args.out / kind).exists():
            print(f"{kind}: the earlier run stopped while training it; starting it again")
            shutil.rmtree(args.out / kind)
        config, overrides = kind_config(kind, args.smoke)
        overrides = [*overrides, *args.overrides, f"optim.max_minutes={budgets[-1]}", f"optim.max_steps={UNCAPPED}"]
        cfg = load_config(DistillConfig, str(config), [*overrides, f"output_dir={args.out / kind}"])
        if cfg.teacher.cache and cfg.teacher.cache_fill != "before":  # every store built before the budget starts
            overrides.append("teacher.cache_fill=before")
            cfg = with_settings(cfg, {"teacher.cache_fill": "before"})
        print(f"{kind}: {config.name} {' '.join(overrides)}, snapshots at {budgets} training minutes")
        curves[kind] = []
        for budget, trained, folder in train_snapshots(cfg, budgets):
            if target is None:
                target, tokenizer = load_target(cfg, torch.device("cpu"), dtype)
            point = {"budget_minutes": budget, **trained, **measure_snapshot(target, tokenizer, folder, args)}
            curves[kind].append(point)
            print(
                f"  {budget:g} min: {point['steps']} steps, {point['tokens']} tokens, held-out sum min(p,q) "
                f"{point['heldout_sum_min_pq']:.3f}, alpha by position "
                f"{[None if a is None else round(a, 3) for a in point['alpha_per_position']]}, c "
                f"{point['cost_ratio_c']:.3f}, gamma {point['best_gamma']}, speedup {point['speedup']:.2f}x "
                f"(predicted {point['predicted_speedup']:.2f}x), greedy {point['greedy_match']}, lookup guesses "
                f"{point['guesses']} ({point['guesses_accepted']} kept), "
                f"guesses off {point['speedup_guesses_off']:.2f}x"
            )
        machines[kind] = machine()
        done = all(k in curves for k in args.kinds.split(","))
        save(name, {"settings": settings, "dtype": dtype_name, "complete": done, "machines": machines, **curves})
    plot(curves, RESULTS / f"{name}.png")
    print(f"plot: {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
