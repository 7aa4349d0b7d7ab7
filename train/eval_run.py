"""Every draft of a run measured for real: ``initial/`` and each complete checkpoint, at each temperature.

The report (``speedup_report.json``, ``.md``, ``speedup.png``) and ``best.json`` are rewritten after
each draft, so an interruption loses nothing; drafts already measured with the same settings are
not measured again.
"""

from __future__ import annotations

import math
from pathlib import Path

from draftsmith.distill.draft_init import load_draft
from draftsmith.distill.early_exit import is_early_exit
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import eos_token_ids, resolve_device, resolve_dtype
from draftsmith.specdec.prompts import Prompt, read_prompts
from draftsmith.specdec.tree import TreeShape
from draftsmith.train import checkpoint, speedup
from draftsmith.train.config import load_run_config
from draftsmith.train.models import load_target


def evaluate_run(
    run_dir: Path,
    prompts_file: str | Path,
    gammas: list[int],
    temperatures: list[float],
    max_new_tokens: int = 64,
    limit: int | None = None,
    repeats: int = 1,
    force: bool = False,
    device: str | None = None,
    progress: bool = True,
    dtype: str | None = None,
    draft_vocab_size: int | None = None,
    trees: list[TreeShape] | None = None,
) -> dict:
    """Measure the drafts of ``run_dir`` not yet in its report; return the report (``best`` names the best draft).

    draft_vocab_size: decode with the draft's head cut to the N tokens most frequent in the training
    answers (0: the full head); None: the cut the run trained with (its ``train_draft_vocab``).
    trees: token-tree shapes measured beside the chain gammas (batch 1); the fastest is chosen over the
    chain when it measured faster (``speedup.choose_tree``)."""
    if any(g < 1 for g in gammas):
        raise DraftsmithError(f"gammas must be >= 1, got {gammas}")
    if limit is not None and limit < 1:
        raise DraftsmithError(f"--limit must be >= 1 (prompts to use; leave it out for all), got {limit}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    cfg = load_run_config(run_dir)
    if draft_vocab_size is None:
        draft_vocab_size = cfg.train_draft_vocab
    drafts = checkpoint.drafts_of_run(run_dir)
    if not drafts:
        raise DraftsmithError(f"{run_dir} has no checkpoints yet (no initial/ or checkpoint-*/ folders)")
    prompts = read_prompts(prompts_file)[:limit]
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    target, tokenizer = load_target(cfg, dev, torch_dtype)
    eos = eos_token_ids(target, tokenizer)
    ranking = draft_vocab.load_ranking(run_dir, draft_vocab_size) if draft_vocab_size else None

    settings = {
        "prompts": str(prompts_file),
        "gammas": gammas,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "draft_vocab": draft_vocab_size,
        "trees": [t.text for t in trees or []],
    }
    report = speedup.load_report(run_dir)
    if force or any(report.get(k) != v for k, v in settings.items()):
        report = {"results": {}}
    report.update(settings, run=str(run_dir), target=cfg.target, temperatures=temperatures, hardware=speedup.hardware())
    for name, step, folder in drafts:
        for temp in temperatures:
            if str(temp) in report["results"].get(name, {}):
                continue
            draft = load_draft(str(folder), target, dev, torch_dtype)
            if ranking and not is_early_exit(folder):
                draft = draft_vocab.SubsetHeadDraft(draft, ranking, eos)
            print(f"measuring {name} at temperature {temp}")
            result = measure(
                target,
                draft,
                tokenizer,
                prompts,
                gammas=gammas,
                temperature=temp,
                max_new_tokens=max_new_tokens,
                repeats=repeats,
                seed=cfg.seed,
                progress=progress,
                trees=tuple(trees or ()),
            )
            check_measured(result, name, max_new_tokens)
            report["results"].setdefault(name, {})[str(temp)] = {"step": step, **result}
            speedup.write_report(run_dir, report)
    report["best"] = speedup.write_report(run_dir, report)
    return report


def check_measured(result: dict, name: str, max_new_tokens: int) -> None:
    """Refuse a measurement without figures (no decoding rounds to time) before anything is written."""
    figures = (result["speedup"], result["acceptance_rate"], result["cost_ratio_c"])
    if any(x is None or math.isnan(x) for x in figures):
        raise DraftsmithError(
            f"{name}: nothing was measured at --max-new-tokens {max_new_tokens} (no speculative rounds to time); "
            "raise --max-new-tokens (16 or more) or use more prompts; nothing was written for it"
        )


def measure(
    target,
    draft,
    tokenizer,
    prompts: list[Prompt],
    gammas: list[int],
    temperature: float,
    max_new_tokens: int,
    repeats: int,
    seed: int,
    progress: bool,
    trees: tuple[TreeShape, ...] = (),
) -> dict:
    """One draft at one temperature: the best gamma and what was measured there (``speedup.measure_draft``)."""
    return speedup.measure_draft(
        target,
        draft,
        tokenizer,
        prompts,
        gammas=gammas,
        temperature=temperature,
        eos_ids=eos_token_ids(target, tokenizer),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        seed=seed,
        progress=progress,
        trees=trees,
    )
