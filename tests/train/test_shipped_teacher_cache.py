"""The default target's top-k log-probs for the shipped dataset (smollm2-self) ship beside it: the default
config's steps read them (no target forward), and they are the live target's."""

import json

import pytest
import torch

from draftsmith.distill import dataset_builder
from draftsmith.distill.dataset_cache import carried_caches, dataset_entries, manifest_digest
from draftsmith.distill.teacher_cache import Encoding, example_digest
from draftsmith.specdec.loading import DEFAULT_TARGET, load_model
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.profile import weights_digest

FOLDER = dataset_builder.SHIPPED / "smollm2-self"


def shipped() -> tuple:
    """(the shipped cache's folder, its cache.json): exactly one ships."""
    carried = carried_caches(FOLDER)
    assert [path.name for path, _ in carried] == [carried[0][0].name]
    return carried[0]


def test_the_shipped_cache_says_how_it_was_made_and_serves_the_default_configs_every_row():
    folder, record = shipped()
    assert (record["target"], record["dtype"], record["computed_by"]) == (DEFAULT_TARGET, "float32", "draftsmith")
    assert record["manifest_sha256"] == manifest_digest(FOLDER)  # computed for the dataset as it ships
    assert len(record["target_weights_sha256"]) == 64 and record["draftsmith_version"]
    assert record["command"].startswith(f"draftsmith data --output {FOLDER.relative_to(FOLDER.parents[2])}")
    assert f"--teacher-cache {record['top_k']}" in record["command"] and "--dtype float32" in record["command"]
    for cfg_name in ("smollm2-135m", "smollm2-135m-early-exit", "smollm2-135m-dflash"):
        cfg = load_config(DistillConfig, config_path(cfg_name), [])
        assert (cfg.data.dataset, cfg.teacher.cache, cfg.teacher.top_k) == ("smollm2-self", True, record["top_k"])
        assert cfg.data.max_length <= record["max_length"]
    examples = dataset_builder.training_examples(FOLDER, record["max_length"])
    unique = {example_digest(e): sum(e["loss_mask"]) for e in examples}  # a repeated answer is kept once
    assert (len(examples), len(unique), sum(unique.values())) == (2800, record["examples"], record["tokens"])
    entries, served_by = dataset_entries(FOLDER, examples, "bfloat16", record["top_k"], record["max_length"])
    assert served_by == folder  # a float32 cache serves a bfloat16 teacher too
    assert [len(ids) for ids, _ in entries] == [sum(e["loss_mask"]) for e in examples]
    ids, logps = entries[0]
    assert ids.shape[1] == record["top_k"] and bool((logps[:, :-1] >= logps[:, 1:]).all())  # most likely first
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    assert size < 15e6


@pytest.mark.slow
def test_shipped_rows_are_the_live_targets_top_k_within_the_encodings_rounding():
    folder, record = shipped()
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    assert record["target_weights_sha256"] == weights_digest(model)
    examples = dataset_builder.training_examples(FOLDER, record["max_length"])[::350]  # 8 rows, one a shard or so
    entries, _ = dataset_entries(FOLDER, examples, "float32", record["top_k"], record["max_length"])
    rounding = Encoding(**record["encoding"]).error()  # a cache derived from a larger one: its rounding too
    rounding += Encoding(**record["derived_from"]["encoding"]).error() if "derived_from" in record else 0.0
    equal = total = 0
    for example, (ids, logps) in zip(examples, entries, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([example["input_ids"]])).logits[0]  # (T, V)
        live = torch.log_softmax(logits.float(), -1)[torch.tensor(example["loss_mask"], dtype=torch.bool)]  # (N, V)
        top = live.topk(record["top_k"])
        # the stored ids are the live top-k: equal where not tied, and where they differ the live log-probs
        # of the two tie (batched and single-row forwards round differently)
        torch.testing.assert_close(live.gather(1, ids), top.values, atol=1e-4, rtol=0)
        equal, total = equal + int((ids == top.indices).sum()), total + ids.numel()
        kept = top.values > -255 * 0.0625  # uint8 steps of 1/16 nat reach -15.9; below, a value is clipped there
        error = (logps - top.values).abs()[kept]
        assert float(error.max()) <= rounding + 1e-4
    assert equal / total > 0.99
    print(json.dumps({"rows": len(examples), "ids_equal": equal / total}))
