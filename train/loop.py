"""The distillation recipe: ``setup`` builds a Run, ``train_step`` makes one optimizer step,
``on_step_end`` logs, evaluates and saves, and ``train`` reads top to bottom.

Runs on one CPU, one GPU or N processes under ``accelerate launch`` / ``torchrun``. The teacher
(target) is frozen and is not wrapped by accelerate; only the draft is trained. Every loss is a
sum over valid tokens divided by the global count of valid tokens in the optimizer step (all
micro-batches of the accumulation window, all processes), so each token weighs the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torchmetrics
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from draftsmith.distill import data as ddata
from draftsmith.distill import vocab_cut
from draftsmith.distill.drafts import kind_named, kind_of_model, lm
from draftsmith.distill.drafts.kind import Batch, DraftKind, Predictions
from draftsmith.distill.drafts.lm import count_parameters
from draftsmith.distill.losses import row_acceptance, row_cross_entropy, row_token_losses
from draftsmith.distill.on_policy import OnPolicyMixer, OnPolicySettings, example_prompt
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.clock import eval_mode
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text
from draftsmith.specdec.loading import eos_token_ids, resolve_device
from draftsmith.specdec.measure.costs import measure_cost_ratio
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.partial_model import count_loaded, is_loaded, load_whole
from draftsmith.specdec.prompts import read_prompts
from draftsmith.train import budget, checkpoint, cpu_setup, speedup
from draftsmith.train.config import RUN_CONFIG, DistillConfig, flat_settings, save_config, with_settings
from draftsmith.train.examples import (
    Teacher,
    TeacherRows,
    build_examples,
    generation,
    heldout_teacher,
    loaders,
    teacher,
    teacher_settings,
)
from draftsmith.train.models import build_models, in_dtype_of, mixed_precision
from draftsmith.train.sharding import TeacherForward, shard_teacher

LOGS = ("metrics.jsonl", "losses.jsonl", "speedup.jsonl")  # one JSON record per line, each with its "step"


@dataclass
class LossHead:
    """Where a training forward applies the draft's head: the unwrapped draft, at the loss rows, over
    the kept token ids of a cut head (None: the full head); the draft's kind runs the forward."""

    model: torch.nn.Module  # the draft unwrapped (a DDP wrapper calls its head)
    ids: torch.Tensor | None  # (N,)
    vocab_size: int
    kind: DraftKind = lm.KIND


@dataclass
class Run:
    """Everything a distillation run holds between steps."""

    cfg: DistillConfig
    accelerator: Accelerator
    run_dir: Path
    target: PreTrainedModel  # the frozen teacher, not wrapped by accelerate
    tokenizer: PreTrainedTokenizerBase
    draft: torch.nn.Module  # prepared by accelerate (wrapped for DDP / FSDP when distributed)
    params: list[torch.nn.Parameter]  # the draft's trainable parameters
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoader
    heldout: DataLoader
    teacher: Teacher
    heldout_teacher: Teacher | None  # the held-out rows' teacher from the store, when it holds them
    ranking: list[int]  # token ids by frequency in the training answers (draft_vocab.json)
    head_ids: torch.Tensor | None = None  # (N,) the tokens the draft's head is cut to (draft.vocab)
    mixer: OnPolicyMixer | None = None  # on-policy data, when on_policy.fraction > 0
    step: int = 0  # optimizer steps done
    bar: tqdm | None = None
    plan: budget.Plan | None = None  # a budget of minutes, once planned (``optim.max_minutes``)
    last_metrics: dict = dataclasses.field(default_factory=dict)  # the latest held-out record
    window_loss: float = 0.0  # summed step losses since the last held-out record
    window_tokens: int = 0
    window_start: float = 0.0
    grad_norm: float = 0.0  # the latest step's gradient norm, before clipping
    heldout_memo: dict = dataclasses.field(default_factory=dict)  # the frozen target at the held-out rows
    started: float = 0.0  # when this process began training, and at which step
    start_step: int = 0
    trained_tokens: int = 0  # loss tokens of the optimizer steps this process made (all processes)
    train_seconds: float = 0.0  # time in those steps (not evaluations nor checkpoints)


@dataclass
class Result:
    """What ``train`` gives back."""

    run_dir: Path
    step: int
    metrics: dict  # the last held-out record: step, acceptance_rate, tvd (and loss, lr, tokens_per_s after step 0)
    draft: torch.nn.Module  # this process's trained draft, unwrapped
    target: PreTrainedModel  # the frozen target it was distilled from (the teacher, in its dtype)
    tokenizer: PreTrainedTokenizerBase


def print0(accelerator: Accelerator, *args) -> None:
    if accelerator.is_main_process:
        tqdm.write(" ".join(str(a) for a in args))


def train(cfg: DistillConfig, stop_at_step: int | None = None) -> Result:
    """Run (or resume) the distillation described by ``cfg``.

    stop_at_step: end this process after that step, as an interrupted run would (for time-boxed
    jobs and the resume tests); running again resumes from the last checkpoint.
    """
    run = setup(cfg)
    steps_per_epoch = max(1, len(run.loader) // cfg.optim.grad_accum)
    times = StepTimes()
    while run.step < run.cfg.optim.max_steps and run.step != stop_at_step:
        epoch, done_in_epoch = divmod(run.step, steps_per_epoch)
        # The same data order as an uninterrupted run: reseed the sampler per epoch, skip what was done.
        run.loader.set_epoch(epoch)
        if epoch > 0:
            end_of_epoch(run, times)
        skipped = done_in_epoch * cfg.optim.grad_accum
        batches = iter(run.accelerator.skip_first_batches(run.loader, skipped) if skipped else run.loader)
        for _ in range(done_in_epoch, steps_per_epoch):
            micro = [next(batches) for _ in range(cfg.optim.grad_accum)]
            began = time.perf_counter()
            loss, tokens = train_step(run, micro)
            seconds = time.perf_counter() - began
            run.train_seconds += seconds
            run.trained_tokens += tokens
            if cfg.optim.max_minutes is not None:
                plan_budget(run, cfg, times, seconds)
            on_step_end(run, loss, tokens)
            if run.step >= run.cfg.optim.max_steps or run.step == stop_at_step:
                break

    run.bar.close()
    run.accelerator.wait_for_everyone()
    write_train_summary(run)  # a collective: before end_training ends the process group
    # The DDP wrapper's reducer holds the process group: it is released while every process is still
    # in the group (a reducer freed after the group ends can hang in gloo's destructor, its peer gone).
    run.draft = run.accelerator.unwrap_model(run.draft)
    run.accelerator.free_memory()
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    summarize(run)
    return Result(run.run_dir, run.step, run.last_metrics, run.draft, run.target, run.tokenizer)


def setup(cfg: DistillConfig) -> Run:
    """Everything a run needs, then either resume from its last checkpoint or start (step-0 metrics, ``initial/``)."""
    device = resolve_device(None if cfg.device == "auto" else cfg.device)
    accelerator = make_accelerator(cfg, device)
    print0(accelerator, cpu_setup.set_up_host(cpu_setup.local_processes(accelerator.num_processes)))
    set_seed(cfg.seed)
    run_dir = Path(cfg.output_dir)
    resume_from = checkpoint.resume_point(run_dir, cfg, record=accelerator.is_main_process)
    target, tokenizer, draft = build_models(cfg, accelerator.device)
    train_examples, heldout_examples = build_examples(cfg, target, tokenizer, accelerator)
    ranking = draft_vocab.rank_tokens(train_examples)  # before any step: the cut the draft trains with
    if accelerator.is_main_process:  # the run folder only once the models and the data are good
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / RUN_CONFIG)
        draft_vocab.save_ranking(run_dir, ranking)
    head_ids = cut_head_ids(cfg, ranking, eos_token_ids(target, tokenizer), accelerator.device)
    describe(accelerator, draft, target, len(train_examples), head_ids)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kind = kind_named(cfg.draft.kind)
    layers, argmax = kind.teacher_layers(draft), kind.teacher_argmax(draft)
    sparse = not kind.teacher_log_probs(draft)
    examples = (train_examples, heldout_examples)
    settings = teacher_settings(cfg, accelerator.device, head_ids, layers, argmax, sparse)
    teacher_logits = teacher(cfg, target, examples, pad, accelerator, settings)
    # held-out metrics run the target where it is loaded (exact p); a run holding only the draft's parts of
    # it reads them from the store when the store holds the held-out rows, else the target's body loads
    held_teacher = None
    if not is_loaded(target):
        held_teacher = heldout_teacher(cfg, target, teacher_logits, heldout_examples, head_ids, accelerator.device)
    if shards_teacher(cfg, accelerator, teacher_logits):
        teacher_logits.forward = shard_teacher(target)
    loader, heldout = loaders(cfg, train_examples, heldout_examples, pad)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.optim.warmup_steps, cfg.optim.max_steps)
    draft, optimizer, loader, heldout, scheduler = accelerator.prepare(draft, optimizer, loader, heldout, scheduler)
    # after prepare: FSDP replaces the draft's parameters with its shards (the optimizer is moved onto them)
    params = [p for p in draft.parameters() if p.requires_grad]
    run = Run(
        cfg=cfg,
        accelerator=accelerator,
        run_dir=run_dir,
        target=target,
        tokenizer=tokenizer,
        draft=draft,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        heldout=heldout,
        teacher=teacher_logits,
        heldout_teacher=held_teacher,
        ranking=ranking,
        head_ids=head_ids,
    )
    if cfg.on_policy.fraction > 0:
        run.mixer = on_policy_mixer(cfg, train_examples, target, tokenizer, pad, accelerator.process_index)

    if resume_from is not None:
        resume(run, *resume_from)
    else:
        start(run)
    plan = budget.load_plan(run_dir) if cfg.optim.max_minutes is not None and resume_from is not None else None
    if plan is not None:  # a resumed run trains the steps it planned, whatever this machine's speed
        follow_plan(run, plan, record=False)
    run.bar = progress_bar(cfg, run.step, accelerator.is_main_process)
    if cfg.optim.max_minutes is not None:
        show_minutes(run)
    if cfg.log.report_to != "none":
        scalars = {k: v for k, v in flat_settings(cfg).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("distill", config=scalars)
    run.window_start = run.started = time.perf_counter()
    run.start_step = run.step
    return run


def progress_bar(cfg: DistillConfig, step: int, shown: bool) -> tqdm:
    """The run's progress bar (drawn where ``shown``): optimizer steps from ``step``, or under a budget
    (``optim.max_minutes``) minutes of training steps."""
    if cfg.optim.max_minutes is None:
        return tqdm(total=cfg.optim.max_steps, initial=step, desc="distill", disable=not shown)
    return tqdm(
        total=cfg.optim.max_minutes,
        desc="distill",
        unit="min",
        bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} min [{elapsed}<{remaining}{postfix}]",
        disable=not shown,
    )


@dataclass
class StepTimes:
    """This process's step times for a budget's plan: before the teacher turned to its store (or all
    of them, when it never did) and after (from ``switch_step``)."""

    live: list[float] = dataclasses.field(default_factory=list)
    store: list[float] = dataclasses.field(default_factory=list)
    switch_step: int | None = None


def end_of_epoch(run: Run, times: StepTimes) -> None:
    """Between epochs: a store the first epoch filled is complete and read from here on; the step
    where the teacher turned to it is kept for the budget's plan (``times.switch_step``)."""
    live = run.teacher.runs_target
    run.teacher.epoch_end(run.accelerator)
    if live and not run.teacher.runs_target:
        times.switch_step = run.step


def plan_budget(run: Run, cfg: DistillConfig, times: StepTimes, seconds: float) -> None:
    """Plan a budget's steps once the first steps are timed, and again once the steps after a filled
    store took over the teacher are (``budget.store_plan``); every process plans from the slowest pace."""
    (times.live if times.switch_step is None else times.store).append(seconds)
    plan = run.plan
    if plan is not None and (plan.store_step_seconds is not None or times.switch_step is None):
        return  # planned, and nothing changed since (or planned again already)

    def slowest(pace: float) -> float:
        return float(run.accelerator.reduce(torch.tensor(pace, device=run.accelerator.device), "max"))

    if times.switch_step is None:
        new = budget.timed_plan(cfg, run.step, times.live, slowest)
    else:
        new = budget.store_plan(cfg, plan, run.step, times.switch_step, times.live, times.store, slowest)
    if new is not None:
        follow_plan(run, new, record=True)


def follow_plan(run: Run, plan: budget.Plan, record: bool) -> None:
    """Train the steps a budget's ``plan`` fits: the run's optim.max_steps, checkpoint and log intervals
    become the plan's, and the learning-rate schedule decays to its last step from here on
    (``record``: a new plan, written into the run folder and announced)."""
    run.plan = plan
    run.cfg = with_settings(run.cfg, plan.settings())
    scheduler = get_cosine_schedule_with_warmup(
        run.optimizer.optimizer, run.cfg.optim.warmup_steps, plan.max_steps, last_epoch=run.step - 1
    )
    run.scheduler.scheduler = scheduler  # inside accelerate's wrapper, which checkpoints save
    if record and run.accelerator.is_main_process:
        budget.save_plan(run.run_dir, plan)
        if plan.store_step_seconds is None:
            pace = f"{plan.step_seconds:.2f} s a step"
        else:
            pace = (
                f"{plan.step_seconds:.2f} s a step to step {plan.switch_step}, then {plan.store_step_seconds:.2f} "
                "s reading the teacher's store"
            )
        print0(
            run.accelerator,
            f"budget {plan.minutes:g} min at {pace}: {plan.max_steps} steps (checkpoints every {plan.save_steps})",
        )


def show_minutes(run: Run) -> None:
    """A budget's progress bar: training minutes so far (steps at the plan's paces once it is made)."""
    minutes = run.plan.minutes_at(run.step) if run.plan is not None else run.train_seconds / 60
    run.bar.n = min(minutes, run.cfg.optim.max_minutes)
    run.bar.refresh()


def make_accelerator(cfg: DistillConfig, device: torch.device) -> Accelerator:
    # accelerate keeps one precision setting per process; a process that trains again (a notebook,
    # a benchmark, the tests) may ask for another. The distributed set-up (PartialState) is kept.
    AcceleratorState._reset_state()
    # The schedule counts optimizer steps; by default accelerate would advance it once per process.
    return Accelerator(
        mixed_precision=mixed_precision(cfg, device),
        cpu=device.type == "cpu",
        step_scheduler_with_optimizer=False,
        log_with=trackers(cfg.log.report_to),
        project_dir=cfg.output_dir,
    )


def trackers(report_to: str) -> list[str] | None:
    """accelerate's ``log_with`` for ``log.report_to``; a tracker that is not installed is refused by name."""
    if report_to == "none":
        return None
    names = report_to.split(",")
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise DraftsmithError(
                f"log.report_to: {name} is not installed; pip install {name}, or drop it from log.report_to"
            )
    return names


def shards_teacher(cfg: DistillConfig, accelerator: Accelerator, teacher: Teacher) -> bool:
    """Whether the live teacher is sharded over the launch's processes (``teacher.shard``): ``auto`` shards
    a teacher that runs in every step under several processes unless something needs it whole (then a
    note says what); ``true`` refuses such a run instead."""
    if cfg.teacher.shard == "false" or accelerator.num_processes == 1 or not teacher.runs_target:
        return False
    whole = None
    if cfg.teacher.cache:
        whole = "teacher.cache fills its store with each process's own target (build the store first: draftsmith data)"
    elif cfg.draft.kind == "early_exit":
        whole = "an early_exit draft shares the target's layers"
    elif cfg.teacher.device_map is not None:
        whole = "teacher.device_map places the whole target over this process's GPUs"
    elif cfg.eval.speedup_steps:
        whole = "eval.speedup_steps decodes with the target in the main process alone (measure with eval-run instead)"
    if whole is None:
        return True
    if cfg.teacher.shard == "true":
        raise DraftsmithError(f"teacher.shard=true: the teacher cannot be sharded here: {whole}")
    print0(accelerator, f"note: the teacher is not sharded over the {accelerator.num_processes} processes: {whole}")
    return False


def cut_head_ids(
    cfg: DistillConfig, ranking: list[int], eos_ids: frozenset[int], device: torch.device
) -> torch.Tensor | None:
    """(N,) the token ids the draft's head is cut to: the ``draft.vocab`` most frequent in the
    training answers and the EOS ids, exactly the set eval decodes with; None for the full head."""
    if not cfg.draft.vocab:
        return None
    return torch.tensor(draft_vocab.kept_ids(ranking[: cfg.draft.vocab], eos_ids), device=device)


def decoding_draft(draft, head_ids: torch.Tensor | None):
    """The draft as it decodes: with its head cut to ``head_ids`` when training used a cut and its kind
    decodes through the generic cut head (a kind whose vocabulary is its own carries it itself)."""
    if head_ids is None or not kind_of_model(draft).cuts_head:
        return draft
    return draft_vocab.SubsetHeadDraft(draft, head_ids.tolist())


def run_heldout_metrics(run: Run) -> dict:
    """``heldout_metrics`` of the run's draft, with the run's memo, its held-out teacher from the store
    when it has one, and the teacher's forward when it is sharded (every process then runs it)."""
    forward = run.teacher.forward if run.teacher.sharded else None
    head = loss_head(run)
    return heldout_metrics(
        run.draft, run.target, run.heldout, run.accelerator, head, run.heldout_memo, run.heldout_teacher, forward
    )


def loss_head(run: Run) -> LossHead:
    """How this run's training forwards apply the draft's head: at the loss rows, full or cut."""
    model = run.accelerator.unwrap_model(run.draft)
    return LossHead(model, run.head_ids, run.target.config.vocab_size, kind_named(run.cfg.draft.kind))


def describe(accelerator: Accelerator, draft, target, n_examples: int, head_ids: torch.Tensor | None) -> None:
    """Print the sizes and the measured cost ratio c of the draft as it decodes (main process); c is left
    out while the target holds only the tensors the draft read (timing it would load the rest)."""
    if not accelerator.is_main_process:
        return
    total, loaded = count_loaded(target)
    if loaded == total:
        with torch.random.fork_rng(devices=[]):  # training draws the same numbers whether c is timed or not
            cost_ratio = measure_cost_ratio(target, decoding_draft(in_dtype_of(draft, target), head_ids))
        cost = f"measured cost ratio c = {cost_ratio:.3f} (draft step / target step)"
    else:
        cost = f"{loaded / 1e6:.2f} M of its tensors loaded (what the draft reads; the rest loads if it runs)"
    head = "full head" if head_ids is None else f"head cut to {len(head_ids)} tokens"
    print0(
        accelerator,
        f"draft: {count_parameters(draft) / 1e6:.2f} M parameters "
        f"({count_parameters(draft, trainable_only=True) / 1e6:.2f} M trainable, {head}); target: "
        f"{total / 1e6:.2f} M; {cost}; {n_examples} training sequences",
    )


def on_policy_mixer(
    cfg: DistillConfig, examples: list[dict], target, tokenizer, pad: int, process_index: int
) -> OnPolicyMixer:
    prompts = [list(p) for p in sorted({tuple(example_prompt(e)) for e in examples})]
    settings = OnPolicySettings(
        fraction=cfg.on_policy.fraction,
        refresh_steps=cfg.on_policy.refresh_steps,
        pool_size=cfg.on_policy.pool,
        max_new_tokens=cfg.generate.max_new_tokens,
        sampling=generation(cfg),
        eos_ids=eos_token_ids(target, tokenizer),
        seed=cfg.seed,
        batch_size=cfg.optim.batch_size,
        max_length=cfg.data.max_length,
    )
    return OnPolicyMixer(prompts, settings, pad, process_index)


def resume(run: Run, step: int, folder: Path) -> None:
    """Continue from checkpoint ``folder``: optimizer, scheduler, RNG and on-policy pool as they were at ``step``."""
    run.step = step
    run.accelerator.load_state(str(folder / "state"))
    if run.mixer is not None:
        run.mixer.load(folder)
    if run.accelerator.is_main_process:  # records past the checkpoint will be written again
        for name in LOGS:
            truncate_log(run.run_dir / name, step)
    print0(run.accelerator, f"resuming from {folder} (step {step})")


def start(run: Run) -> None:
    """A fresh run: the held-out metrics of the untrained draft, and the draft itself as ``initial/``."""
    accelerator = run.accelerator
    if accelerator.is_main_process:
        for name in LOGS[:2]:
            (run.run_dir / name).unlink(missing_ok=True)
    run.last_metrics = {"step": 0, **run_heldout_metrics(run)}
    state = accelerator.get_state_dict(run.draft)  # a collective: every process takes part
    if accelerator.is_main_process:
        log(run.run_dir / "metrics.jsonl", run.last_metrics)
        tmp = checkpoint.begin(run.run_dir, checkpoint.INITIAL)
        checkpoint.write_draft(accelerator.unwrap_model(run.draft), state, run.tokenizer, tmp, run.cfg.target)
        save_cut(run, tmp)
        info = {"step": 0, "target": run.cfg.target, "config": dataclasses.asdict(run.cfg)}
        checkpoint.commit(run.run_dir, tmp, checkpoint.INITIAL, info)


def save_cut(run: Run, folder: Path) -> None:
    """A draft trained with a cut head carries the cut (the kept part of the ranking) in its folder."""
    if run.head_ids is not None:
        draft_vocab.save_ranking(folder, run.ranking[: run.cfg.draft.vocab])


def distill_step_loss(cfg: DistillConfig, draft, teacher_rows: Teacher, batch: dict, head: LossHead) -> torch.Tensor:
    """Sum over valid tokens of the configured loss for one micro-batch (not yet normalized).

    Both heads run at the M loss rows only (the ``loss_mask`` positions): the draft's through its own
    forward with ``head.model``'s output embedding swapped, over ``head.ids`` for a cut head."""
    mask = batch["loss_mask"]  # (B, T)
    rows = vocab_cut.loss_rows(mask)  # (M,)
    with torch.no_grad():
        teacher = teacher_rows(batch, rows)  # log_probs (M, V), or (M, N) with a cut head
    predicted = draft_predictions(draft, batch, rows, teacher, head)  # logits (R, N or V)
    teacher_out, at = teacher.log_probs, rows
    if predicted.teacher_rows is not None:  # several predictions per loss row (steps ahead)
        teacher_out, at = teacher_out.index_select(0, predicted.teacher_rows), rows[predicted.teacher_rows]
    losses = row_token_losses(
        cfg.loss.name, predicted.logits, teacher_out, mask, at, cfg.loss.temperature, cfg.loss.jsd_beta, cfg.loss.gamma
    )  # (R,)
    if cfg.loss.ce_weight:
        labels = batch["input_ids"].roll(-1, dims=1).flatten().index_select(0, at)  # (R,): the next tokens
        if head.ids is not None:
            labels = vocab_cut.subset_labels(labels, head.ids, head.vocab_size)
        losses = (1 - cfg.loss.ce_weight) * losses + cfg.loss.ce_weight * row_cross_entropy(predicted.logits, labels)
    if predicted.weights is not None:
        losses = losses * predicted.weights
    return losses.sum()


def draft_predictions(draft, batch: dict, rows: torch.Tensor, teacher: TeacherRows, head: LossHead) -> Predictions:
    """The draft's predictions at the loss rows, by its kind's training forward."""
    kind_batch = Batch(
        batch["input_ids"],
        batch["attention_mask"],
        batch["loss_mask"],
        rows,
        head.ids,
        teacher.hidden or {},
        teacher.log_probs if isinstance(teacher.log_probs, torch.Tensor) else None,
        teacher.argmax,
    )
    return head.kind.training_forward(draft, head.model, kind_batch)


def train_step(run: Run, micro: list[dict]) -> tuple[float, int]:
    """One optimizer step over an accumulation window of micro-batches: (loss per token, global token count)."""
    accelerator, cfg = run.accelerator, run.cfg
    if run.mixer is not None:
        if run.mixer.due(run.step):
            draft = decoding_draft(accelerator.unwrap_model(run.draft), run.head_ids)
            run.mixer.refresh(draft, run.step, progress=accelerator.is_main_process)
        micro = [run.mixer.maybe_replace(b, run.step, i, accelerator.device) for i, b in enumerate(micro)]
    local_tokens = sum(int(b["loss_mask"].sum()) for b in micro)
    global_tokens = int(accelerator.reduce(torch.tensor(local_tokens, device=accelerator.device), "sum"))
    # DDP averages gradients over processes, hence the factor num_processes.
    scale = accelerator.num_processes / max(global_tokens, 1)
    step_loss, head = 0.0, loss_head(run)
    for i, batch in enumerate(micro):
        sync = i == len(micro) - 1  # gradients are all-reduced once, after the last micro-batch
        with contextlib.nullcontext() if sync else accelerator.no_sync(run.draft):
            loss = distill_step_loss(cfg, run.draft, run.teacher, batch, head) * scale
            accelerator.backward(loss)
        step_loss += float(loss.detach()) / accelerator.num_processes
    run.grad_norm = float(accelerator.clip_grad_norm_(run.params, cfg.optim.max_grad_norm))
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    step_loss = float(accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), "sum"))
    return step_loss, global_tokens


def on_step_end(run: Run, loss: float, tokens: int) -> None:
    """After each optimizer step: log its loss; on schedule, held-out metrics, real speedup, a checkpoint."""
    cfg, step = run.cfg, run.step
    run.window_loss += loss
    run.window_tokens += tokens
    if cfg.optim.max_minutes is None:
        run.bar.update(1)
    else:
        show_minutes(run)
    run.bar.set_postfix(loss=f"{loss:.4f}")
    if run.accelerator.is_main_process:
        log(run.run_dir / "losses.jsonl", {"step": step, "loss": loss})
    if step % cfg.log.steps == 0 or step == cfg.optim.max_steps:
        log_heldout(run)
    if cfg.eval.speedup_steps and step % cfg.eval.speedup_steps == 0:
        measure_speedup(run)
    if step % cfg.save.steps == 0 or step == cfg.optim.max_steps:
        save(run)


def log_heldout(run: Run) -> None:
    """Held-out acceptance next to the loss, learning rate and throughput since the last record."""
    elapsed = time.perf_counter() - run.window_start  # training time only, before the held-out evaluation
    metrics = run_heldout_metrics(run)
    run.last_metrics = {
        "step": run.step,
        "loss": run.window_loss / (run.step % run.cfg.log.steps or run.cfg.log.steps),
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": run.window_tokens / elapsed,
        "grad_norm": run.grad_norm,
        **metrics,
    }
    if run.accelerator.is_main_process:
        log(run.run_dir / "metrics.jsonl", run.last_metrics)
    if run.cfg.log.report_to != "none":
        run.accelerator.log({k: v for k, v in run.last_metrics.items() if k != "step"}, step=run.step)
    print0(run.accelerator, progress_line(run))
    run.bar.set_postfix(loss=f"{run.last_metrics['loss']:.4f}", alpha=f"{metrics['acceptance_rate']:.3f}")
    run.window_loss, run.window_tokens, run.window_start = 0.0, 0, time.perf_counter()


def progress_line(run: Run) -> str:
    """step, loss, alpha, tokens/s, lr and the time left at this process's pace so far."""
    m, done = run.last_metrics, run.step - run.start_step
    per_step = (time.perf_counter() - run.started) / max(done, 1)
    eta = datetime.timedelta(seconds=round(per_step * (run.cfg.optim.max_steps - run.step)))
    return (
        f"step {run.step}/{run.cfg.optim.max_steps}: loss {m['loss']:.4f}, alpha {m['acceptance_rate']:.3f}, "
        f"{m['tokens_per_s']:.0f} tokens/s, lr {m['lr']:.2e}, grad norm {m['grad_norm']:.3f}, ETA {eta}"
    )


def write_train_summary(run: Run) -> None:
    """``train_summary.json`` beside the checkpoints (atomically): the target forward passes this
    process's training steps made, summed over processes (0 when the teacher is read from a store;
    held-out evaluations are not counted), the steps, the loss tokens trained per second of step time,
    and per process the target's parameters it holds and its peak resident memory."""
    device = run.accelerator.device
    forwards = int(run.accelerator.reduce(torch.tensor(run.teacher.forwards, device=device), "sum"))
    total, loaded = count_loaded(run.target)
    per_process = torch.tensor([loaded, peak_rss()], device=device)[None]  # (1, 2)
    loaded_by, rss_by = run.accelerator.gather(per_process).T.tolist()  # one of each per process
    if not run.accelerator.is_main_process:
        return
    summary = {
        "teacher_forwards": forwards,
        "steps": run.step - run.start_step,
        "step": run.step,
        "tokens": run.trained_tokens,
        "tokens_per_s": run.trained_tokens / run.train_seconds if run.train_seconds else 0.0,
        "steps_per_s": (run.step - run.start_step) / run.train_seconds if run.train_seconds else 0.0,
        "teacher": run.teacher.source,
        "store": None if run.teacher.store is None else str(run.teacher.store),
        "processes": run.accelerator.num_processes,
        "target_parameters": total,
        "target_parameters_loaded": loaded_by,  # per process: resident in it (a sharded teacher: its shard)
        "teacher_sharded": run.teacher.sharded,
        "peak_rss_bytes": rss_by,  # per process
    }
    write_text(run.run_dir / "train_summary.json", json.dumps(summary, indent=2) + "\n")


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(run: Run) -> None:
    """The end of a run: the best held-out alpha so far and the command that measures real speedup next."""
    if not run.accelerator.is_main_process:
        return
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    best = max(records, key=lambda r: r["acceptance_rate"])
    print0(
        run.accelerator,
        f"done: step {run.step}; best held-out alpha {best['acceptance_rate']:.3f} at step {best['step']} "
        f"(step 0: {records[0]['acceptance_rate']:.3f}).\nnext: draftsmith eval-run {run.run_dir} "
        "(measures each checkpoint's real speedup), then draftsmith publish CHECKPOINT --out FOLDER",
    )


@torch.no_grad()
def heldout_metrics(
    draft,
    target,
    loader,
    accelerator: Accelerator,
    head: LossHead,
    memo: dict | None = None,
    stored: Teacher | None = None,
    forward: TeacherForward | None = None,
) -> dict:
    """Mean acceptance probability sum_x min(p, q) and TVD over held-out tokens, synced across processes.

    Exact over the target's full vocabulary, with both heads at the loss rows only; with a cut head
    (``head.ids``) the draft's q is the cut head's (zero outside those tokens), as it decodes. A kind
    that predicts several steps ahead is measured on its first step (the next token). ``memo`` (a
    run's, kept between evaluations) holds the frozen target's decoder output per held-out batch, so
    only the first evaluation runs the target's layers; the later ones apply its head to them. ``stored``:
    the held-out rows' teacher read from a feature store instead (no target runs; p is its top-k with
    the rest spread evenly). ``forward``: the sharded target's forward (every process takes part; no memo)."""
    alpha = torchmetrics.MeanMetric().to(accelerator.device)
    layers = head.kind.teacher_layers(head.model)
    was_training = draft.training
    draft.eval()
    read = functools.partial(heldout_teacher_rows, head.ids, accelerator.device)  # (target, rows) -> TeacherRows
    for index, batch in enumerate(loader):
        rows = vocab_cut.loss_rows(batch["loss_mask"])  # (M,)
        if stored is not None:
            teacher = stored(batch, rows)
        elif forward is not None:
            teacher = forward(batch, rows, layers, read)
        else:
            teacher = read(target, frozen_target_rows(target, batch, rows, layers, memo, index))
        p = teacher.log_probs  # (M, N or V)
        predicted = draft_predictions(draft, batch, rows, teacher, head)
        q = predicted.logits if predicted.teacher_rows is None else predicted.logits[: len(rows)]  # step 0 first
        a = row_acceptance(q, p)  # (M,)
        alpha.update(a, weight=torch.ones_like(a))
    draft.train(was_training)
    value = float(alpha.compute())
    return {"acceptance_rate": value, "tvd": 1 - value}


def heldout_teacher_rows(
    ids: torch.Tensor | None, device: torch.device, target: PreTrainedModel, out: vocab_cut.TargetRows
) -> TeacherRows:
    """The frozen target's full log-probs (M, N or V) and hidden states at the held-out loss rows."""
    return TeacherRows(vocab_cut.head_log_probs(target, out.hidden, ids).to(device), out.layers)


def frozen_target_rows(
    target: PreTrainedModel, batch: dict, rows: torch.Tensor, layers, memo: dict | None, index: int
) -> vocab_cut.TargetRows:
    """``vocab_cut.target_rows`` for the ``index``-th held-out batch, read from ``memo`` when that batch
    was seen before (the same input ids and layers: the target is frozen, so its output is the same)."""
    key = (index, tuple(layers))
    seen = None if memo is None else memo.get(key)
    if seen is not None and torch.equal(seen[0], batch["input_ids"]):
        return seen[1]
    out = vocab_cut.target_rows(target, batch, rows, layers)
    if memo is not None:
        memo[key] = (batch["input_ids"].clone(), out)
    return out


def measure_speedup(run: Run) -> None:
    """The current draft's real speedup (greedy), measured on the main process; the others wait."""
    cfg, target, tokenizer = run.cfg, run.target, run.tokenizer
    if run.accelerator.is_main_process:
        load_whole(target)  # the decoder reads its weights outside forwards too
        prompts_file = ddata.EVAL_PROMPTS if cfg.eval.prompts == "builtin" else cfg.eval.prompts
        prompts = read_prompts(prompts_file)[: cfg.eval.limit]
        model = decoding_draft(in_dtype_of(run.accelerator.unwrap_model(run.draft), target), run.head_ids)
        with eval_mode(model):
            settings = MeasureSettings(
                prompts,
                max_new_tokens=cfg.eval.max_new_tokens,
                eos_ids=eos_token_ids(target, tokenizer),
                repeats=1,
                progress=False,
            )
            result = speedup.measure_draft(target, model, tokenizer, settings, cfg.eval.gammas)
        record = {
            "step": run.step,
            "speedup": result.speedup,
            "spec_acceptance_rate": result.acceptance_rate,
            "best_gamma": result.best_gamma,
            "mean_accepted_tokens": result.mean_accepted_tokens,
            "greedy_match": result.greedy_match,
        }
        log(run.run_dir / "speedup.jsonl", record)
        tqdm.write(
            f"step {run.step}: measured speedup {result.speedup:.2f} at gamma {result.best_gamma} "
            f"(alpha {result.acceptance_rate:.3f})"
        )
    run.accelerator.wait_for_everyone()


def save(run: Run) -> None:
    """Write checkpoint-{step}: the draft as a model folder, the training state, then the marker."""
    accelerator, cfg, step = run.accelerator, run.cfg, run.step
    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    tmp = checkpoint.begin(run.run_dir, step) if main else checkpoint.temporary_dir(run.run_dir, step)
    accelerator.wait_for_everyone()
    # accelerate's safetensors writer cannot read a sharded (DTensor) state's storage: pickled tensors there
    accelerator.save_state(str(tmp / "state"), safe_serialization=accelerator.distributed_type != DistributedType.FSDP)
    state = accelerator.get_state_dict(run.draft)  # gathers a sharded (FSDP) draft; every process takes part
    if main:
        checkpoint.write_draft(accelerator.unwrap_model(run.draft), state, run.tokenizer, tmp, cfg.target)
        save_cut(run, tmp)
        if run.mixer is not None:
            run.mixer.save(tmp)
        info = {"step": step, "target": cfg.target, "draft_init": cfg.draft.init, "config": dataclasses.asdict(cfg)}
        checkpoint.commit(run.run_dir, tmp, f"checkpoint-{step}", info, keep_last=cfg.save.keep_last)
    accelerator.wait_for_everyone()


def log(file: Path, record: dict) -> None:
    """Append one JSON record to a .jsonl file."""
    with file.open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step``."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        write_text(path, "".join(line + "\n" for line in keep))
