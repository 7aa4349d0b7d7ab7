"""The dataset that ships with draftsmith (``smollm2-self``) is found by name and trains the default config."""

from pathlib import Path

import pytest

from draftsmith.distill import dataset_builder
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.examples import build_examples


def test_the_default_config_trains_on_the_shipped_dataset_by_name():
    cfg = load_config(DistillConfig, config_path("smollm2-135m"), ["data.max_samples=40", "data.heldout=4"])
    assert cfg.data.dataset == "smollm2-self"
    folder = dataset_builder.built_folder(cfg.data.dataset)
    assert folder == dataset_builder.SHIPPED / "smollm2-self"
    counts = dataset_builder.read_manifest(folder)["counts"]
    assert (counts["rows"], counts["answer_tokens"]) == (2800, 511310)

    # The answers are in the folder: nothing is generated, so no target is needed.
    train, held = build_examples(cfg, target=None, tokenizer=None, accelerator=None)
    assert (len(train), len(held)) == (36, 4)
    for example in train + held:
        assert len(example["input_ids"]) == len(example["loss_mask"]) <= cfg.data.max_length
        assert 0 < sum(example["loss_mask"]) < len(example["input_ids"])  # the prompt is not learned


def test_only_dataset_folders_are_built_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("builtin", "prompts.jsonl", "HuggingFaceH4/ultrachat_200k", "smollm2-sel", "data/smollm2-self"):
        assert dataset_builder.built_folder(spec) is None
    local = Path("smollm2-self")  # a local folder of that name, written by draftsmith data, comes first
    local.mkdir()
    (local / dataset_builder.MANIFEST).write_text('{"settings": {"target": "x"}}')
    assert dataset_builder.built_folder("smollm2-self") == local


def test_the_shipped_dataset_refuses_another_target():
    cfg = load_config(DistillConfig, config_path("tiny"), ["data.dataset=smollm2-self"])
    with pytest.raises(DraftsmithError, match="holds answers of target 'smollm2-135m-instruct', not of 'tiny'"):
        build_examples(cfg, target=None, tokenizer=None, accelerator=None)
