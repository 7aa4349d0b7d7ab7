"""A feature store written row by row as a serving engine finishes requests: bounded shards, resumable."""

import json

import pytest
import torch

from draftsmith.distill import teacher_cache
from draftsmith.distill.teacher_cache import example_digest
from draftsmith.specdec.errors import DraftsmithError

LAYERS = [0, 3]
HIDDEN = 8


def example(i: int) -> dict:
    length = 3 + i
    return {"input_ids": [10 + i] * length, "loss_mask": [0] + [1] * (length - 2) + [0]}


EXAMPLES = [example(i) for i in range(5)]


def row(i: int) -> tuple[bytes, tuple[torch.Tensor, torch.Tensor], dict[int, torch.Tensor]]:
    """Example i's features as an engine returns them: (digest, top-2 (N, 2) ids and log-probs, {layer: (L, H)})."""
    e = EXAMPLES[i]
    loss = sum(e["loss_mask"])
    ids = torch.arange(2 * loss).view(loss, 2) + i
    logps = torch.tensor([-0.25, -2.5]).expand(loss, 2).clone()  # exact in float16
    states = {layer: torch.full((len(e["input_ids"]), HIDDEN), float(i + layer)) for layer in LAYERS}
    return example_digest(e), (ids, logps), states


def test_rows_in_completion_order_fill_bounded_shards_that_the_store_reads(tmp_path):
    folder = tmp_path / "store"
    order = [3, 0, 4, 1, 2]  # as requests finish
    written = teacher_cache.write_streamed(
        folder, (row(i) for i in order), LAYERS, torch.bfloat16, shard_rows=2, shard_bytes=1 << 20
    )
    assert written == 5
    assert sorted(p.name for p in folder.iterdir()) == [f"shard-0000{i}.safetensors" for i in range(3)]
    teacher_cache.finish_streamed(folder, EXAMPLES, top_k=2, made_by={"layers": LAYERS, "hidden_size": HIDDEN})
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["examples"], meta["tokens"], meta["shards"]) == (5, sum(1 + i for i in range(5)), 3)
    store = teacher_cache.Store(folder)
    for i, e in enumerate(EXAMPLES):
        digest, (ids, logps), states = row(i)
        stored_ids, stored_logps = store.lookup([e])[0]
        assert torch.equal(stored_ids, ids) and torch.equal(stored_logps, logps)
        got = store.hidden([digest], LAYERS, len(e["input_ids"]), torch.float32, torch.device("cpu"))
        for layer in LAYERS:
            assert torch.equal(got[layer][0], states[layer])  # small integers: exact in bfloat16


def test_a_shard_closes_at_its_byte_bound_before_its_row_bound(tmp_path):
    folder = tmp_path / "store"
    one_row = 2 * len(EXAMPLES[4]["input_ids"]) * HIDDEN * 2  # example 4's two layers in bfloat16
    teacher_cache.write_streamed(folder, (row(i) for i in (4, 3, 2)), LAYERS, shard_rows=100, shard_bytes=one_row)
    assert len(list(folder.glob("shard-*.safetensors"))) == 2  # example 4 alone fills one; 3 and 2 share the next


def test_a_build_killed_midway_keeps_its_shards_and_writes_only_the_rest(tmp_path):
    folder = tmp_path / "store"
    teacher_cache.write_streamed(folder, (row(i) for i in (1, 3)), LAYERS, shard_rows=1)
    (folder / ".shard-00002.safetensors.1234abcd.tmp").write_bytes(b"half")  # a killed atomic write
    with pytest.raises(DraftsmithError, match="lacks 3 of its 5 examples; run the same command again"):
        teacher_cache.finish_streamed(folder, EXAMPLES, top_k=2)
    assert not (folder / "meta.json").exists()
    stored, next_shard = teacher_cache.stored_rows(folder)
    assert stored == {example_digest(EXAMPLES[1]), example_digest(EXAMPLES[3])} and next_shard == 2
    rest = [i for i, e in enumerate(EXAMPLES) if example_digest(e) not in stored]
    teacher_cache.write_streamed(folder, (row(i) for i in rest), LAYERS, first_shard=next_shard, shard_rows=2)
    teacher_cache.finish_streamed(folder, EXAMPLES + [EXAMPLES[0]], top_k=2)  # a repeated example counts once
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["files"] == [f"shard-0000{i}.safetensors" for i in range(4)] and meta["examples"] == 5
    assert teacher_cache.stored_rows(tmp_path / "none") == (set(), 0)
