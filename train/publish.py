"""A checkpoint written as a draft model folder that serving stacks load as is, with a model card.

The folder is written beside its destination and renamed into place only after it reproduces the
checkpoint's greedy output, so a published folder is always a complete, working draft. It ends with
a marker (``.draftsmith-published``) listing the files publish wrote: ``--overwrite`` replaces a
folder only when it holds that marker and nothing else, or is empty; a run, a checkpoint, a dataset,
the source being published or any other folder of the user's is refused (``check_output_folder``).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from draftsmith.distill.drafts import DraftKind, Serving, kind_of_folder
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.decoder import speculative_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import atomic_path, check_writable
from draftsmith.specdec.loading import check_compatible, load_tokenizer
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from draftsmith.train import batch_schedule, checkpoint
from draftsmith.train.config import RUN_CONFIG, DistillConfig, draft_settings
from draftsmith.train.models import RunModels
from draftsmith.train.profile import draft_profile, figure, profile_lines, write_profile
from draftsmith.train.speedup import BEST, REPORT, batch_one_entry, card_figures, does_not_pay, load_report, schedule_of

GAMMA = 4  # draft tokens per round of an unmeasured draft (eval's default)
# Hub ids of the built-in aliases, for the model card's base_model.
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Their licenses, the card's default license field (a distilled draft carries its target's).
LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0"}
CHECK_PROMPTS = ["Write a haiku about the sea.", "What is 7 times 8?", "Name three colors."]
PUBLISHED = ".draftsmith-published"  # written last into a published folder: the files publish wrote there
DATASET_MANIFEST = "manifest.json"  # a `draftsmith data` folder (distill.dataset_builder.MANIFEST)


def resolve_checkpoint(path: Path) -> Path:
    """A complete, standalone checkpoint folder; a run folder stands for its best checkpoint (eval-run's best.json)."""
    if (path / BEST).is_file():
        best = json.loads((path / BEST).read_text()).get("checkpoint")
        if not isinstance(best, str):
            raise DraftsmithError(
                f"{path / BEST} names no checkpoint (its eval-run measured nothing): run draftsmith eval-run "
                "on the run again, or publish a checkpoint-*/ folder directly"
            )
        path = path / best
    elif (path / RUN_CONFIG).is_file():
        raise DraftsmithError(
            f"{path} is a run folder with no ranking ({BEST}): run draftsmith eval-run {path} first, "
            "or publish one of its checkpoint-*/ folders"
        )
    if not path.is_dir():
        raise DraftsmithError(f"checkpoint not found: {path}")
    kind = kind_of_folder(path)
    if kind is not None:
        kind.check_export(path)  # refuses a kind that cannot be published, saying why
    missing = checkpoint.missing_files(path)
    if missing:
        raise DraftsmithError(f"{path} is missing {', '.join(missing)}: not a complete draftsmith checkpoint")
    return path


def publish(
    ckpt: Path,
    out: Path,
    overwrite: bool = False,
    repo_id: str | None = None,
    license: str | None = None,
    models: RunModels | None = None,
) -> Path:
    """Write checkpoint ``ckpt`` (or a run's best) to ``out`` with a model card; return ``out``.

    repo_id: the hub repository the folder is going to (the card's usage names it; else ``out``).
    license: the card's license field (default: the built-in target's, else "other").
    models: the run's config and target when the caller has them loaded (``quickstart``)."""
    ckpt = resolve_checkpoint(ckpt)
    check_output_folder(out, {"the checkpoint being published": ckpt, "its run": ckpt.parent}, overwrite)
    run_dir = ckpt.parent
    models = models or RunModels.for_run(run_dir)
    cfg, device = models.cfg, torch.device("cpu")
    target = models.target(device, torch.float32)
    target_tokenizer = models.tokenizer
    kind = kind_of_folder(ckpt)
    draft = kind.load(ckpt, target, device, torch.float32)
    tokenizer = load_tokenizer(str(ckpt))
    check_compatible(target_tokenizer, tokenizer, target.config.vocab_size, draft.config.vocab_size)

    report = load_report(run_dir)  # eval-run's report, read once ({"results": {}} when never measured)
    measured = measured_settings(report, run_dir, ckpt)
    serving = Serving(gamma=measured["gamma"], tree=measured_tree(report, ckpt))
    schedule = measured_schedule(report, ckpt)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        kind.export(draft, tokenizer, tmp, serving)
        if schedule is not None:  # draftsmith's decoder reads the gammas it measured; vLLM's come in the card
            batch_schedule.write_schedule(tmp, schedule["bundled"][batch_schedule.SCHEDULE_KEY])
        if measured["draft_vocab"]:
            # The head cut the measurement used: eval on the published folder drafts with it too.
            ranking = draft_vocab.load_ranking(run_dir, measured["draft_vocab"])
            draft_vocab.save_ranking(tmp, ranking)
        results = measured_results(report, ckpt)
        profile = draft_profile(cfg, ckpt, report, results, target, schedule)
        write_profile(tmp, profile)
        ref = repo_id or str(out.resolve())
        card = model_card(cfg, ckpt, kind, tmp, draft_ref=ref, license=license, measured=(report, results, profile))
        card.save(tmp / "README.md")
        # The written folder must draft exactly like the checkpoint: the same tokens accepted.
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHECK_PROMPTS]
        if drafted(target, kind.load(tmp, target, device, torch.float32), prompts) != drafted(target, draft, prompts):
            raise DraftsmithError(f"the written folder does not draft as {ckpt} does; nothing published")
        readable_by_all(tmp)
        write_marker(tmp, ckpt)
    return out


def drafted(target, draft, prompts: list[list[int]], gamma: int = 3) -> list[tuple[int, int]]:
    """(proposed, accepted) per prompt when ``draft`` drafts greedily for ``target``: a fingerprint of
    the draft's predictions along the target's own text (which is the same for every draft)."""
    counts = []
    for prompt in prompts:
        _, stats = speculative_generate(target, draft, [prompt], 16, options=DecodeOptions(gamma=gamma, compile=False))
        counts.append((stats.proposed, stats.accepted))
    return counts


def check_output_folder(out: Path, sources: dict[str, Path], overwrite: bool, name: str | None = None) -> None:
    """Refuse an output folder whose replacement would lose work, before anything loads.

    sources: what is being published, by how the message names it (the checkpoint, its run): the
    folder may neither be one of them, hold one, nor lie inside one. A run, a checkpoint or a
    dataset is refused with or without ``overwrite``; a non-empty folder only with ``overwrite`` and
    only when publish wrote everything in it (its marker lists the files); an empty or new folder always.
    name: how messages name the folder (default ``--out OUT``).
    """
    out = Path(out)
    name = name or f"--out {out}"
    check_writable(out, name, folder=True)
    if out.is_symlink():
        raise DraftsmithError(f"{name} is a symbolic link; give the folder it points to, or a new folder")
    real = out.resolve()
    for label, source in sources.items():
        source = Path(source).resolve()
        if real == source:
            where = "is"
        elif real in source.parents:
            where = "holds"
        elif source in real.parents:
            where = "lies inside"
        else:
            continue
        raise DraftsmithError(f"{name} {where} {label} ({source}); write the draft to a new folder outside the run")
    if not out.is_dir() or not any(out.iterdir()):
        return
    for marker, kind in (
        (RUN_CONFIG, "a distillation run"),
        (checkpoint.MARKER, "a checkpoint"),
        (DATASET_MANIFEST, "a dataset"),
    ):
        if (out / marker).is_file():
            raise DraftsmithError(
                f"{name} is {kind} (it has {marker}); publish never replaces one: choose a new folder"
            )
    if not (out / PUBLISHED).is_file():
        raise DraftsmithError(
            f"{name} is not empty and was not written by draftsmith publish; choose a new or empty folder"
        )
    if not overwrite:
        raise DraftsmithError(f"{out} exists and is not empty; pass --overwrite to replace it (a published draft)")
    written = set(json.loads((out / PUBLISHED).read_text())["files"]) | {PUBLISHED}
    added = sorted(
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and str(p.relative_to(out)) not in written
    )
    if added:
        raise DraftsmithError(
            f"--overwrite replaces only what publish wrote, and {out} also holds {added[0]}"
            f"{f' and {len(added) - 1} more' if len(added) > 1 else ''}; move it out first"
        )


def write_marker(folder: Path, ckpt: Path) -> None:
    """The last file of a published folder: which checkpoint it is and every file publish wrote."""
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    (folder / PUBLISHED).write_text(json.dumps({"checkpoint": str(ckpt.resolve()), "files": files}, indent=2) + "\n")
    os.chmod(folder / PUBLISHED, 0o644)


def readable_by_all(folder: Path) -> None:
    """Folders 0755 and files 0644, as a published model is shared (the temporary folder starts 0700)."""
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def measured_settings(report: dict, run_dir: Path, ckpt: Path) -> dict:
    """The gamma (best at the report's first temperature) and draft vocabulary size ``ckpt`` was
    measured with by eval-run (``report``, its run's, as ``speedup.load_report`` reads it); when it was
    not measured, the default gamma and the head it was trained with (the cut its folder carries, else
    the full head)."""
    by_temp = report["results"].get(ckpt.name, {})
    first = str(report["temperatures"][0]) if by_temp else None
    if first not in by_temp:
        trained_cut = len(draft_vocab.load_ranking(ckpt)) if (ckpt / draft_vocab.FILE).is_file() else 0
        return {"gamma": GAMMA, "draft_vocab": trained_cut, "measured": False}
    figures = [by_temp[first].get(k) for k in ("best_gamma", "speedup", "acceptance_rate")]
    if any(x is None or math.isnan(x) for x in figures):
        raise DraftsmithError(
            f"{run_dir / REPORT} has no figures for {ckpt.name} (its eval-run measured nothing): run "
            "draftsmith eval-run on the run again with more --max-new-tokens, then publish"
        )
    return {"gamma": by_temp[first]["best_gamma"], "draft_vocab": report.get("draft_vocab") or 0, "measured": True}


def measured_tree(report: dict, ckpt: Path) -> str | None:
    """The token-tree shape eval-run chose over the chain for ``ckpt`` at the report's first temperature
    (``speedup.choose_tree``), or None: the chain, or not measured with trees."""
    by_temp = report["results"].get(ckpt.name, {})
    first = by_temp.get(str(report["temperatures"][0]), {}) if by_temp else {}
    return first.get("best_tree")


def measured_schedule(report: dict, ckpt: Path) -> dict | None:
    """The gammas by batch size eval-run chose for ``ckpt`` at the report's first temperature, or None
    where it was not measured: ``bundled``, the bundled decoder's (its ``by_batch_size`` entries and
    their ranges; batch 1 alone, from the checkpoint's own figures, where it was not chosen at more
    sizes), and ``vllm``, the engine's (``engine_eval.engine_run_schedule``) when ``eval-run --engine
    vllm --batch-sizes`` measured this checkpoint, else None."""
    by_temp = report["results"].get(ckpt.name, {})
    first = str(report["temperatures"][0]) if by_temp else None
    if first not in by_temp:
        return None
    result = by_temp[first]
    under = {"dtype": report.get("dtype"), "matmul": report.get("matmul")}
    entries = result.get("by_batch_size") or {"1": batch_one_entry(result, None, under)}
    engine = report.get("engine_schedule")
    same = engine is not None and engine["checkpoint"] == ckpt.name and str(engine["temperature"]) == first
    return {
        "temperature": float(first),
        "bundled": {"by_batch_size": entries, batch_schedule.SCHEDULE_KEY: schedule_of(entries)},
        "vllm": engine if same else None,
    }


def is_hub_id(name: str) -> bool:
    """``owner/name`` as the hub spells a repository, and not a local path."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not Path(name).exists()


def measured_results(report: dict, ckpt: Path) -> dict:
    """``ckpt``'s figures per temperature in the run's ``report`` as its card gives them: its confirmation
    where it was measured again (``speedup.card_figures``)."""
    return {temp: card_figures(r) for temp, r in report["results"].get(ckpt.name, {}).items()}


def model_card(
    cfg: DistillConfig,
    ckpt: Path,
    kind: DraftKind,
    folder: Path,
    draft_ref: str,
    license: str | None,
    measured: tuple[dict, dict, dict],
) -> ModelCard:
    """The model card (README.md): hub metadata with the measured results as ``eval_results``, what the
    draft is and how it was made, its acceptance profile, and usage that runs as written; the kind
    describes the draft exported into ``folder`` and gives the usage of each engine that runs it
    (``DraftKind.card_usage``). measured: (report, results, profile) as ``measured_results`` and
    ``profile.draft_profile`` give them."""
    target = HUB_IDS.get(cfg.target, cfg.target)
    report, results, profile = measured
    data = ModelCardData(
        base_model=target if is_hub_id(target) else None,
        license=license or LICENSES.get(target, "other"),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "draft-model", "draftsmith", "distillation"],
        model_name=f"draft model for {target}",
        eval_results=_eval_results(report, results) if results else None,
    )
    steps = json.loads((ckpt / checkpoint.MARKER).read_text())["step"]
    made_of = "" if is_hub_id(target) else f" (the target is `{target}`, not a hub model)"
    lines = [
        f"# Draft model for {target}",
        "",
        f"A `{kind.name}` draft for speculative decoding with `{target}` as the target{made_of}: "
        f"{kind.card_description(draft_settings(cfg), folder)}. Distilled with draftsmith (loss `{cfg.loss.name}`, "
        f"data `{cfg.data.mode}`, {steps} steps). Speculative decoding keeps the target's output unchanged; the draft "
        "only makes it faster.",
        "",
        "## Measured speedup",
        "",
    ]
    if results:
        lines += _measured(report, results)
        lines += ["", *profile_lines(profile)]
    else:
        lines.append("Not measured yet: run `draftsmith eval-run` on the training run before publishing.")
    gamma = next(iter(results.values()))["best_gamma"] if results else GAMMA
    lines += kind.card_usage(target, draft_ref, gamma)
    if profile.get("gamma_by_batch_size"):
        lines += schedule_lines(profile["gamma_by_batch_size"], kind, Path(draft_ref), gamma)
    text = "\n".join(lines)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")


def _eval_results(report: dict, results: dict) -> list[EvalResult]:
    """alpha, tau, speedup and gamma per temperature, with the hardware and dtype they were measured on."""
    prompts = Path(report["prompts"]).stem
    out = []
    for temp, r in results.items():
        args = {
            "temperature": float(temp),
            "gamma": r["best_gamma"],
            "hardware": report["hardware"],
            "dtype": report.get("dtype"),
            "max_new_tokens": report["max_new_tokens"],
            "draft_vocab": report.get("draft_vocab") or None,
        }
        for metric, value in (
            ("acceptance_rate", r["acceptance_rate"]),
            ("mean_accepted_tokens", r["mean_accepted_tokens"]),
            ("speedup", r["speedup"]),
            ("gamma", r["best_gamma"]),
        ):
            out.append(
                EvalResult(
                    task_type="text-generation",
                    task_name="speculative decoding",
                    dataset_type=prompts,
                    dataset_name=prompts,
                    metric_type=metric,
                    metric_value=value,
                    metric_name=f"{metric} (T={temp})",
                    metric_config=f"temperature={temp}",
                    metric_args=args,
                )
            )
    return out


def _measured(report: dict, results: dict) -> list[str]:
    """The card's table of what eval-run measured for this checkpoint, one row per temperature."""
    dtype = f" in {report['dtype']}" if report.get("dtype") else ""
    cut_head = (
        f", with the draft's head cut to the {report['draft_vocab']} tokens most frequent in the training "
        "answers (frequency-ranked drafting; the published model keeps its full head)"
        if report.get("draft_vocab")
        else ""
    )
    lines = [
        f"Measured by `draftsmith eval-run` with its bundled speculative decoder on {report['hardware']}{dtype}, "
        f"prompts `{report['prompts']}`, {report['max_new_tokens']} new tokens, against a KV-cached "
        f"target-only decoder{cut_head}:",
        "",
        "| temperature | gamma | acceptance rate | mean accepted tokens | speedup |",
        "|---|---|---|---|---|",
    ]
    for temp, r in results.items():
        lines.append(
            f"| {temp} | {r['best_gamma']} | {r['acceptance_rate']:.3f} | "
            f"{r['mean_accepted_tokens']:.2f} | {r['speedup']:.2f}x |"
        )
    first = results.get(str(report["temperatures"][0]), {})
    verdict = does_not_pay("This draft", first.get("speedup"))
    if verdict is not None:
        lines += ["", f"**{verdict}.**"]
    if "chosen_speedup" in first:
        lines += [
            "",
            f"At temperature {report['temperatures'][0]} these figures are a second measurement of this checkpoint, "
            f"taken after `draftsmith eval-run` chose it among its run's drafts at {first['chosen_speedup']:.2f}x: the "
            "fastest of several measured drafts tends to have been measured in its luckiest minutes, and a "
            "measurement taken after the choice carries no such luck.",
        ]
    kept = sum(r.get("guesses_accepted", 0) for r in results.values())
    if kept:
        lines += [
            "",
            "The bundled decoder paces drafting (a sequence stops drafting while it does not pay) and verifies "
            "lookup guesses beside the draft's tokens: tokens copied from the prompt and the answer where they "
            f"repeat themselves ({kept} kept in these runs). Both are part of the speedup above; transformers' and "
            "vLLM's decoding with this draft do neither. `draftsmith eval --no-guesses --no-pace` measures the "
            "draft alone.",
        ]
    if first.get("best_tree"):
        tree = first["trees"][first["best_tree"]]
        lines += [
            "",
            f"draftsmith's own decoder measured a token tree faster: shape {first['best_tree']}, "
            f"{tree['nodes_per_round']:.1f} nodes and {tree['mean_accepted_tokens']:.2f} tokens per round, "
            f"speedup {tree['speedup']:.2f}x (the chain above: {first['speedup']:.2f}x). `generation_config.json` "
            "carries it as `draftsmith.tree`, and `draftsmith eval --draft` on this folder decodes with it; "
            "transformers and vLLM draft the chain.",
        ]
    return lines


def schedule_lines(schedule: dict, kind: DraftKind, folder: Path, gamma: int) -> list[str]:
    """The card's section on gamma per batch size (``measured_schedule``): what was measured at each
    size, where the schedule is carried, and the speculative config vLLM reads it from (the kind's
    ``engine_config`` for ``folder`` with the schedule measured in vLLM where it was, else the bundled
    decoder's; ``gamma``: the chain gamma of batch 1)."""
    key = batch_schedule.SCHEDULE_KEY
    bundled, vllm = schedule["bundled"], schedule["vllm"]
    lines = [
        "",
        "## Gamma per batch size",
        "",
        f"Measured by `draftsmith eval-run --batch-sizes` at temperature {schedule['temperature']}: at each batch "
        "size the gamma is chosen as at batch 1, beside the target alone at that size, and a size where drafting "
        "measured slower than the target alone gets gamma 0 (drafting off).",
        "",
        "| batch size | measured in | best gamma | speedup there | gamma served |",
        "|---|---|---|---|---|",
    ]
    for size, e in sorted(bundled["by_batch_size"].items(), key=lambda item: int(item[0])):
        engine = f"draftsmith's decoder, {e['dtype']}"
        lines.append(f"| {size} | {engine} | {e['best_gamma']} | {figure(e['speedup'], '.2f', 'x')} | {e['gamma']} |")
    for size, e in sorted((vllm or {}).get("by_batch_size", {}).items(), key=lambda item: int(item[0])):
        engine = f"vLLM {vllm['engine_version']}, {vllm['dtype']}"
        lines.append(f"| {size} | {engine} | {e['best_gamma']} | {figure(e['speedup'], '.2f', 'x')} | {e['gamma']} |")
    lines += [
        "",
        f"`generation_config.json` carries the bundled decoder's schedule as `draftsmith.{key}` "
        f"({batch_schedule.format_ranges(bundled[key])}: inclusive batch-size ranges and their gamma); "
        "`draftsmith eval --draft` on this folder drafts the gamma of its `--batch-size`, and transformers keeps "
        f"`num_assistant_tokens` ({gamma}), the gamma of batch 1.",
    ]
    try:
        config = kind.engine_config(folder)
    except DraftsmithError:  # a kind no serving engine runs: draftsmith's decoder alone reads the schedule
        return lines + [""]
    ranges = vllm[key] if vllm else bundled[key]
    config |= {"num_speculative_tokens": batch_schedule.engine_gamma(ranges, gamma), key: [tuple(r) for r in ranges]}
    measured_by = f"vLLM {vllm['engine_version']}" if vllm else "draftsmith's decoder (not measured in vLLM)"
    return lines + [
        "",
        f"vLLM 0.32 and later switch gamma with the batch size by `{key}` in the speculative config (a batch "
        f"past the last range takes its gamma; each is capped at `num_speculative_tokens`). As measured by "
        f"{measured_by}:",
        "",
        "```python",
        f"speculative_config = {config!r}",
        "```",
        "",
    ]


def push(folder: Path, repo_id: str, private: bool) -> None:
    """Upload ``folder`` to the hub repo ``repo_id`` (created when missing)."""
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise DraftsmithError(
            f"no Hugging Face credentials; the local folder {folder} is written. Log in with "
            "`hf auth login` (or set HF_TOKEN) and run publish again with --push-to-hub"
        )
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, ignore_patterns=[PUBLISHED])
    except Exception as err:  # network and permission errors come in many types
        raise DraftsmithError(f"upload to {repo_id} failed: {err}; the local folder {folder} is written") from err
    print(f"uploaded to https://huggingface.co/{repo_id}")
