"""The distillation run's config: sections of settings, from YAML plus overrides, validated up front.

A config groups its settings by what they configure (``draft:``, ``data:``, ``generate:``, ``teacher:``,
``loss:``, ``optim:``, ``on_policy:``, ``save:``, ``log:``, ``eval:``), beside the run's ``output_dir``,
``target``, ``device``, ``seed`` and ``resume``. Overrides name a setting by its dotted path
(``optim.lr=1e-3``, ``draft.layers=3``, ``draft.options.mask_token_id=0``). The flat keys of earlier
configs (``lr``, ``draft_layers``, ``kind_options``, ...) are still read, each with a one-line hint
naming its place (``LEGACY_KEYS``), so existing configs, overrides and run folders keep working.

Every run saves its resolved config as ``config.yaml``; ``load_run_config`` reads it back through
the same validation. ``--config`` takes a YAML path or the name of a config shipped in
``draftsmith.configs`` (``tiny``, ``smollm2-135m``, ...), so the shipped recipes run from any folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import LlamaConfig

from draftsmith.distill.data import ROW_FIELDS
from draftsmith.distill.drafts import DraftSettings, kind_named
from draftsmith.distill.losses import LOSSES
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text

TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # report_to values
RUN_CONFIG = "config.yaml"  # the resolved config inside every run folder


def failed(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the (holds, message) checks that do not hold, in order."""
    return [message for ok, message in checks if not ok]


@dataclass
class DraftSection:
    """The draft: its kind and how it starts. ``options`` are the kind's own settings, checked by the kind."""

    kind: str = "lm"  # lm | early_exit | eagle3 | parallel | dflash (draftsmith.distill.drafts)
    init: str = "truncate"  # lm: truncate | config | pretrained
    layers: str = "2"  # truncate: a count ("2") or indices ("0,1,29"); early_exit: k, the shared layers
    # the kind's own settings (early_exit: {adapter: false} leaves out its adapter layer; eagle3: ttt_steps, ...)
    options: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # init config: fields overriding the target's config
    model: str | None = None  # init pretrained: a small model with the target's tokenizer (folder, hub id, .gguf)
    lora_r: int = 0  # > 0: train a LoRA adapter of this rank instead of the full draft
    lora_alpha: int = 16
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    freeze_embeddings: bool = True  # keep the embeddings and LM head shared with the target frozen
    # > 0: train (and decode) with the draft's LM head cut to the N tokens most frequent in the training
    # answers (the run's draft_vocab.json, ranked before training starts) plus the EOS ids: logits, softmax
    # and loss over those N instead of the whole vocabulary. The loss compares the cut draft's q (zero
    # outside the N) with the target's p over its full vocabulary: TVD, reverse KL, JSD and accepted_length
    # exactly (the mass p puts outside is a constant the draft cannot accept); forward KL, infinite for
    # such a q, against p renormalized over the N. Checkpoints carry the cut (draft_vocab.json), so eval,
    # eval-run and publish decode with it; held-out alpha is still measured against the full target.
    # 0 = the full head.
    vocab: int = 0

    def problems(self) -> list[str]:
        """What is wrong with the section's own values (the kind checks the rest: ``DistillConfig``)."""
        return failed(
            (self.lora_r >= 0, "draft.lora_r must be >= 0"),
            (self.vocab >= 0, "draft.vocab must be >= 0 (0 = the full head)"),
        )


@dataclass
class DataSection:
    """What the draft trains on."""

    mode: str = "target"  # target: the target answers the prompts | text: the dataset's own text
    # builtin, a shipped dataset (smollm2-self), a `draftsmith data` folder, a .jsonl/.json/.csv/.parquet/.txt
    # file, a save_to_disk folder, or a hub dataset
    dataset: str = "builtin"
    split: str = "train"
    config: str | None = None  # a hub dataset's config name
    max_samples: int | None = None  # use the first this many rows of the dataset at most
    column_map: dict = field(default_factory=dict)  # field -> column, e.g. {prompt: question, completion: answer}
    skip_bad_rows: bool = False  # leave out rows without a usable prompt/text (counted) instead of stopping
    heldout: int = 8  # rows kept aside for the held-out acceptance rate
    max_length: int = 256
    # > 0: length-bucketed batches: the epoch's shuffled order is cut into windows of this many batches,
    # each window sorted by length and cut into batches, the batches shuffled (a function of seed and
    # epoch, so a resumed run sees the same batches); little padding. 0: plain shuffled batches
    bucket_batches: int = 0
    # train on a `draftsmith data` folder whose build has not finished (its manifest says incomplete)
    allow_incomplete: bool = False

    def problems(self) -> list[str]:
        return failed(
            (self.mode in ("text", "target"), "data.mode must be text or target"),
            (self.heldout >= 1, "data.heldout must be >= 1"),
            (self.max_length >= 8, "data.max_length must be >= 8"),
            (self.bucket_batches >= 0, "data.bucket_batches must be >= 0 (0 = plain shuffled batches)"),
            (
                self.max_samples is None or self.max_samples >= 1,
                "data.max_samples must be >= 1 (or left empty for all)",
            ),
        )


@dataclass
class GenerateSection:
    """The target's answers to the training prompts (data.mode target)."""

    max_new_tokens: int = 96
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 8
    samples: int = 1  # answers per training prompt (needs temperature > 0 when > 1)

    def problems(self) -> list[str]:
        return failed(
            (self.samples >= 1, "generate.samples must be >= 1"),
            (self.batch_size >= 1, f"generate.batch_size must be >= 1, got {self.batch_size}"),
            (
                self.samples == 1 or self.temperature > 0,
                "generate.samples > 1 needs generate.temperature > 0 (greedy answers would all be the same)",
            ),
        )


@dataclass
class OnPolicySection:
    """Micro-batches of the draft's own answers, scored by the target."""

    fraction: float = 0.0  # lambda: share of micro-batches replaced by the draft's own answers
    refresh_steps: int = 50  # regenerate the draft's answers every this many steps
    pool: int = 32  # prompts answered by the draft at each refresh

    def problems(self, live_teacher: bool) -> list[str]:
        """live_teacher: the target runs as teacher (``teacher.cache: false``), as the draft's answers need."""
        return failed(
            (0 <= self.fraction <= 1, "on_policy.fraction must be in [0, 1]"),
            (self.refresh_steps >= 1, "on_policy.refresh_steps must be >= 1"),
            (self.pool >= 1, "on_policy.pool must be >= 1"),
            (
                self.fraction == 0 or live_teacher,
                "on_policy.fraction > 0 needs the live target (teacher.cache: false): draft answers are new text",
            ),
        )


@dataclass
class TeacherSection:
    """The target as teacher."""

    device_map: str | None = None  # e.g. auto: spread the target over this process's GPUs
    # store the target's features once (top-k log-probs, the hidden states a kind reads): no target forward per step
    cache: bool = False
    top_k: int = 64
    cache_dtype: str = "bfloat16"  # the stored hidden states' dtype: bfloat16 | float16 | float32
    # when the store is filled: before training, or by the first epoch's live forwards (read after it)
    cache_fill: str = "before"  # before | first_epoch
    # the target's dtype as teacher and answer generator: auto = bfloat16 on CUDA and on CPUs with native
    # bfloat16 (as eval measures it), else float32; a kind may keep float32 (early_exit drafts share its layers)
    dtype: str = "auto"
    # read only the target's tensors the draft copies (embeddings, norm, head, the layers its init takes)
    # until something runs the target; false: load it whole at the start
    load_parts: bool = True
    # shard a live teacher over the processes of a launch (FSDP2), each holding 1/N of it: auto = when
    # there are several processes and the teacher runs (no store, or a store the first epoch fills)
    shard: str = "auto"  # auto | true | false

    def __post_init__(self) -> None:
        self.shard = self.shard.lower()  # a YAML true reads as the string True

    def problems(self) -> list[str]:
        return failed(
            (self.top_k >= 1, "teacher.top_k must be >= 1"),
            (
                self.cache_dtype in ("bfloat16", "float16", "float32"),
                f"teacher.cache_dtype must be bfloat16, float16 or float32, got {self.cache_dtype!r}",
            ),
            (
                self.cache_fill in ("before", "first_epoch"),
                f"teacher.cache_fill must be before or first_epoch, got {self.cache_fill!r}",
            ),
            (
                self.shard in ("auto", "true", "false"),
                f"teacher.shard must be auto, true or false, got {self.shard!r}",
            ),
            (
                self.dtype in ("auto", "float32", "bfloat16", "float16"),
                "teacher.dtype must be auto, float32, bfloat16 or float16",
            ),
        )


@dataclass
class LossSection:
    name: str = "tvd"  # forward_kl | reverse_kl | jsd | tvd | accepted_length
    temperature: float = 1.0
    jsd_beta: float = 0.5
    gamma: int = 4  # accepted_length: positions per window
    ce_weight: float = 0.0  # weight of hard-label cross-entropy mixed in

    def problems(self) -> list[str]:
        return failed(
            (self.name in LOSSES, f"loss.name must be one of {', '.join(LOSSES)}"),
            (self.temperature > 0, "loss.temperature must be > 0"),
            (0 < self.jsd_beta < 1, "loss.jsd_beta must be in (0, 1)"),
            (self.gamma >= 1, "loss.gamma must be >= 1"),
            (0 <= self.ce_weight <= 1, "loss.ce_weight must be in [0, 1]"),
        )


@dataclass
class OptimSection:
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5
    max_steps: int = 100
    # a budget of training minutes: after its first steps the run plans how many steps fit (at most
    # max_steps) from the step time it measured, and decays its schedule to that step (train.budget);
    # None: max_steps steps
    max_minutes: float | None = None
    budget_checkpoints: int = 3  # with max_minutes: checkpoints spread over the planned steps (save.steps unused)
    batch_size: int = 8  # sequences per process per micro-batch
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where the device has native bfloat16)

    def problems(self) -> list[str]:
        minutes = self.max_minutes
        return failed(
            (self.max_steps >= 1, "optim.max_steps must be >= 1"),
            (
                minutes is None or (isinstance(minutes, (int, float)) and 0 < minutes < float("inf")),
                f"optim.max_minutes must be minutes > 0 (or null for optim.max_steps alone), got {minutes!r}",
            ),
            (self.budget_checkpoints >= 1, "optim.budget_checkpoints must be >= 1"),
            (self.batch_size >= 1, "optim.batch_size must be >= 1"),
            (self.grad_accum >= 1, "optim.grad_accum must be >= 1"),
            (self.lr > 0, "optim.lr must be > 0"),
            (
                self.mixed_precision in ("no", "bf16", "fp16", "auto"),
                "optim.mixed_precision must be no, bf16, fp16 or auto",
            ),
        )


@dataclass
class SaveSection:
    steps: int = 50  # a checkpoint every this many steps
    keep_last: int = 3

    def problems(self) -> list[str]:
        return failed(
            (self.steps >= 1, "save.steps must be >= 1"), (self.keep_last >= 1, "save.keep_last must be >= 1")
        )


@dataclass
class LogSection:
    steps: int = 10  # held-out metrics, a console line and the trackers' record every this many steps
    report_to: str = "none"  # none, or experiment trackers (accelerate log_with): tensorboard, wandb, trackio

    def problems(self) -> list[str]:
        return failed(
            (self.steps >= 1, "log.steps must be >= 1"),
            (
                all(name in TRACKERS for name in self.report_to.split(",")),
                f"log.report_to must be none or a comma-separated list of {', '.join(TRACKERS[1:])}",
            ),
        )


@dataclass
class EvalSection:
    """Real speedup measured during training (main process)."""

    speedup_steps: int = 0  # > 0: every this many steps, measure real speedup on the prompts
    prompts: str = "builtin"  # prompts JSONL; builtin = distill/data/eval_prompts.jsonl
    limit: int = 4  # prompts used
    max_new_tokens: int = 48
    gammas: list = field(default_factory=lambda: [1, 2, 4])

    def problems(self) -> list[str]:
        return failed(
            (self.speedup_steps >= 0, "eval.speedup_steps must be >= 0"),
            (
                bool(self.gammas) and all(isinstance(g, int) and g >= 1 for g in self.gammas),
                "eval.gammas must be a list of integers >= 1",
            ),
            (self.limit >= 1, f"eval.limit must be >= 1 (prompts measured in training), got {self.limit}"),
            (self.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}"),
        )


@dataclass
class DistillConfig:
    output_dir: str = "runs/distill"  # run folder: checkpoints, metrics.jsonl, config.yaml
    target: str = "smollm2-135m-instruct"  # folder, .gguf, hub id, alias, or "tiny" (a random model from tiny_target)
    tiny_target: dict = field(default_factory=dict)  # LlamaConfig fields for target "tiny"
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps | xpu
    seed: int = 0
    # resuming with a changed training setting (loss, lr, ...) is refused; force accepts it and records it
    resume: str = "auto"  # auto | force
    draft: DraftSection = field(default_factory=DraftSection)
    data: DataSection = field(default_factory=DataSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    on_policy: OnPolicySection = field(default_factory=OnPolicySection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    save: SaveSection = field(default_factory=SaveSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise DraftsmithError(f"config: {problems[0]}")
        try:
            kind_named(self.draft.kind).check(draft_settings(self))
        except DraftsmithError as err:
            raise DraftsmithError(f"config: {err}") from err

    def problems(self) -> list[str]:
        """What is wrong with the settings, in the order checked: each section's values, then the
        run-wide settings (the draft's kind is checked after)."""
        return [
            *self.draft.problems(),
            *self.teacher.problems(),
            *self.eval.problems(),
            *self.on_policy.problems(live_teacher=not self.teacher.cache),
            *self.data.problems(),
            *self.generate.problems(),
            *self.loss.problems(),
            *self.optim.problems(),
            *self.save.problems(),
            *self.log.problems(),
            *self.run_problems(),
        ]

    def run_problems(self) -> list[str]:
        """What is wrong with the run-wide settings (device, output_dir, resume)."""
        return failed(
            (
                re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", self.device) is not None,
                f"device must be auto, cpu, cuda, cuda:N, mps or xpu, got {self.device!r}",
            ),
            (
                not Path(self.output_dir).is_file(),
                f"output_dir {self.output_dir} is an existing file; give a folder path (new, or a run to resume)",
            ),
            (self.resume in ("auto", "force"), "resume must be auto or force"),
        )


SECTION_TYPES = {
    name: kind for name, kind in typing.get_type_hints(DistillConfig).items() if dataclasses.is_dataclass(kind)
}
SECTIONS = tuple(SECTION_TYPES)


def by_section(values: dict[str, object]) -> tuple[dict[str, object], dict[str, dict[str, object]]]:
    """Settings by dotted name, split into the run-wide ones and {section: {key: value}}."""
    top: dict[str, object] = {}
    sections: dict[str, dict[str, object]] = {}
    for name, value in values.items():
        section, _, key = name.partition(".")
        if key:
            sections.setdefault(section, {})[key] = value
        else:
            top[name] = value
    return top, sections


def draft_settings(cfg: DistillConfig) -> DraftSettings:
    """The config's draft section (and what the kinds read beside it), as the drafter kinds take them:
    each setting under its own name, but ``vocab`` (``train_draft_vocab``)."""
    section = {f.name: getattr(cfg.draft, f.name) for f in dataclasses.fields(DraftSection)}
    vocab, modules = section.pop("vocab"), tuple(section.pop("lora_target_modules"))
    beside = {"teacher_dtype": cfg.teacher.dtype, "loss": cfg.loss.name}
    return DraftSettings(**section, lora_target_modules=modules, train_draft_vocab=vocab, **beside)


# The flat keys of earlier configs and where each setting lives now.
LEGACY_KEYS = {
    "draft_kind": "draft.kind",
    "draft_init": "draft.init",
    "draft_layers": "draft.layers",
    "kind_options": "draft.options",
    "draft_config": "draft.config",
    "draft_model": "draft.model",
    "lora_r": "draft.lora_r",
    "lora_alpha": "draft.lora_alpha",
    "lora_target_modules": "draft.lora_target_modules",
    "freeze_embeddings": "draft.freeze_embeddings",
    "train_draft_vocab": "draft.vocab",
    "data": "data.mode",
    "dataset": "data.dataset",
    "dataset_split": "data.split",
    "dataset_config": "data.config",
    "max_samples": "data.max_samples",
    "column_map": "data.column_map",
    "skip_bad_rows": "data.skip_bad_rows",
    "heldout": "data.heldout",
    "max_length": "data.max_length",
    "bucket_batches": "data.bucket_batches",
    "allow_incomplete": "data.allow_incomplete",
    "gen_max_new_tokens": "generate.max_new_tokens",
    "gen_temperature": "generate.temperature",
    "gen_top_p": "generate.top_p",
    "gen_batch_size": "generate.batch_size",
    "gen_samples": "generate.samples",
    "on_policy_fraction": "on_policy.fraction",
    "on_policy_refresh_steps": "on_policy.refresh_steps",
    "on_policy_pool": "on_policy.pool",
    "teacher_device_map": "teacher.device_map",
    "teacher_cache": "teacher.cache",
    "teacher_top_k": "teacher.top_k",
    "teacher_cache_dtype": "teacher.cache_dtype",
    "teacher_cache_fill": "teacher.cache_fill",
    "teacher_dtype": "teacher.dtype",
    "loss": "loss.name",
    "loss_temperature": "loss.temperature",
    "jsd_beta": "loss.jsd_beta",
    "loss_gamma": "loss.gamma",
    "ce_weight": "loss.ce_weight",
    **{
        name: f"optim.{name}"
        for name in (
            "lr",
            "weight_decay",
            "warmup_steps",
            "max_steps",
            "max_minutes",
            "budget_checkpoints",
            "batch_size",
            "grad_accum",
            "max_grad_norm",
            "mixed_precision",
        )
    },
    "save_steps": "save.steps",
    "keep_last": "save.keep_last",
    "log_steps": "log.steps",
    "report_to": "log.report_to",
    "eval_speedup_steps": "eval.speedup_steps",
    "eval_prompts": "eval.prompts",
    "eval_limit": "eval.limit",
    "eval_max_new_tokens": "eval.max_new_tokens",
    "eval_gammas": "eval.gammas",
}


def setting_types() -> dict[str, object]:
    """{dotted name: type} of every setting: ``output_dir``, ``draft.kind``, ``optim.lr``, ..."""
    types_: dict[str, object] = {}
    for name, kind in typing.get_type_hints(DistillConfig).items():
        if name in SECTION_TYPES:
            types_.update({f"{name}.{key}": t for key, t in typing.get_type_hints(kind).items()})
        else:
            types_[name] = kind
    return types_


def dotted_name(key: str) -> str:
    """The dotted name of a setting given by name or by an old flat key (``lr`` -> ``optim.lr``)."""
    return LEGACY_KEYS.get(key, key)


def _coerce(name: str, kind, value):
    """Turn a YAML value or a command-line string into the setting's type, or say which setting is wrong."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None  # an optional setting left empty (as a saved config writes it)
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind in (dict, list):
            value = yaml.safe_load(value) if isinstance(value, str) else value
            if value is None:
                value = kind()
            if not isinstance(value, kind):
                raise ValueError
            return value
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError) as err:
        raise DraftsmithError(f"config {name}: {value!r} is not a valid {kind.__name__}") from err


class _Settings:
    """Settings gathered by dotted name from a file and overrides, old flat keys mapped (with a hint)."""

    def __init__(self, quiet: bool) -> None:
        self.types = setting_types()
        self.values: dict[str, object] = {}
        self.entries: dict[str, dict[str, object]] = {}  # draft.options.x=...: keys set inside a mapping
        self.quiet = quiet
        self.moved: dict[str, dict[str, str]] = {}  # where -> {old flat key: dotted name}, for one hint each

    def known(self) -> set[str]:
        return set(self.types) | set(LEGACY_KEYS)

    def name(self, key: str, where: str) -> str:
        """The dotted name a key given as ``key`` stands for; old flat keys are mapped with a hint."""
        if key in self.types:
            return key
        if key in LEGACY_KEYS:
            self.moved.setdefault(where, {})[key] = LEGACY_KEYS[key]
            return LEGACY_KEYS[key]
        close = [dotted_name(name) for name in difflib.get_close_matches(key, self.known(), n=1)]
        hint = (
            f"did you mean {close[0]}?" if close else "see the settings of a shipped config: draftsmith distill --help"
        )
        raise DraftsmithError(f"{where}unknown config key {key!r} ({hint})")

    def read_file(self, path: str, mapping: dict) -> None:
        where = f"{path}: "
        for key, value in mapping.items():
            if key in SECTIONS and (isinstance(value, dict) or value is None):
                for sub, item in (value or {}).items():
                    name = f"{key}.{sub}"
                    if name not in self.types:
                        close = difflib.get_close_matches(name, self.types, n=1)
                        hint = f"did you mean {close[0]}?" if close else f"{key} has: {self._section(key)}"
                        raise DraftsmithError(f"{where}unknown config key {name!r} ({hint})")
                    if name in self.values:
                        raise DraftsmithError(f"{where}{name} is set twice (flat and in its section); keep one")
                    self.values[name] = item
            elif key in SECTIONS and key not in LEGACY_KEYS:
                raise DraftsmithError(f"{where}{key} must be a mapping of its settings ({self._section(key)})")
            else:
                name = self.name(key, where)
                if name in self.values:
                    raise DraftsmithError(f"{where}{key} and {name} set the same setting; keep one")
                self.values[name] = value

    def _section(self, section: str) -> str:
        return ", ".join(n.split(".", 1)[1] for n in self.types if n.startswith(section + "."))

    def override(self, item: str, given: set[str]) -> None:
        if "=" not in item:
            raise DraftsmithError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        key, value = item.split("=", 1)
        inner = None
        if key not in self.types and key not in LEGACY_KEYS:  # draft.options.mask_token_id: a key in a mapping
            for name, kind in self.types.items():
                if kind is dict and key.startswith(name + "."):
                    key, inner = name, key[len(name) + 1 :]
                    break
        if key in SECTIONS and key not in LEGACY_KEYS:  # optim=5: a whole section given one value
            first = self._section(key).split(", ")[0]
            raise DraftsmithError(
                f"overrides: {key} is a section, not a setting; set a key in it, e.g. {key}.{first}={value} "
                f"(its keys: {self._section(key)})"
            )
        name = self.name(key, "overrides: ")
        full = f"{name}.{inner}" if inner else name
        if full in given:
            raise DraftsmithError(f"override {full}= is given twice; keep one")
        given.add(full)
        if inner:
            self.entries.setdefault(name, {})[inner] = yaml.safe_load(value) if value else value
        else:
            self.values[name] = value

    def hint(self) -> None:
        """One line per source of old flat keys, naming where each now lives."""
        for where, moved in self.moved.items():
            if moved and not self.quiet:
                pairs = ", ".join(f"{old} -> {new}" for old, new in moved.items())
                print(f"config: {where}old flat keys, still read; their grouped names: {pairs}", file=sys.stderr)

    def build(self) -> DistillConfig:
        coerced = {name: _coerce(name, self.types[name], value) for name, value in self.values.items()}
        for name, entries in self.entries.items():
            coerced[name] = {**coerced.get(name, {}), **entries}
        check_sections(coerced)
        top, sections = by_section(coerced)
        return DistillConfig(**top, **{name: SECTION_TYPES[name](**values) for name, values in sections.items()})


def load_config(cls, path: str | None, overrides: list[str], quiet: bool = False) -> DistillConfig:
    """A ``DistillConfig`` from an optional YAML file and ``key=value`` overrides (dotted names, or the old
    flat keys with a hint on stderr unless ``quiet``); unknown keys are refused, in nested mappings too
    (``check_sections``)."""
    if cls is not DistillConfig:
        raise TypeError(f"load_config builds DistillConfig, not {cls.__name__}")
    settings = _Settings(quiet)
    if path is not None:
        settings.read_file(path, read_yaml(Path(path)))
    given: set[str] = set()
    for item in overrides:
        settings.override(item, given)
    settings.hint()
    return settings.build()


def flat_settings(config: DistillConfig | dict) -> dict[str, object]:
    """{dotted name: value} of a config, or of a saved config's mapping (grouped, or the old flat keys)."""
    mapping = dataclasses.asdict(config) if isinstance(config, DistillConfig) else config
    flat: dict[str, object] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and key in SECTIONS:
            flat.update({f"{key}.{sub}": item for sub, item in value.items()})
        else:
            flat[dotted_name(key)] = value
    return flat


def with_settings(config: DistillConfig, values: dict[str, object]) -> DistillConfig:
    """A copy of ``config`` with the settings named by dotted name in ``values`` replaced (and checked)."""
    top, sections = by_section(values)
    replaced = {name: dataclasses.replace(getattr(config, name), **subs) for name, subs in sections.items()}
    return dataclasses.replace(config, **top, **replaced)


def read_yaml(file: Path) -> dict:
    """A config file's mapping; an empty file, a duplicated key (at any depth) or another top level is refused."""
    if not file.is_file():
        raise DraftsmithError(f"config file not found: {file} (shipped configs: {', '.join(shipped_configs())})")
    try:
        loaded = yaml.load(file.read_text(), Loader=UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise DraftsmithError(f"{file}: not valid YAML: {' '.join(str(err).split())}") from err
    if loaded is None:
        raise DraftsmithError(
            f"{file} is empty; a config says what to distill: start from a copy of a shipped config "
            f"({', '.join(shipped_configs())})"
        )
    if not isinstance(loaded, dict):
        raise DraftsmithError(f"{file}: the top level must be a mapping of config keys")
    return loaded


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1})"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def known_hint(key: str, known: set[str]) -> str:
    """``did you mean X?`` for a near miss, else the known keys listed."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"


def check_sections(values: dict) -> None:
    """Unknown keys inside the nested mappings whose keys are known without loading a model."""
    if "tiny_target" in values:
        known = set(LlamaConfig().to_dict())
        for key in values["tiny_target"]:
            if key not in known:
                raise DraftsmithError(
                    f"config tiny_target: unknown LlamaConfig field {key!r} ({known_hint(key, known)})"
                )
    if "data.column_map" in values:
        known = {*ROW_FIELDS, "category"}
        for key in values["data.column_map"]:
            if key not in known:
                raise DraftsmithError(f"config data.column_map: unknown field {key!r} ({known_hint(key, known)})")


def save_config(config: DistillConfig, path: Path) -> None:
    write_text(path, yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))


def load_run_config(run_dir: Path) -> DistillConfig:
    """The validated config a run was made with (its ``config.yaml``; a run saved with the old flat keys too)."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise DraftsmithError(f"{run_dir} is not a distillation run folder (no {RUN_CONFIG})")
    return load_config(DistillConfig, str(path), [], quiet=True)


def shipped_configs() -> list[str]:
    """Names of the configs installed with draftsmith (``draftsmith.configs``)."""
    folder = importlib.resources.files("draftsmith.configs")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def config_path(name: str) -> str:
    """A config file path as given, or the shipped config ``name`` (``tiny`` or ``tiny.yaml``)."""
    if Path(name).is_file():
        return name
    shipped = importlib.resources.files("draftsmith.configs") / (name if name.endswith(".yaml") else f"{name}.yaml")
    if "/" not in name and shipped.is_file():
        return str(shipped)
    if Path(name).is_dir():
        raise DraftsmithError(
            f"config {name} is a folder; give a YAML file or a shipped config ({', '.join(shipped_configs())})"
        )
    raise DraftsmithError(
        f"config not found: {name} (give a YAML file, or the name of a shipped config: {', '.join(shipped_configs())})"
    )
