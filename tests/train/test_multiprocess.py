"""Two CPU processes (gloo) under torchrun: ranks stay identical and match one process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train

ROOT = Path(__file__).parents[2]
COMMON = ["max_steps=4", "save_steps=4", "log_steps=2", "grad_accum=1"]


def read_losses(run):
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


# 0: the full head; 40: the head cut to 40 of the tiny target's 103 tokens in training, which must
# reach the DDP-wrapped draft's forward.
@pytest.mark.parametrize("cut", [0, 40])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, cut):
    two = tmp_path / "two"
    two.mkdir()
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port, chosen by the rendezvous
        "--nproc_per_node=2",
        "--redirects=3",  # each rank's output to its own file under --log-dir
        f"--log-dir={tmp_path / 'logs'}",
        str(ROOT / "tests" / "train" / "ddp_worker.py"),
        str(two),
        f"output_dir={two / 'run'}",
        "batch_size=4",
        f"train_draft_vocab={cut}",
        *COMMON,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rank_logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").rglob("*.log")))
    assert result.returncode == 0, rank_logs or result.stderr[-3000:]
    rank0, rank1 = load_file(two / "rank-0.safetensors"), load_file(two / "rank-1.safetensors")
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name

    # One process, micro-batches of 4 accumulated twice: the same 8 sequences per optimizer step.
    one = train(
        load_config(
            DistillConfig,
            config_path("tiny"),
            [f"output_dir={tmp_path / 'one'}", "batch_size=4", f"train_draft_vocab={cut}", *COMMON[:-1]]
            + ["grad_accum=2"],
        )
    ).run_dir
    assert read_losses(two / "run") == pytest.approx(read_losses(one), rel=1e-4)
    single = load_file(one / "checkpoint-4" / "model.safetensors")
    for name in rank0:
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-5)
