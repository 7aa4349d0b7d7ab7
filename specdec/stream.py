"""A model decoding a batch: its KV cache, which slots hold which positions, and row-exact forwards.

Greedy speculative output is the target's own only if the target's logits for a position do not
depend on how many tokens a forward carries. Attention is made row-exact by ``specdec.attention``;
matrix products keep rows apart from two rows up, but one-row (GEMV) kernels sum in another order,
so a one-token forward of one sequence runs as two rows, the second a padding input dropped again.
That matters in 16-bit dtypes, where last-bit differences flip near-tied argmaxes.

On CPUs without native bfloat16 the bfloat16 matrix products are emulated, and with several threads
a thread's share of 1-3 rows takes another kernel than a larger share: a row's result then depends
on the row count and on where the row sits. There, 16-bit decoding runs on one thread
(``decoding_threads``), where every share of two rows or more takes the same kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.attention import EXACT, MAX_ROWS, use_exact_attention
from draftsmith.specdec.cache import SlotTracker, make_cache, select_batch
from draftsmith.specdec.loading import cpu_has_native_bfloat16
from draftsmith.specdec.matmul import use_column_products


@dataclass
class Verification:
    """What one target forward produced, handed to the drafter (``Drafter.observe``).

    logits: (B, K, V) the target's logits (prefill: after the last prompt token only, K = 1).
    hidden: {layer i: (B, Q, H)} the residual stream entering target layer i (``hidden_states[i]``
        of a transformers forward: i = 0 is the embeddings, i = L the final normed output) at every
        input row of the forward, for the layers the drafter asked for; empty when it asked for none.
    """

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


def needs_row_padding(model: torch.nn.Module) -> bool:
    """Whether one-token forwards of ``model`` go through two rows: in 16-bit dtypes. In float32 the
    last-bit differences of one-row kernels do not flip argmaxes in practice, and on CPUs whose
    float32 BLAS is slow for two rows the padding would cost."""
    return model.dtype in (torch.bfloat16, torch.float16)


@contextmanager
def decoding_threads(model: torch.nn.Module) -> Iterator[None]:
    """One intra-op thread for the block when ``model`` decodes in bfloat16 on a CPU that emulates it
    (see the module docstring); otherwise the thread count is left alone."""
    single = model.device.type == "cpu" and model.dtype == torch.bfloat16 and not cpu_has_native_bfloat16()
    threads = torch.get_num_threads()
    if single:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if single:
            torch.set_num_threads(threads)


def _contiguous_input(_module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].clone(memory_format=torch.contiguous_format), *args[1:])


def standard_strides_into_head(model: torch.nn.Module) -> None:
    """Give the LM head its input with standard strides.

    ``logits_to_keep`` hands the head a slice of the hidden states, e.g. shape (1, 1, H) with a
    batch stride of Q*H. For such an input torch's bfloat16 CPU matmul takes a batched path that
    copies the whole weight first: 40 ms instead of 2 ms for a 49k-token head (benchmarks/cpu_kernels.py).
    The hook is added once per head: a deep copy of a model (a draft made from the target) carries
    its hooks along, and a compiled graph is specialized to the number of hooks it ran.
    """
    if not isinstance(model, PreTrainedModel):
        return  # a draft wrapper (reduced head, early exit) feeds its head itself
    head = model.get_output_embeddings()
    if head is None or _contiguous_input in head._forward_pre_hooks.values():
        return
    head.register_forward_pre_hook(_contiguous_input)


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L_max) token ids and validity mask, prompts right-aligned."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt) :] = True
    return tokens.to(device), valid.to(device)


class ModelStream:
    """A model plus its cache and slot bookkeeping for one batch.

    Every stream's model gets row-exact attention (``specdec.attention``; also the fastest
    single-query path) and few-row products in the faster form (``specdec.matmul``). ``row_exact``:
    the model's logits must not depend on how many tokens a forward carries (the target's), so
    one-token forwards of one sequence run as two rows.
    """

    def __init__(
        self, model: torch.nn.Module, batch_size: int, capacity: int, cache_kind: str, row_exact: bool = False
    ):
        self.model = model
        self.device = model.device
        self.cache = make_cache(cache_kind, model.config, capacity + 1)
        self.tracker = SlotTracker(batch_size, capacity + 1, self.device)
        self.pad_single = row_exact and batch_size == 1 and needs_row_padding(model)
        self._pad_valid = torch.tensor([[True, False]], device=self.device)
        use_exact_attention(model)
        use_column_products(model)  # timed once per model: CPU float32 only
        standard_strides_into_head(model)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sequence in the cache."""
        return self.tracker.pos.tolist()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``tokens`` (B, Q) (padding where ``valid`` is False) and return logits (B, K, V)."""
        return self.forward_features(tokens, valid, (), logits_to_keep).logits

    def forward_features(
        self, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...], logits_to_keep: int = 0
    ) -> Verification:
        """``forward``, also giving the hidden states entering the model's ``layers`` at every input row."""
        if self.pad_single and tokens.shape == (1, 1):
            out = self._forward(tokens.repeat(1, 2), self._pad_valid, 0, layers, exact_rows=1)
            self.tracker.drop_last_slot()  # the padding slot
            self.cache.crop(-1)
            return Verification(out.logits[:, :1], {i: h[:, :1] for i, h in out.hidden.items()})
        return self._forward(tokens, valid, logits_to_keep, layers)

    def _forward(
        self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int, layers: tuple[int, ...], **attention
    ) -> Verification:
        holes_before = self.tracker.holes
        positions = self.tracker.reserve(valid)
        kv_length, _ = self.cache.get_mask_sizes(tokens.shape[1], 0)
        mask = self.tracker.attention_mask(tokens.shape[1], kv_length, self.model.dtype)
        if mask is not None and not holes_before and valid.shape[0] == 1 and bool(valid[0].long().diff().le(0).all()):
            # One sequence whose only padding trails its real inputs (a padded verification): the
            # real rows never look past themselves, so the plain causal mask is right for them.
            mask = None
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=bool(layers),
            **attention,
        )
        return Verification(out.logits, {i: out.hidden_states[i] for i in layers})

    def forward_tree(
        self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, layers: tuple[int, ...] = ()
    ) -> Verification:
        """Append the inputs ``tokens`` (1, Q) of one sequence at explicit ``positions`` (1, Q), input
        i attending to the cache slots where ``visible[i]`` (Q, S) is True (S: slots in use after this
        forward); logits (1, Q, V) and the hidden states entering ``layers``. Used for token trees,
        whose nodes sit at positions by depth and see only their ancestors; ``keep_slots`` commits
        some of them afterwards."""
        q = tokens.shape[1]
        self.tracker.reserve_at(positions)
        kv_length, _ = self.cache.get_mask_sizes(q, 0)
        allowed = torch.nn.functional.pad(visible, (0, kv_length - visible.shape[1]), value=False)
        mask = torch.zeros(1, 1, q, kv_length, dtype=self.model.dtype, device=self.device)
        mask.masked_fill_(~allowed[None, None], torch.finfo(self.model.dtype).min)
        attention = {}
        if self.model.config._attn_implementation == EXACT and q <= MAX_ROWS:
            attention["exact_keys"] = [row.nonzero()[:, 0] for row in visible]  # (K_i,) slots, in order
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            **attention,
        )
        return Verification(out.logits, {i: out.hidden_states[i] for i in layers})

    def keep_slots(self, slots: list[int]) -> None:
        """Commit the uncommitted slots ``slots`` (ascending, at or after the sequence's committed
        length) in that order right after the committed tokens, and forget every other slot after
        them: a token tree's accepted path, compacted. One sequence without holes."""
        base = int(self.tracker.pos[0])
        if slots:
            index = torch.tensor(slots, device=self.device)
            for layer in (layer for layer in self.cache.layers if layer.is_initialized):
                layer.keys[:, :, base : base + len(slots)] = layer.keys[:, :, index]
                layer.values[:, :, base : base + len(slots)] = layer.values[:, :, index]
        dropped = self.tracker.length - base - len(slots)
        self.tracker.compact(base, len(slots))
        if dropped:
            self.cache.crop(-dropped)

    def rollback(self, keep: torch.Tensor) -> None:
        """Keep the first ``keep[b]`` tokens of each sequence in the cache, at most what it holds (B,)."""
        dropped = self.tracker.rollback(keep)
        if dropped:
            self.cache.crop(-dropped)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (finished sequences leave the batch)."""
        select_batch(self.cache, rows)
        self.tracker.select(rows)
