"""Two CPU processes (gloo) under torchrun: ranks stay identical and match one process with the same global
batch, for the standalone LM and for every registered kind, with the live teacher and from the feature store."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.distill.drafts import KINDS
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from tests.helpers import child_env

ROOT = Path(__file__).parents[2]
COMMON = ["optim.max_steps=4", "save.steps=4", "log.steps=2", "optim.grad_accum=1"]


def read_losses(run):
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


def launch_two_ranks(logs: Path, runs: list[dict]) -> None:
    """Train each of ``runs`` (``ddp_worker.main``'s plan) in two gloo processes, one launch for all."""
    plan = logs.parent / "plan.json"
    plan.write_text(json.dumps(runs))
    for run in runs:
        Path(run["out"]).mkdir(parents=True)
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port, chosen by the rendezvous
        "--nproc_per_node=2",
        "--redirects=3",  # each rank's output to its own file under --log-dir
        f"--log-dir={logs}",
        str(ROOT / "tests" / "train" / "ddp_worker.py"),
        str(plan),
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    rank_logs = "\n".join(p.read_text()[-3000:] for p in sorted(logs.rglob("*.log")))
    assert result.returncode == 0, rank_logs or result.stderr[-3000:]


# What each kind needs on the tiny target, and no random choice in its training forward (a draw would
# differ between one process running two micro-batches and two processes running one each): all of a
# parallel draft's chains kept, every DFlash anchor taken. A kind registered later trains as it comes.
KIND_ITEMS = {
    "eagle3": ["draft.vocab=30"],
    "parallel": ['draft.options={"mask_token_id": 2, "k": 3, "cod_ratio": 1.0, "cod_min": 1.0}'],
    "dflash": ["draft.layers=1", 'draft.options={"mask_token_id": 2, "block_size": 4, "max_anchors": 1000}'],
}
STORE = ["teacher.cache=true", "teacher.top_k=103", "teacher.cache_dtype=float32"]  # the whole tiny vocabulary


TEACHERS = ("live", "store")
CUTS = (0, 40)  # the full head; the head cut to 40 of the tiny target's 103 tokens, which must reach DDP's forward


def kind_items(kind: str, teacher: str) -> list[str]:
    items = [f"draft.kind={kind}", *KIND_ITEMS.get(kind, []), "optim.batch_size=4", "optim.max_steps=2", "save.steps=2"]
    return items + ["log.steps=2", *(STORE if teacher == "store" else [])]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """Every case below trained in two processes by one launch: its folder holds ``<case>/two``."""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = []
    for kind in sorted(KINDS):
        for teacher in TEACHERS:
            case = root / f"{kind}-{teacher}"  # its own DRAFTSMITH_HOME: the store the two processes build
            items = [f"output_dir={case / 'two' / 'run'}", *kind_items(kind, teacher), "optim.grad_accum=1"]
            runs.append({"out": str(case / "two"), "home": str(case / "home"), "items": items})
    for cut in CUTS:
        case = root / f"batch-{cut}"
        items = [f"output_dir={case / 'two' / 'run'}", "optim.batch_size=4", f"draft.vocab={cut}", *COMMON]
        runs.append({"out": str(case / "two"), "home": None, "items": items})
    launch_two_ranks(root / "logs", runs)
    return root


def same_ranks(two: Path) -> dict:
    rank0, rank1 = load_file(two / "rank-0.safetensors"), load_file(two / "rank-1.safetensors")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    return rank0


@pytest.mark.parametrize("teacher", TEACHERS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_in_two_processes_matches_one(launched, tmp_path, monkeypatch, kind, teacher):
    case = launched / f"{kind}-{teacher}"
    monkeypatch.setenv("DRAFTSMITH_HOME", str(case / "home"))  # the store the two processes built, read by one
    two = case / "two"
    rank0 = same_ranks(two)
    items = [f"output_dir={tmp_path / 'one'}", *kind_items(kind, teacher), "optim.grad_accum=2"]
    one = train(load_config(DistillConfig, config_path("tiny"), items))
    assert read_losses(two / "run") == pytest.approx(read_losses(one.run_dir), rel=1e-4)
    single = one.draft.state_dict()
    for name in rank0:
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-5)
    summaries = [json.loads((run / "train_summary.json").read_text()) for run in (two / "run", one.run_dir)]
    # live: a target forward per micro-batch, 2 steps x 2 (processes or accumulated micro-batches)
    assert [s["teacher_forwards"] for s in summaries] == ([4, 4] if teacher == "live" else [0, 0])
    # A live teacher is sharded over the two processes (FSDP2), each holding half of it, with the
    # losses of one process holding it whole (above, within 1e-4); early exit shares the target's
    # layers with its draft, so its teacher stays whole. A store-fed teacher is not run.
    total, sharded = summaries[0]["target_parameters"], teacher == "live" and kind != "early_exit"
    assert summaries[0]["teacher_sharded"] is sharded and summaries[1]["teacher_sharded"] is False
    held = summaries[0]["target_parameters_loaded"]
    assert len(held) == 2 and all(n <= 0.6 * total if sharded else n == total for n in held)
    assert summaries[1]["target_parameters_loaded"] == [total]
    if teacher == "store":  # the two processes built it, each its own shard; the one process read it
        store = Path(summaries[0]["store"])
        assert summaries[1]["store"] == str(store) and len(json.loads((store / "meta.json").read_text())["files"]) == 2


@pytest.mark.parametrize("cut", CUTS)
def test_two_processes_match_one_with_the_same_global_batch(launched, tmp_path, cut):
    two = launched / f"batch-{cut}" / "two"
    rank0 = same_ranks(two)
    # One process, micro-batches of 4 accumulated twice: the same 8 sequences per optimizer step.
    items = [f"output_dir={tmp_path / 'one'}", "optim.batch_size=4", f"draft.vocab={cut}", *COMMON[:-1]]
    one = train(load_config(DistillConfig, config_path("tiny"), [*items, "optim.grad_accum=2"])).run_dir
    assert read_losses(two / "run") == pytest.approx(read_losses(one), rel=1e-4)
    single = load_file(one / "checkpoint-4" / "model.safetensors")
    for name in rank0:
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-5)
