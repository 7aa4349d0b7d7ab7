"""Options shared by the commands, each defined once with one default (argparse ``parents=``)."""

from __future__ import annotations

import argparse
import importlib.resources
import math
import re

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.vllm_server import KV_CACHE_VARIABLE, default_kv_cache_gib

# The held-out prompts shipped with draftsmith (never used for training).
EVAL_PROMPTS = str(importlib.resources.files("draftsmith.distill") / "data" / "eval_prompts.jsonl")
GAMMA = 4  # draft tokens per round when one gamma is measured
GAMMAS = "1,2,3,4,6,8"  # the gammas eval-run and quickstart choose the best from
MAX_NEW_TOKENS = 64


def prompt_options(limit: int | None = None) -> argparse.ArgumentParser:
    """--prompts, --limit, --max-new-tokens: what is decoded when measuring (a recipe may pass its own limit)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--prompts",
        default=EVAL_PROMPTS,
        help="prompts JSONL, held out from training (default: the shipped eval_prompts.jsonl)",
    )
    p.add_argument("--limit", type=int, default=limit, help=f"use only the first N prompts (default: {limit or 'all'})")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=MAX_NEW_TOKENS,
        help=f"tokens to generate per prompt (default: {MAX_NEW_TOKENS})",
    )
    return p


def device_options() -> argparse.ArgumentParser:
    """--device, --dtype: where and in what precision the models run."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when present)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 (default: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)",
    )
    return p


def gammas_option() -> argparse.ArgumentParser:
    """--gammas: the draft lengths to choose the best from."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--gammas", default=GAMMAS, help=f"gammas to choose the best from (default: {GAMMAS})")
    return p


def draft_vocab_option(default: int | None = 0) -> argparse.ArgumentParser:
    """--draft-vocab: frequency-ranked drafting with the N most frequent tokens of the run's training answers
    (off unless a recipe passes its own default; None: what the draft folder carries)."""
    carried = "the draft folder's own draft_vocab.json when it has one (publish writes it), else 0"
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=default,
        help="the draft's head scores only the N tokens most frequent in its run's training answers "
        "(draft_vocab.json in the run folder); exact, the target verifies over its full vocabulary. "
        f"0 = full head (default: {carried if default is None else default})",
    )
    return p


def pace_option() -> argparse.ArgumentParser:
    """--pace / --no-pace: pause drafting for a sequence while drafting does not pay for it."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--pace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop drafting for a sequence while drafting does not pay for it (its acceptance so far against "
        "the measured cost of the draft and the verification), drafting one round again now and then; the "
        "output is the target's either way (default: on; --no-pace drafts every round)",
    )
    return p


def progress_option() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_list(text: str, kind, name: str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``; a bad or empty list names its option."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise DraftsmithError(f"--{name} must be a comma-separated list, got {text!r}") from err
    if not values:
        raise DraftsmithError(f"--{name} is empty")
    return values


REPEATABLE = ("--trees", "--draft-option")  # options that add to a list each time they are given


def refuse_repeated(argv: list[str]) -> None:
    """An option given twice (``--gamma 2 --gamma 3``) is refused rather than the last one silently winning."""
    seen = set()
    for token in argv:
        if token == "--":
            break
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag in seen and flag not in REPEATABLE:
            raise DraftsmithError(f"{flag} is given twice; give it once")
        seen.add(flag)


# A value that starts with a dash but is not a plain number (``-1,2``, ``-1:4``): argparse reads it as an option.
DASHED_VALUE = re.compile(r"-\d[\d,.:]*")


def attach_dashed_values(argv: list[str]) -> list[str]:
    """``--tree -1,2`` as ``--tree=-1,2``: argparse would take ``-1,2`` for an option and say that
    ``--tree`` lacks its value; attached, the option's own check judges the value."""
    joined: list[str] = []
    for index, token in enumerate(argv):
        if token == "--":
            return joined + argv[index:]
        previous = joined[-1] if joined else ""
        if previous.startswith("--") and "=" not in previous and DASHED_VALUE.fullmatch(token):
            joined[-1] = f"{previous}={token}"
        else:
            joined.append(token)
    return joined


def check_sampling(temperature: float, top_p: float, what: str = "--temperature") -> None:
    """A temperature that is a finite number >= 0 (inf would be uniform noise reported as a speedup), and
    a top-p in (0, 1]."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise DraftsmithError(f"{what} must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise DraftsmithError(f"--top-p must be in (0, 1] (1 = off), got {top_p}")


def engine_options(what: str) -> argparse.ArgumentParser:
    """--engine, --engine-url, --engine-threads, --engine-eager: draftsmith's own decoder, or vLLM.

    what: what the engine does in this command (the help text's subject).
    """
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--engine",
        choices=("draftsmith", "vllm"),
        default="draftsmith",
        help=f"{what}: draftsmith (the bundled decoder) or vllm, a vLLM server started for this command from the "
        "environment `make vllm` installs (.venv-vllm, or $DRAFTSMITH_VLLM), or the one at --engine-url "
        "(default: draftsmith)",
    )
    p.add_argument(
        "--engine-url", default=None, help="--engine vllm: a running vLLM server to use (e.g. http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="--engine vllm on a CPU: threads of the server started (default: every core this process may use)",
    )
    p.add_argument(
        "--engine-eager",
        action="store_true",
        help="--engine vllm: start the server without torch.compile (starts in seconds, decodes somewhat slower)",
    )
    p.add_argument(
        "--engine-kv-cache-gib",
        type=int,
        default=None,
        help="--engine vllm on a CPU: the KV cache of each server started, in GiB, taken from memory at start "
        f"(default: ${KV_CACHE_VARIABLE}, else 2)",
    )
    return p


def check_engine_options(args: argparse.Namespace) -> None:
    """The vLLM-only options need --engine vllm; a URL names a server that is already running.
    Sets ``args.engine_kv_cache_gib`` to its default when not given."""
    if args.engine != "vllm":
        vllm_only = [("--engine-url", args.engine_url), ("--engine-threads", args.engine_threads)]
        vllm_only.append(("--engine-kv-cache-gib", args.engine_kv_cache_gib))
        for flag, value in vllm_only:
            if value is not None:
                raise DraftsmithError(f"{flag} applies to --engine vllm")
        if args.engine_eager:
            raise DraftsmithError("--engine-eager applies to --engine vllm")
    elif args.engine_url is not None and (args.engine_threads is not None or args.engine_eager):
        raise DraftsmithError("--engine-threads and --engine-eager start a server; --engine-url names a running one")
    if args.engine_kv_cache_gib is None:
        args.engine_kv_cache_gib = default_kv_cache_gib()
    if args.engine_kv_cache_gib < 1:
        raise DraftsmithError(f"--engine-kv-cache-gib must be >= 1, got {args.engine_kv_cache_gib}")
