"""Checks the commands run on their inputs before any model loads: each refusal is one line, exit 2.

A mistake found after training or a measurement costs the user those minutes; everything that can
be checked from the options, the config and the files on disk is checked here first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.distill import dataset_builder
from draftsmith.distill.dataset_card import missing_manifest
from draftsmith.distill.tiny import CONTEXT as TINY_CONTEXT
from draftsmith.distill.tiny import char_tokenizer
from draftsmith.options import check_sampling, parse_list
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import check_writable
from draftsmith.specdec.loading import check_model_files, context_length, vocab_size
from draftsmith.specdec.locks import LOCK_FILE
from draftsmith.specdec.prompts import read_prompts
from draftsmith.specdec.tree import TreeShape
from draftsmith.train.config import RUN_CONFIG, DistillConfig


def check_run_inputs(cfg: DistillConfig) -> None:
    """``distill`` and ``quickstart``: the run folder can be written and holds nothing of the user's, and a
    ``draftsmith data`` folder trains only when it is complete and made by this target."""
    out = Path(cfg.output_dir)
    check_writable(out, f"output_dir={cfg.output_dir}", folder=True)
    if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()) and not (out / RUN_CONFIG).is_file():
        raise DraftsmithError(
            f"output_dir={cfg.output_dir} is not empty and holds no run (no {RUN_CONFIG}); give a new folder, "
            "or a run folder to resume"
        )
    folder = dataset_builder.built_folder(cfg.data.dataset)
    if cfg.data.allow_incomplete and (folder is None or folder.parent == dataset_builder.SHIPPED):
        raise DraftsmithError(
            "data.allow_incomplete=true applies to a draftsmith data folder still being built; "
            f"data.dataset={cfg.data.dataset} is not one (a shipped dataset is complete): "
            "leave data.allow_incomplete out"
        )
    if folder is not None:
        dataset_builder.check_trusted(folder, cfg.target, cfg.data.allow_incomplete)
    elif missing_manifest(Path(cfg.data.dataset)) is not None:  # a data folder copied without its manifest
        raise DraftsmithError(missing_manifest(Path(cfg.data.dataset)))
    vocab = run_vocab_size(cfg)
    if cfg.teacher.cache and vocab is not None and cfg.teacher.top_k > vocab:
        raise DraftsmithError(
            f"teacher.top_k={cfg.teacher.top_k} is more than the target's vocabulary ({vocab} tokens); "
            f"give teacher.top_k <= {vocab}"
        )


def run_vocab_size(cfg: DistillConfig) -> int | None:
    """The vocabulary of a run's target, known without loading it (None for a hub id)."""
    if cfg.target == "tiny":
        return cfg.tiny_target.get("vocab_size", len(char_tokenizer()))
    return vocab_size(cfg.target)


def run_context(cfg: DistillConfig) -> int | None:
    """The context of a run's target, known without loading it (None when unknown)."""
    if cfg.target == "tiny":
        return cfg.tiny_target.get("max_position_embeddings", TINY_CONTEXT)
    return context_length(cfg.target)


def check_draft_vocab(size: int | None, vocab: int | None, default: int | None = None) -> int | None:
    """--draft-vocab N: at least 0 (0 = the full head), and fewer tokens than the model has; returns the N
    to use. A command's own default that the model is too small for means the full head, said in a note."""
    if size is None:
        return None
    if size < 0:
        raise DraftsmithError(f"--draft-vocab must be >= 0 (0 = the full head), got {size}")
    if vocab is None or size < vocab:
        return size
    if size == default:
        print(
            f"note: the target has {vocab} tokens, fewer than --draft-vocab's default {size}: the full head",
            file=sys.stderr,
        )
        return 0
    raise DraftsmithError(
        f"--draft-vocab {size} is not smaller than the model's vocabulary ({vocab} tokens); give a smaller N, "
        "or 0 for the full head"
    )


def check_measure_options(
    args: argparse.Namespace, vocab: int | None, default_draft_vocab: int | None = None, context: int | None = None
) -> list[int]:
    """What ``eval-run`` and ``quickstart`` measure with: --gammas (each round within the target's
    ``context``, when known), --limit, --max-new-tokens, --prompts (read now) and --draft-vocab
    (``args.draft_vocab`` set to the size to use); returns the gammas."""
    gammas = parse_list(args.gammas, int, "gammas")
    if any(g < 1 for g in gammas):
        raise DraftsmithError(f"--gammas must all be >= 1, got {args.gammas}")
    check_gamma_fits(max(gammas), args.max_new_tokens, context, option="--gammas")
    if args.limit is not None and args.limit < 1:
        raise DraftsmithError(f"--limit must be >= 1 (prompts to use; leave it out for all), got {args.limit}")
    if args.max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    read_prompts(args.prompts)
    args.draft_vocab = check_draft_vocab(args.draft_vocab, vocab, default_draft_vocab)
    return gammas


def check_gamma_fits(gamma: int | None, max_new_tokens: int, context: int | None, option: str = "--gamma") -> None:
    """A gamma whose round, with the answer, fits in the target's context (a huge one would allocate
    caches and masks for minutes before failing)."""
    if gamma is not None and context is not None and gamma + max_new_tokens >= context:
        raise DraftsmithError(
            f"{option} {gamma} with --max-new-tokens {max_new_tokens} does not fit the target's context ({context} "
            f"tokens); give {option} below {max(context - max_new_tokens, 1)}"
        )


MAX_GUESS_TOKENS = 64  # a round verifies each guess as a row; far past any repeat an answer holds


def check_guess_tokens(tokens: int, max_new_tokens: int, context: int | None) -> None:
    """--guess-tokens: 1 to ``MAX_GUESS_TOKENS``, and a round with them fits the target's ``context`` when
    guesses may be on (each is a cache slot and a verification row, reserved for the whole run: a huge one
    allocates for minutes)."""
    if not 1 <= tokens <= MAX_GUESS_TOKENS:
        raise DraftsmithError(
            f"--guess-tokens must be 1 to {MAX_GUESS_TOKENS} (lookup tokens a round verifies), got {tokens}; "
            "no guesses: --no-guesses"
        )
    if context is not None and max_new_tokens + 1 < context:  # an answer past the context is refused on its own
        check_gamma_fits(tokens, max_new_tokens, context, option="--guess-tokens")


def check_eval_options(args: argparse.Namespace) -> None:
    """``draftsmith eval``: options that contradict each other or do not apply, and the --json path."""
    if args.gamma is not None and args.tree is not None:
        raise DraftsmithError("--gamma sets a chain's length and --tree drafts a tree instead; give one of them")
    if args.tree is not None:
        TreeShape.parse(args.tree)
    check_sampling(args.temperature, args.top_p)
    check_gamma_fits(args.gamma, args.max_new_tokens, context_length(args.target))
    check_guess_tokens(
        args.guess_tokens, args.max_new_tokens, context_length(args.target) if args.guesses is not False else None
    )
    if args.temperature == 0:
        for flag, given in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0)):
            if given:
                raise DraftsmithError(f"{flag} applies when sampling; with --temperature 0 decoding is greedy")
        if args.draft_greedy:
            raise DraftsmithError("--draft-greedy applies when sampling; with --temperature 0 the draft is greedy")
    if args.repeats < 1:
        raise DraftsmithError(f"--repeats must be >= 1, got {args.repeats}")
    if args.json_out is not None:
        check_writable(Path(args.json_out), f"--json {args.json_out}")
    for spec in (args.target, args.draft):
        if Path(spec).expanduser().is_dir():
            check_model_files(Path(spec).expanduser())
    check_draft_vocab(args.draft_vocab, vocab_size(args.target))
    read_prompts(args.prompts)
