"""What the drafter-kind benchmarks share: training a config for a wall-clock budget, the target's
greedy answers as a teacher-forcing batch, and a saved draft loaded as eval-run decodes it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from draftsmith.distill.drafts import kind_of_folder, load_draft
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.decoder import target_generate
from draftsmith.train.config import DistillConfig
from draftsmith.train.loop import StepTimes, end_of_epoch, log_heldout, plan_budget, setup, train_step
from draftsmith.train.loop import save as save_checkpoint


def train_for(cfg: DistillConfig, minutes: float) -> dict:
    """Train the run ``cfg`` describes until ``minutes`` of training steps have passed or its max_steps
    are done (set-up, held-out evaluations and checkpoint writing not counted), then log its held-out
    alpha and save its draft as ``checkpoint-{step}``: steps, seconds, held-out alpha, load before/after."""
    _, figures, _ = next(train_snapshots(cfg, [minutes]))
    return {
        "steps": figures["steps"],
        "train_s": figures["train_s"],
        "heldout_alpha": figures["heldout_sum_min_pq"],
        "load_average": figures["load_average"],
    }


def train_snapshots(cfg: DistillConfig, budgets: list[float]):
    """Step the run ``cfg`` describes; at each of ``budgets`` (minutes of training steps, ascending) or at
    ``max_steps``, log its held-out alpha, save its draft and yield (budget, the run's figures so far,
    the draft's folder). Set-up, held-out evaluations and checkpoint writes are not counted. With
    ``optim.max_minutes`` the run plans its steps from its measured pace as ``distill`` does (its
    schedule decays to the planned last step)."""
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    run = setup(cfg)
    spent, tokens, epoch, pending, times = 0.0, 0, 0, list(budgets), StepTimes()
    while pending:
        run.loader.set_epoch(epoch)
        if epoch > 0:  # a store the first epoch filled (teacher.cache_fill: first_epoch) is read from here on
            end_of_epoch(run, times)
        batches = iter(run.loader)
        for _ in range(len(run.loader) // cfg.optim.grad_accum):
            micro = [next(batches) for _ in range(cfg.optim.grad_accum)]
            start = time.perf_counter()
            loss, step_tokens = train_step(run, micro)
            seconds = time.perf_counter() - start
            spent += seconds
            tokens += step_tokens
            run.window_loss, run.window_tokens = run.window_loss + loss, run.window_tokens + step_tokens
            if cfg.optim.max_minutes is not None:
                plan_budget(run, cfg, times, seconds)  # run.cfg.optim.max_steps becomes the planned steps
            finished = run.step >= run.cfg.optim.max_steps
            while pending and (spent >= 60 * pending[0] or finished):
                log_heldout(run)
                save_checkpoint(run)
                figures = {
                    "steps": run.step,
                    "tokens": tokens,
                    "train_s": spent,
                    "wall_s": time.perf_counter() - started,
                    "heldout_sum_min_pq": run.last_metrics["acceptance_rate"],
                    "load_average": [load_before, os.getloadavg()[0]],
                }
                yield pending.pop(0), figures, run.run_dir / f"checkpoint-{run.step}"
            if not pending:
                break
        epoch += 1
    run.bar.close()


def answers_batch(target, tokenizer, prompts: list[list[int]], tokens: int, eos) -> dict:
    """The target's greedy answers to ``prompts``, right-padded, with the loss rows that predict them."""
    answers = target_generate(target, prompts, tokens, eos_ids=eos)[0]
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id or 0)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss[row, len(prompt) - 1 : len(sequence) - 1] = True
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def decoding_draft(folder: Path, target, eos):
    """A saved draft as eval-run decodes it: a kind that trains with the generic cut head decodes with
    it; the others (EAGLE-3's own vocabulary, a parallel draft's own cut) load as they are."""
    draft = load_draft(str(folder), target, target.device, target.dtype)
    if kind_of_folder(folder).cuts_head and (folder / draft_vocab.FILE).is_file():
        return draft_vocab.SubsetHeadDraft(draft, draft_vocab.load_ranking(folder), eos)
    return draft
