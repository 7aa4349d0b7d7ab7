"""The distillation run's config: one dataclass, from YAML plus ``key=value`` overrides, validated up front.

Every run saves its resolved config as ``config.yaml``; ``load_run_config`` reads it back through
the same validation. ``--config`` takes a YAML path or the name of a config shipped in
``draftsmith.configs`` (``tiny``, ``smollm2-135m``, ...), so the shipped recipes run from any folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
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


@dataclass
class DistillConfig:
    output_dir: str = "runs/distill"  # run folder: checkpoints, metrics.jsonl, config.yaml
    # models
    target: str = "smollm2-135m-instruct"  # folder, .gguf, hub id, alias, or "tiny" (a random model from tiny_target)
    tiny_target: dict = field(default_factory=dict)  # LlamaConfig fields for target "tiny"
    draft_kind: str = "lm"  # lm (a standalone causal LM) | early_exit (the target's first k layers + exit head)
    draft_init: str = "truncate"  # lm: truncate | config | pretrained
    draft_layers: str = "2"  # truncate: a count ("2") or indices ("0,1,29"); early_exit: k, the shared layers
    # the kind's own settings, checked by the kind (early_exit: {adapter: false} leaves out its adapter layer)
    kind_options: dict = field(default_factory=dict)
    draft_config: dict = field(default_factory=dict)  # config: fields overriding the target's config
    draft_model: str | None = None  # pretrained: a small model with the target's tokenizer (folder, hub id, .gguf)
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
    train_draft_vocab: int = 0
    # data
    data: str = "target"  # text | target
    # builtin, a shipped dataset (smollm2-self), a `draftsmith data` folder, a .jsonl/.json/.csv/.parquet/.txt
    # file, a save_to_disk folder, or a hub dataset
    dataset: str = "builtin"
    dataset_split: str = "train"
    dataset_config: str | None = None  # a hub dataset's config name
    max_samples: int | None = None  # use the first this many rows of the dataset at most
    column_map: dict = field(default_factory=dict)  # field -> column, e.g. {prompt: question, completion: answer}
    skip_bad_rows: bool = False  # leave out rows without a usable prompt/text (counted) instead of stopping
    heldout: int = 8  # rows kept aside for the held-out acceptance rate
    max_length: int = 256
    gen_max_new_tokens: int = 96  # target mode: answer length
    gen_temperature: float = 0.0
    gen_top_p: float = 1.0
    gen_batch_size: int = 8
    gen_samples: int = 1  # target mode: answers per training prompt (needs gen_temperature > 0 when > 1)
    on_policy_fraction: float = 0.0  # lambda: share of micro-batches replaced by the draft's own answers
    on_policy_refresh_steps: int = 50  # regenerate the draft's answers every this many steps
    on_policy_pool: int = 32  # prompts answered by the draft at each refresh
    # train on a `draftsmith data` folder whose build has not finished (its manifest says incomplete)
    allow_incomplete: bool = False
    # teacher
    teacher_device_map: str | None = None  # e.g. auto: spread the target over this process's GPUs
    # store the target's features once (top-k log-probs, the hidden states a kind reads): no target forward per step
    teacher_cache: bool = False
    teacher_top_k: int = 64
    # the storage dtype of the target's hidden states in the teacher store (kinds that read them)
    teacher_cache_dtype: str = "bfloat16"  # bfloat16 | float16 | float32
    # when the store is filled: before training, or by the first epoch's live forwards (read after it)
    teacher_cache_fill: str = "before"  # before | first_epoch
    # the target's dtype as teacher and answer generator: auto = bfloat16 on CUDA and on CPUs with native
    # bfloat16 (as eval measures it), else float32; a kind may keep float32 (early_exit drafts share its layers)
    teacher_dtype: str = "auto"
    # loss
    loss: str = "tvd"  # forward_kl | reverse_kl | jsd | tvd | accepted_length
    loss_temperature: float = 1.0
    jsd_beta: float = 0.5
    loss_gamma: int = 4  # accepted_length: positions per window
    ce_weight: float = 0.0  # weight of hard-label cross-entropy mixed in
    # optimization
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 5
    max_steps: int = 100
    # a budget of training minutes: after its first steps the run plans how many steps fit (at most
    # max_steps) from the step time it measured, and decays its schedule to that step (train.budget);
    # None: max_steps steps
    max_minutes: float | None = None
    budget_checkpoints: int = 3  # with max_minutes: checkpoints spread over the planned steps (save_steps unused)
    batch_size: int = 8  # sequences per process per micro-batch
    grad_accum: int = 1
    # > 0: length-bucketed batches: the epoch's shuffled order is cut into windows of this many batches,
    # each window sorted by length and cut into batches, the batches shuffled (a function of seed and
    # epoch, so a resumed run sees the same batches); little padding. 0: plain shuffled batches
    bucket_batches: int = 0
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where the device has native bfloat16)
    seed: int = 0
    # bookkeeping
    save_steps: int = 50
    keep_last: int = 3
    log_steps: int = 10  # held-out metrics, a console line and the trackers' record every this many steps
    report_to: str = "none"  # none, or experiment trackers (accelerate log_with): tensorboard, wandb, trackio
    eval_speedup_steps: int = 0  # > 0: every this many steps, measure real speedup on eval_prompts (main process)
    eval_prompts: str = "builtin"  # prompts JSONL for that; builtin = distill/data/eval_prompts.jsonl
    eval_limit: int = 4  # prompts used
    eval_max_new_tokens: int = 48
    eval_gammas: list = field(default_factory=lambda: [1, 2, 4])
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps | xpu
    # resuming with a changed training setting (loss, lr, ...) is refused; force accepts it and records it
    resume: str = "auto"  # auto | force

    def __post_init__(self) -> None:
        checks = [
            (self.lora_r >= 0, "lora_r must be >= 0"),
            (self.train_draft_vocab >= 0, "train_draft_vocab must be >= 0 (0 = the full head)"),
            (self.teacher_top_k >= 1, "teacher_top_k must be >= 1"),
            (
                self.teacher_cache_dtype in ("bfloat16", "float16", "float32"),
                f"teacher_cache_dtype must be bfloat16, float16 or float32, got {self.teacher_cache_dtype!r}",
            ),
            (
                self.teacher_cache_fill in ("before", "first_epoch"),
                f"teacher_cache_fill must be before or first_epoch, got {self.teacher_cache_fill!r}",
            ),
            (self.eval_speedup_steps >= 0, "eval_speedup_steps must be >= 0"),
            (
                bool(self.eval_gammas) and all(isinstance(g, int) and g >= 1 for g in self.eval_gammas),
                "eval_gammas must be a list of integers >= 1",
            ),
            (0 <= self.on_policy_fraction <= 1, "on_policy_fraction must be in [0, 1]"),
            (self.on_policy_refresh_steps >= 1, "on_policy_refresh_steps must be >= 1"),
            (self.on_policy_pool >= 1, "on_policy_pool must be >= 1"),
            (
                self.on_policy_fraction == 0 or not self.teacher_cache,
                "on_policy_fraction > 0 needs the live target (teacher_cache: false): draft answers are new text",
            ),
            (self.data in ("text", "target"), "data must be text or target"),
            (self.loss in LOSSES, f"loss must be one of {', '.join(LOSSES)}"),
            (self.max_steps >= 1, "max_steps must be >= 1"),
            (
                self.max_minutes is None
                or (isinstance(self.max_minutes, (int, float)) and 0 < self.max_minutes < float("inf")),
                f"max_minutes must be a number of minutes > 0 (or null for max_steps alone), got {self.max_minutes!r}",
            ),
            (self.budget_checkpoints >= 1, "budget_checkpoints must be >= 1"),
            (self.save_steps >= 1, "save_steps must be >= 1"),
            (self.keep_last >= 1, "keep_last must be >= 1"),
            (self.log_steps >= 1, "log_steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.grad_accum >= 1, "grad_accum must be >= 1"),
            (self.bucket_batches >= 0, "bucket_batches must be >= 0 (0 = plain shuffled batches)"),
            (self.lr > 0, "lr must be > 0"),
            (self.max_length >= 8, "max_length must be >= 8"),
            (self.loss_temperature > 0, "loss_temperature must be > 0"),
            (0 < self.jsd_beta < 1, "jsd_beta must be in (0, 1)"),
            (self.loss_gamma >= 1, "loss_gamma must be >= 1"),
            (0 <= self.ce_weight <= 1, "ce_weight must be in [0, 1]"),
            (self.mixed_precision in ("no", "bf16", "fp16", "auto"), "mixed_precision must be no, bf16, fp16 or auto"),
            (
                self.teacher_dtype in ("auto", "float32", "bfloat16", "float16"),
                "teacher_dtype must be auto, float32, bfloat16 or float16",
            ),
            (self.heldout >= 1, "heldout must be >= 1"),
            (self.gen_samples >= 1, "gen_samples must be >= 1"),
            (self.gen_batch_size >= 1, f"gen_batch_size must be >= 1, got {self.gen_batch_size}"),
            (self.eval_limit >= 1, f"eval_limit must be >= 1 (prompts measured in training), got {self.eval_limit}"),
            (self.eval_max_new_tokens >= 1, f"eval_max_new_tokens must be >= 1, got {self.eval_max_new_tokens}"),
            (
                self.gen_samples == 1 or self.gen_temperature > 0,
                "gen_samples > 1 needs gen_temperature > 0 (greedy answers would all be the same)",
            ),
        ]
        checks += [
            (
                re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", self.device) is not None,
                f"device must be auto, cpu, cuda, cuda:N, mps or xpu, got {self.device!r}",
            ),
            (
                not Path(self.output_dir).is_file(),
                f"output_dir {self.output_dir} is an existing file; give a folder path (new, or a run to resume)",
            ),
            (self.resume in ("auto", "force"), "resume must be auto or force"),
            (self.max_samples is None or self.max_samples >= 1, "max_samples must be >= 1 (or left empty for all)"),
            (
                all(name in TRACKERS for name in self.report_to.split(",")),
                f"report_to must be none or a comma-separated list of {', '.join(TRACKERS[1:])}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise DraftsmithError(f"config: {message}")
        try:
            kind_named(self.draft_kind).check(draft_settings(self))
        except DraftsmithError as err:
            raise DraftsmithError(f"config: {err}") from err


def draft_settings(cfg: DistillConfig) -> DraftSettings:
    """The config's draft fields, as the drafter kinds take them."""
    return DraftSettings(
        kind=cfg.draft_kind,
        init=cfg.draft_init,
        layers=cfg.draft_layers,
        config=cfg.draft_config,
        model=cfg.draft_model,
        lora_r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_target_modules=tuple(cfg.lora_target_modules),
        freeze_embeddings=cfg.freeze_embeddings,
        options=cfg.kind_options,
        train_draft_vocab=cfg.train_draft_vocab,
        teacher_dtype=cfg.teacher_dtype,
        loss=cfg.loss,
    )


def _coerce(name: str, kind, value):
    """Turn a YAML value or a command-line string into the field's type, or say which field is wrong."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None:  # an optional field left empty (as a saved config writes it)
            return None
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
            if not isinstance(value, kind):
                raise ValueError
            return value
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError) as err:
        raise DraftsmithError(f"config field {name!r}: {value!r} is not a valid {kind.__name__}") from err


def load_config(cls, path: str | None, overrides: list[str]):
    """Build ``cls`` from an optional YAML file and ``key=value`` overrides; unknown keys are refused,
    in nested sections too (``check_sections``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict = {}
    if path is not None:
        for key, value in read_yaml(Path(path)).items():
            if key not in fields:
                raise DraftsmithError(f"{path}: unknown config key {key!r} ({known_hint(key, fields)})")
            values[key] = value
    given: set[str] = set()
    for item in overrides:
        if "=" not in item:
            raise DraftsmithError(f"override {item!r} must look like key=value")
        key, value = item.split("=", 1)
        if key not in fields:
            raise DraftsmithError(f"unknown config key {key!r} in override ({known_hint(key, fields)})")
        if key in given:
            raise DraftsmithError(f"override {key}= is given twice; keep one")
        given.add(key)
        values[key] = value
    values = {k: _coerce(k, hints[k], v) for k, v in values.items()}
    check_sections(values)
    return cls(**values)


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
    """Unknown keys inside the nested sections whose keys are known without loading a model."""
    if "tiny_target" in values:
        known = set(LlamaConfig().to_dict())
        for key in values["tiny_target"]:
            if key not in known:
                raise DraftsmithError(
                    f"config tiny_target: unknown LlamaConfig field {key!r} ({known_hint(key, known)})"
                )
    if "column_map" in values:
        known = {*ROW_FIELDS, "category"}
        for key in values["column_map"]:
            if key not in known:
                raise DraftsmithError(f"config column_map: unknown field {key!r} ({known_hint(key, known)})")


def save_config(config, path: Path) -> None:
    write_text(path, yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))


def load_run_config(run_dir: Path) -> DistillConfig:
    """The validated config a run was made with (its ``config.yaml``)."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise DraftsmithError(f"{run_dir} is not a distillation run folder (no {RUN_CONFIG})")
    return load_config(DistillConfig, str(path), [])


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
