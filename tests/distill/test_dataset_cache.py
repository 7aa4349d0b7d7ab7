"""The teacher's top-k cache a dataset folder carries: built per answer shard, read cut to a run's examples."""

import json

import pytest
import torch
from safetensors import safe_open

from draftsmith.distill import teacher_cache
from draftsmith.distill.dataset_builder import (
    BuildSettings,
    build_dataset,
    load_built,
    read_shard,
    shard_name,
    shard_paths,
    training_examples,
)
from draftsmith.distill.dataset_cache import (
    build_dataset_cache,
    cache_folder,
    dataset_entries,
    derive_cache,
    manifest_digest,
    row_examples,
    target_cache_writer,
)
from draftsmith.distill.engines import BundledEngine, Writer
from draftsmith.distill.prompt_sources import PromptRecord
from draftsmith.distill.teacher_cache import LOGPROB_STEP, Encoding, StoreFormat
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
    manifest = (folder / "manifest.json").read_bytes()
    fmt = StoreFormat(8)
    record = build_dataset_cache(folder, fmt, target_cache_writer(model, fmt), MADE_BY)
    answer_tokens = sum(len(a) for a in load_built(folder)["answer_ids"])
    encoding = {"indices": "int32", "logprobs": "float16"}
    made = {"top_k": 8, "encoding": encoding, "max_length": None, "shards": 3, "examples": 7, "tokens": answer_tokens}
    assert record == {**MADE_BY, **made, "manifest_sha256": manifest_digest(folder)}
    assert json.loads((cache_folder(folder, fmt) / "cache.json").read_text()) == record
    assert (folder / "manifest.json").read_bytes() == manifest  # the dataset is left as it was
    names = [f"train-{json.loads(manifest)['id']}-r0-0000{i}" for i in range(3)]
    assert sorted(p.name for p in cache_folder(folder, fmt).iterdir()) == ["cache.json", *names]

    # A run that cuts sequences at 10 tokens and keeps 5 tokens per position reads exactly those.
    examples = training_examples(folder, max_length=10)
    assert any(len(e["input_ids"]) == 10 for e in examples)  # rows cut at max_length
    entries, served_by = dataset_entries(folder, examples, "float32", top_k=5, max_length=10)
    assert served_by == cache_folder(folder, fmt) and len(entries) == len(examples)
    for example, (ids, logps) in zip(examples, entries, strict=True):
        want_ids, want_logps = own_top_k(model, example["input_ids"], example["loss_mask"], 5)
        assert ids.shape == (sum(example["loss_mask"]), 5)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(logps.double(), want_logps, atol=2e-3)  # stored as float16

    # Without cache.json (a build killed before its end, or one made before caches recorded their making)
    # it is not read, and the run says so.
    (cache_folder(folder, fmt) / "cache.json").rename(tmp_path / "cache.json")
    capsys.readouterr()
    assert dataset_entries(folder, examples, "float32", top_k=5, max_length=10) is None
    assert "has teacher-cache-k8 without cache.json" in capsys.readouterr().err
    (tmp_path / "cache.json").rename(cache_folder(folder, fmt) / "cache.json")

    # Computed in float32, it serves a bfloat16 teacher too (the dtype matters for a forward only); more
    # tokens per position than it keeps: the run's target teaches, and the run says why in one line.
    assert dataset_entries(folder, examples, "bfloat16", top_k=5, max_length=10)[1] == served_by
    capsys.readouterr()
    assert dataset_entries(folder, examples, "float32", top_k=9, max_length=10) is None
    err = capsys.readouterr().err
    assert (
        err
        == f"teacher cache: {folder} carries teacher-cache-k8: top-8, the run keeps 9; so the run's target teaches\n"
    )


def test_a_cache_serves_only_the_dataset_it_was_computed_for_and_rows_added_later_are_cached_again(
    tmp_path, model, capsys
):
    folder = tmp_path / "d"
    build(folder, model, 4)
    fmt = StoreFormat(6)
    first_record = build_dataset_cache(folder, fmt, target_cache_writer(model, fmt), MADE_BY)
    first, second = (shard_name(p) for p in shard_paths(folder)[:2])
    kept = cache_folder(folder, fmt) / first / "shard-00000.safetensors"
    written = kept.stat().st_mtime_ns
    (cache_folder(folder, fmt) / second / "meta.json").unlink()  # as a build killed before its end leaves it
    examples = training_examples(folder, max_length=256)
    in_first = [e for e in row_examples(read_shard(shard_paths(folder)[0]), 256) if e is not None]
    assert len(dataset_entries(folder, in_first, "float32", top_k=6, max_length=256)[0]) == len(in_first) == 3
    capsys.readouterr()
    assert dataset_entries(folder, examples, "float32", top_k=6, max_length=256) is None
    assert capsys.readouterr().err == (
        f"teacher cache: {cache_folder(folder, fmt)} has no entries for 1 of the run's examples (shards without "
        f"entries: {second}; `draftsmith data --teacher-cache K` adds them), so the run's target teaches\n"
    )
    build(folder, model, 8)  # 4 more rows: shards 2 and 3, and a new manifest
    examples = training_examples(folder, max_length=256)
    capsys.readouterr()
    assert dataset_entries(folder, examples, "float32", top_k=6, max_length=256) is None
    now = manifest_digest(folder)
    assert capsys.readouterr().err == (
        f"teacher cache: {folder} carries teacher-cache-k6: computed for another version of the dataset (manifest "
        f"sha256 {first_record['manifest_sha256'][:12]}, now {now[:12]}); `draftsmith data --teacher-cache K` "
        "computes it again; so the run's target teaches\n"
    )

    record = build_dataset_cache(folder, fmt, target_cache_writer(model, fmt), MADE_BY)
    assert (record["shards"], record["examples"], record["manifest_sha256"]) == (4, 8, now)
    assert kept.stat().st_mtime_ns == written  # a finished shard cache is not built again
    entries, _ = dataset_entries(folder, examples, "float32", top_k=6, max_length=256)
    for example, (ids, _) in zip(examples, entries, strict=True):
        assert torch.equal(ids, own_top_k(model, example["input_ids"], example["loss_mask"], 6)[0])


def test_a_compact_cache_cut_at_a_length_serves_runs_up_to_it_within_its_rounding(tmp_path, model, capsys):
    folder = tmp_path / "d"
    build(folder, model, 6)
    compact = StoreFormat(4, encoding=Encoding("uint16", "uint8"))
    record = build_dataset_cache(folder, compact, target_cache_writer(model, compact), MADE_BY, max_length=12)
    assert cache_folder(folder, compact).name == "teacher-cache-k4-uint8" and record["max_length"] == 12
    shard = next(cache_folder(folder, compact).glob("*/shard-00000.safetensors"))
    with safe_open(shard, framework="pt") as f:
        assert (f.get_tensor("indices").dtype, f.get_tensor("logprobs").dtype) == (torch.uint16, torch.uint8)
    examples = training_examples(folder, max_length=9)
    entries, _ = dataset_entries(folder, examples, "float32", top_k=3, max_length=9)
    for example, (ids, logps) in zip(examples, entries, strict=True):
        want_ids, want_logps = own_top_k(model, example["input_ids"], example["loss_mask"], 3)
        assert torch.equal(ids, want_ids)
        assert (logps.double() - want_logps).abs().max() <= LOGPROB_STEP / 2 + 1e-6  # uint8 steps of 1/16 nat
        assert not torch.allclose(logps.double(), want_logps, atol=1e-3)  # really rounded
    capsys.readouterr()
    assert dataset_entries(folder, training_examples(folder, 13), "float32", top_k=3, max_length=13) is None
    assert "teacher-cache-k4-uint8: rows cut at 12 tokens, the run reads 13" in capsys.readouterr().err
    with pytest.raises(DraftsmithError, match="was made with max_length 12 \\(now None\\)"):
        build_dataset_cache(folder, compact, target_cache_writer(model, compact), MADE_BY)


def test_a_derived_cache_keeps_the_first_columns_of_a_larger_one(tmp_path, model):
    folder = tmp_path / "d"
    build(folder, model, 5)
    wide = StoreFormat(8)
    build_dataset_cache(folder, wide, target_cache_writer(model, wide), MADE_BY)
    narrow = StoreFormat(3, encoding=Encoding("uint16", "uint8"))
    out = derive_cache(folder, cache_folder(folder, wide), narrow, "draftsmith data --teacher-cache 3")
    record = json.loads((out / "cache.json").read_text())
    assert (record["top_k"], record["encoding"]["logprobs"]) == (3, "uint8")
    assert record["derived_from"] == {
        "cache": "teacher-cache-k8",
        "encoding": {"indices": "int32", "logprobs": "float16"},
    }
    assert record["command"] == "draftsmith data --teacher-cache 3"
    examples = training_examples(folder, max_length=256)
    (derived, _), (computed, _) = (
        dataset_entries(folder, examples, "float32", top_k=k, max_length=256) for k in (3, 8)
    )  # the smallest cache that serves: top-3 for a run keeping 3
    for (ids, logps), (all_ids, all_logps) in zip(derived, computed, strict=True):
        assert torch.equal(ids, all_ids[:, :3])
        assert (logps - all_logps[:, :3]).abs().max() <= LOGPROB_STEP / 2 + 2e-3
    with pytest.raises(DraftsmithError, match="keeps top-8: it cannot give top-9"):
        derive_cache(folder, cache_folder(folder, wide), StoreFormat(9), "")


def test_more_tokens_per_position_than_the_vocabulary_is_refused(model):
    with pytest.raises(DraftsmithError, match="--teacher-cache 33 exceeds the target's vocabulary"):
        target_cache_writer(model, StoreFormat(33))


def test_a_run_cache_of_the_same_examples_made_another_way_is_named_when_not_reused(tmp_path, model, capsys):
    examples = [
        {"input_ids": [0, 5, 6, 7, 1], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [0, 9, 1], "loss_mask": [0, 1, 1]},
    ]
    teacher_cache.build(model, examples, tmp_path / "k3", StoreFormat(3), progress=True)
    capsys.readouterr()
    teacher_cache.build(model, examples[::-1], tmp_path / "k4", StoreFormat(4), progress=True)  # in any order
    err = capsys.readouterr().err
    assert f"teacher cache: {tmp_path / 'k3'} holds these examples but was made with top_k 3 (this run: 4)" in err
    teacher_cache.build(model, examples[:1], tmp_path / "one", StoreFormat(3), progress=True)  # others: no note
    assert "holds these examples" not in capsys.readouterr().err
