"""A (target, draft) pair measured in vLLM: acceptance from the engine's counters, speedup from the clock.

The same prompts (token ids), sampling settings and ``max_tokens`` go to two servers, the target
alone and the target with the draft at gamma, after a warm-up, the two interleaved repeat by repeat
(so a load change on a shared machine hits both alike) and the medians of the repeats compared. The
report's keys are those of the bundled decoder's report (``pair.evaluate_pair``), so the two
can stand side by side: ``acceptance_rate`` (alpha), ``mean_accepted_tokens`` (tau: tokens emitted
per verification, the target's own token included), ``target_tokens_per_s``, ``spec_tokens_per_s``,
``speedup``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import resolve_device
from draftsmith.specdec.measure.report import EngineReport
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_client import (
    Completion,
    SpecCounters,
    complete_batch,
    engine_version,
    read_spec_counters,
)
from draftsmith.specdec.vllm_server import Engine, ServeOptions, Server, serve

# Two servers share one GPU during a measurement; vLLM's default would give each 92 % of its memory.
PAIR_GPU_MEMORY_FRACTION = 0.45


@contextmanager
def serve_pair(
    target: str, speculative: dict, gamma: int, options: ServeOptions, engine: Engine | None = None
) -> Iterator[tuple[Server, Server]]:
    """Two servers for the ``with`` block: the target alone, and the target with the draft of
    ``speculative`` (its speculative config, as its kind gives it) at ``gamma``.

    options: how both servers run (dtype, threads, ...); on a GPU each takes at most
    ``PAIR_GPU_MEMORY_FRACTION`` of its memory unless ``options`` says otherwise.
    """
    if resolve_device(options.device).type == "cuda" and options.memory_fraction is None:
        options = dataclasses.replace(options, memory_fraction=PAIR_GPU_MEMORY_FRACTION)
    with ExitStack() as stack:
        baseline = stack.enter_context(serve(target, options, engine=engine))
        speculative_server = serve(target, options, speculative=speculative, gamma=gamma, engine=engine)
        yield baseline, stack.enter_context(speculative_server)


def measure_engine_gammas(
    target: str,
    speculative: dict,
    gammas: list[int],
    prompts_by_size: dict[int, list[list[int]]],
    settings: MeasureSettings,
    options: ServeOptions,
    engine: Engine | None = None,
) -> tuple[str, dict[int, dict[int, EngineReport]]]:
    """Each of ``gammas`` at each batch size in vLLM, beside the target alone: one server of the target
    alone for the whole search, and one with the draft of ``speculative`` per gamma in turn (a server's
    gamma is fixed when it starts); at each batch size the two are measured interleaved repeat by
    repeat (``measure_engine_pair``) on ``prompts_by_size[size]`` (token ids).

    settings: the new tokens, sampling, repeats and seed of every measurement (its prompts and batch
    size are not read). options: how the servers run (on a GPU each takes at most
    ``PAIR_GPU_MEMORY_FRACTION`` of its memory unless ``options`` says otherwise).
    Returns the engine's version and the reports by batch size, then gamma.
    """
    if resolve_device(options.device).type == "cuda" and options.memory_fraction is None:
        options = dataclasses.replace(options, memory_fraction=PAIR_GPU_MEMORY_FRACTION)
    reports: dict[int, dict[int, EngineReport]] = {size: {} for size in prompts_by_size}
    run = {"max_tokens": settings.max_new_tokens, "sampling": settings.options.sampling}
    run |= {"repeats": settings.repeats, "seed": settings.seed}
    with serve(target, options, engine=engine) as baseline:
        version = engine_version(baseline)
        for gamma in gammas:
            with serve(target, options, speculative=speculative, gamma=gamma, engine=engine) as drafted:
                for size, prompts in prompts_by_size.items():
                    if settings.progress:
                        print(f"vLLM, gamma {gamma}, batch {size}: {len(prompts)} prompts")
                    reports[size][gamma] = measure_engine_pair(baseline, drafted, prompts, batch_size=size, **run)
    return version, reports


def _timed_run(
    server: Server, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams, batch_size: int, seed: int
) -> tuple[list[Completion], float, SpecCounters]:
    """Answers, tokens/s and the counters' growth of one pass over ``prompts``."""
    before = read_spec_counters(server)
    answers, seconds = complete_batch(
        server, prompts, max_tokens=max_tokens, sampling=sampling, batch_size=batch_size, seed=seed
    )
    tokens = sum(len(a.token_ids) for a in answers)
    return answers, tokens / seconds, read_spec_counters(server) - before


def measure_engine_pair(
    baseline: Server,
    speculative: Server,
    prompts: list[list[int]],
    max_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    batch_size: int = 1,
    repeats: int = 3,
    seed: int = 0,
) -> EngineReport:
    """Target alone vs target + draft in vLLM on the same prompts; the report.

    baseline, speculative: servers of the same target, without and with a draft (``serve_pair``).
    Tokens/s are medians over ``repeats``; alpha, tau and the per-position acceptance count every
    round of every repeat. With sampling, prompt i draws with seed ``seed + i`` on both servers.
    """
    if speculative.gamma is None:
        raise DraftsmithError("the speculative server has no draft (gamma unknown); start it with a draft and gamma")
    if repeats < 1:
        raise DraftsmithError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise DraftsmithError("no prompts to measure")
    warm = prompts[:batch_size]
    for server in (baseline, speculative):  # first requests pay for allocations and kernel selection
        complete_batch(server, warm, max_tokens=min(max_tokens, 16), sampling=sampling, batch_size=batch_size)
    target_rates, spec_rates, matches = [], [], []
    counters = SpecCounters()
    for repeat in range(repeats):
        run = {"max_tokens": max_tokens, "sampling": sampling, "batch_size": batch_size, "seed": seed}
        base_answers, base_rate, _ = _timed_run(baseline, prompts, **run)
        spec_answers, spec_rate, grown = _timed_run(speculative, prompts, **run)
        target_rates.append(base_rate)
        spec_rates.append(spec_rate)
        counters = counters + grown
        if repeat == 0:
            matches = [b.token_ids == s.token_ids for b, s in zip(base_answers, spec_answers, strict=True)]
    return EngineReport(
        **engine_figures(target_rates, spec_rates, counters),
        greedy_match=sum(matches) / len(matches) if sampling.greedy else None,
        gamma=speculative.gamma,
        batch_size=batch_size,
        max_new_tokens=max_tokens,
        repeats=len(target_rates),
        prompts=len(prompts),
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        baseline_server=baseline.settings,
        speculative_server=speculative.settings,
    )


def engine_figures(target_rates: list[float], spec_rates: list[float], counters: SpecCounters) -> dict:
    """``EngineReport``'s figures over the repeats: medians and spread of tokens/s and speedup, and the
    acceptance from the counters' totals."""
    per_repeat = [s / t for s, t in zip(spec_rates, target_rates, strict=True)]
    target_tps, spec_tps = statistics.median(target_rates), statistics.median(spec_rates)
    return {
        "acceptance_rate": counters.acceptance_rate,
        "acceptance_per_position": counters.acceptance_per_position,
        "mean_accepted_tokens": counters.mean_accepted_tokens,
        "target_tokens_per_s": target_tps,
        "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / target_tps,
        "speedup_per_repeat": per_repeat,
        "speedup_spread": [min(per_repeat), max(per_repeat)],
        "target_tokens_per_s_per_repeat": target_rates,
        "spec_tokens_per_s_per_repeat": spec_rates,
        "drafts": counters.drafts,
        "proposed": counters.draft_tokens,
        "accepted": counters.accepted,
    }
