"""``draftsmith data`` in two CPU processes (gloo, under torchrun): disjoint shares, one manifest."""

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.cli import main
from draftsmith.distill.dataset_builder import load_built, read_self_prompts, read_shard, shard_paths
from tests.helpers import child_env, save_tiny_pair

ROOT = Path(__file__).parents[2]


def test_two_processes_write_disjoint_shards_and_one_process_extends_them(tmp_path):
    target = save_tiny_pair(tmp_path / "pair")[0]
    out = tmp_path / "d"
    args = [
        "data",
        "--target",
        str(target),
        "--prompts",
        "self",
        "--topics",
        "coding,math",
        "--any-prompt-text",
        "--prompt-max-tokens",
        "64",
        "--max-new-tokens",
        "12",
        "--temperature",
        "1.0",
        "--batch-size",
        "8",
        "--shard-rows",
        "3",
        "--no-progress",
        "--output",
        str(out),
    ]
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--redirects=3",
        f"--log-dir={tmp_path / 'logs'}",
        "-m",
        "draftsmith.cli",
        *args,
        "--num-prompts",
        "10",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rank_logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").rglob("*.log")))
    assert result.returncode == 0, rank_logs or result.stderr[-3000:]

    by_rank = {}
    for rank in (0, 1):
        paths = [p for p in shard_paths(out) if f"-r{rank}-" in p.name]
        by_rank[rank] = [i for p in paths for i in read_shard(p)["prompt_id"]]
    assert len(by_rank[0]) == len(by_rank[1]) == 5  # every second prompt each
    assert not set(by_rank[0]) & set(by_rank[1])
    prompts = read_self_prompts(out)
    assert sorted(by_rank[0] + by_rank[1]) == sorted(p.id for p in prompts)
    assert {p.name.split("-r")[1][0] for p in (out / "prompts").glob("round-*.jsonl")} == {"0", "1"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["rows"] == 10
    assert manifest["counts"]["rows_by_topic"] == {"coding": 5, "math": 5}

    assert main([*args, "--num-prompts", "12"]) == 0  # one process continues what two began
    rows = load_built(out)
    assert len(rows) == len(set(rows["prompt_id"])) == 12
    assert set(by_rank[0] + by_rank[1]) < set(rows["prompt_id"])
