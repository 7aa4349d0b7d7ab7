"""The bundled decoder beside vLLM for one (target, draft) pair: how well our figures predict the engine's.

At each batch size the same prompts, sampling settings, gamma and ``max_new_tokens`` go to
``pair.evaluate_pair`` (the bundled decoder: its measured speedup, and the speedup predicted
from its alpha, c and v) and to ``vllm_pair.measure_engine_pair`` (two vLLM servers, the target
alone and the target with the draft: alpha, per-position acceptance and tau from the engine's own
counters, tokens/s from the clock). The prompts' first turns are used, all in one category so that
batches fill, repeated in order up to the batch size when there are fewer. The bundled decoder runs
first, with no vLLM process alive; then the two servers start once for every batch size.

Each row sets the engine's measured speedup beside ours: ``predicted_over_engine`` is our
predicted speedup / vLLM's measured one (1.0: our prediction says what the engine delivers),
``measured_over_engine`` our measured speedup / vLLM's.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.report import EngineReport, PairReport
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tables import fmt
from draftsmith.specdec.measure.vllm_pair import measure_engine_pair, serve_pair
from draftsmith.specdec.prompts import Prompt, encode_chat
from draftsmith.specdec.vllm_client import engine_version
from draftsmith.specdec.vllm_server import ServeOptions, find_engine

BUNDLED_KEYS = ("acceptance_rate", "mean_accepted_tokens", "target_tokens_per_s", "spec_tokens_per_s", "speedup")
BUNDLED_KEYS += ("speedup_spread", "predicted_speedup", "cost_ratio_c", "verify_ratio_v", "greedy_match")
BUNDLED_KEYS += ("proposed", "accepted")
ENGINE_KEYS = ("acceptance_rate", "acceptance_per_position", "mean_accepted_tokens", "target_tokens_per_s")
ENGINE_KEYS += ("spec_tokens_per_s", "speedup", "speedup_spread", "greedy_match", "drafts", "proposed", "accepted")


def filled(prompts: list[Prompt], batch_size: int) -> list[Prompt]:
    """The prompts' first turns in one category, repeated in order up to ``batch_size`` when fewer."""
    if not prompts:
        raise DraftsmithError("no prompts to measure")
    count = max(len(prompts), batch_size)
    return [dataclasses.replace(prompts[i % len(prompts)], category="all") for i in range(count)]


def first_turn_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids of each prompt's first turn, chat template applied (as the bundled decoder encodes it)."""
    return [encode_chat(tokenizer, p.turns[0], p.text if len(p.turns) == 1 else None) for p in prompts]


def compare_with_engine(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    settings: MeasureSettings,
    *,
    target_spec: str,
    speculative: dict,
    batch_sizes: list[int],
    serve_options: ServeOptions = ServeOptions(),
) -> dict:
    """The pair in the bundled decoder and in vLLM at each of ``batch_sizes``; the report as a dict.

    settings: what both engines measure (its batch size is each of ``batch_sizes`` in turn).
    target_spec, speculative: what the vLLM servers load (the same models as ``target`` and
    ``draft``): the target's spec and the draft's speculative config as its kind gives it
    (``{"method": "draft_model", "model": folder}``). serve_options: how both servers run (dtype,
    threads, eager, ...).
    """
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise DraftsmithError(f"batch sizes must be >= 1, got {batch_sizes}")
    engine = find_engine()  # a missing vLLM is said before minutes of measuring
    runs = {size: filled(settings.prompts, size) for size in batch_sizes}
    bundled = {}
    for size, chosen in runs.items():
        if settings.progress:
            print(f"bundled decoder, batch {size}: {len(chosen)} prompts")
        at_size = dataclasses.replace(settings, prompts=chosen, batch_size=size)
        bundled[size] = evaluate_pair(target, draft, tokenizer, at_size)
    options = settings.options
    engine_runs = {}
    with serve_pair(target_spec, speculative, options.gamma, serve_options, engine) as (baseline, speculative_server):
        version = engine_version(baseline)
        for size, chosen in runs.items():
            if settings.progress:
                print(f"vLLM, batch {size}: {len(chosen)} prompts")
            engine_runs[size] = measure_engine_pair(
                baseline,
                speculative_server,
                first_turn_ids(tokenizer, chosen),
                max_tokens=settings.max_new_tokens,
                sampling=options.sampling,
                batch_size=size,
                repeats=settings.repeats,
                seed=settings.seed,
            )
        servers = {"baseline": baseline.settings, "speculative": speculative_server.settings}
    return {
        "engine": "vllm",
        "engine_version": version,
        "gamma": options.gamma,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "temperature": options.sampling.temperature,
        "top_k": options.sampling.top_k,
        "top_p": options.sampling.top_p,
        "rows": [comparison_row(size, bundled[size], engine_runs[size], len(runs[size])) for size in batch_sizes],
        "servers": servers,
    }


def comparison_row(batch_size: int, bundled: PairReport, engine: EngineReport, prompts: int) -> dict:
    """One batch size: the engine's figures, ours, and the two ratios of speedups."""
    ours, theirs = bundled.to_json(), engine.to_json()
    ours, theirs = {key: ours[key] for key in BUNDLED_KEYS}, {key: theirs[key] for key in ENGINE_KEYS}

    def over_engine(figure):
        return figure / theirs["speedup"] if figure is not None and theirs["speedup"] else None

    return {
        "batch_size": batch_size,
        "prompts": prompts,
        "vllm": theirs,
        "bundled": ours,
        "predicted_over_engine": over_engine(ours["predicted_speedup"]),
        "measured_over_engine": over_engine(ours["speedup"]),
    }


def format_comparison(report: dict) -> str:
    """A plain-text table: per batch size, vLLM's figures beside the bundled decoder's."""
    head = (
        f"{'batch':>5} | {'vLLM alpha':>10}{'tau':>6}{'target t/s':>11}{'spec t/s':>9}{'speedup':>8} | "
        f"{'ours alpha':>10}{'tau':>6}{'speedup':>8}{'predicted':>10} | {'predicted/vLLM':>14}"
    )
    lines = [
        f"vLLM {report['engine_version']} vs the bundled decoder, gamma {report['gamma']}, "
        f"temperature {report['temperature']}, {report['max_new_tokens']} new tokens, {report['repeats']} repeats",
        head,
        "-" * len(head),
    ]
    for row in report["rows"]:
        e, b = row["vllm"], row["bundled"]
        lines.append(
            f"{row['batch_size']:>5} | {fmt(e['acceptance_rate']):>10}{fmt(e['mean_accepted_tokens'], '.2f'):>6}"
            f"{fmt(e['target_tokens_per_s'], '.1f'):>11}{fmt(e['spec_tokens_per_s'], '.1f'):>9}"
            f"{fmt(e['speedup'], '.2f'):>8} | {fmt(b['acceptance_rate']):>10}{fmt(b['mean_accepted_tokens'], '.2f'):>6}"
            f"{fmt(b['speedup'], '.2f'):>8}{fmt(b['predicted_speedup'], '.2f'):>10} | "
            f"{fmt(row['predicted_over_engine'], '.2f'):>14}"
        )
    for row in report["rows"]:
        positions = " ".join(f"{a:.2f}" for a in row["vllm"]["acceptance_per_position"])
        lines.append(f"vLLM acceptance per draft position, batch {row['batch_size']}: {positions or '-'}")
    return "\n".join(lines)
