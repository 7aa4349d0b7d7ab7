"""KV cache kinds on this machine: slot (preallocated, rollback moves a position) vs dynamic
(concatenate, crop by slicing) vs static (fixed capacity), for the target-only decoder and the
speculative decoder (target + its first 2 layers), greedy, side by side in one run.

Run: .venv/bin/python benchmarks/cache_kinds.py [--repeats 3 --prompts 3]
"""

from __future__ import annotations

import argparse

from common import default_target, median, prompt_ids, save, timed

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.cache import CACHE_KINDS
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.options import DecodeOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, tokenizer, eos = default_target()
    draft = truncate_target(target, 2)
    prompts = prompt_ids(tokenizer, args.prompts)
    n = args.max_new_tokens
    for kind in CACHE_KINDS:  # warm-up
        target_generate(target, prompts[:1], 8, DecodeOptions(cache_kind=kind), eos_ids=eos)
        speculative_generate(target, draft, prompts[:1], 8, options=DecodeOptions(cache_kind=kind), eos_ids=eos)
    tps = {f"{mode}/{kind}": [] for mode in ("target", "spec") for kind in CACHE_KINDS}
    for _ in range(args.repeats):
        for ids in prompts:
            for kind in CACHE_KINDS:
                (out, _), dt = timed(target_generate, target, [ids], n, DecodeOptions(cache_kind=kind), eos_ids=eos)
                tps[f"target/{kind}"].append(len(out[0]) / dt)
                options = DecodeOptions(gamma=4, cache_kind=kind)
                (out, _), dt = timed(speculative_generate, target, draft, [ids], n, options=options, eos_ids=eos)
                tps[f"spec/{kind}"].append(len(out[0]) / dt)
    result = {}
    for mode in ("target", "spec"):
        for kind in CACHE_KINDS:
            ratio = median([a / b for a, b in zip(tps[f"{mode}/{kind}"], tps[f"{mode}/dynamic"], strict=True)])
            result[f"{mode}/{kind}"] = {"tokens_per_s": median(tps[f"{mode}/{kind}"]), "vs_dynamic": ratio}
            print(f"{mode:<7}{kind:<9}{median(tps[f'{mode}/{kind}']):7.2f} t/s   {ratio:.3f}x dynamic")
    save("cache_kinds", result)


if __name__ == "__main__":
    main()
