"""The distillation loop: setup, train, save, cleanup, read top to bottom.

Runs on one CPU, one GPU or N processes under ``accelerate launch`` / ``torchrun``. The teacher
(target) is frozen and is not wrapped by accelerate; only the draft is trained. Every loss is a
sum over valid tokens divided by the global count of valid tokens in the optimizer step (all
micro-batches of the accumulation window, all processes), so each token weighs the same.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from pathlib import Path

import torch
import torchmetrics
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from peft import PeftModel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from draftsmith.distill import data as ddata
from draftsmith.distill import teacher_cache
from draftsmith.distill.draft_init import (
    add_lora,
    count_parameters,
    draft_decoder,
    measure_cost_ratio,
    new_config_draft,
    truncate_target,
)
from draftsmith.distill.early_exit import EarlyExitDraft
from draftsmith.distill.losses import acceptance_probability, cross_entropy, token_losses
from draftsmith.distill.on_policy import OnPolicyMixer, example_prompt
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import (
    check_compatible,
    draftsmith_home,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.train import checkpoint, speedup
from draftsmith.train.config import DistillConfig, save_config


def print0(accelerator: Accelerator, *args) -> None:
    if accelerator.is_main_process:
        tqdm.write(" ".join(str(a) for a in args))


def load_target(cfg: DistillConfig, device: torch.device, dtype: torch.dtype = torch.float32):
    """(target, tokenizer) of a run: the frozen teacher (``tiny`` is rebuilt from its config and seed)."""
    if cfg.target == "tiny":
        target, tokenizer = tiny_target(seed=cfg.seed, **cfg.tiny_target)
        target = target.to(device=device, dtype=dtype)
    else:
        tokenizer = load_tokenizer(cfg.target)
        target = load_model(cfg.target, device, dtype, device_map=cfg.teacher_device_map)
    return target.requires_grad_(False).eval(), tokenizer


def teacher_dtype(cfg: DistillConfig, device: torch.device) -> torch.dtype:
    """The dtype the frozen target runs in as teacher (early-exit drafts share its layers: float32)."""
    if cfg.draft_init == "early_exit":
        return torch.float32
    return resolve_dtype(cfg.teacher_dtype, device)


def mixed_precision(cfg: DistillConfig, device: torch.device) -> str:
    """accelerate's mixed_precision for the draft; ``auto``: bf16 where the device has native bfloat16."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "no"


def build_models(cfg: DistillConfig, device: torch.device):
    """(target, tokenizer, draft): the frozen teacher and the trainable draft.

    The draft is built from the float32 target; the teacher is then cast to ``teacher_dtype``.
    """
    target, tokenizer = load_target(cfg, device)
    draft = _build_draft(cfg, target, tokenizer, device)
    return target.to(teacher_dtype(cfg, device)), tokenizer, draft


def _build_draft(cfg: DistillConfig, target, tokenizer, device: torch.device):
    if cfg.draft_init == "truncate":
        draft = truncate_target(target, cfg.draft_layers)
    elif cfg.draft_init == "early_exit":
        draft = EarlyExitDraft(target, _early_exit_k(cfg.draft_layers), adapter=cfg.early_exit_adapter)
        return draft.train()  # its shared layers, embeddings and head are the target's, frozen
    elif cfg.draft_init == "config":
        draft = new_config_draft(target, cfg.draft_config)
    else:
        draft = load_model(cfg.draft_model, device, torch.float32)
        check_compatible(tokenizer, load_tokenizer(cfg.draft_model), target.config.vocab_size, draft.config.vocab_size)
    draft.requires_grad_(True).train()
    if cfg.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    if cfg.lora_r:
        draft = add_lora(draft, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules)
    return draft


def build_examples(cfg: DistillConfig, target, tokenizer, accelerator: Accelerator) -> tuple[list[dict], list[dict]]:
    """(train examples, held-out examples). The first ``heldout`` rows (after a seeded shuffle) are held out.

    In ``target`` mode the held-out prompts get the target's greedy answers (what greedy decoding
    will face), the training prompts ``gen_samples`` answers each with the generation settings.
    """
    rows = ddata.load_rows(cfg.dataset, cfg.dataset_split)
    if len(rows) <= cfg.heldout:
        raise DraftsmithError(f"dataset {cfg.dataset} has {len(rows)} rows; need more than heldout={cfg.heldout}")
    rows = rows.shuffle(seed=cfg.seed)
    held_rows, train_rows = rows.select(range(cfg.heldout)), rows.select(range(cfg.heldout, len(rows)))
    if cfg.data == "text":
        held = ddata.text_examples(held_rows, tokenizer, cfg.max_length)
        train_examples = ddata.text_examples(train_rows, tokenizer, cfg.max_length)
    else:
        held_prompts, train_prompts = _encode_prompts(cfg, target, tokenizer, held_rows, train_rows)
        train_prompts = [p for p in train_prompts for _ in range(cfg.gen_samples)]
        greedy = SamplingParams()
        sampling = SamplingParams(cfg.gen_temperature, 0, cfg.gen_top_p)
        name = cfg.target if cfg.target != "tiny" else f"tiny-{cfg.seed}-{sorted(cfg.tiny_target.items())}"
        eos = eos_token_ids(target, tokenizer)
        with accelerator.main_process_first():  # the main process generates, the others read the saved sets
            answers = [
                ddata.cached_target_responses(
                    draftsmith_home() / "data",
                    name,
                    target,
                    prompts,
                    cfg.gen_max_new_tokens,
                    params,
                    eos,
                    cfg.gen_batch_size,
                    cfg.seed,
                    progress=accelerator.is_main_process,
                )
                for prompts, params in ((held_prompts, greedy), (train_prompts, sampling))
            ]
        held = ddata.target_examples(held_prompts, answers[0], cfg.max_length)
        train_examples = ddata.target_examples(train_prompts, answers[1], cfg.max_length)
    if not held or not train_examples:
        raise DraftsmithError(
            f"no usable {'held-out' if not held else 'training'} examples in {cfg.dataset} (rows with tokens to learn)"
        )
    return train_examples, held


def _encode_prompts(cfg: DistillConfig, target, tokenizer, *row_sets) -> list[list[list[int]]]:
    """Chat-encoded prompts of each row set; prompts that leave no room for the answer are refused."""
    context = min(cfg.max_length, target.config.max_position_embeddings)
    encoded = []
    for rows in row_sets:
        prompts = [encode_chat(tokenizer, m) for m in (ddata.prompt_messages(r) for r in rows) if m]
        too_long = [len(p) for p in prompts if len(p) + cfg.gen_max_new_tokens > context]
        if too_long:
            raise DraftsmithError(
                f"{len(too_long)} prompts are too long: the longest has {max(too_long)} tokens, which with "
                f"gen_max_new_tokens={cfg.gen_max_new_tokens} exceeds max_length / context ({context}); raise "
                "max_length or lower gen_max_new_tokens"
            )
        encoded.append(prompts)
    return encoded


def distill_step_loss(cfg: DistillConfig, draft, teacher_logits, batch: dict) -> torch.Tensor:
    """Sum over valid tokens of the configured loss for one micro-batch (not yet normalized).

    teacher_logits: batch -> (B, T, V) teacher logits or log-probs (the live target or the cache).
    """
    mask = batch["loss_mask"]
    with torch.no_grad():
        teacher = teacher_logits(batch)
    student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses = token_losses(cfg.loss, student, teacher, mask, cfg.loss_temperature, cfg.jsd_beta, cfg.loss_gamma)
    if cfg.ce_weight:
        labels = torch.where(mask, batch["input_ids"].roll(-1, dims=1), -100)
        losses = (1 - cfg.ce_weight) * losses + cfg.ce_weight * cross_entropy(student, labels)
    return losses.sum()


@torch.no_grad()
def heldout_metrics(draft, target, loader, accelerator: Accelerator) -> dict:
    """Mean acceptance probability sum_x min(p, q) and TVD over held-out tokens, synced across processes."""
    alpha = torchmetrics.MeanMetric().to(accelerator.device)
    was_training = draft.training
    draft.eval()
    for batch in loader:
        mask = batch["loss_mask"]
        p = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        q = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        a = acceptance_probability(q, p)
        alpha.update(a[mask], weight=torch.ones_like(a[mask]))
    draft.train(was_training)
    value = float(alpha.compute())
    return {"acceptance_rate": value, "tvd": 1 - value}


def train(cfg: DistillConfig, stop_at_step: int | None = None) -> Path:
    """Run (or resume) the distillation described by ``cfg``; return the run folder.

    stop_at_step: end this process after that step, as an interrupted run would (for time-boxed
    jobs and the resume tests); running again resumes from the last checkpoint.
    """
    # ---- setup ---------------------------------------------------------------------------------
    device = resolve_device(None if cfg.device == "auto" else cfg.device)
    # accelerate keeps one precision setting per process; a process that trains again (a notebook,
    # a benchmark) may ask for another. The distributed set-up (PartialState) is kept.
    AcceleratorState._reset_state()
    # The schedule counts optimizer steps; by default accelerate would advance it once per process.
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg, device), cpu=device.type == "cpu", step_scheduler_with_optimizer=False
    )
    set_seed(cfg.seed)
    run_dir = Path(cfg.output_dir)
    resume_from = _check_resume(run_dir, cfg)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    target, tokenizer, draft = build_models(cfg, accelerator.device)
    train_examples, heldout_examples = build_examples(cfg, target, tokenizer, accelerator)
    if accelerator.is_main_process:
        draft_vocab.save_ranking(run_dir, draft_vocab.rank_tokens(train_examples))
    cost_ratio = float("nan")
    if accelerator.is_main_process:
        cost_ratio = measure_cost_ratio(target, _in_dtype_of(draft, target))
    print0(
        accelerator,
        f"draft: {count_parameters(draft) / 1e6:.2f} M parameters "
        f"({count_parameters(draft, trainable_only=True) / 1e6:.2f} M trainable); target: "
        f"{count_parameters(target) / 1e6:.2f} M; measured cost ratio c = {cost_ratio:.3f} "
        f"(draft step / target step); {len(train_examples)} training sequences",
    )

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    teacher_logits = _teacher(cfg, target, train_examples, pad, accelerator)
    loader = DataLoader(
        train_examples,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=False,
        collate_fn=lambda b: ddata.collate(b, pad),
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    heldout = DataLoader(heldout_examples, batch_size=cfg.batch_size, collate_fn=lambda b: ddata.collate(b, pad))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps)
    draft, optimizer, loader, heldout, scheduler = accelerator.prepare(draft, optimizer, loader, heldout, scheduler)

    mixer = None
    if cfg.on_policy_fraction > 0:
        prompts = [list(p) for p in sorted({tuple(example_prompt(e)) for e in train_examples})]
        mixer = OnPolicyMixer(
            prompts,
            cfg.on_policy_fraction,
            cfg.on_policy_refresh_steps,
            cfg.on_policy_pool,
            cfg.gen_max_new_tokens,
            SamplingParams(cfg.gen_temperature, 0, cfg.gen_top_p),
            eos_token_ids(target, tokenizer),
            cfg.seed,
            cfg.batch_size,
            cfg.max_length,
            pad,
            accelerator.process_index,
        )

    step = 0
    if resume_from is not None:
        step = resume_from[0]
        accelerator.load_state(str(resume_from[1] / "state"))
        if mixer is not None:
            mixer.load(resume_from[1])
        if accelerator.is_main_process:  # records past the checkpoint will be written again
            for name in ("metrics.jsonl", "losses.jsonl", "speedup.jsonl"):
                _truncate_log(run_dir / name, step)
        print0(accelerator, f"resuming from {resume_from[1]} (step {step})")
    elif accelerator.is_main_process:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (run_dir / "losses.jsonl").unlink(missing_ok=True)
    if step == 0:
        initial = heldout_metrics(draft, target, heldout, accelerator)  # a collective: every process computes
        state = accelerator.get_state_dict(draft)
        if accelerator.is_main_process:
            _log(run_dir / "metrics.jsonl", {"step": 0, **initial})
            tmp = checkpoint.begin(run_dir, "initial")
            _write_draft(accelerator.unwrap_model(draft), state, tokenizer, tmp, cfg.target)
            checkpoint.commit_initial(
                run_dir, tmp, {"step": 0, "target": cfg.target, "config": dataclasses.asdict(cfg)}
            )

    # ---- train ---------------------------------------------------------------------------------
    steps_per_epoch = max(1, len(loader) // cfg.grad_accum)
    bar = tqdm(total=cfg.max_steps, initial=step, desc="distill", disable=not accelerator.is_main_process)
    window_loss, window_tokens, t0 = 0.0, 0, time.perf_counter()
    while step < cfg.max_steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        # The same data order as an uninterrupted run: reseed the sampler per epoch, skip what was done.
        loader.set_epoch(epoch)
        batches = iter(
            accelerator.skip_first_batches(loader, done_in_epoch * cfg.grad_accum) if done_in_epoch else loader
        )
        for _ in range(done_in_epoch, steps_per_epoch):
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            if mixer is not None:
                if mixer.due(step):
                    mixer.refresh(accelerator.unwrap_model(draft), step, progress=accelerator.is_main_process)
                micro = [mixer.maybe_replace(b, step, i, accelerator.device) for i, b in enumerate(micro)]
            local_tokens = sum(int(b["loss_mask"].sum()) for b in micro)
            global_tokens = int(accelerator.reduce(torch.tensor(local_tokens, device=accelerator.device), "sum"))
            step_loss = 0.0
            for i, batch in enumerate(micro):
                # DDP averages gradients over processes, hence the factor num_processes.
                scale = accelerator.num_processes / max(global_tokens, 1)
                sync = i == len(micro) - 1
                with accelerator.no_sync(draft) if not sync else contextlib.nullcontext():
                    loss = distill_step_loss(cfg, draft, teacher_logits, batch) * scale
                    accelerator.backward(loss)
                step_loss += float(loss.detach()) / accelerator.num_processes
            accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_loss = float(accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), "sum"))
            window_loss += step_loss
            window_tokens += global_tokens
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}")
            if accelerator.is_main_process:
                _log(run_dir / "losses.jsonl", {"step": step, "loss": step_loss})
            if step % cfg.log_steps == 0 or step == cfg.max_steps:
                elapsed = time.perf_counter() - t0  # training time only, before the held-out evaluation
                metrics = heldout_metrics(draft, target, heldout, accelerator)
                record = {
                    "step": step,
                    "loss": window_loss / (step % cfg.log_steps or cfg.log_steps),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": window_tokens / elapsed,
                    **metrics,
                }
                if accelerator.is_main_process:
                    _log(run_dir / "metrics.jsonl", record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", alpha=f"{metrics['acceptance_rate']:.3f}")
                window_loss, window_tokens, t0 = 0.0, 0, time.perf_counter()
            if cfg.eval_speedup_steps and step % cfg.eval_speedup_steps == 0:
                _speedup_during_training(cfg, accelerator, run_dir, step, draft, target, tokenizer)
            if step % cfg.save_steps == 0 or step == cfg.max_steps:
                _save(accelerator, cfg, run_dir, step, draft, tokenizer, mixer)
            if step >= cfg.max_steps or step == stop_at_step:
                break
        if step == stop_at_step:
            break

    # ---- cleanup -------------------------------------------------------------------------------
    bar.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return run_dir


def _teacher(cfg: DistillConfig, target, examples: list[dict], pad: int, accelerator: Accelerator):
    """The function that gives a batch's teacher logits: the target's forward, or the top-k cache."""
    if not cfg.teacher_cache:
        # .to(): a target spread with teacher_device_map returns logits on its last device
        return lambda batch: target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.to(
            accelerator.device
        )
    for i, example in enumerate(examples):
        example["index"] = i
    key = teacher_cache.cache_key(cfg.target, target.dtype, examples, cfg.teacher_top_k, 1.0)
    folder = draftsmith_home() / "teacher-cache" / key
    with accelerator.main_process_first():
        teacher_cache.build(
            target,
            examples,
            folder,
            cfg.teacher_top_k,
            cfg.batch_size,
            pad_id=pad,
            progress=accelerator.is_main_process,
        )
    entries = teacher_cache.load(folder)
    vocab = target.config.vocab_size
    return lambda batch: teacher_cache.dense_teacher_logprobs(
        [entries[i] for i in batch["index"].tolist()], batch["loss_mask"], vocab
    )


def _truncate_log(path: Path, step: int) -> None:
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


def _log(file: Path, record: dict) -> None:
    """Append one JSON record to a .jsonl file."""
    with file.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _save(accelerator: Accelerator, cfg: DistillConfig, run_dir: Path, step: int, draft, tokenizer, mixer) -> None:
    """Write checkpoint-{step}: the draft as a model folder, the training state, then the marker."""
    accelerator.wait_for_everyone()
    tmp = checkpoint.begin(run_dir, step) if accelerator.is_main_process else run_dir / f".checkpoint-{step}.tmp"
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    state = accelerator.get_state_dict(draft)  # gathers a sharded (FSDP) draft; every process takes part
    if accelerator.is_main_process:
        _write_draft(accelerator.unwrap_model(draft), state, tokenizer, tmp, cfg.target)
        if mixer is not None:
            mixer.save(tmp)
        info = {"step": step, "target": cfg.target, "draft_init": cfg.draft_init, "config": dataclasses.asdict(cfg)}
        checkpoint.commit(run_dir, tmp, step, info, cfg.keep_last)
    accelerator.wait_for_everyone()


def _speedup_during_training(
    cfg: DistillConfig, accelerator: Accelerator, run_dir: Path, step: int, draft, target, tokenizer
) -> None:
    """Measure the current draft's real speedup (greedy) on the main process; the others wait."""
    if accelerator.is_main_process:
        prompts_file = ddata.EVAL_PROMPTS if cfg.eval_prompts == "builtin" else cfg.eval_prompts
        prompts = read_prompts(prompts_file)[: cfg.eval_limit]
        model = _in_dtype_of(accelerator.unwrap_model(draft), target)
        was_training = model.training
        model.eval()
        result = speedup.measure_draft(
            target,
            model,
            tokenizer,
            prompts,
            cfg.eval_gammas,
            0.0,
            eos_token_ids(target, tokenizer),
            cfg.eval_max_new_tokens,
            progress=False,
            decode=draft_decoder(model),
        )
        model.train(was_training)
        record = {
            "step": step,
            "speedup": result["speedup"],
            "spec_acceptance_rate": result["acceptance_rate"],
            "best_gamma": result["best_gamma"],
            "mean_accepted_tokens": result["mean_accepted_tokens"],
            "greedy_match": result["greedy_match"],
        }
        _log(run_dir / "speedup.jsonl", record)
        tqdm.write(
            f"step {step}: measured speedup {result['speedup']:.2f} at gamma {result['best_gamma']} "
            f"(alpha {result['acceptance_rate']:.3f})"
        )
    accelerator.wait_for_everyone()


def _in_dtype_of(draft, target):
    """The draft as it will decode next to ``target``: a copy cast to the target's dtype when they differ."""
    dtype = next(draft.parameters()).dtype
    return draft if dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)


def _early_exit_k(layers: str) -> int:
    try:
        return int(layers)
    except ValueError as err:
        raise DraftsmithError(f"draft_init early_exit takes draft_layers as a layer count k, got {layers!r}") from err


def _write_draft(model, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
    """The draft as a Hugging Face model folder (a LoRA draft: its adapter, plus a merged copy).

    An early-exit draft is not a standalone model: its folder holds the exit head and a reference to
    the target and k.
    """
    if isinstance(model, EarlyExitDraft):
        model.save(folder, target_name)
        tokenizer.save_pretrained(folder)
        return
    if isinstance(model, PeftModel):
        model.save_pretrained(folder / "adapter")
        model, state = copy.deepcopy(model).merge_and_unload(), None
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(folder)


_RESUME_KEYS = (
    "target",
    "tiny_target",
    "draft_init",
    "draft_layers",
    "draft_config",
    "early_exit_adapter",
    "freeze_embeddings",
    "data",
    "dataset",
    "max_length",
    "batch_size",
    "grad_accum",
    "seed",
    "heldout",
    "gen_samples",
    "on_policy_fraction",
    "on_policy_refresh_steps",
    "on_policy_pool",
    "teacher_cache",
    "teacher_top_k",
)


def _check_resume(run_dir: Path, cfg: DistillConfig) -> tuple[int, Path] | None:
    """The last complete checkpoint to resume from, after checking the run was made with a compatible config."""
    found = checkpoint.checkpoint_dirs(run_dir) if run_dir.is_dir() else []
    if not found:
        return None
    step, path = found[-1]
    saved = json.loads((path / checkpoint.MARKER).read_text())["config"]
    current = dataclasses.asdict(cfg)
    diff = [k for k in _RESUME_KEYS if saved.get(k) != current[k]]
    if diff:
        changes = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in diff)
        raise DraftsmithError(
            f"{run_dir} holds a run made with a different config ({changes}); "
            "use another output_dir, or the same settings to resume"
        )
    if step >= cfg.max_steps:
        raise DraftsmithError(
            f"{run_dir} already reached step {step} (max_steps={cfg.max_steps}); raise max_steps "
            "to train further or use another output_dir"
        )
    return step, path
