"""Compiled decoding: the decoding steps of a model run as ``torch.compile`` d graphs over a static cache.

An eager decoder on a GPU is bound by kernel launches and Python for small models: a 2-layer draft
step costs about as much as a much larger model's, so c comes out too high. Engines that serve
speculative decoding run both models as captured CUDA graphs; compiled mode measures what such an
engine would see.

What compiles: every forward of a ``CompiledStream`` after its first, i.e. the draft steps (one
token, or two when the draft catches up after a fully accepted round), the verification forwards
(one graph per width used; ``DecodeOptions.verify_widths`` decides the widths) and the baseline's
single-token steps. The function compiled (``decode_step``) builds the attention mask from the slot
bookkeeping inside the graph and runs the model over a ``transformers.StaticCache``, whose tensors
keep their addresses. On CUDA the mode is ``reduce-overhead``, which captures each shape as a CUDA
graph; elsewhere it is the default mode. Shapes are dynamic, so a new width or batch size reuses the
compiled code (one CUDA graph is still recorded per shape), and so does a new model of the same
architecture: the checkpoints of one run pay for compilation once per process.

What stays eager: the prompt's prefill (long and of varying length), the acceptance rule and all
bookkeeping, token trees, early-exit drafts sharing the target's cache, and 16-bit decoding on a
CPU: row-exact greedy identity in bfloat16 rests on the one-query-row attention and two-row
padding of ``attention`` and ``stream``, which inductor's fused kernels do not keep (a one-token
step and a verification forward would sum in different orders). In float32 compiled output is
tested to be the target's own, greedy and sampled.

Static caches are pooled per model and role (``static_cache``) and reused across decoding calls,
so captured graphs replay on the same addresses. A finished sequence keeps its row in a compiled
batch (fed padding, never read), so a batch's shape does not change while it decodes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from transformers import Cache, StaticCache

from draftsmith.specdec.attention import use_exact_attention
from draftsmith.specdec.cache import SlotTracker, slot_mask
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.stream import ModelStream, Verification, standard_strides_into_head

MIN_CAPACITY = 64  # pooled caches hold a power of two of slots, at least this many


def compile_mode(device: torch.device) -> str:
    """``reduce-overhead`` (CUDA graphs) on CUDA, inductor's default mode elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def check_compilable(model: torch.nn.Module) -> None:
    """Refuse compiled decoding where it would give up row-exact greedy identity (16-bit on a CPU)."""
    if model.device.type == "cpu" and model.dtype != torch.float32:
        raise DraftsmithError(
            f"compiled decoding on a CPU runs in float32; {str(model.dtype).removeprefix('torch.')} decodes eager "
            "to keep greedy output identical to the target's (pass --no-compile, or --dtype float32)"
        )


def resolve_compile(requested: bool | None, model: torch.nn.Module) -> bool:
    """Whether to compile: as ``requested``, or by default on CUDA only (on CPUs the eager slot cache
    was measured as fast or faster, ``benchmarks/compiled.py``)."""
    if requested is None:
        return model.device.type == "cuda"
    if requested:
        check_compilable(model)
    return requested


def decode_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot_pos: torch.Tensor,
    q_slots: torch.Tensor,
    cache: Cache,
) -> torch.Tensor:
    """Logits (B, Q, V) of ``tokens`` (B, Q) at ``positions`` (B, Q), written to cache slots ``q_slots``
    (Q,), attending to the live slots of ``slot_pos`` (B, S) (``cache.slot_mask``)."""
    mask = slot_mask(slot_pos, q_slots, model.dtype)  # (B, 1, Q, S)
    out = model(
        input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=0
    )
    return out.logits


_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def compiled_graphs() -> int:
    """Graphs compiled so far in this process (all modes and models together)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_step(device: torch.device) -> Callable[..., torch.Tensor]:
    """``decode_step`` compiled for ``device`` (one compiled function per mode, made on first use)."""
    mode = compile_mode(device)
    if mode not in _COMPILED:
        # Every model architecture, batch size of 1 or more and width of 1 or more is its own entry.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[mode] = torch.compile(decode_step, mode=mode, dynamic=True, fullgraph=True)
    return _COMPILED[mode]


_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(role, batch): StaticCache}


def static_cache(model: torch.nn.Module, role: str, batch_size: int, capacity: int) -> StaticCache:
    """An empty static cache of at least ``capacity`` slots for ``model`` decoding ``batch_size``
    sequences as ``role`` (the target and a draft that is the same model need one each): the pooled
    one when it is large enough, so compiled graphs replay on the same tensors; else a new one of a
    power of two of slots (at least ``MIN_CAPACITY``), which replaces it in the pool."""
    caches = _POOL.setdefault(model, {})
    key = (role, batch_size, model.dtype, model.device)
    cache = caches.get(key)
    if cache is None or cache.layers[0].max_cache_len < capacity:
        slots = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        cache = caches[key] = StaticCache(config=model.config, max_cache_len=slots)
    cache.reset()
    return cache


class CompiledStream(ModelStream):
    """A ``ModelStream`` whose forwards after the first (the prefill) are compiled decoding steps.

    The batch keeps its rows: ``select`` only changes which physical rows the caller's rows are
    (``rows``); the others are fed padding. ``role`` names the stream in the cache pool.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, capacity: int, role: str):
        check_compilable(model)
        self.model = model
        self.device = model.device
        self.cache = static_cache(model, role, batch_size, capacity)
        self.tracker = SlotTracker(batch_size, self.cache.layers[0].max_cache_len, self.device)
        self.pad_single = False
        self.rows = torch.arange(batch_size, device=self.device)  # physical row of each caller's row
        self.cuda_graphs = compile_mode(self.device) == "reduce-overhead"
        use_exact_attention(model)  # prefill and steps over a static cache take its sdpa path
        standard_strides_into_head(model)

    @property
    def lengths(self) -> list[int]:
        return self.tracker.pos[self.rows].tolist()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``tokens`` (B, Q) of the live rows (padding where ``valid`` is False); logits (B, K, V)."""
        prefill = self.tracker.length == 0
        batch, q = self.tracker.pos.shape[0], tokens.shape[1]
        if len(self.rows) < batch:  # finished rows read padding
            tokens = tokens.new_zeros(batch, q).index_copy_(0, self.rows, tokens)
            valid = valid.new_zeros(batch, q).index_copy_(0, self.rows, valid)
        positions = self.tracker.reserve(valid)
        if self.tracker.length > self.tracker.slot_pos.shape[1]:
            raise DraftsmithError(f"a compiled stream outgrew its {self.tracker.slot_pos.shape[1]} cache slots")
        q_slots = torch.arange(self.tracker.length - q, self.tracker.length, device=self.device)
        step = decode_step if prefill else compiled_step(self.device)
        if self.cuda_graphs and not prefill:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are no longer read
        logits = step(self.model, tokens, positions, self.tracker.slot_pos, q_slots, self.cache)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        # A replay overwrites a captured graph's outputs: keep a copy of the live rows.
        return logits[self.rows] if len(self.rows) < batch or self.cuda_graphs else logits

    def forward_features(
        self, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...], logits_to_keep: int = 0
    ) -> Verification:
        if layers:
            raise DraftsmithError("a draft that reads the target's hidden states decodes eager; pass --no-compile")
        return Verification(self.forward(tokens, valid, logits_to_keep))

    def rollback(self, keep: torch.Tensor) -> None:
        full = self.tracker.pos.clone()  # finished rows keep what they hold
        full[self.rows] = keep
        dropped = self.tracker.rollback(full)
        if dropped:
            self.cache.crop(-dropped)

    def select(self, rows: torch.Tensor) -> None:
        self.rows = self.rows[rows]

    def forward_tree(
        self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, layers: tuple[int, ...] = ()
    ) -> Verification:
        raise DraftsmithError("token trees decode eager; pass --no-compile with --tree")

    def keep_slots(self, slots: list[int]) -> None:
        raise DraftsmithError("token trees decode eager; pass --no-compile with --tree")


def make_stream(
    model: torch.nn.Module,
    batch_size: int,
    capacity: int,
    cache_kind: str,
    *,
    role: str,
    compiled: bool,
    row_exact: bool | None = None,
) -> ModelStream:
    """A compiled stream (static cache from the pool) or an eager one of ``cache_kind``; ``role``:
    ``target`` or ``draft``. ``row_exact`` (see ``stream``; by default for the target): logits that do
    not depend on how many tokens a forward carries."""
    if compiled:
        return CompiledStream(model, batch_size, capacity, role)
    exact = role == "target" if row_exact is None else row_exact
    return ModelStream(model, batch_size, capacity, cache_kind, row_exact=exact)
