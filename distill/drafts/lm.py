"""The standalone draft LM kind: a causal LM over the target's vocabulary with its own KV cache.

Ways it starts (``draft.init``):

- ``truncate``: the target's architecture keeping a chosen subset of its decoder layers, with the
  embeddings, final norm and LM head copied (so the draft speaks the target's tokenizer from step 0);
- ``config``: a freshly initialized model of the target's architecture with config overrides;
- ``pretrained``: an existing small model with the same tokenizer;
- any of them with a LoRA adapter (peft) when ``lora_r > 0``.

It decodes on the decoder's own ``LMDrafter``, saves as a Hugging Face model folder (a LoRA draft:
its adapter plus a merged copy), and serves in vLLM as ``draft.model``.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.drafts.kind import DraftSettings, KindBase, Serving, TargetParts
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_compatible, load_model, load_tokenizer


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
        raise DraftsmithError("draft.config may not change vocab_size: the draft must share the target's tokenizer")
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

    names = {name.rsplit(".", 1)[-1] for name, module in draft.named_modules() if isinstance(module, torch.nn.Linear)}
    unknown = [name for name in target_modules if name not in names]
    if unknown:
        raise DraftsmithError(
            f"draft.lora_target_modules: the draft has no linear module named {', '.join(unknown)}; "
            f"it has {', '.join(sorted(names))}"
        )
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(draft, config)


def check_draft_config(target_config, overrides: dict) -> None:
    """Refuse ``draft.config`` keys that the target's config class does not have (a typo would be ignored)."""
    known = set(type(target_config)().to_dict()) | set(target_config.to_dict())
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DraftsmithError(
                f"draft.config: {key!r} is not a field of {type(target_config).__name__}; {hint}"
                "fix the key (nested keys are the target's config fields, e.g. num_hidden_layers)"
            )


INITS = ("truncate", "config", "pretrained")


def refuse_bare_adapter(folder: Path) -> None:
    """A folder with only a LoRA adapter is not a model: its merged draft is in the checkpoint above it."""
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise DraftsmithError(
            f"{folder} holds only a LoRA adapter; pass the checkpoint folder above it, which holds the merged draft"
        )


def describe(settings: DraftSettings) -> str:
    """How a standalone LM draft started, as the model card says it."""
    if settings.init == "truncate":
        layers = str(settings.layers).strip()
        kept = f"first {layers} layers" if layers.isdigit() else f"layers {layers}"
        made = f"the target truncated to its {kept}"
    elif settings.init == "config":
        made = f"a new model of the target's architecture with {settings.config or 'its own config'}"
    else:
        made = f"`{settings.model}`"
    lora = f", trained through a LoRA adapter of rank {settings.lora_r} (merged)" if settings.lora_r else ""
    return f"a standalone causal LM, starting from {made}{lora}"


class LMKind(KindBase):
    """The standalone draft LM (``draft.kind: lm``)."""

    name = "lm"
    model_class = (PreTrainedModel, PeftModel)
    spec_help = (
        "'self' (the target drafts for itself), 'truncate:N' / 'truncate:0,1,28' (the target's first N / listed layers)"
    )
    standalone = True
    cuts_head = True

    def check(self, settings: DraftSettings) -> None:
        if settings.init not in INITS:
            raise DraftsmithError(f"draft.init must be one of {', '.join(INITS)} for lm drafts, got {settings.init!r}")
        if settings.init == "pretrained" and not settings.model:
            raise DraftsmithError("draft.init pretrained needs draft.model")
        if settings.config and settings.init != "config":
            raise DraftsmithError(
                f"draft.config applies to draft.init config; draft.init {settings.init} ignores it: leave it out"
            )
        if settings.model and settings.init != "pretrained":
            raise DraftsmithError(
                f"draft.model applies to draft.init pretrained; draft.init {settings.init} ignores it: leave it out"
            )
        super().check(settings)

    def target_parts(self, settings: DraftSettings, target_layers: int) -> TargetParts:
        """A truncated target copies its kept layers too; a new config or a pretrained draft none."""
        if settings.init == "truncate":
            return TargetParts(tuple(parse_layers(settings.layers, target_layers)))
        return TargetParts()

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> torch.nn.Module:
        if settings.init == "truncate":
            draft = truncate_target(target, settings.layers)
        elif settings.init == "config":
            check_draft_config(target.config, settings.config)
            draft = new_config_draft(target, settings.config)
        else:
            draft = load_model(settings.model, device, torch.float32)
            check_compatible(
                tokenizer, load_tokenizer(settings.model), target.config.vocab_size, draft.config.vocab_size
            )
        draft.requires_grad_(True).train()
        if settings.freeze_embeddings:
            draft.get_input_embeddings().requires_grad_(False)
            draft.get_output_embeddings().requires_grad_(False)
        if settings.lora_r:
            draft = add_lora(draft, settings.lora_r, settings.lora_alpha, list(settings.lora_target_modules))
        return draft

    def save(self, draft: torch.nn.Module, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        if isinstance(draft, PeftModel):
            draft.save_pretrained(folder / "adapter")
            draft, state = copy.deepcopy(draft).merge_and_unload(), None
        draft.save_pretrained(folder, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    def files(self) -> tuple[str, ...]:
        return ("config.json", "model.safetensors")

    def recognises(self, folder: Path) -> bool:
        return (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        refuse_bare_adapter(folder)
        return load_model(str(folder), device, dtype)

    def from_spec(self, spec: str, target: PreTrainedModel) -> torch.nn.Module | None:
        if spec == "self":
            return target
        if spec.startswith("truncate:"):
            return truncate_target(target, spec.split(":", 1)[1])
        return None

    def architecture(self, folder: Path) -> tuple[str, dict]:
        config = json.loads((folder / "config.json").read_text())
        return config.get("model_type", "model"), config

    def check_export(self, folder: Path) -> None:
        refuse_bare_adapter(folder)

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        """A Hugging Face model folder, its generation config carrying ``serving`` (``write_serving``)."""
        draft.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        self.write_serving(draft, folder, serving)

    def engine_config(self, folder: Path) -> dict:
        refuse_bare_adapter(folder)
        return {"method": "draft_model", "model": str(folder)}

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        return describe(settings)


KIND = LMKind()
