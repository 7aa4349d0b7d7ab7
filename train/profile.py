"""What a published draft carries of its measurement and its making, in one file beside its card.

``draftsmith_profile.json`` holds, per measured temperature, the acceptance profile (the rate, the
acceptance at each draft position, and acceptance and speedup per prompt category) with the gamma
or token tree it was measured at, exactly the figures the model card gives; and the draft's
provenance: the target (its name and a digest of its weights), the dataset (its name, and the
digest and id of its manifest when it is a ``draftsmith data`` folder), the run's config, the
draftsmith version, and the machine and settings every figure was measured under. The card shows
the profile as a table and ``acceptance.png``; ``draftsmith eval`` of the folder against another
target warns, naming both.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from draftsmith.distill import dataset_builder
from draftsmith.specdec.files import write_text
from draftsmith.train.config import DistillConfig, flat_settings

PROFILE = "draftsmith_profile.json"
PLOT = "acceptance.png"
# what the profile records of the settings a report was measured under
MEASURED_UNDER = ("prompts", "max_new_tokens", "limit", "repeats", "pace", "dtype", "matmul", "draft_vocab", "gammas")


def weights_digest(model: PreTrainedModel) -> str:
    """sha256 over ``model``'s parameters as loaded, name by name in order (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def dataset_provenance(cfg: DistillConfig) -> dict:
    """The run's dataset: its name, and for a ``draftsmith data`` folder its manifest's id and digest."""
    out: dict = {"dataset": cfg.data.dataset, "mode": cfg.data.mode}
    folder = dataset_builder.built_folder(cfg.data.dataset)
    if folder is not None:
        manifest = (folder / dataset_builder.MANIFEST).read_bytes()
        out |= {"manifest_sha256": hashlib.sha256(manifest).hexdigest(), "id": json.loads(manifest).get("id")}
    return out


def draft_profile(
    cfg: DistillConfig, ckpt: Path, report: dict, results: dict, target, schedule: dict | None = None
) -> dict:
    """The profile of checkpoint ``ckpt``: ``results`` its figures per temperature as its card gives
    them (``speedup.card_figures``), ``report`` the run's eval-run report as ``speedup.load_report`` reads
    it (without ``temperatures`` when the run was never measured), ``schedule`` its gammas by batch
    size (``publish.measured_schedule``: each size's figures with the dtype it ran in, and the ranges
    written into ``generation_config.json`` and the card's vLLM config)."""
    acceptance = {
        temp: {
            "gamma": r["best_gamma"],
            "tree": r.get("tree") or r.get("best_tree"),
            "acceptance_rate": r["acceptance_rate"],
            "acceptance_by_position": r.get("acceptance_by_position"),
            "speedup": r["speedup"],
            "greedy_match": r.get("greedy_match"),
            "by_category": r.get("by_category"),
        }
        for temp, r in results.items()
    }
    measured = "temperatures" in report  # what eval-run writes; load_report's stand-in has only results
    under = {key: report.get(key) for key in MEASURED_UNDER} if measured else {}
    machine = {"hardware": report.get("hardware"), "machine": report.get("machine")} if measured else {}
    provenance = {
        "target": cfg.target,
        "target_weights_sha256": weights_digest(target),
        "target_weights_as": f"{str(target.dtype).removeprefix('torch.')} parameters as loaded, in name order",
        **dataset_provenance(cfg),
        "checkpoint": ckpt.name,
        "config": flat_settings(cfg),
        "draftsmith_version": importlib.metadata.version("draftsmith"),
    }
    return {
        "acceptance": acceptance,
        "gamma_by_batch_size": schedule,
        "measured_under": {**under, **machine},
        "provenance": provenance,
    }


def write_profile(folder: Path, profile: dict) -> None:
    """``PROFILE`` and, when acceptance per position was measured, ``PLOT`` into ``folder``."""
    write_text(folder / PROFILE, json.dumps(profile, indent=2) + "\n")
    curves = {t: a["acceptance_by_position"] for t, a in profile["acceptance"].items() if a["acceptance_by_position"]}
    if not curves:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3))
    for temp, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"temperature {temp}")
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="acceptance by draft position")
    ax.set_xticks(range(1, max(len(c) for c in curves.values()) + 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / PLOT, dpi=100)
    plt.close(fig)


def profile_lines(profile: dict) -> list[str]:
    """The card's section on the profile: acceptance per position and per category, per temperature."""
    lines = ["## Acceptance profile", ""]
    for temp, a in profile["acceptance"].items():
        at = f"token tree {a['tree']}" if a["tree"] else f"gamma {a['gamma']}"
        lines.append(
            f"Temperature {temp}, {at}: acceptance rate {figure(a['acceptance_rate'], '.3f')}, "
            f"speedup {figure(a['speedup'], '.2f', 'x')}."
        )
        lines.append("")
        if a["acceptance_by_position"]:
            positions = a["acceptance_by_position"]
            lines += [
                "| draft position | " + " | ".join(str(i + 1) for i in range(len(positions))) + " |",
                "|---|" + "---|" * len(positions),
                "| acceptance | " + " | ".join(figure(x, ".3f") for x in positions) + " |",
                "",
            ]
        if a["by_category"]:
            lines += ["| category | acceptance rate | speedup |", "|---|---|---|"]
            for name, figures in sorted(a["by_category"].items()):
                rate, speed = figure(figures["acceptance_rate"], ".3f"), figure(figures["speedup"], ".2f", "x")
                lines.append(f"| {name} | {rate} | {speed} |")
            lines.append("")
    if any(a["acceptance_by_position"] for a in profile["acceptance"].values()):
        lines += [f"![acceptance by draft position]({PLOT})", ""]
    lines += [f"`{PROFILE}` holds these figures with the target's weight digest, the dataset, the config and the "
              "machine and settings they were measured under.", ""]  # fmt: skip
    return lines


def figure(value: float | None, spec: str, unit: str = "") -> str:
    """A measured figure as the card prints it; "-" where it was not measured (a run that never drafted
    has no acceptance rate, a position no round reached none either, a NaN where nothing was timed)."""
    return "-" if value is None or value != value else f"{value:{spec}}{unit}"


def profile_target(folder: Path) -> str | None:
    """The target a published folder was distilled and measured for (its profile), or None."""
    path = Path(folder) / PROFILE
    return json.loads(path.read_text())["provenance"]["target"] if path.is_file() else None
