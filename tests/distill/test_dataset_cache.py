"""The teacher's top-k cache a dataset folder carries: built per answer shard, read cut to a run's examples."""

import json

import pytest
import torch

from draftsmith.distill import teacher_cache
from draftsmith.distill.dataset_builder import (
    BuildSettings,
    build_dataset,
    load_built,
    shard_name,
    shard_paths,
    training_examples,
)
from draftsmith.distill.dataset_cache import build_dataset_cache, cache_folder, dataset_entries, target_cache_writer
from draftsmith.distill.engines import BundledEngine, Writer
from draftsmith.distill.prompt_sources import PromptRecord
from draftsmith.specdec.errors import DraftsmithError
from tests.helpers import tiny_llama, tiny_tokenizer

EOS = frozenset({1})
MADE_BY = {"target": "tiny", "dtype": "float32", "computed_by": "draftsmith"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=32, sharpness=8.0)


def records(n: int) -> list[PromptRecord]:
    words = [" ".join(f"w{3 + (k * 7 + j * 5) % 29}" for j in range(1 + k % 5)) for k in range(n)]
    return [PromptRecord(f"p{k}", [{"role": "user", "content": words[k]}], "test", "t") for k in range(n)]


def build(folder, model, n: int) -> None:
    settings = BuildSettings(
        target="tiny",
        dtype="float32",
        sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        seed=0,
        max_new_tokens=12,
        prompt_source={"kind": "local", "path": "/prompts.jsonl"},
    )
    engine = BundledEngine(model, batch_size=4)
    build_dataset(folder, Writer(engine, tiny_tokenizer(32), EOS), settings, records(n), shard_rows=3, progress=False)


def own_top_k(model, ids: list[int], loss_mask: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's k most likely tokens and their log-probs at the loss positions, computed here."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()  # (T, V)
    top = torch.topk(torch.log_softmax(logits, -1)[torch.tensor(loss_mask, dtype=torch.bool)], k, dim=-1)
    return top.indices, top.values


def test_every_row_is_cached_whole_and_a_run_reads_it_cut_to_its_examples(tmp_path, model, capsys):
    folder = tmp_path / "d"
    build(folder, model, 7)  # shards of 3 + 3 + 1 rows
    manifest = build_dataset_cache(folder, 8, target_cache_writer(model, 8), MADE_BY)
    answer_tokens = sum(len(a) for a in load_built(folder)["answer_ids"])
    assert manifest["teacher_cache"] == {"8": {**MADE_BY, "top_k": 8, "shards": 3, "tokens": answer_tokens}}
    assert json.loads((folder / "manifest.json").read_text())["teacher_cache"] == manifest["teacher_cache"]
    names = [f"train-{manifest['id']}-r0-0000{i}" for i in range(3)]
    assert sorted(p.name for p in cache_folder(folder, 8).iterdir()) == names

    # A run that cuts sequences at 10 tokens and keeps 5 tokens per position reads exactly those.
    examples = training_examples(folder, max_length=10)
    assert any(len(e["input_ids"]) == 10 for e in examples)  # rows cut at max_length
    entries = dataset_entries(folder, examples, "float32", top_k=5, max_length=10)
    assert len(entries) == len(examples)
    for example, (ids, logps) in zip(examples, entries, strict=True):
        want_ids, want_logps = own_top_k(model, example["input_ids"], example["loss_mask"], 5)
        assert ids.shape == (sum(example["loss_mask"]), 5)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(logps.double(), want_logps, atol=2e-3)  # stored as float16

    # Another dtype, or more tokens per position than were kept: the run builds its own cache, and says why.
    capsys.readouterr()
    assert dataset_entries(folder, examples, "bfloat16", top_k=5, max_length=10) is None
    assert f"{folder} carries top-8 in float32; this run asks top-5 in bfloat16" in capsys.readouterr().err
    assert dataset_entries(folder, examples, "float32", top_k=9, max_length=10) is None
    assert "this run asks top-9 in float32" in capsys.readouterr().err


def test_rows_added_later_and_a_shard_cache_cut_short_are_cached_when_the_step_runs_again(tmp_path, model, capsys):
    folder = tmp_path / "d"
    build(folder, model, 4)
    build_dataset_cache(folder, 6, target_cache_writer(model, 6), MADE_BY)
    first, second = (shard_name(p) for p in shard_paths(folder)[:2])
    kept = cache_folder(folder, 6) / first / "shard-00000.safetensors"
    written = kept.stat().st_mtime_ns
    (cache_folder(folder, 6) / second / "meta.json").unlink()  # as a build killed before its end leaves it
    build(folder, model, 8)  # 4 more rows: shards 2 and 3
    examples = training_examples(folder, max_length=256)
    capsys.readouterr()
    assert dataset_entries(folder, examples, "float32", top_k=6, max_length=256) is None  # not all covered
    assert "has no entries for the shard" in capsys.readouterr().err

    manifest = build_dataset_cache(folder, 6, target_cache_writer(model, 6), MADE_BY)
    assert manifest["teacher_cache"]["6"]["shards"] == 4
    assert kept.stat().st_mtime_ns == written  # a finished shard cache is not built again
    entries = dataset_entries(folder, examples, "float32", top_k=6, max_length=256)
    for example, (ids, _) in zip(examples, entries, strict=True):
        assert torch.equal(ids, own_top_k(model, example["input_ids"], example["loss_mask"], 6)[0])


def test_more_tokens_per_position_than_the_vocabulary_is_refused(model):
    with pytest.raises(DraftsmithError, match="--teacher-cache 33 exceeds the target's vocabulary"):
        target_cache_writer(model, 33)


def test_a_run_cache_of_the_same_examples_made_another_way_is_named_when_not_reused(tmp_path, model, capsys):
    examples = [
        {"input_ids": [0, 5, 6, 7, 1], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [0, 9, 1], "loss_mask": [0, 1, 1]},
    ]
    teacher_cache.build(model, examples, tmp_path / "k3", top_k=3, progress=True)
    capsys.readouterr()
    teacher_cache.build(model, examples[::-1], tmp_path / "k4", top_k=4, progress=True)  # same examples, in any order
    err = capsys.readouterr().err
    assert f"teacher cache: {tmp_path / 'k3'} holds these examples but was made with top_k 3 (this run: 4)" in err
    teacher_cache.build(model, examples[:1], tmp_path / "one", top_k=3, progress=True)  # other examples: no note
    assert "holds these examples" not in capsys.readouterr().err
