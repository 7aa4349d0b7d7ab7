"""Prompt sources: the usual row formats, column mapping, caps, bad rows named by number."""

import json

import datasets
import pytest

from draftsmith.distill.data import EVAL_PROMPTS
from draftsmith.distill.prompt_sources import load_prompts, parse_column_map, source_settings
from draftsmith.specdec.errors import DraftsmithError

ROWS = [
    {"prompt": "What is a prime number?", "category": "math"},
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a color."}]},
    {"instruction": "Translate to French.", "input": "Good morning"},
    {"question": "Why is the sky blue?"},
    {"text": "Tell me a joke."},
    {"turns": ["Plan a picnic.", "Now for ten people."], "category": "writing"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_usual_format_gives_the_conversation_awaiting_a_reply(tmp_path):
    prompts = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", ROWS)))
    assert [p.id for p in prompts] == ["0", "1", "2", "3", "4", "5", "6"]
    assert [p.messages for p in prompts] == [
        [{"role": "user", "content": "What is a prime number?"}],
        [{"role": "user", "content": "Hi!"}],  # the assistant's reply is dropped: the target writes it
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "Translate to French.\n\nGood morning"}],
        [{"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "user", "content": "Tell me a joke."}],
        [{"role": "user", "content": "Plan a picnic."}],  # the first turn
    ]
    assert prompts[0].topic == "math" and prompts[1].topic == ""
    assert {p.source for p in prompts} == {str(tmp_path / "p.jsonl")}


def test_column_map_reads_a_renamed_column_of_a_csv(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('query,answer,prompt\n"How far is the moon?",far,ignored\n"What is 2+2?",4,ignored\n')
    prompts = load_prompts(str(path), column_map=parse_column_map("prompt=query"))
    assert [p.text for p in prompts] == ["How far is the moon?", "What is 2+2?"]
    with pytest.raises(DraftsmithError, match=r"column\(s\) question .* its columns are query, answer, prompt"):
        load_prompts(str(path), column_map={"prompt": "question"})


def test_column_map_syntax_errors_are_named():
    assert parse_column_map("prompt=q, input=ctx") == {"prompt": "q", "input": "ctx"}
    with pytest.raises(DraftsmithError, match="FIELD=COLUMN"):
        parse_column_map("prompt")
    with pytest.raises(DraftsmithError, match="unknown field 'answer'"):
        parse_column_map("answer=x")


def test_a_row_without_a_prompt_is_named_by_its_number_or_skipped_and_counted(tmp_path, capsys):
    rows = [ROWS[0], {"title": "no prompt here"}, ROWS[4], {"title": "nor here"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DraftsmithError, match=r"bad.jsonl, row 1 \(counting from 0\): none of the fields"):
        load_prompts(str(path))
    prompts = load_prompts(str(path), skip_bad_rows=True)
    assert [p.id for p in prompts] == ["0", "2"]
    assert "skipped 2 bad row(s) of 4" in capsys.readouterr().err


def test_malformed_fields_are_errors_naming_the_row(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [ROWS[0], {"messages": [{"role": "assistant", "content": "Hi"}]}])
    with pytest.raises(DraftsmithError, match="row 1 .*holds only assistant replies"):
        load_prompts(str(path))
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "   "}])
    with pytest.raises(DraftsmithError, match="row 0 .*'prompt' must be a non-empty string"):
        load_prompts(str(path))


def test_parquet_and_saved_folders_and_their_splits(tmp_path):
    table = datasets.Dataset.from_list([{"prompt": f"Question number {i}?"} for i in range(5)])
    table.to_parquet(str(tmp_path / "p.parquet"))
    assert [p.text for p in load_prompts(str(tmp_path / "p.parquet"), max_samples=3)] == [
        "Question number 0?",
        "Question number 1?",
        "Question number 2?",
    ]
    datasets.DatasetDict({"train": table, "test": table.select([4])}).save_to_disk(str(tmp_path / "saved"))
    assert [p.text for p in load_prompts(str(tmp_path / "saved"), split="test")] == ["Question number 4?"]
    with pytest.raises(DraftsmithError, match="no split 'dev'; it has train, test"):
        load_prompts(str(tmp_path / "saved"), split="dev")


def test_builtin_prompts_load_and_the_held_out_set_is_refused():
    builtin = load_prompts("builtin")
    assert len(builtin) == 56
    assert builtin[0].id == "chat-0" and builtin[0].topic == "chat"
    assert load_prompts("builtin", max_samples=4) == builtin[:4]
    with pytest.raises(DraftsmithError, match="held-out evaluation prompts"):
        load_prompts(str(EVAL_PROMPTS))


def test_missing_files_and_unsupported_types_are_named(tmp_path):
    with pytest.raises(DraftsmithError, match="prompt file not found: ./nope.jsonl"):
        load_prompts("./nope.jsonl")
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(DraftsmithError, match="unsupported file type '.txt'"):
        load_prompts(str(tmp_path / "p.txt"))


def test_source_settings_identify_the_source(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert source_settings("builtin", None, "train", {}) == {"kind": "builtin"}
    assert source_settings(str(path), None, "train", {"prompt": "q"}) == {
        "kind": "local",
        "path": str(path.resolve()),
        "split": "train",
        "column_map": {"prompt": "q"},
    }
    assert source_settings("org/set", "en", "train", {})["kind"] == "hub"
