"""Early-exit (self-speculative) drafts: the target's own first k layers, shared and frozen, plus a
small trainable exit head (an adapter decoder layer initialized from the target's layer k, a norm,
and the target's LM head, shared and frozen).

Because the first k layers are the target's, the keys and values the draft computes there are the
ones the target needs: the decoder lets the target reuse them and run only its layers k..L-1 over
the candidates (``specdec.self_spec``; Draft & Verify, Zhang et al. 2024; LayerSkip, Elhoushi et
al. 2024). ``EarlyExitDraft`` is the ``specdec.self_spec.EarlyExit`` the decoder expects for that.
Used on its own (``--no-kv-reuse``) it is a standalone draft.

A checkpoint holds only the trained parameters (``exit_head.safetensors``) and ``early_exit.json``
(the target and k); the shared layers come from the target when it is loaded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Cache, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.self_spec import run_layers

META = "early_exit.json"
WEIGHTS = "exit_head.safetensors"


class EarlyExitDraft(nn.Module):
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
        self.to(device=target.device, dtype=target.dtype)
        self.requires_grad_(True)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.target.get_input_embeddings()

    def _mask(self, embeds, attention_mask, cache, position_ids, layer_idx):
        return create_causal_mask(
            config=self.target.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=layer_idx,
        )

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
        if self.adapter is not None:
            mask = self._mask(hidden, attention_mask, cache, position_ids, self.config.num_hidden_layers - 1)
            rotary = self.target.get_decoder().rotary_emb(hidden, position_ids=position_ids)
            hidden = self.adapter(
                hidden,
                attention_mask=mask,
                position_embeddings=rotary,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
            )
        if not with_head:
            return None
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.target.get_output_embeddings()(self.norm(hidden))

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
        draft = cls(target, meta["k"], meta["adapter"])
        draft.load_state_dict(load_file(folder / WEIGHTS, device=str(target.device)))
        return draft.eval()


def is_early_exit(folder: Path) -> bool:
    return (folder / META).is_file()
