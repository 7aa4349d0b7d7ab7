"""The DFlash draft kind (Chen et al. 2026, DFlash; z-lab): a few decoder layers that fill a whole
block of masked positions in ONE forward, conditioned on the target's own hidden states.

**The model** (``DFlashDraft``). The target's residual streams after the layers ``target_layer_ids``
(DFlash's ids: the output of target layer i, transformers' ``hidden_states[i + 1]``, vLLM's aux
layer id i + 1) are concatenated and projected by ``fc`` (L*H -> H, no bias), then normed by
``hidden_norm``: one context vector c_p per committed position p. ``layers`` Qwen3 decoder layers
follow (q and k normed per head, as vLLM's ``qwen3_dflash`` builds them, whatever the target's
architecture); every layer projects the context vectors to keys and values with its own ``k_proj``
/ ``v_proj`` (k normed, rotated at position p), and its queries read them beside the block's own
keys. The block is ``[x_n, m, m, ..., m]`` at positions n .. n+K: the last committed token (whose
target state is not computed yet) and K copies of the mask, which embed to ``mask_embedding`` (a
trained vector; every other token embeds through the target's frozen embedding). The block attends
to all context positions before n and to itself in both directions (``causal: false``); the final
norm and the target's frozen LM head give, at mask k, the draft's distribution for x_{n+k}. The
default ``target_layer_ids`` are z-lab's: the middle layer for a one-layer draft, else ``layers``
ids spread evenly from 1 to n-3 (repeats dropped on a small target).

**Training** (``DFlashKind.training_forward``), the recipe of speculators' DFlash trainer
(``select_anchors``, ``fixed-exp-decay``), on the teacher's distributions instead of hard labels:
per sequence, up to ``max_anchors`` anchors a are drawn uniformly among its loss rows; each anchors
a block ``[x_a, m x (B-1)]`` at positions a .. a+B-1 that sees the target's context vectors at
positions < a and its own block. Mask k predicts x_{a+k} and is compared with the teacher's
distribution at loss row a+k-1 (the target given the true tokens up to x_{a+k-1}: what verification
computes when the drafts before it were accepted), only where that row is a loss row of the same
sequence, with weight exp(-(k-1)/``decay``) (``decay`` 4, speculators' default; the paper's
gamma). The target's features come from ``Batch.teacher_hidden`` (the live teacher forward or stored
features alike). In eval mode every loss row anchors a block of one mask (held-out alpha: block
position 1, the next token).

**Decoding** (``DFlashDrafter``). The verifier returns the target's states at the feature layers
for every row it computed; ``observe`` projects the committed rows to context keys and values, one
per layer, in the drafter's own cache (row p at position p). A proposal is ONE forward over
``[x_n, m x gamma]`` (``round_forwards`` = 1); the gamma tokens are drawn from the mask rows' q_k
(argmax, or a sample from the processed q_k, which the acceptance rule gets), so the output is
exactly the target's. The block's own keys never enter the cache. A token tree's level k is the
top-k of q_k for every node of level k-1 (``one_forward.tree_from_levels``): its candidates do not
depend on the parent, so tree acceptance stays exact; the tree's nodes are never fed back.

**Serving**: the z-lab DFlash layout vLLM's ``dflash`` method loads: ``config.json`` a Qwen3 config
(``model_type: qwen3``, ``architectures: [DFlashDraftModel]``, ``num_hidden_layers`` = the draft's
layers) with ``block_size``, ``num_target_layers``, ``target_hidden_size`` and ``dflash_config``
(``mask_token_id``, ``target_layer_ids``, ``causal: false``); ``model.safetensors`` with ``fc.weight``,
``hidden_norm.weight``, ``layers.*`` and ``norm.weight`` (no embedding or head: vLLM shares the
target's); ``mask_embedding.pt`` ({``mask_token_id``, ``embedding``}, vLLM's override of the mask's
row). Served as ``{"method": "dflash", "model": folder}`` with num_speculative_tokens = gamma.
"""

from __future__ import annotations

import copy
import json
import pickle
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from draftsmith.distill.drafts.kind import (
    Batch,
    DraftModel,
    DraftSettings,
    KindBase,
    Predictions,
    layer_count,
    refuse_settings,
)
from draftsmith.distill.drafts.one_forward import OneForwardDrafter
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.stream import Verification
from draftsmith.specdec.verify import TargetVerifier

CONFIG, WEIGHTS, MASK_EMBEDDING = "config.json", "model.safetensors", "mask_embedding.pt"
ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry: qwen3_dflash.DFlashQwen3ForCausalLM
OPTIONS = {"mask_token_id": int, "block_size": int, "target_layer_ids": list, "max_anchors": int, "decay": float}
DEFAULTS = {"block_size": 8, "max_anchors": 64, "decay": 4.0}
SAVED = ("fc.", "hidden_norm.", "layers.", "norm.")  # the tensors of the layout (vLLM shares embedding and head)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's choice: the middle layer for one draft layer, else ids spread evenly over 1 .. n-3
    (rounded); repeats (a small target) are dropped, and ids past n-2 clipped to it."""
    if num_target_layers < 2:
        raise DraftsmithError(f"a DFlash draft reads a target layer's output; this target has {num_target_layers}")
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return tuple(sorted({min(max(i, 0), num_target_layers - 2) for i in ids}))


def check_target_layer_ids(ids, num_target_layers: int) -> tuple[int, ...]:
    """Increasing ids in 0..n-2: the output of layer n-1 is the stream vLLM never hands a drafter."""
    ids = tuple(ids)
    if (
        not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or list(ids) != sorted(set(ids))
        or ids[0] < 0
        or ids[-1] > num_target_layers - 2
    ):
        raise DraftsmithError(
            f"target_layer_ids must be increasing target layer ids in 0..{num_target_layers - 2} (the outputs of "
            f"those layers; vLLM hands a drafter no later one), got {list(ids)}"
        )
    return ids


def draft_config(target_config, layers: int) -> Qwen3Config:
    """The Qwen3 config of the draft's layers: the target's width, heads, MLP and rotary settings."""
    heads = target_config.num_attention_heads
    return Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.to_dict().get("head_dim") or target_config.hidden_size // heads,
        hidden_act=target_config.hidden_act,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(target_config.rope_parameters),
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., heads, d) by cos, sin (..., d) (one per position)."""
    return x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]


class DFlashDraft(DraftModel):
    """A DFlash draft for ``target`` (the module docstring): ``layers`` decoder layers reading the
    target's outputs of ``target_layer_ids``, drafting ``block_size - 1`` tokens per forward in
    training's blocks, with ``mask_token_id`` as the mask's id in the exported config."""

    described_as = "a DFlash draft"

    def __init__(self, target: PreTrainedModel, layers: int, target_layer_ids, block_size: int, mask_token_id: int):
        super().__init__()
        vocab = target.config.vocab_size
        if not 0 <= mask_token_id < vocab:
            raise DraftsmithError(f"mask_token_id must be a vocabulary id (0..{vocab - 1}), got {mask_token_id}")
        if block_size < 2:
            raise DraftsmithError(f"block_size must be >= 2 (the anchor and at least one mask), got {block_size}")
        self.num_target_layers = target.config.num_hidden_layers
        self.target_layer_ids = check_target_layer_ids(target_layer_ids, self.num_target_layers)
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.max_anchors, self.decay = DEFAULTS["max_anchors"], DEFAULTS["decay"]
        self.config = draft_config(target.config, layers)
        self.generation_config = copy.deepcopy(target.generation_config)
        self.verifier = target.name_or_path
        hidden = self.config.hidden_size
        self.embed_tokens = copy.deepcopy(target.get_input_embeddings()).requires_grad_(False)
        self.lm_head = copy.deepcopy(target.get_output_embeddings()).requires_grad_(False)
        self.mask_embedding = nn.Parameter(self.embed_tokens.weight[mask_token_id].detach().clone())
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=self.config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(self.config, i) for i in range(layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=self.config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.config)
        self.to(device=target.device, dtype=target.dtype)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose entering states it reads (``hidden_states[i + 1]`` for output id i)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """hidden_norm(fc([target states])): {layer: (B, S, H)} -> (B, S, H)."""
        features = torch.cat([hidden[i] for i in self.feature_layers], -1).to(self.dtype)
        return self.hidden_norm(self.fc(features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context vectors (B, S, H) at positions (B, S):
        [(k (B, S, kv heads, d), v (B, S, kv heads, d))], k normed and rotated."""
        cos, sin = self.rotary_emb(context, positions)
        out = []
        for layer in self.layers:
            attention = layer.self_attn
            shape = (*context.shape[:-1], -1, attention.head_dim)
            k = rotate(attention.k_norm(attention.k_proj(context).view(shape)), cos, sin)
            out.append((k, attention.v_proj(context).view(shape)))
        return out

    def embed_block(self, first: torch.Tensor, width: int) -> torch.Tensor:
        """The block's inputs: first (...,) the anchor tokens -> (..., width, H): the anchor's
        embedding, then ``width - 1`` mask embeddings."""
        anchor = self.embed_tokens(first)[..., None, :]
        masks = self.mask_embedding.to(anchor.dtype).expand(*first.shape, width - 1, -1)
        return torch.cat([anchor, masks], -2)

    def block_hidden(
        self, x: torch.Tensor, positions: torch.Tensor, kv: list, context_ok: torch.Tensor
    ) -> torch.Tensor:
        """The layers over blocks x (B, A, Q, H) at positions (B, A, Q), each block reading the context
        keys ``kv`` (``context_kv``, S rows) where context_ok (B, A, S) and its own Q keys: (B, A, Q, H) normed."""
        cos, sin = self.rotary_emb(x, positions.flatten(1))
        cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        for layer, (context_k, context_v) in zip(self.layers, kv, strict=True):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (*h.shape[:-1], -1, attention.head_dim)
            q = rotate(attention.q_norm(attention.q_proj(h).view(shape)), cos, sin)  # (B, A, Q, heads, d)
            k = rotate(attention.k_norm(attention.k_proj(h).view(shape)), cos, sin)  # (B, A, Q, kv, d)
            v = attention.v_proj(h).view(shape)
            attended = block_attention(q, k, v, context_k, context_v, context_ok, attention.scaling)
            x = x + attention.o_proj(attended.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def forward(self, input_ids, attention_mask, features: dict[int, torch.Tensor], anchors: torch.Tensor, width: int):
        """Training blocks: input_ids, attention_mask (B, T); features {layer: (B, T, H)}; anchors
        (B, A) the anchor positions; blocks of ``width`` (anchor and masks). Returns (B, A, width, H)
        normed hidden states (the head is applied by the caller at the rows it scores)."""
        length = input_ids.shape[1]
        index = torch.arange(length, device=input_ids.device)
        kv = self.context_kv(self.context(features), index.expand(input_ids.shape[0], -1))
        context_ok = (index[None, None, :] < anchors[..., None]) & attention_mask.bool()[:, None, :]  # (B, A, T)
        x = self.embed_block(input_ids.gather(1, anchors), width)
        positions = anchors[..., None] + torch.arange(width, device=anchors.device)
        return self.block_hidden(x, positions, kv, context_ok)

    # specdec.drafters.PairedDraft: the target's verifier returns its feature layers' states to the drafter.
    def decoding_pair(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions
    ) -> tuple[TargetVerifier, DFlashDrafter]:
        verifier = self.feature_verifier(target, batch_size, capacity, options, self.feature_layers)
        return verifier, DFlashDrafter(self, batch_size, capacity)

    def round_forwards(self, gamma: int) -> int:
        """One draft forward drafts a whole round, whatever its gamma."""
        return 1


def block_attention(q, k, v, context_k, context_v, context_ok, scale: float) -> torch.Tensor:
    """Attention of block queries q (B, A, Q, heads, d) over the context keys and values (B, S, kv, d)
    where context_ok (B, A, S), and over their own block's keys and values k, v (B, A, Q, kv, d), all of
    them (bidirectional). Returns (B, A, Q, heads, d)."""
    groups = q.shape[-2] // k.shape[-2]
    context_k, context_v = context_k.repeat_interleave(groups, -2), context_v.repeat_interleave(groups, -2)
    k, v = k.repeat_interleave(groups, -2), v.repeat_interleave(groups, -2)
    on_context = torch.einsum("baqhd,bshd->bahqs", q, context_k) * scale
    on_context = on_context.masked_fill(~context_ok[:, :, None, None, :], torch.finfo(on_context.dtype).min)
    on_block = torch.einsum("baqhd,bakhd->bahqk", q, k) * scale
    weights = torch.cat([on_context, on_block], -1).float().softmax(-1).to(q.dtype)
    seen = context_k.shape[1]
    out = torch.einsum("bahqs,bshd->baqhd", weights[..., :seen], context_v)
    return out + torch.einsum("bahqk,bakhd->baqhd", weights[..., seen:], v)


class DFlashDrafter(OneForwardDrafter):
    """A ``DFlashDraft`` as drafter (``specdec.drafters.Drafter``) on its own context cache.

    The cache holds, per layer, the keys and values of the target's context vectors of the committed
    rows the target has computed: one less than the committed tokens (the last, x_n, is the block's
    anchor). ``lengths`` (B,) counts them; row p sits at position p."""

    def __init__(self, draft: DFlashDraft, batch_size: int, capacity: int):
        self.draft = draft
        self.feature_layers = draft.feature_layers
        config = draft.config
        shape = (batch_size, capacity, config.num_key_value_heads, config.head_dim)
        self.kv = [
            (
                torch.zeros(shape, dtype=draft.dtype, device=draft.device),
                torch.zeros(shape, dtype=draft.dtype, device=draft.device),
            )
            for _ in draft.layers
        ]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=draft.device)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Nothing yet: the context needs the target's states of the prompts (``observe``)."""

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """Append the context keys and values of the committed rows ``kept`` (B, Q), in order."""
        kept = kept.to(self.draft.device)
        positions = self.lengths[:, None] + kept.long().cumsum(1) - 1  # (B, Q): where each kept row goes
        positions = positions.clamp(min=0)
        kv = self.draft.context_kv(self.draft.context(verification.hidden), positions)
        rows, columns = kept.nonzero(as_tuple=True)
        for (cache_k, cache_v), (k, v) in zip(self.kv, kv, strict=True):
            cache_k[rows, positions[rows, columns]] = k[rows, columns]
            cache_v[rows, positions[rows, columns]] = v[rows, columns]
        self.lengths = self.lengths + kept.sum(1)

    def round_logits(self, sequences: list[list[int]], reading: torch.Tensor, width: int) -> torch.Tensor:
        """ONE forward over [last token, ``width`` masks] per sequence: logits (B, width, V), row k the
        draft's distribution for the token k+1 places after the last one (every sequence's block: its
        cache holds its context, whether it reads or not)."""
        last = torch.tensor([sequence[-1] for sequence in sequences], device=self.draft.device)
        seen = int(self.lengths.max())
        kv = [(k[:, :seen], v[:, :seen]) for k, v in self.kv]
        context_ok = (torch.arange(seen, device=last.device) < self.lengths[:, None])[:, None]  # (B, 1, S)
        x = self.draft.embed_block(last[:, None], width + 1)  # (B, 1, width + 1, H)
        positions = (self.lengths[:, None] + torch.arange(width + 1, device=last.device))[:, None]
        hidden = self.draft.block_hidden(x, positions, kv, context_ok)[:, 0, 1:]  # the masks' rows
        return self.draft.lm_head(hidden)

    def rollback(self, keep: torch.Tensor) -> None:
        """The cache holds one row less than the committed tokens, so nothing is dropped unless asked."""
        self.lengths = torch.minimum(self.lengths, keep.to(self.lengths.device))

    def select(self, rows: torch.Tensor) -> None:
        self.kv = [(k[rows], v[rows]) for k, v in self.kv]
        self.lengths = self.lengths[rows]


# ---- Training: anchored blocks (speculators' DFlash recipe) -----------------------------------------


def sample_anchors(loss_mask: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``limit`` anchors per sequence (None: all), drawn uniformly without replacement among its
    loss rows and sorted: anchors (B, A) positions and valid (B, A) (False: padding, position 0)."""
    picked = []
    for row in loss_mask:
        candidates = row.nonzero()[:, 0]
        if limit is not None and len(candidates) > limit:
            candidates = candidates[torch.randperm(len(candidates))[:limit].to(candidates.device)].sort().values
        picked.append(candidates)
    width = max(1, max(len(p) for p in picked))
    anchors = torch.zeros(len(picked), width, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(len(picked), width, dtype=torch.bool, device=loss_mask.device)
    for row, candidates in enumerate(picked):
        anchors[row, : len(candidates)], valid[row, : len(candidates)] = candidates, True
    return anchors, valid


def block_targets(
    rows: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, length: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which block rows are scored: mask k of the block at anchor a predicts x_{a+k} against the
    teacher at loss row a+k-1, where that is a loss row of the same sequence. rows (M,) flat (B, T)
    loss rows; anchors, valid (B, A). Returns the flat indices into (B, A, width) of the scored rows,
    their teacher rows (indices into ``rows``) and their block positions k."""
    batch = anchors.shape[0]
    where = torch.full((batch * length,), -1, dtype=torch.long, device=rows.device)
    where[rows] = torch.arange(len(rows), device=rows.device)
    k = torch.arange(1, width, device=rows.device)
    at = anchors[..., None] + k - 1  # (B, A, width-1): the teacher's position
    inside = valid[..., None] & (at < length)
    flat = torch.arange(batch, device=rows.device)[:, None, None] * length + at.clamp(max=length - 1)
    teacher = torch.where(inside, where[flat], -1)
    scored = teacher >= 0
    index = torch.arange(anchors.numel() * width, device=rows.device).view(*anchors.shape, width)[..., 1:]
    return index[scored], teacher[scored], k.expand_as(teacher)[scored]


class DFlashKind(KindBase):
    """DFlash drafts (``draft.kind: dflash``). draft.options: ``mask_token_id`` (required: an id of the
    target's vocabulary the data never uses, e.g. 16 for SmolLM2), ``block_size`` (the anchor and
    block_size-1 masks per training block, default 8), ``target_layer_ids`` (the target layers whose
    outputs it reads, default z-lab's), ``max_anchors`` (blocks per sequence per step, default 64),
    ``decay`` (block position k weighs exp(-(k-1)/decay), default 4). ``draft.layers``: its decoder
    layers. ``draft.init``, ``draft.config``, ``draft.model``, LoRA and a cut head do not apply."""

    name = "dflash"
    model_class = DFlashDraft
    option_types = OPTIONS
    standalone = False  # it reads the target's hidden states: transformers cannot run it as an assistant
    cuts_head = False  # it drafts with the target's own head

    def options(self, settings: DraftSettings) -> dict:
        return DEFAULTS | settings.options

    def check(self, settings: DraftSettings) -> None:
        super().check(settings)
        refused = ("draft.lora_r", "draft.config", "draft.model", "draft.vocab")
        refuse_settings(self.name, settings, refused, "are decoder layers on the target's head")
        if "mask_token_id" not in settings.options:
            raise DraftsmithError(
                "dflash drafts need draft.options.mask_token_id: an id of the target's vocabulary that the data never "
                "uses (e.g. 16, <empty_output>, for SmolLM2)"
            )
        options = self.options(settings)
        if options["block_size"] < 2:
            raise DraftsmithError(f"draft.options: block_size must be >= 2, got {options['block_size']}")
        if options["max_anchors"] < 1 or options["decay"] <= 0:
            raise DraftsmithError("draft.options: max_anchors must be >= 1 and decay > 0")
        if settings.loss == "accepted_length":
            raise DraftsmithError(
                "dflash drafts score several block positions per anchor, and accepted_length's windows assume one "
                "prediction per position: use forward_kl, tvd, reverse_kl or jsd"
            )
        layer_count(settings.layers, "dflash")

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> DFlashDraft:
        options = self.options(settings)
        layers = layer_count(settings.layers, "dflash")
        ids = options.get("target_layer_ids") or default_target_layer_ids(target.config.num_hidden_layers, layers)
        if tokenizer is not None and options["mask_token_id"] in {tokenizer.bos_token_id, tokenizer.eos_token_id}:
            raise DraftsmithError(
                f"mask_token_id {options['mask_token_id']} is the tokenizer's bos or eos; pick an unused id"
            )
        draft = DFlashDraft(target, layers, ids, options["block_size"], options["mask_token_id"])
        draft.max_anchors, draft.decay = options["max_anchors"], options["decay"]
        draft.requires_grad_(True)
        draft.embed_tokens.requires_grad_(False)
        draft.lm_head.requires_grad_(False)
        return draft.train()

    def teacher_layers(self, draft: DFlashDraft) -> tuple[int, ...]:
        return draft.feature_layers

    def training_forward(self, draft: torch.nn.Module, model: DFlashDraft, batch: Batch) -> Predictions:
        """Anchored blocks at sampled loss rows, each mask scored against the teacher and weighted by
        its block position (the module docstring); eval mode: one mask after every loss row, in order."""
        length = batch.input_ids.shape[1]
        if model.training:
            anchors, valid = sample_anchors(batch.loss_mask, model.max_anchors)
            width = model.block_size
        else:
            anchors, valid = sample_anchors(batch.loss_mask, None)
            width = 2
        hidden = draft(batch.input_ids, batch.attention_mask, batch.teacher_hidden, anchors, width)
        index, teacher_rows, k = block_targets(batch.rows, anchors, valid, length, width)
        logits = model.lm_head(hidden.flatten(0, 2).index_select(0, index))  # (R, V)
        if not model.training:  # one prediction per loss row, in the loss rows' order
            order = torch.empty_like(teacher_rows)
            order[teacher_rows] = torch.arange(len(teacher_rows), device=order.device)
            return Predictions(logits.index_select(0, order))
        weights = torch.exp(-(k - 1).float() / model.decay)
        return Predictions(logits, teacher_rows, weights)

    def save(self, draft: DFlashDraft, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        """The DFlash layout and the tokenizer; ``export`` adds ``write_serving``'s generation config (gamma
        and the tree shape for draftsmith's eval; vLLM takes num_speculative_tokens from its own speculative
        config)."""
        write_layout(draft, folder, state, target_name)
        tokenizer.save_pretrained(folder)

    def files(self) -> tuple[str, ...]:
        return (CONFIG, WEIGHTS, MASK_EMBEDDING)

    def recognises(self, folder: Path) -> bool:
        path = folder / CONFIG
        return path.is_file() and ARCHITECTURE in json.loads(path.read_text()).get("architectures", [])

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
        return load_layout(folder, target).to(device=device, dtype=dtype).eval()

    def architecture(self, folder: Path) -> tuple[str, dict]:
        config = read_layout(folder)
        return "dflash", {key: config[key] for key in ("num_hidden_layers", "hidden_size", "dflash_config")}

    def check_export(self, folder: Path) -> None:
        read_layout(folder)

    def engine_config(self, folder: Path) -> dict:
        return {"method": "dflash", "model": str(folder)}

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        config = read_layout(folder)
        dflash = config["dflash_config"]
        return (
            f"a DFlash draft ({config['num_hidden_layers']} Qwen3 decoder layers) filling a block of masks in one "
            f"forward from the target's outputs of layers {dflash['target_layer_ids']} (mask token "
            f"{dflash['mask_token_id']})"
        )

    def decoding_report(self, target: PreTrainedModel, draft: DFlashDraft, options: DecodeOptions) -> dict:
        return {"target_layer_ids": list(draft.target_layer_ids), "mask_token_id": draft.mask_token_id}


# ---- the layout -------------------------------------------------------------------------------------


def layout_config(draft: DFlashDraft, dtype: torch.dtype, verifier: str) -> dict:
    """``config.json``: the draft's Qwen3 config with DFlash's fields, as z-lab writes them and vLLM reads them."""
    config = {key: value for key, value in draft.config.to_dict().items() if not key.startswith("_")}
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        block_size=draft.block_size,
        num_target_layers=draft.num_target_layers,
        target_hidden_size=draft.config.hidden_size,
        dflash_config={
            "mask_token_id": draft.mask_token_id,
            "target_layer_ids": list(draft.target_layer_ids),
            "causal": False,
        },
        draftsmith={"verifier": verifier, "max_anchors": draft.max_anchors, "decay": draft.decay},
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    return config


def write_layout(draft: DFlashDraft, folder: Path, state: dict | None = None, target_name: str = "") -> None:
    """Write ``draft`` into ``folder`` (``state``: its full state dict when sharded)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = draft.state_dict() if state is None else state
    tensors = {name: value.detach().contiguous().cpu() for name, value in state.items() if name.startswith(SAVED)}
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    mask = {"mask_token_id": draft.mask_token_id, "embedding": state["mask_embedding"].detach().cpu().clone()}
    torch.save(mask, folder / MASK_EMBEDDING)
    config = layout_config(draft, tensors["fc.weight"].dtype, draft.verifier or target_name)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_layout(folder: Path) -> dict:
    """``config.json`` of a DFlash draft in ``folder``, refused (saying why) where vLLM would misread it."""
    path = folder / CONFIG
    config = json.loads(path.read_text())
    dflash = config.get("dflash_config") or {}
    problems = [
        (config.get("architectures") != [ARCHITECTURE], f"architectures is not [{ARCHITECTURE}]"),
        (config.get("model_type") != "qwen3", "model_type is not qwen3 (vLLM's DFlash layers are Qwen3's)"),
        (not isinstance(dflash.get("mask_token_id"), int), "no dflash_config.mask_token_id"),
        (not dflash.get("target_layer_ids"), "no dflash_config.target_layer_ids"),
        (dflash.get("causal") is not False, "dflash_config.causal is not written as false"),
    ]
    wrong = [why for bad, why in problems if bad]
    if wrong:
        raise DraftsmithError(f"{path}: not a DFlash draft vLLM loads: {'; '.join(wrong)}")
    return config


def read_mask_embedding(path: Path) -> dict:
    """``mask_embedding.pt``: {mask_token_id, embedding}, read as tensors and numbers only (``weights_only``):
    a file holding any other pickled object is refused in one line, its code never run."""
    try:
        with warnings.catch_warnings():  # a bare pickle draws a protocol warning before the refusal
            warnings.simplefilter("ignore")
            mask = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise DraftsmithError(
            f"{path} holds pickled objects other than tensors, which draftsmith does not load (they could run "
            "code); publish the draft again, or take the file from its publisher"
        ) from err
    if not (isinstance(mask, dict) and isinstance(mask.get("embedding"), torch.Tensor)):
        raise DraftsmithError(f"{path} is not {{mask_token_id, embedding}}; publish the draft again")
    return mask


def load_layout(folder: Path, target: PreTrainedModel) -> DFlashDraft:
    """The draft saved in ``folder`` for ``target``: every tensor of the layout there, nothing else."""
    config = read_layout(folder)
    dflash = config["dflash_config"]
    if config["num_target_layers"] != target.config.num_hidden_layers:
        raise DraftsmithError(
            f"{folder} reads a target of {config['num_target_layers']} layers; this one has "
            f"{target.config.num_hidden_layers}"
        )
    draft = DFlashDraft(
        target, config["num_hidden_layers"], dflash["target_layer_ids"], config["block_size"], dflash["mask_token_id"]
    )
    own = config.get("draftsmith", {})
    draft.max_anchors, draft.decay = (
        own.get("max_anchors", DEFAULTS["max_anchors"]),
        own.get("decay", DEFAULTS["decay"]),
    )
    draft.verifier = own.get("verifier", draft.verifier)
    tensors = load_file(folder / WEIGHTS, device=str(target.device))
    expected = {name for name in draft.state_dict() if name.startswith(SAVED)}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise DraftsmithError(f"{folder / WEIGHTS}: missing {missing}, unexpected {unexpected}")
    mask = read_mask_embedding(folder / MASK_EMBEDDING)
    if mask["mask_token_id"] != dflash["mask_token_id"]:
        raise DraftsmithError(f"{folder / MASK_EMBEDDING}: its mask_token_id is not dflash_config's")
    tensors["mask_embedding"] = mask["embedding"]
    draft.load_state_dict(tensors, strict=False)
    return draft


KIND = DFlashKind()
