"""The early-exit draft kind (self-speculative): the target's own first k layers, shared and frozen,
plus a small trainable exit head (an adapter decoder layer initialized from the target's layer k, a
norm, and the target's LM head, shared and frozen).

Because the first k layers are the target's, the keys and values the draft computes there are the
ones the target needs: draft and target share one cache, the drafter runs the shared layers on the
target itself (``SharedLayersDrafter``), and verification runs only the target's layers k..L-1
over the candidates (``specdec.self_spec.UpperLayersVerifier``; Draft & Verify, Zhang et al. 2024;
LayerSkip, Elhoushi et al. 2024). With the decode option ``kv_reuse: false`` (``--draft-option
kv_reuse=false``), and for token trees unless ``kv_reuse: true`` is asked, it decodes as a
standalone draft on its own cache.

A checkpoint holds only the trained parameters (``exit_head.safetensors``) and ``early_exit.json``
(the target and k); the shared layers come from the target when it is loaded. Serving engines run
standalone drafts, so this kind is measured by draftsmith and not exported.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Generator, nn
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftsmith.distill.drafts.kind import (
    DecodeOption,
    DraftModel,
    DraftSettings,
    KindBase,
    Serving,
    TargetParts,
    layer_count,
    refuse_settings,
)
from draftsmith.specdec.attention import use_exact_attention
from draftsmith.specdec.cache import SlotCache, select_batch
from draftsmith.specdec.clock import Clock
from draftsmith.specdec.compiled import resolve_compile
from draftsmith.specdec.decoder import standalone_pair
from draftsmith.specdec.drafters import Proposal, Verification, draft_chain
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.matmul import use_column_products
from draftsmith.specdec.measure.report import PairReport
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.self_spec import UpperLayersVerifier, crop_to, run_layers, run_modules, two_rows
from draftsmith.specdec.stream import decoding_threads, needs_row_padding, standard_strides_into_head
from draftsmith.specdec.tree import TreeShape
from draftsmith.specdec.tree_drafting import Tree
from draftsmith.specdec.verify import TargetVerifier

META = "early_exit.json"
WEIGHTS = "exit_head.safetensors"
KV_REUSE = "kv_reuse"  # the decode option: share the target's cache


def reuses_kv(options: DecodeOptions) -> bool:
    """Whether the draft decodes on the cache it shares with the target: the ``kv_reuse`` decode
    option when given, else for chains (a token tree is drafted on the draft's own cache)."""
    chosen = options.draft_options.get(KV_REUSE)
    return options.tree is None if chosen is None else bool(chosen)


class EarlyExitDraft(DraftModel):
    def __init__(self, target: PreTrainedModel, k: int, adapter: bool = True):
        super().__init__()
        layers = target.get_decoder().layers
        if not 1 <= k < len(layers):
            raise DraftsmithError(f"an early-exit draft needs 1 <= k < {len(layers)} target layers, got {k}")
        object.__setattr__(self, "target", target)  # shared: not a submodule, never trained or saved here
        self.k = k
        self.has_adapter = adapter
        num_layers = len(layers)
        # Cache layout: the target's layers 0..L-1, and the adapter's own keys and values at index L.
        self.config = copy.deepcopy(target.config)
        self.config.num_hidden_layers = num_layers + 1
        self.adapter = copy.deepcopy(layers[k]) if adapter else None
        if adapter:
            self.adapter.self_attn.layer_idx = num_layers
        self.norm = copy.deepcopy(target.get_decoder().norm)
        self.generation_config = copy.deepcopy(target.generation_config)
        object.__setattr__(self, "head", None)  # None: the target's head (``get_output_embeddings``)
        self.to(device=target.device, dtype=target.dtype)
        self.requires_grad_(True)

    def get_input_embeddings(self) -> nn.Module:
        return self.target.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        """The head the exit logits go through: the target's (shared, frozen), unless a training
        step swapped in another (``set_output_embeddings``: a head cut to a token subset)."""
        return self.target.get_output_embeddings() if self.head is None else self.head

    def set_output_embeddings(self, head: nn.Module) -> None:
        """Route the exit logits through ``head``; setting the target's own head again restores it."""
        object.__setattr__(self, "head", None if head is self.target.get_output_embeddings() else head)

    def lower(self, input_ids, position_ids, cache: Cache | None, attention_mask=None) -> torch.Tensor:
        """Hidden states after the target's layers 0..k-1 (B, Q, H); writes those layers' cache."""
        hidden = self.target.get_decoder().embed_tokens(input_ids)
        return run_layers(self.target, hidden, position_ids, cache, range(0, self.k), attention_mask)

    def exit_logits(
        self,
        hidden,
        position_ids,
        cache: Cache | None,
        attention_mask=None,
        logits_to_keep: int = 0,
        with_head: bool = True,
    ):
        """Draft logits from the layer-k hidden states (B, Q, H) -> (B, K, V); writes the adapter's cache.

        with_head=False only updates the adapter's cache (a token the draft must see but not predict from).
        """
        if self.adapter is not None:  # its cache index is L, after the target's layers
            adapter_index = self.config.num_hidden_layers - 1
            hidden = run_modules(
                self.target, [self.adapter], adapter_index, hidden, position_ids, cache, attention_mask
            )
        if not with_head:
            return None
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.get_output_embeddings()(self.norm(hidden))

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """A standalone causal LM forward, for training and for decoding without KV reuse."""
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        with torch.no_grad():  # the shared layers are the target's, frozen
            hidden = self.lower(input_ids, position_ids, cache, attention_mask)
        logits = self.exit_logits(hidden, position_ids, cache, attention_mask, logits_to_keep)
        return CausalLMOutputWithPast(logits=logits, cache=cache)

    def save(self, folder: Path, target_name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, folder / WEIGHTS)
        (folder / META).write_text(json.dumps({"target": target_name, "k": self.k, "adapter": self.has_adapter}))

    @classmethod
    def load(cls, folder: Path, target: PreTrainedModel) -> EarlyExitDraft:
        meta = json.loads((folder / META).read_text())
        state = load_file(folder / WEIGHTS, device=str(target.device))
        other = DraftsmithError(
            f"{folder} is an early-exit draft of the target {meta['target']}, whose layers it shares; this target "
            "is another (its layers or sizes differ): evaluate it with its own target, or train one for this target"
        )
        if meta["k"] >= target.config.num_hidden_layers:
            raise other
        draft = cls(target, meta["k"], meta["adapter"])
        expected = draft.state_dict()
        if any(name in expected and tensor.shape != expected[name].shape for name, tensor in state.items()):
            raise other
        draft.load_state_dict(state)
        return draft.eval()

    # specdec.drafters.PairedDraft: with KV reuse the draft shares the target's cache.
    def decoding_pair(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions
    ) -> tuple[TargetVerifier | UpperLayersVerifier, object]:
        if not reuses_kv(options):
            return standalone_pair(target, self, batch_size, capacity, options)
        return shared_layers_pair(target, self, batch_size, capacity, options)

    def decodes_compiled(self, target: PreTrainedModel, options: DecodeOptions) -> bool:
        if reuses_kv(options):
            if options.compile:
                raise DraftsmithError(
                    "an early-exit draft sharing the target's cache decodes eager; pass --no-compile or "
                    "--draft-option kv_reuse=false"
                )
            return False
        return options.tree is None and resolve_compile(options.compile, target)


class SharedLayersDrafter:
    """An ``EarlyExitDraft`` as drafter, on the cache it shares with the target (one sequence)."""

    feature_layers: tuple[int, ...] = ()  # the target's states it needs are the ones it computes itself
    # no lookup guesses: verification starts from the shared layers' states this drafter computed
    takes_guesses = False

    def __init__(self, target: PreTrainedModel, draft: EarlyExitDraft, capacity: int):
        self.target, self.draft, self.k = target, draft, draft.k
        self.cache = SlotCache(draft.config.num_hidden_layers, capacity)
        self.pad = needs_row_padding(target)

    def _positions(self, count: int) -> torch.Tensor:
        first = self.cache.get_seq_length()
        return torch.arange(first, first + count, device=self.target.device)[None]

    def _lower(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens (1, Q) through the shared layers (1, Q, H); one token as two rows in 16-bit dtypes."""

        def run(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            embeds = self.target.get_decoder().embed_tokens(ids)
            return run_layers(self.target, embeds, pos, self.cache, range(0, self.k))

        if self.pad and tokens.shape[1] == 1:
            return two_rows(run, tokens, positions, self.cache.layers[: self.k])
        return run(tokens, positions)

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens (1, Q) the draft sees but predicts nothing from; their layer-k states (1, Q, H)."""
        positions = self._positions(tokens.shape[1])
        hidden = self._lower(tokens, positions)
        self.draft.exit_logits(hidden, positions, self.cache, with_head=False)
        return hidden

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.read(tokens)

    def propose(
        self, sequences: list[list[int]], budget: torch.Tensor, options: DecodeOptions, generator: Generator | None
    ) -> Proposal:
        """Up to ``budget[0]`` tokens (``draft_chain``); ``reusable`` holds the layer-k states of
        ``[x_n, d_1 .. d_g]``."""
        unread = torch.tensor([sequences[0][self.cache.get_seq_length() :]], device=self.target.device)
        states = []

        def next_logits(token: torch.Tensor | None, active: torch.Tensor) -> torch.Tensor:
            feed = unread if token is None else token[:, None]
            positions = self._positions(feed.shape[1])
            hidden = self._lower(feed, positions)  # (1, Q, H)
            states.append(hidden[:, -1:])
            return self.draft.exit_logits(hidden, positions, self.cache, logits_to_keep=1)[:, -1]

        proposal = draft_chain(next_logits, budget, options, generator)
        last = proposal.tokens[:, -1:] if proposal.tokens.shape[1] else unread
        states.append(self.read(last)[:, -1:])  # the last proposal (or x_n): the target needs its state
        proposal.reusable = torch.cat(states, 1)  # (1, g+1, H)
        return proposal

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """Nothing: the drafter wrote the shared layers' cache itself."""

    def rollback(self, keep: torch.Tensor) -> None:
        crop_to(self.cache, keep)

    def select(self, rows: torch.Tensor) -> None:
        select_batch(self.cache, rows)

    def propose_tree(self, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
        raise DraftsmithError(TREE_REFUSED)

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        raise DraftsmithError(TREE_REFUSED)


TREE_REFUSED = "a token tree is drafted on the draft's own cache; leave out --draft-option kv_reuse=true with --tree"


def shared_layers_pair(
    target: PreTrainedModel, draft: EarlyExitDraft, batch_size: int, capacity: int, options: DecodeOptions
) -> tuple[UpperLayersVerifier, SharedLayersDrafter]:
    """Verifier and drafter sharing one cache, for an early-exit draft of ``target``."""
    if options.tree is not None:
        raise DraftsmithError(TREE_REFUSED)
    if batch_size != 1:
        raise DraftsmithError(
            "KV reuse decodes one sequence at a time; use --batch-size 1 or --draft-option kv_reuse=false"
        )
    if options.cache_kind not in (None, "slot"):
        raise DraftsmithError("KV reuse uses the slot cache; drop --cache or use --draft-option kv_reuse=false")
    if not 1 <= draft.k < target.config.num_hidden_layers:
        layers = target.config.num_hidden_layers
        raise DraftsmithError(f"an early-exit draft shares 1..{layers - 1} of the target's layers, not {draft.k}")
    use_exact_attention(target)
    use_column_products(draft, use_column_products(target))  # the layers they share take one form
    standard_strides_into_head(target)
    drafter = SharedLayersDrafter(target, draft, capacity)
    return UpperLayersVerifier(target, draft.k, drafter.cache, options.verify_widths), drafter


@torch.inference_mode()
def measure_verify_saving(
    target: PreTrainedModel, draft: EarlyExitDraft, gamma: int, context: int = 128, reps: int = 9
) -> dict[str, float]:
    """Time one verification pass over gamma+1 tokens with KV reuse and without, on the same context.

    With reuse the pass is the draft's shared layers for the last token plus the target's layers
    k..L-1 over all gamma+1; without, the full target over gamma+1. Returns both (median seconds)
    and the fraction of verification time saved.
    """
    device, clock = target.device, Clock(target.device)
    vocab = target.config.vocab_size
    prompt = torch.arange(1, context + 1, device=device)[None] % vocab
    tokens = torch.arange(context + 1, context + gamma + 2, device=device)[None] % vocab
    valid, prompt_valid = torch.ones_like(tokens, dtype=torch.bool), torch.ones_like(prompt, dtype=torch.bool)
    keep = torch.tensor([context], device=device)
    upper, shared = shared_layers_pair(target, draft, 1, context + gamma + 2, DecodeOptions(gamma=gamma))
    full = TargetVerifier(target, 1, context + gamma + 2, "slot", widths={})
    times: dict[str, list[float]] = {"reuse": [], "full": []}
    with decoding_threads(target):
        upper.prefill(prompt, prompt_valid, shared.prefill(prompt, prompt_valid))
        full.prefill(prompt, prompt_valid)
        for _ in range(reps):
            drafted = shared.read(tokens[:, :gamma])  # done while drafting, before verification starts
            clock.lap()
            upper.verify(tokens, valid, torch.cat([drafted, shared.read(tokens[:, gamma:])], 1))
            times["reuse"].append(clock.lap())
            shared.rollback(keep)
            full.verify(tokens, valid)
            times["full"].append(clock.lap())
            full.rollback(keep)
    reuse, full_s = sorted(times["reuse"])[reps // 2], sorted(times["full"])[reps // 2]
    return {"verify_s_kv_reuse": reuse, "verify_s_full": full_s, "verify_time_saved": 1 - reuse / full_s}


def uses_adapter(settings: DraftSettings) -> bool:
    """Whether the draft has its adapter layer (``draft.options: adapter``, on by default)."""
    return settings.options.get("adapter", True)


class EarlyExitKind(KindBase):
    """The early-exit draft (``draft.kind: early_exit``): ``draft.layers`` is k, the target layers it
    shares; ``draft.options: {adapter: false}`` leaves out the trainable adapter layer. Decode option
    ``kv_reuse`` (``--draft-option kv_reuse=false``): decode as a standalone draft instead."""

    name = "early_exit"
    model_class = EarlyExitDraft
    spec_help = "'early_exit:K' (the target's first K layers and an untrained exit head)"
    option_types = {"adapter": bool}
    decode_options = {
        KV_REUSE: DecodeOption(
            bool,
            None,
            "share the target's cache and verify with its layers above k (default: for chains, not for token trees)",
            old_flag="--no-kv-reuse",
            old_value=False,
        )
    }
    standalone = False  # it runs the target's own layers: no serving engine loads it alone
    cuts_head = False  # it exits through the target's full head, shared

    def check(self, settings: DraftSettings) -> None:
        super().check(settings)
        layer_count(settings.layers, self.name)
        refused = ("draft.lora_r", "draft.vocab", "draft.config", "draft.model")
        refuse_settings(self.name, settings, refused, "share the target's head and layers")
        if settings.teacher_dtype not in ("auto", "float32"):
            raise DraftsmithError(
                "early_exit drafts share the target's layers, which stay float32: set teacher.dtype to auto"
            )

    def teacher_dtype(self, settings: DraftSettings, resolved: torch.dtype) -> torch.dtype:
        return torch.float32  # the shared layers train and decode with the teacher's own weights

    def target_parts(self, settings: DraftSettings, target_layers: int) -> TargetParts:
        """Its shared layers, the first k, and layer k, which its adapter starts as."""
        k = layer_count(settings.layers, self.name)
        return TargetParts(tuple(range(k + 1 if uses_adapter(settings) else k)))

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> EarlyExitDraft:
        adapter = uses_adapter(settings)
        # Its shared layers, embeddings and head are the target's, frozen.
        return EarlyExitDraft(target, layer_count(settings.layers, self.name), adapter=adapter).train()

    def save(self, draft: EarlyExitDraft, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        draft.save(folder, target_name)
        tokenizer.save_pretrained(folder)

    def files(self) -> tuple[str, ...]:
        return (META, WEIGHTS)

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> EarlyExitDraft:
        return EarlyExitDraft.load(folder, target)

    def from_spec(self, spec: str, target: PreTrainedModel) -> EarlyExitDraft | None:
        if not spec.startswith("early_exit:"):
            return None
        return EarlyExitDraft(target, layer_count(spec.split(":", 1)[1], self.name)).eval()

    def architecture(self, folder: Path) -> tuple[str, dict]:
        return "early-exit", json.loads((folder / META).read_text())

    def check_publishable(self) -> None:
        raise DraftsmithError(
            "early-exit drafts share the target's layers and are not standalone models, so none is published: "
            "train one with draftsmith distill draft.kind=early_exit and measure it with draftsmith eval-run"
        )

    def check_export(self, folder: Path) -> None:
        raise DraftsmithError(
            f"{folder} is an early-exit draft: it shares the target's layers and is not a standalone model, so "
            "transformers and vLLM cannot load it as an assistant; evaluate it with draftsmith eval / eval-run"
        )

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        self.check_export(folder)

    def engine_config(self, folder: Path) -> dict:
        raise DraftsmithError(
            f"{folder} is an early-exit draft, which shares the target's layers; a serving engine runs standalone "
            "drafts (a model folder, truncate:N or self)"
        )

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        return f"an early-exit draft: the target's first {settings.layers} layers, shared, and an exit head"

    def decoding_report(self, target: PreTrainedModel, draft: EarlyExitDraft, options: DecodeOptions) -> dict:
        """The verification pass with and without KV reuse, timed, and whether this run reused."""
        return {**measure_verify_saving(target, draft, options.gamma), KV_REUSE: reuses_kv(options)}

    def report_lines(self, report: PairReport) -> list[str]:
        added = report.kind_figures
        return [
            f"verification pass over {report.gamma + 1} tokens: "
            f"{added['verify_s_kv_reuse'] * 1e3:.1f} ms with KV reuse, "
            f"{added['verify_s_full'] * 1e3:.1f} ms with the full target ({added['verify_time_saved']:.1%} saved); "
            f"this run {'reused' if added[KV_REUSE] else 'did not reuse'} the draft's KV"
        ]


KIND = EarlyExitKind()
