"""``draftsmith publish``: write a checkpoint as a draft model folder that serving stacks load as is."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

from draftsmith.distill.early_exit import is_early_exit
from draftsmith.specdec.decoder import target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_compatible, load_model, load_tokenizer
from draftsmith.specdec.prompts import encode_chat
from draftsmith.train import checkpoint
from draftsmith.train.config import DistillConfig
from draftsmith.train.loop import load_target
from draftsmith.train.speedup import REPORT

# Hub ids of the built-in aliases, for the model card's base_model.
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
CHECK_PROMPTS = ["Write a haiku about the sea.", "What is 7 times 8?", "Name three colors."]

EPILOG = """example:
  draftsmith publish runs/smollm2-135m/checkpoint-120 --out drafts/smollm2-135m-draft
  draftsmith publish runs/smollm2-135m/checkpoint-120 --out drafts/x --push-to-hub me/smollm2-draft --private"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="draftsmith publish",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint-*/ or initial/ folder of a run, or a run folder (its best.json)")
    p.add_argument("--out", required=True, help="folder to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload the folder to this repo")
    p.add_argument("--private", action="store_true", help="create the hub repo as private")
    args = p.parse_args(argv)
    out = publish(Path(args.checkpoint), Path(args.out), args.overwrite)
    print(f"published draft: {out}")
    if args.push_to_hub:
        push(out, args.push_to_hub, args.private)
    return 0


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder; a run folder stands for its best checkpoint (best.json from eval-run)."""
    if (path / "best.json").is_file():
        path = path / json.loads((path / "best.json").read_text())["checkpoint"]
    if not path.is_dir():
        raise DraftsmithError(f"checkpoint not found: {path}")
    if is_early_exit(path):
        raise DraftsmithError(
            f"{path} is an early-exit draft: it shares the target's layers and is not a standalone model, so "
            "transformers and vLLM cannot load it as an assistant; evaluate it with draftsmith eval / eval-run"
        )
    missing = [f for f in ("config.json", "model.safetensors", checkpoint.MARKER) if not (path / f).is_file()]
    if missing:
        raise DraftsmithError(f"{path} is missing {', '.join(missing)}: not a complete draftsmith checkpoint")
    return path


def publish(ckpt: Path, out: Path, overwrite: bool = False) -> Path:
    ckpt = resolve_checkpoint(ckpt)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DraftsmithError(f"{out} exists and is not empty; pass --overwrite to replace it")
    run_dir = ckpt.parent
    cfg = DistillConfig(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    device = torch.device("cpu")
    target, target_tokenizer = load_target(cfg, device)
    draft = load_model(str(ckpt), device, torch.float32)
    tokenizer = load_tokenizer(str(ckpt))
    check_compatible(target_tokenizer, tokenizer, target.config.vocab_size, draft.config.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(cfg, ckpt, run_dir))
        # The written folder must behave exactly like the checkpoint: same greedy tokens.
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHECK_PROMPTS]
        reloaded = load_model(str(tmp), device, torch.float32)
        expected, _ = target_generate(draft, prompts, 16)
        got, _ = target_generate(reloaded, prompts, 16)
        if got != expected:
            raise DraftsmithError(f"the written folder does not reproduce {ckpt}'s greedy output; nothing published")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_card(cfg: DistillConfig, ckpt: Path, run_dir: Path) -> str:
    base_model = HUB_IDS.get(cfg.target, cfg.target)
    meta = {
        "base_model": base_model,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["speculative-decoding", "draft-model", "draftsmith", "distillation"],
    }
    report = json.loads((run_dir / REPORT).read_text()) if (run_dir / REPORT).is_file() else None
    results = (report or {}).get("results", {}).get(ckpt.name, {})
    layers = ""
    if cfg.draft_init == "truncate":
        if str(cfg.draft_layers).strip().isdigit():
            layers = f" of the target's first {cfg.draft_layers} layers"
        else:
            layers = f" of the target's layers {cfg.draft_layers}"
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# Draft model for {base_model}",
        "",
        f"A draft for speculative decoding with `{base_model}` as the target, distilled with draftsmith "
        f"(loss `{cfg.loss}`, data `{cfg.data}`, draft `{cfg.draft_init}`{layers}"
        + f", {json.loads((ckpt / checkpoint.MARKER).read_text())['step']} steps). "
        "Speculative decoding keeps the target's output unchanged; the draft only makes it faster.",
        "",
        "## Measured speedup",
        "",
    ]
    if results:
        dtype = f" in {report['dtype']}" if report.get("dtype") else ""
        cut_head = (
            f", with the draft's head cut to the {report['draft_vocab']} tokens most frequent in the training "
            "answers (frequency-ranked drafting; the published model keeps its full head)"
            if report.get("draft_vocab")
            else ""
        )
        lines += [
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
    else:
        lines.append("Not measured yet: run `draftsmith eval-run` on the training run before publishing.")
    gamma = next(iter(results.values()))["best_gamma"] if results else 4
    lines += [
        "",
        "## Usage",
        "",
        "transformers (assisted generation):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'target = AutoModelForCausalLM.from_pretrained("{base_model}")',
        'draft = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO_OF_THIS_DRAFT")',
        f'tokenizer = AutoTokenizer.from_pretrained("{base_model}")',
        'inputs = tokenizer("Why is the sky blue?", return_tensors="pt")',
        f"out = target.generate(**inputs, assistant_model=draft, num_assistant_tokens={gamma}, max_new_tokens=128)",
        "```",
        "",
        "vLLM (draft-model speculative decoding):",
        "",
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{base_model}", speculative_config={{"model": "PATH_OR_REPO_OF_THIS_DRAFT", '
        f'"num_speculative_tokens": {gamma}}})',
        "```",
        "",
    ]
    return "\n".join(lines)


def push(folder: Path, repo_id: str, private: bool) -> None:
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise DraftsmithError(
            f"no Hugging Face credentials; the local folder {folder} is written. Log in with "
            "`hf auth login` (or set HF_TOKEN) and run publish again with --push-to-hub"
        )
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    except Exception as err:  # network and permission errors come in many types
        raise DraftsmithError(f"upload to {repo_id} failed: {err}; the local folder {folder} is written") from err
    print(f"uploaded to https://huggingface.co/{repo_id}")
