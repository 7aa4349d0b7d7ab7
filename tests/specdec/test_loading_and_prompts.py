"""Model specs, compatibility checks and prompt files: the error messages users see."""

import json

import pytest

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_compatible, convert_gguf, resolve_model
from draftsmith.specdec.prompts import encode_chat, read_prompts
from tests.helpers import tiny_tokenizer


def test_resolve_local_folder_and_errors(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(DraftsmithError, match="holds no config.json"):
        resolve_model(str(model_dir))
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir)) == str(model_dir)
    with pytest.raises(DraftsmithError, match="model not found: ./nope"):
        resolve_model("./nope")
    with pytest.raises(DraftsmithError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "x.gguf"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DraftsmithError, match="is a file, not a model folder"):
        resolve_model(str(tmp_path / "notes.txt"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_gguf_that_is_not_a_model_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(DraftsmithError, match="not a GGUF causal language model"):
        convert_gguf(bad)
    assert not list((tmp_path.parent).glob("**/bad-*/.draftsmith-complete"))


def test_mismatched_vocabularies_name_both_sizes():
    with pytest.raises(DraftsmithError, match="draft's tokenizer has 20 tokens and the target's has 32"):
        check_compatible(tiny_tokenizer(32), tiny_tokenizer(20), 32, 20)
    with pytest.raises(DraftsmithError, match="output vocabulary has 40 entries and the target's has 32"):
        check_compatible(tiny_tokenizer(32), tiny_tokenizer(32), 32, 40)
    check_compatible(tiny_tokenizer(32), tiny_tokenizer(32), 32, 32)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_formats(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "w3 w4"}),
            "",
            json.dumps({"messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]}),
            json.dumps({"question_id": 81, "category": "writing", "turns": ["w7", "w8"]}),
        ],
    )
    prompts = read_prompts(path)
    assert [p.category for p in prompts] == ["all", "all", "writing"]
    assert prompts[2].id == "81"
    assert len(prompts[2].turns) == 1  # first turn only
    assert prompts[1].turns == [[{"role": "user", "content": "w5"}]]  # trailing assistant reply dropped
    assert len(read_prompts(path, all_turns=True)[2].turns) == 2
    tok = tiny_tokenizer(32)
    assert encode_chat(tok, prompts[0].turns[0]) == [0, 3, 4]
    assert encode_chat(tiny_tokenizer(32, chat=False), prompts[0].turns[0], prompts[0].text) == [3, 4]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: each line must be a JSON object"),
        ('{"text": "hi"}', "line 2: the object has none of the keys"),
        ('{"prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
        ('{"turns": []}', "line 2: 'turns' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "line 2: 'messages' must be a non-empty list"),
    ],
)
def test_malformed_prompt_lines_are_named(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok"}), line])
    with pytest.raises(DraftsmithError, match=message):
        read_prompts(path)


def test_empty_and_missing_prompt_files(tmp_path):
    with pytest.raises(DraftsmithError, match="holds no prompts"):
        read_prompts(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(DraftsmithError, match="prompts file not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_load_model_with_a_device_map(tmp_path):
    import torch

    from draftsmith.specdec.loading import load_model
    from tests.helpers import save_tiny_pair

    target, _ = save_tiny_pair(tmp_path)
    model = load_model(str(target), torch.device("cpu"), torch.float32, device_map="cpu")
    assert model.device.type == "cpu" and not model.training
    assert all(not p.requires_grad for p in model.parameters())
