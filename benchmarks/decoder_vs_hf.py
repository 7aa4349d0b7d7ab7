"""The bundled decoder against transformers on the default target, side by side in one run.

1. target-only decoder vs `generate` (greedy): our baseline must be at least as fast, same tokens
   (it steps one row, as `generate` does; the speculative output is checked against the row-exact
   target it reproduces where the two differ); the row-exact target-only decoder is timed too, and
   its speed beside the baseline's is what timing the baseline row-exact would have flattered by;
2. speculative decoder vs assisted generation, same pair (target + its first 2 layers), same gamma;
3. the target as its own draft (alpha = 1): tau must be exactly gamma+1, and the measured speedup
   close to the predicted one (the loop adds little beyond the two models' forwards).

Each prompt runs every contender back to back (interleaved), repeated; ratios are medians of the
per-repeat ratios. Run: .venv/bin/python benchmarks/decoder_vs_hf.py [--repeats 3 --prompts 4]
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import default_target, median, prompt_ids, save, timed

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.measure.costs import step_costs, sum_stats
from draftsmith.specdec.measure.hf_compare import configure_assistant, hf_generate
from draftsmith.specdec.measure.runs import greedy_identical
from draftsmith.specdec.measure.theory import predicted_speedup
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams

GREEDY = SamplingParams()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    target, tokenizer, eos = default_target(dtype=dtype)
    draft = truncate_target(target, 2)
    # transformers runs on stock copies made before the bundled decoder switches its models' attention,
    # its assistant set to draft exactly gamma tokens per round.
    hf_target, hf_draft = copy.deepcopy(target), copy.deepcopy(draft)
    configure_assistant(hf_draft.generation_config, args.gamma)
    prompts = prompt_ids(tokenizer, args.prompts)
    gamma, n = args.gamma, args.max_new_tokens
    options = DecodeOptions(gamma=gamma)
    n_self = 1 + ((n - 1) // (gamma + 1)) * (gamma + 1)  # whole rounds only, so tau is exact

    # Warm-up.
    hf_generate(hf_target, prompts[0], 8, sampling=GREEDY, eos_ids=eos)
    target_generate(target, prompts[:1], 8, eos_ids=eos)
    speculative_generate(target, draft, prompts[:1], 8, options=options, eos_ids=eos)

    keys = ("base_vs_hf", "row_exact_vs_base", "spec_vs_assisted", "self_speedup", "self_predicted", "self_tau")
    rows = {k: [] for k in keys}
    identical, same_as_hf = [], []
    for rep in range(args.repeats):
        t = {k: 0.0 for k in ("hf", "base", "exact_base", "assisted", "spec", "self_base", "self_spec")}
        tok = {k: 0 for k in t}
        self_stats, self_base_stats = [], []
        for ids in prompts:
            hf_out, dt = timed(hf_generate, hf_target, ids, n, sampling=GREEDY, eos_ids=eos)
            t["hf"] += dt
            tok["hf"] += len(hf_out)
            (base_out, _), dt = timed(target_generate, target, [ids], n, eos_ids=eos)
            t["base"] += dt
            tok["base"] += len(base_out[0])
            same_as_hf.append(base_out[0] == hf_out)
            (exact_out, _), dt = timed(target_generate, target, [ids], n, eos_ids=eos, row_exact=True)
            t["exact_base"] += dt
            tok["exact_base"] += len(exact_out[0])
            assisted_out, dt = timed(hf_generate, hf_target, ids, n, sampling=GREEDY, eos_ids=eos, assistant=hf_draft)
            t["assisted"] += dt
            tok["assisted"] += len(assisted_out)
            (spec_out, _), dt = timed(speculative_generate, target, draft, [ids], n, options=options, eos_ids=eos)
            t["spec"] += dt
            tok["spec"] += len(spec_out[0])
            identical.append(spec_out[0] in (base_out[0], exact_out[0]))  # the timed or the row-exact target's
            # Self-drafting without EOS, so that every round is a full one.
            (out, st), dt = timed(target_generate, target, [ids], n_self)
            t["self_base"] += dt
            tok["self_base"] += len(out[0])
            self_base_stats.append(st)
            (out2, st2), dt = timed(speculative_generate, target, target, [ids], n_self, options=options)
            t["self_spec"] += dt
            tok["self_spec"] += len(out2[0])
            self_stats.append(st2)
            identical += greedy_identical(target, [ids], n_self, frozenset(), [out[0]], [out2[0]])
        tps = {k: tok[k] / t[k] for k in t}
        c, v = step_costs(sum_stats(self_base_stats), sum_stats(self_stats), calls=len(self_stats))
        rows["base_vs_hf"].append(tps["base"] / tps["hf"])
        rows["row_exact_vs_base"].append(tps["exact_base"] / tps["base"])
        rows["spec_vs_assisted"].append(tps["spec"] / tps["assisted"])
        rows["self_speedup"].append(tps["self_spec"] / tps["self_base"])
        rows["self_predicted"].append(predicted_speedup(1.0, gamma, c, v))
        rows["self_tau"].append(sum_stats(self_stats).mean_accepted_tokens)
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {tps[k]:.1f} t/s" for k in tps) + f"; c={c:.2f} v={v:.2f}")

    result = {k: median(v) for k, v in rows.items()}
    result["self_efficiency"] = result["self_speedup"] / result["self_predicted"]
    result["identical_outputs"] = all(identical)
    result["baseline_same_as_hf"] = sum(same_as_hf) / len(same_as_hf)
    result.update(
        dtype=str(dtype).removeprefix("torch."),
        gamma=gamma,
        max_new_tokens=n,
        prompts=len(prompts),
        repeats=args.repeats,
        torch_threads=torch.get_num_threads(),
    )
    print()
    print(f"target-only decoder / transformers generate:        {result['base_vs_hf']:.2f}x  (goal >= 1.0)")
    print(
        f"row-exact target-only decoder (the output the speculative decoder reproduces) / the timed one: "
        f"{result['row_exact_vs_base']:.3f}x"
    )
    print(
        f"speculative decoder / transformers assisted (2-layer draft, gamma={gamma}): "
        f"{result['spec_vs_assisted']:.2f}x  (goal >= 1.2)"
    )
    print(
        f"self-draft: tau {result['self_tau']:.2f} (gamma+1 = {gamma + 1}), measured speedup "
        f"{result['self_speedup']:.3f}, predicted {result['self_predicted']:.3f}, "
        f"efficiency {result['self_efficiency']:.3f}  (goal >= 0.9)"
    )
    print(f"speculative greedy outputs identical to the target-only decoder's: {result['identical_outputs']}")
    print(f"target-only decoder's outputs equal to transformers generate's: {result['baseline_same_as_hf']:.0%}")
    save("decoder_vs_hf" if dtype == torch.float32 else f"decoder_vs_hf_{result['dtype']}", result)


if __name__ == "__main__":
    main()
