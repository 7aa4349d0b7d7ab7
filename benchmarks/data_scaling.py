"""What more training data buys: the default 2-layer draft trained on growing amounts of target-written data.

1. Training data: ``draftsmith data --prompts self`` writes prompts with the default target itself on
   six topics (coding, math, writing, chat, qa, summarization) and has it answer them; the folder is
   grown until it holds the largest token budget (resumable: re-running continues it).
2. Held-out prompts: the target writes prompts on two topics the training prompts never used
   (translation, reasoning); only their first turns are kept. With --teacher-cache K the data step
   also stores the target's top-K log-probs (pass --set teacher.cache=true to train from them).
3. For each budget (25 k, 100 k, 400 k answer tokens by default), the default config
   (smollm2-135m: 2-layer truncated draft, forward KL) trains for one epoch over the first rows
   holding that many tokens, so every run takes the same steps per token.
4. Every draft (and the untrained one) is measured with the bundled decoder on the held-out prompts,
   greedy, at gamma 1 and 3, side by side with the target alone: alpha, tau, c and measured speedup.

Run: .venv/bin/python benchmarks/data_scaling.py --work /tmp/scaling [--budgets 25000,100000,400000]
     [--engine vllm] [--set key=value ...]
Writes benchmarks/results/data_scaling.json and benchmarks/results/data_scaling.png.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, save

from draftsmith.distill import dataset_builder
from draftsmith.distill.drafts import load_draft
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.draft_vocab import SubsetHeadDraft
from draftsmith.specdec.loading import eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.measure.machine import cpu_flags
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts
from draftsmith.train import checkpoint
from draftsmith.train.config import DistillConfig, config_path, load_config, load_run_config
from draftsmith.train.loop import train

TARGET = "smollm2-135m-instruct"
TRAIN_TOPICS = "coding,math,writing,chat,qa,summarization"
HELDOUT_TOPICS = "translation,reasoning"
GAMMAS = (1, 3)


def data_command(output: Path, topics: str, num_prompts: int, args, max_new_tokens: int, samples: int) -> list[str]:
    command = [sys.executable, "-m", "draftsmith.cli", "data", "--output", str(output), "--target", TARGET]
    command += ["--prompts", "self", "--topics", topics, "--num-prompts", str(num_prompts)]
    command += ["--samples-per-prompt", str(samples), "--temperature", "0.7", "--top-p", "0.95"]
    command += ["--max-new-tokens", str(max_new_tokens), "--seed", str(args.seed)]
    return command + ["--no-progress"] if args.quiet else command


def answer_tokens(folder: Path) -> list[int]:
    """Answer tokens of each row of a built dataset, in the order training reads them."""
    rows = dataset_builder.load_built(folder).select_columns(["answer_ids"])
    return [len(a) for a in rows["answer_ids"]]


def build_training_data(args, folder: Path, budget: int) -> list[int]:
    """Grow the dataset until its answers hold ``budget`` tokens; returns answer tokens per row."""
    lengths = answer_tokens(folder) if dataset_builder.read_manifest(folder) else []
    prompts = args.first_prompts
    while sum(lengths) < budget:
        per_prompt = sum(lengths) / max(1, len(lengths)) * args.samples if lengths else 150 * args.samples
        if lengths:
            prompts = len(lengths) // args.samples + math.ceil((budget - sum(lengths)) / per_prompt * 1.1)
        print(f"data: {sum(lengths)} of {budget} answer tokens; asking for {prompts} prompts", flush=True)
        command = data_command(folder, TRAIN_TOPICS, prompts, args, 256, args.samples)
        subprocess.run([*command, "--engine", args.engine], check=True)
        lengths = answer_tokens(folder)
    if args.teacher_cache:  # the target's top-k at every answer position, so training never runs it
        written = len(set(dataset_builder.load_built(folder)["prompt_id"]))
        command = data_command(folder, TRAIN_TOPICS, written, args, 256, args.samples)
        subprocess.run([*command, "--engine", args.engine, "--teacher-cache", str(args.teacher_cache)], check=True)
    return lengths


def heldout_prompts(args, work: Path) -> Path:
    """First turns of prompts the target wrote on topics the training prompts never used (JSONL)."""
    out = work / "heldout_prompts.jsonl"
    if not out.exists():
        folder = work / "heldout_data"
        command = data_command(folder, HELDOUT_TOPICS, args.heldout, args, 8, 1)
        subprocess.run([*command, "--engine", "draftsmith"], check=True)  # a few short answers
        rows = dataset_builder.load_built(folder)
        lines = [
            json.dumps({"question_id": i, "category": r["topic"], "turns": [r["messages"][0]["content"]]})
            for i, r in enumerate(rows)
        ]
        out.write_text("\n".join(lines) + "\n")
    return out


def train_budget(args, work: Path, data: Path, lengths: list[int], budget: int) -> tuple[Path, dict]:
    """One epoch over the first rows holding ``budget`` answer tokens; returns (final checkpoint, facts)."""
    rows = next(i + 1 for i in range(len(lengths)) if sum(lengths[: i + 1]) >= budget)
    live = "teacher.cache=false"  # one epoch: the live target, unless --set teacher.cache=true
    overrides = [
        f"data.dataset={data}",
        f"data.max_samples={rows}",
        f"output_dir={work / f'run-{budget}'}",
        live,
        *args.set,
    ]
    cfg = load_config(DistillConfig, config_path("smollm2-135m"), overrides)
    steps = max(1, round((rows - cfg.data.heldout) / (cfg.optim.batch_size * cfg.optim.grad_accum)))
    overrides += [f"optim.max_steps={steps}", f"save.steps={steps}"]
    cfg = load_config(DistillConfig, config_path("smollm2-135m"), overrides)
    final = Path(cfg.output_dir) / f"checkpoint-{steps}"
    start = time.perf_counter()
    if not checkpoint.is_complete(final):
        print(f"training on {budget} tokens: {rows} rows, {steps} steps", flush=True)
        train(cfg)
    return final, {"rows": rows, "tokens": sum(lengths[:rows]), "steps": steps, "train_s": time.perf_counter() - start}


def measure(target, tokenizer, draft, prompts, args) -> dict:
    eos = eos_token_ids(target, tokenizer)
    out = {}
    for gamma in GAMMAS:
        report = evaluate_pair(
            target,
            draft,
            tokenizer,
            MeasureSettings(
                prompts,
                options=DecodeOptions(gamma=gamma),
                max_new_tokens=args.max_new_tokens,
                eos_ids=eos,
                repeats=args.repeats,
                progress=not args.quiet,
            ),
        ).to_json()
        keys = ("acceptance_rate", "mean_accepted_tokens", "cost_ratio_c", "speedup", "speedup_spread", "greedy_match")
        out[str(gamma)] = {k: report[k] for k in keys}
        print(f"  gamma {gamma}: " + ", ".join(f"{k} {report[k]}" for k in keys), flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["runs"] if r["tokens"] > 0]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for gamma in map(str, GAMMAS):
        axes[0].plot([r["tokens"] for r in rows], [r["measured"][gamma]["acceptance_rate"] for r in rows], "o-")
        axes[1].plot([r["tokens"] for r in rows], [r["measured"][gamma]["speedup"] for r in rows], "o-")
    untrained = result["runs"][0]["measured"]
    for gamma, color in zip(map(str, GAMMAS), ("C0", "C1"), strict=True):
        axes[0].axhline(untrained[gamma]["acceptance_rate"], color=color, ls=":", lw=1)
        axes[1].axhline(untrained[gamma]["speedup"], color=color, ls=":", lw=1)
    axes[0].set(xscale="log", xlabel="training answer tokens", ylabel="greedy alpha (held-out topics)")
    axes[1].set(xscale="log", xlabel="training answer tokens", ylabel="measured speedup")
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[0].legend([f"gamma {g}" for g in GAMMAS] + ["untrained (dotted)"], fontsize=8)
    fig.suptitle(f"default 2-layer draft, {result['dtype']}, {result['threads']} CPU threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder for the datasets and runs (re-running resumes)")
    parser.add_argument("--budgets", default="25000,100000,400000", help="answer-token budgets")
    parser.add_argument("--engine", default="draftsmith", help="data engine: draftsmith or vllm")
    parser.add_argument("--teacher-cache", type=int, default=0, help="build the top-K teacher cache in the data step")
    parser.add_argument("--samples", type=int, default=2, help="answers per training prompt")
    parser.add_argument("--first-prompts", type=int, default=200, help="prompts asked for in the first data round")
    parser.add_argument("--heldout", type=int, default=12, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per held-out prompt")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="key=value override of the distill config")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    budgets = sorted(int(b) for b in args.budgets.split(","))

    started = time.perf_counter()
    lengths = build_training_data(args, work / "train_data", budgets[-1])
    data_s = time.perf_counter() - started
    prompts_file = heldout_prompts(args, work)
    finals = [train_budget(args, work, work / "train_data", lengths, b) for b in budgets]

    target = load_model(TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(TARGET)
    prompts = read_prompts(prompts_file)
    eos = eos_token_ids(target, tokenizer)
    result = {"cpu_flags": cpu_flags(), "dtype": "float32", "threads": torch.get_num_threads()}
    result |= {"engine": args.engine, "data_s": data_s, "heldout_prompts": len(prompts), "overrides": args.set}
    result |= {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "runs": []}
    drafts = [(Path(finals[0][0]).parent / "initial", {"rows": 0, "tokens": 0, "steps": 0})] + finals
    for folder, facts in drafts:
        print(f"measuring {folder} ({facts['tokens']} training tokens)", flush=True)
        draft = with_trained_head(load_draft(str(folder), target, torch.device("cpu"), torch.float32), folder, eos)
        measured = measure(target, tokenizer, draft, prompts, args)
        result["runs"].append({**facts, "draft": str(folder), "measured": measured})
        save("data_scaling", result)
    plot(result, RESULTS / "data_scaling.png")


def with_trained_head(draft, folder: Path, eos: frozenset[int]):
    """The draft as its run trained it: with ``train_draft_vocab`` set, only the head rows of the run's
    most frequent answer tokens were trained, so the draft proposes from those (as ``eval-run`` does);
    the untrained draft is cut the same way as the smallest run."""
    run = folder.parent
    cfg = load_run_config(run)
    if not cfg.draft.vocab:
        return draft
    return SubsetHeadDraft(draft, draft_vocab.load_ranking(run, cfg.draft.vocab), eos)


if __name__ == "__main__":
    main()
