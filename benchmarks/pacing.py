"""Pacing on real drafts: how often the decoder pauses a sequence that drafting would have paid for,
and what that costs, replayed exactly from greedy agreement traces, then timed side by side.

Greedy decoding is deterministic, so where a chain of gamma proposals stops is known in advance: the
draft's greedy token at output position i, given the target's own output before it, either equals
the target's token there or not. One teacher-forced draft forward over each prompt and the target's
greedy answer gives that agreement at every position. A round that starts at position i with g
proposals accepts the run of agreements from i (at most g) and emits one token more; a paused round
emits one, plus the lookup guesses (``specdec.lookup``: the tokens after an earlier occurrence of the
answer's last n-gram) the target keeps, as a drafting round whose chain was all kept does after
it. Replaying the decoder's own ``Pacer`` over those traces with a cost model (a plain step 1, a
drafting round c * g + v, each guess ``--row`` more; c and v as eval-run measures them) gives, in
seconds of CPU, what each pacing rule would do on those prompts: rounds paused, tokens per unit
time, and the speedup the cost model predicts. It is a model (it leaves out the decoder's per-round
bookkeeping), so the part that counts is the timed one:

``--time``: for each prompt and repeat, the target alone, the decoder unpaced, paced (lookup guesses
where the pacer finds their rows paying, the default), paced verifying every guess found, paced with
other numbers of guess tokens a round, paced without guesses, and with a pacer that never lets a
sequence draft (guesses only), interleaved (each prompt runs them back to back, in a rotating
order), greedy output checked against the target's. Per category
and overall: the measured speedup of each, the median over repeats and its range.

    .venv/bin/python benchmarks/pacing.py --draft quickstart/draft --gamma 1 --time --repeats 3
    .venv/bin/python benchmarks/pacing.py --draft quickstart/draft --gamma 1 --time --repeats 30 \
        --categories translation --name pacing_translation

Written to ``benchmarks/results/pacing.json`` (``--name``: another file of that folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import PROMPTS, default_target, machine, save
from kind_runs import decoding_draft

from draftsmith.specdec import decoder
from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.compiled import make_stream
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import cpu_has_native_bfloat16
from draftsmith.specdec.lookup import STRONG_NGRAM, lookup_continuation
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import Pacer, PaceSettings
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.stream import decoding_threads

# The pacer's defaults, and other settings replayed beside them ("fixed prior": the prior not centred
# on the draft's confidence; "no prior, ...": the rule the pacer had before any prior, less the 3
# warm-up rounds it also had).
VARIANTS = {
    "pacer": PaceSettings(),
    "fixed prior": PaceSettings(confidence=0.0),
    "no prior, decay 0.7, probe 8": PaceSettings(
        prior=(0.0, 0.0), confidence=0.0, decay=0.7, probe_every=8, backoff=1.0
    ),
    "decay 0.7": PaceSettings(decay=0.7),
    "no decay": PaceSettings(decay=1.0),
    "fixed prior (1, 1), probe 16": PaceSettings(prior=(1.0, 1.0), confidence=0.0, probe_every=16),
    "probe 16": PaceSettings(probe_every=16),
    "no back-off": PaceSettings(backoff=1.0),
    "backoff 2, at most 16": PaceSettings(backoff=2.0, probe_max=16),
    "backoff 1.5, at most 32": PaceSettings(backoff=1.5, probe_max=32),
    "fixed prior (0.25, 0.5)": PaceSettings(prior=(0.25, 0.5), confidence=0.0),
    "fixed prior (0.25, 0.5), decay 0.9": PaceSettings(prior=(0.25, 0.5), confidence=0.0, decay=0.9),
    "confidence 1.5": PaceSettings(confidence=1.5),
    "confidence 3": PaceSettings(confidence=3.0),
    "confidence 12": PaceSettings(confidence=12.0),
    "confidence 3, probe 8": PaceSettings(confidence=3.0, probe_every=8),
    "margin 1.2": PaceSettings(margin=1.2),
    "margin 1.0": PaceSettings(margin=1.0),
    "no probe budget": PaceSettings(probe_budget=0.0),
    "probe budget 0.05": PaceSettings(probe_budget=0.05),
    "guess misses 0.5": PaceSettings(guess_misses=0.5),
    "guess misses 2": PaceSettings(guess_misses=2.0),
    "guess misses 4": PaceSettings(guess_misses=4.0),
    "guess misses 8": PaceSettings(guess_misses=8.0),
}


def agreement(target, draft, prompt: list[int], answer: list[int], guess_tokens: int) -> dict:
    """Whether the draft's greedy token at each answer position equals the target's, given the
    target's answer before it (one teacher-forced forward of the draft), the probability the draft
    gave that token (what pacing reads as its confidence), and how many of the lookup guesses made
    there (``guess_tokens`` at most) are the target's next tokens."""
    ids = torch.tensor([prompt + answer[:-1]], device=target.device)
    with torch.inference_mode():
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 :]
    probs = logits.float().softmax(-1)
    gained, offered, repeats = [], [], []
    for i in range(len(answer)):
        (guess, repeat), kept = lookup_continuation(prompt + answer[:i], guess_tokens), 0
        while kept < len(guess) and i + kept < len(answer) and guess[kept] == answer[i + kept]:
            kept += 1
        gained.append(kept)
        offered.append(len(guess))
        repeats.append(repeat)
    return {
        "agrees": (logits.argmax(-1) == torch.tensor(answer, device=target.device)).tolist(),
        "confidence": [round(x, 4) for x in probs.max(-1).values.tolist()],
        "gained": gained,
        "offered": offered,
        "repeat": repeats,
    }


def replay(
    trace: dict,
    gamma: int,
    c: float,
    v: float,
    pacer: Pacer | None,
    pause: float = 1.0,
    guesses: bool = True,
    row: float = 0.0,
) -> dict:
    """One sequence decoded by the chain rounds the ``pacer`` (None: never paused, no guesses)
    chooses, under the cost model: tokens, model time, rounds and paused rounds. ``pause``: a round
    without drafts, in target steps (1 for the plain one-row step, v for a row-exact one); with
    ``guesses`` the pacer chooses the lookup guesses of each round as the decoder's does (a lookup
    round instead of drafting, guesses in a paused round, guesses after a chain, kept only where the
    whole chain was), each guess row after the first of a paused round (which a row-exact step of one
    sequence pads anyway) costing ``row`` more; the pacer is handed the forwards' costs by width, as
    the decoder's clock times them. The answer's first token comes with the prompt's forward, for
    the target alone as for the decoder, so the rounds start at the second and the target's time is
    one step per later token."""
    agrees, sure, gained, offered = trace["agrees"], trace["confidence"], trace["gained"], trace["offered"]
    n, pos, spent, rounds, paused = len(agrees), 1, 0.0, 0, 0
    guessing = guesses and pacer is not None
    while pos < n:
        go = pacer.drafts([0])[0] if pacer is not None else True
        room = n - pos - 1
        found = min(offered[pos], room) if guessing else 0
        strong = trace["repeat"][pos] >= STRONG_NGRAM
        looked = pacer.lookup_guesses(0, found) if go and strong and found else 0  # instead of drafting
        g = min(gamma, room) if go and not looked else 0
        rounds += 1
        if g == 0:
            paused += go is False
            tried = looked or (pacer.paused_guesses(0, found) if found else 0)
            extra = min(gained[pos], tried)
            forward = pause + row * max(tried - 1, 0)
            spent += forward
            if pacer is not None:
                pacer.record([0], torch.tensor([0]), torch.tensor([0]), 0.0, forward, 1 + tried)
                if guessing and room >= 1:
                    pacer.record_guess(0, min(gained[pos], found), strong)
            pos += 1 + extra
            continue
        kept = 0
        while kept < g and agrees[pos + kept]:
            kept += 1
        # guesses after the chain where the text with it repeats itself (the target's text where all was kept)
        end, left = pos + g, n - pos - g - 1
        after = min(offered[end], left) if guessing and end < n and trace["repeat"][end] >= STRONG_NGRAM else 0
        tried = pacer.chain_guesses(0, g, after) if after else 0
        extra = min(gained[end], tried) if kept == g else 0
        forward = v + row * tried
        spent += c * g + forward
        if pacer is not None:
            confidence = torch.tensor([sure[pos : pos + g]])
            pacer.record([0], torch.tensor([g]), torch.tensor([kept]), c * g, forward, g + 1 + tried, confidence)
            if guessing:  # the round-start continuation, against the tokens the answer has there
                pacer.record_guess(0, min(gained[pos], found), strong)
        pos += kept + 1 + extra
    return {"tokens": n - 1, "time": spent, "rounds": rounds, "paused": paused}


def replay_all(
    traces: dict[str, list[dict]],
    gamma: int,
    c: float,
    v: float,
    make_pacer,
    pause: float = 1.0,
    guesses: bool = True,
    row: float = 0.0,
) -> dict:
    """Per category: the model's speedup (target time = tokens) and the share of rounds paused."""
    out = {}
    for category, sequences in traces.items():
        runs = [replay(a, gamma, c, v, make_pacer(), pause, guesses, row) for a in sequences]
        tokens, spent = sum(r["tokens"] for r in runs), sum(r["time"] for r in runs)
        out[category] = {
            "speedup": round(tokens / spent, 4) if spent else 1.0,  # one-token answers: nothing to decode
            "paused_share": round(sum(r["paused"] for r in runs) / sum(r["rounds"] for r in runs), 3),
        }
    return out


def by_repeat_length(traces: list[dict]) -> dict:
    """Per length n of the repeat a position's lookup guess follows (0: none): positions, how often
    the first guessed token is the target's, and how often the draft's greedy token is."""
    out = {}
    for n in sorted({n for t in traces for n in t["repeat"]}):
        cells = [(t["gained"][i] > 0, t["agrees"][i]) for t in traces for i, m in enumerate(t["repeat"]) if m == n]
        out[str(n)] = {
            "positions": len(cells),
            "guess_right": round(statistics.fmean(g for g, _ in cells), 3),
            "draft_right": round(statistics.fmean(d for _, d in cells), 3),
        }
    return out


@torch.inference_mode()
def row_costs(target, repeats: int, context: int = 200, widths: int = 6) -> dict:
    """Seconds of a row-exact verification forward of q = 1..``widths`` tokens of one sequence (what a
    round with q - 1 proposals costs) over the plain one-row step, on a ``context``-token cache: the
    widths and the plain step interleaved, 10 * ``repeats`` times each, medians."""
    streams = {}
    for exact in (False, True):
        kind = default_cache_kind(target.device)
        stream = make_stream(target, 1, context + widths + 1, kind, role="target", compiled=False, row_exact=exact)
        prompt = torch.arange(1, context + 1, device=target.device)[None]
        stream.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
        streams[exact] = stream
    cases = [(False, 1)] + [(True, q) for q in range(1, widths + 1)]
    spent = {case: [] for case in cases}
    keep = torch.tensor([context], device=target.device)
    with decoding_threads(target):
        for _ in range(10 * repeats):
            for exact, q in cases:
                tokens = torch.ones(1, q, dtype=torch.long, device=target.device)
                start = time.perf_counter()
                streams[exact].forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
                spent[(exact, q)].append(time.perf_counter() - start)
                streams[exact].rollback(keep)
    plain = statistics.median(spent[(False, 1)])
    return {str(q): round(statistics.median(spent[(True, q)]) / plain, 3) for _, q in cases[1:]}


class NeverDrafts(Pacer):
    """A pacer that pauses every sequence in every round: the decoder then runs the target's own
    steps through its round loop, verifying lookup guesses only, so its time beside the target alone
    is what the guesses gain less the loop's own cost (its bookkeeping, the drafter reading the prompt)."""

    def drafts(self, live: list[int]) -> list[bool]:
        return [False] * len(live)


def timed(target, draft, prompts, categories, eos, args) -> dict:
    """Target alone, unpaced decoding, paced decoding (lookup guesses of ``--guess-tokens`` where they
    pay, and every guess found), with ``--guess-variants`` guess tokens, without guesses, and the
    decoder drafting never (guesses only), interleaved per prompt and repeat (rotating order). Per
    category and repeat the ratio of tokens/s (summed tokens over summed seconds: in bfloat16 the
    timed target, stepping one row, may end an answer elsewhere than the row-exact output the decoder
    reproduces, so the answers' lengths can differ); reported: the median over repeats and its range,
    as ``draftsmith eval`` does (one slow minute of a shared machine moves one repeat, not the figure)."""
    # seconds[category][name][repeat], and the tokens those seconds produced
    seconds = defaultdict(lambda: defaultdict(lambda: [0.0] * args.repeats))
    tokens = defaultdict(lambda: defaultdict(lambda: [0] * args.repeats))
    identical = True
    # what every speculative run must reproduce: the row-exact target's output, untimed (the timed
    # target steps one row, as plain decoding runs fastest)
    reference = [target_generate(target, [p], args.max_new_tokens, eos_ids=eos, row_exact=True)[0] for p in prompts]
    paced = {"pace": True, "exact_pauses": args.exact_pauses}
    runs = {
        "unpaced": DecodeOptions(gamma=args.gamma, pace=False),
        # the decoder's default: guesses where the rows they add pay, as the pacer measures them
        "paced": DecodeOptions(gamma=args.gamma, guess_tokens=args.guess_tokens, **paced),
        "paced, every guess": DecodeOptions(gamma=args.gamma, guesses=True, guess_tokens=args.guess_tokens, **paced),
        **{
            f"paced, {n} guess tokens": DecodeOptions(gamma=args.gamma, guess_tokens=n, **paced)
            for n in args.guess_variants
        },
        "paced, no guesses": DecodeOptions(gamma=args.gamma, guesses=False, **paced),
        # with the NeverDrafts pacer: guesses only
        "never drafting": DecodeOptions(gamma=args.gamma, guess_tokens=args.guess_tokens, **paced),
    }
    order = ["target", *runs]
    for options in runs.values():  # warm-up, not timed: a process's first decoding calls run slow
        speculative_generate(target, draft, [prompts[0]], args.max_new_tokens, options, eos)
    for repeat in range(args.repeats):
        for index, (prompt, category) in enumerate(zip(prompts, categories, strict=True)):
            shift = (repeat + index) % len(order)
            for name in order[shift:] + order[:shift]:
                start = time.perf_counter()
                if name == "target":
                    out, _ = target_generate(target, [prompt], args.max_new_tokens, eos_ids=eos)
                elif name == "never drafting":
                    decoder.Pacer = NeverDrafts  # the decoder's pacer, replaced for this run only
                    try:
                        out, _ = speculative_generate(target, draft, [prompt], args.max_new_tokens, runs[name], eos)
                    finally:
                        decoder.Pacer = Pacer
                else:
                    out, _ = speculative_generate(target, draft, [prompt], args.max_new_tokens, runs[name], eos)
                spent = time.perf_counter() - start
                for key in (category, "all"):
                    seconds[key][name][repeat] += spent
                    tokens[key][name][repeat] += len(out[0])  # the new tokens
                if name != "target" and out != reference[index]:
                    identical = False
    result = {}
    for category, by_name in seconds.items():
        result[category] = {}
        rate = {name: [n / t for n, t in zip(tokens[category][name], by_name[name], strict=True)] for name in order}
        for name in runs:
            ratios = [spec / base for base, spec in zip(rate["target"], rate[name], strict=True)]
            result[category][name] = round(statistics.median(ratios), 4)
            result[category][f"{name} range"] = [round(min(ratios), 4), round(max(ratios), 4)]
    return {"speedup": result, "greedy_match": identical}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="a trained draft folder (a kind that decodes as an LM)")
    p.add_argument(
        "--prompts",
        default=PROMPTS,
        help="a prompts JSONL file (default: the held-out prompts; benchmarks/pacing_prompts.jsonl holds 30 "
        "more, five per category, for comparing pacing rules on more sequences)",
    )
    p.add_argument("--gamma", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--c", type=float, default=0.12, help="draft step / target step, for the replay")
    p.add_argument("--v", type=float, default=1.0, help="verification / target step, for the replay")
    p.add_argument(
        "--row", type=float, default=0.04, help="one more verification row (a guess) / target step, for the replay"
    )
    p.add_argument(
        "--guess-tokens", type=int, default=DecodeOptions.guess_tokens, help="lookup guesses a round verifies, at most"
    )
    p.add_argument(
        "--row-costs",
        action="store_true",
        help="also time the row-exact verification of 1-6 tokens against the plain one-row step (interleaved)",
    )
    p.add_argument(
        "--guess-variants",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1, 2],
        help="--time: also paced with these numbers of guess tokens (comma-separated; default: 1,2)",
    )
    p.add_argument("--save-traces", default=None, help="write the agreement traces to this JSON file")
    p.add_argument(
        "--time", action="store_true", help="also time target, unpaced, paced and never-drafting decoding side by side"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--exact-pauses",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="paused rounds step the target as a verification does, greedy output bit-identical (the decoder's "
        "default); --no-exact-pauses times them as the plain one-row step",
    )
    p.add_argument(
        "--categories",
        default=None,
        help="only the held-out prompts of these categories (comma-separated): a short answer times in "
        "about a second, so one category can take many repeats",
    )
    p.add_argument("--name", default="pacing", help="results/NAME.json (default: pacing)")
    return p.parse_args()


def replay_variants(traces: dict, args: argparse.Namespace, pause: float) -> dict:
    """Every pacing rule replayed over the traces under the cost model (plus never pausing, and the
    pacer without guesses), printed per category as speedup (paused share)."""
    replayed = {"never paused": replay_all(traces, args.gamma, args.c, args.v, lambda: None, pause)}
    for name, settings in VARIANTS.items():
        make = lambda s=settings: Pacer(args.gamma, 1, s, args.guess_tokens)  # noqa: E731
        replayed[name] = replay_all(traces, args.gamma, args.c, args.v, make, pause, row=args.row)
    make = lambda: Pacer(args.gamma, 1, PaceSettings(), args.guess_tokens)  # noqa: E731
    replayed["pacer, no guesses"] = replay_all(traces, args.gamma, args.c, args.v, make, pause, guesses=False)
    for name, by_category in replayed.items():
        cells = (f"{k} {r['speedup']:.3f} ({r['paused_share']:.2f})" for k, r in by_category.items())
        print(f"{name:>14}: " + "  ".join(cells))
    return replayed


def main() -> None:
    args = parse_args()
    dtype = torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    target, tokenizer, eos = default_target(dtype=dtype)
    draft = decoding_draft(Path(args.draft), target, eos)
    rows = read_prompts(args.prompts)
    if args.categories:
        wanted = set(args.categories.split(","))
        rows = [row for row in rows if row.category in wanted]
        if not rows:
            raise SystemExit(f"--categories {args.categories}: no held-out prompt has these categories")
    prompts = [encode_chat(tokenizer, row.turns[0]) for row in rows]
    categories = [row.category or "all" for row in rows]

    traces = defaultdict(list)
    for prompt, category in zip(prompts, categories, strict=True):
        answer = target_generate(target, [prompt], args.max_new_tokens, eos_ids=eos)[0][0]
        traces[category].append(agreement(target, draft, prompt, answer, args.guess_tokens))
    traces["all"] = [t for category in list(traces) for t in traces[category]]
    if args.save_traces:
        Path(args.save_traces).write_text(json.dumps(traces))
    alpha = {k: round(statistics.fmean(x for t in v for x in t["agrees"]), 3) for k, v in traces.items()}
    sure = {k: round(statistics.fmean(x for t in v for x in t["confidence"]), 3) for k, v in traces.items()}
    guessed = {k: round(statistics.fmean(x > 0 for t in v for x in t["gained"]), 3) for k, v in traces.items()}
    gain = {k: round(statistics.fmean(x for t in v for x in t["gained"]), 3) for k, v in traces.items()}
    print("greedy agreement per position:", alpha)
    print("the draft's mean probability of its token:", sure)
    print("lookup guess agreement per position:", guessed)
    print(f"lookup guess tokens kept per position (at most {args.guess_tokens}):", gain)
    by_repeat = by_repeat_length(traces["all"])
    print("by the length of the repeat the guess follows (first guess right, the draft right):", by_repeat)

    # a round without drafts costs what the decoder's paused rounds cost: a row-exact step, v
    pause = args.v if args.exact_pauses else 1.0
    replayed = replay_variants(traces, args, pause)
    result = {
        "draft": args.draft,
        "prompts": str(args.prompts),
        "gamma": args.gamma,
        "dtype": str(dtype).removeprefix("torch."),
        "cost_model": {"c": args.c, "v": args.v, "pause": pause, "row": args.row},
        "guess_tokens": args.guess_tokens,
        "agreement": alpha,
        "confidence": sure,
        "lookup_guess_agreement": guessed,
        "lookup_guess_tokens_kept": gain,
        "replayed": replayed,
    }
    result["lookup_by_repeat_length"] = by_repeat
    if args.row_costs:
        result["row_costs"] = row_costs(target, args.repeats)
        print("verification of q tokens, row-exact, per plain one-row step:", result["row_costs"])
    if args.time:
        result["timed"] = {"exact_pauses": args.exact_pauses, **timed(target, draft, prompts, categories, eos, args)}
        print("timed:", result["timed"])
    print(machine()["cpu"])
    save(args.name, result)


if __name__ == "__main__":
    main()
