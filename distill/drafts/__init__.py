"""Drafter kinds: one module per family of drafts, and the registry that names them.

- ``lm``: a standalone causal LM (truncated target, new config, pretrained, LoRA), ``lm.py``;
- ``early_exit``: the target's first k layers (shared, with its KV cache) and an exit head, ``early_exit.py``;
- ``parallel``: a standalone LM with a mask token that proposes K tokens in one forward (PARD), ``parallel.py``;
- ``eagle3``: an EAGLE-3 head on the target's low, middle and high hidden states (one layer, its own
  vocabulary), served by vLLM from the speculators layout, ``eagle3.py``;
- ``dflash``: Qwen3 decoder layers that fill a block of masks in one forward from the target's hidden
  states (DFlash), served by vLLM's ``dflash`` method, ``dflash.py``.

``kind.py`` says what a kind answers, and ``KindBase`` / ``DraftModel`` answer it the way most kinds
do. A new kind is one module with a ``KIND`` object (a ``KindBase`` overriding what differs) and one
entry in ``KINDS`` below (or ``register`` at run time); nothing else in draftsmith names a kind.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.distill.drafts import dflash, eagle3, early_exit, lm, parallel
from draftsmith.distill.drafts.kind import DraftKind, DraftModel, DraftSettings, KindBase, Serving
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import load_model

__all__ = [
    "KINDS",
    "DraftKind",
    "DraftModel",
    "DraftSettings",
    "KindBase",
    "Serving",
    "kind_named",
    "kind_of_folder",
    "kind_of_model",
    "load_draft",
    "named_draft",
]

KINDS: dict[str, DraftKind] = {
    kind.name: kind for kind in (lm.KIND, early_exit.KIND, parallel.KIND, eagle3.KIND, dflash.KIND)
}


def register(kind: DraftKind) -> None:
    """Add a kind at run time (a kind defined outside draftsmith, or in a test)."""
    KINDS[kind.name] = kind


def kind_named(name: str) -> DraftKind:
    if name not in KINDS:
        raise DraftsmithError(f"draft.kind must be one of {', '.join(KINDS)}, got {name!r}")
    return KINDS[name]


def _most_specific_first() -> list[DraftKind]:
    """Kinds in the order a folder is recognised: the standalone LM (any model folder) last."""
    return [kind for kind in reversed(KINDS.values()) if kind is not lm.KIND] + [lm.KIND]


def kind_of_folder(folder: Path) -> DraftKind | None:
    """The kind whose draft ``folder`` holds, or None when it holds none."""
    return next((kind for kind in _most_specific_first() if kind.recognises(folder)), None)


def kind_of_model(draft: torch.nn.Module) -> DraftKind:
    """The kind of a draft model object (a plain causal LM is the standalone LM kind)."""
    return next((kind for kind in _most_specific_first() if kind.owns(draft)), lm.KIND)


def named_draft(spec: str, target: PreTrainedModel) -> torch.nn.Module | None:
    """The draft a kind names by ``spec`` (``self``, ``truncate:LAYERS``, ``early_exit:K``: built
    from ``target``, untrained), or None when no kind names it (a folder, a file, a hub model)."""
    for kind in _most_specific_first():
        draft = kind.from_spec(spec, target)
        if draft is not None:
            return draft
    return None


def load_draft(spec: str, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A draft to evaluate, by spec: ``self`` (the target), an untrained draft a kind names
    (``named_draft``), a saved draft folder of any kind, or any model ``specdec.loading.load_model``
    takes (a .gguf file, a hub id, an alias)."""
    draft = named_draft(spec, target)
    if draft is not None:
        return draft
    folder = Path(spec)
    kind = kind_of_folder(folder) if folder.is_dir() else None
    if kind is not None:
        return kind.load(folder, target, device, dtype)
    return load_model(spec, device, dtype)


def engine_draft_folder(spec: str, target_spec: str, draft: torch.nn.Module, tokenizer, scratch: Path) -> str:
    """The model folder (or spec) a serving engine loads the draft ``spec`` from.

    ``self``: the target's own spec; an untrained draft named by a kind (``truncate:LAYERS``):
    exported by its kind into ``scratch``; a saved draft folder: its kind says whether an engine
    runs it (an early-exit draft shares the target's layers; a bare LoRA adapter needs its base).
    """
    if spec == "self":
        return target_spec
    folder = Path(spec)
    kind = kind_of_folder(folder) if folder.is_dir() else kind_of_model(draft)
    if folder.is_dir() and kind is not None:
        kind.engine_config(folder)  # refuses a draft no engine runs
        return spec
    kind.engine_config(folder)  # refuses a draft no engine runs, naming it as the command did
    kind.export(draft, tokenizer, scratch, Serving(gamma=1))  # the engine is told gamma itself
    return str(scratch)
