"""The gamma per batch size: 0 where drafting does not pay, and vLLM's ranges built as vLLM reads them."""

import json
import subprocess

import pytest
from transformers import GenerationConfig

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train import speedup
from draftsmith.train.batch_schedule import (
    engine_gamma,
    gamma_for_batch,
    gamma_that_pays,
    parse_batch_sizes,
    read_schedule,
    schedule_ranges,
    write_schedule,
)


def measured(best_gamma: int, speedup_there: float, **more) -> dict:
    """A draft's result at one batch size as eval-run's report keeps it (the keys the entries read)."""
    return {"best_gamma": best_gamma, "speedup": speedup_there, "acceptance_rate": 0.4, **more}


def test_a_size_where_nothing_pays_records_gamma_0():
    under = {"dtype": "float32", "matmul": "linear"}
    slower = speedup.batch_size_entry(measured(3, 0.97), 16, 16, under)
    assert (slower["gamma"], slower["best_gamma"], slower["speedup"]) == (0, 3, 0.97)
    assert (slower["batch_size"], slower["prompts"], slower["dtype"]) == (16, 16, "float32")
    faster = speedup.batch_size_entry(measured(3, 1.0), 4, 4, under)
    assert faster["gamma"] == 3  # as fast as the target alone: drafting is kept
    assert gamma_that_pays(2, float("nan")) == 0 and gamma_that_pays(2, None) == 0


def test_batch_one_is_judged_by_its_second_measurement_and_by_its_chain():
    under = {"dtype": "bfloat16", "matmul": "linear"}
    # chosen at 1.05x, measured again once chosen at 0.97x: the second figure decides
    chosen = measured(4, 1.05, confirmation={"speedup": 0.97, "acceptance_rate": 0.5})
    entry = speedup.batch_one_entry(chosen, 10, under)
    assert (entry["gamma"], entry["best_gamma"], entry["speedup"], entry["acceptance_rate"]) == (0, 4, 0.97, 0.5)
    # a token tree measured again: the chain's own figures decide (serving engines draft the chain)
    tree = measured(2, 1.2, best_tree="3,2,1", trees={"3,2,1": {"speedup": 1.4}}, confirmation={"speedup": 1.3})
    entry = speedup.batch_one_entry(tree, 10, under)
    assert (entry["gamma"], entry["speedup"]) == (2, 1.2)


def test_ranges_are_contiguous_inclusive_from_1_and_the_last_holds_every_larger_batch():
    ranges = schedule_ranges({1: 3, 4: 2, 16: 0})
    assert ranges == [(1, 3, 3), (4, 15, 2), (16, 16, 0)]
    assert ranges[0][0] == 1
    assert all(last + 1 == nxt for (_, last, _), (nxt, _, _) in zip(ranges[:-1], ranges[1:], strict=True))
    expected = {**dict.fromkeys(range(1, 4), 3), **dict.fromkeys(range(4, 16), 2), **dict.fromkeys(range(16, 41), 0)}
    assert {size: gamma_for_batch(ranges, size) for size in range(1, 41)} == expected
    # sizes below the smallest measured one take its gamma; equal neighbours merge
    assert schedule_ranges({2: 4, 8: 4, 32: 1}) == [(1, 31, 4), (32, 32, 1)]
    assert schedule_ranges({1: 0}) == [(1, 1, 0)]
    assert engine_gamma([(1, 3, 2), (4, 4, 5)], 2) == 5 and engine_gamma([(1, 1, 0)], 3) == 3


def test_bad_schedules_and_batch_sizes_are_refused():
    with pytest.raises(DraftsmithError, match="no batch size was measured"):
        schedule_ranges({})
    with pytest.raises(DraftsmithError, match="gammas >= 0"):
        schedule_ranges({1: -1})
    assert parse_batch_sizes("16,4") == [1, 4, 16]  # batch 1 always: the schedule starts there
    with pytest.raises(DraftsmithError, match="--batch-sizes must all be >= 1"):
        parse_batch_sizes("1,0")
    with pytest.raises(DraftsmithError, match="separated by commas"):
        parse_batch_sizes("1;4")


def test_the_schedule_rides_in_the_generation_config_transformers_reads(tmp_path):
    config = GenerationConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
    config.draftsmith = {"tree": "3,2,1"}
    config.save_pretrained(tmp_path)
    write_schedule(tmp_path, [(1, 3, 3), (4, 4, 0)])
    assert read_schedule(tmp_path) == [(1, 3, 3), (4, 4, 0)]
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["draftsmith"] == {"tree": "3,2,1", "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 4, 0]]}
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert (loaded.num_assistant_tokens, loaded.num_assistant_tokens_schedule) == (3, "constant")
    with pytest.raises(DraftsmithError, match="wrote no generation config"):
        write_schedule(tmp_path / "missing", [(1, 1, 2)])


VLLM_READS = """
import json, sys
from vllm.v1.spec_decode.dynamic import utils
ranges, max_batch, tokens = json.loads(sys.argv[1])
normalized = utils.validate_and_normalize_dynamic_sd_schedule(ranges)
print(json.dumps([normalized, utils.build_dynamic_sd_schedule_lookup(ranges, max_batch, tokens)]))
"""


def vllm_reads(engine, ranges, max_batch: int, tokens: int) -> tuple[list, list[int]]:
    """vLLM's own validator and dense batch-size lookup run on ``ranges`` in its environment."""
    python = engine.prefix / "bin" / "python"
    argument = json.dumps([[list(r) for r in ranges], max_batch, tokens])
    done = subprocess.run([python, "-c", VLLM_READS, argument], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    normalized, dense = json.loads(done.stdout.strip().splitlines()[-1])
    return normalized, dense


@pytest.mark.vllm
def test_vllm_validates_the_ranges_and_reads_each_batch_as_draftsmith_does(engine):
    ranges = schedule_ranges({1: 3, 4: 2, 16: 0, 24: 5})
    normalized, dense = vllm_reads(engine, ranges, max_batch=40, tokens=engine_gamma(ranges, 3))
    assert normalized == [list(r) for r in ranges]
    assert dense[1:] == [gamma_for_batch(ranges, size) for size in range(1, 41)]
