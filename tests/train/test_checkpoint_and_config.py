"""What makes a checkpoint complete, a run's config read back, and prompt rows for training: no training here."""

import json

import pytest
import yaml

from draftsmith.distill.data import encode_prompt_rows
from draftsmith.distill.tiny import char_tokenizer
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train import checkpoint
from draftsmith.train.config import (
    DistillConfig,
    config_path,
    flat_settings,
    load_config,
    load_run_config,
    save_config,
)


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
    cfg = load_config(DistillConfig, config_path("tiny"), [f"output_dir={tmp_path}", "optim.max_steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_run_config(tmp_path)
    assert again == cfg and again.draft.model is None and again.teacher.device_map is None
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


GROUPED = """
output_dir: runs/x
target: tiny
draft:
  kind: parallel
  layers: "1"
  options: {mask_token_id: 2, k: 4}
data:
  mode: target
  heldout: 3
optim:
  lr: 0.002
  max_steps: 7
loss:
  name: jsd
"""

FLAT = """
output_dir: runs/x
target: tiny
draft_kind: parallel
draft_layers: "1"
kind_options: {mask_token_id: 2, k: 4}
data: target
heldout: 3
lr: 0.002
max_steps: 7
loss: jsd
"""


def test_a_grouped_config_and_its_old_flat_form_are_the_same_run(tmp_path, capsys):
    (tmp_path / "grouped.yaml").write_text(GROUPED)
    (tmp_path / "flat.yaml").write_text(FLAT)
    grouped = load_config(DistillConfig, str(tmp_path / "grouped.yaml"), [])
    assert capsys.readouterr().err == ""  # the grouped form takes no hint
    flat = load_config(DistillConfig, str(tmp_path / "flat.yaml"), [])
    assert flat == grouped
    assert (grouped.draft.kind, grouped.draft.options["k"], grouped.optim.lr, grouped.loss.name) == (
        "parallel",
        4,
        0.002,
        "jsd",
    )
    hint = capsys.readouterr().err.strip().splitlines()
    assert len(hint) == 1  # one line for the whole file, naming every key's new place
    assert hint[0].startswith(f"config: {tmp_path / 'flat.yaml'}: old flat keys, still read")
    for old, new in [
        ("draft_kind", "draft.kind"),
        ("kind_options", "draft.options"),
        ("data", "data.mode"),
        ("lr", "optim.lr"),
    ]:
        assert f"{old} -> {new}" in hint[0]


def test_dotted_overrides_reach_a_setting_and_a_key_inside_a_mapping(tmp_path, capsys):
    (tmp_path / "grouped.yaml").write_text(GROUPED)
    items = ["optim.lr=0.01", "draft.options.k=3", "draft.layers=2", "data.dataset=builtin"]
    cfg = load_config(DistillConfig, str(tmp_path / "grouped.yaml"), items)
    assert (cfg.optim.lr, cfg.draft.layers, cfg.draft.options) == (0.01, "2", {"mask_token_id": 2, "k": 3})
    assert cfg.optim.max_steps == 7  # the file's other settings in the section stay
    old = load_config(DistillConfig, str(tmp_path / "grouped.yaml"), ["lr=0.01", "draft_layers=2"])
    assert (old.optim.lr, old.draft.layers) == (0.01, "2")
    assert (
        "overrides: old flat keys, still read; their grouped names: lr -> optim.lr, draft_layers -> draft.layers"
        in (capsys.readouterr().err)
    )


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("optim: {lrr: 0.1}\n", [], "unknown config key 'optim.lrr' (did you mean optim.lr?)"),
        ("optim: 0.1\n", [], "optim must be a mapping of its settings (lr, weight_decay,"),
        ("lr: 0.1\noptim: {lr: 0.2}\n", [], "optim.lr is set twice (flat and in its section); keep one"),
        ("target: tiny\n", ["optim.lr=0.1", "lr=0.2"], "override optim.lr= is given twice; keep one"),
        ("target: tiny\n", ["max_step=3"], "unknown config key 'max_step' (did you mean optim.max_steps?)"),
        ("target: tiny\n", ["optim.max_steps=ten"], "config optim.max_steps: 'ten' is not a valid int"),
        ("target: tiny\n", ["data.column_map.promt=q"], "config data.column_map: unknown field 'promt'"),
    ],
)
def test_a_wrong_setting_is_named_by_its_dotted_name(tmp_path, text, overrides, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(DraftsmithError) as err:
        load_config(DistillConfig, str(tmp_path / "c.yaml"), overrides)
    assert message in str(err.value)


def test_a_run_saved_with_the_flat_keys_reads_back_quietly(tmp_path, capsys):
    flat = {"output_dir": str(tmp_path), "target": "tiny", "draft_layers": "1", "lr": 0.002, "teacher_cache": True}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(flat))
    cfg = load_run_config(tmp_path)
    assert (cfg.draft.layers, cfg.optim.lr, cfg.teacher.cache) == ("1", 0.002, True)
    assert capsys.readouterr().err == ""
    saved = flat_settings({"lr": 0.002, "draft_layers": "1", "optim": {"max_steps": 3}})
    assert saved == {"optim.lr": 0.002, "draft.layers": "1", "optim.max_steps": 3}
