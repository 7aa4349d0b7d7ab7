"""Few-row products as torch's ``linear`` or as ``weight @ rows^T`` (``specdec.matmul``), side by side.

Two copies of the target (and of the draft), one held to torch's ``linear`` and one to the column
form, in the dtype the run asks for (float32 by default: the dtype of CPUs without native bfloat16,
where the column form pays). Measured in one run, interleaved:

- forwards of 1-4 tokens of the target over a 128-token cache, each form, medians of ``--reps``:
  milliseconds, and each width's cost in one-token steps of its own form (the v of a verification);
- per prompt and repeat, back to back: the target-only decoder and the speculative decoder (gamma,
  pacing and guesses as ``draftsmith eval`` sets them; ``--no-pace`` drafts every round) in each
  form. Ratios of tokens/s, medians over repeats; greedy output checked against the target-only
  decoder of the same form and across forms.

Run: .venv/bin/python benchmarks/matmul_forms.py --draft quickstart/draft [--repeats 3] [--dtype float32]
To see what an AVX2-only CPU's kernels do on a newer one, run it under ``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` (the JSON records these variables).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from common import default_target, interleaved, median, prompt_ids, save, timed

from draftsmith.specdec import draft_vocab
from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import load_model, resolve_dtype
from draftsmith.specdec.matmul import use_column_products
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.stream import ModelStream, decoding_threads

FORMS = ("linear", "columns")
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


def load_pair(draft_folder: Path, dtype: torch.dtype, columns: bool):
    target, tokenizer, eos = default_target(dtype=dtype)
    draft = load_model(str(draft_folder), torch.device("cpu"), dtype)
    if (draft_folder / draft_vocab.FILE).is_file():
        draft = draft_vocab.SubsetHeadDraft(draft, draft_vocab.load_ranking(draft_folder), eos)
    use_column_products(target, columns)
    use_column_products(draft, columns)
    return target, draft, tokenizer, eos


@torch.inference_mode()
def forward_costs(targets: dict[str, torch.nn.Module], widths: range, reps: int, context: int = 128) -> dict:
    """Seconds per forward of each width in each form (medians), the forms interleaved per repetition."""
    streams, times = {}, {(form, w): [] for form in targets for w in widths}
    prompt = torch.arange(1, context + 1)[None]
    for form, model in targets.items():
        streams[form] = ModelStream(model, 1, context + max(widths) + 8, default_cache_kind(model.device))
        streams[form].forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    keep = torch.tensor([context])
    with decoding_threads(next(iter(targets.values()))):
        for _ in range(reps + 1):  # the first pass warms up
            for width in widths:
                for form, stream in streams.items():
                    x = torch.ones(1, width, dtype=torch.long)
                    _, seconds = timed(stream.forward, x, torch.ones_like(x, dtype=torch.bool))
                    stream.rollback(keep)
                    times[form, width].append(seconds)
    return {key: median(values[1:]) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="a trained draft folder (a published draft or a checkpoint)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--pace", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--reps", type=int, default=15, help="forwards per width and form for the step costs")
    parser.add_argument("--name", default="matmul_forms", help="results/<name>.json")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    pairs = {form: load_pair(Path(args.draft), dtype, form == "columns") for form in FORMS}
    tokenizer, eos = pairs["linear"][2], pairs["linear"][3]
    prompts = prompt_ids(tokenizer, args.prompts)
    n, options = args.max_new_tokens, DecodeOptions(gamma=args.gamma, pace=args.pace)

    widths = range(1, 5)
    cost = forward_costs({form: pairs[form][0] for form in FORMS}, widths, args.reps)
    steps = {
        form: {w: {"ms": 1e3 * cost[form, w], "steps": cost[form, w] / cost[form, 1]} for w in widths} for form in FORMS
    }
    for form in FORMS:
        row = ", ".join(f"{w} tokens {s['ms']:.1f} ms ({s['steps']:.2f} steps)" for w, s in steps[form].items())
        print(f"{form:8s} {row}")

    runs = {}
    for form in FORMS:
        target, draft = pairs[form][0], pairs[form][1]
        runs[f"target_{form}"] = lambda ids, t=target: target_generate(t, [ids], n, eos_ids=eos)
        runs[f"spec_{form}"] = lambda ids, t=target, d=draft: speculative_generate(
            t, d, [ids], n, options=options, eos_ids=eos
        )
    ratios = {k: [] for k in ("target_columns_vs_linear", "speedup_linear", "speedup_columns", "columns_vs_linear")}
    identical = {"linear": [], "columns": [], "targets_across_forms": []}
    for rep, done in enumerate(interleaved(runs, prompts, args.repeats)):
        for i in range(len(prompts)):
            for form in FORMS:
                identical[form].append(done.outputs[f"spec_{form}", i] == done.outputs[f"target_{form}", i])
            identical["targets_across_forms"].append(
                done.outputs["target_columns", i] == done.outputs["target_linear", i]
            )
        tps = done.tokens_per_s
        ratios["target_columns_vs_linear"].append(tps["target_columns"] / tps["target_linear"])
        ratios["speedup_linear"].append(tps["spec_linear"] / tps["target_linear"])
        ratios["speedup_columns"].append(tps["spec_columns"] / tps["target_columns"])
        ratios["columns_vs_linear"].append(tps["spec_columns"] / tps["target_linear"])
        alpha = done.alpha()
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v:.1f} t/s" for k, v in tps.items()))

    result = {k: median(v) for k, v in ratios.items()}
    result.update(
        spread={k: [min(v), max(v)] for k, v in ratios.items()},
        forward_costs=steps,
        alpha=alpha,
        identical={k: sum(v) / len(v) for k, v in identical.items()},
        draft=args.draft,
        dtype=str(dtype).removeprefix("torch."),
        gamma=args.gamma,
        pace=args.pace,
        max_new_tokens=n,
        prompts=len(prompts),
        repeats=args.repeats,
        kernel_variables={k: os.environ.get(k) for k in KERNEL_VARIABLES},
    )
    print()
    print(f"target alone, columns / linear tokens/s:        {result['target_columns_vs_linear']:.2f}x")
    print(f"speculative / target alone, both linear:        {result['speedup_linear']:.2f}x")
    print(f"speculative / target alone, both columns:       {result['speedup_columns']:.2f}x")
    print(f"speculative in columns / target alone linear:   {result['columns_vs_linear']:.2f}x")
    print(f"alpha at gamma {args.gamma}: " + ", ".join(f"{k} {v:.3f}" for k, v in alpha.items()))
    print("greedy output identical: " + str(result["identical"]))
    save(args.name, result)


if __name__ == "__main__":
    main()
