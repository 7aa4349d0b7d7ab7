"""``--engine vllm`` for ``draftsmith eval`` and ``eval-run``: the pair measured in vLLM beside the bundled decoder.

Both commands parse their usual options plus these; ``engine_report`` runs the comparison
(``specdec.measure.engine_compare``) for one loaded (target, draft) pair and returns its report. ``eval``
compares its pair; ``eval-run`` first measures the run as usual, then compares its best draft at
the best gamma and adds the comparison to the run's speedup report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from draftsmith.distill.drafts import engine_draft_folder, kind_of_folder, kind_of_model, load_draft
from draftsmith.options import check_engine_options, engine_options, parse_list
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text
from draftsmith.specdec.loading import eos_token_ids, resolve_device, resolve_dtype
from draftsmith.specdec.measure import machine
from draftsmith.specdec.measure.engine_compare import compare_with_engine, filled, first_turn_ids, format_comparison
from draftsmith.specdec.measure.report import EngineReport
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tables import fmt
from draftsmith.specdec.measure.vllm_pair import measure_engine_gammas
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_server import ServeOptions, check_engine_importable, find_engine
from draftsmith.train import speedup
from draftsmith.train.batch_schedule import SCHEDULE_KEY, format_ranges, gamma_that_pays, schedule_ranges
from draftsmith.train.config import load_run_config
from draftsmith.train.models import load_target

ENGINE_BATCH_SIZES = "1,16"
ENGINE_REPORT = "engine_report.md"  # eval-run --engine vllm: the comparison, in the run folder


def engine_eval_options() -> argparse.ArgumentParser:
    """--engine and its settings, and --engine-batch-sizes."""
    p = argparse.ArgumentParser(add_help=False, parents=[engine_options("where the pair is also measured")])
    p.add_argument(
        "--engine-batch-sizes",
        default=None,
        help="--engine vllm: batch sizes measured in both engines; prompts repeat to fill a batch "
        f"(default: {ENGINE_BATCH_SIZES})",
    )
    return p


def check_engine_eval_options(args: argparse.Namespace, unsupported: dict[str, object]) -> list[int]:
    """Refuse what the comparison cannot do; return the batch sizes (empty without --engine vllm).

    unsupported: the command's options that have no counterpart in vLLM, by flag, with their values.
    """
    check_engine_options(args)
    if args.engine != "vllm":
        if args.engine_batch_sizes is not None:
            raise DraftsmithError("--engine-batch-sizes applies to --engine vllm")
        return []
    args.engine_batch_sizes = args.engine_batch_sizes or ENGINE_BATCH_SIZES
    if args.engine_url is not None:
        raise DraftsmithError(
            "--engine-url: the comparison starts its own two servers (the target alone and with the draft)"
        )
    for flag, value in unsupported.items():
        if value:
            raise DraftsmithError(f"{flag} does not apply with --engine vllm (see --help); leave it out")
    sizes = parse_list(args.engine_batch_sizes, int, "engine-batch-sizes")
    if any(size < 1 for size in sizes):
        raise DraftsmithError(f"--engine-batch-sizes must be >= 1, got {args.engine_batch_sizes}")
    check_engine_importable(find_engine())  # said before the models load and the bundled decoder measures
    return sizes


def engine_report(
    args: argparse.Namespace,
    target,
    draft: torch.nn.Module,
    tokenizer,
    settings: MeasureSettings,
    *,
    target_spec: str,
    draft_spec: str,
    batch_sizes: list[int],
) -> dict:
    """The (target, draft) pair in vLLM and in the bundled decoder (full draft head in both), as a report.

    settings: what both engines measure (batch size aside: each of ``batch_sizes``). target_spec,
    draft_spec: the pair as the command names it (a model folder, alias, ``self``, ``truncate:N``);
    vLLM loads the same models.
    """
    notes = []
    options = settings.options
    if options.tree is not None:
        notes.append(f"chains of {options.gamma} draft tokens, not the tree {options.tree}: vLLM drafts chains")
        settings = dataclasses.replace(settings, options=dataclasses.replace(options, tree=None))
    if args.draft_vocab:
        notes.append(
            f"the draft's head is not cut to its {args.draft_vocab} most frequent tokens here: vLLM drafts with the "
            "full head, so both engines do"
        )
    serve_options = engine_serve_options(args, target, settings.seed)
    with tempfile.TemporaryDirectory(prefix="draftsmith-engine-draft-") as scratch:
        report = compare_with_engine(
            target,
            draft,
            tokenizer,
            settings,
            target_spec=target_spec,
            speculative=speculative_config(draft_spec, target_spec, draft, tokenizer, Path(scratch)),
            batch_sizes=batch_sizes,
            serve_options=serve_options,
        )
    report.update(target=target_spec, draft=draft_spec, dtype=serve_options.dtype, notes=notes)
    return report


def engine_serve_options(args: argparse.Namespace, target, seed: int) -> ServeOptions:
    """How the vLLM servers run: the target's dtype and device, as the bundled decoder runs it, and the
    command's --engine-* settings."""
    return ServeOptions(
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        threads=args.engine_threads,
        eager=args.engine_eager,
        kv_cache_gib=args.engine_kv_cache_gib,
        seed=seed,
    )


def engine_schedule(
    args: argparse.Namespace,
    target,
    draft: torch.nn.Module,
    tokenizer,
    settings: MeasureSettings,
    *,
    specs: tuple[str, str],
    gammas: list[int],
    batch_sizes: list[int],
) -> dict:
    """The fastest of ``gammas`` at each of ``batch_sizes`` in vLLM (``vllm_pair.measure_engine_gammas``),
    0 where none measured at least as fast as the target alone, and vLLM's ranges of them; as a report.

    specs: the (target, draft) pair as the command names it; vLLM loads the same models as ``target``
    and ``draft``, in ``target``'s dtype. The prompts' first turns fill each batch (``engine_compare.filled``).
    """
    serve_options = engine_serve_options(args, target, settings.seed)
    prompts = {size: first_turn_ids(tokenizer, filled(settings.prompts, size)) for size in batch_sizes}
    with tempfile.TemporaryDirectory(prefix="draftsmith-engine-draft-") as scratch:
        speculative = speculative_config(specs[1], specs[0], draft, tokenizer, Path(scratch))
        version, reports = measure_engine_gammas(specs[0], speculative, gammas, prompts, settings, serve_options)
    by_size = {str(size): engine_batch_entry(by_gamma) for size, by_gamma in reports.items()}
    sampling = settings.options.sampling
    return {
        "engine": "vllm",
        "engine_version": version,
        "target": specs[0],
        "draft": specs[1],
        "dtype": serve_options.dtype,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "gammas": gammas,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "by_batch_size": by_size,
        SCHEDULE_KEY: schedule_ranges({int(size): entry["gamma"] for size, entry in by_size.items()}),
    }


def engine_batch_entry(by_gamma: dict[int, EngineReport]) -> dict:
    """One batch size in vLLM: each gamma's speedup and acceptance, the fastest gamma and its figures,
    and ``gamma``, the fastest or 0 where it measured slower than the target alone."""
    speedups = {gamma: report.speedup for gamma, report in by_gamma.items()}
    fastest = max(speedups, key=speedups.get)
    best = by_gamma[fastest]
    return {
        "speedup_by_gamma": {str(gamma): speedup for gamma, speedup in speedups.items()},
        "acceptance_rate_by_gamma": {str(gamma): report.acceptance_rate for gamma, report in by_gamma.items()},
        "best_gamma": fastest,
        "speedup": best.speedup,
        "speedup_spread": best.speedup_spread,
        "acceptance_rate": best.acceptance_rate,
        "greedy_match": best.greedy_match,
        "prompts": best.prompts,
        "gamma": gamma_that_pays(fastest, best.speedup),
    }


def format_engine_schedule(report: dict) -> str:
    """Each batch size in vLLM: every gamma's speedup, the fastest, and the gamma served."""
    lines = [
        f"vLLM {report['engine_version']}, {report['dtype']}: the fastest gamma at each batch size "
        f"(temperature {report['temperature']}, {report['max_new_tokens']} new tokens, {report['repeats']} repeats)",
    ]
    for size, entry in report["by_batch_size"].items():
        each = ", ".join(f"gamma {g}: {fmt(x, '.2f')}x" for g, x in entry["speedup_by_gamma"].items())
        lines.append(f"batch {size}: {each}; gamma served {entry['gamma']}")
    lines.append(f"{SCHEDULE_KEY}: {format_ranges(report[SCHEDULE_KEY])}")
    return "\n".join(lines)


def speculative_config(draft_spec: str, target_spec: str, draft: torch.nn.Module, tokenizer, scratch: Path) -> dict:
    """vLLM's speculative config of the draft ``draft_spec``, as its kind gives it, for a folder the
    engine loads (a draft no folder holds yet, such as ``truncate:N``, is exported into ``scratch``)."""
    folder = Path(engine_draft_folder(draft_spec, target_spec, draft, tokenizer, scratch))
    kind = kind_of_folder(folder) if folder.is_dir() else None
    return (kind or kind_of_model(draft)).engine_config(folder)


def show_engine_report(report: dict, json_out: str | None) -> int:
    """Print the comparison table (and its note), write the JSON report when asked; the exit status."""
    print(format_comparison(report))
    for note in report["notes"]:
        print(f"note: {note}")
    if json_out:
        write_text(Path(json_out), json.dumps({**report, "machine": machine.machine()}, indent=2))
        print(f"report written to {json_out}")
    return 0


def engine_run_report(run_dir: Path, report: dict, args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    """The run's best draft, at its best gamma and the first temperature, in vLLM beside the bundled
    decoder: added to the speedup report as ``engine`` (JSON and Markdown); the report returned."""
    best = report.get("best")
    if best is None:
        raise DraftsmithError(f"{run_dir} has no best draft to measure in vLLM; nothing was measured")
    temperature = report["temperatures"][0]
    measured = report["results"][best][str(temperature)]
    cfg = load_run_config(run_dir)
    if cfg.target == "tiny":
        raise DraftsmithError("--engine vllm serves the run's target from its folder; a tiny target has none")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer = load_target(cfg, device, dtype)
    folder = str(run_dir / best)
    settings = MeasureSettings(
        read_prompts(args.prompts)[: args.limit],
        options=DecodeOptions(gamma=measured["best_gamma"], sampling=SamplingParams(temperature)),
        max_new_tokens=args.max_new_tokens,
        eos_ids=eos_token_ids(target, tokenizer),
        seed=cfg.seed,
        repeats=args.repeats,
        progress=not args.no_progress,
    )
    draft = load_draft(folder, target, device, dtype)
    comparison = engine_report(
        args,
        target,
        draft,
        tokenizer,
        settings,
        target_spec=cfg.target,
        draft_spec=folder,
        batch_sizes=batch_sizes,
    )
    report["engine"] = {"checkpoint": best, **comparison}
    speedup.write_report(run_dir, report)  # speedup_report.json carries it
    lines = [f"# {best} in vLLM, beside the bundled decoder", "", "```", format_comparison(report["engine"])]
    write_text(run_dir / ENGINE_REPORT, "\n".join([*lines, *(f"note: {n}" for n in comparison["notes"]), "```", ""]))
    return report


def engine_run_schedule(
    run_dir: Path, report: dict, args: argparse.Namespace, gammas: list[int], sizes: list[int]
) -> str:
    """The run's best draft at the first temperature in vLLM: the fastest of ``gammas`` at each of
    ``sizes`` (``engine_schedule``), added to the speedup report as ``engine_schedule`` (publish
    writes its ranges into the card's vLLM config); returns the lines printed."""
    best = report.get("best")
    if best is None:
        raise DraftsmithError(f"{run_dir} has no best draft to measure in vLLM; nothing was measured")
    temperature = report["temperatures"][0]
    cfg = load_run_config(run_dir)
    if cfg.target == "tiny":
        raise DraftsmithError("--engine vllm serves the run's target from its folder; a tiny target has none")
    device = resolve_device(args.device)
    target, tokenizer = load_target(cfg, device, resolve_dtype(args.dtype, device))
    folder = str(run_dir / best)
    settings = MeasureSettings(
        read_prompts(args.prompts)[: args.limit],
        options=DecodeOptions(sampling=SamplingParams(temperature)),
        max_new_tokens=args.max_new_tokens,
        seed=cfg.seed,
        repeats=args.repeats,
        progress=not args.no_progress,
    )
    draft = load_draft(folder, target, device, target.dtype)
    measured = engine_schedule(
        args, target, draft, tokenizer, settings, specs=(cfg.target, folder), gammas=gammas, batch_sizes=sizes
    )
    report["engine_schedule"] = {"checkpoint": best, **measured}
    speedup.write_report(run_dir, report)
    return format_engine_schedule(measured)
