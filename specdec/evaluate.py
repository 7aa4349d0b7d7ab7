"""Measure a (target, draft) pair: acceptance, tau, real speedup, and the speedup theory predicts.

Speedup is spec tokens/s over target-only tokens/s on the same prompts, the same
``max_new_tokens`` and stop rules, the same cache kind, after a warm-up, with the two decoders
interleaved batch by batch and the median over repeats taken. The baseline is
``decoder.target_generate``, a KV-cached decoder at least as fast as ``transformers`` ``generate``
(``benchmarks/decoder_vs_hf.py``), so the speedup is not inflated by a slow reference.

In compiled mode (``DecodeOptions.compile``, by default on CUDA) both decoders run compiled, and
the warm-up compiles and captures every graph before anything is timed: its seconds are reported
as ``compile_s``, apart from every tokens/s.

The cost ratios come from the same runs: c = one draft step / one target single-token step, v = one
verification forward / one target single-token step (``step_costs``); ``measure_cost_ratio`` times
c on its own, for a draft that is not being evaluated (during training). With a token tree
(``DecodeOptions.tree``) a draft step is one forward over a level's nodes, a verification is the one
forward over all the tree's nodes, and the report adds the nodes verified per round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.compiled import compiled_graphs, resolve_compile
from draftsmith.specdec.decoder import DecodeStats, decodes_compiled, speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.hf_compare import AssistedRounds, Round, configure_assistant, hf_generate
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt, check_length, encode_chat
from draftsmith.specdec.timing import eval_mode
from draftsmith.specdec.verify import tune_verify_widths


def predicted_speedup(alpha: float, gamma: float, c: float, v: float = 1.0) -> float:
    """Expected speedup ``(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + v))``.

    Leviathan et al. 2023, Theorem 3.8 (there ``v = 1``); ``v`` is the cost of the verification
    forward over gamma+1 tokens in single-token steps. At ``alpha = 1`` the limit is ``(gamma+1) / (gamma c + v)``.
    """
    expected_tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / (gamma * c + v)


def predicted_tree_speedup(spec: DecodeStats, c: float, v: float, calls: int) -> float | None:
    """Expected speedup of token-tree rounds: tau tokens per round for the round's draft forwards
    (one per level, each c single-token target steps) and one verification (v steps).

    There is no closed form in alpha as for chains (which tokens a tree offers depends on the draft's
    whole distribution), so tau is the measured one; ``spec`` sums ``calls`` decoding calls, whose
    draft prefills are not steps."""
    tau = spec.mean_accepted_tokens
    if tau is None or not spec.rounds or math.isnan(c) or math.isnan(v):
        return None
    draft_steps = (spec.draft_forwards - calls) / spec.rounds
    return tau / (draft_steps * c + v)


def alpha_from_tau(tau: float, gamma: int) -> float:
    """The per-position acceptance rate a that gives ``tau = (1 - a^(gamma+1)) / (1 - a)`` tokens per round.

    The measured acceptance rate (accepted / proposed) counts the draft tokens after the first
    rejection of a round as proposed, so for gamma > 1 it is lower than the chance that one
    position is accepted; this inverts the i.i.d. model of Leviathan et al. instead (bisection).
    At gamma = 1 both are the same number.
    """
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (gamma + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Tally:
    """Tokens and seconds of one decoder over one repeat, and the stats of each of its calls."""

    tokens: int = 0
    seconds: float = 0.0
    stats: list[DecodeStats] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # the target's: each call's tokens per sequence

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, stats: DecodeStats) -> None:
        self.tokens += stats.new_tokens
        self.seconds += stats.total_time
        self.stats.append(stats)


@dataclass
class Baseline:
    """Target-only runs over a prompt set, timed once (``measure_baseline``) and shared by the drafts
    ``evaluate_pair`` measures against it: one Tally per repeat, its stats and outputs in the order in
    which a repeat visits the batches. ``settings``: what the runs depend on (``baseline_settings``)."""

    settings: dict
    repeats: list[Tally]


def baseline_settings(
    prompts: list[Prompt], max_new_tokens: int, options: DecodeOptions, seed: int, batch_size: int
) -> dict:
    """What target-only runs depend on: prompts, length, sampling, seeds, batching and cache kind."""
    sampling = options.sampling
    return {
        "prompts": [(p.id, p.category, p.turns, p.text) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "sampling": (sampling.temperature, sampling.top_k, sampling.top_p),
        "seed": seed,
        "batch_size": batch_size,
        "cache_kind": options.cache_kind,
        "compile": options.compile,
    }


def measure_baseline(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    *,
    options: DecodeOptions = DecodeOptions(),
    max_new_tokens: int = 128,
    eos_ids: frozenset[int] = frozenset(),
    seed: int = 0,
    repeats: int = 3,
    batch_size: int = 1,
    progress: bool = True,
) -> Baseline:
    """Time the target-only decoder over ``prompts`` once, as ``evaluate_pair`` would beside a draft
    (same seeds, batches and turns; ``options``: its sampling and cache kind), for several drafts to share."""
    options = dataclasses.replace(options, compile=resolve_compile(options.compile, target))
    generator = torch.Generator(device=target.device)
    pair = _Pair(target, None, tokenizer, options, max_new_tokens, frozenset(eos_ids), generator)
    sizes = {len(batch) for batch in _batches(prompts, batch_size)} if options.compile else {batch_size}
    _warm_up(pair, pair.encode(prompts[0], prompts[0].turns[0]), sizes, seed)
    runs, _ = _run_repeats(
        pair,
        prompts,
        seed=seed,
        repeats=repeats,
        batch_size=batch_size,
        hf=None,
        greedy_matches=None,
        progress=progress,
        baseline=None,
    )
    return Baseline(baseline_settings(prompts, max_new_tokens, options, seed, batch_size), [r["target"] for r in runs])


def sum_stats(stats: list[DecodeStats]) -> DecodeStats:
    """The counters and timings of several decoding calls added up."""
    total = DecodeStats()
    for s in stats:
        for name in total.__dataclass_fields__:
            setattr(total, name, getattr(total, name) + getattr(s, name))
    return total


def single_step_time(baseline: DecodeStats) -> float:
    """Seconds of one single-token step of a target-only run (prefill excluded); nan without steps."""
    return baseline.verify_time / baseline.rounds if baseline.rounds else math.nan


def step_costs(baseline: DecodeStats, spec: DecodeStats, calls: int) -> tuple[float, float]:
    """(c, v) from a target-only run and a speculative run on the same prompts, each the sum of
    ``calls`` decoding calls: c = one draft step / one target step, v = one verification / one
    target step. The draft's prefill forwards (one per call) are not steps."""
    step = single_step_time(baseline)
    draft_steps = spec.draft_forwards - calls
    c = spec.draft_time / draft_steps / step if draft_steps else math.nan
    v = spec.verify_time / spec.rounds / step if spec.rounds else math.nan
    return c, v


def measure_cost_ratio(target: PreTrainedModel, draft: torch.nn.Module, prompt_len: int = 32, steps: int = 16) -> float:
    """c = one draft decoding step / one target decoding step, each timed decoding alone (as the
    target-only baseline decodes), for a draft that is not being evaluated as a pair."""
    prompt = [[t % target.config.vocab_size for t in range(1, prompt_len + 1)]]
    step = {}
    with eval_mode(target, draft):
        for name, model in (("target", target), ("draft", draft)):
            target_generate(model, prompt, 4)  # warm-up
            step[name] = single_step_time(target_generate(model, prompt, steps + 1)[1])
    return step["draft"] / step["target"]


def _batches(prompts: list[Prompt], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped by category, then cut into batches (so per-category timing is exact)."""
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_category[p.category].append(i)
    batches = []
    for indices in by_category.values():
        batches += [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    return batches


@dataclass
class _Pair:
    """The pair under measurement and the settings both decoders share."""

    target: PreTrainedModel
    draft: torch.nn.Module | None  # None: the target-only baseline alone (``measure_baseline``)
    tokenizer: PreTrainedTokenizerBase
    options: DecodeOptions
    max_new_tokens: int
    eos_ids: frozenset[int]
    generator: torch.Generator

    def encode(self, prompt: Prompt, history: list[dict]) -> list[int]:
        ids = encode_chat(self.tokenizer, history, prompt.text if len(prompt.turns) == 1 else None)
        check_length(ids, self.max_new_tokens, self.target.config.max_position_embeddings, prompt.id)
        return ids

    def run_target(self, batch_ids: list[list[int]]) -> tuple[list[list[int]], DecodeStats]:
        return _guard_memory(
            lambda: target_generate(
                self.target,
                batch_ids,
                self.max_new_tokens,
                sampling=self.options.sampling,
                eos_ids=self.eos_ids,
                generator=self.generator,
                cache_kind=self.options.cache_kind,
                compile=self.options.compile,
            ),
            len(batch_ids),
        )

    def run_spec(self, batch_ids: list[list[int]]) -> tuple[list[list[int]], DecodeStats]:
        return _guard_memory(
            lambda: speculative_generate(
                self.target,
                self.draft,
                batch_ids,
                self.max_new_tokens,
                options=self.options,
                eos_ids=self.eos_ids,
                generator=self.generator,
            ),
            len(batch_ids),
        )

    def time_hf(self, ids: list[int], hf: HFComparison) -> None:
        """``transformers`` generate and assisted generation on one prompt, on the stock copies in ``hf``."""
        for name, assistant in (("generate", None), ("assisted", hf.assistant)):
            rounds = AssistedRounds(hf.target, hf.assistant, len(ids) + self.max_new_tokens, self.eos_ids)
            start = time.perf_counter()
            with rounds if assistant is not None else contextlib.nullcontext():
                new = hf_generate(
                    hf.target,
                    ids,
                    self.max_new_tokens,
                    sampling=self.options.sampling,
                    eos_ids=self.eos_ids,
                    assistant=assistant,
                )
            hf.tallies[name].tokens += len(new)
            hf.tallies[name].seconds += time.perf_counter() - start
            if assistant is not None:
                rounds.check(self.options.gamma)
                hf.rounds += rounds.rounds


@dataclass
class HFComparison:
    """Stock ``transformers`` copies of the pair (loaded apart from the models the bundled decoder
    runs, which it switches to row-exact attention) and what was timed on them."""

    target: PreTrainedModel
    assistant: PreTrainedModel
    tallies: dict[str, Tally] = field(default_factory=lambda: {"generate": Tally(), "assisted": Tally()})
    rounds: list[Round] = field(default_factory=list)

    def report(self, gamma: int) -> dict:
        """tokens/s of both, and the assistant's drafted tokens per round that had room for ``gamma``."""
        full = [r.drafted for r in self.rounds if r.room >= gamma and not r.ended_with_eos]
        histogram: dict[str, int] = defaultdict(int)
        for r in self.rounds:
            histogram[str(r.drafted)] += 1
        return {
            "hf_generate_tokens_per_s": self.tallies["generate"].tokens_per_s,
            "hf_assisted_tokens_per_s": self.tallies["assisted"].tokens_per_s,
            "hf_assisted_rounds": len(self.rounds),
            "hf_drafted_per_round": sum(full) / len(full) if full else None,
            "hf_drafted_histogram": dict(sorted(histogram.items())),
        }


def evaluate_pair(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    *,
    options: DecodeOptions = DecodeOptions(),
    max_new_tokens: int = 128,
    eos_ids: frozenset[int] = frozenset(),
    seed: int = 0,
    repeats: int = 3,
    batch_size: int = 1,
    compare_hf: HFComparison | None = None,
    progress: bool = True,
    tune_verify: bool = True,
    baseline: Baseline | None = None,
) -> dict:
    """Run the baseline and the speculative decoder side by side; return the report as a dict.

    baseline: target-only runs timed once for several drafts (``measure_baseline``), used instead of
    timing the target here when they match this call's settings (``baseline_shared`` in the report).
    options: how the speculative decoder decodes (its sampling is the baseline's too). compare_hf:
    stock copies of the pair to time ``transformers`` on too; the assistant's generation config is set
    to draft ``options.gamma`` tokens per round (``configure_assistant``), and the rounds are checked. tune_verify:
    at batch size 1 and without widths in ``options``, pad verification passes to the widths
    ``verify.tune_verify_widths`` finds faster on this machine. The report says whether the decoders
    ran compiled (``compile``), and then the warm-up's seconds (``compile_s``) and the graphs it compiled.
    """
    _check_evaluation(repeats, batch_size, compare_hf)
    compiled = decodes_compiled(target, draft, options)
    options = dataclasses.replace(options, compile=compiled)  # the baseline decodes as the pair does
    start, graphs = time.perf_counter(), compiled_graphs()
    if tune_verify and batch_size == 1 and not options.verify_widths and options.tree is None:
        widths = tune_verify_widths(target, options.gamma + 1, compiled=compiled)
        options = dataclasses.replace(options, verify_widths=widths)
    generator = torch.Generator(device=target.device)
    pair = _Pair(target, draft, tokenizer, options, max_new_tokens, frozenset(eos_ids), generator)
    warm = pair.encode(prompts[0], prompts[0].turns[0])
    _warm_up(pair, warm, {len(batch) for batch in _batches(prompts, batch_size)} if compiled else {batch_size}, seed)
    compiled_report = {
        "compile": compiled,
        "compile_s": time.perf_counter() - start if compiled else None,
        "compiled_graphs": compiled_graphs() - graphs if compiled else None,
    }

    hf = compare_hf
    if hf is not None:
        configure_assistant(hf.assistant.generation_config, options.gamma)
        pair.time_hf(warm, HFComparison(hf.target, hf.assistant))  # warm-up, not counted
    greedy_matches: list[bool] = []
    shared = _usable(baseline, baseline_settings(prompts, max_new_tokens, options, seed, batch_size), repeats)
    repeat_tallies, per_cat = _run_repeats(
        pair,
        prompts,
        seed=seed,
        repeats=repeats,
        batch_size=batch_size,
        hf=hf,
        greedy_matches=greedy_matches,
        progress=progress,
        baseline=shared,
    )
    report = report_from_repeats(
        repeat_tallies, per_cat, hf, greedy_matches, options.gamma, tree=options.tree is not None
    )
    report.update(
        gamma=options.gamma,
        tree=options.tree.text if options.tree is not None else None,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        prompts=len(prompts),
        temperature=options.sampling.temperature,
        top_k=options.sampling.top_k,
        top_p=options.sampling.top_p,
        verify_widths={str(q): w for q, w in options.verify_widths.items()},
        baseline_shared=shared is not None,
        **compiled_report,
    )
    return report


def _warm_up(pair: _Pair, ids: list[int], batch_sizes: set[int], seed: int) -> None:
    """Both decoders (the target alone without a draft) on ``ids`` at each of ``batch_sizes``: the first
    calls pay for allocator growth and kernel selection, and in compiled mode for compiling and
    capturing the graphs of each batch size."""
    for size in sorted(batch_sizes):
        pair.generator.manual_seed(seed)
        pair.run_target([ids] * size)
        if pair.draft is not None:
            pair.run_spec([ids] * size)


def _run_repeats(
    pair: _Pair,
    prompts: list[Prompt],
    *,
    seed: int,
    repeats: int,
    batch_size: int,
    hf: HFComparison | None,
    greedy_matches: list[bool] | None,
    progress: bool,
    baseline: Baseline | None,
) -> tuple[list[dict[str, Tally]], dict[str, dict[str, Tally]]]:
    """Every repeat (``_run_repeat``) under one progress bar: each repeat's tallies, and the tallies per
    category over all of them. The first repeat records greedy identity."""
    per_cat: dict[str, dict[str, Tally]] = defaultdict(lambda: {"target": Tally(), "spec": Tally()})
    total = repeats * max(len(p.turns) for p in prompts) * len(_batches(prompts, batch_size))
    desc = "eval" if pair.draft is not None else "target-only baseline"
    with tqdm(total=total, desc=desc, disable=not progress, unit="batch") as bar:
        tallies = [
            _run_repeat(
                pair,
                prompts,
                seed + rep,
                batch_size,
                per_cat,
                hf,
                greedy_matches if rep == 0 else None,
                bar,
                baseline=baseline.repeats[rep] if baseline is not None else None,
            )
            for rep in range(repeats)
        ]
    return tallies, per_cat


def _check_evaluation(repeats: int, batch_size: int, compare_hf: HFComparison | None) -> None:
    if batch_size < 1:
        raise DraftsmithError(f"batch size must be >= 1, got {batch_size}")
    if repeats < 1:
        raise DraftsmithError(f"repeats must be >= 1, got {repeats}")
    if compare_hf is not None and batch_size != 1:
        raise DraftsmithError("--compare-hf needs --batch-size 1: transformers' assisted generation takes one sequence")


def _usable(baseline: Baseline | None, settings: dict, repeats: int) -> Baseline | None:
    """``baseline`` when its runs are the ones this evaluation would time, else None (time them here)."""
    if baseline is None or baseline.settings != settings or len(baseline.repeats) != repeats:
        return None
    return baseline


def _run_repeat(
    pair: _Pair,
    prompts: list[Prompt],
    seed: int,
    batch_size: int,
    per_cat: dict[str, dict[str, Tally]],
    hf: HFComparison | None,
    greedy_matches: list[bool] | None,
    bar: tqdm,
    baseline: Tally | None = None,
) -> dict[str, Tally]:
    """One pass over every turn of every prompt, both decoders batch by batch; later turns see the
    target's earlier answers. Returns this repeat's tallies; also adds to ``per_cat`` and ``hf``,
    and appends to ``greedy_matches`` (when given, in greedy runs) whether each output is the target's.
    baseline: this repeat's target-only runs timed before, taken in order instead of running the target."""
    replay = iter(zip(baseline.outputs, baseline.stats, strict=True)) if baseline is not None else None
    tally = {"target": Tally(), "spec": Tally()}
    answers: dict[int, list[dict]] = {i: [] for i in range(len(prompts))}  # conversation so far
    for turn in range(max(len(p.turns) for p in prompts)):
        todo = [p for p in range(len(prompts)) if len(prompts[p].turns) > turn]
        for batch in _batches([prompts[i] for i in todo], batch_size):
            indices = [todo[i] for i in batch]
            ids = [pair.encode(prompts[i], answers[i] + prompts[i].turns[turn]) for i in indices]
            # Same seed for both decoders: with sampling, the pair sees the same draws.
            pair.generator.manual_seed(seed)
            base_out, base_stats = next(replay) if replay is not None else pair.run_target(ids)
            pair.generator.manual_seed(seed)
            spec_out, spec_stats = pair.run_spec(ids) if pair.draft is not None else (None, None)
            category = prompts[indices[0]].category
            tally["target"].outputs.append(base_out)
            for name, stats in (("target", base_stats), ("spec", spec_stats)):
                if stats is not None:
                    tally[name].add(stats)
                    per_cat[category][name].add(stats)
            for row, i in enumerate(indices):
                if greedy_matches is not None and spec_out is not None and pair.options.sampling.greedy:
                    greedy_matches.append(spec_out[row] == base_out[row])
                reply = pair.tokenizer.decode(base_out[row], skip_special_tokens=True)
                answers[i] = answers[i] + prompts[i].turns[turn] + [{"role": "assistant", "content": reply}]
            for row_ids in ids if hf is not None else []:
                pair.time_hf(row_ids, hf)
            bar.update(1)
            bar.set_postfix(speedup=f"{tally['spec'].tokens_per_s / max(tally['target'].tokens_per_s, 1e-9):.2f}")
    return tally


def _guard_memory(run, batch_size: int):
    """``run()``, turning an out-of-memory error into advice on the batch size."""
    try:
        return run()
    except torch.OutOfMemoryError as err:
        raise DraftsmithError(
            f"out of memory at batch size {batch_size}; try --batch-size {max(1, batch_size // 2)}"
        ) from err


def pair_metrics(target: Tally, spec: Tally, gamma: int, tree: bool = False) -> dict:
    """alpha, tau, c, v and both speedups from the stats of one set of runs (``tree``: token-tree rounds)."""
    base, sp = sum_stats(target.stats), sum_stats(spec.stats)
    alpha = sp.acceptance_rate
    c, v = step_costs(base, sp, calls=len(spec.stats))
    if tree:
        predicted = predicted_tree_speedup(sp, c, v, calls=len(spec.stats))
    else:
        predicted = predicted_speedup(alpha, gamma, c, v) if alpha is not None else None
    speedup = spec.tokens_per_s / target.tokens_per_s if target.tokens_per_s else None
    return {
        "acceptance_rate": alpha,
        "mean_accepted_tokens": sp.mean_accepted_tokens,
        "target_tokens_per_s": target.tokens_per_s,
        "spec_tokens_per_s": spec.tokens_per_s,
        "speedup": speedup,
        "cost_ratio_c": c,
        "verify_ratio_v": v,
        "predicted_speedup": predicted,
        "efficiency": speedup / predicted if speedup and predicted else None,
        "nodes_per_round": sp.nodes_per_round,  # tree rounds only
        "proposed": sp.proposed,
        "accepted": sp.accepted,
        "time_split_s": {
            "prefill": sp.prefill_time,
            "draft": sp.draft_time,
            "verify": sp.verify_time,
            "other": sp.other_time,
        },
    }


def report_from_repeats(
    repeat_tallies: list[dict[str, Tally]],
    per_cat: dict[str, dict[str, Tally]],
    hf: HFComparison | None,
    greedy_matches: list[bool],
    gamma: int,
    tree: bool = False,
) -> dict:
    """The overall figures (alpha, c, v, ... of the median repeat; speedup from the median tokens/s
    of each decoder), greedy identity, and the figures per category."""
    per_repeat = [pair_metrics(t["target"], t["spec"], gamma, tree) for t in repeat_tallies]
    median_rep = sorted(range(len(per_repeat)), key=lambda i: per_repeat[i]["speedup"])[len(per_repeat) // 2]
    report = dict(per_repeat[median_rep])
    target_tps = statistics.median(r["target_tokens_per_s"] for r in per_repeat)
    spec_tps = statistics.median(r["spec_tokens_per_s"] for r in per_repeat)
    report.update(
        target_tokens_per_s=target_tps,
        spec_tokens_per_s=spec_tps,
        speedup=spec_tps / target_tps,
        speedup_per_repeat=[r["speedup"] for r in per_repeat],
        speedup_spread=spread([r["speedup"] for r in per_repeat]),
        cost_ratio_c_spread=spread([r["cost_ratio_c"] for r in per_repeat]),
    )
    if report["predicted_speedup"]:
        report["efficiency"] = report["speedup"] / report["predicted_speedup"]
    report["greedy_match"] = sum(greedy_matches) / len(greedy_matches) if greedy_matches else None
    report["per_category"] = {
        cat: pair_metrics(t["target"], t["spec"], gamma, tree) for cat, t in sorted(per_cat.items())
    }
    if hf is not None:
        report.update(hf.report(gamma))
    return report


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
