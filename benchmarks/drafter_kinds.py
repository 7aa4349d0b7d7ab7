"""Drafter kinds side by side on the default target: the 2-layer truncated LM, the early-exit draft,
the EAGLE-3 head, the parallel (PARD) draft and the DFlash draft, each trained the same wall-clock
minutes on the same shipped data, then measured on held-out prompts.

Training: each kind's shipped config (``configs/smollm2-135m.yaml``, ``smollm2-135m-early-exit.yaml``,
``smollm2-135m-eagle3.yaml``, ``smollm2-135m-parallel.yaml``, ``smollm2-135m-dflash.yaml``) on
``dataset: smollm2-self``, stepped until ``--minutes`` of training steps have passed or its
``max_steps`` are done (set-up, held-out evaluations and checkpoint writing not counted), then its
held-out alpha logged and its draft saved. The machine's load is recorded before and after each
run: on a shared machine the same minutes buy fewer steps when it is busy.

Measured per draft, greedy, batch 1, on prompts never trained on (``distill/data/eval_prompts.jsonl``):

- greedy alpha per position, teacher-forced on the target's greedy answers to ``--heldout`` prompts:
  the share of answer positions where draft token j+1 (drafted after j right ones) is the target's
  argmax. A standalone LM or an early-exit draft drafts every position from the true prefix, so its
  figure is the same at every j; the EAGLE-3 head's step j reads its own features of step j-1
  (its training forward, unrolled ``--positions`` steps); the parallel draft's step j is its mask
  position j, read in the same forward as step 0 (its chains of masks, as it trains); the DFlash
  draft's step j is block position j+1 of the block anchored at each answer row, one forward;
- eval-run's measurement (``train.speedup.measure_draft``): tau, alpha, c, v, the measured and
  predicted speedup at the best gamma of ``--gammas``, and the best token tree of ``--trees``;
- in float32, and in bfloat16 where the CPU multiplies it natively (the machine's flags are saved).

Each kind's folder under ``--out`` keeps its saved draft and ``trained.json`` (steps, seconds):
``benchmarks/parallel_drafting.py --drafts OUT`` measures the truncated LM and the parallel draft
trained here instead of training its own.

Run (5 x MINUTES of training, then about 20 minutes of measuring per dtype on 2 cores):
    .venv/bin/python benchmarks/drafter_kinds.py --minutes 20
One kind, to its own results file:
    .venv/bin/python benchmarks/drafter_kinds.py --only dflash --minutes 8 --name drafter_kinds_dflash
Smoke test on the tiny target (a few minutes):
    .venv/bin/python benchmarks/drafter_kinds.py --smoke
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import PROMPTS, save
from kind_runs import answers_batch, decoding_draft, train_for

from draftsmith.distill.drafts.dflash import DFlashDraft, block_targets
from draftsmith.distill.drafts.eagle3 import KIND as EAGLE3
from draftsmith.distill.drafts.eagle3 import EagleHead, unroll
from draftsmith.distill.drafts.kind import Batch
from draftsmith.distill.drafts.parallel import ParallelDraft, every_chain
from draftsmith.specdec.loading import cpu_has_native_bfloat16, eos_token_ids
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.tree import TreeShape
from draftsmith.train import checkpoint
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.models import load_target
from draftsmith.train.speedup import measure_draft

CONFIGS = Path(__file__).parents[1] / "configs"
KINDS = {  # name -> (config, overrides): every kind on the same shipped data
    "truncated LM (2 layers)": (  # the live target and the schedule of the other kinds' configs
        "smollm2-135m.yaml",
        ["data.dataset=smollm2-self", "teacher.cache=false", "optim.max_steps=300", "save.steps=100"],
    ),
    "early exit (4 layers + exit head)": ("smollm2-135m-early-exit.yaml", ["data.dataset=smollm2-self"]),
    "EAGLE-3 head": ("smollm2-135m-eagle3.yaml", ["data.dataset=smollm2-self"]),
    "parallel draft (2 layers, 6 masks)": ("smollm2-135m-parallel.yaml", ["data.dataset=smollm2-self"]),
    "DFlash draft (2 layers, blocks of 8)": ("smollm2-135m-dflash.yaml", ["data.dataset=smollm2-self"]),
}
# --smoke: configs/tiny.yaml as each kind
SMOKE = {
    "truncated LM (1 layer)": ("tiny.yaml", []),
    "early exit (2 layers + exit head)": ("tiny.yaml", ["draft.kind=early_exit", "draft.layers=2"]),
    "EAGLE-3 head": ("tiny.yaml", ["draft.kind=eagle3", "draft.vocab=30"]),
    "parallel draft (1 layer, 4 masks)": (
        "tiny.yaml",
        ["draft.kind=parallel", "draft.options={mask_token_id: 2, k: 4}"],
    ),
    "DFlash draft (1 layer, blocks of 4)": (
        "tiny.yaml",
        ["draft.kind=dflash", "draft.layers=1", "draft.options={mask_token_id: 2, block_size: 4}"],
    ),
}


@torch.no_grad()
def greedy_agreement(draft, target, batch: dict, positions: int) -> list[float]:
    """Per draft position j, the share of answer rows where draft token j+1 (after j right drafts) is
    the target's argmax, teacher-forced on ``batch``."""
    out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    rows = batch["loss_mask"].flatten().nonzero()[:, 0]
    best = out.logits.flatten(0, 1)[rows].argmax(-1)  # (M,) the target's token at each row
    if isinstance(draft, ParallelDraft):
        return parallel_agreement(draft, batch, rows, best, positions)
    if isinstance(draft, DFlashDraft):
        return dflash_agreement(draft, batch, out.hidden_states, rows, best, positions)
    if not isinstance(draft, EagleHead):
        logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return [float((logits.flatten(0, 1)[rows].argmax(-1) == best).float().mean())] * positions
    hidden = {i: out.hidden_states[i] for i in draft.aux_layers}
    kind_batch = Batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], rows, None, hidden)
    steps, draft.ttt_steps = draft.ttt_steps, positions
    draft.train()  # the unrolled training forward, on the head's own vocabulary
    predicted = EAGLE3.training_forward(draft, draft, kind_batch)
    draft.eval()
    draft.ttt_steps = steps
    drafted = draft.vocab[predicted.logits.argmax(-1)]  # (R,) target ids, step 0's first
    sizes = [len(anchors) for anchors in unroll(rows, batch["input_ids"].shape[1], positions).anchors]
    step = torch.cat([torch.full((n,), j) for j, n in enumerate(sizes)])
    agree = (drafted == best[predicted.teacher_rows]).float()
    return [float(agree[step == j].mean()) for j in range(positions)]


def parallel_agreement(draft: ParallelDraft, batch: dict, rows, best, positions: int) -> list[float]:
    """Per mask position j, the share of answer rows where the parallel draft's token there (every
    chain of masks that fits, none dropped) is the target's argmax given the true prefix."""
    ids = None if draft.head_ids is None else torch.tensor(draft.head_ids)
    logits, teacher_rows, step = every_chain(draft, batch, rows, ids, positions)
    drafted = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
    agree = (drafted == best[teacher_rows]).float()
    return [float(agree[step == j].mean()) for j in range(positions)]


def dflash_agreement(draft: DFlashDraft, batch: dict, states, rows, best, positions: int) -> list[float]:
    """Per block position j+1, the share of answer rows where the DFlash draft's token there (the block
    anchored at each answer row, one forward, every position that stays inside the answer) is the
    target's argmax given the true prefix."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    anchors = [row.nonzero()[:, 0] for row in batch["loss_mask"]]
    width = max(len(a) for a in anchors)
    padded = torch.zeros(len(anchors), width, dtype=torch.long)
    valid = torch.zeros(len(anchors), width, dtype=torch.bool)
    for b, a in enumerate(anchors):
        padded[b, : len(a)], valid[b, : len(a)] = a, True
    hidden = draft(ids, attention, {i: states[i] for i in draft.feature_layers}, padded, positions + 1)
    index, teacher_rows, k = block_targets(rows, padded, valid, ids.shape[1], positions + 1)
    drafted = draft.lm_head(hidden.flatten(0, 2).index_select(0, index)).argmax(-1)
    agree = (drafted == best[teacher_rows]).float()
    return [float(agree[k == j + 1].mean()) for j in range(positions)]


def measure_dtype(cfg: DistillConfig, folders: dict[str, Path], dtype: torch.dtype, args) -> dict:
    """Per-position agreement and eval-run's figures for every draft, target and drafts in ``dtype``."""
    target, tokenizer = load_target(cfg, torch.device("cpu"), dtype)
    eos = eos_token_ids(target, tokenizer)
    heldout = [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(PROMPTS)[: args.heldout]]
    batch = answers_batch(target, tokenizer, heldout, args.max_new_tokens, eos)
    settings = MeasureSettings(
        read_prompts(PROMPTS)[: args.prompts],
        max_new_tokens=args.max_new_tokens,
        eos_ids=eos,
        repeats=args.repeats,
        progress=False,
    )
    trees = tuple(TreeShape.parse(t) for t in args.trees)
    result = {}
    for name, folder in folders.items():
        draft = decoding_draft(folder, target, eos)
        agreement = greedy_agreement(draft, target, batch, args.positions)
        measured = measure_draft(target, draft, tokenizer, settings, args.gammas, trees=trees).to_json()
        result[name] = {"greedy_alpha_per_position": agreement, **figures(measured)}
        print(row(name, result[name]))
    return result


def figures(measured: dict) -> dict:
    """What the table shows of eval-run's measurement: the chain at its best gamma and the best tree."""
    keys = ("acceptance_rate", "mean_accepted_tokens", "cost_ratio_c", "verify_ratio_v", "speedup", "predicted_speedup")
    trees = measured.get("trees", {})
    fastest = max(trees, key=lambda shape: trees[shape]["speedup"]) if trees else None
    return {
        "best_gamma": measured["best_gamma"],
        **{k: measured[k] for k in keys},
        "greedy_match": measured["greedy_match"],
        "best_tree": fastest,
        "tree": {k: trees[fastest][k] for k in (*keys, "greedy_match")} if fastest else None,
    }


def row(name: str, r: dict) -> str:
    """One Markdown table row: the chain at its best gamma, then the fastest tree (- for a figure not measured)."""

    def fig(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    alphas = " / ".join(fig(a, ".2f") for a in r["greedy_alpha_per_position"])
    chain = (
        f"{r['best_gamma']} | {fig(r['acceptance_rate'], '.3f')} | {fig(r['mean_accepted_tokens'], '.2f')} | "
        f"{fig(r['cost_ratio_c'], '.3f')} | {fig(r['verify_ratio_v'], '.2f')} | "
        f"{fig(r['speedup'], '.2f')}x ({fig(r['predicted_speedup'], '.2f')}x)"
    )
    tree = r["tree"]
    best = f"{r['best_tree']}: {fig(tree['speedup'], '.2f')}x, tau {fig(tree['mean_accepted_tokens'], '.2f')}"
    return f"| {name} | {alphas} | {chain} | {best if tree else '-'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="training minutes per kind")
    parser.add_argument("--out", type=Path, default=Path("runs/drafter_kinds"))
    parser.add_argument("--gammas", type=lambda s: [int(g) for g in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--trees", nargs="*", default=["2,1", "2,2,1", "3,2,1:4"])
    parser.add_argument("--positions", type=int, default=3, help="draft positions of the per-position alpha")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--heldout", type=int, default=8, help="prompts of the teacher-forced per-position alpha")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny target, a few seconds of training each")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="WORD",
        help="the kinds whose name starts with one of these words (case ignored), e.g. --only dflash eagle-3",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config settings for every kind, e.g. teacher.cache=false",
    )
    parser.add_argument("--name", default=None, help="results/NAME.json (default: drafter_kinds, or _smoke)")
    args = parser.parse_args()
    kinds = SMOKE if args.smoke else KINDS
    if args.only:
        kinds = {
            name: kind for name, kind in kinds.items() if name.lower().startswith(tuple(w.lower() for w in args.only))
        }
        if not kinds:
            parser.error(f"--only {' '.join(args.only)} names no kind of: {', '.join(SMOKE if args.smoke else KINDS)}")
    if args.smoke:
        args.minutes, args.prompts, args.heldout, args.max_new_tokens, args.repeats = 0.1, 2, 2, 16, 1
        args.gammas, args.trees = [1, 2], ["2,1"]
    if args.out.exists():
        parser.error(f"{args.out} exists (an earlier run's drafts): remove it, or pass another --out")
    trained, folders = {}, {}
    for name, (config, overrides) in kinds.items():
        out = args.out / name.split(" (")[0].replace(" ", "-")
        cfg = load_config(DistillConfig, str(CONFIGS / config), [*overrides, *args.set, f"output_dir={out}"])
        print(f"training {name} for {args.minutes} minutes ({config} {' '.join(overrides)})")
        trained[name] = train_for(cfg, args.minutes)
        folders[name] = checkpoint.checkpoint_dirs(out)[-1][1]
        (out / "trained.json").write_text(json.dumps(trained[name]))
        print(f"  {trained[name]}")
    dtypes = {"float32": torch.float32} | ({"bfloat16": torch.bfloat16} if cpu_has_native_bfloat16() else {})
    measured = {}
    header = "| draft | greedy alpha per position | gamma | alpha | tau | c | v | speedup (predicted) | fastest tree |"
    for label, dtype in dtypes.items():
        print(f"\n{label}\n{header}\n|---|---|---|---|---|---|---|---|---|")
        measured[label] = measure_dtype(cfg, folders, dtype, args)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    name = args.name or ("drafter_kinds_smoke" if args.smoke else "drafter_kinds")
    save(name, {"settings": settings, "trained": trained, **measured})


if __name__ == "__main__":
    main()
