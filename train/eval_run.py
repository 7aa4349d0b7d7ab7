"""Every draft of a run measured for real: ``initial/`` and each complete checkpoint, at each temperature.

The report (``speedup_report.json``, ``.md``, ``speedup.png``) and ``best.json`` are rewritten after
each draft, so an interruption loses nothing; drafts already measured with the same settings are
not measured again. The drafts measured in one call share what does not depend on their weights:
the target-only baseline of each temperature is timed once (``evaluate.measure_baseline``), and the
cost ratio c once per draft architecture and dtype (on the first draft of it), so the comparison
between checkpoints is not moved by noise in either.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.drafts import kind_of_folder, load_draft
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.evaluate import Baseline, measure_baseline, spread
from draftsmith.specdec.loading import eos_token_ids, resolve_device, resolve_dtype
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt, read_prompts
from draftsmith.specdec.sampling import SamplingParams
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
    check_settings(gammas, limit, max_new_tokens)
    cfg = load_run_config(run_dir)
    if draft_vocab_size is None:
        draft_vocab_size = cfg.train_draft_vocab
    drafts = checkpoint.drafts_of_run(run_dir)
    if not drafts:
        raise DraftsmithError(f"{run_dir} has no checkpoints yet (no initial/ or checkpoint-*/ folders)")
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
        "repeats": repeats,
    }
    report = speedup.load_report(run_dir)
    if force or any(report.get(k) != v for k, v in settings.items()) or "draft_cost_ratios" not in report:
        report = {"results": {}, "draft_cost_ratios": {}, "baselines": {}}
    report.update(settings, run=str(run_dir), target=cfg.target, temperatures=temperatures, hardware=speedup.hardware())
    shared = SharedMeasurements(
        target,
        tokenizer,
        read_prompts(prompts_file)[:limit],
        gammas,
        tuple(trees or ()),
        max_new_tokens,
        repeats,
        cfg.seed,
        progress,
        costs=report["draft_cost_ratios"],
    )
    for name, step, folder in drafts:
        for temp in temperatures:
            if str(temp) in report["results"].get(name, {}):
                continue
            draft = load_draft(str(folder), target, dev, torch_dtype)
            if ranking and kind_of_folder(folder).cuts_head:
                draft = draft_vocab.SubsetHeadDraft(draft, ranking, eos)
            print(f"measuring {name} at temperature {temp}")
            key = architecture(folder, settings["dtype"], draft_vocab_size)
            result = shared.measure(name, draft, key, temperature=temp)
            check_measured(result, name, max_new_tokens)
            report["results"].setdefault(name, {})[str(temp)] = {"step": step, **result}
            report["baselines"][str(temp)] = shared.baseline_figures(temp)
            speedup.write_report(run_dir, report)
    report["best"] = speedup.write_report(run_dir, report)
    return report


def check_settings(gammas: list[int], limit: int | None, max_new_tokens: int) -> None:
    if any(g < 1 for g in gammas):
        raise DraftsmithError(f"gammas must be >= 1, got {gammas}")
    if limit is not None and limit < 1:
        raise DraftsmithError(f"--limit must be >= 1 (prompts to use; leave it out for all), got {limit}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")


def architecture(folder: Path, dtype: str, draft_vocab_size: int) -> str:
    """What a draft's step time depends on, as a key: its kind's label and saved config, the dtype
    and the head cut; not its weights, so ``initial/`` and the checkpoints of a run share it."""
    label, saved = kind_of_folder(folder).architecture(folder)
    config = {k: v for k, v in saved.items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    head = f"head {draft_vocab_size}" if draft_vocab_size else "full head"
    return f"{label} {digest}, {dtype}, {head}"


@dataclass
class SharedMeasurements:
    """What the drafts measured in one eval-run share: the target-only baseline of each temperature
    (timed on first use) and the cost ratio c of each draft architecture (``costs``: the report's
    ``draft_cost_ratios``, filled by the first draft of each architecture)."""

    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    prompts: list[Prompt]
    gammas: list[int]
    trees: tuple[TreeShape, ...]
    max_new_tokens: int
    repeats: int
    seed: int
    progress: bool
    costs: dict[str, dict]
    baselines: dict[float, Baseline] = field(default_factory=dict)

    def baseline(self, temperature: float) -> Baseline:
        if temperature not in self.baselines:
            self.baselines[temperature] = measure_baseline(
                self.target,
                self.tokenizer,
                self.prompts,
                options=DecodeOptions(sampling=SamplingParams(temperature)),
                max_new_tokens=self.max_new_tokens,
                eos_ids=eos_token_ids(self.target, self.tokenizer),
                seed=self.seed,
                repeats=self.repeats,
                progress=self.progress,
            )
        return self.baselines[temperature]

    def baseline_figures(self, temperature: float) -> dict:
        """The target-only tokens/s of the baseline at ``temperature``: median, min and max over repeats."""
        return {"target_tokens_per_s": spread([t.tokens_per_s for t in self.baseline(temperature).repeats])}

    def measure(self, name: str, draft, key: str, temperature: float) -> dict:
        """``speedup.measure_draft`` against the shared baseline, with the c of ``key`` when it is known."""
        known = self.costs.get(key)
        result = speedup.measure_draft(
            self.target,
            draft,
            self.tokenizer,
            self.prompts,
            gammas=self.gammas,
            temperature=temperature,
            eos_ids=eos_token_ids(self.target, self.tokenizer),
            max_new_tokens=self.max_new_tokens,
            repeats=self.repeats,
            seed=self.seed,
            progress=self.progress,
            trees=self.trees,
            baseline=self.baseline(temperature),
            cost_ratio=known["cost_ratio_c"] if known else None,
        )
        if known is None:
            known = {**result["measured_cost_ratio"], "measured_on": name, "temperature": temperature}
            if not math.isnan(known["cost_ratio_c"]):  # a run that measured nothing is refused after this
                self.costs[key] = known
        result.update(cost_ratio_c_spread=known["cost_ratio_c_spread"], cost_ratio_c_measured_on=known["measured_on"])
        return result


def check_measured(result: dict, name: str, max_new_tokens: int) -> None:
    """Refuse a measurement without figures (no decoding rounds to time) before anything is written."""
    figures = (result["speedup"], result["acceptance_rate"], result["cost_ratio_c"])
    if any(x is None or math.isnan(x) for x in figures):
        raise DraftsmithError(
            f"{name}: nothing was measured at --max-new-tokens {max_new_tokens} (no speculative rounds to time); "
            "raise --max-new-tokens (16 or more) or use more prompts; nothing was written for it"
        )
