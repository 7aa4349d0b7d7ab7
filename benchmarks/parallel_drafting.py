"""Parallel drafting (PARD, An et al. 2025) against the ordinary draft: the same draft trained the same
wall-clock minutes both ways, then measured side by side on the default target.

The parallel config (``configs/smollm2-135m-parallel.yaml``) is trained as it is and, for the
ordinary draft, with ``draft_kind=lm`` (the same layers, head cut, data, loss and learning rate);
each run trains until ``--minutes`` have passed, then saves its draft. Then, for each draft:

- per-position acceptance: held-out, teacher-forced on the target's greedy answers to the evaluation
  prompts (``parallel.position_acceptance``); for the ordinary draft every position drafts from the
  true prefix, so it is its next-token acceptance at every position;
- the draft's cost for K tokens, in target single-token steps: one forward over [x, K-1 masks]
  against K one-token forwards, on a 128-token context;
- for gamma 1..6, greedy, batch 1: tau, alpha, c (one draft forward), v, the measured speedup, and the
  predicted one ``(1 + sum_j prod_{i<=j} a_i) / (forwards * c + v)`` from the per-position acceptance
  a_i (``forwards``: 1 per round for the parallel draft, gamma for the ordinary one);
- in float32, and in bfloat16 where the CPU has it natively.

With ``--drafts DIR`` nothing is trained here: the standalone LM and the parallel draft another
benchmark trained there for the same budget of minutes each (a run that reached its shipped
``max_steps`` first stopped there; ``trained`` in the results says how long each trained) are measured:
``benchmarks/drafter_kinds.py --out DIR`` (the truncated LM and the parallel config) or
``benchmarks/kind_curves.py --out DIR`` (``smollm2-135m.yaml`` and the parallel config, each at its
largest budget; the figures of the training come from ``benchmarks/results/kind_curves.json``).
With ``--runs ORDINARY,PARALLEL`` the latest checkpoints of two ``draftsmith distill`` runs are
measured (an LM and a parallel draft trained on the same data, e.g. each shipped config to its
``max_steps``); the figures of their training come from each run's ``train_summary.json`` and
``metrics.jsonl``.

Run (2 x MINUTES of training, then about 30 minutes of measuring on 2 cores):
    .venv/bin/python benchmarks/parallel_drafting.py --minutes 30
Smoke test on the tiny target (a minute):
    .venv/bin/python benchmarks/parallel_drafting.py --smoke
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import PROMPTS, RESULTS, save
from kind_runs import answers_batch, decoding_draft, train_for

from draftsmith.distill import vocab_cut
from draftsmith.distill.drafts.parallel import ParallelDraft, position_acceptance
from draftsmith.distill.losses import row_acceptance
from draftsmith.specdec.clock import Clock
from draftsmith.specdec.loading import cpu_has_native_bfloat16, eos_token_ids
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.stream import ModelStream
from draftsmith.train import checkpoint
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.models import load_target

CONFIGS = Path(__file__).parents[1] / "configs"
ORDINARY = ["draft.kind=lm", "draft.options={}"]  # the parallel config's draft, without its masks
# --smoke: configs/tiny.yaml as a parallel draft (<unk> as the mask: the character data has none), head cut too
SMOKE = ["draft.kind=parallel", "draft.options={mask_token_id: 2, k: 4}"]


@torch.no_grad()
def next_token_acceptance(draft, target, batch: dict) -> float:
    """An ordinary draft's held-out acceptance at the loss rows, with the head it decodes with."""
    rows = vocab_cut.loss_rows(batch["loss_mask"])
    p = vocab_cut.head_log_probs(target, vocab_cut.target_rows(target, batch, rows).hidden, None)
    logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    return float(row_acceptance(logits.flatten(0, 1)[rows], p).mean())


@torch.inference_mode()
def cost_for_k(target, draft, k_max: int, mask: int, context: int = 128, reps: int = 7) -> dict:
    """Median seconds, in target single-token steps, of one draft forward over [x, K-1 masks] and of K
    one-token draft forwards, for K = 1..k_max, on a ``context``-token cache."""
    clock = Clock(target.device)
    prompt = torch.arange(1, context + 1)[None] % target.config.vocab_size
    streams = {
        name: ModelStream(model, 1, context + k_max + 2, "slot")
        for name, model in (("target", target), ("draft", draft))
    }
    for stream in streams.values():
        stream.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    keep = torch.tensor([context])

    def median_time(name: str, widths: list[int]) -> float:
        times = []
        for _ in range(reps):
            clock.lap()
            for width in widths:
                step = torch.full((1, width), mask)
                streams[name].forward(step, torch.ones_like(step, dtype=torch.bool), logits_to_keep=width)
            times.append(clock.lap())
            streams[name].rollback(keep)
        return sorted(times)[reps // 2]

    step = median_time("target", [1])
    return {
        k: {"one_forward": median_time("draft", [k]) / step, "k_forwards": median_time("draft", [1] * k) / step}
        for k in range(1, k_max + 1)
    }


def predicted(acceptance: list[float], gamma: int, forwards: int, c: float, v: float) -> float:
    """Expected tokens per round ``1 + sum_j prod_{i<=j} a_i`` over the round's cost in target steps."""
    tokens, reach = 1.0, 1.0
    for a in acceptance[:gamma]:
        reach *= a
        tokens += reach
    return tokens / (forwards * c + v)


def measure(draft, target, tokenizer, eos, acceptance: list[float], parallel: bool, args) -> dict:
    """alpha, tau, c, v, measured and predicted speedup of ``draft`` at each of ``args.gammas``."""
    prompts = read_prompts(PROMPTS)[: args.prompts]
    rows = {}
    for gamma in args.gammas:
        settings = MeasureSettings(
            prompts,
            options=DecodeOptions(gamma=gamma),
            max_new_tokens=args.max_new_tokens,
            eos_ids=eos,
            repeats=args.repeats,
            progress=False,
        )
        r = evaluate_pair(target, draft, tokenizer, settings).to_json()
        c, v = r["cost_ratio_c"], r["verify_ratio_v"]
        rows[gamma] = {
            "acceptance_rate": r["acceptance_rate"],
            "tau": r["mean_accepted_tokens"],
            "c": c,
            "v": v,
            "speedup": r["speedup"],
            "predicted": predicted(acceptance, gamma, 1 if parallel else gamma, c, v),
            "greedy_match": r["greedy_match"],
        }
        print(
            f"  gamma {gamma}: alpha {r['acceptance_rate']:.3f} tau {rows[gamma]['tau']:.2f} c {c:.3f} v {v:.2f} "
            f"speedup {r['speedup']:.3f} predicted {rows[gamma]['predicted']:.3f} greedy {r['greedy_match']}"
        )
    return rows


def measure_dtype(cfg: DistillConfig, folders: dict[str, Path], dtype: torch.dtype, args) -> dict:
    """Everything measured for both drafts with the target (and the drafts) in ``dtype``."""
    target, tokenizer = load_target(cfg, torch.device("cpu"), dtype)
    eos = eos_token_ids(target, tokenizer)
    prompts = [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(PROMPTS)[: args.heldout]]
    batch = answers_batch(target, tokenizer, prompts, args.max_new_tokens, eos)
    k, mask = cfg.draft.options["k"], cfg.draft.options["mask_token_id"]
    result = {}
    for name, folder in folders.items():
        draft = decoding_draft(folder, target, eos)
        parallel = isinstance(draft, ParallelDraft)
        with torch.no_grad():
            if parallel:
                acceptance = position_acceptance(draft, target, batch, max(k, max(args.gammas))).tolist()
            else:
                acceptance = [next_token_acceptance(draft, target, batch)] * max(k, max(args.gammas))
        print(
            f"{name} ({str(dtype).removeprefix('torch.')}): per-position acceptance {[round(a, 3) for a in acceptance]}"
        )
        result[name] = {
            "position_acceptance": acceptance,
            "cost_for_k": cost_for_k(target, draft.decoding_model() if parallel else draft, max(args.gammas), mask),
            "gammas": measure(draft, target, tokenizer, eos, acceptance, parallel, args),
        }
    return result


def trained_elsewhere(out: Path, parser) -> tuple[dict, dict]:
    """The two drafts another benchmark trained under ``out``, with its figures of their training, and
    their latest checkpoints: drafter_kinds' layout (a ``trained.json`` per run) or kind_curves' (the
    figures of each run's last snapshot in its results file)."""
    if (out / "lm").is_dir() and (out / "parallel").is_dir():
        curves = json.loads((RESULTS / "kind_curves.json").read_text())
        trained, folders = {}, {}
        for name, kind in (("ordinary", "lm"), ("parallel", "parallel")):
            if kind not in curves:
                parser.error(f"{RESULTS / 'kind_curves.json'} has no {kind} curve: run benchmarks/kind_curves.py first")
            last = curves[kind][-1]
            folders[name] = out / kind / f"checkpoint-{last['steps']}"
            if not folders[name].is_dir():
                parser.error(f"{folders[name]} not found: kind_curves.json was measured on other drafts than {out}'s")
            figures = {"steps": last["steps"], "train_s": last["train_s"], "heldout_alpha": last["heldout_sum_min_pq"]}
            trained[name] = {"from": str(folders[name]), **figures, "load_average": last["load_average"]}
        return trained, folders
    trained, folders = {}, {}
    for name, folder in (("ordinary", "truncated-LM"), ("parallel", "parallel-draft")):
        if not (out / folder / "trained.json").is_file():
            parser.error(
                f"{out / folder / 'trained.json'} not found: train with benchmarks/drafter_kinds.py or "
                "benchmarks/kind_curves.py first"
            )
        trained[name] = {"from": str(out / folder), **json.loads((out / folder / "trained.json").read_text())}
        folders[name] = checkpoint.checkpoint_dirs(out / folder)[-1][1]
    return trained, folders


def distill_runs(spec: str, parser) -> tuple[dict, dict]:
    """``--runs ORDINARY,PARALLEL``: two distill run folders, their latest checkpoints and the figures of
    their training (steps and step seconds from ``train_summary.json``, the last held-out alpha logged
    in ``metrics.jsonl``)."""
    runs = [Path(part) for part in spec.split(",")]
    if len(runs) != 2:
        parser.error(f"--runs takes two run folders, ORDINARY,PARALLEL; got {spec!r}")
    trained, folders = {}, {}
    for name, run in zip(("ordinary", "parallel"), runs, strict=True):
        summary, metrics = run / "train_summary.json", run / "metrics.jsonl"
        if not summary.is_file() or not metrics.is_file():
            parser.error(f"{run}: no train_summary.json or metrics.jsonl; is it a finished draftsmith distill run?")
        done = json.loads(summary.read_text())
        logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        heldout = [m for m in logged if "acceptance_rate" in m]  # held-out alpha, logged every log.steps
        folders[name] = checkpoint.checkpoint_dirs(run)[-1][1]
        trained[name] = {
            "from": str(folders[name]),
            "steps": done["step"],
            "train_s": done["steps"] / done["steps_per_s"] if done["steps_per_s"] else 0.0,
            "heldout_alpha": heldout[-1]["acceptance_rate"] if heldout else None,
            "teacher": done["teacher"],
        }
    return trained, folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes per draft")
    parser.add_argument("--out", default="runs/parallel_drafting")
    parser.add_argument("--gammas", default="1,2,3,4,5,6")
    parser.add_argument("--prompts", type=int, default=8, help="evaluation prompts timed")
    parser.add_argument("--heldout", type=int, default=24, help="evaluation prompts for per-position acceptance")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16" if cpu_has_native_bfloat16() else "float32")
    parser.add_argument("--smoke", action="store_true", help="the tiny target, seconds of training, few prompts")
    parser.add_argument(
        "--drafts", type=Path, help="measure the drafts benchmarks/drafter_kinds.py or kind_curves.py trained there"
    )
    parser.add_argument("--runs", help="ORDINARY,PARALLEL: measure the latest checkpoints of two distill runs")
    args = parser.parse_args()
    overrides = ["optim.max_steps=1000000", "save.steps=1000000", "log.steps=1000000", "save.keep_last=1"]
    config, parallel = CONFIGS / "smollm2-135m-parallel.yaml", []
    if args.smoke:
        config, parallel = CONFIGS / "tiny.yaml", SMOKE
        overrides.append("draft.vocab=48")
        args.minutes, args.prompts, args.heldout, args.max_new_tokens, args.repeats = 0.1, 2, 4, 16, 1
        args.gammas = "1,2,3"
    args.gammas = [int(g) for g in args.gammas.split(",")]
    out = Path(args.out) / ("smoke" if args.smoke else "default")
    folders, trained = {}, {}
    if args.drafts is not None:
        out = args.drafts
        trained, folders = trained_elsewhere(out, parser)
    elif args.runs is not None:
        trained, folders = distill_runs(args.runs, parser)
        out = folders["parallel"].parent
    else:
        for name, kind in (("ordinary", ORDINARY), ("parallel", parallel)):
            cfg = load_config(DistillConfig, str(config), [*overrides, *kind, f"output_dir={out / name}"])
            record = out / name / "trained.json"
            if not record.is_file():  # a later call measures the same drafts again
                record.write_text(json.dumps(train_for(cfg, args.minutes)))
            trained[name] = json.loads(record.read_text())
            folders[name] = out / name / f"checkpoint-{trained[name]['steps']}"
    for name in trained:
        print(f"{name}: {trained[name]['steps']} steps in {trained[name]['train_s'] / 60:.1f} min")
    parallel_cfg = load_config(DistillConfig, str(config), [*overrides, *parallel, f"output_dir={out / 'parallel'}"])
    measured_elsewhere = args.drafts is not None or args.runs is not None
    minutes = trained["parallel"]["train_s"] / 60 if measured_elsewhere else args.minutes
    result = {"trained": trained, "minutes": minutes, "smoke": args.smoke, "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        result["dtypes"][name] = measure_dtype(parallel_cfg, folders, dtype, args)
    if args.smoke:  # not a measurement of anything worth keeping
        (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"written: {out / 'result.json'}")
    else:
        save("parallel_drafting", result)


if __name__ == "__main__":
    main()
