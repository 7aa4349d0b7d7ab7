"""Ways to make a draft model for a target.

- ``truncate``: the target's architecture keeping a chosen subset of its decoder layers, with the
  embeddings, final norm and LM head copied (so the draft speaks the target's tokenizer from step 0).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.errors import DraftsmithError


def parse_layers(spec: int | str | Sequence[int], num_layers: int) -> list[int]:
    """``4`` -> the first 4 layers; ``"0,1,28,29"`` or ``[0, 1, 28, 29]`` -> those layers, in order."""
    if isinstance(spec, int):
        if not 1 <= spec <= num_layers:
            raise DraftsmithError(f"a truncated draft needs 1..{num_layers} layers, got {spec}")
        return list(range(spec))
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError as err:
            raise DraftsmithError(f"layers must be a count or a comma-separated list of indices, got {spec!r}") from err
        if len(spec) == 1:
            return parse_layers(spec[0], num_layers)
    layers = list(spec)
    if not layers or sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise DraftsmithError(
            f"layer indices must be increasing, distinct and within 0..{num_layers - 1}, got {layers}"
        )
    return layers


def truncate_target(target: PreTrainedModel, layers: int | str | Sequence[int]) -> PreTrainedModel:
    """A copy of ``target`` that keeps only ``layers`` of its decoder (embeddings, norm, head copied)."""
    decoder = target.get_decoder()
    keep = parse_layers(layers, len(decoder.layers))
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    layer_types = config.to_dict().get("layer_types")  # only architectures with mixed attention have it
    if layer_types is not None:
        config.layer_types = [layer_types[i] for i in keep]
    draft = type(target)(config).to(dtype=target.dtype, device=target.device)
    source = target.state_dict()
    prefix = "model.layers."
    state = {}
    for name in draft.state_dict():
        if name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            state[name] = source[f"{prefix}{keep[int(index)]}.{rest}"]
        else:
            state[name] = source[name]
    draft.load_state_dict(state)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def new_config_draft(target: PreTrainedModel, overrides: dict) -> PreTrainedModel:
    """A freshly initialized model of the target's architecture and tokenizer, with config ``overrides``
    (e.g. fewer layers, a smaller hidden size). When the hidden size is unchanged the token embeddings
    and LM head are copied from the target, so the draft starts from the target's vocabulary geometry."""
    fields = target.config.to_dict() | overrides
    if fields["vocab_size"] != target.config.vocab_size:
        raise DraftsmithError("draft_config may not change vocab_size: the draft must share the target's tokenizer")
    config = type(target.config)(**fields)
    draft = type(target)(config).to(dtype=target.dtype, device=target.device)
    if config.hidden_size == target.config.hidden_size:
        draft.get_input_embeddings().weight.data.copy_(target.get_input_embeddings().weight)
        draft.get_output_embeddings().weight.data.copy_(target.get_output_embeddings().weight)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


def add_lora(draft: PreTrainedModel, rank: int, alpha: int, target_modules: list[str]):
    """Wrap ``draft`` in a LoRA adapter (peft); only the adapter's parameters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(draft, config)


def load_draft(spec: str, target: PreTrainedModel, device: torch.device, dtype: torch.dtype):
    """A draft to evaluate, by spec: ``self`` (the target), ``truncate:LAYERS`` or ``early_exit:K`` of the
    target (untrained), an early-exit checkpoint folder, or any model ``load_model`` takes."""
    from draftsmith.distill.early_exit import EarlyExitDraft, is_early_exit
    from draftsmith.specdec.loading import load_model

    if spec == "self":
        return target
    if spec.startswith("truncate:"):
        return truncate_target(target, spec.split(":", 1)[1])
    if spec.startswith("early_exit:"):
        return EarlyExitDraft(target, int(spec.split(":", 1)[1])).eval()
    if is_early_exit(Path(spec)):
        return EarlyExitDraft.load(Path(spec), target)
    return load_model(spec, device, dtype)


def engine_draft_folder(spec: str, target_spec: str, draft: torch.nn.Module, tokenizer, scratch: Path) -> str:
    """The model folder (or spec) a serving engine loads the draft ``spec`` from.

    ``self``: the target's own spec; ``truncate:LAYERS``: ``draft`` (those layers of the target)
    saved with the tokenizer into ``scratch``; a model folder as it is. Early-exit drafts share the
    target's layers, and a bare LoRA adapter needs its base: neither is a standalone model.
    """
    from draftsmith.distill.early_exit import is_early_exit

    if spec == "self":
        return target_spec
    if spec.startswith("truncate:"):
        draft.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        return str(scratch)
    if spec.startswith("early_exit:") or is_early_exit(Path(spec)):
        raise DraftsmithError(
            f"{spec} is an early-exit draft, which shares the target's layers; a serving engine runs standalone "
            "drafts (a model folder, truncate:N or self)"
        )
    if (Path(spec) / "adapter_config.json").is_file() and not (Path(spec) / "config.json").is_file():
        raise DraftsmithError(
            f"{spec} holds only a LoRA adapter; pass the checkpoint folder above it, which holds the merged draft"
        )
    return spec
