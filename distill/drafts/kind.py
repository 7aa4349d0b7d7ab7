"""What a drafter kind is: the calls every kind module answers, and the settings it is built from.

A *kind* is everything that makes one family of drafts: how it is built from a target and the run's
settings, its setting checks, how it is saved, recognised and loaded, its training forward (what it
needs from the teacher), the (verifier, drafter) pair it decodes with (a draft model that is a
``specdec.drafters.PairedDraft`` builds its own; any other is a standalone LM to the decoder), and
how it is exported for serving, the serving settings its folder carries, the model card's
description and usage, and the decode options it takes. The trainer, checkpoints, eval, eval-run,
publish and the command line ask the kind (``distill.drafts.kind_named``, ``kind_of_folder``,
``kind_of_model``); none of them tests for a particular kind.

``DraftKind`` lists the calls; ``KindBase`` answers most of them the way most kinds do, so that a
new kind overrides only what differs (``build``, ``save``, ``files``, ``load``, ``model_class`` and,
for a draft that decodes with its own pair, a ``DraftModel``).
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill import vocab_cut
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.hf_compare import configure_assistant
from draftsmith.specdec.measure.report import PairReport
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.verify import TargetVerifier

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class Serving:
    """What a published draft carries of its measurement: the best gamma (draft tokens per round)
    and the fastest token-tree shape when one beat the chain (draftsmith's decoder reads it)."""

    gamma: int
    tree: str | None = None


@dataclass(frozen=True)
class DraftSettings:
    """How a run's draft is made: the run config's draft fields as plain values (``train.config``).

    kind: the kind's name (``lm``, ``early_exit``, ...). init, layers, config, model, lora_*:
    how a standalone LM starts (truncated target, new config, pretrained, LoRA); ``layers`` is also
    the shared layer count k of an early-exit draft. options: the kind's own settings
    (``draft.options``), checked by the kind. draft.vocab: the head cut to the N most
    frequent tokens (0: the full head). teacher.dtype: the run's ``teacher.dtype``. loss: the run's
    loss (a kind whose predictions reach several steps ahead may refuse ``accepted_length``, whose
    windows assume one prediction per position).
    """

    kind: str = "lm"
    init: str = "truncate"
    layers: str = "2"
    config: dict = field(default_factory=dict)
    model: str | None = None
    lora_r: int = 0
    lora_alpha: int = 16
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    freeze_embeddings: bool = True
    options: dict = field(default_factory=dict)
    train_draft_vocab: int = 0
    teacher_dtype: str = "auto"
    loss: str = "tvd"


@dataclass(frozen=True)
class TargetParts:
    """Which of the target's tensors a run reads when the target itself is not run (its teacher read
    from a feature store): its token embeddings, final norm and LM head, and the decoder layers
    ``layers`` (what the draft's initialisation copies or shares). ``whole``: all of it."""

    layers: tuple[int, ...] = ()
    whole: bool = False


@dataclass
class Batch:
    """A training micro-batch as a kind's training forward sees it.

    input_ids, attention_mask, loss_mask: (B, T). rows: (M,) the flat indices into (B, T) of the
    loss positions, row-major (the teacher's distributions come at these rows, in this order).
    head_ids: (N,) the tokens of a cut head (``draft.vocab``), None for the full head; the
    logits then cover those N tokens. teacher_hidden: {layer i: (B, T, H)} the residual stream
    entering target layer i at every position, for the layers ``teacher_layers`` named, from the
    same target forward that gives the teacher's distributions ({} when none were asked for).
    teacher_log_probs: (M, N or V) the teacher's log-probs at the loss rows as the loss reads them
    (``train.examples.TeacherRows``), for a kind whose ``teacher_log_probs`` asks for them (None: not
    asked for).
    teacher_argmax: (M,) the target's most probable token at each loss row, over its whole vocabulary,
    for a kind whose ``teacher_argmax`` asks for it (None: not asked for); a store gives it from its
    top-k entries, so reading it costs no head over the target's vocabulary.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: torch.Tensor
    head_ids: torch.Tensor | None = None
    teacher_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    teacher_log_probs: torch.Tensor | None = None
    teacher_argmax: torch.Tensor | None = None


@dataclass
class Predictions:
    """What a kind's training forward predicts, compared with the teacher's distributions.

    logits: (R, N or V) the draft's logits. teacher_rows: (R,) for each prediction, the index into
    ``Batch.rows`` of the teacher distribution it is compared with (a kind that predicts several
    tokens ahead, or unrolls several steps, compares its j-th step with the teacher j positions
    on); None: R = M, one prediction per loss row, in order. With ``teacher_rows``, the first M
    predictions are still the next-token ones at the loss rows, in order (held-out alpha reads
    them). weights: (R,) each prediction's weight in the loss sum (None: 1 each); the loss is still
    divided by the count of loss tokens.
    """

    logits: torch.Tensor
    teacher_rows: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeOption:
    """A decode option a kind declares (``draftsmith eval --draft-option KEY=VALUE``), read by its
    decoding pair from ``DecodeOptions.draft_options``. type: what the value must be; default: what
    the kind does without it (None: it decides by the other options); help: one line for ``--help``.
    old_flag / old_value: a command-line flag it replaces, still taken (with a hint) as KEY=old_value."""

    type: type
    default: object
    help: str
    old_flag: str | None = None
    old_value: object = None


class DraftKind(Protocol):
    """The calls a kind module answers (one object per module, registered in ``distill.drafts``)."""

    name: str
    standalone: bool  # its folder is a model transformers and serving engines load as is
    cuts_head: bool  # it can train and decode with its head cut to frequent tokens
    decode_options: Mapping[str, DecodeOption]  # what ``DecodeOptions.draft_options`` may hold for it

    def check(self, settings: DraftSettings) -> None:
        """Refuse settings this kind does not take, by name (``DraftsmithError``)."""
        ...

    def teacher_dtype(self, settings: DraftSettings, resolved: torch.dtype) -> torch.dtype:
        """The target's dtype as teacher, given what ``teacher.dtype`` resolves to on the device."""
        ...

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> torch.nn.Module:
        """The trainable draft, in training mode, only its trainable parameters requiring grad."""
        ...

    def target_parts(self, settings: DraftSettings, target_layers: int) -> TargetParts:
        """The target tensors ``build`` reads (the target has ``target_layers`` decoder layers)."""
        ...

    def teacher_layers(self, draft: torch.nn.Module) -> tuple[int, ...]:
        """Target layers whose entering hidden states the training forward reads (() for none)."""
        ...

    def teacher_argmax(self, draft: torch.nn.Module) -> bool:
        """Whether the training forward reads the target's argmax at the loss rows (``Batch.teacher_argmax``)."""
        ...

    def teacher_log_probs(self, draft: torch.nn.Module) -> bool:
        """Whether the training forward reads the teacher's log-probs at the loss rows
        (``Batch.teacher_log_probs``; without them a store's teacher stays sparse for forward KL)."""
        ...

    def training_forward(self, draft: torch.nn.Module, model: torch.nn.Module, batch: Batch) -> Predictions:
        """The draft's predictions for a training batch, at its loss rows (``batch.rows``) only.

        draft: the draft as accelerate prepared it (call its forward through it, so that a DDP or FSDP
        wrapper takes part); model: the same draft unwrapped (to swap its head, e.g. with
        ``vocab_cut.loss_rows_head``)."""
        ...

    def save(self, draft: torch.nn.Module, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        """Write the draft into ``folder`` (``state``: the full state dict of a sharded model, else None)."""
        ...

    def files(self) -> tuple[str, ...]:
        """The files a complete saved draft of this kind holds."""
        ...

    def recognises(self, folder: Path) -> bool:
        """Whether ``folder`` holds a draft of this kind."""
        ...

    def load(
        self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype
    ) -> torch.nn.Module: ...

    def from_spec(self, spec: str, target: PreTrainedModel) -> torch.nn.Module | None:
        """An untrained draft named on the command line (``truncate:2``, ``early_exit:4``), or None."""
        ...

    def architecture(self, folder: Path) -> tuple[str, dict]:
        """(label, the config its step time depends on) of a saved draft, for sharing c between checkpoints."""
        ...

    def owns(self, draft: torch.nn.Module) -> bool:
        """Whether the model object ``draft`` is of this kind."""
        ...

    def check_publishable(self) -> None:
        """Refuse, saying why, a kind none of whose drafts can be published (before a job that would
        train and measure one to publish it, such as ``quickstart``)."""
        ...

    def check_export(self, folder: Path) -> None:
        """Refuse, saying why, a saved draft that cannot be published (before anything loads)."""
        ...

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        """Write ``draft`` into ``folder`` in the format its serving engine loads, with the measured
        ``serving`` settings where the format carries them."""
        ...

    def engine_config(self, folder: Path) -> dict:
        """vLLM's ``speculative_config`` for the exported draft in ``folder``, without
        ``num_speculative_tokens`` (e.g. ``{"method": "draft.model", "model": folder}``)."""
        ...

    def write_serving(self, draft: torch.nn.Module, folder: Path, serving: Serving) -> None:
        """Write the measured ``serving`` settings into the exported ``folder`` (``export`` calls it)."""
        ...

    def read_serving(self, folder: Path) -> Serving | None:
        """The serving settings ``write_serving`` wrote into ``folder`` (eval's defaults), or None."""
        ...

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        """What the draft is, in one clause of the model card (``folder``: the exported draft)."""
        ...

    def card_usage(self, target: str, draft_ref: str, gamma: int) -> list[str]:
        """The model card's usage section (markdown lines): each engine that runs the draft as written."""
        ...

    def check_decode_options(self, values: Mapping[str, object]) -> None:
        """Refuse decode options (``--draft-option``) this kind does not take, by name."""
        ...

    def decoding_report(self, target: PreTrainedModel, draft: torch.nn.Module, options: DecodeOptions) -> dict:
        """Figures ``draftsmith eval`` adds to its report for this kind ({} for none)."""
        ...

    def report_lines(self, report: PairReport) -> list[str]:
        """Lines ``draftsmith eval`` prints after its table about what ``decoding_report`` added
        (``report.kind_figures``)."""
        ...


def check_options(kind: str, values: Mapping[str, object], known: Mapping[str, type], where: str, what: str) -> None:
    """Refuse keys of ``values`` that ``known`` does not name, or values not of the type it gives, by name.

    kind: the kind's name; where: where the values were given (``draft.options:``, ``--draft-option``);
    what: what each key is (``an option``, ``a decode option``)."""
    for key, value in values.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            names = ", ".join(sorted(known)) or "none"
            raise DraftsmithError(f"{where} {key!r} is not {what} of {kind} drafts (known: {names}){hint}")
        wanted = known[key]
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise DraftsmithError(f"{where} {key} must be a {wanted.__name__}, got {value!r}")


# The draft settings a kind may not take (``refuse_settings``), by name: the DraftSettings field each one fills.
SETTING_FIELDS = {
    "draft.lora_r": "lora_r",
    "draft.vocab": "train_draft_vocab",
    "draft.config": "config",
    "draft.model": "model",
}


def refuse_settings(kind: str, settings: DraftSettings, names: Sequence[str], why: str) -> None:
    """Refuse the first of the settings ``names`` (keys of ``SETTING_FIELDS``) that is not left out:
    ``{kind} drafts {why}: leave out {name}``."""
    left_out = DraftSettings()
    for name in names:
        field_name = SETTING_FIELDS[name]
        if getattr(settings, field_name) != getattr(left_out, field_name):
            raise DraftsmithError(f"{kind} drafts {why}: leave out {name}")


def layer_count(layers: str, kind: str) -> int:
    """A layer count from ``draft.layers`` (e.g. the k shared layers of an early-exit draft)."""
    try:
        return int(layers)
    except ValueError as err:
        raise DraftsmithError(f"{kind} drafts take draft.layers as a layer count, got {layers!r}") from err


def serving_generation_config(config: GenerationConfig, serving: Serving) -> GenerationConfig:
    """A copy of ``config`` carrying ``serving``: transformers' assisted generation reads gamma from it
    (``configure_assistant``), draftsmith's decoder also the tree shape (transformers and vLLM ignore it)."""
    config = copy.deepcopy(config)
    configure_assistant(config, serving.gamma)
    if serving.tree is not None:
        config.draftsmith = {"tree": serving.tree}
    return config


def generation_serving(folder: Path) -> Serving | None:
    """The serving settings a folder's ``generation_config.json`` carries (``serving_generation_config``):
    gamma when it sets the constant schedule, with the tree shape when it has one; else None."""
    path = folder / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("num_assistant_tokens_schedule") != "constant" or "num_assistant_tokens" not in config:
        return None
    return Serving(gamma=config["num_assistant_tokens"], tree=config.get("draftsmith", {}).get("tree"))


def transformers_usage(target: str, draft_ref: str, gamma: int, note: str = "") -> list[str]:
    """The card's transformers snippet: assisted generation with the draft as ``assistant_model``."""
    return [
        f"transformers (assisted generation; `generation_config.json` sets {gamma} draft tokens per round, "
        f"the constant schedule and no confidence cut{note}):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'target = AutoModelForCausalLM.from_pretrained("{target}")',
        f'draft = AutoModelForCausalLM.from_pretrained("{draft_ref}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        'inputs = tokenizer("Why is the sky blue?", return_tensors="pt")',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
    ]


def draftsmith_usage(target: str, draft_ref: str, gamma: int) -> list[str]:
    """The card's usage for a draft no serving engine runs: draftsmith's own decoder."""
    return [
        "draftsmith's decoder (no serving engine runs this kind of draft):",
        "",
        "```bash",
        f"draftsmith eval --target {target} --draft {draft_ref} --gamma {gamma}",
        "```",
        "",
    ]


def vllm_usage(target: str, engine_config: dict, gamma: int) -> list[str]:
    """The card's vLLM snippet: the kind's ``engine_config`` with ``num_speculative_tokens``, as a literal."""
    config = {**engine_config, "num_speculative_tokens": gamma}
    return [
        f"vLLM (speculative decoding, method `{engine_config['method']}`):",
        "",
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{target}", speculative_config={config!r})',
        "```",
        "",
    ]


class OwnParameters(nn.Module):
    """A module whose device and dtype are those of its parameters (as a transformers model's are)."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class DraftModel(OwnParameters):
    """A draft model that decodes with its own (verifier, drafter) pair (``specdec.drafters.PairedDraft``),
    with what most such drafts share: its device and dtype are its parameters', a chain round costs
    one draft forward per proposal, and it decodes eager. A subclass writes ``decoding_pair``."""

    described_as = "this draft"  # how messages name it

    def round_forwards(self, gamma: int) -> int:
        """Draft forwards of a chain round of ``gamma`` proposals: one per proposal."""
        return gamma

    def decodes_compiled(self, target: PreTrainedModel, options: DecodeOptions) -> bool:
        """Eager; ``options.compile`` is refused."""
        if options.compile:
            raise DraftsmithError(f"{self.described_as} decodes eager; pass --no-compile")
        return False

    def decoding_pair(self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions):
        """(verifier, drafter) for ``batch_size`` sequences of up to ``capacity`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not build a decoding pair")

    def feature_verifier(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions, layers: tuple[int, ...]
    ) -> TargetVerifier:
        """The whole target as verifier, handing the drafter its states entering ``layers`` (for a draft
        that reads the target's hidden states); eager, and refused for another target's width or vocabulary."""
        self.decodes_compiled(target, options)
        if (target.config.hidden_size, target.config.vocab_size) != (self.config.hidden_size, self.config.vocab_size):
            raise DraftsmithError(
                f"{self.described_as} cannot decode with this target: it was made for another (hidden size or "
                "vocabulary differ)"
            )
        return TargetVerifier.for_options(target, batch_size, capacity, options, feature_layers=layers)


class KindBase:
    """``DraftKind`` with what most kinds do the same way; a kind subclasses it and overrides what differs.

    Class attributes: ``name``; ``model_class``: the class of its draft objects (``owns``);
    ``option_types``: its ``draft.options`` and their types (``check``); ``decode_options``: the
    decode options it takes; ``spec_help``: the drafts it names on the command line;
    ``standalone``: its folder is a causal LM transformers loads as an assistant (the card then
    shows transformers' usage); ``cuts_head``. The first of ``files()`` marks a folder of this
    kind (``recognises``).
    """

    name: str = ""
    model_class: type | tuple[type, ...] = ()
    option_types: Mapping[str, type] = {}
    decode_options: Mapping[str, DecodeOption] = {}
    spec_help: str = ""  # the drafts ``from_spec`` names, for ``--help`` ("" for none)
    standalone: bool = False
    cuts_head: bool = False

    def check(self, settings: DraftSettings) -> None:
        check_options(self.name, settings.options, self.option_types, "draft.options:", "an option")

    def teacher_dtype(self, settings: DraftSettings, resolved: torch.dtype) -> torch.dtype:
        return resolved

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> torch.nn.Module:
        raise NotImplementedError(f"the {self.name} kind does not build drafts")

    def target_parts(self, settings: DraftSettings, target_layers: int) -> TargetParts:
        """The embeddings, final norm and head, which most kinds copy (or apply to stored rows)."""
        return TargetParts()

    def teacher_layers(self, draft: torch.nn.Module) -> tuple[int, ...]:
        return ()

    def teacher_argmax(self, draft: torch.nn.Module) -> bool:
        return False

    def teacher_log_probs(self, draft: torch.nn.Module) -> bool:
        return False

    def training_forward(self, draft: torch.nn.Module, model: torch.nn.Module, batch: Batch) -> Predictions:
        """A causal-LM forward, the head run at the loss rows only (cut to ``batch.head_ids``)."""
        with vocab_cut.loss_rows_head(model, batch.rows, batch.head_ids):
            logits = draft(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        return Predictions(logits)  # (M, N or V)

    def save(self, draft: torch.nn.Module, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        raise NotImplementedError(f"the {self.name} kind does not save drafts")

    def files(self) -> tuple[str, ...]:
        raise NotImplementedError(f"the {self.name} kind names no files")

    def recognises(self, folder: Path) -> bool:
        return (folder / self.files()[0]).is_file()

    def load(self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        raise NotImplementedError(f"the {self.name} kind does not load drafts")

    def from_spec(self, spec: str, target: PreTrainedModel) -> torch.nn.Module | None:
        return None

    def architecture(self, folder: Path) -> tuple[str, dict]:
        """Every draft of the kind has the same step time unless a kind says what changes it."""
        return self.name, {}

    def owns(self, draft: torch.nn.Module) -> bool:
        return isinstance(draft, self.model_class)

    def check_publishable(self) -> None:
        """The drafts of most kinds are published."""

    def check_export(self, folder: Path) -> None:
        """Any saved draft of the kind can be published."""

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        """The draft as ``save`` writes it, with the serving settings (``write_serving``)."""
        self.save(draft, None, tokenizer, folder, "")
        self.write_serving(draft, folder, serving)

    def engine_config(self, folder: Path) -> dict:
        raise DraftsmithError(
            f"{folder} is a {self.name} draft, which no serving engine runs; evaluate it with draftsmith eval"
        )

    def write_serving(self, draft: torch.nn.Module, folder: Path, serving: Serving) -> None:
        """``generation_config.json`` carrying ``serving`` (``serving_generation_config``)."""
        serving_generation_config(draft.generation_config, serving).save_pretrained(folder)

    def read_serving(self, folder: Path) -> Serving | None:
        return generation_serving(folder)

    def card_description(self, settings: DraftSettings, folder: Path) -> str:
        return f"a {self.name} draft"

    def card_usage(self, target: str, draft_ref: str, gamma: int) -> list[str]:
        """transformers' usage for a standalone draft, vLLM's from ``engine_config``."""
        lines = ["", "## Usage", ""]
        if self.standalone:
            lines += transformers_usage(target, draft_ref, gamma)
        if type(self).engine_config is KindBase.engine_config:  # a kind no serving engine runs
            return lines + draftsmith_usage(target, draft_ref, gamma)
        return lines + vllm_usage(target, self.engine_config(Path(draft_ref)), gamma)

    def check_decode_options(self, values: Mapping[str, object]) -> None:
        known = {key: option.type for key, option in self.decode_options.items()}
        check_options(self.name, values, known, "--draft-option", "a decode option")

    def decoding_report(self, target: PreTrainedModel, draft: torch.nn.Module, options: DecodeOptions) -> dict:
        return {}

    def report_lines(self, report: PairReport) -> list[str]:
        return []
