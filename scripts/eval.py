"""``draftsmith eval``: measure a (target, draft) pair with the bundled speculative decoder."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import torch

from draftsmith.checks import check_eval_options
from draftsmith.distill.drafts import KINDS, DraftKind, kind_of_folder, kind_of_model, load_draft, named_draft
from draftsmith.draft_options import draft_option_args, parse_draft_options
from draftsmith.engine_eval import check_engine_eval_options, engine_eval_options, engine_report, show_engine_report
from draftsmith.eval_batch_sizes import (
    batch_size_options,
    check_batch_size_options,
    format_batch_sizes,
    measure_batch_sizes,
    measure_settings,
)
from draftsmith.options import GAMMA, device_options, draft_vocab_option, pace_option, progress_option, prompt_options
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.cache import CACHE_KINDS
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text
from draftsmith.specdec.loading import (
    DEFAULT_TARGET,
    check_compatible,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    same_model,
)
from draftsmith.specdec.matmul import use_column_products, uses_column_products
from draftsmith.specdec.measure import machine
from draftsmith.specdec.measure.hf_compare import HFComparison
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.report import PairReport
from draftsmith.specdec.measure.settings import measuring_dtype
from draftsmith.specdec.measure.tables import format_table
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import TreeShape
from draftsmith.train import batch_schedule
from draftsmith.train.profile import profile_target
from draftsmith.train.speedup import does_not_pay

DESCRIPTION = """Measure how much faster a draft makes a target: acceptance rate, mean accepted tokens (tau),
tokens/s of the target alone and of speculative decoding (interleaved, median over repeats), the
measured speedup next to the predicted one, and the cost ratios c (draft step / target step) and v
(verification pass / target step). Greedy runs also check that the output is identical to the target's."""

EPILOG = """prompts file: JSONL, one object per line with "prompt" (text), "messages" (chat) or "turns"
(list of user turns, as in public multi-turn benchmarks); optional "category" and "id".

example:
  draftsmith eval --target smollm2-135m-instruct --draft truncate:4 --prompts prompts.jsonl --json out.json"""


def decoding_options() -> argparse.ArgumentParser:
    """How the pair decodes: sampling, repeats, batch size, turns, dynamic gamma, pauses, lookup guesses,
    cache kind, product form and compilation."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="top-k filtering when sampling (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filtering when sampling (1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported (default: 3)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default: 1)")
    p.add_argument(
        "--all-turns",
        action="store_true",
        help="multi-turn prompts: run every turn (later turns see the target's earlier answers)",
    )
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        help="dynamic gamma: stop drafting after a token whose draft probability is below this",
    )
    p.add_argument("--draft-greedy", action="store_true", help="the draft proposes its argmax even when sampling")
    p.add_argument(
        "--exact-pauses",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --pace, a paused round of one sequence steps the target as a verification does (two rows in "
        "bfloat16), so that greedy output is the row-exact target's bit for bit (default: on); "
        "--no-exact-pauses makes it the target's plain one-row step, 1.5-5 %% faster on native-bfloat16 CPUs, "
        "but in bfloat16 a near-tie in an answer that mixes the two steps may then be decided either way",
    )
    p.add_argument(
        "--guesses",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --pace and --exact-pauses, a round also verifies lookup guesses, the tokens that followed the "
        "sequence's latest n-gram earlier in its prompt or answer (prompt lookup): where its last tokens repeat, "
        "their continuation instead of a draft; a paused round in the row a row-exact pause pads anyway and "
        "after it; a drafting round after the draft's chain; the pacer weighs what they gain against the draft "
        "(default: each round verifies as many as pay by the cost of a verification row the pacer measures in the "
        "run, many where a row costs little beside a step, none where it costs much; --guesses verifies every one "
        "found; exact either way)",
    )
    p.add_argument(
        "--guess-tokens",
        type=int,
        default=DecodeOptions.guess_tokens,
        help="with --guesses, the most lookup tokens a round verifies (default: %(default)s)",
    )
    p.add_argument(
        "--cache", choices=CACHE_KINDS, default=None, help="KV cache kind (default: slot on CPU, static on CUDA)"
    )
    p.add_argument(
        "--matmul",
        choices=("auto", "linear", "columns"),
        default="auto",
        help="how both decoders multiply a forward's few rows by float32 weights on a CPU: torch's linear, or "
        "as weight @ rows^T, which reads the weights about twice as fast on CPUs whose matrix-vector kernel is "
        "slow (default: auto, timed on the models' own weights when they load; the report names the choice)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run both decoders' decoding steps as compiled graphs over static caches (CUDA graphs on CUDA), "
        "compile time reported apart (default: on with CUDA; off on CPUs, where compiling the default pair "
        "took 3 minutes for 1.1x faster steps; "
        "token trees and early-exit drafts sharing the target's cache decode eager)",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith eval",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[
            prompt_options(),
            device_options(),
            draft_vocab_option(default=None),
            progress_option(),
            pace_option(),
            draft_option_args(),
            engine_eval_options(),
            batch_size_options(),
            decoding_options(),
        ],
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"model folder, .gguf file, hub id, or alias (default: {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--draft",
        required=True,
        help="draft model folder / .gguf / hub id, or an untrained draft a kind names: "
        + "; ".join(kind.spec_help for kind in KINDS.values() if kind.spec_help),
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft tokens per round (default: the draft folder's generation_config.json num_assistant_tokens "
        f"with the constant schedule, as publish writes it; else {GAMMA})",
    )
    p.add_argument(
        "--tree",
        default=None,
        metavar="SHAPE",
        help="draft a token tree each round instead of a chain, verified in one target forward: children per "
        "depth (3,2,1,1: the draft's 3 likeliest first tokens, 2 after each, ...; 21 nodes), or SHAPE:BUDGET for "
        "a dynamic tree keeping the BUDGET likeliest nodes (3,2,2,1:12). Batch 1 only. Default: the draft "
        "folder's generation_config.json draftsmith.tree (publish writes it when a tree measured fastest) "
        "unless --gamma is given; else a chain",
    )
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time transformers generate and assisted generation on the same prompts",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write the full report to this JSON file")
    return p


def _cut_head(args, draft, kind: DraftKind, eos: frozenset[int]):
    """The draft with its head cut to the ``--draft-vocab`` most frequent tokens of its run."""
    folder = Path(args.draft)
    if not folder.is_dir():
        raise DraftsmithError("--draft-vocab needs a trained draft folder from a distillation run (not self/truncate)")
    if not kind.cuts_head:
        raise DraftsmithError(
            f"--draft-vocab: a {kind.name} draft decodes with the head cut its folder carries (if any); leave it out"
        )
    if args.compare_hf:
        raise DraftsmithError("--compare-hf times transformers with the full draft; leave out --draft-vocab there")
    source = folder if (folder / draft_vocab.FILE).is_file() else folder.parent
    return draft_vocab.SubsetHeadDraft(draft, draft_vocab.load_ranking(source, args.draft_vocab), eos)


def _stock_pair(args, device: torch.device, dtype: torch.dtype) -> HFComparison:
    """Fresh copies of the target and the draft as transformers loads them, for ``--compare-hf``
    (the bundled decoder switches the models it runs to row-exact attention)."""
    target = load_model(args.target, device, dtype)
    named = None if args.draft == "self" else named_draft(args.draft, target)
    if named is not None:
        return HFComparison(target, named)
    return HFComparison(target, load_model(args.target if args.draft == "self" else args.draft, device, dtype))


def _published_settings(args) -> None:
    """Fill ``--gamma``, ``--draft-vocab`` and ``--tree`` left out from what a published draft folder
    carries: the gamma of its generation config (constant schedule), its draft_vocab.json, and the
    tree shape of its ``draftsmith`` section (used when no chain setting or batch asks otherwise)."""
    folder = Path(args.draft)
    kind = kind_of_folder(folder) if folder.is_dir() else None
    carried = kind.read_serving(folder) if kind is not None else None  # what the kind's export wrote
    args.gamma_source = "--gamma" if args.gamma is not None else "generation_config.json" if carried else "default"
    if args.gamma is None:
        args.gamma = carried.gamma if carried else GAMMA
        if carried and args.batch_sizes is None:
            published_batch_gamma(args, folder)
    if args.draft_vocab is None:
        # A kind whose vocabulary is its own (cut at load, not by the generic head) carries it itself.
        cut = (folder / draft_vocab.FILE).is_file() and not args.compare_hf and kind is not None and kind.cuts_head
        args.draft_vocab = len(draft_vocab.load_ranking(folder)) if cut else 0
    # The tree shape publish found fastest with draftsmith's decoder (transformers takes the chain gamma).
    carried_tree = carried.tree if carried else None
    args.tree_source = "--tree" if args.tree is not None else None
    chain_asked = args.gamma_source == "--gamma" or args.confidence_threshold is not None or args.batch_size != 1
    chain_asked = chain_asked or args.batch_sizes is not None
    if args.tree is None and carried_tree and not chain_asked:
        args.tree, args.tree_source = carried_tree, "generation_config.json"


def published_batch_gamma(args: argparse.Namespace, folder: Path) -> None:
    """The gamma a published ``folder`` carries for ``--batch-size`` (its generation config's
    ``draftsmith`` schedule, ``batch_schedule.read_schedule``) into ``args.gamma``, said in one line.
    Batch 1 keeps ``num_assistant_tokens`` (the schedule's batch-1 gamma, or 0); a size the schedule
    gives 0, where drafting measured slower than the target alone, is measured at that gamma too,
    since measuring the draft is what eval was asked for."""
    ranges = batch_schedule.read_schedule(folder)
    where = f"generation_config.json draftsmith.{batch_schedule.SCHEDULE_KEY}"
    size = args.batch_size
    served = batch_schedule.gamma_for_batch(ranges, size) if ranges else None
    if served == 0:
        print(
            f"gamma {args.gamma}: {folder}'s schedule ({where}) turns drafting off at batch size {size}, where it "
            "measured slower than the target alone; measuring at its batch-1 gamma (num_assistant_tokens) anyway "
            "(--gamma chooses another)"
        )
        return
    if served is not None and size != 1:
        args.gamma, args.gamma_source = served, where
    print(f"gamma {args.gamma}: {folder}'s published gamma for batch size {size} ({args.gamma_source})")


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    """The decoding settings the arguments ask for, checked together."""
    options = DecodeOptions(
        gamma=args.gamma,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        draft_greedy=args.draft_greedy,
        confidence_threshold=args.confidence_threshold,
        cache_kind=args.cache,
        draft_options=parse_draft_options(args.draft_option),
        tree=TreeShape.parse(args.tree) if args.tree is not None else None,
        pace=args.pace and args.tree is None,
        exact_pauses=args.exact_pauses,
        guesses=args.guesses,
        guess_tokens=args.guess_tokens,
        compile=args.compile,
    )
    if options.tree is not None and args.batch_size != 1:
        raise DraftsmithError("--tree decodes one prompt at a time; leave out --batch-size")
    if options.tree is not None and args.confidence_threshold is not None:
        raise DraftsmithError("--confidence-threshold cuts chains; a --tree's size is set by its shape or budget")
    if args.max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise DraftsmithError(f"--limit must be >= 1 (prompts to use; leave it out for all), got {args.limit}")
    if args.batch_size < 1:
        raise DraftsmithError(f"--batch-size must be >= 1, got {args.batch_size}")
    return options


def eval_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    dtype = measuring_dtype(args.dtype, resolve_dtype(args.dtype, device), args.batch_size)
    if dtype != resolve_dtype(args.dtype, device):
        print("batch > 1: measuring in float32, where batched greedy output stays the target's (see --dtype)")
    return dtype


def load_pair(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(tokenizer, target, draft, the draft's kind), checked against what the arguments ask of them."""
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, device, dtype)
    draft = named_draft(args.draft, target)
    if draft is None:  # a folder, file or hub model: its tokenizer must be the target's
        draft = load_draft(args.draft, target, device, dtype)
        if kind_of_model(draft).standalone:
            check_compatible(tokenizer, load_tokenizer(args.draft), target.config.vocab_size, draft.config.vocab_size)
    kind = kind_of_model(draft)
    if args.compare_hf and not kind.standalone:
        raise DraftsmithError(f"--compare-hf needs a standalone draft; {args.draft} is a {kind.name} draft")
    return tokenizer, target, draft, kind


def measured_pair(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple:
    """(tokenizer, target, draft) in ``dtype`` as eval measures them: the draft's head cut to
    ``--draft-vocab`` and the few-row products as ``--matmul`` says."""
    tokenizer, target, draft, kind = load_pair(args, device, dtype)
    if args.draft_vocab:
        draft = _cut_head(args, draft, kind, eos_token_ids(target, tokenizer))
    if args.matmul != "auto":
        for model in (target, draft):
            use_column_products(model, args.matmul == "columns")
    return tokenizer, target, draft


def warn_other_target(draft: str, target: str) -> None:
    """A published draft measured against another target than ``target``: say so, naming both (its
    figures and gamma were measured there, and its acceptance here may be anything)."""
    made_for = profile_target(Path(draft)) if Path(draft).is_dir() else None
    if made_for is not None and not same_model(made_for, target):
        print(
            f"warning: {draft} was distilled and measured for the target {made_for}, not {target}: its published "
            "figures and gamma do not carry over",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_eval_options(args)  # before anything loads: contradictions, options that do not apply, --json
    not_in_engine = {
        "--compare-hf": args.compare_hf,
        "--all-turns": args.all_turns,
        "--batch-size": args.batch_size != 1,
    }
    not_in_engine.update({"--confidence-threshold": args.confidence_threshold, "--draft-vocab": args.draft_vocab})
    batch_plan = check_batch_size_options(args)  # before --engine sets its batch sizes
    engine_batch_sizes = check_engine_eval_options(args, not_in_engine)
    warn_other_target(args.draft, args.target)
    _published_settings(args)
    options = decode_options(args)
    prompts = read_prompts(args.prompts, all_turns=args.all_turns)[: args.limit]
    device = resolve_device(args.device)
    if batch_plan is not None:
        report = measure_batch_sizes(args, options, prompts, device, partial(measured_pair, args, device), batch_plan)
        print(format_batch_sizes(report))
        if args.json_out:
            write_text(Path(args.json_out), json.dumps({**report, "machine": machine.machine()}, indent=2))
            print(f"report written to {args.json_out}")
        return 0
    dtype = eval_dtype(args, device)
    tokenizer, target, draft, kind = load_pair(args, device, dtype)
    kind.check_decode_options(options.draft_options)
    settings = measure_settings(args, prompts, options, eos_token_ids(target, tokenizer), args.batch_size)
    if engine_batch_sizes:  # --engine vllm: the pair in vLLM beside the bundled decoder
        report = engine_report(
            args,
            target,
            draft,
            tokenizer,
            settings,
            target_spec=args.target,
            draft_spec=args.draft,
            batch_sizes=engine_batch_sizes,
        )
        return show_engine_report(report, args.json_out)
    # transformers is timed on models as transformers loads them, apart from the ones our decoder runs.
    compare_hf = _stock_pair(args, device, dtype) if args.compare_hf else None
    if args.draft_vocab:
        draft = _cut_head(args, draft, kind, settings.eos_ids)
    if args.matmul != "auto":
        for model in (target, draft):
            use_column_products(model, args.matmul == "columns")
    report = evaluate_pair(target, draft, tokenizer, settings, compare_hf=compare_hf)
    report = dataclasses.replace(report, kind_figures=kind.decoding_report(target, draft, options))
    matmul = "columns" if uses_column_products(target) else "linear"
    return finish(args, report, device, dtype, kind, matmul)


def finish(
    args: argparse.Namespace,
    report: PairReport,
    device: torch.device,
    dtype: torch.dtype,
    kind: DraftKind,
    matmul: str,
) -> int:
    """Print the report (and what the kind added), write it as JSON when asked; the exit status.

    matmul: the form the decoders' few-row products took (``specdec.matmul``), printed and recorded.
    """
    report = dataclasses.replace(
        report,
        source={
            "target": args.target,
            "draft": args.draft,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "draft_vocab": args.draft_vocab,
            "matmul": matmul,
            "gamma_source": args.gamma_source,
            "tree_source": args.tree_source,
            "prompts_file": str(args.prompts),
        },
    )
    print(format_table(report))
    print(f"{str(dtype).removeprefix('torch.')} on {device}, few-row products: {matmul} (--matmul)")
    for line in kind.report_lines(report):
        print(line)
    verdict = does_not_pay(f"the draft {args.draft}", report.speedup)
    if verdict is not None:
        print(f"note: {verdict}")
    if args.json_out:
        out = Path(args.json_out)
        write_text(out, json.dumps({**report.to_json(), "machine": machine.machine()}, indent=2))
        print(f"report written to {out}")
    return 0
