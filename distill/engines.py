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

The target's features (``vllm_features``) come from a server running vLLM's ``extract_hidden_states``
method: every request's prompt hidden states at the asked layers land in a safetensors file its
``ExampleHiddenStatesConnector`` writes, read back here by the prompt's token ids.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

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


def read_hidden_states_file(path: Path, layers: Sequence[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
    """A file vLLM's ``ExampleHiddenStatesConnector`` wrote for one request: (its prompt's token ids,
    {layer: (L, H)} the states entering each of ``layers``, the server's aux layers in sorted order).
    The connector stores ``hidden_states`` (L, len(layers), H) and ``token_ids`` (L,)."""
    lock = path.with_name(path.name + ".lock")
    if lock.is_file():  # the connector writes after answering: it holds this lock until the file is whole
        with lock.open() as held:
            fcntl.flock(held, fcntl.LOCK_SH)
            data = load_file(path)
    else:
        data = load_file(path)
    states, ids = data["hidden_states"], data["token_ids"]
    if states.dim() != 3 or states.shape[:2] != (len(ids), len(layers)):
        raise DraftsmithError(
            f"{path}: hidden_states of shape {tuple(states.shape)} for {len(ids)} tokens and layers {sorted(layers)}; "
            "was the server started with these layers?"
        )
    return ids.tolist(), {layer: states[:, i] for i, layer in enumerate(sorted(layers))}


def read_hidden_states(storage: Path, examples: list[dict], layers: Sequence[int]) -> list[dict[int, torch.Tensor]]:
    """Per example, its {layer: (L, H)} from the connector's files in ``storage``, found by their token ids
    (each file holds one request's prompt: the example's input ids); a missing example is an error."""
    by_ids = {}
    for path in sorted(storage.glob("*.safetensors")):
        ids, states = read_hidden_states_file(path, layers)
        by_ids[tuple(ids)] = states
    missing = [i for i, e in enumerate(examples) if tuple(e["input_ids"]) not in by_ids]
    if missing:
        raise DraftsmithError(f"the vLLM server wrote no hidden states for {len(missing)} of {len(examples)} rows")
    return [by_ids[tuple(e["input_ids"])] for e in examples]


def vllm_features(
    server: Server, examples: list[dict], storage: Path, top_k: int, layers: Sequence[int], concurrency: int = 64
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[dict[int, torch.Tensor]]]:
    """The target's features from a server started with ``vllm_server.hidden_states_plan(layers, storage)``:
    per example, its top-k (ids (N, k), log-probs (N, k)) at its N loss positions, from the prompt
    log-probs (the distribution after token t predicts t + 1), and its hidden states {layer: (L, H)}."""

    def entry(example: dict) -> tuple[torch.Tensor, torch.Tensor]:
        answer = complete(server, example["input_ids"], max_tokens=1, prompt_logprobs=top_k)
        rows = [answer.prompt_logprobs[t] for t, counts in enumerate(example["loss_mask"]) if counts]
        if any(len(ids) != top_k for ids, _ in rows):
            raise DraftsmithError(f"the vLLM server returned fewer than {top_k} log-probs at a position")
        return torch.tensor([ids for ids, _ in rows]), torch.tensor([logps for _, logps in rows])

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        entries = list(pool.map(entry, examples))
    return entries, read_hidden_states(storage, examples, layers)
