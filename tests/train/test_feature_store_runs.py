"""Training from the feature store: an EAGLE-3 head reads the target's hidden states from disk, its
training steps run no target forward, and its losses are the live run's."""

import json
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.distill.dataset_builder import training_examples
from draftsmith.train import examples
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from tests.helpers import tiny_llama, tiny_tokenizer

EAGLE = {"draft_kind": "eagle3", "train_draft_vocab": 30, "save_steps": 3, "log_steps": 3}


def tiny_cfg(folder: Path, **overrides) -> DistillConfig:
    items = [f"output_dir={folder}"] + [f"{k}={v}" for k, v in overrides.items()]
    return load_config(DistillConfig, config_path("tiny"), items)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    return json.loads((run / "train_summary.json").read_text())


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A DRAFTSMITH_HOME of the test's own: no store another test built for this data."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_eagle3_from_the_store_runs_no_target_forward_and_learns_what_the_live_run_learns(tmp_path, home):
    live = train(tiny_cfg(tmp_path / "live", max_steps=3, **EAGLE)).run_dir
    assert summary(live)["teacher_forwards"] == 3 and summary(live)["teacher"] == "live"
    assert summary(live)["steps"] == 3 and summary(live)["tokens_per_s"] > 0
    # the whole top-k of the tiny target's 103 tokens and float32 states: the same teacher as the live one
    exact = {"teacher_cache": "true", "teacher_top_k": 103, "teacher_cache_dtype": "float32", "max_steps": 3}
    stored = train(tiny_cfg(tmp_path / "stored", **exact, **EAGLE)).run_dir
    assert summary(stored)["teacher_forwards"] == 0 and summary(stored)["teacher"] == "store"
    assert losses(stored) == pytest.approx(losses(live), rel=1e-3)
    store = Path(summary(stored)["store"])
    meta = json.loads((store / "meta.json").read_text())
    # the aux layers only: the argmax that masks rows outside the head's 30 tokens is the top-k's first entry
    assert meta["layers"] == [1, 2, 3] and meta["examples"] == 56


def test_a_second_run_on_the_same_data_reads_the_bf16_store_and_the_hybrid_fills_it_in_the_first_epoch(tmp_path, home):
    # 48 training examples in batches of 8: an epoch is 6 steps
    cached = {"teacher_cache": "true", "teacher_top_k": 16, "max_steps": 2, **EAGLE}
    first = train(tiny_cfg(tmp_path / "first", **cached)).run_dir
    second = train(tiny_cfg(tmp_path / "second", lr=0.001, **cached)).run_dir
    assert summary(first)["teacher_forwards"] == summary(second)["teacher_forwards"] == 0
    assert summary(first)["store"] == summary(second)["store"]
    assert json.loads((Path(summary(first)["store"]) / "meta.json").read_text())["hidden_dtype"] == "bfloat16"
    assert losses(second)[0] == pytest.approx(losses(first)[0], rel=1e-6)  # the same teacher for the same batch

    hybrid = {**cached, "teacher_cache_fill": "first_epoch", "max_steps": 8, "save_steps": 8, "log_steps": 4}
    filled = train(tiny_cfg(tmp_path / "filled", **hybrid)).run_dir
    assert summary(filled)["teacher_forwards"] == 6 and summary(filled)["teacher"] == "filled"  # the first epoch only
    meta = json.loads((Path(summary(filled)["store"]) / "meta.json").read_text())
    assert meta["examples"] == 48 and len(meta["files"]) == 1  # the training examples, one process's shard
    # the first epoch is the live teacher's, the argmax that masks rows taken from the top-k it stores
    live = train(tiny_cfg(tmp_path / "live", **{**EAGLE, "max_steps": 8, "save_steps": 8, "log_steps": 4})).run_dir
    assert losses(filled)[:6] == pytest.approx(losses(live)[:6], rel=1e-5)
    again = train(tiny_cfg(tmp_path / "again", **hybrid)).run_dir
    assert summary(again)["teacher_forwards"] == 0 and summary(again)["teacher"] == "store"


def test_the_first_epoch_fill_writes_its_rows_to_shards_as_it_goes(tmp_path, home, monkeypatch):
    # a filling teacher holds at most 16 rows: the 48 training examples reach the store in 3 shards
    # during the epoch (not at its end), and training is the same as with one shard at the epoch's end
    hybrid = {**EAGLE, "teacher_cache": "true", "teacher_top_k": 16, "teacher_cache_fill": "first_epoch"}
    hybrid |= {"max_steps": 8, "save_steps": 8, "log_steps": 4}
    whole = train(tiny_cfg(tmp_path / "whole", **hybrid)).run_dir
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "another-home"))  # a store of its own
    monkeypatch.setattr(examples, "FILL_SHARD_ROWS", 16)
    written = []
    flush = examples.FillingTeacher.flush
    monkeypatch.setattr(examples.FillingTeacher, "flush", lambda self: written.append(len(self.seen)) or flush(self))
    sharded = train(tiny_cfg(tmp_path / "sharded", **hybrid)).run_dir
    assert written == [16, 16, 16, 0]  # three shards in the epoch, nothing left at its end
    meta = json.loads((Path(summary(sharded)["store"]) / "meta.json").read_text())
    assert meta["examples"] == 48 and meta["files"] == [f"shard-r000-0000{i}.safetensors" for i in range(3)]
    assert summary(sharded)["teacher_forwards"] == 6
    assert losses(sharded) == pytest.approx(losses(whole), rel=1e-6)


def test_an_eagle3_run_reads_the_feature_store_the_data_step_wrote(tmp_path, home, capsys):
    target = tmp_path / "target"  # 4 layers: the head reads the states entering layers 1, 2 and 3
    tiny_llama(layers=4, sharpness=8.0).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    data = tmp_path / "ds"
    common = ["data", "--target", str(target), "--prompts", "builtin", "--max-samples", "10", "--temperature", "0"]
    common += ["--max-new-tokens", "16", "--dtype", "float32", "--no-progress", "--output", str(data)]
    assert main([*common, "--teacher-cache", "6", "--hidden-layers", "0,1,2,3,4", "--max-length", "24"]) == 0
    assert "feature store: " in capsys.readouterr().out
    (store,) = (data / "feature-store").iterdir()
    meta = json.loads((store / "meta.json").read_text())
    rows = {tuple(e["input_ids"]) for e in training_examples(data, 24)}  # the rows as distill cuts them
    assert (meta["layers"], meta["hidden_dtype"], meta["target_key"]) == ([0, 1, 2, 3, 4], "bfloat16", "dataset")
    assert meta["examples"] == len(rows) >= 8
    items = [f"target={target}", f"data.dataset={data}", "data.heldout=2", "teacher.cache=true", "teacher.top_k=6"]
    items += [
        "data.max_length=24",
        "optim.batch_size=4",
        "draft.kind=eagle3",
        "optim.max_steps=2",
        "save.steps=2",
        "log.steps=2",
    ]
    run = train(load_config(DistillConfig, config_path("tiny"), [f"output_dir={tmp_path / 'run'}", *items])).run_dir
    assert summary(run)["teacher_forwards"] == 0 and summary(run)["store"] == str(store)
    assert not (home / "teacher-cache").exists()  # the run built no store of its own
