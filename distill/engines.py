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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import ClassVar

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
