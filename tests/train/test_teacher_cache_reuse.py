"""The top-k teacher cache belongs to the data: built once, read by every later epoch and every later run."""

import json
import os
from pathlib import Path

import pytest

from draftsmith.train import loop
from draftsmith.train.config import DistillConfig, config_path, load_config


def tiny_cfg(folder: Path, **overrides) -> DistillConfig:
    items = [f"output_dir={folder}"] + [f"{k}={v}" for k, v in overrides.items()]
    return load_config(DistillConfig, config_path("tiny"), items)


def watched_run(cfg: DistillConfig, monkeypatch) -> tuple[list[tuple[int, ...]], list[dict], list[dict]]:
    """Train ``cfg`` while recording every row the target is given; (rows, train examples, held-out examples)."""
    rows, seen = [], {}
    build_models, build_examples = loop.build_models, loop.build_examples

    def record(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]  # (B, T)
        attention = kwargs.get("attention_mask")
        for r in range(len(ids)):
            kept = ids[r] if attention is None or attention.shape != ids.shape else ids[r][attention[r].bool()]
            rows.append(tuple(kept.tolist()))

    def watched_models(*args):
        target, tokenizer, draft = build_models(*args)
        # the decoder: the trainer runs it and applies the head at the loss rows only
        target.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
        return target, tokenizer, draft

    def captured_examples(*args):
        seen["train"], seen["heldout"] = build_examples(*args)
        return seen["train"], seen["heldout"]

    monkeypatch.setattr(loop, "build_models", watched_models)
    monkeypatch.setattr(loop, "build_examples", captured_examples)
    loop.train(cfg)
    monkeypatch.undo()
    return rows, seen["train"], seen["heldout"]


def test_the_target_teaches_each_example_once_and_a_second_run_never_runs_it_on_training_rows(tmp_path, monkeypatch):
    with pytest.MonkeyPatch.context() as home:  # a home of its own: no cache another test built for this data
        home.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
        teaches_once_then_never(tmp_path, monkeypatch)


def teaches_once_then_never(tmp_path: Path, monkeypatch) -> None:
    # 48 training examples in batches of 8: 6 steps an epoch, so 8 steps make two epochs.
    common = {"teacher_cache": "true", "teacher_top_k": 8, "max_steps": 8, "save_steps": 8, "log_steps": 4}
    rows, train_examples, heldout = watched_run(tiny_cfg(tmp_path / "first", **common), monkeypatch)
    training_rows = {tuple(e["input_ids"]) for e in train_examples}
    assert len(training_rows) == 48
    taught = [r for r in rows if r in training_rows]
    assert sorted(taught) == sorted(training_rows)  # each exactly once, in the cache build, not once per epoch

    # Another run on the same data (another learning rate, another folder): the cache is found by the
    # data's content, so the target never sees a training row; it still gives the held-out p exactly
    # (evaluated at steps 0, 4 and 8: its layers run over the 8 held-out rows once, at step 0).
    rows, train_again, heldout_again = watched_run(tiny_cfg(tmp_path / "second", lr=0.001, **common), monkeypatch)
    assert {tuple(e["input_ids"]) for e in train_again} == training_rows
    assert [r for r in rows if r in training_rows] == []
    heldout_rows = {tuple(e["input_ids"]) for e in heldout_again}
    assert sum(r in heldout_rows for r in rows) == len(heldout_rows)
    metas = [json.loads(p.read_text()) for p in Path(os.environ["DRAFTSMITH_HOME"]).glob("teacher-cache/*/meta.json")]
    assert [m["examples"] for m in metas if m["top_k"] == 8] == [56]  # one cache: 48 training + 8 held-out examples
    losses = [json.loads(line)["loss"] for line in (tmp_path / "second" / "losses.jsonl").read_text().splitlines()]
    first = [json.loads(line)["loss"] for line in (tmp_path / "first" / "losses.jsonl").read_text().splitlines()]
    assert losses[0] == pytest.approx(first[0], rel=1e-6)  # the same teacher for the same first batch
