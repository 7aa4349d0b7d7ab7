"""``draftsmith data``: build a training set of the target's own answers, as a dataset on disk.

Prompts come from the target itself (``--prompts self``: it writes user messages, optionally steered
to topics), the built-in prompt set, a local json/jsonl/csv/parquet file or ``save_to_disk`` folder,
or a hub dataset. The target answers them with continuous batching, in draftsmith's own decoder or in
a vLLM server (--engine vllm), into the same dataset format. The folder is resumable: run the same
command again after an interruption and it continues; ask for more prompts or samples and it adds
rows; change a setting that decides what a row holds (the engine included) and it refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import datasets
import torch
from accelerate import PartialState
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import AutoConfig

from draftsmith.distill import teacher_cache
from draftsmith.distill.dataset_builder import (
    BuildSettings,
    ProcessGroup,
    SelfPromptRequest,
    build_dataset,
    check_settings,
    draftsmith_version,
    read_manifest,
    sampling_settings,
    training_examples,
)
from draftsmith.distill.dataset_cache import build_dataset_cache, cache_folder, engine_cache_writer, target_cache_writer
from draftsmith.distill.engines import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    BundledEngine,
    GenerationEngine,
    VllmEngine,
    Writer,
    install_connector,
    staging_bytes,
    stream_features,
)
from draftsmith.distill.prompt_filters import PromptFilter
from draftsmith.distill.prompt_sources import load_prompts, parse_column_map, source_settings
from draftsmith.distill.self_prompts import TOPICS, SelfPromptSettings
from draftsmith.distill.teacher_cache import Encoding, StoreFormat, unique_examples
from draftsmith.options import check_engine_options, check_sampling, engine_options
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import check_writable
from draftsmith.specdec.loading import (
    DEFAULT_TARGET,
    config_field,
    context_length,
    eos_token_ids,
    load_model,
    load_tokenizer,
    model_eos_token_ids,
    resolve_device,
    resolve_dtype,
    resolve_model,
    same_model,
    vocab_size,
)
from draftsmith.specdec.locks import folder_lock
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_client import served_model
from draftsmith.specdec.vllm_server import (
    ServeOptions,
    check_engine_importable,
    connect,
    find_engine,
    hidden_states_plan,
    serve,
)
from draftsmith.train.profile import weights_digest

EPILOG = f"""prompt sources (--prompts):
  self       the target writes user messages itself (--num-prompts of them; --topics to steer the mix)
  builtin    the packaged training prompts
  PATH       a .jsonl/.json/.csv/.parquet file or a save_to_disk folder, rows with messages,
             conversations, prompt, question, instruction (+ input) or text (--column-map to rename)
  HUB_ID     a hub dataset (--dataset-config, --split)

topics: {", ".join(TOPICS)}

examples:
  draftsmith data --prompts self --num-prompts 2000 --topics coding,math,chat --output data/smol-self
  draftsmith data --prompts builtin --samples-per-prompt 8 --temperature 0.7 --output data/smol-builtin
  draftsmith data --prompts questions.csv --column-map prompt=question --output data/q
  accelerate launch -m draftsmith.cli data --prompts self --num-prompts 100000 --output data/big
  draftsmith data --engine vllm --prompts self --num-prompts 20000 --samples-per-prompt 4 --output data/v
  draftsmith data --prompts self --num-prompts 3000 --topics coding,math,chat,translation --output data/smol-self

An existing --output folder is continued with the settings it was built with: an interrupted build
finishes, a larger --num-prompts adds prompts, and self-written prompts may add topics (the last
example grows the first one by 1000 prompts: 750 for the new topic and 250 more for the old ones;
the rows it has are kept).

The folder is a standard dataset: data/train-*.parquet and a dataset card README.md (datasets.load_dataset(FOLDER,
split="train") reads it), beside manifest.json; `distill` trains from it by path once the build is complete."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith data",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[engine_options("what writes the prompts and answers")],
    )
    p.add_argument("--output", required=True, help="dataset folder (created, or continued when it exists)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default: {DEFAULT_TARGET})")
    p.add_argument("--prompts", default="self", help="self, builtin, a file or folder, or a hub id (default: self)")
    p.add_argument("--num-prompts", type=int, default=None, help="--prompts self: how many prompts to write")
    p.add_argument("--topics", default="", help="--prompts self: comma-separated topics (default: no steering)")
    p.add_argument("--max-samples", type=int, default=None, help="use only the first N rows of a prompt source")
    p.add_argument("--column-map", default=None, help="FIELD=COLUMN pairs, e.g. prompt=question,input=context")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip rows with no prompt (count printed)")
    p.add_argument("--dataset-config", default=None, help="config name of a hub dataset")
    p.add_argument("--split", default="train", help="split of a hub dataset or saved folder (default: train)")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (needs --temperature > 0)")
    p.add_argument("--temperature", type=float, default=0.7, help="answer temperature; 0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=1.0, help="answer nucleus sampling (default: 1.0, off)")
    p.add_argument("--top-k", type=int, default=0, help="answer top-k sampling (default: 0, off)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit (default: 256)")
    p.add_argument(
        "--prompt-temperature",
        type=float,
        default=1.0,
        help="--prompts self: temperature of the writing (default: 1.0)",
    )
    p.add_argument(
        "--prompt-top-p", type=float, default=0.95, help="--prompts self: top-p of the writing (default: 0.95)"
    )
    p.add_argument(
        "--prompt-max-tokens",
        type=int,
        default=128,
        help="--prompts self: a prompt still unfinished after this many tokens is dropped (default: 128)",
    )
    p.add_argument(
        "--any-prompt-text",
        action="store_true",
        help="--prompts self: keep prompts that read as neither a question nor an instruction",
    )
    p.add_argument("--seed", type=int, default=0, help="fixes every sampled prompt and answer (default: 0)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="rows decoded together; with --engine vllm, requests in flight (default: 64)",
    )
    p.add_argument(
        "--shard-rows",
        type=int,
        default=256,
        help="rows per saved shard, of the rows and of a feature store (default: 256)",
    )
    add_store_options(p)
    p.add_argument("--store-dtype", default="bfloat16", help="--hidden-layers: storage dtype (default: bfloat16)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="--engine vllm: GPUs per model copy (default: 1)"
    )
    p.add_argument(
        "--data-parallel-size", type=int, default=None, help="--engine vllm: model copies serving (default: 1)"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when present)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 (default: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def add_store_options(p: argparse.ArgumentParser) -> None:
    """--teacher-cache and the options of what it stores."""
    p.add_argument(
        "--teacher-cache",
        type=int,
        default=None,
        metavar="K",
        help="also store the target's K most likely tokens and their log-probs at every answer position "
        "(teacher-cache-kK/ in the folder), so `distill data.dataset=FOLDER teacher.cache=true teacher.top_k=K` (or "
        "less) reads them instead of running the target. Computed after the answers by the same engine: "
        "draftsmith's copy of the target, or vLLM's prompt log-probs (a server at --engine-url must allow K: "
        "its --max-logprobs). distill reads it while the folder's manifest.json is the one it was computed for, "
        "when it was computed in float32 or the run's teacher dtype; teacher-cache-kK/cache.json says how it was "
        "made. Rows added later are cached when the step runs again with the option (default: none)",
    )
    p.add_argument(
        "--teacher-encoding",
        default="float16",
        choices=("float16", "uint8"),
        help="--teacher-cache: keep the log-probs as float16, or as uint8 steps of 1/16 nat (half the bytes; "
        "teacher-cache-kK-uint8/); token ids are uint16 where the vocabulary fits (default: float16)",
    )
    p.add_argument(
        "--cache-only",
        action="store_true",
        help="--teacher-cache on a complete dataset folder as it is: no answers are written and its build's "
        "options need not be given; the target is the one that wrote it, run by draftsmith (--dtype, --device)",
    )
    p.add_argument(
        "--hidden-layers",
        default=None,
        metavar="I,J,...",
        help="with --teacher-cache K: also write a feature store (feature-store/ in the folder) holding the target's "
        "hidden states entering these layers at every position, for kinds that read them (EAGLE-3's aux layers; "
        "the layer count itself: its output), so `distill data.dataset=FOLDER teacher.cache=true` runs no target. "
        "--engine vllm computes them with vLLM's extract_hidden_states method, in a server it starts once the "
        "answers' server has stopped (not the one at --engine-url), layers 0 to n-1 (default: none)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="rows cut as distill cuts them (its data.max_length): for --teacher-cache (a run with a larger "
        f"max_length computes its own; default: whole rows) and --hidden-layers (default: {STORE_LENGTH})",
    )


def prompt_plan(args: argparse.Namespace) -> tuple[list | SelfPromptRequest, dict]:
    """What to answer (prompts, or a request for self-written ones) and its manifest description."""
    if args.prompts == "self":
        if args.num_prompts is None or args.num_prompts < 1:
            raise DraftsmithError("--prompts self needs --num-prompts N (N >= 1): how many prompts to write")
        for flag, value in (("--max-samples", args.max_samples), ("--column-map", args.column_map)):
            if value is not None:
                raise DraftsmithError(f"{flag} applies to a dataset prompt source, not to --prompts self")
        topics = tuple(t.strip() for t in args.topics.split(",") if t.strip())
        settings = SelfPromptSettings(topics, args.prompt_temperature, args.prompt_top_p, args.prompt_max_tokens)
        request = SelfPromptRequest(args.num_prompts, settings, PromptFilter(require_request=not args.any_prompt_text))
        return request, request.source_settings()
    if args.num_prompts is not None:
        raise DraftsmithError("--num-prompts counts self-written prompts; cap a prompt source with --max-samples")
    if args.topics:
        raise DraftsmithError("--topics steers self-written prompts (--prompts self); a prompt source has its own")
    column_map = parse_column_map(args.column_map)
    prompts = load_prompts(
        args.prompts, args.dataset_config, args.split, column_map, args.max_samples, args.skip_bad_rows
    )
    return prompts, source_settings(args.prompts, args.dataset_config, args.split, column_map)


@contextmanager
def generation_engine(
    args: argparse.Namespace, device, dtype, tokenizer
) -> Iterator[tuple[GenerationEngine, frozenset[int]]]:
    """The engine that generates, for the ``with`` block, and the target's EOS ids.

    --engine vllm starts a server of the target (the same dtype; prefix caching on, so a prompt's
    samples share its prefill) and stops it afterwards, or uses the running one at --engine-url.
    """
    if args.engine == "draftsmith":
        model = load_model(args.target, device, dtype)
        yield BundledEngine(model, args.batch_size), eos_token_ids(model, tokenizer)
        return
    eos = model_eos_token_ids(args.target, tokenizer)
    if args.engine_url is not None:
        server = connect(args.engine_url)
        yield VllmEngine(server, served_model(server)["max_model_len"], args.batch_size), eos
        return
    with serve(args.target, serve_options(args, device, dtype)) as server:
        yield VllmEngine(server, served_model(server)["max_model_len"], args.batch_size), eos


def serve_options(args: argparse.Namespace, device, dtype) -> ServeOptions:
    """How --engine vllm starts its server of the target."""
    return ServeOptions(
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        threads=args.engine_threads,
        kv_cache_gib=args.engine_kv_cache_gib,
        eager=args.engine_eager,
        prefix_caching=True,
        max_logprobs=args.teacher_cache,  # None: vLLM's default
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )


def cache_format(args: argparse.Namespace, target: str) -> StoreFormat:
    """The top-k cache --teacher-cache K asks for: uint16 ids where the target's vocabulary fits them."""
    vocab = vocab_size(target) or target_size(target, "vocab_size")
    return StoreFormat(args.teacher_cache, encoding=Encoding.for_vocab(vocab, args.teacher_encoding))


def cache_writer(args: argparse.Namespace, engine: GenerationEngine) -> Callable[[list[dict], Path], None]:
    """How --teacher-cache computes a shard's cache: with the engine that wrote the answers."""
    if args.engine == "vllm":
        return engine_cache_writer(engine.server, cache_format(args, args.target), args.batch_size)
    return target_cache_writer(engine.model, cache_format(args, args.target))


def cache_description(args: argparse.Namespace, dtype: str, computed_by: str, model=None) -> dict:
    """What a dataset's cache.json says of how its top-k was computed (the target's weights digest where
    draftsmith holds the target) and the command that computes it again."""
    return {
        "target": args.target,
        "target_weights_sha256": None if model is None else weights_digest(model),
        "dtype": dtype,
        "computed_by": computed_by,
        "draftsmith_version": draftsmith_version(),
        "command": shlex.join(["draftsmith", "data", *args.argv]),
    }


def engine_dtype(args: argparse.Namespace, dtype) -> str:
    """The dtype a dataset records: the one the target runs in, or for a user's server what --dtype says
    it runs (else "server's own": draftsmith cannot ask it)."""
    if args.engine == "vllm" and args.engine_url is not None:
        return args.dtype or "server's own"
    return str(dtype).removeprefix("torch.")


def check_options(args: argparse.Namespace) -> None:
    """Options that are out of range, do not apply, or contradict each other, and an --output that
    cannot be written: refused before the target loads."""
    for flag, value in (("--batch-size", args.batch_size), ("--shard-rows", args.shard_rows)):
        if value < 1:
            raise DraftsmithError(f"{flag} must be >= 1, got {value}")
    if args.max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    context = context_length(args.target)
    if context is not None and args.max_new_tokens >= context:
        raise DraftsmithError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's context "
            f"({context} tokens); give fewer"
        )
    if args.max_length is not None and args.max_length < 1:
        raise DraftsmithError(f"--max-length must be >= 1 (tokens a stored row is cut to), got {args.max_length}")
    check_sampling(args.temperature, args.top_p)
    if args.samples_per_prompt < 1:
        raise DraftsmithError(f"--samples-per-prompt must be >= 1, got {args.samples_per_prompt}")
    if args.temperature == 0:
        for flag, given in (
            ("--top-p", args.top_p != 1.0),
            ("--top-k", args.top_k != 0),
            ("--samples-per-prompt", args.samples_per_prompt > 1),
        ):
            if given:
                raise DraftsmithError(f"{flag} applies to sampled answers; with --temperature 0 they are greedy")
    if args.prompts != "self":
        defaults = parser()
        for name in ("prompt_temperature", "prompt_top_p", "prompt_max_tokens", "any_prompt_text"):
            if vars(args)[name] != defaults.get_default(name):
                flag = "--" + name.replace("_", "-")
                raise DraftsmithError(f"{flag} applies to self-written prompts (--prompts self)")
    if args.teacher_cache is not None:
        vocab = vocab_size(args.target)
        if args.teacher_cache < 1 or (vocab is not None and args.teacher_cache > vocab):
            raise DraftsmithError(
                f"--teacher-cache must be 1 to the target's vocabulary ({vocab or 'its size'}), "
                f"got {args.teacher_cache}"
            )
    if args.hidden_layers is not None:
        if args.teacher_cache is None:
            raise DraftsmithError("--hidden-layers needs --teacher-cache K (the store holds both)")
        hidden_layers(args)
        if args.store_dtype not in teacher_cache.STORAGE_DTYPES:
            raise DraftsmithError(
                f"--store-dtype must be one of {', '.join(teacher_cache.STORAGE_DTYPES)}, got {args.store_dtype}"
            )
        if args.engine == "vllm" and args.engine_url is not None:
            raise DraftsmithError(
                "--hidden-layers with --engine vllm needs a server draftsmith starts (with the extract_hidden_states "
                "method and its connector), not the one at --engine-url; leave out --engine-url"
            )
        count = config_field(args.target, "num_hidden_layers")
        if count is not None:  # else checked once the target loads, still before any answer
            check_layer_range(args, count)
        if args.engine == "vllm":
            check_vllm_layers(args, target_size(args.target, "num_hidden_layers"))
    check_parallel_sizes(args)
    check_engine_options(args)
    check_writable(Path(args.output), f"--output {args.output}", folder=True)
    if args.engine == "vllm" and args.engine_url is None:
        check_engine_importable(find_engine())


def check_parallel_sizes(args: argparse.Namespace) -> None:
    """--tensor-parallel-size and --data-parallel-size shape the vLLM server draftsmith starts: refused
    without one, or below 1 (a server asked for 0 GPUs waits for them forever); 1 when not given."""
    sizes = {"--tensor-parallel-size": args.tensor_parallel_size, "--data-parallel-size": args.data_parallel_size}
    for flag, value in sizes.items():
        if value is None:
            continue
        if args.engine != "vllm":
            raise DraftsmithError(f"{flag} applies to --engine vllm (the server it starts); leave it out")
        if args.engine_url is not None:
            raise DraftsmithError(f"{flag} shapes a server draftsmith starts; --engine-url names a running one")
        if value < 1:
            raise DraftsmithError(f"{flag} must be >= 1 (GPUs or model copies), got {value}")
    args.tensor_parallel_size = args.tensor_parallel_size or 1
    args.data_parallel_size = args.data_parallel_size or 1


def check_layer_range(args: argparse.Namespace, count: int) -> None:
    """--hidden-layers within a target of ``count`` layers: 0 (the embeddings) to ``count`` (its normed output)."""
    outside = [layer for layer in hidden_layers(args) if not 0 <= layer <= count]
    if outside:
        raise DraftsmithError(
            f"--hidden-layers {','.join(map(str, outside))}: this target has {count} layers; give layers 0 "
            f"(the embeddings) to {count} (its normed output)"
        )


def check_store_room(args: argparse.Namespace, prompts: list | SelfPromptRequest, output: Path) -> None:
    """Before any answer: the feature store of every row asked for, each at its longest (--max-length
    positions), fits the disk that holds --output, besides a store already there (a build that resumes).
    A store found not to fit only once the answers are written would have cost their hours."""
    count = prompts.count if isinstance(prompts, SelfPromptRequest) else len(prompts)
    rows = count * args.samples_per_prompt
    hidden_size = target_size(args.target, "hidden_size")
    item = torch.empty((), dtype=teacher_cache.STORAGE_DTYPES[args.store_dtype]).element_size()
    length = store_length(args)
    states = rows * length * len(hidden_layers(args)) * hidden_size * item
    needed = states + 6 * args.teacher_cache * rows * min(args.max_new_tokens, length)
    stores = output / "feature-store"
    held = sum(path.stat().st_size for path in stores.rglob("*") if path.is_file()) if stores.is_dir() else 0
    free = teacher_cache.disk_free(output)
    if needed > free + held:
        raise DraftsmithError(
            f"--hidden-layers: the feature store of {rows} rows may take up to {teacher_cache.size_text(needed)} "
            f"({length} positions a row) but the disk holding {output} has {teacher_cache.size_text(free)} "
            "free; free disk space, or store less (--max-length, fewer --hidden-layers or prompts, --store-dtype)"
        )


@contextmanager
def disk_full_refused(output: Path) -> Iterator[None]:
    """A disk that fills up during the build, said in one line: every shard written so far is whole (each is
    renamed into place once complete), so the same command continues once there is room."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        if not (isinstance(err, OSError) and err.errno == errno.ENOSPC) and "(os error 28)" not in str(err):
            raise
        raise DraftsmithError(
            f"the disk holding {output} is full; free space and run the same command again: it keeps what is "
            "written and continues"
        ) from err


STORE_LENGTH = 256  # tokens a feature store's row is cut to without --max-length: distill's default


def store_length(args: argparse.Namespace) -> int:
    """--max-length for the feature store (--hidden-layers)."""
    return args.max_length or STORE_LENGTH


def hidden_layers(args: argparse.Namespace) -> list[int]:
    """--hidden-layers as layer indices (0: the embeddings; the layer count: the normed output)."""
    try:
        return sorted({int(part) for part in args.hidden_layers.split(",")})
    except ValueError as err:
        raise DraftsmithError(f"--hidden-layers takes layer numbers like 2,15,27, got {args.hidden_layers!r}") from err


def target_size(target: str, name: str) -> int:
    """A size of the target's config (``num_hidden_layers``, ``hidden_size``): read from its config.json
    without loading it where it says (``loading.config_field``), else as transformers reads its config (a
    GGUF file converted once)."""
    size = config_field(target, name)
    if size is None:
        size = AutoConfig.from_pretrained(resolve_model(target)).get_text_config().to_dict()[name]
    return size


def check_vllm_layers(args: argparse.Namespace, count: int) -> None:
    """Refuse --hidden-layers that vLLM's extract_hidden_states does not give as draftsmith stores them for
    a target of ``count`` layers: it gives the residual entering layers 0 to n - 1, and after the last layer
    the residual before the final norm, where draftsmith's layer n is the normed output."""
    outside = [layer for layer in hidden_layers(args) if not 0 <= layer < count]
    if outside:
        raise DraftsmithError(
            f"--hidden-layers {','.join(map(str, outside))} with --engine vllm: vLLM gives the states entering "
            f"layers 0 to {count - 1} of this target; its normed output (layer {count}) only --engine draftsmith stores"
        )


def store_plan(args: argparse.Namespace, dtype: str, output: Path) -> tuple[list[dict], Path, dict]:
    """The folder's rows cut at --max-length, where their feature store goes
    (``teacher_cache.dataset_store``), and what its ``meta.json`` says of how it was made."""
    examples = training_examples(output, store_length(args))
    if not examples:
        raise DraftsmithError(
            f"--max-length {store_length(args)} cuts every row of {output} before its answer: nothing to store; "
            "give a larger --max-length"
        )
    layers = hidden_layers(args)
    made_by = {"target": args.target, "target_key": teacher_cache.DATASET_TARGET, "dtype": dtype}
    made_by |= {"top_k": args.teacher_cache, "content": teacher_cache.content_digest(unique_examples(examples)[0])}
    return examples, teacher_cache.dataset_store(output, made_by["content"], args.teacher_cache, layers), made_by


def feature_store(args: argparse.Namespace, model, dtype: str, output: Path, group: ProcessGroup) -> Path:
    """The folder's feature store (``teacher_cache``'s format): the top-K and the hidden states of
    --hidden-layers for its rows cut at --max-length, by draftsmith's copy of the target (each process
    its own shards)."""
    examples, folder, _ = store_plan(args, dtype, output)
    if (folder / "meta.json").is_file():
        return folder
    fmt = StoreFormat(
        args.teacher_cache,
        tuple(hidden_layers(args)),
        teacher_cache.STORAGE_DTYPES[args.store_dtype],
        shard_rows=args.shard_rows,
    )
    progress = group.is_main and not args.no_progress
    target_key = teacher_cache.DATASET_TARGET
    return teacher_cache.build(model, examples, folder, fmt, group, args.batch_size, progress, target_key)


def vllm_feature_store(args: argparse.Namespace, options: ServeOptions, dtype: torch.dtype, output: Path) -> Path:
    """The folder's feature store by a vLLM server of the target started for it (the only one running:
    the answers' server has stopped), with the extract_hidden_states method and draftsmith's connector
    (``vllm_server.hidden_states_plan``), written shard by shard as requests finish
    (``teacher_cache.write_streamed``). The connector's files live in a hidden ``.vllm-states.tmp``
    folder beside the store, at most one per request in flight, and go when the build ends, whether it
    succeeds or fails; a build killed midway keeps its shards and the next run computes only the rest."""
    examples, folder, made_by = store_plan(args, str(dtype).removeprefix("torch."), output)
    if (folder / "meta.json").is_file():
        return folder
    layers, store_dtype = hidden_layers(args), teacher_cache.STORAGE_DTYPES[args.store_dtype]
    staging = folder.parent / f".{folder.name}.vllm-states.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # a killed build's files: their rows are asked for again
    stored, next_shard = teacher_cache.stored_rows(folder)
    digests, unique = unique_examples(examples)
    todo = [(digest, example) for digest, example in zip(digests, unique, strict=True) if digest not in stored]
    hidden_size = target_size(args.target, "hidden_size")
    needed = teacher_cache.store_bytes([e for _, e in todo], args.teacher_cache, layers, hidden_size, store_dtype)
    needed += staging_bytes([e for _, e in todo], layers, hidden_size, dtype, args.batch_size)
    teacher_cache.check_space(folder, needed)
    made_by |= {"layers": layers, "hidden_dtype": args.store_dtype, "hidden_size": hidden_size}
    if todo:
        try:
            python = install_connector(staging / "python")
            speculative, kv_transfer = hidden_states_plan(
                layers, staging / "states", (CONNECTOR_CLASS, CONNECTOR_MODULE)
            )
            options = dataclasses.replace(
                options, kv_transfer=kv_transfer, prefix_caching=False, python_path=(str(python),)
            )
            requests = ([e for _, e in todo], staging / "states", args.teacher_cache, layers, args.batch_size)
            with (
                serve(args.target, options, speculative=speculative, gamma=1) as server,
                closing(stream_features(server, *requests)) as found,  # an error ends the requests in flight
            ):
                rows = ((todo[i][0], entry, hidden) for i, entry, hidden in found)
                rows = tqdm(rows, total=len(todo), desc="feature store", unit="row", disable=args.no_progress)
                teacher_cache.write_streamed(folder, rows, layers, store_dtype, next_shard, args.shard_rows)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return teacher_cache.finish_streamed(folder, examples, args.teacher_cache, made_by)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv)  # the command, recorded beside a teacher cache
    datasets.disable_progress_bars()  # one bar, in tokens/s, is shown instead of one per saved shard
    if args.cache_only:
        return cache_only(args)
    check_options(args)
    device = resolve_device(args.device)
    state = PartialState(cpu=device.type == "cpu")  # several CPU processes talk over gloo
    group = ProcessGroup(state.process_index, state.num_processes, state.wait_for_everyone)
    if args.engine == "vllm" and state.num_processes > 1:
        raise DraftsmithError(
            "--engine vllm runs as one process: vLLM spreads the work over GPUs itself "
            "(start a server with --data-parallel-size or --tensor-parallel-size and pass --engine-url)"
        )
    if state.num_processes > 1 and device.type == "cuda":
        device = state.device  # this process's own GPU
    dtype = resolve_dtype(args.dtype, device)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts, source = prompt_plan(args)
    settings = BuildSettings(
        target=args.target,
        dtype=engine_dtype(args, dtype),
        sampling=sampling_settings(sampling),
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        prompt_source=source,
        engine=args.engine,
    )
    output = Path(args.output)
    check_settings(output, settings)  # before the model loads: a refused build fails at once
    if args.hidden_layers is not None:
        check_store_room(args, prompts, output)
    tokenizer = load_tokenizer(args.target)
    with folder_lock(output, "draftsmith data"), disk_full_refused(output):  # one build at a time per folder
        manifest, store = build(args, group, settings, prompts, tokenizer, (device, dtype))
    if group.is_main:
        report(args, output, manifest, store)
    return 0


def cache_only(args: argparse.Namespace) -> int:
    """--cache-only: the teacher cache of a complete dataset folder, computed by draftsmith's copy of the
    target that wrote it (the folder's rows are not touched; its build options need not be given)."""
    output = Path(args.output)
    manifest = check_cache_only(args, output)
    args.target = manifest["settings"]["target"]
    device = resolve_device(args.device)
    state = PartialState(cpu=device.type == "cpu")
    group = ProcessGroup(state.process_index, state.num_processes, state.wait_for_everyone)
    if state.num_processes > 1 and device.type == "cuda":
        device = state.device
    dtype = resolve_dtype(args.dtype, device)
    with folder_lock(output, "draftsmith data"), disk_full_refused(output):
        model = load_model(args.target, device, dtype)
        description = cache_description(args, teacher_cache.dtype_name(dtype), "draftsmith", model)
        fmt = cache_format(args, args.target)
        record = build_dataset_cache(output, fmt, target_cache_writer(model, fmt), description, group, args.max_length)
    if group.is_main:
        say_cache(output, record)
    return 0


def check_cache_only(args: argparse.Namespace, output: Path) -> dict:
    """--cache-only's options and folder: a complete dataset, --teacher-cache K, nothing that writes rows or a
    feature store; returns the folder's manifest."""
    manifest = read_manifest(output)
    if manifest is None:
        raise DraftsmithError(
            f"--cache-only computes the teacher cache of a dataset folder; {output} has no manifest.json"
        )
    if not manifest.get("complete", False):
        raise DraftsmithError(f"{output} is an incomplete build: finish it first (the same draftsmith data command)")
    if args.teacher_cache is None or args.teacher_cache < 1:
        raise DraftsmithError("--cache-only needs --teacher-cache K (K >= 1: tokens kept per position)")
    if args.hidden_layers is not None or args.engine != "draftsmith":
        raise DraftsmithError(
            "--cache-only computes the top-k cache with draftsmith's copy of the target; leave out "
            "--hidden-layers and --engine"
        )
    made_by = manifest["settings"]["target"]
    if args.target != DEFAULT_TARGET and not same_model(args.target, made_by):
        raise DraftsmithError(f"{output} holds answers of {made_by!r}; its cache is that target's (leave out --target)")
    if args.max_length is not None and args.max_length < 1:
        raise DraftsmithError(f"--max-length must be >= 1 (tokens a cached row is cut to), got {args.max_length}")
    return manifest


def say_cache(output: Path, record: dict) -> None:
    """One line: what the folder's teacher cache holds and where."""
    cut = "whole rows" if record["max_length"] is None else f"rows cut at {record['max_length']} tokens"
    encoding = Encoding(**record["encoding"])
    folder = cache_folder(output, StoreFormat(record["top_k"], encoding=encoding))
    print(
        f"teacher cache: top {record['top_k']} at {record['tokens']} answer positions, {record['dtype']}, "
        f"{encoding.name}, {cut} ({folder})"
    )


def build(
    args: argparse.Namespace,
    group: ProcessGroup,
    settings: BuildSettings,
    prompts: list | SelfPromptRequest,
    tokenizer,
    placement: tuple[torch.device, torch.dtype],
) -> tuple[dict, Path | None]:
    """The answers, then the teacher cache and the feature store asked for: (the manifest, the store)."""
    output, (device, dtype), store = Path(args.output), placement, None
    with generation_engine(args, device, dtype, tokenizer) as (engine, eos_ids):
        if args.hidden_layers is not None and args.engine == "draftsmith":  # a count config.json did not give
            check_layer_range(args, engine.model.config.get_text_config().num_hidden_layers)
        manifest = build_dataset(
            output,
            Writer(engine, tokenizer, eos_ids),
            settings,
            prompts,
            samples_per_prompt=args.samples_per_prompt,
            shard_rows=args.shard_rows,
            group=group,
            progress=not args.no_progress,
        )
        if args.teacher_cache is not None:
            model = engine.model if args.engine == "draftsmith" else None
            description = cache_description(args, settings.dtype, engine.name, model)
            fmt = cache_format(args, args.target)
            cached = build_dataset_cache(output, fmt, cache_writer(args, engine), description, group, args.max_length)
            manifest = {**manifest, "teacher_cache": cached}
        if args.hidden_layers is not None and args.engine == "draftsmith":
            store = feature_store(args, engine.model, settings.dtype, output, group)
    if args.hidden_layers is not None and args.engine == "vllm":  # its own server, once the answers' has stopped
        store = vllm_feature_store(args, serve_options(args, device, dtype), dtype, output)
    return manifest, store


def report(args: argparse.Namespace, output: Path, manifest: dict, store: Path | None) -> None:
    """What the folder holds now: rows, prompts, tokens, the teacher cache and the feature store."""
    counts = manifest["counts"]
    print(
        f"{output}: {counts['rows']} rows, {counts['prompts']} prompts, {counts['answer_tokens']} answer tokens "
        f"({manifest['seconds']:.0f} s of building in all)\n{json.dumps(counts['rows_by_topic'])}"
    )
    if args.teacher_cache is not None:
        say_cache(output, manifest["teacher_cache"])
    if args.hidden_layers is not None:
        print(f"feature store: {store} (layers {args.hidden_layers}, {args.store_dtype})")
