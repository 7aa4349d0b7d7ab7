"""``draftsmith eval --batch-sizes``: the fastest gamma of a (target, draft) pair at each batch size.

At each size the gamma is chosen as ``eval-run`` chooses it at batch 1 (``speedup.measure_batch_size``:
alpha, c and v measured at a base gamma, beside the target alone at that size, predict each gamma of
``--gammas``, and the best one is measured there too); a size where the best measured speedup stays
below 1.0 gets gamma 0, drafting off. Past batch 1 the pair runs in float32 unless ``--dtype`` is
given (``measuring_dtype``), and each size's entry names its dtype. With ``--engine vllm`` every
gamma is also measured in vLLM at each size (``engine_eval.engine_schedule``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from draftsmith.engine_eval import engine_schedule, format_engine_schedule
from draftsmith.options import GAMMAS, parse_list
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import eos_token_ids, resolve_dtype
from draftsmith.specdec.measure.settings import MeasureSettings, measuring_dtype
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt
from draftsmith.train import speedup
from draftsmith.train.batch_schedule import SCHEDULE_KEY, format_ranges, parse_batch_sizes

# The options --batch-sizes replaces or cannot take, by flag: whether each was given.
REPLACED = {
    "--gamma": lambda args: args.gamma is not None,
    "--tree": lambda args: args.tree is not None,
    "--batch-size": lambda args: args.batch_size != 1,
    "--confidence-threshold": lambda args: args.confidence_threshold is not None,
    "--compare-hf": lambda args: args.compare_hf,
    "--engine-batch-sizes": lambda args: args.engine_batch_sizes is not None,
}


def measure_settings(
    args: argparse.Namespace, prompts: list[Prompt], options: DecodeOptions, eos_ids, batch_size: int = 1
) -> MeasureSettings:
    """What ``eval`` measures, from its arguments: ``options`` over ``prompts``, ``batch_size`` together."""
    return MeasureSettings(
        prompts,
        options=options,
        max_new_tokens=args.max_new_tokens,
        eos_ids=eos_ids,
        seed=args.seed,
        repeats=args.repeats,
        batch_size=batch_size,
        progress=not args.no_progress,
    )


def batch_size_options() -> argparse.ArgumentParser:
    """--batch-sizes and the --gammas it chooses from."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="choose the fastest gamma at each of these batch sizes (e.g. 1,4,16) instead of measuring one gamma: "
        "gamma 0 where drafting does not pay; with --engine vllm, in vLLM too",
    )
    p.add_argument("--gammas", default=None, help=f"with --batch-sizes: the gammas chosen from (default: {GAMMAS})")
    return p


def check_batch_size_options(args: argparse.Namespace) -> tuple[list[int], list[int]] | None:
    """The batch sizes and gammas of --batch-sizes, or None without it; options it replaces refused."""
    if args.batch_sizes is None:
        if args.gammas is not None:
            raise DraftsmithError("--gammas applies with --batch-sizes (eval measures one --gamma otherwise)")
        return None
    for flag, given in REPLACED.items():
        if given(args):
            raise DraftsmithError(f"--batch-sizes chooses the gamma at each batch size; leave out {flag}")
    gammas = parse_list(args.gammas or GAMMAS, int, "gammas")
    if any(g < 1 for g in gammas):
        raise DraftsmithError(f"--gammas must all be >= 1, got {args.gammas}")
    return parse_batch_sizes(args.batch_sizes), gammas


def measure_batch_sizes(
    args: argparse.Namespace,
    options: DecodeOptions,
    prompts: list[Prompt],
    device: torch.device,
    load: Callable[[torch.dtype], tuple],
    plan: tuple[list[int], list[int]],
) -> dict:
    """Each batch size of ``plan`` (the sizes and gammas ``check_batch_size_options`` returned) measured
    with the pair ``load(dtype)`` gives (tokenizer, target, draft), loaded once per dtype; the report
    (``by_batch_size``, its ranges, and vLLM's with --engine vllm)."""
    sizes, gammas = plan
    resolved = resolve_dtype(args.dtype, device)
    pairs: dict[torch.dtype, tuple] = {}
    entries = {}
    for size in sizes:
        dtype = measuring_dtype(args.dtype, resolved, size)
        pairs[dtype] = pairs.get(dtype) or load(dtype)
        tokenizer, target, draft = pairs[dtype]
        settings = measure_settings(args, prompts, options, eos_token_ids(target, tokenizer))
        print(f"choosing the gamma at batch size {size} ({str(dtype).removeprefix('torch.')})")
        entries[str(size)] = speedup.measure_batch_size(target, draft, tokenizer, settings, gammas, size)
    report = {
        "target": args.target,
        "draft": args.draft,
        "gammas": gammas,
        "temperature": options.sampling.temperature,
        "by_batch_size": entries,
        SCHEDULE_KEY: speedup.schedule_of(entries),
    }
    if args.engine == "vllm":
        tokenizer, target, draft = pairs[resolved]  # batch 1's pair: vLLM runs it in that dtype
        report["engine_schedule"] = engine_schedule(
            args, target, draft, tokenizer, settings, specs=(args.target, args.draft), gammas=gammas, batch_sizes=sizes
        )
    return report


def format_batch_sizes(report: dict) -> str:
    """The table of each batch size, the schedule, and vLLM's search when it ran."""
    lines = [
        f"the fastest gamma at each batch size (gammas {','.join(map(str, report['gammas']))}, temperature "
        f"{report['temperature']}; gamma 0 where drafting measured slower than the target alone):",
        "",
        *speedup.batch_size_rows(report["by_batch_size"]),
        "",
        f"{SCHEDULE_KEY}: {format_ranges(report[SCHEDULE_KEY])}",
    ]
    if "engine_schedule" in report:
        lines += ["", format_engine_schedule(report["engine_schedule"])]
    return "\n".join(lines)
