"""The bundled decoder against transformers on the default target, side by side in one run.

1. target-only decoder vs `generate` (greedy): our baseline must be at least as fast, same tokens
   (it steps one row, as `generate` does; the speculative output is checked against the row-exact
   target it reproduces where the two differ); the row-exact target-only decoder is timed too, and
   its speed beside the baseline's is what timing the baseline row-exact would have flattered by.
   The target-alone step is also set against its physical limit: the bytes of weights a step reads
   over the memory read bandwidth measured on this machine (``measure.machine``), and the few-row
   product form each weight shape took (``specdec.matmul``, timed on this machine) is printed;
2. speculative decoder vs assisted generation, same pair (target + its first 2 layers), same gamma;
3. the target as its own draft (alpha = 1): tau must be exactly gamma+1, and the measured speedup
   close to the predicted one (the loop adds little beyond the two models' forwards).

Each prompt runs every contender back to back (interleaved), repeated; ratios are medians of the
per-repeat ratios. Run: .venv/bin/python benchmarks/decoder_vs_hf.py [--repeats 3 --prompts 4]
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field

import torch
from common import default_target, median, prompt_ids, save, timed

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.matmul import column_form_shapes
from draftsmith.specdec.measure.costs import single_step_time, step_costs, step_weight_bytes, sum_stats
from draftsmith.specdec.measure.hf_compare import configure_assistant, hf_generate
from draftsmith.specdec.measure.machine import describe, memory_read_bandwidth
from draftsmith.specdec.measure.runs import greedy_identical
from draftsmith.specdec.measure.theory import predicted_speedup
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import SamplingParams

GREEDY = SamplingParams()
CONTENDERS = ("hf", "base", "exact_base", "assisted", "spec", "self_base", "self_spec")


@dataclass
class Contenders:
    """The pair as each decoder runs it (transformers on stock copies), what they share, and what every
    prompt leaves behind: per contender seconds and tokens of the current repeat, and over all repeats
    the self-drafting stats, output checks, the target-alone stats and generate's seconds per token."""

    target: torch.nn.Module
    draft: torch.nn.Module
    hf_target: torch.nn.Module
    hf_draft: torch.nn.Module
    eos: frozenset[int]
    options: DecodeOptions
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    self_stats: list = field(default_factory=list)
    self_base_stats: list = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    same_as_hf: list[bool] = field(default_factory=list)
    base_stats: list = field(default_factory=list)
    hf_seconds: list[float] = field(default_factory=list)

    def add(self, name: str, seconds: float, tokens: int) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.tokens[name] = self.tokens.get(name, 0) + tokens


def time_prompt(run: Contenders, ids: list[int], n: int, n_self: int) -> None:
    """Every contender on one prompt, back to back."""
    target, eos, options = run.target, run.eos, run.options
    hf_out, dt = timed(hf_generate, run.hf_target, ids, n, sampling=GREEDY, eos_ids=eos)
    run.add("hf", dt, len(hf_out))
    run.hf_seconds.append(dt / len(hf_out))
    (base_out, base_stats), dt = timed(target_generate, target, [ids], n, eos_ids=eos)
    run.add("base", dt, len(base_out[0]))
    run.base_stats.append(base_stats)
    run.same_as_hf.append(base_out[0] == hf_out)
    (exact_out, _), dt = timed(target_generate, target, [ids], n, eos_ids=eos, row_exact=True)
    run.add("exact_base", dt, len(exact_out[0]))
    assisted_out, dt = timed(hf_generate, run.hf_target, ids, n, sampling=GREEDY, eos_ids=eos, assistant=run.hf_draft)
    run.add("assisted", dt, len(assisted_out))
    (spec_out, _), dt = timed(speculative_generate, target, run.draft, [ids], n, options=options, eos_ids=eos)
    run.add("spec", dt, len(spec_out[0]))
    run.identical.append(spec_out[0] in (base_out[0], exact_out[0]))  # the timed or the row-exact target's
    # Self-drafting without EOS, so that every round is a full one.
    (out, st), dt = timed(target_generate, target, [ids], n_self)
    run.add("self_base", dt, len(out[0]))
    run.self_base_stats.append(st)
    (out2, st2), dt = timed(speculative_generate, target, target, [ids], n_self, options=options)
    run.add("self_spec", dt, len(out2[0]))
    run.self_stats.append(st2)
    run.identical.extend(greedy_identical(target, [ids], n_self, frozenset(), [out[0]], [out2[0]]))


def print_result(result: dict, gamma: int) -> None:
    print()
    print(f"target-only decoder / transformers generate:        {result['base_vs_hf']:.2f}x  (goal >= 1.0)")
    print(
        f"target-alone step {result['target_step_ms']:.1f} ms (generate: {result['hf_ms_per_token']:.1f} ms a token, "
        f"prefill included); its weights, {result['step_weight_mib']:.0f} MiB, read at the measured "
        f"{result['memory_read_gb_per_s']:.1f} GB/s take {result['step_limit_ms']:.1f} ms: the step runs at "
        f"{result['step_limit_ms'] / result['target_step_ms']:.0%} of that limit"
    )
    shapes = result["column_form_shapes"]
    print(f"few-row products in the column form for weight shapes {shapes}" if shapes else "few-row products: linear")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    parser.add_argument("--name", default=None, help="results/NAME.json (default: decoder_vs_hf[_DTYPE])")
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
    run = Contenders(target, draft, hf_target, hf_draft, eos, DecodeOptions(gamma=gamma))
    print(f"{describe()}; {str(dtype).removeprefix('torch.')}")
    n_self = 1 + ((n - 1) // (gamma + 1)) * (gamma + 1)  # whole rounds only, so tau is exact

    # Warm-up.
    hf_generate(hf_target, prompts[0], 8, sampling=GREEDY, eos_ids=eos)
    target_generate(target, prompts[:1], 8, eos_ids=eos)
    speculative_generate(target, draft, prompts[:1], 8, options=run.options, eos_ids=eos)

    keys = ("base_vs_hf", "row_exact_vs_base", "spec_vs_assisted", "self_speedup", "self_predicted", "self_tau")
    rows = {k: [] for k in keys}
    for rep in range(args.repeats):
        run.seconds, run.tokens, run.self_stats, run.self_base_stats = {}, {}, [], []
        for ids in prompts:
            time_prompt(run, ids, n, n_self)
        tps = {k: run.tokens[k] / run.seconds[k] for k in CONTENDERS}
        c, v = step_costs(sum_stats(run.self_base_stats), sum_stats(run.self_stats), calls=len(run.self_stats))
        rows["base_vs_hf"].append(tps["base"] / tps["hf"])
        rows["row_exact_vs_base"].append(tps["exact_base"] / tps["base"])
        rows["spec_vs_assisted"].append(tps["spec"] / tps["assisted"])
        rows["self_speedup"].append(tps["self_spec"] / tps["self_base"])
        rows["self_predicted"].append(predicted_speedup(1.0, gamma, c, v))
        rows["self_tau"].append(sum_stats(run.self_stats).mean_accepted_tokens)
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {tps[k]:.1f} t/s" for k in tps) + f"; c={c:.2f} v={v:.2f}")

    result = {k: median(v) for k, v in rows.items()}
    bandwidth, weights = memory_read_bandwidth(), step_weight_bytes(target)
    result.update(
        target_step_ms=single_step_time(sum_stats(run.base_stats)) * 1e3,
        hf_ms_per_token=median(run.hf_seconds) * 1e3,  # prefill included, as generate gives it
        step_weight_mib=weights / 2**20,
        memory_read_gb_per_s=bandwidth / 1e9,
        step_limit_ms=weights / bandwidth * 1e3,
        column_form_shapes=sorted(list(shape) for shape in column_form_shapes(target)),
    )
    result["self_efficiency"] = result["self_speedup"] / result["self_predicted"]
    result["identical_outputs"] = all(run.identical)
    result["baseline_same_as_hf"] = sum(run.same_as_hf) / len(run.same_as_hf)
    result.update(dtype=str(dtype).removeprefix("torch."), gamma=gamma, max_new_tokens=n, prompts=len(prompts))
    result.update(repeats=args.repeats, torch_threads=torch.get_num_threads())
    print_result(result, gamma)
    default = "decoder_vs_hf" if dtype == torch.float32 else f"decoder_vs_hf_{result['dtype']}"
    save(args.name or default, result)


if __name__ == "__main__":
    main()
