"""The parallel draft kind (PARD, An et al. 2025): a standalone draft LM that proposes K tokens in ONE forward.

A standalone draft LM (built as ``lm.py`` builds one: truncated target, new config, pretrained)
plus a mask token: an id of the target's vocabulary that the data never uses (vLLM requires the
draft's vocabulary to be the target's, so no row is added; where the data does use it, a real
occurrence looks like a mask to the draft: decoding stays exact, acceptance suffers). Fed
``[x_1 .. x_n, m_1 .. m_{K-1}]``, the draft's output at x_n is its ordinary next-token
distribution q_1, and its output at mask m_j is q_{j+1}: its guess for the token j places further
on, without the tokens in between. Drafting K tokens then costs one draft forward over a few more
rows instead of K forwards.

**Decoding** (``ParallelDrafter``). Each round is ONE draft forward over the committed tokens the
draft has not read (the last round's accepted drafts and the target's token after them) followed by
K-1 masks, at consecutive positions. The K proposals are drawn from the K output rows: the argmax,
or a sample from the processed q_j (temperature, top-k, top-p), and q_j is what the acceptance rule
gets. The acceptance rule is unchanged, so the output is the target's exactly: speculative
sampling needs d_j drawn from the q_j it reports, whatever q_j is conditioned on, and here q_j sees
x_1..x_n only. Right after the forward the masks' keys and values are cropped from the draft's
cache (``ModelStream.rollback`` to the committed length): the decoder's own rollback after
acceptance would keep the first ``a`` of them, in the places where the accepted drafts belong. So
the draft's cache lags the committed text by the accepted drafts plus the target's token, which it
reads at the start of the next round (as vLLM's proposer does, which overwrites the masks' slots).
Dynamic gamma cuts each sequence's chain after its first position whose ``max q_j`` is below the
threshold. A token tree's level j is the top-k of q_j: every node of a level gets the same
candidates, whatever its parent (deterministic candidates, so the tree acceptance stays exact).

**Training** (``training_forward``). Each training sequence is extended with mask chains as in
PARD: the chain anchored at a loss row t is masks at positions t+1 .. t+b, each seeing the real
tokens x_0..x_t and the earlier masks of its own chain (a 4-D attention mask; the real tokens see
only real tokens, so their predictions are the ordinary next-token ones). Mask b of that chain
predicts x_{t+b+1}, compared with the teacher's distribution at loss row t+b, i.e. with the
target's distribution given the true x_{t+1..t+b}: what verification computes when d_1..d_b were
accepted. PARD's conditional drop (COD) keeps, per sequence, ``max(cod_ratio^b, cod_min)`` times
its loss rows as chain step b, chosen at random among the chains kept at step b-1 (a mask needs its
chain's earlier masks): with K = 6 and 0.7 / 0.2 that is about 2.97 inputs per loss row instead of 6.

How the mask rows are weighted (``chain_weights``):

- ``equal`` (PARD, An et al. 2025, and its training code): every kept mask row counts as much as an
  ordinary prediction; conditional drop alone thins the deep steps.
- ``target`` (PARD-2's token weights, with a floor added): step b of the chain at t weighs
  ``prod_{s<b} p(x_{t+s+1})``, the target's probability of the true tokens the chain's earlier steps
  stand for (how often decoding reaches that step with a draft that guesses what the target says),
  but at least ``weight_floor``. It does not depend on the draft, so a step the draft cannot guess
  yet still learns.
- ``draft``: the product of the draft's *current* acceptance ``sum_x min(p, q)`` at the earlier steps
  (detached) over the chance COD kept the row (the expected accepted length of a round), at least
  ``weight_floor``. Without a floor it locks itself in: untrained masks accept little, so the steps
  after them get almost no weight and stay untrained.

The teacher's p there is renormalized over the head's columns (with a cut head, a true token outside
it has p 0 and its chain the floor). Held-out alpha reads the ordinary predictions (in eval mode no
chains are built); ``position_acceptance`` measures every chain step.

The mask token's input embedding learns even when ``draft.freeze_embeddings`` keeps the others (and a tied
head) fixed: the draft holds it as a separate row (``ParallelDraft.mask_row``) that replaces the
embedding at mask positions, and writes it into the embedding matrix when saved, so that a saved
folder is a plain model.

**Serving**: a plain model folder whose ``config.json`` also has ``pard_token`` and
``mask_token_id`` (vLLM reads either), served by vLLM as ``draft.model`` with
``parallel_drafting: true``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill import vocab_cut
from draftsmith.distill.drafts import lm
from draftsmith.distill.drafts.kind import (
    Batch,
    DraftModel,
    DraftSettings,
    KindBase,
    Predictions,
    Serving,
    TargetParts,
    refuse_settings,
    transformers_usage,
    vllm_usage,
)
from draftsmith.distill.drafts.one_forward import OneForwardDrafter
from draftsmith.distill.losses import row_acceptance
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.compiled import make_stream, resolve_compile
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.stream import Verification
from draftsmith.specdec.verify import TargetVerifier

# draft.options: the mask token (required), the chain length trained, PARD's conditional drop, how the
# mask rows are weighted (module docstring) and the weights' floor
OPTIONS = {
    "mask_token_id": int,
    "k": int,
    "cod_ratio": float,
    "cod_min": float,
    "chain_weights": str,
    "weight_floor": float,
}
DEFAULTS = {"k": 6, "cod_ratio": 0.7, "cod_min": 0.2, "chain_weights": "equal", "weight_floor": 0.1}
CHAIN_WEIGHTS = ("equal", "target", "draft")
CONFIG_KEYS = ("pard_token", "mask_token_id")  # vLLM reads either; PARD's own code writes pard_token


@dataclass(frozen=True)
class ChainSettings:
    """How a parallel draft trains: chains of ``k`` predictions (the ordinary one and k-1 masks),
    PARD's conditional drop keeping ``max(cod_ratio^b, cod_min)`` of the loss rows as chain step b,
    and the mask rows' weights (``chain_weights``, ``weight_floor``: module docstring)."""

    k: int = DEFAULTS["k"]
    cod_ratio: float = DEFAULTS["cod_ratio"]
    cod_min: float = DEFAULTS["cod_min"]
    chain_weights: str = DEFAULTS["chain_weights"]
    weight_floor: float = DEFAULTS["weight_floor"]


class ParallelDraft(DraftModel):
    """A causal LM (``lm``) that drafts K tokens per forward with ``mask_token_id`` (PARD).

    Its forward is the LM's (training calls it through accelerate's wrapper); it decodes with its
    own (verifier, drafter) pair (``specdec.drafters.PairedDraft``), with its head cut to
    ``head_ids`` when given (``specdec.draft_vocab``: the cut it trained with)."""

    def __init__(
        self,
        model: PreTrainedModel,
        mask_token_id: int,
        chains: ChainSettings = ChainSettings(),
        head_ids: list[int] | None = None,
        train_mask_row: bool = False,
    ):
        super().__init__()
        vocab = model.config.vocab_size
        if not 0 <= mask_token_id < vocab:
            raise DraftsmithError(f"mask_token_id must be a vocabulary id (0..{vocab - 1}), got {mask_token_id}")
        self.lm = model
        self.chains = chains
        self.head_ids = head_ids
        for key in CONFIG_KEYS:  # saved in config.json, where vLLM looks for it
            setattr(model.config, key, mask_token_id)
        # (H,) the mask's trainable embedding beside a frozen embedding matrix (None: the matrix holds it)
        self.mask_row: nn.Parameter | None = None
        if train_mask_row:
            embedding = model.get_input_embeddings()
            self.mask_row = nn.Parameter(embedding.weight[mask_token_id].detach().clone())
            embedding.register_forward_hook(self.with_mask_row)

    def with_mask_row(self, embedding: nn.Module, args: tuple, embedded: torch.Tensor) -> torch.Tensor:
        """The embedding's output (B, T, H) with ``mask_row`` at the mask tokens of its input ids (B, T)."""
        at_mask = (args[0] == self.mask_token_id)[..., None]
        return torch.where(at_mask, self.mask_row.to(embedded.dtype), embedded)

    @torch.no_grad()
    def merge_mask_row(self) -> None:
        """Write the trained ``mask_row`` into the embedding matrix (and so into a tied head), as saved."""
        if self.mask_row is not None:
            self.lm.get_input_embeddings().weight[self.mask_token_id] = self.mask_row

    @property
    def mask_token_id(self) -> int:
        return self.lm.config.pard_token

    @property
    def config(self):
        return self.lm.config

    @property
    def generation_config(self):
        return self.lm.generation_config

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm.set_output_embeddings(head)

    def get_decoder(self) -> nn.Module:
        return self.lm.get_decoder()

    def forward(self, **inputs):
        return self.lm(**inputs)

    # specdec.drafters.PairedDraft
    def decoding_pair(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions
    ) -> tuple[TargetVerifier, ParallelDrafter]:
        """The whole target on its cache (as for a standalone LM) and the parallel drafter on the
        draft's; the draft's cache holds up to gamma - 1 masks more for the length of a forward."""
        compiled = self.decodes_compiled(target, options)
        verifier = TargetVerifier.for_options(target, batch_size, capacity, options, compiled)
        cache_kind = options.cache_kind or default_cache_kind(target.device)
        masks = options.gamma if options.tree is None else options.tree.depth
        model = self.decoding_model()
        stream = make_stream(model, batch_size, capacity + masks, cache_kind, role="draft", compiled=compiled)
        return verifier, ParallelDrafter(stream, self.mask_token_id)

    def round_forwards(self, gamma: int) -> int:
        """One draft forward drafts a whole round, whatever its gamma (``specdec.drafters.round_forwards``)."""
        return 1

    def decoding_model(self) -> nn.Module:
        """The causal LM the drafter runs: the LM, or the LM with its head cut to ``head_ids``."""
        return self.lm if self.head_ids is None else draft_vocab.SubsetHeadDraft(self.lm, self.head_ids)

    def decodes_compiled(self, target: PreTrainedModel, options: DecodeOptions) -> bool:
        return options.tree is None and resolve_compile(options.compile, target)


class ParallelDrafter(OneForwardDrafter):
    """A ``ParallelDraft`` as drafter (``specdec.drafters.Drafter``) on its own cache (``stream``).

    Its cache holds the committed tokens it has read, never a mask: each round reads the unread
    committed tokens and K-1 masks in one forward, then crops the masks again (``round_logits``)."""

    feature_layers: tuple[int, ...] = ()  # it reads nothing of the target's

    def __init__(self, stream, mask_token_id: int):
        self.stream = stream  # a specdec.stream.ModelStream (compiled.CompiledStream when compiled)
        self.mask = mask_token_id

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self.stream.forward(tokens, valid, logits_to_keep=1)

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """Nothing: a standalone LM reads only the committed tokens."""

    def round_logits(self, sequences: list[list[int]], reading: torch.Tensor, width: int) -> torch.Tensor:
        """ONE draft forward over each reading sequence's unread committed tokens and ``width - 1``
        masks; logits (B, width, V): row 0 after x_n, row j after mask j. The masks leave the cache
        before returning, so it holds exactly the committed tokens read so far. reading (B,) bool:
        sequences that draft this round (the others feed padding and read nothing)."""
        pending = [seq[length:] for seq, length in zip(sequences, self.stream.lengths, strict=True)]
        unread = max(len(p) for p in pending)
        tokens = torch.full((len(pending), unread + width - 1), self.mask, dtype=torch.long)
        valid = torch.zeros(tokens.shape, dtype=torch.bool)
        for row, (todo, drafts) in enumerate(zip(pending, reading.tolist(), strict=True)):
            tokens[row, unread - len(todo) : unread] = torch.tensor(todo, dtype=torch.long)
            valid[row, unread - len(todo) :] = drafts  # left-padded: every row's masks in the same columns
        device = self.stream.device
        logits = self.stream.forward(tokens.to(device), valid.to(device), logits_to_keep=width)  # (B, width, V)
        self.stream.rollback(torch.tensor([len(seq) for seq in sequences], device=device))  # crop the masks
        return logits

    def rollback(self, keep: torch.Tensor) -> None:
        """The cache holds only committed tokens, so nothing is dropped unless ``keep`` asks for it."""
        self.stream.rollback(keep)

    def select(self, rows: torch.Tensor) -> None:
        self.stream.select(rows)


# ---- Training: mask chains (PARD), conditional drop, expected-accepted-length weights ---------------


def loss_runs(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): how many consecutive loss rows start at each position (0 off the loss rows)."""
    flipped = loss_mask.flip(1).long()
    total = flipped.cumsum(1)
    before_gap = torch.where(flipped == 0, total, 0).cummax(1).values
    return (total - before_gap).flip(1)


def cod_depths(
    loss_mask: torch.Tensor, k: int, ratio: float, floor: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PARD's conditional drop: how deep a mask chain each loss row anchors, and the chance of each step.

    Step b of the chain anchored at loss row t predicts x_{t+b+1} against the teacher at row t+b, so
    it needs loss rows t..t+b. Per sequence, ``round(max(ratio^b, floor) * M)`` of its M loss rows
    (at most all that qualify) are drawn among the chains kept at step b-1. Returns depth (B, T):
    the deepest step kept (0: the ordinary prediction only, -1: not a loss row), and inclusion (B, k):
    the probability that a chain that qualifies for step b is kept there (column 0: 1)."""
    runs = loss_runs(loss_mask)
    depth = torch.where(loss_mask, 0, -1)
    inclusion = torch.ones(loss_mask.shape[0], k, dtype=torch.float64)
    rows = loss_mask.sum(1).tolist()
    for step in range(1, k):
        share = max(ratio**step, floor)
        qualified = (depth == step - 1) & (runs >= step + 1)  # (B, T)
        for row in range(loss_mask.shape[0]):
            candidates = qualified[row].nonzero()[:, 0]
            keep = min(len(candidates), round(share * rows[row]))
            if keep:
                order = torch.randperm(len(candidates), generator=generator)[:keep].to(candidates.device)
                depth[row, candidates[order]] = step
            inclusion[row, step] = inclusion[row, step - 1] * (keep / len(candidates) if len(candidates) else 0.0)
    return depth, inclusion


@dataclass
class Chains:
    """A training batch (B, T) extended with mask chains to (B, W), and where each prediction is read.

    input_ids, positions: (B, W); attention: (B, 1, W, W) bool, True where a query may look.
    rows: (M + E,) flat indices into (B, W) of the predictions: the M loss rows first, in order, then
    the E masks. anchor, step: (E,) the flat (B, T) index of each mask's chain anchor, and its step b."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: torch.Tensor
    rows: torch.Tensor
    anchor: torch.Tensor
    step: torch.Tensor


def chain_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor, depth: torch.Tensor, mask_id: int
) -> Chains:
    """Append, after each sequence's T inputs, one mask per kept chain step (``cod_depths``): mask b
    of the chain anchored at t sits at position t+b and sees x_0..x_t and its chain's masks 1..b.
    Real inputs see the real inputs before them, as in a plain causal forward; padding sees itself."""
    batch, length = input_ids.shape
    device = input_ids.device
    steps = torch.arange(1, int(depth.max()) + 1, device=device)
    present = depth[:, :, None] >= steps  # (B, T, S)
    row, anchor, index = present.nonzero(as_tuple=True)  # row-major: grouped by sequence
    step = index + 1
    per_row = present.flatten(1).sum(1)  # (B,)
    column = length + torch.arange(len(row), device=device) - (per_row.cumsum(0) - per_row)[row]
    width = length + int(per_row.max()) if len(row) else length

    ids = torch.full((batch, width), mask_id, dtype=torch.long, device=device)
    ids[:, :length] = input_ids
    positions = torch.zeros(batch, width, dtype=torch.long, device=device)
    positions[:, :length] = torch.arange(length, device=device)
    positions[row, column] = anchor + step
    anchors = torch.full((batch, width), -2, dtype=torch.long, device=device)  # -2: padding after the chains
    anchors[:, :length] = torch.arange(length, device=device)
    anchors[row, column] = anchor
    steps_at = torch.full((batch, width), -1, dtype=torch.long, device=device)
    steps_at[:, :length] = 0
    steps_at[row, column] = step
    real = torch.zeros(batch, width, dtype=torch.bool, device=device)
    real[:, :length] = attention_mask.bool()

    keys = torch.arange(width, device=device)
    sees_context = real[:, None, :] & (keys[None, None, :] <= anchors[:, :, None])  # (B, W, W)
    same_chain = (anchors[:, None, :] == anchors[:, :, None]) & (steps_at[:, None, :] >= 1)
    sees_chain = same_chain & (steps_at[:, None, :] <= steps_at[:, :, None])
    attention = sees_context | sees_chain | torch.eye(width, dtype=torch.bool, device=device)
    ordinary = (rows // length) * width + rows % length
    return Chains(
        input_ids=ids,
        positions=positions,
        attention=attention[:, None],
        rows=torch.cat([ordinary, row * width + column]),
        anchor=row * length + anchor,
        step=step,
    )


@torch.no_grad()
def acceptance(logits: torch.Tensor, teacher_log_probs: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``sum_x min(p, q)`` per row, p renormalized over the columns: (R, n) x2 -> (R,) float32, in
    chunks of rows (no second (R, n) tensor beside the loss's)."""
    parts = []
    for start in range(0, len(logits), chunk):
        q = logits[start : start + chunk].float().softmax(-1)
        p = teacher_log_probs[start : start + chunk].float().softmax(-1)
        parts.append(torch.minimum(p, q).sum(-1))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def draft_weights(
    alpha: torch.Tensor, rows: torch.Tensor, chains: Chains, inclusion: torch.Tensor, cells: int, k: int, floor: float
) -> torch.Tensor:
    """``chain_weights: draft``, each mask's weight (E,): the product of its chain's current acceptance
    at steps 0..b-1 (``alpha`` (M + E,): the loss rows' ordinary predictions, then the masks), at
    least ``floor``, over the chance COD kept it. rows (M,) flat (B, T) loss rows; cells = B * T;
    inclusion (B, k) from ``cod_depths``."""
    table = torch.zeros(cells, k, dtype=torch.float64, device=alpha.device)  # [anchor, step] -> alpha
    table[rows, 0] = alpha[: len(rows)].double()
    table[chains.anchor, chains.step] = alpha[len(rows) :].double()
    reached = table.cumprod(1)[chains.anchor, chains.step - 1]  # (E,) P(steps 0..b-1 all accepted)
    length = cells // inclusion.shape[0]
    kept = inclusion.to(alpha.device)[chains.anchor // length, chains.step]
    return (reached.clamp(min=floor) / kept).to(alpha.dtype)


def target_weights(gold: torch.Tensor, rows: torch.Tensor, chains: Chains, cells: int, k: int, floor: float):
    """``chain_weights: target`` (PARD-2), each mask's weight (E,): the product of the target's
    probability ``gold`` (M,) of the true next token at loss rows t..t+b-1 (the tokens its chain's
    earlier steps stand for), at least ``floor``. rows (M,) flat (B, T) loss rows; cells = B * T."""
    at = torch.zeros(cells, dtype=torch.float64, device=gold.device)
    at[rows] = gold.double()
    ahead = torch.stack([at.roll(-s) for s in range(k - 1)], 1)  # (cells, k-1): [t, s] -> p(x_{t+s+1})
    reached = ahead.cumprod(1)[chains.anchor, chains.step - 1]  # (E,) a mask's steps are loss rows: no wrap
    return reached.clamp(min=floor).float()


def gold_probs(batch: Batch, vocab_size: int) -> torch.Tensor:
    """(M,) the teacher's probability of the true next token at each loss row, over the head's columns
    (0 for a token a cut head lacks)."""
    tokens = batch.input_ids.roll(-1, dims=1).flatten().index_select(0, batch.rows)  # (M,)
    if batch.head_ids is not None:
        tokens = vocab_cut.subset_labels(tokens, batch.head_ids, vocab_size)
    log_p = batch.teacher_log_probs.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    return torch.where(tokens >= 0, log_p.float().exp(), 0.0)


def mask_weights(
    settings: ChainSettings,
    logits: torch.Tensor,
    chains: Chains,
    teacher_rows: torch.Tensor,
    inclusion: torch.Tensor,
    batch: Batch,
    vocab_size: int,
) -> torch.Tensor:
    """The loss weight (E,) float32 of each mask row by ``settings.chain_weights`` (module docstring):
    logits (M + E, n) and teacher_rows (M + E,) from ``chain_predictions``, inclusion (B, k) from
    ``cod_depths``."""
    if settings.chain_weights == "equal":
        return torch.ones(len(chains.step), device=logits.device)
    if batch.teacher_log_probs is None:
        raise DraftsmithError("parallel drafts weight their chains by the teacher's log-probs at the loss rows")
    cells = batch.input_ids.numel()
    if settings.chain_weights == "target":
        gold = gold_probs(batch, vocab_size)
        return target_weights(gold, batch.rows, chains, cells, settings.k, settings.weight_floor)
    alpha = acceptance(logits.detach(), batch.teacher_log_probs.index_select(0, teacher_rows))
    return draft_weights(alpha, batch.rows, chains, inclusion, cells, settings.k, settings.weight_floor).float()


def chain_predictions(
    draft: nn.Module, model: nn.Module, batch: Batch, depth: torch.Tensor, mask_id: int
) -> tuple[torch.Tensor, Chains, torch.Tensor]:
    """One forward of ``draft`` over the batch extended with its mask chains (``depth``): logits
    (M + E, n) at the loss rows and the masks, the layout, and teacher_rows (M + E,) into ``batch.rows``."""
    chains = chain_layout(batch.input_ids, batch.attention_mask, batch.rows, depth, mask_id)
    with vocab_cut.loss_rows_head(model, chains.rows, batch.head_ids):
        logits = draft(
            input_ids=chains.input_ids,
            attention_mask=chains.attention,
            position_ids=chains.positions,
            use_cache=False,
        ).logits
    order = torch.arange(len(batch.rows), device=batch.rows.device)
    where = torch.full((batch.input_ids.numel(),), -1, dtype=torch.long, device=batch.rows.device)
    where[batch.rows] = order  # flat (B, T) -> its index among the loss rows
    teacher_rows = torch.cat([order, where[chains.anchor + chains.step]])
    return logits, chains, teacher_rows


@torch.no_grad()
def position_acceptance(draft: ParallelDraft, target: PreTrainedModel, batch: dict, k: int) -> torch.Tensor:
    """Mean acceptance ``sum_x min(p, q)`` of every chain step 0..k-1 (k,) over a batch (input_ids,
    attention_mask, loss_mask (B, T)) of the target's answers: step j of the chain at each loss row
    (every chain that fits, none dropped) against the target's distribution given the true tokens,
    with the draft's head as it decodes (cut to ``draft.head_ids`` when it is)."""
    rows = vocab_cut.loss_rows(batch["loss_mask"])
    ids = None if draft.head_ids is None else torch.tensor(draft.head_ids, device=rows.device)
    hidden = vocab_cut.target_rows(target, batch, rows).hidden
    teacher = vocab_cut.head_log_probs(target, hidden, ids)  # (M, N or V), normalized over all V
    logits, teacher_rows, steps = every_chain(draft, batch, rows, ids, k)
    alpha = row_acceptance(logits, teacher.index_select(0, teacher_rows))  # exact: p outside the cut counts
    return torch.stack([alpha[steps == j].mean() for j in range(k)])


def every_chain(
    draft: ParallelDraft, batch: dict, rows: torch.Tensor, ids: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's predictions at every chain step 0..k-1 of every loss row ``rows`` (M,) of a batch
    (input_ids, attention_mask, loss_mask (B, T)), every chain that fits, none dropped, with the head
    cut to ``ids`` (None: the full head): logits (M + E, N or V), teacher_rows (M + E,) into ``rows``,
    and each prediction's chain step (M + E,)."""
    depth, _ = cod_depths(batch["loss_mask"], k, 1.0, 1.0)
    plain = Batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], rows, ids)
    logits, chains, teacher_rows = chain_predictions(draft, draft, plain, depth, draft.mask_token_id)
    return logits, teacher_rows, torch.cat([torch.zeros_like(rows), chains.step])


def lm_state(draft: ParallelDraft, state: dict) -> dict:
    """The LM's state dict from the draft's full one: names without ``lm.``, and ``mask_row`` written
    into the embedding matrix (one tensor under every name it has, a tied head's too)."""
    state = {key.removeprefix("lm."): value for key, value in state.items()}
    row = state.pop("mask_row", None)
    if row is None:
        return state
    embedding = draft.lm.get_input_embeddings().weight
    names = [name for name, p in draft.lm.named_parameters(remove_duplicate=False) if p is embedding]
    merged = state[names[0]].clone()
    merged[draft.mask_token_id] = row.to(merged.dtype)
    return state | {name: merged for name in names if name in state}


class ParallelKind(KindBase):
    """The parallel draft (``draft.kind: parallel``): a standalone LM as ``lm`` builds it (``draft.init``,
    ``draft.layers``, ...) with ``draft.options``: ``mask_token_id`` (required: an id of the target's
    vocabulary the data never uses, e.g. 16 ``<empty_output>`` for SmolLM2), ``k`` (the tokens a
    forward proposes in training, default 6), ``cod_ratio`` and ``cod_min`` (PARD's conditional
    drop: 0.7 and 0.2), ``chain_weights`` (``equal``, ``target`` or ``draft``: module docstring) and
    ``weight_floor`` (0.1)."""

    name = "parallel"
    model_class = ParallelDraft
    spec_help = "'parallel:LAYERS:MASK_ID' (the target truncated to LAYERS, drafting with that mask id)"
    option_types = OPTIONS
    standalone = True
    # It trains with a cut head (draft.vocab) and decodes with the cut its folder carries
    # (``load``); a wrapper cutting it again would hide its drafter, so nothing else cuts it.
    cuts_head = False

    def check(self, settings: DraftSettings) -> None:
        lm.KIND.check(dataclasses.replace(settings, options={}))
        super().check(settings)
        options = self.options(settings)
        if "mask_token_id" not in settings.options:
            raise DraftsmithError(
                "parallel drafts need draft.options.mask_token_id: an id of the target's vocabulary that the data "
                "never uses (e.g. 16, <empty_output>, for SmolLM2)"
            )
        if options["k"] < 2:
            raise DraftsmithError(f"draft.options: k must be >= 2 (tokens proposed per forward), got {options['k']}")
        if not 0 < options["cod_ratio"] <= 1 or not 0 <= options["cod_min"] <= 1:
            raise DraftsmithError("draft.options: cod_ratio must be in (0, 1] and cod_min in [0, 1]")
        scheme = options["chain_weights"]
        if scheme not in CHAIN_WEIGHTS:
            named = ", ".join(CHAIN_WEIGHTS)
            raise DraftsmithError(f"draft.options: chain_weights must be one of {named}, got {scheme!r}")
        if not 0 <= options["weight_floor"] <= 1:
            raise DraftsmithError(f"draft.options: weight_floor must be in [0, 1], got {options['weight_floor']}")
        refuse_settings(self.name, settings, ("draft.lora_r",), "train the whole draft")
        if settings.loss == "accepted_length":  # its windows run over consecutive rows, not over chain steps
            raise DraftsmithError(
                "parallel drafts weight their chain steps for accepted length themselves; "
                "use loss forward_kl, reverse_kl, jsd or tvd"
            )

    def options(self, settings: DraftSettings) -> dict:
        return DEFAULTS | settings.options

    def target_parts(self, settings: DraftSettings, target_layers: int) -> TargetParts:
        return lm.KIND.target_parts(settings, target_layers)  # a standalone LM's

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> ParallelDraft:
        model = lm.KIND.build(dataclasses.replace(settings, options={}), target, tokenizer, device)
        if model.config.vocab_size != target.config.vocab_size:
            raise DraftsmithError(
                f"a parallel draft needs the target's vocabulary size ({target.config.vocab_size}, what vLLM "
                f"checks), got {model.config.vocab_size}"
            )
        mask = self.options(settings)["mask_token_id"]
        specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
        if mask in specials:
            raise DraftsmithError(f"mask_token_id {mask} is the tokenizer's bos, eos or pad token; pick an unused id")
        if mask in encode_chat(tokenizer, [{"role": "user", "content": "hello"}]):  # the template's own tokens
            raise DraftsmithError(
                f"mask_token_id {mask} ({tokenizer.convert_ids_to_tokens(mask)}) is a token the data uses: the chat "
                "template writes it into every prompt; pick an id the tokenizer never produces"
            )
        chains = ChainSettings(**{key: self.options(settings)[key] for key in DEFAULTS})
        # frozen embeddings: the mask's row still learns (the data never feeds the mask, so nothing else trains it)
        return ParallelDraft(model, mask, chains, train_mask_row=settings.freeze_embeddings).train()

    def teacher_log_probs(self, draft: torch.nn.Module) -> bool:
        """Chains weighted by acceptance (``chain_weights`` draft or target) read them."""
        return draft.chains.chain_weights != "equal"

    def training_forward(self, draft: torch.nn.Module, model: torch.nn.Module, batch: Batch) -> Predictions:
        """The ordinary predictions at the loss rows (M, n), then, in training, every kept chain step
        with its teacher row and its weight (``chain_weights``, module docstring)."""
        if not model.training:  # held-out alpha reads the ordinary predictions only
            with vocab_cut.loss_rows_head(model, batch.rows, batch.head_ids):
                logits = draft(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            return Predictions(logits)  # (M, n)
        settings = model.chains
        depth, inclusion = cod_depths(batch.loss_mask, settings.k, settings.cod_ratio, settings.cod_min)
        logits, chains, teacher_rows = chain_predictions(draft, model, batch, depth, model.mask_token_id)  # (M + E, n)
        weights = mask_weights(settings, logits, chains, teacher_rows, inclusion, batch, model.config.vocab_size)
        return Predictions(logits, teacher_rows, torch.cat([torch.ones_like(batch.rows, dtype=weights.dtype), weights]))

    def save(self, draft: torch.nn.Module, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        """A plain model folder: the LM, its trained mask row written into its embedding matrix."""
        if state is None:
            draft.merge_mask_row()
        else:  # the full state, named from the wrapper
            state = lm_state(draft, state)
        lm.KIND.save(draft.lm, state, tokenizer, folder, target_name)

    def files(self) -> tuple[str, ...]:
        return ("config.json", "model.safetensors")

    def recognises(self, folder: Path) -> bool:
        config = folder / "config.json"
        return config.is_file() and "pard_token" in json.loads(config.read_text())

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> ParallelDraft:
        """The draft in ``folder``, decoding with the head cut its ``draft_vocab.json`` holds (a
        checkpoint's trained cut, the cut a published draft was measured with), plus the EOS ids."""
        model = load_model(str(folder), device, dtype)
        head_ids = None
        if (folder / draft_vocab.FILE).is_file():
            eos = eos_token_ids(target, load_tokenizer(str(folder)))
            head_ids = draft_vocab.kept_ids(draft_vocab.load_ranking(folder), eos)
        return ParallelDraft(model, model.config.pard_token, head_ids=head_ids).eval()

    def from_spec(self, spec: str, target: PreTrainedModel) -> ParallelDraft | None:
        """``parallel:LAYERS:MASK``: the target truncated to LAYERS, untrained, drafting with mask id MASK."""
        if not spec.startswith("parallel:"):
            return None
        layers, _, mask = spec.removeprefix("parallel:").rpartition(":")
        if not layers or not mask.isdigit():
            raise DraftsmithError(f"a parallel draft is named parallel:LAYERS:MASK_ID (e.g. parallel:2:16), got {spec}")
        return ParallelDraft(lm.truncate_target(target, layers), int(mask)).eval()

    def architecture(self, folder: Path) -> tuple[str, dict]:
        config = json.loads((folder / "config.json").read_text())
        return f"parallel-{config.get('model_type', 'model')}", config

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        """A model folder whose config.json names the mask (``pard_token``, ``mask_token_id``)."""
        lm.KIND.export(draft.lm, tokenizer, folder, serving)

    def engine_config(self, folder: Path) -> dict:
        return {"method": "draft_model", "model": str(folder), "parallel_drafting": True}

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        mask = json.loads((folder / "config.json").read_text())["pard_token"]
        made = lm.describe(settings)
        return f"a parallel (PARD) draft drafting a whole round in one forward (mask token {mask}); {made}"

    def card_usage(self, target: str, draft_ref: str, gamma: int) -> list[str]:
        """transformers runs it as an ordinary assistant (one forward per token); vLLM drafts in parallel."""
        note = "; transformers drafts one token per forward with it, vLLM a whole round in one"
        vllm = vllm_usage(target, self.engine_config(Path(draft_ref)), gamma)
        return ["", "## Usage", "", *transformers_usage(target, draft_ref, gamma, note), *vllm]

    def decoding_report(self, target: PreTrainedModel, draft: torch.nn.Module, options: DecodeOptions) -> dict:
        return {"mask_token_id": draft.mask_token_id}


KIND = ParallelKind()
