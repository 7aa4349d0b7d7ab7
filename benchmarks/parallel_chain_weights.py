"""How a parallel draft's mask rows are weighted in training (``kind_options.chain_weights``), compared
by the greedy acceptance each gives at every mask position.

Each scheme trains the same run (a config, then ``chain_weights`` set) for the same number of steps;
then, teacher-forced on the target's greedy answers to the held-out evaluation prompts, every chain
of masks that fits is read (``parallel.every_chain``, none dropped) and, per position j (1: the
ordinary next-token prediction, j > 1: mask j-1), the share of rows where the draft's argmax is the
target's next token (the greedy acceptance of that position given the earlier ones accepted), and
the mean ``sum_x min(p, q)`` (``parallel.position_acceptance``). Acceptance is a count, not a time:
any machine gives the same figures for the same run.

Run (the tiny target; a few minutes on 2 cores):
    .venv/bin/python benchmarks/parallel_chain_weights.py --config tiny --steps 60
The default target with the shipped parallel config at a small budget (training dominates):
    .venv/bin/python benchmarks/parallel_chain_weights.py --config smollm2-135m-parallel --steps 40 \
        --set optim.batch_size=4 data.max_length=160 data.heldout=4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import PROMPTS
from kind_runs import answers_batch

from draftsmith.cli import main as draftsmith
from draftsmith.distill.drafts import load_draft
from draftsmith.distill.drafts.parallel import CHAIN_WEIGHTS, ParallelDraft, every_chain, position_acceptance
from draftsmith.specdec.loading import eos_token_ids
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.train.config import load_run_config
from draftsmith.train.models import load_target

# configs/tiny.yaml as a parallel draft: <unk> (2) as the mask (the character data has none), a cut
# head, and frozen embeddings as the shipped parallel config has them
TINY = ["draft.kind=parallel", "draft.freeze_embeddings=true", "draft.vocab=48"]
TINY_OPTIONS = {"mask_token_id": 2, "k": 4}


@torch.no_grad()
def greedy_per_position(draft: ParallelDraft, batch: dict, best: torch.Tensor, positions: int) -> list[float]:
    """Per position j, the share of answer rows where the draft's token (every chain that fits) is the
    target's argmax ``best`` (M,) given the true prefix."""
    rows = torch.nonzero(batch["loss_mask"].flatten())[:, 0]
    ids = None if draft.head_ids is None else torch.tensor(draft.head_ids)
    logits, teacher_rows, step = every_chain(draft, batch, rows, ids, positions)
    drafted = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
    agree = (drafted == best[teacher_rows]).float()
    return [float(agree[step == j].mean()) for j in range(positions)]


def train(config: str, scheme: str, steps: int, floor: float | None, out: Path, overrides: list[str]) -> Path:
    """One run of ``config`` with ``chain_weights: scheme`` for ``steps`` steps (and the config
    ``overrides``, KEY=VALUE); its run folder."""
    run = out / scheme
    options = dict(TINY_OPTIONS) if config == "tiny" else {"mask_token_id": 16, "k": 6}
    options["chain_weights"] = scheme
    if floor is not None:
        options["weight_floor"] = floor
    flow = ", ".join(f"{key}: {value}" for key, value in options.items())
    extra = TINY if config == "tiny" else []
    steps_args = [f"optim.max_steps={steps}", f"save.steps={steps}", f"log.steps={steps}", "optim.warmup_steps=2"]
    args = ["distill", "--config", config, f"output_dir={run}", *extra, f"draft.options={{{flow}}}", *steps_args]
    args += overrides
    if draftsmith(args) != 0:
        raise SystemExit(f"training {scheme} failed")
    return run


def measure(run: Path, steps: int, heldout: int, tokens: int) -> dict:
    """Greedy acceptance and mean sum min(p, q) per position of the run's initial and final drafts."""
    cfg = load_run_config(run)
    positions = cfg.draft.options["k"]
    target, tokenizer = load_target(cfg, torch.device("cpu"))
    eos = eos_token_ids(target, tokenizer)
    prompts = [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(PROMPTS)[:heldout]]
    batch = answers_batch(target, tokenizer, prompts, tokens, eos)
    rows = torch.nonzero(batch["loss_mask"].flatten())[:, 0]
    with torch.no_grad():
        best = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    best = best.flatten(0, 1)[rows].argmax(-1)
    result = {}
    for name in ("initial", f"checkpoint-{steps}"):
        draft = load_draft(str(run / name), target, torch.device("cpu"), torch.float32)
        result[name] = {
            "greedy_per_position": greedy_per_position(draft, batch, best, positions),
            "acceptance_per_position": position_acceptance(draft, target, batch, positions).tolist(),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--schemes", nargs="*", default=list(CHAIN_WEIGHTS))
    parser.add_argument("--floor", type=float, default=None, help="weight_floor (default: the kind's)")
    parser.add_argument("--heldout", type=int, default=16, help="held-out prompts")
    parser.add_argument("--tokens", type=int, default=32, help="greedy answer tokens per prompt")
    parser.add_argument("--out", type=Path, default=Path("runs/parallel_chain_weights"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE (e.g. batch_size=4)")
    args = parser.parse_args()
    results = {}
    for scheme in args.schemes:
        run = train(args.config, scheme, args.steps, args.floor, args.out, args.set)
        results[scheme] = measure(run, args.steps, args.heldout, args.tokens)
        final = results[scheme][f"checkpoint-{args.steps}"]
        print(scheme, "greedy", [round(a, 3) for a in final["greedy_per_position"]])
        print(scheme, "sum min", [round(a, 3) for a in final["acceptance_per_position"]])
    record = {"config": args.config, "steps": args.steps, "floor": args.floor, "set": args.set, "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
