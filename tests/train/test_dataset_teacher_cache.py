"""``draftsmith data --teacher-cache K``, then ``distill dataset=FOLDER teacher_cache=true``: the run reads the
dataset's cache and never gives the target a training row."""

import hashlib
import json
import shlex
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.distill import teacher_cache
from draftsmith.distill.dataset_builder import training_examples
from draftsmith.distill.dataset_cache import dataset_entries
from draftsmith.distill.teacher_cache import example_digest
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from tests.helpers import save_tiny_pair, tiny_llama, tiny_tokenizer
from tests.train.test_teacher_cache_reuse import watched_run


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def data_args(target, output, *extra) -> list[str]:
    # float32 pinned: the answers are the same on every CPU (auto would pick bfloat16 on one with native
    # bfloat16), and so is the cache, which then serves a run in any teacher dtype.
    common = ["--prompts", "builtin", "--max-samples", "14", "--temperature", "1.0", "--max-new-tokens", "24"]
    common += ["--dtype", "float32"]
    return [
        "data",
        "--target",
        str(target),
        *common,
        "--shard-rows",
        "5",
        "--no-progress",
        "--output",
        str(output),
        *extra,
    ]


real_head_top_k = teacher_cache.head_top_k


def run_cfg(target, data, folder, *extra: str, steps: int = 3) -> DistillConfig:
    overrides = [
        f"target={target}",
        f"data.dataset={data}",
        "data.heldout=2",
        f"optim.max_steps={steps}",
        f"save.steps={steps}",
        f"log.steps={steps}",
    ]
    overrides += [
        "teacher.cache=true",
        "teacher.top_k=6",
        "data.max_length=24",
        "optim.batch_size=4",
        f"output_dir={folder}",
        *extra,
    ]
    return load_config(DistillConfig, config_path("tiny"), overrides)


def first_loss(folder) -> float:
    return json.loads((folder / "losses.jsonl").read_text().splitlines()[0])["loss"]


def test_distill_reads_the_cache_the_data_step_built(tmp_path, monkeypatch, capsys):
    target = save_tiny_pair(tmp_path / "pair")[0]
    data = tmp_path / "ds"
    assert main(data_args(target, data)) == 0
    # Without a dataset cache the run builds its own: the target sees every training row once.
    rows, train_examples, _ = watched_run(run_cfg(target, data, tmp_path / "own"), monkeypatch)
    training_rows = {tuple(e["input_ids"]) for e in train_examples}
    assert len(training_rows) >= 8 and training_rows <= set(rows)
    assert any(len(e["input_ids"]) == 24 for e in train_examples)  # answers cut at max_length

    # The same command with --teacher-cache: nothing new to answer, the cache is added (k=8 >= the run's 6).
    assert main(data_args(target, data, "--teacher-cache", "8")) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((data / "manifest.json").read_text())
    assert "teacher_cache" not in manifest  # the dataset is as it was: the cache says what it was computed for
    cached = json.loads((data / "teacher-cache-k8" / "cache.json").read_text())
    assert (cached["target"], cached["dtype"], cached["shards"]) == (str(target), "float32", 3)
    assert cached["tokens"] == manifest["counts"]["answer_tokens"]
    assert cached["manifest_sha256"] == hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()
    assert cached["command"] == shlex.join(["draftsmith", *data_args(target, data, "--teacher-cache", "8")])
    assert len(cached["target_weights_sha256"]) == 64 and cached["encoding"]["indices"] == "uint16"
    assert (
        f"teacher cache: top 8 at {cached['tokens']} answer positions, float32, uint16-float16, whole rows" in printed
    )

    rows, again, _ = watched_run(run_cfg(target, data, tmp_path / "from-data"), monkeypatch)
    assert {tuple(e["input_ids"]) for e in again} == training_rows
    assert not training_rows & set(rows)  # the target never ran over a training row
    assert f"teacher: top-6 of {data / 'teacher-cache-k8'} (the dataset's cache" in capsys.readouterr().out
    summary = json.loads((tmp_path / "from-data" / "train_summary.json").read_text())
    assert (summary["teacher"], summary["store"], summary["teacher_forwards"]) == (
        "store",
        str(data / "teacher-cache-k8"),
        0,
    )
    # The same teacher: top 6 of the dataset's top 8, cut to max_length 24 (float16 entries both times).
    assert first_loss(tmp_path / "from-data") == pytest.approx(first_loss(tmp_path / "own"), rel=1e-4)


def test_a_kind_reading_hidden_states_takes_the_datasets_top_k_and_fills_only_the_states(tmp_path, monkeypatch):
    target = tmp_path / "target"  # 4 layers: the head reads the states entering layers 1, 2 and 3
    tiny_llama(layers=4, sharpness=8.0).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    data = tmp_path / "ds"
    assert main(data_args(target, data, "--teacher-cache", "8")) == 0
    eagle = ["draft.kind=eagle3", "draft.vocab=30", "teacher.cache_dtype=float32"]

    def run(name: str, fill: str) -> tuple[list[float], dict, Path]:
        monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / f"home-{name}"))  # a store of its own
        cfg = run_cfg(target, data, tmp_path / name, *eagle, f"teacher.cache_fill={fill}", steps=6)
        heads = []
        monkeypatch.setattr(teacher_cache, "head_top_k", lambda *args: heads.append(1) or real_head_top_k(*args))
        result = train(cfg)
        monkeypatch.undo()
        losses = [json.loads(line)["loss"] for line in (result.run_dir / "losses.jsonl").read_text().splitlines()]
        summary = json.loads((result.run_dir / "train_summary.json").read_text())
        return losses, {**summary, "heads": len(heads)}, Path(summary["store"])

    # 12 training rows in batches of 4: the first epoch's 3 steps run the target's layers for their hidden
    # states, never its head (the top-8 are the dataset's), and fill the store the second epoch reads.
    filled, summary, store = run("fill", "first_epoch")
    assert (summary["teacher"], summary["teacher_forwards"], summary["heads"]) == ("filled", 3, 0)
    meta = json.loads((store / "meta.json").read_text())
    assert (meta["top_k"], meta["examples"], meta["top_k_from"]) == (6, 12, str(data / "teacher-cache-k8"))
    assert meta["layers"] == [1, 2, 3]
    train_rows = training_examples(data, 24)
    stored = teacher_cache.Store(store)
    carried, _ = dataset_entries(data, [e for e in train_rows if example_digest(e) in stored.entries], "float32", 6, 24)
    found = stored.lookup([e for e in train_rows if example_digest(e) in stored.entries])
    assert len(found) == 12
    for (ids, logps), (want_ids, want_logps) in zip(found, carried, strict=True):
        assert torch.equal(ids, want_ids) and torch.equal(logps, want_logps)

    # The same run from a store the target computes before training: the same teacher, the same losses.
    built, summary, _ = run("before", "before")
    assert summary["heads"] > 0 and summary["teacher_forwards"] == 0
    assert filled == pytest.approx(built, rel=1e-4)
