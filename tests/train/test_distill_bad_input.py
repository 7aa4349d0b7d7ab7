"""Mistakes on ``draftsmith distill``: one line naming the field or file and what to do, exit code 2,
and no run folder written; resuming with a changed training setting needs resume=force."""

import json

from draftsmith.cli import main
from draftsmith.train.config import config_path

TINY = config_path("tiny")


def distill(tmp_path, *args) -> int:
    return main(["distill", "--config", TINY, f"output_dir={tmp_path / 'run'}", *args])


def last_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ")
    return lines[-1]


def prompt_rows(count: int) -> str:
    return "".join(json.dumps({"prompt": f"Say the number {i} twice."}) + "\n" for i in range(count))


def test_unknown_device(tmp_path, capsys):
    assert distill(tmp_path, "device=tpu") == 2
    assert "device must be auto, cpu, cuda, cuda:N, mps or xpu, got 'tpu'" in last_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_output_dir_that_is_a_file(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    assert main(["distill", "--config", TINY, f"output_dir={file}"]) == 2
    assert f"output_dir {file} is an existing file; give a folder path" in last_error_line(capsys)
    assert file.read_text() == "mine\n"


def test_dataset_with_invalid_json_names_the_file_and_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(prompt_rows(3) + '{"prompt": "unterminated\n' + prompt_rows(2))
    assert distill(tmp_path, f"data.dataset={data}") == 2
    assert f"{data}, line 4: not valid JSON" in last_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_misspelled_draft_config_key_suggests_the_field(tmp_path, capsys):
    assert distill(tmp_path, "draft.init=config", "draft.config={num_hiden_layers: 1}") == 2
    line = last_error_line(capsys)
    assert "draft.config: 'num_hiden_layers' is not a field of LlamaConfig" in line
    assert "did you mean 'num_hidden_layers'?" in line
    assert not (tmp_path / "run").exists()


def test_row_with_an_unknown_key_is_an_error_or_skipped_with_a_count(tmp_path, capsys):
    data = tmp_path / "mixed.jsonl"
    data.write_text(prompt_rows(11) + json.dumps({"query": "What is two and two?"}) + "\n" + prompt_rows(2))
    small = ["data.heldout=4", "generate.max_new_tokens=8", "optim.max_steps=1", "save.steps=1", "log.steps=1"]
    assert distill(tmp_path, f"data.dataset={data}", *small) == 2
    line = last_error_line(capsys)
    assert f"{data}, row 11 (counting from 0): the object has none of the keys" in line
    assert line.endswith("pass data.skip_bad_rows=true to leave bad rows out")
    assert not (tmp_path / "run").exists()

    assert distill(tmp_path, f"data.dataset={data}", *small, "data.skip_bad_rows=true") == 0
    captured = capsys.readouterr()
    assert f"{data}: skipped 1 bad row(s) of 14 (data.skip_bad_rows)" in captured.err
    assert "9 training sequences" in captured.out  # 13 good rows, 4 held out
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "losses.jsonl").read_text().splitlines()] == [1]


def test_resume_with_a_changed_training_setting_needs_force_and_is_recorded(tmp_path, capsys):
    run = tmp_path / "run"
    steps = ["save.steps=2", "log.steps=2"]
    assert distill(tmp_path, "optim.max_steps=2", *steps) == 0
    assert distill(tmp_path, "optim.max_steps=4", "optim.lr=0.001", *steps) == 2
    line = last_error_line(capsys)
    assert f"{run} was trained up to step 2 with other settings (optim.lr: 0.003 -> 0.001)" in line
    assert line.endswith("or resume=force to continue with the new ones")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]  # nothing trained

    assert distill(tmp_path, "optim.max_steps=4", "optim.lr=0.001", "loss.name=forward_kl", "resume=force", *steps) == 0
    log = [json.loads(x) for x in (run / "resume_log.jsonl").read_text().splitlines()]
    assert log == [{"step": 2, "changed": {"loss.name": ["tvd", "forward_kl"], "optim.lr": [0.003, 0.001]}}]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (
        distill(tmp_path, "optim.max_steps=6", "optim.lr=0.001", "loss.name=forward_kl", *steps) == 0
    )  # the new settings hold


def test_draft_settings_the_initialisation_ignores_are_refused(tmp_path, capsys):
    assert distill(tmp_path, "draft.config={num_hidden_layers: 1}") == 2
    assert "draft.config applies to draft.init config; draft.init truncate ignores it" in capsys.readouterr().err
    assert distill(tmp_path, "draft.init=config", f"draft.model={tmp_path}") == 2
    assert "draft.model applies to draft.init pretrained; draft.init config ignores it" in capsys.readouterr().err
