"""Ways to make a draft model for a target.

- ``truncate``: the target's architecture keeping a chosen subset of its decoder layers, with the
  embeddings, final norm and LM head copied (so the draft speaks the target's tokenizer from step 0).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.errors import DraftsmithError


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
