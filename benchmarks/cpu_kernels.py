"""Two CPU kernel choices behind the bfloat16 decoding path, timed side by side in one run.

1. The LM head (49,152 x 576, the default target's) on a (1, 1, H) slice of a (1, Q, H) hidden
   state, as ``logits_to_keep`` hands it over, against the same row with standard strides
   (``stream.standard_strides_into_head``).
2. One query over a few hundred keys with grouped-query attention (9 query heads, 3 key/value
   heads): ``sdpa`` with ``enable_gqa`` against heads packed by key/value group
   (``attention.one_query_attention``).
3. One decoding step of the default target for one sequence on a 100-token cache: one row, as plain
   decoding (and the target-only baseline) steps, against two rows, the decoder's row-exact step
   (``stream``), alternating step by step.

Ratios are medians over repeats of interleaved timings. Run: .venv/bin/python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import argparse
import time

import torch
from common import default_target, median, save

from draftsmith.specdec.attention import one_query_attention
from draftsmith.specdec.stream import ModelStream, decoding_threads


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def step_times(dtype: torch.dtype, repeats: int, steps: int = 40) -> list[float]:
    """Per repeat: the median of ``steps`` two-row steps over the median of as many one-row steps of the
    default target, each stream stepping once in turn on a 100-token cache (rolled back after each)."""
    target, _, _ = default_target(dtype=dtype)
    prompt = torch.arange(1, 101)[None] % target.config.vocab_size
    token, valid = torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.bool)
    streams = {}
    for exact in (False, True):
        streams[exact] = ModelStream(target, 1, 128, "slot", row_exact=exact)
        streams[exact].forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    keep = torch.tensor([100])
    ratios = []
    with torch.inference_mode(), decoding_threads(target):
        for rep in range(repeats + 1):  # the first pass warms up
            spent = {False: [], True: []}
            for _ in range(steps):
                for exact, stream in streams.items():
                    start = time.perf_counter()
                    stream.forward(token, valid)
                    spent[exact].append(time.perf_counter() - start)
                    stream.rollback(keep)
            if rep:
                ratios.append(median(spent[True]) / median(spent[False]))
                one, two = median(spent[False]) * 1e3, median(spent[True]) * 1e3
                print(f"repeat {rep}: target step, one row {one:.2f} ms, two rows {two:.2f} ms")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weight = torch.randn(49152, 576, dtype=dtype)
    hidden = torch.randn(1, 3, 576, dtype=dtype)
    sliced = hidden[:, -1:, :]  # batch stride 3*576, as logits_to_keep=1 leaves it
    standard = sliced.clone(memory_format=torch.contiguous_format)
    query = torch.randn(1, 9, 1, 64, dtype=dtype)
    keys, values = torch.randn(1, 3, 300, 64, dtype=dtype), torch.randn(1, 3, 300, 64, dtype=dtype)
    runs = {
        "head_sliced": lambda: torch.nn.functional.linear(sliced, weight),
        "head_standard": lambda: torch.nn.functional.linear(standard, weight),
        "attn_sdpa_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True),
        "attn_packed": lambda: one_query_attention(query, keys, values, None),
    }
    ratios = {"head_sliced_vs_standard": [], "attn_gqa_vs_packed": []}
    with torch.inference_mode():
        torch.testing.assert_close(runs["head_sliced"](), runs["head_standard"]())
        torch.testing.assert_close(
            runs["attn_packed"]().reshape(1, 9, 64), runs["attn_sdpa_gqa"]().reshape(1, 9, 64), rtol=2e-2, atol=2e-2
        )
        for fn in runs.values():
            fn()
        for rep in range(args.repeats):
            t = {name: per_call(fn, 5 if name.startswith("head") else 200) for name, fn in runs.items()}
            ratios["head_sliced_vs_standard"].append(t["head_sliced"] / t["head_standard"])
            ratios["attn_gqa_vs_packed"].append(t["attn_sdpa_gqa"] / t["attn_packed"])
            print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()))
    ratios["target_step_two_rows_vs_one"] = step_times(dtype, args.repeats)
    result = {k: median(v) for k, v in ratios.items()}
    result.update(dtype=args.dtype, repeats=args.repeats, torch_threads=torch.get_num_threads())
    print()
    print(f"LM head on a sliced row / on the same row with standard strides: {result['head_sliced_vs_standard']:.1f}x")
    print(f"single-query attention, sdpa enable_gqa / packed by group:       {result['attn_gqa_vs_packed']:.1f}x")
    print(
        f"target step of one sequence, two rows / one row:                 {result['target_step_two_rows_vs_one']:.3f}x"
    )
    save(f"cpu_kernels_{args.dtype}", result)


if __name__ == "__main__":
    main()
