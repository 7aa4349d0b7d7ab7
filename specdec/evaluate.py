"""Measure a (target, draft) pair: acceptance, tau, real speedup, and the speedup theory predicts.

Speedup is spec tokens/s over target-only tokens/s on the same prompts, the same
``max_new_tokens`` and stop rules, the same cache kind, after a warm-up, with the two decoders
interleaved batch by batch and the median over repeats taken (SPEC.md section 3). The baseline is
``decoder.target_generate``, a KV-cached decoder at least as fast as ``transformers`` ``generate``
(``benchmarks/decoder_vs_hf.py``).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.decoder import DecodeStats, speculative_generate, target_generate, tune_verify_widths
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.prompts import Prompt, check_length, encode_chat
from draftsmith.specdec.sampling import SamplingParams


def predicted_speedup(alpha: float, gamma: float, c: float, v: float = 1.0) -> float:
    """Expected speedup ``(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + v))``.

    Leviathan et al. 2023, Theorem 3.8 (there ``v = 1``); ``v`` is the cost of the verification
    forward over gamma+1 tokens in single-token steps. At ``alpha = 1`` the limit is ``(gamma+1) / (gamma c + v)``.
    """
    expected_tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / (gamma * c + v)


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
class _Tally:
    """Tokens and seconds of one decoder over one repeat."""

    tokens: int = 0
    seconds: float = 0.0
    stats: list[DecodeStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _sum_stats(stats: list[DecodeStats]) -> DecodeStats:
    total = DecodeStats()
    for s in stats:
        for name in total.__dataclass_fields__:
            setattr(total, name, getattr(total, name) + getattr(s, name))
    return total


def _batches(prompts: list[Prompt], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped by category, then cut into batches (so per-category timing is exact)."""
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_category[p.category].append(i)
    batches = []
    for indices in by_category.values():
        batches += [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    return batches


def hf_generate(
    target: PreTrainedModel,
    ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: frozenset[int],
    assistant: PreTrainedModel | None,
    gamma: int,
) -> list[int]:
    """Run ``transformers`` ``generate`` (assisted when ``assistant`` is given); return the new tokens."""
    kwargs: dict = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": sorted(eos_ids),
        "pad_token_id": sorted(eos_ids)[0],
    }
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p
        )
    if assistant is not None:
        kwargs.update(assistant_model=assistant, num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant")
    x = torch.tensor([ids], device=target.device)
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    return out[0, len(ids) :].tolist()


def evaluate_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    gamma: int = 4,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: frozenset[int] = frozenset(),
    seed: int = 0,
    repeats: int = 3,
    batch_size: int = 1,
    cache_kind: str | None = None,
    confidence_threshold: float | None = None,
    draft_greedy: bool = False,
    compare_hf: bool = False,
    progress: bool = True,
    decode=speculative_generate,
    tune_verify: bool = True,
) -> dict:
    """Run the baseline and the speculative decoder side by side; return the report as a dict.

    tune_verify: pad verification passes to the widths ``tune_verify_widths`` finds faster here.
    decode: the speculative decoder (``speculative_generate``, or ``self_spec.self_speculative_generate``
    for an early-exit draft that shares the target's cache); both take the same arguments.
    """
    if gamma < 1:
        raise DraftsmithError(f"gamma must be >= 1, got {gamma}")
    if batch_size < 1:
        raise DraftsmithError(f"batch size must be >= 1, got {batch_size}")
    if repeats < 1:
        raise DraftsmithError(f"repeats must be >= 1, got {repeats}")
    if compare_hf and batch_size != 1:
        raise DraftsmithError("--compare-hf needs --batch-size 1: transformers' assisted generation takes one sequence")
    context = target.config.max_position_embeddings
    device = target.device
    generator = torch.Generator(device=device)

    def encode(prompt: Prompt, history: list[dict]) -> list[int]:
        ids = encode_chat(tokenizer, history, prompt.text if len(prompt.turns) == 1 else None)
        check_length(ids, max_new_tokens, context, prompt.id)
        return ids

    # Verification widths that run faster padded, measured on this machine (single sequences only;
    # the shared-cache decoder verifies its own way).
    verify_widths = {}
    if tune_verify and batch_size == 1 and decode is speculative_generate:
        verify_widths = tune_verify_widths(target, gamma + 1)
    extra = {"verify_widths": verify_widths} if decode is speculative_generate else {}

    def run_spec(batch_ids):
        return decode(
            target,
            draft,
            batch_ids,
            max_new_tokens,
            gamma,
            sampling,
            eos_ids,
            generator,
            cache_kind,
            draft_greedy,
            confidence_threshold,
            **extra,
        )

    def run_target(batch_ids):
        return target_generate(target, batch_ids, max_new_tokens, sampling, eos_ids, generator, cache_kind)

    # Warm-up: the first calls pay for allocator growth and kernel selection.
    warm = [encode(prompts[0], prompts[0].turns[0])]
    generator.manual_seed(seed)
    _guard_memory(run_target, warm * batch_size)
    _guard_memory(run_spec, warm * batch_size)

    n_turns = max(len(p.turns) for p in prompts)
    repeat_tallies = []
    greedy_matches: list[bool] = []
    per_cat: dict[str, dict[str, _Tally]] = defaultdict(lambda: {"target": _Tally(), "spec": _Tally()})
    hf = {"assisted": _Tally(), "generate": _Tally()}
    total_steps = repeats * n_turns * len(_batches(prompts, batch_size))
    bar = tqdm(total=total_steps, desc="eval", disable=not progress, unit="batch")
    for rep in range(repeats):
        tally = {"target": _Tally(), "spec": _Tally()}
        answers: dict[int, list[dict]] = {i: [] for i in range(len(prompts))}  # conversation so far
        for turn in range(n_turns):
            todo = [p for p in range(len(prompts)) if len(prompts[p].turns) > turn]
            wave = [prompts[i] for i in todo]
            for batch in _batches(wave, batch_size):
                indices = [todo[i] for i in batch]
                ids = [encode(prompts[i], answers[i] + prompts[i].turns[turn]) for i in indices]
                category = prompts[indices[0]].category
                # Same seed for both decoders and every repeat: with sampling, the pair sees the same draws.
                generator.manual_seed(seed + rep)
                base_out, base_stats = _guard_memory(run_target, ids)
                generator.manual_seed(seed + rep)
                spec_out, spec_stats = _guard_memory(run_spec, ids)
                for name, stats in (("target", base_stats), ("spec", spec_stats)):
                    for t in (tally[name], per_cat[category][name]):
                        t.tokens += stats.new_tokens
                        t.seconds += stats.total_time
                        t.stats.append(stats)
                for row, i in enumerate(indices):
                    if rep == 0 and sampling.greedy:
                        greedy_matches.append(spec_out[row] == base_out[row])
                    reply = tokenizer.decode(base_out[row], skip_special_tokens=True)
                    answers[i] = answers[i] + prompts[i].turns[turn] + [{"role": "assistant", "content": reply}]
                if compare_hf:
                    for row in range(len(ids)):
                        for name, assistant in (("generate", None), ("assisted", draft)):
                            start = time.perf_counter()
                            new = hf_generate(target, ids[row], max_new_tokens, sampling, eos_ids, assistant, gamma)
                            hf[name].tokens += len(new)
                            hf[name].seconds += time.perf_counter() - start
                bar.update(1)
                bar.set_postfix(speedup=f"{tally['spec'].tokens_per_s / max(tally['target'].tokens_per_s, 1e-9):.2f}")
        repeat_tallies.append(tally)
    bar.close()
    report = _report(
        repeat_tallies,
        per_cat,
        hf if compare_hf else None,
        greedy_matches,
        sampling,
        gamma,
        batch_size,
        max_new_tokens,
        repeats,
        len(prompts),
    )
    report["verify_widths"] = {str(q): w for q, w in verify_widths.items()}
    return report


def _guard_memory(fn, batch_ids: list[list[int]]):
    """Call ``fn(batch_ids)``, turning an out-of-memory error into advice on the batch size."""
    batch_size = len(batch_ids)
    try:
        return fn(batch_ids)
    except torch.OutOfMemoryError as err:
        raise DraftsmithError(
            f"out of memory at batch size {batch_size}; try --batch-size {max(1, batch_size // 2)}"
        ) from err


def _pair_metrics(target: _Tally, spec: _Tally, gamma: int) -> dict:
    """alpha, tau, c, v and both speedups from the stats of one set of runs."""
    base, sp = _sum_stats(target.stats), _sum_stats(spec.stats)
    alpha = sp.acceptance_rate
    step = base.verify_time / base.rounds if base.rounds else float("nan")
    draft_steps = sp.draft_forwards - len(spec.stats)  # prefill forwards excluded
    c = (sp.draft_time / draft_steps) / step if draft_steps else float("nan")
    v = (sp.verify_time / sp.rounds) / step if sp.rounds else float("nan")
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
        "proposed": sp.proposed,
        "accepted": sp.accepted,
        "time_split_s": {
            "prefill": sp.prefill_time,
            "draft": sp.draft_time,
            "verify": sp.verify_time,
            "other": sp.other_time,
        },
    }


def _report(
    repeat_tallies, per_cat, hf, greedy_matches, sampling, gamma, batch_size, max_new_tokens, repeats, n_prompts
) -> dict:
    per_repeat = [_pair_metrics(t["target"], t["spec"], gamma) for t in repeat_tallies]
    median_rep = sorted(range(len(per_repeat)), key=lambda i: per_repeat[i]["speedup"])[len(per_repeat) // 2]
    report = dict(per_repeat[median_rep])  # alpha, c, v, ... from the median repeat
    target_tps = statistics.median(r["target_tokens_per_s"] for r in per_repeat)
    spec_tps = statistics.median(r["spec_tokens_per_s"] for r in per_repeat)
    report.update(
        target_tokens_per_s=target_tps,
        spec_tokens_per_s=spec_tps,
        speedup=spec_tps / target_tps,
        speedup_per_repeat=[r["speedup"] for r in per_repeat],
    )
    if report["predicted_speedup"]:
        report["efficiency"] = report["speedup"] / report["predicted_speedup"]
    report["greedy_match"] = (sum(greedy_matches) / len(greedy_matches)) if sampling.greedy else None
    report["per_category"] = {cat: _pair_metrics(t["target"], t["spec"], gamma) for cat, t in sorted(per_cat.items())}
    if hf is not None:
        report["hf_generate_tokens_per_s"] = hf["generate"].tokens_per_s
        report["hf_assisted_tokens_per_s"] = hf["assisted"].tokens_per_s
    report.update(
        gamma=gamma,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        prompts=n_prompts,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
    return report


def format_table(report: dict) -> str:
    """A plain-text table of the report, overall and per category."""

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

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
    lines.append(
        f"gamma={report['gamma']} batch={report['batch_size']} temperature={report['temperature']} "
        f"repeats={report['repeats']} prompts={report['prompts']}"
    )
    if report["greedy_match"] is not None:
        lines.append(f"greedy output identical to the target's: {report['greedy_match']:.0%} of prompts")
    if "hf_generate_tokens_per_s" in report:
        lines.append(
            f"transformers generate: {report['hf_generate_tokens_per_s']:.1f} t/s, "
            f"assisted generation: {report['hf_assisted_tokens_per_s']:.1f} t/s"
        )
    return "\n".join(lines)
