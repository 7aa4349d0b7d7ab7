"""The EAGLE-3 draft kind (Li et al. 2025, EAGLE-3): a one-layer head that drafts from the target's own
hidden states, trained with training-time test, decoded exactly in draftsmith's loop, and served by
vLLM from the ``speculators`` layout.

**The model** (``EagleHead``). The target's hidden states at three layers, low, middle and high, are
concatenated and projected by ``fc`` (3H -> H, no bias): g_p = fc([h_a | h_b | h_c] at position p),
where h_i is the residual stream entering target layer i (transformers' ``hidden_states[i]``, vLLM's
aux layer id i). The ids are vLLM's and speculators' default (2, n//2, n-3), in ascending order (vLLM
concatenates them so); a target of fewer than 7 layers, where those repeat a layer, takes its last
three (n-3, n-2, n-1); ``draft.options: {aux_layers: [a, b, c]}`` sets them. One decoder layer of the
target's architecture follows, whose attention reads ``[input_layernorm(embed(x)) | hidden_norm(g)]``
(2H wide, the embedding first) with its residual stream starting at the un-normed g
(``norm_before_residual: false``); then the final norm and an LM head over the draft vocabulary.
Row p of the head's own sequence pairs g_p with the next token x_{p+1}, sits at position p and
predicts x_{p+2}; its layer output before the final norm is the feature of the next draft step.
The embedding and the head start as copies of the target's and stay frozen unless
``draft.freeze_embeddings: false``.

**Vocabulary.** With ``draft.vocab: N`` the head's vocabulary is the N tokens most frequent in
the training answers plus the EOS ids: exactly the ids the trainer cuts the teacher to
(``Batch.head_ids``), which the head adopts at its first training forward (the ranking is counted
after the draft is built). Its logits over the target's vocabulary are the draft's at those ids and
-inf elsewhere, so q is zero outside the draft vocabulary, as in vLLM's ``compute_logits``. Without
a cut the head covers the whole vocabulary. A saved head stores its rows in ascending id order with
``d2t`` (draft id -> offset to the target id) and ``t2d`` (a mask over the target's vocabulary); a
full-vocabulary head stores neither (vLLM then has no mapping to load them into).

**Training-time test** (``EagleHead.forward``, ``EagleKind.training_forward``). The target's
features (``teacher_layers``) come from the teacher: its forward at each step, or the feature store
(``teacher.cache``), which holds them with the top-k log-probs. The head is unrolled ``ttt_steps``
steps (default 3, as speculators; SpecForge uses 7): step 0 reads the target's features, step j > 0
the head's own layer output of step j-1 at the same place, with the ground-truth tokens shifted by j
and positions advanced by j, as both stacks do. Step j's query at index t attends to step 0's keys
at indices <= t (the causal prefix, the rows built from the target's features) and to its own keys
of steps 1..j at index t (the diagonal): what drafting token j+1 after position t sees. Steps j > 0
run only from the batch's first scored index on: their queries see no other index's keys of steps >
0, so the prompt rows would change no prediction. Step j's prediction at loss row t is compared with
the teacher's distribution at loss row t+j of the same sequence (the target given the true tokens in
between: what verification computes when the drafts were accepted), weighted ``step_decay``^j (0.8,
as SpecForge). With a cut vocabulary, predictions whose teacher argmax lies outside it get weight 0,
as SpecForge masks them (the teacher gives the argmax, ``teacher_argmax``: a store its top entry, so
no head over the target's vocabulary runs per step); the count is written into every checkpoint
(``eagle3_training.json``: loss rows seen by this process's training steps and how many were
masked). Held-out alpha reads step 0.

**Decoding** (``EagleDrafter``). The verifier returns the target's states entering the aux layers at
every row it computed (``TargetVerifier(feature_layers=...)``); after acceptance the fused features
of the committed rows wait until the next proposal, which knows the token that follows each of them.
A proposal reads the waiting rows in one forward (its last row is draft step 0), then drafts one
token per forward on its own layer output. The acceptance rule is unchanged: q is the processed
distribution each token was drawn from, so greedy output is the target's and sampled output is
distributed as the target's. The rows drafted on the head's own features leave its cache right after
the proposal (vLLM recomputes them from the target's features too). Token trees: each node is fed
with its parent's layer output, its children are its top tokens. Batches are ragged, as for any
drafter (the decoder's slot cache).

**Serving**: the speculators EAGLE-3 layout (``config.json`` with ``speculators_model_type: eagle3``
and no top-level ``model_type``; ``model.safetensors`` with ``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, and ``embed_tokens.weight`` only when trained),
served by vLLM as ``{"method": "eagle3", "model": folder}``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Generator, nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftsmith.distill import vocab_cut
from draftsmith.distill.drafts.kind import (
    Batch,
    DraftModel,
    DraftSettings,
    KindBase,
    OwnParameters,
    Predictions,
    Serving,
    refuse_settings,
)
from draftsmith.specdec.drafters import Proposal, draft_chain
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.stream import ModelStream, Verification
from draftsmith.specdec.tree import ROOT, TreeShape, path_to
from draftsmith.specdec.tree_drafting import Tree, add_children, prune
from draftsmith.specdec.verify import TargetVerifier

CONFIG, WEIGHTS = "config.json", "model.safetensors"
TRAINING = "eagle3_training.json"  # in checkpoints: loss rows seen and masked (teacher argmax outside the vocabulary)
OPTIONS = {"aux_layers": list, "ttt_steps": int, "step_decay": float}
DEFAULTS = {"ttt_steps": 3, "step_decay": 0.8}
# The target architectures vLLM 0.32 serves EAGLE-3 heads for (transformer_layer_config.model_type).
MODEL_TYPES = ("llama", "qwen3")
LAYER = "layers.0."  # the decoder layer's names in the file, as vLLM loads them


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and speculators' (2, n//2, n-3); a target under 7 layers, where those repeat, its last three."""
    if num_layers < 3:
        raise DraftsmithError(f"an EAGLE-3 head reads three target layers; this target has {num_layers}")
    low_mid_high = (2, num_layers // 2, num_layers - 3)
    if low_mid_high[0] < low_mid_high[1] < low_mid_high[2]:
        return low_mid_high
    return (num_layers - 3, num_layers - 2, num_layers - 1)


def check_aux_layers(layers, num_layers: int) -> tuple[int, int, int]:
    """Three increasing layer ids in 0..n-1 (``hidden_states[n]`` is the normed output, not a layer's input)."""
    ids = tuple(layers)
    if (
        len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or list(ids) != sorted(set(ids))
        or ids[0] < 0
        or ids[-1] >= num_layers
    ):
        raise DraftsmithError(
            f"aux_layers must be three increasing target layer ids in 0..{num_layers - 1} (vLLM concatenates "
            f"them in ascending order), got {list(layers)}"
        )
    return ids


def check_target(config) -> None:
    if config.model_type not in MODEL_TYPES:
        raise DraftsmithError(
            f"EAGLE-3 heads are built for {' and '.join(MODEL_TYPES)} targets (the architectures vLLM serves them "
            f"for), not {config.model_type}"
        )


def first_layer(layer_class: type[nn.Module], config) -> nn.Module:
    """A fresh decoder layer of the target's class whose q, k and v read 2H (the normed token embedding
    and the normed feature side by side, vLLM's EAGLE-3 layer 0), plus its ``hidden_norm``."""
    layer = layer_class(config, layer_idx=0)
    attention = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        setattr(attention, name, nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None))
    layer.hidden_norm = copy.deepcopy(layer.input_layernorm)  # a fresh norm (weight 1) of the target's kind
    return layer


def ttt_mask(key_ok: torch.Tensor, step: int, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """Step ``step``'s additive attention mask (B, 1, Q, T + step Q) over the keys of steps 0..step.

    key_ok (B, T): step 0's keys that exist (real tokens after the first, which pairs no feature).
    Step 0 has a query at every index (Q = T); a later step only at the indices from ``start`` on
    (Q = T - start), as have its keys. Query t sees step 0's keys at t' <= t and its own keys of
    steps 1..step at t (the diagonal): what drafting step ``step`` after position t sees (Li et al.
    2025). Every query also sees its own step-0 key, so no row is empty (such rows are padding, never scored)."""
    batch, length = key_ok.shape
    index = torch.arange(length, device=key_ok.device)
    queries = index[start:] if step else index  # (Q,)
    first = (index[None, :] <= queries[:, None])[None] & key_ok[:, None, :]  # (B, Q, T)
    first |= (index[None, :] == queries[:, None])[None]
    own = torch.eye(len(queries), dtype=torch.bool, device=key_ok.device)[None].expand(batch, -1, -1)  # (B, Q, Q)
    allowed = torch.cat([first, *[own] * step], -1)  # (B, Q, T + step Q)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=key_ok.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class EagleHead(DraftModel):
    """An EAGLE-3 head for ``target`` (the module docstring). head_weight (R, H): the LM head's rows,
    for the target ids ``row_ids`` (R,); the draft vocabulary is a subset of them (``use_vocabulary``)."""

    described_as = "an EAGLE-3 head"

    def __init__(self, target: PreTrainedModel, aux_layers, head_weight: torch.Tensor, row_ids: torch.Tensor):
        super().__init__()
        check_target(target.config)
        decoder = target.get_decoder()
        hidden = target.config.hidden_size
        self.aux_layers = check_aux_layers(aux_layers, target.config.num_hidden_layers)
        self.config = copy.deepcopy(target.config)
        self.config.num_hidden_layers = 1
        layer_types = self.config.to_dict().get("layer_types")  # only architectures with mixed attention have it
        if layer_types is not None:
            self.config.layer_types = layer_types[:1]
        self.generation_config = copy.deepcopy(target.generation_config)
        self.verifier = {"name_or_path": target.name_or_path, "architectures": [type(target).__name__]}
        self.embed_tokens = copy.deepcopy(decoder.embed_tokens)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([first_layer(type(decoder.layers[0]), self.config)])
        self.norm = copy.deepcopy(decoder.norm)
        self.rotary_emb = copy.deepcopy(decoder.rotary_emb)
        self.lm_head = nn.Linear(hidden, len(row_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head_weight)
        self.to(device=target.device, dtype=target.dtype)
        self.row_ids = row_ids.to(target.device)  # (R,) plain tensors: never in the state dict
        self.vocab: torch.Tensor | None = None  # (N,) the draft vocabulary's target ids, in draft-id order
        self.vocab_rows: torch.Tensor | None = None  # (N,) their rows of lm_head
        self.use_vocabulary(None)
        self.ttt_steps, self.step_decay = DEFAULTS["ttt_steps"], DEFAULTS["step_decay"]
        self.own_embeddings = False  # embedding and head trained (saved), else the target's (frozen, not saved)
        self.masks_outside_vocab = False  # rows whose target argmax lies outside the vocabulary weigh 0
        self.out_of_vocab = {"loss_rows": 0, "masked": 0}  # counted by training forwards

    @classmethod
    def from_target(cls, target: PreTrainedModel, aux_layers) -> EagleHead:
        """An untrained head over the whole vocabulary, its embedding and head copied from the target's."""
        weight = target.get_output_embeddings().weight.detach()
        return cls(target, aux_layers, weight, torch.arange(weight.shape[0]))

    def use_vocabulary(self, ids: torch.Tensor | None) -> None:
        """Draft over the target ids ``ids`` (N,), in that order (the trainer's cut), or over all the
        head's rows (None); a no-op when they are the current ones."""
        ids = self.row_ids if ids is None else ids.to(self.device)
        if self.vocab is not None and (ids is self.vocab or torch.equal(ids, self.vocab)):
            return
        where = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.device)
        where[self.row_ids] = torch.arange(len(self.row_ids), device=self.device)
        rows = where[ids]
        if bool((rows < 0).any()):
            raise DraftsmithError("the draft vocabulary asked for has tokens this EAGLE-3 head has no row for")
        self.vocab, self.vocab_rows = ids, rows

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """fc over the target's states entering the aux layers ({i: (B, Q, H)}, ascending ids) -> (B, Q, H)."""
        return self.fc(torch.cat([hidden[i] for i in self.aux_layers], -1).to(self.dtype))

    def layer_forward(self, tokens, features, positions, mask, cache, **attention) -> torch.Tensor:
        """The decoder layer over tokens (B, Q) paired with features (B, Q, H) at positions (B, Q):
        its output before the final norm (B, Q, H), the next step's feature (vLLM's ``hidden_prenorm``)."""
        layer = self.layers[0]
        embeds = self.embed_tokens(tokens).to(features.dtype)
        both = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], -1)  # (B, Q, 2H)
        rotary = self.rotary_emb(features, position_ids=positions)
        attended, _ = layer.self_attn(
            hidden_states=both, position_embeddings=rotary, attention_mask=mask, cache=cache, **attention
        )
        residual = features + attended  # norm_before_residual false: the residual starts at the feature
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, in ``vocab`` order: (..., H) -> (..., N)."""
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.dtype
        return F.linear(self.norm(hidden), vocab_cut.kept_rows(self.lm_head.weight, self.vocab_rows, dtype))

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (..., V): the draft's at their target ids (d2t), -inf
        elsewhere (vLLM's ``compute_logits``); their softmax is q, zero outside the draft vocabulary."""
        scores = self.draft_logits(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(logits.dim() - 1, self.vocab, scores)

    def forward(self, input_ids, attention_mask, features, anchors: list[torch.Tensor]) -> torch.Tensor:
        """Training-time test (Li et al. 2025): the head unrolled ``len(anchors)`` steps over a batch.

        input_ids, attention_mask (B, T); features (B, T, 3H): the target's states entering the aux
        layers; anchors[j] (R_j,): flat indices into (B, T) where step j's prediction is scored.
        Returns logits over the draft vocabulary (sum_j R_j, N), step 0's first.

        Step 0 runs at every index (its keys are every later step's causal prefix); a later step's
        queries see only their own index's keys of steps >= 1, so steps >= 1 run from the first index
        any of them scores on (the answers' start: no prompt rows), which changes no prediction."""
        batch, length = input_ids.shape
        fused = self.fc(features.to(self.dtype))  # (B, T, H)
        hidden = F.pad(fused, (0, 0, 1, 0))[:, :-1]  # index t holds g_{t-1}: the row that pairs it with x_t
        key_ok = attention_mask.bool().clone()
        key_ok[:, 0] = False  # x_0 follows no feature: no row of the head's sequence
        cache, logits = DynamicCache(), []
        index = torch.arange(length, device=input_ids.device)
        later = torch.cat(anchors[1:]) if len(anchors) > 1 else index[:0]
        start = int((later % length).min()) if len(later) else 0
        for step, rows in enumerate(anchors):
            first = start if step else 0
            if step == 1:
                hidden = hidden[:, start:]
            tokens = F.pad(input_ids[:, step:], (0, step))[:, first:]  # x_{t+step}: ground truth, as both stacks
            positions = (index[first:] + step - 1).clamp(min=0).expand(batch, -1)  # row t-1, one further per step
            mask = ttt_mask(key_ok, step, hidden.dtype, first)
            hidden = self.layer_forward(tokens, hidden, positions, mask, cache)  # the next step's features
            width = length - first
            flat = rows // length * width + rows % length - first  # (R_j,) into (B, width)
            logits.append(self.draft_logits(hidden.flatten(0, 1).index_select(0, flat)))
        return torch.cat(logits)

    def in_vocabulary(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each target token id (M,) lies in the draft vocabulary: (M,) bool (SpecForge masks
        the rows whose target argmax does not)."""
        inside = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.device)
        inside[self.vocab] = True
        return inside[ids.to(self.device)]

    # specdec.drafters.PairedDraft: the target's verifier returns the aux layers' states to the drafter.
    def decoding_pair(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions
    ) -> tuple[TargetVerifier, EagleDrafter]:
        verifier = self.feature_verifier(target, batch_size, capacity, options, self.aux_layers)
        return verifier, EagleDrafter(self, batch_size, capacity)


@dataclass
class Unrolled:
    """Where a training batch's unrolled steps are scored: per step j, the anchors (R_j,) (flat
    indices into (B, T)) and the teacher rows (R_j,) (indices into ``Batch.rows``) they are compared with."""

    anchors: list[torch.Tensor]
    teacher: list[torch.Tensor]


def unroll(rows: torch.Tensor, length: int, steps: int) -> Unrolled:
    """Step j at loss row r (flat index f = b T + t) predicts token t+j+1: it is scored at the loss
    rows whose row f+j is a loss row of the same sequence, against the teacher there.
    rows (M,): the loss rows, ascending; length: T."""
    anchors, teacher = [rows], [torch.arange(len(rows), device=rows.device)]
    for step in range(1, steps):
        ahead = rows + step
        found = torch.searchsorted(rows, ahead).clamp(max=max(len(rows) - 1, 0))
        ok = (rows[found] == ahead) & (rows % length + step < length) if len(rows) else ahead.bool()
        anchors.append(rows[ok])
        teacher.append(found[ok])
    return Unrolled(anchors, teacher)


class FedHead(OwnParameters):
    """The head as ``ModelStream`` runs a causal LM: token ids at positions in; logits over the
    target's vocabulary (B, K, V) and the layer output (``hidden_states[0]``, (B, Q, H)) out. A stream
    passes token ids only, so the features of the rows fed are handed over just before (``features``)."""

    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head
        self.features: torch.Tensor | None = None  # (B, Q, H)

    @property
    def config(self):
        return self.head.config

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask=None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        **attention,
    ) -> CausalLMOutputWithPast:
        features = self.features
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=features,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden = self.head.layer_forward(input_ids, features, position_ids, mask, cache, **attention)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return CausalLMOutputWithPast(logits=self.head.target_logits(kept), hidden_states=(hidden,))


class EagleDrafter:
    """An ``EagleHead`` as drafter (``specdec.drafters.Drafter``), on its own cache.

    The cache holds only rows built from the target's features: row p pairs g_p with x_{p+1}. After
    each verification the fused features of the committed rows wait in ``pending`` (right-aligned,
    ``pending_valid``) until the next proposal, when the token after each is known: those are the last
    ``pending_valid[b].sum()`` committed tokens of sequence b, since the cache's rows plus the pending
    ones always number one less than the committed tokens."""

    takes_guesses = True  # rounds may verify lookup guesses: it takes the committed rows as they come

    def __init__(self, head: EagleHead, batch_size: int, capacity: int):
        self.head = head
        self.feature_layers = head.aux_layers
        self.fed = FedHead(head)
        self.stream = ModelStream(self.fed, batch_size, capacity, "slot")
        hidden = head.config.hidden_size
        self.pending = torch.zeros(batch_size, 0, hidden, dtype=head.dtype, device=head.device)  # (B, W, H)
        self.pending_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=head.device)  # (B, W)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Nothing yet: the head's rows need the target's features of the prompts (``observe``)."""

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """Queue the fused target features of the committed rows ``kept`` (B, Q), in order."""
        features = torch.cat([self.pending, self.head.fuse(verification.hidden)], 1)  # (B, W+Q, H)
        valid = torch.cat([self.pending_valid, kept.to(self.head.device)], 1)
        order = valid.long().sort(dim=1, stable=True).indices  # the unused first, each side in order
        features = features.gather(1, order[..., None].expand_as(features))
        valid = valid.gather(1, order)
        width = int(valid.sum(1).max())
        self.pending, self.pending_valid = features[:, valid.shape[1] - width :], valid[:, valid.shape[1] - width :]

    def _forward(self, tokens, valid, features, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the head over tokens (B, Q) with their features (B, Q, H): (logits (B, K, V),
        layer output (B, Q, H))."""
        self.fed.features = features
        out = self.stream.forward_features(tokens, valid, (0,), logits_to_keep)
        return out.logits, out.hidden[0]

    def _read_pending(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Build the pending rows (one forward): logits after each sequence's last row (B, V) and its
        layer output (B, 1, H). The last row is draft step 0: g_{n-1} with x_n."""
        counts = self.pending_valid.sum(1).tolist()
        tokens = torch.zeros(self.pending_valid.shape, dtype=torch.long)
        for row, (sequence, count) in enumerate(zip(sequences, counts, strict=True)):
            tokens[row, tokens.shape[1] - count :] = torch.tensor(sequence[len(sequence) - count :])
        logits, hidden = self._forward(tokens.to(self.head.device), self.pending_valid, self.pending, 1)
        self.pending, self.pending_valid = self.pending[:, :0], self.pending_valid[:, :0]
        return logits[:, -1], hidden[:, -1:]

    def propose(
        self, sequences: list[list[int]], budget: torch.Tensor, options: DecodeOptions, generator: Generator | None
    ) -> Proposal:
        """Up to ``budget[b]`` tokens per sequence, one head forward per token (``draft_chain``; the first
        also builds the pending rows); sequences that stop early feed padding, so the batch stays dense.
        A round where no sequence drafts (all paused) runs no forward: the pending rows wait, and the
        next proposal builds them all in its first forward."""
        hidden, built = None, None

        def next_logits(token: torch.Tensor | None, active: torch.Tensor) -> torch.Tensor:
            nonlocal hidden, built
            if token is None:
                first, hidden = self._read_pending(sequences)  # (B, V), (B, 1, H)
                built = torch.tensor(self.stream.lengths, device=budget.device)  # rows from the target's features
                return first
            logits, hidden = self._forward(token[:, None], active[:, None], hidden, logits_to_keep=1)
            return logits[:, -1]

        proposal = draft_chain(next_logits, budget, options, generator)
        if built is not None:
            self.stream.rollback(built)  # rows built on the head's own features leave the cache
        return proposal

    def rollback(self, keep: torch.Tensor) -> None:
        """Nothing to drop: the cache holds fewer rows than the committed tokens (see the class docstring)."""
        self.stream.rollback(keep)

    def select(self, rows: torch.Tensor) -> None:
        self.stream.select(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]

    def propose_tree(self, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
        """A token tree after the one sequence: each level is one forward over its nodes, each fed with
        its parent's layer output and seeing the built rows and its ancestors (EAGLE-2's dynamic
        shapes with ``shape.budget``); the fed nodes leave the cache before the tree is returned."""
        tree = Tree()
        if max_depth < 1:
            return tree
        logits, hidden = self._read_pending([sequence])
        tree.steps = 1
        built = self.stream.lengths[0]
        outputs = {ROOT: hidden[0, -1]}  # node -> its layer output (H,), its children's feature
        frontier = [ROOT]
        for depth in range(max_depth):
            level = add_children(tree, frontier, logits, shape.branching[depth])
            if depth + 1 == max_depth:
                break
            frontier = level
            if shape.budget:  # EAGLE-2: grow only below the likeliest frontier nodes
                frontier = sorted(sorted(level, key=lambda i: -tree.path_logprob[i])[: shape.expand])
            logits, level_outputs = self._feed_level(tree, frontier, built, outputs)
            outputs.update(zip(frontier, level_outputs, strict=True))
            tree.steps += 1
        self.stream.keep_slots([])
        if shape.budget:
            prune(tree, shape.budget)
        return tree

    def _feed_level(
        self, tree: Tree, nodes: list[int], built: int, outputs: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``nodes`` (one level): (logits (F, V), layer outputs (F, H)). A node at
        depth d sits at position built - 1 + d, after draft step 0's row."""
        for node in nodes:
            tree.slots[node] = built + len(tree.slots)
        visible = torch.zeros(len(nodes), built + len(tree.slots), dtype=torch.bool)  # (F, S)
        visible[:, :built] = True
        positions = []
        for row, node in enumerate(nodes):
            path = path_to(tree.parents, node)
            visible[row, [tree.slots[n] for n in path]] = True
            positions.append(built - 1 + len(path))
        device = self.head.device
        tokens = torch.tensor([[tree.tokens[n] for n in nodes]], device=device)  # (1, F)
        self.fed.features = torch.stack([outputs[tree.parents[n]] for n in nodes])[None]  # (1, F, H)
        out = self.stream.forward_tree(tokens, torch.tensor([positions], device=device), visible.to(device), (0,))
        return out.logits[0], out.hidden[0][0]

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        """Nothing: the tree's nodes already left the cache; the path's target features come by ``observe``."""


def file_tensors(head: EagleHead, state: dict | None) -> dict[str, torch.Tensor]:
    """The tensors of the speculators EAGLE-3 layout (``state``: the head's full state dict when it is
    sharded): the vocabulary's head rows in ascending id order, with ``d2t`` (int64 offsets) and
    ``t2d`` (bool over the target's vocabulary) unless it is the whole vocabulary; the embedding only
    when it was trained (vLLM shares the target's otherwise)."""
    state = head.state_dict() if state is None else state
    tensors = {name: value for name, value in state.items() if name.startswith(("fc.", LAYER, "norm."))}
    if head.own_embeddings:
        tensors["embed_tokens.weight"] = state["embed_tokens.weight"]
    ids, order = head.vocab.sort()
    tensors["lm_head.weight"] = state["lm_head.weight"].index_select(0, head.vocab_rows[order])
    vocab = head.config.vocab_size
    if not torch.equal(ids, torch.arange(vocab, device=ids.device)):
        tensors["d2t"] = ids - torch.arange(len(ids), device=ids.device)
        t2d = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
        tensors["t2d"] = t2d.index_fill_(0, ids, True)
    return {name: value.detach().contiguous().cpu() for name, value in tensors.items()}


def layout_config(head: EagleHead, gamma: int, dtype: torch.dtype, verifier: dict) -> dict:
    """``config.json`` of the speculators EAGLE-3 layout, as vLLM 0.32 reads it: no top-level
    ``model_type`` (vLLM recognises the format by ``speculators_config``), the layer's config, the
    norms' placement written out (vLLM's default for ``norm_before_residual`` is the opposite of
    speculators'), and ``speculative_tokens`` = ``gamma``."""
    layer = {key: value for key, value in head.config.to_dict().items() if not key.startswith("_")}
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, architectures=verifier["architectures"])
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": len(head.vocab),
        "target_hidden_size": head.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": gamma,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": verifier,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_layout(head: EagleHead, folder: Path, gamma: int, state: dict | None = None, target_name: str = "") -> None:
    """Write ``head`` into ``folder`` in the speculators EAGLE-3 layout (``config.json``, ``model.safetensors``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = file_tensors(head, state)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    verifier = {**head.verifier, "name_or_path": head.verifier["name_or_path"] or target_name}
    if not verifier["name_or_path"]:
        raise DraftsmithError("the layout names the head's target (verifier.name_or_path), and this head's has no name")
    config = layout_config(head, gamma, tensors["fc.weight"].dtype, verifier)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_layout(folder: Path) -> dict:
    """``config.json`` of a head in ``folder``, refused (saying why) where vLLM would refuse it: the
    fields ``SpeculatorsConfig.validate_speculators_config`` and the eagle3 config updater read."""
    path = folder / CONFIG
    config = json.loads(path.read_text())
    try:
        method = config["speculators_config"]["proposal_methods"][0]
        gamma, verifier = method["speculative_tokens"], config["speculators_config"]["verifier"]["name_or_path"]
        layer_type = config["transformer_layer_config"]["model_type"]
        aux = config["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, IndexError, TypeError) as err:
        raise DraftsmithError(f"{path}: not a speculators EAGLE-3 config (missing {err})") from err
    problems = [
        ("model_type" in config, "a top-level model_type (vLLM would read a plain model)"),
        (config.get("speculators_model_type") != "eagle3", "speculators_model_type is not eagle3"),
        (layer_type not in MODEL_TYPES, f"transformer_layer_config.model_type {layer_type!r} (vLLM: llama, qwen3)"),
        (not (isinstance(gamma, int) and gamma >= 1), f"speculative_tokens {gamma!r} (an integer >= 1)"),
        (not verifier, "no verifier name_or_path"),
        (config.get("norm_before_residual") is not False, "norm_before_residual is not written as false"),
        (len(aux) != 3 or aux != sorted(set(aux)), f"aux layer ids {aux} (three, increasing)"),
    ]
    wrong = [why for bad, why in problems if bad]
    if wrong:
        raise DraftsmithError(f"{path}: {'; '.join(wrong)}")
    return config


def check_head_target(folder: Path, config: dict, width: int, target_config) -> None:
    """Refuse a head trained for another target: it reads three of its target's layers, ``width`` wide."""
    layers, hidden = target_config.num_hidden_layers, target_config.hidden_size
    if width != hidden or max(config["eagle_aux_hidden_state_layer_ids"]) >= layers:
        trained_for = config["speculators_config"]["verifier"]["name_or_path"]
        raise DraftsmithError(
            f"{folder} is an EAGLE-3 head for the target {trained_for} (hidden size {width}), not for this one "
            f"(hidden size {hidden}, {layers} layers): evaluate it with its own target, or train a head for this one"
        )


def load_head(folder: Path, target: PreTrainedModel) -> EagleHead:
    """The head saved in ``folder`` (the speculators layout), for ``target``; every tensor the layout
    needs must be there and nothing else (vLLM refuses unknown names and silently keeps missing ones)."""
    config = read_layout(folder)
    tensors = load_file(folder / WEIGHTS, device=str(target.device))
    if "fc.weight" in tensors:  # (H_draft, 3 H_target)
        check_head_target(folder, config, tensors["fc.weight"].shape[1] // 3, target.config)
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    head_weight = tensors.pop("lm_head.weight")
    rows = torch.arange(len(head_weight), device=head_weight.device)
    if d2t is not None:
        rows = rows + d2t
        if t2d is None or int(t2d.sum()) != len(rows) or not bool(t2d[rows].all()):
            raise DraftsmithError(f"{folder / WEIGHTS}: t2d does not mark exactly the ids d2t gives")
    head = EagleHead(target, config["eagle_aux_hidden_state_layer_ids"], head_weight, rows)
    head.verifier = config["speculators_config"]["verifier"]
    embeddings = tensors.pop("embed_tokens.weight", None)
    head.own_embeddings = embeddings is not None
    if embeddings is not None:
        tensors["embed_tokens.weight"] = embeddings
    expected = {name for name in head.state_dict() if name != "lm_head.weight"} - (
        set() if head.own_embeddings else {"embed_tokens.weight"}
    )
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise DraftsmithError(f"{folder / WEIGHTS}: missing {missing}, unexpected {unexpected}")
    head.load_state_dict(tensors, strict=False)
    return head


class EagleKind(KindBase):
    """EAGLE-3 heads (``draft.kind: eagle3``). draft.options: ``aux_layers`` (three target layer ids,
    default (2, n//2, n-3)), ``ttt_steps`` (steps unrolled in training, default 3), ``step_decay``
    (step j's loss weight step_decay^j, default 0.8). ``draft.vocab: N``: the head's vocabulary
    is the N most frequent answer tokens plus EOS; ``draft.freeze_embeddings: false`` trains its embedding
    and head too. ``draft.init`` and ``draft.layers`` (the standalone LM's) do not apply."""

    name = "eagle3"
    model_class = EagleHead
    option_types = OPTIONS
    standalone = False  # it reads the target's hidden states: transformers cannot run it as an assistant
    cuts_head = False  # its vocabulary is its own (d2t); the generic cut head (draft_vocab) never wraps it

    def check(self, settings: DraftSettings) -> None:
        super().check(settings)
        refused = ("draft.lora_r", "draft.config", "draft.model")
        refuse_settings(self.name, settings, refused, "are one decoder layer built on the target")
        if settings.loss == "accepted_length":
            raise DraftsmithError(
                "eagle3 drafts score several unrolled steps per position, and accepted_length's windows assume one "
                "prediction per position: use forward_kl, tvd, reverse_kl or jsd"
            )
        if settings.options.get("ttt_steps", DEFAULTS["ttt_steps"]) < 1:
            raise DraftsmithError("draft.options: ttt_steps must be >= 1")
        if not 0 < settings.options.get("step_decay", DEFAULTS["step_decay"]) <= 1:
            raise DraftsmithError("draft.options: step_decay must be in (0, 1]")

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> EagleHead:
        check_target(target.config)
        layers = target.config.num_hidden_layers
        head = EagleHead.from_target(target, settings.options.get("aux_layers") or default_aux_layers(layers))
        head.ttt_steps = settings.options.get("ttt_steps", DEFAULTS["ttt_steps"])
        head.step_decay = settings.options.get("step_decay", DEFAULTS["step_decay"])
        head.own_embeddings = not settings.freeze_embeddings
        head.requires_grad_(True)
        head.embed_tokens.requires_grad_(head.own_embeddings)
        head.lm_head.requires_grad_(head.own_embeddings)
        head.masks_outside_vocab = bool(settings.train_draft_vocab)  # rows whose target argmax falls outside the cut
        return head.train()

    def teacher_layers(self, draft: EagleHead) -> tuple[int, ...]:
        """The aux layers."""
        return draft.aux_layers

    def teacher_argmax(self, draft: EagleHead) -> bool:
        """With a cut vocabulary: rows whose target argmax lies outside it are masked."""
        return draft.masks_outside_vocab

    def training_forward(self, draft: torch.nn.Module, model: EagleHead, batch: Batch) -> Predictions:
        """Training-time test at the loss rows (the module docstring); eval mode: step 0 only (held-out alpha)."""
        model.use_vocabulary(batch.head_ids)
        plan = unroll(batch.rows, batch.input_ids.shape[1], model.ttt_steps if model.training else 1)
        features = torch.cat([batch.teacher_hidden[i] for i in model.aux_layers], -1)  # (B, T, 3H)
        logits = draft(batch.input_ids, batch.attention_mask, features, plan.anchors)  # (R, N)
        if not model.training:
            return Predictions(logits)
        teacher_rows = torch.cat(plan.teacher)  # (R,)
        weights = torch.cat(
            [torch.full((len(a),), model.step_decay**j, device=logits.device) for j, a in enumerate(plan.anchors)]
        )
        if batch.head_ids is not None and model.masks_outside_vocab:
            if batch.teacher_argmax is None:
                raise DraftsmithError("a cut EAGLE-3 head reads the target's argmax at the loss rows (teacher_argmax)")
            inside = model.in_vocabulary(batch.teacher_argmax)  # (M,)
            weights = weights * inside[teacher_rows]
            model.out_of_vocab["loss_rows"] += len(inside)
            model.out_of_vocab["masked"] += int((~inside).sum())
        return Predictions(logits, teacher_rows, weights)

    def save(self, draft: EagleHead, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        """The speculators layout proposing ``ttt_steps`` tokens (the steps it trained; publish writes
        the measured gamma), and the out-of-vocabulary count of its training (``TRAINING``)."""
        write_layout(draft, folder, draft.ttt_steps, state, target_name)
        counts = {**draft.out_of_vocab, "draft_vocab_size": len(draft.vocab)}
        (folder / TRAINING).write_text(json.dumps(counts) + "\n")
        tokenizer.save_pretrained(folder)

    def files(self) -> tuple[str, ...]:
        return (CONFIG, WEIGHTS)

    def recognises(self, folder: Path) -> bool:
        path = folder / CONFIG
        return path.is_file() and json.loads(path.read_text()).get("speculators_model_type") == "eagle3"

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> EagleHead:
        return load_head(folder, target).to(device=device, dtype=dtype).eval()

    def architecture(self, folder: Path) -> tuple[str, dict]:
        config = read_layout(folder)
        return "eagle3", {key: config[key] for key in ("transformer_layer_config", "draft_vocab_size")}

    def check_export(self, folder: Path) -> None:
        read_layout(folder)

    def export(self, draft: EagleHead, tokenizer, folder: Path, serving: Serving) -> None:
        """The speculators layout proposing ``serving.gamma`` tokens (what vLLM reads), and
        ``write_serving``'s generation config (gamma and the tree shape for draftsmith's eval)."""
        write_layout(draft, folder, serving.gamma)
        self.write_serving(draft, folder, serving)
        tokenizer.save_pretrained(folder)

    def engine_config(self, folder: Path) -> dict:
        return {"method": "eagle3", "model": str(folder)}

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        config = read_layout(folder)
        return (
            f"an EAGLE-3 head (one decoder layer in the speculators layout) reading the target's hidden states "
            f"entering layers {config['eagle_aux_hidden_state_layer_ids']}, drafting over "
            f"{config['draft_vocab_size']} tokens"
        )

    def decoding_report(self, target: PreTrainedModel, draft: EagleHead, options: DecodeOptions) -> dict:
        return {"aux_layers": list(draft.aux_layers), "draft_vocab_size": len(draft.vocab)}


KIND = EagleKind()
