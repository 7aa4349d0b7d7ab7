"""A feature-store build by draftsmith's engine that is killed with SIGKILL, or whose disk fills up, midway:
the same command run again gives the store an uninterrupted build gives (the same rows, the same top-k and
hidden states), writing only the shards it lacks."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

from draftsmith.cli import main
from draftsmith.distill import teacher_cache
from tests.helpers import child_env, save_tiny_pair

ROOT = Path(__file__).parents[2]
SHARDS = 3  # 12 rows, 8 of them distinct in the tiny tokenizer's ids, 3 to a shard
# The command, SIGKILLed right after the feature store's Nth shard is saved (not a shard of the top-k cache).
KILLED_STORE_RUN = """
import os, signal, sys
from draftsmith.distill import teacher_cache
real_write = teacher_cache.write_shard
written = []
def write_then_die(folder, *args, **kwargs):
    tokens = real_write(folder, *args, **kwargs)
    if folder.parent.name == "feature-store":
        written.append(folder)
        if len(written) == int(os.environ["KILL_AFTER_SHARDS"]):
            os.kill(os.getpid(), signal.SIGKILL)
    return tokens
teacher_cache.write_shard = write_then_die
from draftsmith.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


def store_args(target: Path, output: Path) -> list[str]:
    return [
        "data", "--target", str(target), "--prompts", "builtin", "--max-samples", "12", "--max-new-tokens", "8",
        "--temperature", "0", "--dtype", "float32", "--batch-size", "4", "--shard-rows", "3",
        "--teacher-cache", "4", "--hidden-layers", "1,2", "--no-progress", "--output", str(output),
    ]  # fmt: skip


def store_of(output: Path) -> Path:
    (folder,) = (output / "feature-store").glob("k4-*")
    return folder


def read_store(folder: Path) -> dict[bytes, dict[str, torch.Tensor]]:
    """Each stored row's tensors by its content digest: its top-k ids and log-probs, its states per layer."""
    rows = {}
    for name in teacher_cache.shard_files(folder):
        with safe_open(folder / name, framework="pt") as f:
            data = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        counts, lengths = data["counts"].tolist(), data["lengths"].tolist()
        starts = [sum(counts[:i]) for i in range(len(counts))]
        positions = [sum(lengths[:i]) for i in range(len(lengths))]
        for i, digest in enumerate(bytes(row) for row in data["digests"].tolist()):
            row = {key: data[key][starts[i] : starts[i] + counts[i]] for key in ("indices", "logprobs")}
            for layer in (1, 2):
                row[f"hidden.{layer}"] = data[f"hidden.{layer}"][positions[i] : positions[i] + lengths[i]]
            rows[digest] = row
    return rows


@pytest.fixture(scope="module")
def whole(target, tmp_path_factory) -> dict[bytes, dict[str, torch.Tensor]]:
    """The store of an uninterrupted build."""
    output = tmp_path_factory.mktemp("whole") / "d"
    assert main(store_args(target, output)) == 0
    folder = store_of(output)
    assert len(teacher_cache.shard_files(folder)) == SHARDS
    return read_store(folder)


def assert_same_store(rows: dict, expected: dict) -> None:
    assert len(rows) == len(expected) == 8
    assert rows.keys() == expected.keys()
    for digest, row in rows.items():
        for key, tensor in row.items():
            assert torch.equal(tensor, expected[digest][key]), key


def test_a_build_killed_at_a_random_shard_resumes_to_the_uninterrupted_store(target, whole, tmp_path):
    output = tmp_path / "d"
    kill_after = random.Random(54).randint(1, SHARDS - 1)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_STORE_RUN, *store_args(target, output)],
        cwd=ROOT,
        env=child_env(KILL_AFTER_SHARDS=str(kill_after), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    folder = store_of(output)
    kept = sorted(path.name for path in folder.glob("shard-*.safetensors"))
    assert len(kept) == kill_after and not (folder / "meta.json").exists()  # incomplete, its shards whole
    first = os.stat(folder / kept[0])
    assert main(store_args(target, output)) == 0  # the same command
    again = os.stat(folder / kept[0])
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # kept, not computed again
    assert_same_store(read_store(folder), whole)


def test_a_disk_that_fills_up_midway_leaves_a_store_that_resumes(target, whole, tmp_path, monkeypatch, capsys):
    """The disk takes two shards of the store, then refuses every byte, as safetensors reports a full disk;
    the command says so in one line, and once there is room the same command finishes the store."""
    output = tmp_path / "d"
    real_save = teacher_cache.save_file
    saved = []

    def save_until_full(tensors, path, *args, **kwargs):
        if Path(path).parent.parent.name == "feature-store" and len(saved) == 2:
            Path(path).write_bytes(b"\0" * 100)  # what fitted before the disk filled up
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        if Path(path).parent.parent.name == "feature-store":
            saved.append(path)
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(teacher_cache, "save_file", save_until_full)
    assert main(store_args(target, output)) == 2
    err = capsys.readouterr().err  # the store's size and the free disk, then the one line
    assert err.splitlines()[-1].startswith(f"error: the disk holding {output} is full; free space and run the same")
    assert err.count("error:") == 1 and "Traceback" not in err
    folder = store_of(output)
    assert len(list(folder.glob("shard-*.safetensors"))) == 2 and not list(folder.glob(".*"))  # no half shard
    monkeypatch.setattr(teacher_cache, "save_file", real_save)  # room again
    assert main(store_args(target, output)) == 0
    assert_same_store(read_store(folder), whole)
