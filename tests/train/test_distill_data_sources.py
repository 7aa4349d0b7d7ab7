"""Training data from the sources users have: a CSV file, a save_to_disk folder and its split, max_samples."""

import csv

import datasets

from draftsmith.cli import main
from draftsmith.train.config import config_path

TINY = config_path("tiny")
SMALL = ["data.heldout=4", "generate.max_new_tokens=8", "optim.max_steps=1", "save.steps=1", "log.steps=1"]


def prompts(count: int) -> list[dict]:
    return [{"prompt": f"Count from {i} to {i + 3}.", "category": "math"} for i in range(count)]


def training_sequences(out: str) -> int:
    line = next(line for line in out.splitlines() if line.startswith("draft: "))
    return int(line.split("; ")[-1].split()[0])


def test_csv_file_capped_by_max_samples(tmp_path, capsys):
    data = tmp_path / "prompts.csv"
    with data.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "category"])
        writer.writeheader()
        writer.writerows(prompts(16))
    assert main(["distill", "--config", TINY, f"output_dir={tmp_path / 'run'}", f"data.dataset={data}", *SMALL]) == 0
    assert training_sequences(capsys.readouterr().out) == 12  # 16 rows, 4 held out
    args = [f"output_dir={tmp_path / 'capped'}", f"data.dataset={data}", "data.max_samples=10", *SMALL]
    assert main(["distill", "--config", TINY, *args]) == 0
    assert training_sequences(capsys.readouterr().out) == 6  # the first 10 rows, 4 held out


def test_save_to_disk_folder_and_its_split(tmp_path, capsys):
    folder = tmp_path / "saved"
    splits = {"train": datasets.Dataset.from_list(prompts(9)), "test": datasets.Dataset.from_list(prompts(14))}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    args = [f"output_dir={tmp_path / 'run'}", f"data.dataset={folder}", "data.split=test", *SMALL]
    assert main(["distill", "--config", TINY, *args]) == 0
    assert training_sequences(capsys.readouterr().out) == 10  # the test split's 14 rows, 4 held out
    assert (
        main(["distill", "--config", TINY, f"output_dir={tmp_path / 'b'}", f"data.dataset={folder}", "data.split=dev"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{folder} has no split 'dev'; it has train, test (set data.split)" in err


def test_prompt_completion_rows_train_on_the_completion_only():
    from draftsmith.distill.data import chat_example, text_examples
    from draftsmith.distill.tiny import tiny_target

    _, tokenizer = tiny_target(num_hidden_layers=1, hidden_size=32)
    rows = datasets.Dataset.from_list([{"prompt": "Name a color.", "completion": "Blue."}])
    [example] = text_examples(rows, tokenizer, max_length=256)
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    assert example == chat_example(tokenizer, turns, 256)
    ids, mask = example["input_ids"], example["loss_mask"]
    predicted = tokenizer.decode([ids[t + 1] for t in range(len(ids) - 1) if mask[t]])
    assert predicted.replace(" ", "") == "Blue.</s>"  # the completion and its end of turn (one token per char)


def test_column_map_names_the_prompt_column(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(f'{{"query": "Count from {i} to {i + 3}.", "id": {i}}}\n' for i in range(10)))
    run = [f"data.dataset={data}", *SMALL]
    assert main(["distill", "--config", TINY, f"output_dir={tmp_path / 'a'}", *run]) == 2
    assert "row 0" in capsys.readouterr().err  # no prompt field without the mapping
    mapped = [f"output_dir={tmp_path / 'b'}", "data.column_map={prompt: query}", *run]
    assert main(["distill", "--config", TINY, *mapped]) == 0
    assert training_sequences(capsys.readouterr().out) == 6  # 10 rows, 4 held out
    wrong = [f"output_dir={tmp_path / 'c'}", "data.column_map={prompt: ask}", *run]
    assert main(["distill", "--config", TINY, *wrong]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "data.column_map names column(s) ask that the data does not have; its columns are query, id" in err
