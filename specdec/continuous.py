"""Continuous batching for the target: many prompts through a fixed number of rows.

Plain batched decoding keeps a batch together until its longest answer is done, so rows whose
answers ended early sit idle. Here a row whose answer ends (an EOS id, or ``max_new_tokens``) is
handed the next queued prompt, prefilled into the free row while the other rows keep their caches;
the batch stays full until the queue runs dry (iteration-level scheduling, Yu et al. 2022, "Orca").

Cache layout (``RowCache``): one ``(B, Hkv, C, D)`` buffer per layer; row ``b`` marks which of its
slots hold its tokens (``live``), writes its next token at slot ``length[b]`` and has its own next
position id. Each row's query sees only its own live slots through a 4-D attention mask, so a
decoding step is one dense forward: one new key per row (a scatter), attention over slots
``[0, max(length) + 1)``. Keys are stored after the rotary embedding, so where a key sits in the
buffer does not change attention; only the mask does.

Refills go in groups: once ``refill_at`` rows are free, that many queued prompts are prefilled in one
forward (left-padded to the longest) that writes their keys straight into the free rows. A prefill
reads all the weights once, as a decoding step does, so refilling one row per finished answer would
add a forward per answer; waiting for a few free rows costs only their share of a few steps. The
queue is sorted by prompt length, so a group's prompts have similar lengths and little padding.
Prompts that start alike (a chat template's system prompt and turn markers; prompts written from
one opening) have their common prefix computed once, in a single-row forward whose keys are copied
into every row of the group; only the rest of each prompt is prefilled per row. Prefill costs as
many multiply-adds per token as decoding, so on prompts of ~45 tokens, ~30 of them a system prompt,
this removes a large share of the work.
Once the queue is empty, finished rows leave the batch (their cache rows are dropped) whenever a
quarter of the batch is idle, so the tail of a run does not compute for empty rows.

Greedy rows are the target's greedy answers (float32: token for token those of
``decoder.target_generate``); sampled rows draw each token from the processed distribution
``sampling.process_logits``, per row from its own generator when ``seeds`` are given, so an answer
does not depend on which other prompts shared its batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from draftsmith.specdec.sampling import SamplingParams, process_logits, sample

MIN_SHARED_PREFIX = 4  # a shorter common prefix is prefilled with each prompt (a forward costs more)


@dataclass
class Progress:
    """Where a run stands, passed to the progress callback after every forward."""

    tokens: int  # new tokens generated so far, all prompts together
    rows_done: int  # prompts whose answers are complete
    rows_total: int
    tokens_bound: int  # tokens so far + the most the unfinished prompts can still add (an ETA's total)


@dataclass(frozen=True)
class Batching:
    """How a continuous-batching run decodes, whatever its prompts.

    sampling: how each token is chosen (greedy by default). eos_ids: an answer ends after its first
    one of these (kept). batch_size: rows decoded together. refill_at: how many rows must be free
    before queued prompts are prefilled into them (None: an eighth of the batch).
    """

    sampling: SamplingParams = SamplingParams()
    eos_ids: set[int] | frozenset[int] = frozenset()
    batch_size: int = 64
    refill_at: int | None = None


@dataclass
class ContinuousStats:
    """Counters and timings of one ``continuous_generate`` run."""

    prompts: int = 0
    batch_size: int = 0
    new_tokens: int = 0
    prefills: int = 0  # prefill forwards (each fills a group of free rows)
    prefix_forwards: int = 0  # single-row forwards of a prefix shared by a group's prompts
    steps: int = 0  # decoding forwards
    prefill_time: float = 0.0
    step_time: float = 0.0
    total_time: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class _Plan:
    """What the next forward writes, shared by every layer of one ``RowCache``.

    prefill: ``rows`` (n,) receive a shared prefix's keys in slots ``[0, prefix_len)`` (``prefix``: one
    (keys, values) pair of (1, Hkv, prefix_len, D) per layer, or None) and the group's own keys in
    ``[prefix_len, prefix_len + width)``; the forward attends within those. decode: every row writes
    one key at slot ``write_slots[b]`` and attends over ``[0, kv_length)``.
    """

    rows: torch.Tensor | None = None
    width: int = 0
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    prefix_len: int = 0
    write_slots: torch.Tensor | None = None
    kv_length: int = 0


class RowLayer(CacheLayerMixin):
    """One layer's keys and values, ``(B, Hkv, capacity, D)``, written per row as ``RowCache`` plans."""

    is_croppable = False
    is_sliding = False

    def __init__(self, plan: _Plan, index: int, batch_size: int, capacity: int):
        super().__init__()
        self.plan, self.index = plan, index
        self.batch_size = batch_size
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(self.batch_size, heads, self.capacity, dim)
        self.values = value_states.new_zeros(self.batch_size, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Prefill: (n, Hkv, width, D) into rows ``plan.rows``; decode: (B, Hkv, 1, D) at ``plan.write_slots``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.plan
        if plan.rows is None:
            batch = torch.arange(key_states.shape[0], device=key_states.device)
            self.keys[batch, :, plan.write_slots] = key_states[:, :, 0]  # (B, Hkv, D) per indexed slot
            self.values[batch, :, plan.write_slots] = value_states[:, :, 0]
            return self.keys[:, :, : plan.kv_length], self.values[:, :, : plan.kv_length]
        shared, end = plan.prefix_len, plan.prefix_len + plan.width
        self.keys[plan.rows, :, shared:end] = key_states
        self.values[plan.rows, :, shared:end] = value_states
        if plan.prefix is None:
            return key_states, value_states
        prefix_keys, prefix_values = plan.prefix[self.index]  # (1, Hkv, P, D), copied into every row
        self.keys[plan.rows, :, :shared] = prefix_keys
        self.values[plan.rows, :, :shared] = prefix_values
        return self.keys[plan.rows, :, :end], self.values[plan.rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self.plan.kv_length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys[indices]
            self.values = self.values[indices]
        self.batch_size = len(indices)


class RowCache(Cache):
    """A cache whose rows are independent: each has its own live slots, length and next position.

    ``live`` (B, capacity) marks the slots holding a row's tokens (left padding and stale slots are
    not live); ``length[b]`` is the next slot row b writes; ``position[b]`` its next position id.
    The forwards are driven by ``prefill_mask`` / ``decode_mask``, which plan the next write and
    return the attention mask and position ids for it; ``advance`` commits a decoding step.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.plan = _Plan()
        self.dtype = dtype  # the model's: masks are added to its attention scores
        super().__init__(layers=[RowLayer(self.plan, i, batch_size, capacity) for i in range(num_layers)])
        self.live = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.position = torch.zeros(batch_size, dtype=torch.long, device=device)

    def prefill_mask(
        self, rows: torch.Tensor, valid: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan a prefill of left-padded prompt tails ``valid`` (n, L) bool into ``rows`` (n,), after
        ``prefix`` (each layer's keys and values of the tokens all n prompts start with) when given.

        Returns the additive mask (n, 1, L, P + L) and position ids (n, L). A padding query sees
        itself, so no row of the mask is empty (an empty row would put NaN into the cache).
        """
        n, width = valid.shape
        shared = 0 if prefix is None else prefix[0][0].shape[2]
        idx = torch.arange(width, device=valid.device)
        causal = idx[None, :] <= idx[:, None]  # (L, L): key <= query
        own = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=valid.device)
        allowed = torch.cat([own.new_ones(n, width, shared), own], dim=2)  # (n, L, P + L)
        self.plan.rows, self.plan.width, self.plan.prefix, self.plan.prefix_len = rows, width, prefix, shared
        self.plan.kv_length = shared + width
        self.live[rows] = False
        self.live[rows, :shared] = True
        self.live[rows, shared : shared + width] = valid
        self.length[rows] = shared + width
        self.position[rows] = shared + valid.sum(1)
        positions = shared + (valid.long().cumsum(1) - 1).clamp(min=0)
        return self.additive(allowed[:, None]), positions

    def decode_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan a decoding step of one token per row: additive mask (B, 1, 1, KV) and position ids (B, 1)."""
        self.plan.rows, self.plan.prefix = None, None
        self.plan.write_slots = self.length
        self.plan.kv_length = int(self.length.max()) + 1
        slots = torch.arange(self.plan.kv_length, device=self.length.device)
        allowed = self.live[:, : self.plan.kv_length] | (slots[None, :] == self.length[:, None])
        return self.additive(allowed[:, None, None]), self.position[:, None]

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as the additive one every attention implementation takes (0 or the dtype's min)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def advance(self, rows: torch.Tensor) -> None:
        """Commit the last decoding step's token for ``rows`` (B,) bool; other rows' writes are scratch."""
        batch = torch.arange(len(rows), device=rows.device)
        self.live[batch[rows], self.length[rows]] = True
        self.length = self.length + rows.long()
        self.position = self.position + rows.long()

    def keep_rows(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (the others leave the batch)."""
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self.live, self.length, self.position = self.live[indices], self.length[indices], self.position[indices]


class _Rows:
    """Which prompt each row holds, its answer so far, and the queue of prompts still to start."""

    def __init__(self, order: list[int], batch_size: int):
        self.queue = order
        self.prompt: list[int | None] = [None] * batch_size  # prompt index per row, None when free
        self.answer: list[list[int]] = [[] for _ in range(batch_size)]

    def free(self) -> list[int]:
        return [row for row, p in enumerate(self.prompt) if p is None]

    def busy(self) -> list[int]:
        return [row for row, p in enumerate(self.prompt) if p is not None]


def _choose(logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next token per row from (B, V) logits: argmax, or a draw from the processed distribution."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = process_logits(logits, sampling)  # (B, V)
    if all(g is generators[0] for g in generators):
        return sample(probs, generators[0])
    return torch.cat([sample(probs[row : row + 1], g) for row, g in enumerate(generators)])


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int, seeds) -> None:
    if not prompts:
        raise ValueError("no prompts to decode")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")


class _Run:
    """The state of one continuous-batching run: the model, its cache, the rows and the counters."""

    def __init__(self, model, prompts, max_new_tokens, batching: Batching, generators, on_progress):
        self.model, self.prompts, self.sampling = model, prompts, batching.sampling
        self.max_new_tokens, self.eos_ids = max_new_tokens, frozenset(batching.eos_ids)
        self.generators, self.on_progress = generators, on_progress
        self.device = model.device
        batch = min(batching.batch_size, len(prompts))
        capacity = max(len(p) for p in prompts) + max_new_tokens + 1
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache = RowCache(layers, batch, capacity, self.device, model.dtype)
        # Shortest first; equal lengths in token order, so prompts that share a prefix sit together.
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), list(prompts[i])))
        self.rows = _Rows(order, batch)
        self.stats = ContinuousStats(prompts=len(prompts), batch_size=batch)
        self.done = 0
        self.prefix_tokens: list[int] = []  # the last shared prefix computed, and its keys and values
        self.prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One forward on the row cache: tokens (n, Q) -> logits of the last position (n, V)."""
        out = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache, logits_to_keep=1
        )
        return out.logits[:, -1]

    def emit(self, rows: list[int], logits: torch.Tensor) -> Iterator[tuple[int, list[int]]]:
        """Choose the next token of each of ``rows`` from logits (len(rows), V); yield finished answers."""
        generators = [self.generators[self.rows.prompt[row]] for row in rows]
        tokens = _choose(logits, self.sampling, generators).tolist()
        for row, token in zip(rows, tokens, strict=True):
            answer = self.rows.answer[row]
            answer.append(token)
            self.stats.new_tokens += 1
            if token in self.eos_ids or len(answer) == self.max_new_tokens:
                yield self.rows.prompt[row], answer
                self.rows.prompt[row], self.rows.answer[row] = None, []
                self.done += 1

    def report(self) -> None:
        if self.on_progress is None:
            return
        budget = self.max_new_tokens
        unfinished = sum(budget - len(self.rows.answer[row]) for row in self.rows.busy())
        bound = self.stats.new_tokens + unfinished + budget * len(self.rows.queue)
        self.on_progress(Progress(self.stats.new_tokens, self.done, len(self.prompts), bound))

    def refill(self, free: list[int]) -> Iterator[tuple[int, list[int]]]:
        """Prefill the next queued prompts into the ``free`` rows: their shared prefix once (when they
        have one), then their left-padded tails in one forward."""
        started = time.perf_counter()
        take, self.rows.queue = self.rows.queue[: len(free)], self.rows.queue[len(free) :]
        rows = free[: len(take)]
        prompts = [self.prompts[i] for i in take]
        shared = self.shared_prefix(prompts)
        tails = [p[shared:] for p in prompts]
        width = max(len(t) for t in tails)
        tokens = torch.zeros(len(take), width, dtype=torch.long)
        valid = torch.zeros(len(take), width, dtype=torch.bool)
        for j, (i, tail) in enumerate(zip(take, tails, strict=True)):
            tokens[j, width - len(tail) :] = torch.as_tensor(tail)
            valid[j, width - len(tail) :] = True
            self.rows.prompt[rows[j]], self.rows.answer[rows[j]] = i, []
        tokens, valid = tokens.to(self.device), valid.to(self.device)
        prefix = self.prefix_kv if shared else None
        mask, positions = self.cache.prefill_mask(torch.tensor(rows, device=self.device), valid, prefix)
        logits = self.forward(tokens, mask, positions)  # (n, V)
        self.stats.prefills += 1
        self.stats.prefill_time += time.perf_counter() - started
        yield from self.emit(rows, logits)

    def shared_prefix(self, prompts: list[Sequence[int]]) -> int:
        """How many leading tokens the prompts of a refill share and take from ``prefix_kv`` (0: none).

        Prompts of one chat template share its system prompt and turn markers; prompts a model writes
        from one opening share all but their last token. The last prefix computed is reused while
        every prompt of a group starts with it and it covers most of what they share; otherwise the
        group's own common prefix is computed (one single-row forward), if worth it.
        """
        common = min(len(p) for p in prompts) - 1  # every tail keeps at least one token
        for position in range(common):
            if any(p[position] != prompts[0][position] for p in prompts):
                common = position
                break
        cached = len(self.prefix_tokens)
        if cached and all(list(p[:cached]) == self.prefix_tokens for p in prompts) and 4 * cached >= 3 * common:
            return cached
        if len(prompts) < 2 or common < MIN_SHARED_PREFIX:
            return 0
        self.prefix_tokens = list(prompts[0][:common])
        prefix_cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=torch.tensor([self.prefix_tokens], device=self.device), cache=prefix_cache, logits_to_keep=1
        )
        self.prefix_kv = [(layer.keys, layer.values) for layer in prefix_cache.layers]  # (1, Hkv, P, D) each
        self.stats.prefix_forwards += 1
        return common

    def step(self) -> Iterator[tuple[int, list[int]]]:
        """One decoding forward over every row; free rows compute scratch that is never committed."""
        started = time.perf_counter()
        busy = self.rows.busy()
        last = [self.rows.answer[row][-1] if self.rows.answer[row] else 0 for row in range(len(self.rows.prompt))]
        mask, positions = self.cache.decode_mask()
        logits = self.forward(torch.tensor(last, device=self.device)[:, None], mask, positions)  # (B, V)
        live = torch.zeros(len(last), dtype=torch.bool)
        live[busy] = True
        self.cache.advance(live.to(self.device))
        self.stats.steps += 1
        self.stats.step_time += time.perf_counter() - started
        yield from self.emit(busy, logits[busy])

    def shrink(self) -> None:
        """Drop the free rows from the batch (when no prompt is left to fill them)."""
        keep = self.rows.busy()
        self.cache.keep_rows(torch.tensor(keep, device=self.device))
        self.rows.prompt = [self.rows.prompt[row] for row in keep]
        self.rows.answer = [self.rows.answer[row] for row in keep]


@torch.inference_mode()
def stream_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batching: Batching = Batching(),
    *,
    seeds: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    stats: ContinuousStats | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """Answer ``prompts`` (token id lists) with continuous batching; yield ``(prompt index, answer ids)``
    as each answer completes (in completion order, not input order).

    An answer ends after its first EOS id (kept) or after ``max_new_tokens`` tokens. batching: the
    sampling, stop ids, rows and refill size. seeds: one per prompt; prompt i then samples from its
    own ``torch.Generator`` seeded ``seeds[i]``, otherwise all draw from ``generator``. on_progress:
    called with a ``Progress`` after every forward. stats: filled in as the run goes, when given.
    """
    _check(prompts, max_new_tokens, batching.batch_size, seeds)
    if seeds is None:
        generators = [generator] * len(prompts)
    else:
        generators = [torch.Generator(device=model.device).manual_seed(int(s)) for s in seeds]
    run = _Run(model, prompts, max_new_tokens, batching, generators, on_progress)
    if stats is not None:
        run.stats = stats
        stats.prompts, stats.batch_size = len(prompts), len(run.rows.prompt)
    refill_at = batching.refill_at or max(1, len(run.rows.prompt) // 8)
    started = time.perf_counter()
    while True:
        free, busy = run.rows.free(), run.rows.busy()
        queued = len(run.rows.queue)
        if queued and free and (len(free) >= min(refill_at, queued) or not busy):
            yield from run.refill(free)
        elif not busy:
            break
        else:
            if not queued and 4 * len(free) >= len(run.rows.prompt):
                run.shrink()
            yield from run.step()
        run.stats.total_time = time.perf_counter() - started
        run.report()


def continuous_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batching: Batching = Batching(),
    *,
    seeds: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[list[list[int]], ContinuousStats]:
    """``stream_generate`` collected: the answers in input order, and the run's counters."""
    stats = ContinuousStats()
    answers: list[list[int]] = [[] for _ in prompts]
    stream = stream_generate(
        model, prompts, max_new_tokens, batching, seeds=seeds, generator=generator, on_progress=on_progress, stats=stats
    )
    for index, answer in stream:
        answers[index] = answer
    return answers, stats
