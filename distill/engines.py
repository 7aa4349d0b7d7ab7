"""Where a dataset's tokens come from: the bundled continuous-batching decoder, or a vLLM server.

Both take prompts as token ids and yield ``(prompt index, answer ids)`` as each answer completes, in
completion order. An answer ends after its first stop id (kept, as the last token) or after
``max_new_tokens`` tokens. With sampling, prompt ``i`` draws from its own seed ``seeds[i]``, so an
answer does not depend on which other prompts were decoded beside it, in either engine (the two
engines' samplers differ, so a seed gives each engine its own answer; greedy answers agree in
float32).

The vLLM engine sends every prompt as its own ``/v1/completions`` request, up to ``concurrency`` of
them in flight: vLLM schedules them into its own continuously batched steps, so the machine runs at
the engine's speed while this process only waits on sockets.

The target's features (``stream_features``) come from a server running vLLM's ``extract_hidden_states``
method with draftsmith's KV connector (``vllm_connector.py``, installed beside the server's output
folder by ``install_connector``): every request's prompt hidden states at the asked layers land in a
safetensors file named by the prompt's token ids, read here as soon as the request is answered and
removed, so the files on disk and the states in memory are bounded by the requests in flight.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.continuous import Batching, Progress, stream_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_client import complete, engine_version
from draftsmith.specdec.vllm_server import Server

ENGINES = ("draftsmith", "vllm")


@dataclass
class BundledEngine:
    """draftsmith's own KV-cached decoder with continuous batching, ``batch_size`` rows at a time."""

    model: PreTrainedModel
    batch_size: int = 64
    name: ClassVar[str] = "draftsmith"

    @property
    def context(self) -> int:
        """The longest sequence (prompt + answer) the model takes."""
        return self.model.config.get_text_config(decoder=True).max_position_embeddings

    def describe(self) -> dict:
        """What a dataset manifest records of the engine."""
        return {"name": self.name, "batch_size": self.batch_size, "device": str(self.model.device)}

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        seeds: Sequence[int] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Iterator[tuple[int, list[int]]]:
        batching = Batching(sampling, eos_ids=stop_ids, batch_size=self.batch_size)
        return stream_generate(self.model, prompts, max_new_tokens, batching, seeds=seeds, on_progress=on_progress)


@dataclass
class VllmEngine:
    """A vLLM server answering over HTTP, ``concurrency`` requests in flight."""

    server: Server
    context: int  # the server's max_model_len
    concurrency: int = 64
    name: ClassVar[str] = "vllm"

    def describe(self) -> dict:
        """What a dataset manifest records of the engine: its version, and how the server was started."""
        return {
            "name": self.name,
            "version": engine_version(self.server),
            "url": self.server.url,
            "concurrency": self.concurrency,
            "server": self.server.settings,
        }

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        seeds: Sequence[int] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Iterator[tuple[int, list[int]]]:
        if seeds is not None and len(seeds) != len(prompts):
            raise DraftsmithError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        stops = sorted(stop_ids)

        def answer(index: int) -> list[int]:
            seed = None if seeds is None else int(seeds[index])
            return complete(
                self.server, list(prompts[index]), max_new_tokens, sampling, seed, stop_token_ids=stops
            ).token_ids

        tokens, done, total = 0, 0, len(prompts)
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        try:
            pending = {pool.submit(answer, index): index for index in range(total)}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    index = pending.pop(future)
                    ids = future.result()
                    tokens, done = tokens + len(ids), done + 1
                    if on_progress is not None:
                        on_progress(Progress(tokens, done, total, tokens + (total - done) * max_new_tokens))
                    yield index, ids
        finally:  # a consumer that stops early (or an error) leaves no request queued
            pool.shutdown(wait=True, cancel_futures=True)


GenerationEngine = BundledEngine | VllmEngine


@dataclass(frozen=True)
class Writer:
    """The target writing a dataset: the engine that generates, the tokenizer that encodes its prompts
    and decodes its answers, and the ids that end an answer."""

    engine: GenerationEngine
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]


CONNECTOR_FILE = Path(__file__).with_name("vllm_connector.py")  # runs inside the vLLM server, not here
CONNECTOR_MODULE = "draftsmith_vllm_connector"  # the name the server imports it by (``install_connector``)
CONNECTOR_CLASS = "DraftsmithHiddenStatesConnector"


def install_connector(folder: Path) -> Path:
    """Copy draftsmith's KV connector into ``folder`` as the module ``CONNECTOR_MODULE``; returns ``folder``,
    to put on the server's PYTHONPATH (the package's own folder would put every draftsmith module there)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONNECTOR_FILE, folder / f"{CONNECTOR_MODULE}.py")
    return folder


def prompt_file_name(token_ids: Sequence[int]) -> str:
    """The file the connector writes a prompt's states into: ``vllm_connector.prompt_file_name``."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32] + ".safetensors"


def read_hidden_states_file(path: Path, layers: Sequence[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
    """A file the connector wrote for one request: (its prompt's token ids, {layer: (L, H)} the states
    entering each of ``layers``, the server's aux layers in sorted order). The connector stores
    ``hidden_states`` (L, len(layers), H) and ``token_ids`` (L,)."""
    lock = path.with_name(path.name + ".lock")
    try:
        if lock.is_file():  # the connector writes after answering: it holds this lock until the file is whole
            with lock.open() as held:
                fcntl.flock(held, fcntl.LOCK_SH)
                data = load_file(path)
        else:
            data = load_file(path)
    except FileNotFoundError as err:
        raise DraftsmithError(
            f"the vLLM server wrote no hidden states into {path}; was it started with the {CONNECTOR_CLASS} of "
            "vllm_server.hidden_states_plan? Its log says why a write failed"
        ) from err
    states, ids = data["hidden_states"], data["token_ids"]
    if states.dim() != 3 or states.shape[:2] != (len(ids), len(layers)):
        raise DraftsmithError(
            f"{path}: hidden_states of shape {tuple(states.shape)} for {len(ids)} tokens and layers {sorted(layers)}; "
            "was the server started with these layers?"
        )
    return ids.tolist(), {layer: states[:, i] for i, layer in enumerate(sorted(layers))}


def take_hidden_states(storage: Path, token_ids: list[int], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer: (L, H)} of the prompt ``token_ids`` from the connector's file in ``storage``, which is then
    removed with its lock (the states are copies: nothing keeps the file mapped)."""
    path = storage / prompt_file_name(token_ids)
    ids, states = read_hidden_states_file(path, layers)
    if ids != list(token_ids):
        raise DraftsmithError(f"{path} holds the states of another prompt; remove {storage} and run again")
    states = {layer: h.clone() for layer, h in states.items()}
    path.unlink()
    path.with_name(path.name + ".lock").unlink(missing_ok=True)
    return states


Item = TypeVar("Item")
Result = TypeVar("Result")


def as_completed_bounded(fn: Callable[[Item], Result], items: Iterable[Item], workers: int) -> Iterator[Result]:
    """``fn(item)`` for every item on ``workers`` threads, yielded as each finishes; never more than
    ``workers`` items in flight, so what waits to be consumed stays bounded however many items there are."""
    items = iter(items)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        pending = {pool.submit(fn, item) for item in islice(items, workers)}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                for item in islice(items, 1):
                    pending.add(pool.submit(fn, item))
                yield future.result()
    finally:  # a consumer that stops early (or an error) leaves no request queued
        pool.shutdown(wait=True, cancel_futures=True)


def stream_features(
    server: Server,
    examples: list[dict],
    storage: Path,
    top_k: int,
    layers: Sequence[int],
    concurrency: int = 64,
) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor], dict[int, torch.Tensor]]]:
    """The target's features from a server started with ``vllm_server.hidden_states_plan(layers, storage, ...)``,
    yielded per example as its request finishes (completion order): (its index in ``examples``, its top-k
    (ids (N, k), log-probs (N, k)) at its N loss positions from the prompt log-probs (the distribution
    after token t predicts t + 1), its hidden states {layer: (L, H)}). Examples with the same tokens
    (another loss mask) share one request; at most ``concurrency`` requests are in flight."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, example in enumerate(examples):
        by_prompt.setdefault(tuple(example["input_ids"]), []).append(index)

    def request(prompt: tuple[int, ...]) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor], dict]]:
        answer = complete(server, list(prompt), max_tokens=1, prompt_logprobs=top_k)
        if any(len(ids) != top_k for ids, _ in answer.prompt_logprobs):
            raise DraftsmithError(f"the vLLM server returned fewer than {top_k} log-probs at a position")
        hidden = take_hidden_states(storage, list(prompt), layers)
        rows = []
        for index in by_prompt[prompt]:
            # prompt_logprobs[t] predicts token t + 1; loss position t predicts it too
            kept = [answer.prompt_logprobs[t] for t, counts in enumerate(examples[index]["loss_mask"]) if counts]
            entry = (torch.tensor([ids for ids, _ in kept]), torch.tensor([logps for _, logps in kept]))
            rows.append((index, entry, hidden))
        return rows

    for rows in as_completed_bounded(request, by_prompt, concurrency):
        yield from rows


def staging_bytes(
    examples: list[dict], layers: Sequence[int], hidden_size: int, dtype: torch.dtype, in_flight: int
) -> int:
    """The most disk the connector's files take at once: one file per request in flight, ``in_flight``
    of the longest prompts at ``len(layers) * hidden_size`` values of the server's ``dtype`` per token."""
    longest = sorted((len(e["input_ids"]) for e in examples), reverse=True)[:in_flight]
    item = torch.empty((), dtype=dtype).element_size()
    return sum(longest) * len(layers) * hidden_size * item
