"""Dataset building: shards, resume without duplicates or loss, appending, refused setting changes."""

import importlib.metadata
import json

import pytest

from draftsmith.distill.dataset_builder import (
    BuildSettings,
    ProcessGroup,
    SelfPromptRequest,
    build_dataset,
    check_settings,
    load_built,
    read_shard,
    shard_paths,
    training_examples,
)
from draftsmith.distill.engines import BundledEngine, Writer
from draftsmith.distill.prompt_filters import PromptFilter
from draftsmith.distill.prompt_sources import PromptRecord
from draftsmith.distill.self_prompts import SelfPromptSettings
from draftsmith.specdec.decoder import target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.prompts import encode_chat

EOS = frozenset({1})


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread beats OpenMP's barriers


def records(n: int, start: int = 0) -> list[PromptRecord]:
    """n prompts of 1 to 5 words of the tiny vocabulary, ids "p<k>"."""
    out = []
    for k in range(start, start + n):
        words = " ".join(f"w{3 + (k * 7 + j * 5) % 29}" for j in range(1 + k % 5))
        out.append(PromptRecord(f"p{k}", [{"role": "user", "content": words}], "test", ("a", "b")[k % 2]))
    return out


def settings(**changes) -> BuildSettings:
    fields = {
        "target": "tiny",
        "dtype": "float32",
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
        "seed": 0,
        "max_new_tokens": 12,
        "prompt_source": {"kind": "local", "path": "/prompts.jsonl"},
    }
    return BuildSettings(**(fields | changes))


def build(folder, model, tokenizer, prompts, config=None, batch_size=4, **kw):
    kw.setdefault("shard_rows", 3)
    engine = BundledEngine(model, batch_size)
    return build_dataset(folder, Writer(engine, tokenizer, EOS), config or settings(), prompts, progress=False, **kw)


def rows_by_key(folder) -> dict:
    rows = load_built(folder)
    keys = list(zip(rows["prompt_id"], rows["sample"], strict=True))
    assert len(keys) == len(set(keys)), "a (prompt, sample) appears twice"
    return {key: row for key, row in zip(keys, rows, strict=True)}


def test_every_prompt_is_answered_once_in_shards_with_the_targets_own_answer(tmp_path, model, tokenizer):
    prompts = records(10)
    manifest = build(tmp_path / "d", model, tokenizer, prompts)
    names = [p.name for p in shard_paths(tmp_path / "d")]
    assert names == [f"train-{manifest['id']}-r0-0000{i}.parquet" for i in range(4)]  # 3+3+3+1
    rows = rows_by_key(tmp_path / "d")
    assert sorted(rows) == sorted((p.id, 0) for p in prompts)
    for prompt in prompts:
        ids = encode_chat(tokenizer, prompt.messages)
        row = rows[(prompt.id, 0)]
        assert row["prompt_ids"] == ids
        assert row["answer_ids"] == target_generate(model, [ids], 12, eos_ids=EOS)[0][0]
        assert row["answer_text"] == tokenizer.decode(row["answer_ids"], skip_special_tokens=True)
        assert row["finished"] == (row["answer_ids"][-1] == 1)
        assert (row["topic"], row["source"], row["messages"]) == (prompt.topic, "test", prompt.messages)
    counts = manifest["counts"]
    assert counts["rows"] == counts["prompts"] == 10
    assert counts["answer_tokens"] == sum(len(r["answer_ids"]) for r in rows.values())
    assert counts["rows_by_topic"] == {"a": 5, "b": 5}
    on_disk = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert on_disk["complete"] is True and on_disk["settings"] == settings().to_dict()
    assert on_disk["request"] == {"num_prompts": 10, "samples_per_prompt": 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_lost_shard_is_made_again_identically_and_nothing_else(tmp_path, model, tokenizer, temperature):
    config = settings(sampling={"temperature": temperature, "top_k": 0, "top_p": 1.0})
    samples = 2 if temperature else 1
    build(tmp_path / "d", model, tokenizer, records(9), config, samples_per_prompt=samples)
    before = rows_by_key(tmp_path / "d")
    lost = shard_paths(tmp_path / "d")[1]
    in_lost = load_built(tmp_path / "d").select(range(3, 6))  # shards hold 3 rows each, in name order
    lost_keys = set(zip(in_lost["prompt_id"], in_lost["sample"], strict=True))
    lost.unlink()
    stale = tmp_path / "d" / "data" / ".train-r0-00007.parquet.0a1b2c3d.tmp"  # what a killed write leaves
    stale.write_bytes(b"PAR1")
    build(tmp_path / "d", model, tokenizer, records(9), config, samples_per_prompt=samples)
    after = rows_by_key(tmp_path / "d")
    assert not stale.exists()
    assert sorted(after) == sorted(before)
    assert {k: r["answer_ids"] for k, r in after.items()} == {k: r["answer_ids"] for k, r in before.items()}
    assert lost_keys <= set(after)
    if temperature:  # the two samples of a prompt are two draws
        assert any(after[(p, 0)]["answer_ids"] != after[(p, 1)]["answer_ids"] for p, _ in before)


def test_asking_for_more_prompts_and_samples_adds_rows(tmp_path, model, tokenizer):
    config = settings(sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    build(tmp_path / "d", model, tokenizer, records(4), config, samples_per_prompt=2)
    first = rows_by_key(tmp_path / "d")
    manifest = build(tmp_path / "d", model, tokenizer, records(6), config, samples_per_prompt=3)
    grown = rows_by_key(tmp_path / "d")
    assert sorted(grown) == sorted((f"p{k}", s) for k in range(6) for s in range(3))
    assert all(grown[key]["answer_ids"] == row["answer_ids"] for key, row in first.items())
    assert manifest["counts"]["rows"] == 18
    assert manifest["request"] == {"num_prompts": 6, "samples_per_prompt": 3}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_new_tokens": 13}, "max_new_tokens=12, not 13"),
        ({"sampling": {"temperature": 0.5, "top_k": 0, "top_p": 1.0}}, "sampling.temperature=0.0, not 0.5"),
        ({"dtype": "bfloat16"}, 'dtype="float32", not "bfloat16"'),
        ({"target": "other"}, 'target="tiny", not "other"'),
        ({"prompt_source": {"kind": "builtin"}}, 'prompt_source.kind="local", not "builtin"'),
        ({"seed": 1}, "seed=0, not 1"),
    ],
)
def test_a_changed_setting_is_refused_naming_the_field(tmp_path, model, tokenizer, change, named):
    build(tmp_path / "d", model, tokenizer, records(2))
    with pytest.raises(DraftsmithError, match="built with " + named.replace(".", r"\.")):
        build(tmp_path / "d", model, tokenizer, records(2), settings(**change))
    assert len(load_built(tmp_path / "d")) == 2


def test_the_engine_is_a_setting_and_datasets_that_name_none_were_made_by_the_bundled_decoder(
    tmp_path, model, tokenizer
):
    build(tmp_path / "d", model, tokenizer, records(2))
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["settings"]["engine"] == "draftsmith"
    assert manifest["engine"] == {"name": "draftsmith", "batch_size": 4, "device": "cpu"}
    del manifest["settings"]["engine"]  # as written before the engine was recorded
    path.write_text(json.dumps(manifest))
    with pytest.raises(DraftsmithError, match='built with engine="draftsmith", not "vllm"'):
        check_settings(tmp_path / "d", settings(engine="vllm"))
    with pytest.raises(DraftsmithError, match="settings name engine 'vllm' but 'draftsmith' generates"):
        build(tmp_path / "d", model, tokenizer, records(3), settings(engine="vllm"))
    build(tmp_path / "d", model, tokenizer, records(3))
    assert sorted(rows_by_key(tmp_path / "d")) == [("p0", 0), ("p1", 0), ("p2", 0)]
    assert json.loads(path.read_text())["settings"] == settings().to_dict()


def test_a_checkout_run_without_installing_builds_and_says_so_in_the_manifest(tmp_path, model, tokenizer, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"draftsmith": "9.9.9"}[name])
    build(tmp_path / "d", model, tokenizer, records(2))
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["draftsmith_version"] == "9.9.9"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    build(tmp_path / "d", model, tokenizer, records(3))
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["draftsmith_version"] == "not installed (run from a checkout)"
    assert sorted(rows_by_key(tmp_path / "d")) == [("p0", 0), ("p1", 0), ("p2", 0)]


def test_a_folder_that_is_not_a_dataset_is_refused(tmp_path, model, tokenizer):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="not a draftsmith dataset"):
        build(tmp_path / "d", model, tokenizer, records(2))
    with pytest.raises(DraftsmithError, match="not a dataset built by draftsmith data"):
        load_built(tmp_path / "d")


def test_processes_take_disjoint_shares_that_add_up_to_one_process(tmp_path, model, tokenizer):
    prompts = records(11)
    build(tmp_path / "one", model, tokenizer, prompts)
    for index in (0, 1):  # run one after the other; each writes only its own share
        build(tmp_path / "two", model, tokenizer, prompts, group=ProcessGroup(index, 2))
    share = {}
    for rank in ("r0", "r1"):
        paths = [p for p in shard_paths(tmp_path / "two") if f"-{rank}-" in p.name]
        share[rank] = {i for path in paths for i in read_shard(path)["prompt_id"]}
    assert share["r0"] == {f"p{k}" for k in range(0, 11, 2)}  # every second prompt
    assert share["r1"] == {f"p{k}" for k in range(1, 11, 2)}
    one, two = rows_by_key(tmp_path / "one"), rows_by_key(tmp_path / "two")
    assert {k: r["answer_ids"] for k, r in two.items()} == {k: r["answer_ids"] for k, r in one.items()}


def test_training_examples_mask_the_answer_tokens(tmp_path, model, tokenizer):
    build(tmp_path / "d", model, tokenizer, records(3))
    rows = load_built(tmp_path / "d")
    examples = training_examples(tmp_path / "d", max_length=64)
    assert len(examples) == 3
    for example, row in zip(examples, rows, strict=True):
        n_prompt, n_answer = len(row["prompt_ids"]), len(row["answer_ids"])
        assert example["input_ids"] == row["prompt_ids"] + row["answer_ids"]
        # position t predicts token t+1: the last prompt position predicts the first answer token
        assert example["loss_mask"] == [0] * (n_prompt - 1) + [1] * n_answer + [0]


def test_self_written_prompts_are_kept_per_round_and_extended(tmp_path, model, tokenizer):
    self_settings = SelfPromptSettings(topics=("coding", "math"), max_tokens=64)
    request = SelfPromptRequest(4, self_settings, PromptFilter(require_request=False))
    config = settings(prompt_source=request.source_settings())
    manifest = build(tmp_path / "d", model, tokenizer, request, config, batch_size=16)
    first = rows_by_key(tmp_path / "d")
    assert manifest["counts"]["rows_by_topic"] == {"coding": 2, "math": 2}
    assert manifest["counts"]["rows_by_source"] == {"self": 4}
    assert manifest["self_prompts"]["kept"] == 4
    assert all(prompt_id.startswith("self-") for prompt_id, _ in first)
    more = SelfPromptRequest(6, self_settings, PromptFilter(require_request=False))
    manifest = build(tmp_path / "d", model, tokenizer, more, config, batch_size=16)
    grown = rows_by_key(tmp_path / "d")
    assert set(first) < set(grown) and len(grown) == 6
    assert manifest["counts"]["rows_by_topic"] == {"coding": 3, "math": 3}
    texts = [row["messages"][0]["content"] for row in grown.values()]
    assert len(set(texts)) == 6


def test_self_written_prompts_grow_by_a_topic_and_keep_the_rows_they_have(tmp_path, model, tokenizer):
    two = SelfPromptSettings(topics=("coding", "math"), max_tokens=64)
    request = SelfPromptRequest(4, two, PromptFilter(require_request=False))
    build(tmp_path / "d", model, tokenizer, request, settings(prompt_source=request.source_settings()), batch_size=16)
    first = rows_by_key(tmp_path / "d")
    three = SelfPromptSettings(topics=("coding", "math", "translation"), max_tokens=64)
    request = SelfPromptRequest(6, three, PromptFilter(require_request=False))
    config = settings(prompt_source=request.source_settings())
    manifest = build(tmp_path / "d", model, tokenizer, request, config, batch_size=16)
    grown = rows_by_key(tmp_path / "d")
    assert {k: r["answer_ids"] for k, r in grown.items() if k in first} == {
        k: r["answer_ids"] for k, r in first.items()
    }
    assert manifest["counts"]["rows_by_topic"] == {"coding": 2, "math": 2, "translation": 2}
    assert manifest["settings"]["prompt_source"]["topics"] == ["coding", "math", "translation"]
    # A topic left out, or no steering at all, is another mix: refused, naming the field.
    for topics in (("coding", "translation"), ()):
        other = SelfPromptRequest(
            6, SelfPromptSettings(topics=topics, max_tokens=64), PromptFilter(require_request=False)
        )
        with pytest.raises(DraftsmithError, match=r"built with prompt_source\.topics="):
            build(tmp_path / "d", model, tokenizer, other, settings(prompt_source=other.source_settings()))
    assert len(load_built(tmp_path / "d")) == 6
