"""Model specs, compatibility checks and prompt files: the error messages users see."""

import json
import struct
import time

import pytest
import torch

from draftsmith.specdec import loading
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import (
    check_compatible,
    convert_gguf,
    resolve_dtype,
    resolve_model,
    same_model,
    vocab_size,
)
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


def test_a_hub_id_passes_through_when_the_hub_is_reachable(monkeypatch):
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(
        DraftsmithError, match="unknown model alias 'smollm2-135m' \\(did you mean smollm2-135m-instruct"
    ):
        resolve_model("smollm2-135m")  # a near miss of an alias is not sent to the hub


def test_without_the_hub_an_unknown_name_is_refused_at_once_with_the_aliases(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(DraftsmithError, match="unknown model alias 'gpt-9' \\(known aliases: smollm2-135m-instruct\\)"):
        resolve_model("gpt-9")
    with pytest.raises(
        DraftsmithError, match="not in the hub cache, and the hub is not reachable \\(HF_HUB_OFFLINE is set\\)"
    ):
        resolve_model("someone/no-such-model")
    assert time.perf_counter() - started < 2


def test_a_host_that_does_not_resolve_is_said_fast():
    started = time.perf_counter()
    assert loading.host_unresolved("no-such-host.invalid") == "no-such-host.invalid does not resolve"
    assert time.perf_counter() - started < 3


def test_the_same_model_through_a_symbolic_link(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    assert same_model(str(model), str(tmp_path / "link")) and same_model("model", "./link/")
    assert not same_model(str(model), str(tmp_path / "other")) and not same_model("tiny", "smollm2-135m-instruct")


def write_gguf_header(path, fields: list[tuple[str, int, bytes]]) -> None:
    """A GGUF file's header with these key/value fields (type id, packed value) and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    for key, kind, value in fields:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value
    path.write_bytes(out)


def test_the_vocabulary_size_is_read_from_a_gguf_header(tmp_path):
    name = b"llama"
    tokens = struct.pack("<IQ", 8, 3) + b"".join(struct.pack("<Q", len(t)) + t for t in (b"a", b"bc", b"d"))
    fields = [
        ("general.name", 8, struct.pack("<Q", len(name)) + name),
        ("llama.block_count", 4, struct.pack("<I", 30)),
        ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0.0, 1.0, 2.0)),
    ]
    write_gguf_header(tmp_path / "a.gguf", [*fields, ("llama.vocab_size", 4, struct.pack("<I", 49152))])
    write_gguf_header(tmp_path / "b.gguf", [*fields, ("tokenizer.ggml.tokens", 9, tokens)])
    assert vocab_size(str(tmp_path / "a.gguf")) == 49152
    assert vocab_size(str(tmp_path / "b.gguf")) == 3  # no vocab_size key: the token list's length
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 32}))
    assert vocab_size(str(tmp_path / "m")) == 32


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


def test_auto_dtype_follows_the_cpus_bfloat16(native_bfloat16, capsys):
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == (torch.bfloat16 if native_bfloat16 else torch.float32)
    assert resolve_dtype("auto", cpu) == resolve_dtype(None, cpu)
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16  # asked for: honoured either way
    emulated = "note: this CPU has no native bfloat16" in capsys.readouterr().err
    assert emulated == (not native_bfloat16)
