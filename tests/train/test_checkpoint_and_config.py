"""What makes a checkpoint complete, a run's config read back, and prompt rows for training: no training here."""

import json

import pytest
import yaml

from draftsmith.distill.data import encode_prompt_rows
from draftsmith.distill.tiny import char_tokenizer
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train import checkpoint
from draftsmith.train.config import DistillConfig, config_path, load_config, load_run_config, save_config


def make_folder(path, *names):
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text("{}")
    return path


def test_a_checkpoint_is_complete_with_its_model_files_and_the_marker(tmp_path, capsys):
    full = make_folder(tmp_path / "checkpoint-4", "config.json", "model.safetensors", "draftsmith.json")
    no_marker = make_folder(tmp_path / "checkpoint-6", "config.json", "model.safetensors")
    no_weights = make_folder(tmp_path / "checkpoint-8", "config.json", "draftsmith.json")
    early_exit = make_folder(tmp_path / "checkpoint-10", "early_exit.json", "exit_head.safetensors", "draftsmith.json")
    make_folder(tmp_path / "initial", "config.json", "model.safetensors", "draftsmith.json")
    assert checkpoint.missing_files(no_marker) == ["draftsmith.json"]
    assert checkpoint.missing_files(no_weights) == ["model.safetensors"]
    assert [checkpoint.is_complete(p) for p in (full, no_marker, no_weights, early_exit)] == [True, False, False, True]
    assert checkpoint.checkpoint_dirs(tmp_path) == [(4, full), (10, early_exit)]
    err = capsys.readouterr().err
    assert f"skipping incomplete checkpoint {no_marker} (missing draftsmith.json" in err
    assert f"skipping incomplete checkpoint {no_weights} (missing model.safetensors" in err
    names = [(name, step) for name, step, _ in checkpoint.drafts_of_run(tmp_path)]
    assert names == [("initial", 0), ("checkpoint-4", 4), ("checkpoint-10", 10)]


def test_commit_renames_into_place_and_keeps_the_last(tmp_path):
    for step in (2, 4, 6):
        tmp = checkpoint.begin(tmp_path, step)
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_text("")
        checkpoint.commit(tmp_path, tmp, f"checkpoint-{step}", {"step": step}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert json.loads((tmp_path / "checkpoint-6" / "draftsmith.json").read_text()) == {"step": 6}


def test_run_config_reads_back_validated(tmp_path):
    cfg = load_config(DistillConfig, config_path("tiny"), [f"output_dir={tmp_path}", "max_steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_run_config(tmp_path)
    assert again == cfg and again.draft_model is None and again.teacher_device_map is None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"target": "tiny", "lr": -1.0}))
    with pytest.raises(DraftsmithError, match="lr must be > 0"):
        load_run_config(tmp_path)
    with pytest.raises(DraftsmithError, match="is not a distillation run folder"):
        load_run_config(tmp_path / "elsewhere")


def test_training_prompt_rows_use_the_evaluation_parser():
    rows = [
        {"prompt": "hi", "messages": None},
        {"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "a"}], "prompt": None},
        {"turns": ["ab", "cd"]},
        {"question": "q?"},
    ]
    tokenizer = char_tokenizer()
    ids = encode_prompt_rows(rows, tokenizer, "rows.jsonl")
    assert ["".join(tokenizer.convert_ids_to_tokens(p)) for p in ids] == [
        "<|user|>hi<|assistant|>",
        "<|user|>yo<|assistant|>",  # the trailing reply is the model's to write
        "<|user|>ab<|assistant|>",  # the first turn
        "<|user|>q?<|assistant|>",
    ]
    with pytest.raises(DraftsmithError, match=r"rows.jsonl, row 1: the object has none of the keys 'prompt'"):
        encode_prompt_rows([{"prompt": "ok"}, {"text": "plain"}], tokenizer, "rows.jsonl")


def test_a_target_given_by_another_path_to_the_same_folder_is_no_change(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    saved = {"target": str(tmp_path / "model"), "seed": 1}
    same = {"target": str(tmp_path / "link"), "seed": 1}
    assert checkpoint.changed_settings(saved, same, ("target", "seed")) == {}
    moved = {"target": str(tmp_path / "other"), "seed": 2}
    assert checkpoint.changed_settings(saved, moved, ("target", "seed")) == {
        "target": [str(tmp_path / "model"), str(tmp_path / "other")],
        "seed": [1, 2],
    }
