"""A model whose tensors are read from its checkpoint files only where they are needed.

A run fed by a feature store never runs its target: a draft copies the target's embeddings, final
norm, head and a few layers at initialisation, and held-out metrics apply its head to stored rows.
So the target is built as a *skeleton* (every parameter on the meta device, costing no memory; the
buffers, such as rotary frequencies, computed as usual) and only the modules asked for are read
from the checkpoint's safetensors files (``PartialModel.load``). For a 70B target that is about 2 GB
instead of 140 GB.

The rest, the *body*, loads the first time anything runs through a module that has none of its
weights yet (a forward pre-hook on each such module), in the dtype asked for at that time, straight
from the files: no float32 copy of a bfloat16 checkpoint is made. A run that never runs its target
never loads it; one that does (a live teacher, a store still to build, a speedup measured during
training) gets the same model as ``from_pretrained`` would give.

Checkpoint files are found in a local folder or, for a hub id, through the hub cache: a sharded
checkpoint's ``model.safetensors.index.json`` names the file of each tensor, so only the files that
hold the asked tensors are fetched.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from draftsmith.specdec.errors import DraftsmithError

# model -> its PartialModel, while some of its weights are not loaded
PARTIAL: WeakIdKeyDictionary = WeakIdKeyDictionary()

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFiles:
    """Where each tensor of a checkpoint lies (``files``: tensor name -> file name) and how to read them.

    source: a local model folder or a hub id (its files are fetched into the hub cache on first use)."""

    def __init__(self, source: str):
        self.source = source
        self.folder = Path(source) if Path(source).is_dir() else None
        index = self.fetch(INDEX_FILE, required=False)
        if index is not None:
            self.files = json.loads(index.read_text())["weight_map"]  # tensor name -> file name
        else:
            single = self.fetch(SINGLE_FILE, required=True)
            with safe_open(single, "pt") as handle:
                self.files = dict.fromkeys(handle.keys(), SINGLE_FILE)

    def fetch(self, name: str, required: bool) -> Path | None:
        """The local path of the checkpoint's file ``name`` (fetched from the hub for a hub id)."""
        if self.folder is not None:
            path = self.folder / name
            if path.is_file():
                return path
            if required:
                raise DraftsmithError(
                    f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: the target's tensors can be read "
                    "only from safetensors files (convert the checkpoint with save_pretrained)"
                )
            return None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(self.source, name))
        except EntryNotFoundError:
            if required:
                raise DraftsmithError(f"the hub model {self.source} has no {name}") from None
            return None

    def read(self, names: dict[str, torch.dtype], device: torch.device) -> dict[str, torch.Tensor]:
        """The tensors ``names`` ({name: dtype}) on ``device``, each file opened once (memory-mapped: a
        tensor is read, cast and placed one at a time)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        for file, wanted in by_file.items():
            with safe_open(self.fetch(file, required=True), "pt") as handle:
                for name in wanted:
                    tensors[name] = handle.get_tensor(name).to(device=device, dtype=names[name])
        return tensors


def skeleton(source: str, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of the model folder or hub id ``source`` with every parameter on the meta device
    (no memory, no weights read) and its buffers computed; ``name_or_path`` and ``generation_config``
    as ``from_pretrained`` sets them."""
    config = AutoConfig.from_pretrained(source)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # a tied head is the embeddings' Parameter, as from_pretrained leaves it (outside the block, whose
    # patched register_parameter would register a new meta tensor instead)
    model.tie_weights()
    model.config.name_or_path = source
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # a checkpoint without generation_config.json: the config's defaults, as from_pretrained
        model.generation_config = GenerationConfig.from_model_config(config)
    return model.eval().requires_grad_(False)


def parameter_sites(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every place each parameter is registered: {id(parameter): [(module, attribute, full name)]} (a
    tied parameter, e.g. an LM head sharing the embeddings, has several)."""
    sites: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{attribute}" if prefix else attribute
            sites.setdefault(id(param), []).append((module, attribute, name))
    return sites


def is_loaded(model: nn.Module) -> bool:
    """Whether every parameter of ``model`` holds its weights (none is on the meta device)."""
    return not any(p.is_meta for p in model.parameters())


def count_loaded(model: nn.Module) -> tuple[int, int]:
    """(parameters, parameters holding weights in this process) of ``model``, each tensor counted once; a
    sharded (DTensor) parameter counts its local shard."""
    total = loaded = 0
    for param in model.parameters():
        total += param.numel()
        local = param.to_local() if isinstance(param, torch.distributed.tensor.DTensor) else param
        loaded += 0 if local.is_meta else local.numel()
    return total, loaded


class PartialModel:
    """The loading of a skeleton's weights: ``load(modules)`` reads those modules' parameters from the
    checkpoint; the body (every module still without weights) loads on the first forward through any
    of them, or by ``load_body``."""

    def __init__(self, model: PreTrainedModel, files: CheckpointFiles, device: torch.device):
        self.model, self.files, self.device = model, files, device
        self.hooks: dict[nn.Module, torch.utils.hooks.RemovableHandle] = {}
        self.arm()
        PARTIAL[model] = self

    def load(self, modules: Iterable[nn.Module], dtype: torch.dtype | None) -> None:
        """Read the parameters of ``modules`` (and what they contain) that have no weights yet, in ``dtype``
        (None: each in its skeleton's dtype)."""
        self.read({id(p) for module in modules for p in module.parameters() if p.is_meta}, dtype)

    def load_body(self) -> None:
        """Read every parameter that has no weights yet, each in the dtype its skeleton has (the model's
        dtype, or the one it was cast to since)."""
        missing = {id(p) for p in self.model.parameters() if p.is_meta}
        if missing:
            print(f"loading the target's body from {self.files.source}", file=sys.stderr)
        self.read(missing, None)

    def read(self, wanted: set[int], dtype: torch.dtype | None) -> None:
        """Read the parameters ``wanted`` (their ids) in ``dtype`` (None: each in its skeleton's dtype)."""
        if not wanted:
            return
        sites, known = parameter_sites(self.model), self.files.files  # known: the checkpoint's tensor names
        names, dtypes = {}, {}
        for key in wanted:
            stored = [name for _, _, name in sites[key] if name in known]  # a tied parameter is stored once
            if not stored:
                aliases = ", ".join(name for _, _, name in sites[key])
                raise DraftsmithError(
                    f"{self.files.source}: the checkpoint has no tensor named {aliases}; its names differ from the "
                    f"model's ({type(self.model).__name__}), so its parts cannot be read alone: set "
                    "teacher.load_parts=false to load the whole target"
                )
            module, attribute, _ = sites[key][0]
            names[key] = stored[0]
            dtypes[stored[0]] = dtype or module._parameters[attribute].dtype
        tensors = self.files.read(dtypes, self.device)
        for key, name in names.items():
            param = nn.Parameter(tensors[name], requires_grad=False)
            for module, attribute, _ in sites[key]:
                module._parameters[attribute] = param  # every site of a tied parameter gets the same one
        self.disarm()

    def arm(self) -> None:
        """A forward pre-hook on each module that holds a parameter without weights: the body loads first."""
        for module in self.model.modules():
            if any(p.is_meta for p in module.parameters(recurse=False)):
                self.hooks[module] = module.register_forward_pre_hook(self.before_forward)

    def disarm(self) -> None:
        """Remove the hooks of the modules that hold all their weights now (a module copied later, say
        into a draft, carries no hook), and forget the model once it is whole."""
        for module in [m for m in self.hooks if not any(p.is_meta for p in m.parameters(recurse=False))]:
            self.hooks.pop(module).remove()
        if is_loaded(self.model):
            PARTIAL.pop(self.model, None)

    def before_forward(self, module: nn.Module, args) -> None:
        if not is_loaded(self.model):
            self.load_body()


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its parameters (loaded or not) in ``dtype`` and its buffers as they are, which is
    what ``from_pretrained(dtype=...)`` gives: ``model.to(dtype)`` would also round the rotary
    frequencies to bfloat16, which moves a bfloat16 Llama's logits by up to about 16."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def load_whole(model: nn.Module) -> None:
    """Load whatever ``model`` (a ``load_partial`` skeleton or a plain model) has not loaded yet: before
    code that reads its weights outside a forward (cost timings, copies)."""
    partial = PARTIAL.get(model)
    if partial is not None:
        partial.load_body()


def load_partial(source: str, device: torch.device, dtype: torch.dtype) -> PartialModel:
    """The skeleton of ``source`` (a local folder or hub id, as ``loading.resolve_model`` gives it)
    with no weights read yet, its parameters in ``dtype`` once read (``cast_parameters`` changes that
    for those not read yet)."""
    model = skeleton(source, dtype)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)
    return PartialModel(model, CheckpointFiles(source), device)
