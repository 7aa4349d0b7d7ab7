"""KV caches for the decoder, and the bookkeeping that lets a batch roll back ragged.

Three cache kinds share one interface (``transformers.Cache``), so the decoder never branches on them:

- ``slot``: a preallocated buffer per layer, written by position. Rolling back moves the write
  position; nothing is copied and stale slots are simply overwritten by the next write. Attention
  only ever sees the live prefix ``[:length]``, so on CPU it does no work for unused capacity.
  The buffer doubles (one copy) if a run outgrows it. Default on CPU (see ``benchmarks/cache_kinds.py``).
- ``dynamic``: ``transformers.DynamicCache``; grows by concatenation (a copy of the whole layer per
  forward) and is cropped by slicing.
- ``static``: ``transformers.StaticCache``; fixed shape, so the CUDA path can be compiled or
  graph-captured. Attention covers the whole capacity (future slots masked). Default on CUDA.

``SlotTracker`` records, per sequence and per cache slot, which slots hold a committed token and at
which logical position. A batch whose sequences accept different numbers of tokens leaves masked
holes in the shorter ones; the tracker turns that into the 4-D attention mask and per-sequence
``position_ids`` the model needs.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedConfig, StaticCache
from transformers.cache_utils import CacheLayerMixin, StaticLayer

CACHE_KINDS = ("slot", "dynamic", "static")


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in a preallocated ``(B, H, capacity, D)`` buffer."""

    is_croppable = True
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        new_capacity = max(2 * self.capacity, needed)
        pad = new_capacity - self.capacity
        self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, pad))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, pad))
        self.capacity = new_capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the number of trailing slots to drop")
        self.length -= abs(tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys[indices]
            self.values = self.values[indices]


class SlotCache(Cache):
    """A ``transformers.Cache`` made of ``SlotLayer`` s, one per decoder layer."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlotLayer(capacity) for _ in range(num_layers)])


def make_cache(kind: str, config: PreTrainedConfig, capacity: int) -> Cache:
    """Build an empty cache of ``kind`` for a model with ``config`` holding up to ``capacity`` slots."""
    if kind == "slot":
        return SlotCache(config.get_text_config(decoder=True).num_hidden_layers, capacity)
    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "static":
        return StaticCache(config=config, max_cache_len=capacity)
    raise ValueError(f"unknown cache kind {kind!r}; choose one of {', '.join(CACHE_KINDS)}")


def select_batch(cache: Cache, indices: torch.Tensor) -> None:
    """Keep only the batch rows ``indices`` of every layer (finished sequences leave the batch)."""
    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            # A static layer has no row selection of its own; this gives up its fixed address,
            # which only matters to a compiled graph, and a compiled batch never shrinks.
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[indices], layer.values[indices]
                layer.batch_size = len(indices)
        else:
            layer.batch_select_indices(indices)


def slot_mask(slot_pos: torch.Tensor, q_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4-D attention mask (B, 1, Q, S) of a forward whose inputs sit in cache slots
    ``q_slots`` (Q,), from the logical position of each slot ``slot_pos`` (B, S) (-1: padding or hole).

    A query attends to the live slots at or before its own slot, and to itself even when it is
    padding (so no row is fully masked and no NaN can leak into the cache). Only tensor operations,
    so a compiled decoding step builds its mask inside the graph.
    """
    kv_idx = torch.arange(slot_pos.shape[1], device=slot_pos.device)
    causal = kv_idx[None, :] <= q_slots[:, None]  # (Q, S)
    allowed = ((slot_pos >= 0)[:, None, :] & causal[None]) | (kv_idx[None, :] == q_slots[:, None])[None]  # (B, Q, S)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=slot_pos.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def default_cache_kind(device: torch.device) -> str:
    return "static" if device.type == "cuda" else "slot"


class SlotTracker:
    """Which cache slots hold committed tokens, per sequence, and at which logical positions.

    ``pos[b]`` is the number of tokens sequence ``b`` has in the cache (its next position id);
    ``slot_pos[b, s]`` is the logical position stored in slot ``s``, or -1 for padding and holes.
    Slot ``s`` of every sequence is written by the same forward, so slot indices are shared and
    positions are not.
    """

    def __init__(self, batch_size: int, capacity: int, device: torch.device):
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot_pos = torch.full((batch_size, capacity), -1, dtype=torch.long, device=device)
        self.length = 0  # slots in use, the same for every sequence
        self.holes = False  # any masked slot below `length`

    def reserve(self, valid: torch.Tensor) -> torch.Tensor:
        """Claim the next ``Q`` slots for a forward whose inputs are ``valid`` (B, Q) bool.

        Returns ``position_ids`` (B, Q); padded inputs get a harmless in-range position.
        """
        q = valid.shape[1]
        end = self.length + q
        if end > self.slot_pos.shape[1]:
            grow = max(end, 2 * self.slot_pos.shape[1]) - self.slot_pos.shape[1]
            self.slot_pos = torch.nn.functional.pad(self.slot_pos, (0, grow), value=-1)
        offsets = valid.long().cumsum(1) - 1  # (B, Q): rank of each valid input
        positions = self.pos[:, None] + offsets.clamp(min=0)
        self.slot_pos[:, self.length : end] = torch.where(valid, positions, -1)
        self.pos += valid.sum(1)
        self.length = end
        if not bool(valid.all()):
            self.holes = True
        return positions

    def attention_mask(self, q: int, kv_length: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive 4-D mask (B, 1, Q, kv_length) for the last ``q`` reserved slots, or None.

        None means a plain causal mask is right (no padding, no holes), which lets the model use its
        fastest attention path. A query attends to the live slots at or before its own slot, and to
        itself even when it is padding (so no row is fully masked and no NaN can leak into the cache).
        """
        if not self.holes:
            return None
        slot_pos = self.slot_pos[:, :kv_length]
        if slot_pos.shape[1] < kv_length:
            slot_pos = torch.nn.functional.pad(slot_pos, (0, kv_length - slot_pos.shape[1]), value=-1)
        return slot_mask(slot_pos, torch.arange(self.length - q, self.length, device=slot_pos.device), dtype)

    def reserve_at(self, positions: torch.Tensor) -> None:
        """Claim the next ``Q`` slots for inputs at explicit logical ``positions`` (B, Q), e.g. a
        token tree's nodes by depth. ``pos`` does not move: such inputs stay uncommitted until
        ``compact`` keeps some of them."""
        end = self.length + positions.shape[1]
        if end > self.slot_pos.shape[1]:
            grow = max(end, 2 * self.slot_pos.shape[1]) - self.slot_pos.shape[1]
            self.slot_pos = torch.nn.functional.pad(self.slot_pos, (0, grow), value=-1)
        self.slot_pos[:, self.length : end] = positions
        self.length = end

    def compact(self, base: int, kept: int) -> None:
        """After the caller copied ``kept`` chosen slots down to ``base`` (one sequence without holes,
        whose ``pos`` is ``base``): those slots follow the context at consecutive positions, the
        rest is forgotten."""
        self.slot_pos[:, base : base + kept] = self.pos[:, None] + torch.arange(kept, device=self.pos.device)
        self.slot_pos[:, base + kept :] = -1
        self.pos = self.pos + kept
        self.length = base + kept
        self.holes = False

    def drop_last_slot(self) -> None:
        """Forget the last reserved slot, which held padding only (a one-token forward run as two rows)."""
        self.length -= 1
        self.slot_pos[:, self.length] = -1
        self.holes = bool((self.slot_pos[:, : self.length] < 0).any())

    def rollback(self, keep: torch.Tensor) -> int:
        """Forget every token at logical position >= ``keep[b]``; return how many trailing slots to crop."""
        keep = torch.minimum(keep, self.pos)  # a sequence never holds more than it was fed
        self.slot_pos[self.slot_pos >= keep[:, None]] = -1
        self.pos = keep
        live = self.slot_pos[:, : self.length] >= 0  # (B, L)
        slots = torch.arange(1, self.length + 1, device=live.device)
        new_length = (live.any(0) * slots).max() if self.length else slots.sum()  # the last live slot's, plus one
        holes = (~live & (slots <= new_length)).any()
        new_length, holes = torch.stack([new_length, holes.long()]).tolist()  # one read into Python
        dropped = self.length - new_length
        self.length = new_length
        self.holes = bool(holes)
        return dropped

    def select(self, indices: torch.Tensor) -> None:
        """Keep only the sequences at ``indices`` (finished ones leave the batch)."""
        self.pos = self.pos[indices]
        self.slot_pos = self.slot_pos[indices]
        self.holes = bool((self.slot_pos[:, : self.length] < 0).any())
