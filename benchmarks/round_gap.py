"""Where a speculative round's time goes, beside what theory says it costs, from one run.

The default target decodes the held-out prompts alone and with a draft (a truncated 2-layer copy of
the target unless ``--draft`` names a trained one), interleaved prompt by prompt (the variants and
their baselines in a rotating order), greedy. For each variant it prints:

- the predicted speedup ``(1 - a^(g+1)) / ((1 - a)(g c + v))`` from the run's own alpha, c and v (as
  ``draftsmith eval`` computes it, ``measure.figures.pair_metrics``), and the measured speedup;
- each decoder's time per round (per step for the target alone) split into its parts: the model
  forwards of the draft and of verification (with the slot bookkeeping of each forward, its
  positions and mask, apart), cache crops on rollback, the drafter's own work between its forwards,
  acceptance and choosing tokens, emitting, the pacer and its lookups, the prefill, setting up the
  caches, and what remains of the loop (Python between them), with host syncs (tensor values read
  into Python: ``tolist``, ``item``, ``bool``, ``int``, ``float``) per round;
- what each part costs the speedup: the ratio measured with that part's seconds taken out of both
  decoders' time. The formula counts only the draft's and the verification's laps, so the parts
  outside them are the gap between predicted and measured.

Variants (``--variants``): ``eager`` (the default decoder on a CPU), ``compiled`` (both models'
decoding steps as ``torch.compile`` d graphs, ``specdec/compiled.py``; its baseline compiled too),
``paced`` (``DecodeOptions.pace``, lookup guesses priced by the pacer). Compilation happens in the
warm-up and is reported apart. Timing figures from a shared machine are indicative only: every
ratio is taken side by side, but the parts' absolute seconds move with the load.

Run: .venv/bin/python benchmarks/round_gap.py [--prompts 4 --max-new-tokens 48 --repeats 2 --gamma 1]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from common import default_target, prompt_ids, save
from kind_runs import decoding_draft

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec import decoder
from draftsmith.specdec.cache import SlotTracker
from draftsmith.specdec.compiled import CompiledStream
from draftsmith.specdec.drafters import LMDrafter
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.measure.costs import step_weight_bytes
from draftsmith.specdec.measure.figures import pair_metrics
from draftsmith.specdec.measure.machine import describe, memory_read_bandwidth
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer
from draftsmith.specdec.stream import ModelStream

SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__")  # a tensor's value read into Python
PARTS = (
    "draft forwards",
    "verify forwards",
    "slot bookkeeping",
    "cache crops",
    "drafting logic",
    "acceptance",
    "emitting",
    "pacer and lookups",
    "prefill",
    "setup",
    "loop",
)
# the parts outside the laps the formula's c and v are taken from (a round's draft and verification laps)
OUTSIDE = ("acceptance", "emitting", "cache crops", "prefill", "setup", "loop")


class Parts:
    """Seconds spent in each part of a decoding call, exclusive of the parts called inside it (a stack
    of open frames: a frame's time less its children's goes to its part), and host syncs."""

    def __init__(self, target: torch.nn.Module):
        self.target = target  # a stream of this model verifies; any other drafts
        self.seconds: dict[str, float] = defaultdict(float)
        self.syncs = 0
        self.stack: list[list] = []  # [part, start, children's seconds]
        self.prefilled: set[int] = set()  # streams that have run their first forward (the prefill) this call

    def frame(self, part: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.stack.append([part, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, children = self.stack.pop()
                spent = time.perf_counter() - start
                self.seconds[name] += spent - children
                if self.stack:
                    self.stack[-1][2] += spent

        return timed

    def stream_forward(self, fn: Callable) -> Callable:
        """A stream's forward: its first in a call is the prefill, later ones the draft's or verification's."""

        @functools.wraps(fn)
        def forward(stream, *args, **kwargs):
            first = id(stream) not in self.prefilled
            self.prefilled.add(id(stream))
            role = "prefill" if first else ("verify forwards" if stream.model is self.target else "draft forwards")
            return self.frame(role, fn)(stream, *args, **kwargs)

        return forward

    def count(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.syncs += 1
            return fn(*args, **kwargs)

        return counted


@contextlib.contextmanager
def instrumented(parts: Parts) -> Iterator[None]:
    """Every part's functions wrapped to time it (``Parts``) for the block, and tensor reads counted."""
    patches = [
        (ModelStream, "forward_features", parts.stream_forward),
        (CompiledStream, "forward", parts.stream_forward),  # its forward_features calls forward
        (ModelStream, "rollback", functools.partial(parts.frame, "cache crops")),
        (CompiledStream, "rollback", functools.partial(parts.frame, "cache crops")),
        (SlotTracker, "reserve", functools.partial(parts.frame, "slot bookkeeping")),
        (SlotTracker, "attention_mask", functools.partial(parts.frame, "slot bookkeeping")),
        (LMDrafter, "propose", functools.partial(parts.frame, "drafting logic")),
        (decoder, "accept", functools.partial(parts.frame, "acceptance")),
        (decoder, "choose_token", functools.partial(parts.frame, "acceptance")),
        (decoder, "_emit_round", functools.partial(parts.frame, "emitting")),
        (decoder.Outputs, "emit", functools.partial(parts.frame, "emitting")),
        (decoder, "_start_guesses", functools.partial(parts.frame, "pacer and lookups")),
        (decoder, "_add_guesses", functools.partial(parts.frame, "pacer and lookups")),
        (decoder, "_continuation", functools.partial(parts.frame, "pacer and lookups")),
        (Pacer, "drafts", functools.partial(parts.frame, "pacer and lookups")),
        (Pacer, "record", functools.partial(parts.frame, "pacer and lookups")),
        (Pacer, "settle", functools.partial(parts.frame, "pacer and lookups")),
        (decoder, "decoding_pair", functools.partial(parts.frame, "setup")),
        (decoder, "make_stream", functools.partial(parts.frame, "setup")),
        *((torch.Tensor, name, parts.count) for name in SYNCS),
    ]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]  # None: inherited
    try:
        for owner, name, wrap in patches:
            setattr(owner, name, wrap(getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def the_draft(spec: str | None, target, eos):
    """A trained draft folder as eval decodes it (with its cut head where it has one), or the target's
    first two layers."""
    return truncate_target(target, 2) if spec is None else decoding_draft(Path(spec), target, eos)


def variant_options(name: str, gamma: int) -> DecodeOptions:
    if name == "eager":
        return DecodeOptions(gamma=gamma, compile=False)
    if name == "compiled":
        return DecodeOptions(gamma=gamma, compile=True)
    if name == "paced":
        return DecodeOptions(gamma=gamma, compile=False, pace=True)
    raise SystemExit(f"unknown variant {name!r}: choose eager, compiled or paced")


def run_all(target, draft, prompts, eos, args) -> tuple[dict, dict, dict]:
    """Every variant's pair on every prompt, interleaved: the tallies per (variant, decoder) and each
    run's parts (seconds, syncs) summed, and the warm-up's seconds per variant."""
    variants = {name: variant_options(name, args.gamma) for name in args.variants.split(",")}
    runs: dict[tuple[str, str], Callable] = {}
    n = args.max_new_tokens
    for name, options in variants.items():
        runs[name, "target"] = lambda ids, o=options: decoder.target_generate(target, [ids], n, o, eos)
        runs[name, "spec"] = lambda ids, o=options: decoder.speculative_generate(target, draft, [ids], n, o, eos)
    warm = {}
    for name in variants:  # compilation and first-call costs, outside every figure
        start = time.perf_counter()
        runs[name, "target"](prompts[0])
        runs[name, "spec"](prompts[0])
        warm[name] = time.perf_counter() - start
    tallies = {key: [Tally() for _ in range(args.repeats)] for key in runs}
    parts = {key: Parts(target) for key in runs}
    order = list(runs)
    for repeat in range(args.repeats):
        for index, ids in enumerate(prompts):
            shift = (repeat + index) % len(order)
            for key in order[shift:] + order[:shift]:
                parts[key].prefilled.clear()
                with instrumented(parts[key]):
                    start = time.perf_counter()
                    out, stats = runs[key](ids)
                    stats.total_time = time.perf_counter() - start  # the call's wall time, setup included
                tallies[key][repeat].add(stats)
    return tallies, parts, warm


def split_table(name: str, tallies: dict, parts: dict) -> dict:
    """Per variant: per round (spec) and per step (target) seconds by part, and what each part costs."""
    spec, base = tallies[name, "spec"], tallies[name, "target"]
    spec_s, base_s = sum(t.seconds for t in spec), sum(t.seconds for t in base)
    spec_rounds = sum(s.rounds for t in spec for s in t.stats)
    base_steps = sum(s.rounds for t in base for s in t.stats)
    spec_tokens, base_tokens = sum(t.tokens for t in spec), sum(t.tokens for t in base)
    measured = (spec_tokens / spec_s) / (base_tokens / base_s)
    rows = {}
    for decoder_name, total in (("spec", spec_s), ("target", base_s)):
        seconds = parts[name, decoder_name].seconds
        seconds["loop"] = total - sum(v for k, v in seconds.items() if k != "loop")
    for part in PARTS:
        in_spec, in_base = parts[name, "spec"].seconds.get(part, 0.0), parts[name, "target"].seconds.get(part, 0.0)
        without = (spec_tokens / (spec_s - in_spec)) / (base_tokens / (base_s - in_base))
        rows[part] = {
            "spec_ms_per_round": 1e3 * in_spec / spec_rounds,
            "target_ms_per_step": 1e3 * in_base / base_steps,
            "speedup_without_it": without,
        }
    outside_spec = sum(parts[name, "spec"].seconds.get(part, 0.0) for part in OUTSIDE)
    outside_base = sum(parts[name, "target"].seconds.get(part, 0.0) for part in OUTSIDE)
    return {
        "measured": measured,
        "measured_without_outside": (spec_tokens / (spec_s - outside_spec)) / (base_tokens / (base_s - outside_base)),
        "parts": rows,
        "spec_ms_per_round": 1e3 * spec_s / spec_rounds,
        "target_ms_per_step": 1e3 * base_s / base_steps,
        "syncs_per_round": parts[name, "spec"].syncs / spec_rounds,
        "syncs_per_step": parts[name, "target"].syncs / base_steps,
    }


def figures(name: str, tallies: dict, gamma: int) -> dict:
    """alpha, tau, c, v and the predicted speedup of the median repeat (by measured speedup), as eval has them."""
    pairs = zip(tallies[name, "target"], tallies[name, "spec"], strict=True)
    per_repeat = [pair_metrics(base, spec, gamma) for base, spec in pairs]
    median = sorted(per_repeat, key=lambda f: f.speedup)[len(per_repeat) // 2]
    return {
        "alpha": median.acceptance_rate,
        "tau": median.mean_accepted_tokens,
        "c": median.cost_ratio_c,
        "v": median.verify_ratio_v,
        "predicted": median.predicted_speedup,
        "measured_median_repeat": median.speedup,
        "measured_per_repeat": [f.speedup for f in per_repeat],
    }


def print_variant(name: str, result: dict) -> None:
    f, s = result["figures"], result["split"]
    print(
        f"\n{name}: alpha {f['alpha']:.3f}, tau {f['tau']:.2f}, c {f['c']:.3f}, v {f['v']:.3f}; "
        f"predicted {f['predicted']:.3f}x, measured {s['measured']:.3f}x (repeats {f['measured_per_repeat']})"
    )
    print(f"{'part':>20} {'spec ms/round':>14} {'target ms/step':>15} {'speedup without it':>19}")
    for part, row in s["parts"].items():
        print(
            f"{part:>20} {row['spec_ms_per_round']:14.3f} {row['target_ms_per_step']:15.3f} "
            f"{row['speedup_without_it']:18.3f}x"
        )
    print(
        f"{'total':>20} {s['spec_ms_per_round']:14.3f} {s['target_ms_per_step']:15.3f}   "
        f"host syncs: {s['syncs_per_round']:.1f} per round, {s['syncs_per_step']:.1f} per step"
    )
    print(
        f"measured with the parts outside the formula's laps ({', '.join(OUTSIDE)}) taken out of both decoders: "
        f"{s['measured_without_outside']:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=None, help="a trained draft folder (default: the target's first 2 layers)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (default: auto, as eval decodes)")
    parser.add_argument("--variants", default="eager,compiled,paced", help="comma-separated: eager, compiled, paced")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    parser.add_argument("--name", default="round_gap", help="results/NAME.json (default: round_gap)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    target, tokenizer, eos = default_target(dtype=dtype)
    draft = the_draft(args.draft, target, eos).eval()
    prompts = prompt_ids(tokenizer, args.prompts)
    print(f"{describe()}; {str(dtype).removeprefix('torch.')}; gamma {args.gamma}; {len(prompts)} prompts")
    tallies, parts, warm = run_all(target, draft, prompts, eos, args)
    result = {"dtype": str(dtype).removeprefix("torch."), "gamma": args.gamma, "draft": args.draft or "truncate:2"}
    result.update(prompts=len(prompts), max_new_tokens=args.max_new_tokens, repeats=args.repeats, variants={})
    for name in args.variants.split(","):
        entry = {"figures": figures(name, tallies, args.gamma), "split": split_table(name, tallies, parts)}
        entry["warm_up_s"] = warm[name]
        result["variants"][name] = entry
        print_variant(name, entry)
    bandwidth, weights = memory_read_bandwidth(), step_weight_bytes(target)
    limit_ms = 1e3 * weights / bandwidth
    result["memory_read_gb_per_s"], result["step_limit_ms"] = bandwidth / 1e9, limit_ms
    print(
        f"\nmemory read bandwidth {bandwidth / 1e9:.1f} GB/s: a target step reads {weights / 2**20:.0f} MiB of "
        f"weights, {limit_ms:.1f} ms at that rate"
    )
    save(args.name, result)
    print(Path(__file__).name, "done")


if __name__ == "__main__":
    main()
