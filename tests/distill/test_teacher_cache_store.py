"""The feature store: the target's top-k and its hidden states at the layers a kind reads, stored once."""

import json

import pytest
import torch

from draftsmith.distill import teacher_cache, vocab_cut
from draftsmith.distill.data import collate
from draftsmith.distill.dataset_builder import ProcessGroup
from draftsmith.distill.teacher_cache import StoreFormat
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.errors import DraftsmithError

EXAMPLES = [
    {"input_ids": [5, 9, 12, 7, 3], "loss_mask": [0, 0, 1, 1, 0]},
    {"input_ids": [4, 8, 15, 16, 23, 42, 11], "loss_mask": [0, 1, 1, 1, 1, 1, 0]},
    {"input_ids": [6, 6, 6], "loss_mask": [0, 1, 0]},
]


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target(seed=3, num_hidden_layers=4, hidden_size=64)
    return model.float().eval()


def test_stored_states_are_the_targets_at_every_position_and_the_top_k_at_the_loss_rows(tmp_path, target):
    fmt = StoreFormat(4, (1, 3), torch.float32, shard_rows=2)
    folder = teacher_cache.build(target, EXAMPLES, tmp_path / "store", fmt, batch_size=2, progress=False)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["layers"], meta["hidden_dtype"], meta["hidden_size"], meta["shards"]) == ([1, 3], "float32", 64, 2)
    store = teacher_cache.Store(folder)
    batch = collate([EXAMPLES[1], EXAMPLES[0]], pad_id=0)
    live = vocab_cut.target_rows(target, batch, vocab_cut.loss_rows(batch["loss_mask"]), (1, 3))
    digests = [teacher_cache.example_digest(e) for e in (EXAMPLES[1], EXAMPLES[0])]
    stored = store.hidden(digests, (1, 3), 7, torch.float32, torch.device("cpu"))
    for layer in (1, 3):
        assert stored[layer].shape == (2, 7, 64)
        torch.testing.assert_close(stored[layer][0], live.layers[layer][0])  # the full row
        torch.testing.assert_close(stored[layer][1, :5], live.layers[layer][1, :5])  # right padding: zeros
        assert torch.equal(stored[layer][1, 5:], torch.zeros(2, 64))
    ids, logps = store.lookup([EXAMPLES[1]])[0]
    assert ids.shape == (5, 4)  # its 5 loss positions
    top = torch.log_softmax(target.lm_head(live.hidden[:5]).float(), -1).topk(4)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(logps, top.values, atol=2e-3, rtol=0)  # float16 storage


def test_a_stores_entries_are_read_from_its_shards_when_asked(tmp_path, target):
    # three examples over two shards: the reader holds where each lies and reads it when indexed
    folder = teacher_cache.build(target, EXAMPLES, tmp_path / "store", StoreFormat(4, shard_rows=2), progress=False)
    store = teacher_cache.Store(folder)
    assert {name for name, _, _ in store.entries.where.values()} == {
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    }
    assert store.files == {}  # no shard opened for reading yet
    every = dict(teacher_cache.read_entries(folder))
    assert len(store.entries) == 3 and set(store.entries) == set(every)
    looked_up = store.lookup([EXAMPLES[2], EXAMPLES[0], EXAMPLES[2]])
    assert len(looked_up) == 3
    for got, example in zip(looked_up, [EXAMPLES[2], EXAMPLES[0], EXAMPLES[2]], strict=True):
        ids, logps = every[teacher_cache.example_digest(example)]
        assert torch.equal(got[0], ids) and torch.equal(got[1], logps) and len(ids) == sum(example["loss_mask"])
    with pytest.raises(DraftsmithError, match="lacks 1 of these examples"):
        store.lookup([{"input_ids": [1, 2], "loss_mask": [0, 1]}])


def test_the_targets_argmax_at_the_loss_rows_is_read_from_the_top_k_in_any_column_order(target):
    batch = collate([EXAMPLES[1], EXAMPLES[0]], pad_id=0)
    rows = vocab_cut.loss_rows(batch["loss_mask"])
    live = vocab_cut.target_rows(target, batch, rows)
    argmax = vocab_cut.head_argmax(target, live.hidden)
    assert torch.equal(argmax, target.lm_head(live.hidden).argmax(-1))
    top = torch.log_softmax(target.lm_head(live.hidden).float(), -1).topk(4)
    sorted_entries = [(top.indices[:5], top.values[:5]), (top.indices[5:], top.values[5:])]
    assert torch.equal(teacher_cache.rows_teacher_argmax(sorted_entries, torch.device("cpu")), argmax)
    order = torch.tensor([2, 0, 3, 1])  # an engine's entries need not come sorted
    shuffled = [(ids[:, order], logps[:, order]) for ids, logps in sorted_entries]
    assert torch.equal(teacher_cache.rows_teacher_argmax(shuffled, torch.device("cpu")), argmax)
    assert len(set(argmax.tolist())) > 1  # not one token everywhere


def test_bfloat16_storage_is_the_default_and_within_its_rounding(tmp_path, target):
    folder = teacher_cache.build(target, EXAMPLES, tmp_path / "bf16", StoreFormat(2, (2,)), progress=False)
    assert json.loads((folder / "meta.json").read_text())["hidden_dtype"] == "bfloat16"
    batch = collate(EXAMPLES[:1], pad_id=0)
    live = vocab_cut.target_rows(target, batch, vocab_cut.loss_rows(batch["loss_mask"]), (2,)).layers[2]
    stored = teacher_cache.Store(folder).hidden(
        [teacher_cache.example_digest(EXAMPLES[0])], (2,), 5, torch.float32, "cpu"
    )
    torch.testing.assert_close(stored[2], live, rtol=8e-3, atol=1e-2)
    assert not torch.equal(stored[2], live)  # rounded: the storage dtype is really bfloat16


def test_the_size_is_printed_and_a_build_that_does_not_fit_is_refused_before_any_work(
    tmp_path, target, capsys, monkeypatch
):
    # 3 examples: 8 loss tokens at 6 k bytes each, 15 positions x 2 layers x 64 values x 2 bytes
    needed = teacher_cache.store_bytes(EXAMPLES, 4, (1, 3), 64, torch.bfloat16)
    assert needed == 8 * 6 * 4 + 15 * 2 * 64 * 2
    folder = tmp_path / "full"
    monkeypatch.setattr(teacher_cache, "disk_free", lambda path: 1000)
    with pytest.raises(DraftsmithError, match=r"needs 4\.03 kB but .* has 1 kB free"):
        teacher_cache.build(target, EXAMPLES, folder, StoreFormat(4, (1, 3)), progress=False)
    assert not folder.exists()  # refused before anything was written
    assert "teacher store: 4.03 kB to write" in capsys.readouterr().err
    monkeypatch.setattr(teacher_cache, "disk_free", lambda path: needed)
    teacher_cache.build(target, EXAMPLES, folder, StoreFormat(4, (1, 3)), progress=False)
    assert (folder / "meta.json").is_file()


def test_a_store_with_more_layers_serves_a_kind_that_needs_fewer(tmp_path, target):
    def folder(layers):
        return tmp_path / teacher_cache.cache_key("t", torch.float32, EXAMPLES, 4, 1.0, layers, torch.bfloat16)

    wide = teacher_cache.build(
        target, EXAMPLES, folder((0, 2, 4)), StoreFormat(4, (0, 2, 4)), progress=False, target_key="t"
    )
    for fewer in [(2,), (0, 4), ()]:
        assert teacher_cache.find_store(folder(fewer), "t", torch.float32, EXAMPLES, 4, fewer, torch.bfloat16) == wide
    other_layer = folder((1,))
    assert teacher_cache.find_store(other_layer, "t", torch.float32, EXAMPLES, 4, (1,), torch.bfloat16) == other_layer
    other_target = folder((2,))
    assert teacher_cache.find_store(other_target, "u", torch.float32, EXAMPLES, 4, (2,), torch.bfloat16) == other_target
    other_k = folder((2,))
    assert teacher_cache.find_store(other_k, "t", torch.float32, EXAMPLES, 8, (2,), torch.bfloat16) == other_k
    with pytest.raises(DraftsmithError, match=r"holds layers \[0, 2, 4\], not \[1\]"):
        teacher_cache.Store(wide).check_layers((1, 2))


def test_processes_write_their_own_shards_of_one_store(tmp_path, target):
    folder, calls = tmp_path / "parts", []
    for rank in (1, 0):  # the second process first: the first writes meta.json once all are done
        group = ProcessGroup(rank, 2, lambda rank=rank: calls.append(rank))
        teacher_cache.build(target, EXAMPLES, folder, StoreFormat(4, (1,), shard_rows=1), group, progress=False)
        written = sorted(p.name for p in folder.glob("shard-*"))
        assert written == (
            ["shard-00001.safetensors"] if rank == 1 else [f"shard-0000{i}.safetensors" for i in range(3)]
        )
    assert (folder / "meta.json").is_file() and calls == [1, 1, 0, 0]
    whole = teacher_cache.build(target, EXAMPLES, tmp_path / "one", StoreFormat(4, (1,), shard_rows=1), progress=False)
    by_parts, by_one = teacher_cache.Store(folder), teacher_cache.Store(whole)
    digests = [teacher_cache.example_digest(e) for e in EXAMPLES]
    for ours, theirs in zip(by_parts.lookup(EXAMPLES), by_one.lookup(EXAMPLES), strict=True):
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    a = by_parts.hidden(digests, (1,), 7, torch.float32, "cpu")[1]
    assert torch.equal(a, by_one.hidden(digests, (1,), 7, torch.float32, "cpu")[1])
