"""Chain vs fixed tree vs dynamic tree, side by side, on the default target (float32, batch 1).

For the untrained 2-layer truncation of the default target and a draft folder given by --draft (a
published draft decodes with the head cut to the vocabulary it carries, as ``draftsmith eval`` does),
on the held-out evaluation prompts, greedy: each configuration's tau (tokens per verification),
draft nodes per round, v (a verification forward's time over a one-token target step's), measured
speedup over target-only decoding of the same prompts, and whether the output is the target's.

Run: .venv/bin/python benchmarks/tree.py [--draft FOLDER] [--prompts 4] [--tokens 48]
Writes benchmarks/results/tree.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import default_target, prompt_ids, save

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import load_model
from draftsmith.specdec.measure.machine import cpu_flags
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.tree import TreeShape

CONFIGS = {  # name -> options; node budgets: chain gamma = nodes per round
    "chain g1": DecodeOptions(gamma=1),
    "chain g2": DecodeOptions(gamma=2),
    "chain g3": DecodeOptions(gamma=3),
    "chain g6": DecodeOptions(gamma=6),
    "tree 2 (2)": DecodeOptions(tree=TreeShape.parse("2")),
    "tree 3 (3)": DecodeOptions(tree=TreeShape.parse("3")),
    "tree 2,1 (4)": DecodeOptions(tree=TreeShape.parse("2,1")),
    "tree 2,1,1 (6)": DecodeOptions(tree=TreeShape.parse("2,1,1")),
    "tree 3,2,1,1 (21)": DecodeOptions(tree=TreeShape.parse("3,2,1,1")),
    "dyn 3,2,2,1:6": DecodeOptions(tree=TreeShape.parse("3,2,2,1:6")),
    "dyn 3,2,2,1:12": DecodeOptions(tree=TreeShape.parse("3,2,2,1:12")),
}


def run(target, draft, prompts, tokens, eos) -> dict:
    base = [target_generate(target, [p], tokens, eos_ids=eos) for p in prompts]
    base_time = sum(s.total_time for _, s in base)
    step = sum(s.verify_time for _, s in base) / sum(s.rounds for _, s in base)
    rows = {}
    for name, options in CONFIGS.items():
        runs = [speculative_generate(target, draft, [p], tokens, options=options, eos_ids=eos) for p in prompts]
        rounds = sum(s.rounds for _, s in runs)
        rows[name] = {
            "tau": sum(s.round_tokens for _, s in runs) / rounds,
            "nodes_per_round": sum(s.proposed for _, s in runs) / rounds,
            "v": sum(s.verify_time for _, s in runs) / rounds / step,
            "speedup": base_time / sum(s.total_time for _, s in runs),
            "greedy_identical": all(o == b for (o, _), (b, _) in zip(runs, base, strict=True)),
        }
        print(
            f"{name:20s} "
            + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[name].items())
        )
    return {"target_step_s": step, "target_only_s": base_time, "configs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", help="draft model folder (default: the target's first 2 layers, untrained)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    target, tokenizer, eos = default_target()
    drafts = {"untrained 2-layer": truncate_target(target, 2)}
    if args.draft:
        draft = load_model(args.draft, torch.device("cpu"), torch.float32)
        if (Path(args.draft) / draft_vocab.FILE).is_file():  # a published draft decodes with its cut head
            draft = draft_vocab.SubsetHeadDraft(draft, draft_vocab.load_ranking(Path(args.draft)), eos)
        drafts[args.draft] = draft
    prompts = prompt_ids(tokenizer, args.prompts)
    result = {"cpu_flags": cpu_flags(), "dtype": "float32", "threads": torch.get_num_threads(), "drafts": {}}
    result |= {"prompts": len(prompts), "max_new_tokens": args.tokens}
    for name, draft in drafts.items():
        print(f"\n== draft: {name}")
        result["drafts"][name] = run(target, draft, prompts, args.tokens, eos)
    save("tree", result)


if __name__ == "__main__":
    main()
