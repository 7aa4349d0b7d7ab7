"""Length-bucketed batches (data.bucket_batches): little padding, an order fixed by (seed, epoch), exact resume;
and the threads a training process takes."""

import json
from pathlib import Path

import pytest

from draftsmith.distill.data import length_buckets
from draftsmith.train import cpu_setup
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.examples import LengthBucketSampler
from draftsmith.train.loop import train


def test_windows_are_sorted_by_length_and_cut_into_batches():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10]
    order = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # windows of 2 batches of 2: [0, 1, 2, 3] by length -> 1, 3 | 0, 2; [4..7] -> 5, 7 | 4, 6; the rest [8, 9]
    assert length_buckets(order, lengths, batch_size=2, window=2) == [[1, 3], [0, 2], [5, 7], [4, 6], [8, 9]]


def padded_positions(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def test_bucketed_batches_depend_on_seed_and_epoch_only_and_pad_less():
    lengths = [(7 * i) % 97 + 3 for i in range(200)]  # 200 examples of lengths 3..99
    sampler = LengthBucketSampler(lengths, batch_size=8, window=5, seed=3)
    sampler.sampler.set_epoch(1)
    first = list(sampler)
    plain = [list(sampler.sampler)[i : i + 8] for i in range(0, 200, 8)]  # the same epoch's order, unbucketed
    again = LengthBucketSampler(lengths, batch_size=8, window=5, seed=3)  # a resumed process
    again.sampler.set_epoch(1)
    assert list(again) == first
    sampler.sampler.set_epoch(2)
    assert list(sampler) != first
    assert len(first) == len(sampler) == 25
    assert sorted(i for batch in first for i in batch) == list(range(200))  # every example once
    # 10017 tokens: plain batches pad them to 18024 positions, windows of 5 sorted batches to 11760
    assert (sum(lengths), padded_positions(plain, lengths), padded_positions(first, lengths)) == (10017, 18024, 11760)


def tiny_cfg(folder: Path, **overrides) -> DistillConfig:
    items = [f"{k}={v}" for k, v in {"output_dir": folder, "bucket_batches": 3, **overrides}.items()]
    return load_config(DistillConfig, config_path("tiny"), items)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())}


def test_a_bucketed_run_resumed_inside_its_second_epoch_has_the_losses_of_an_uninterrupted_one(tmp_path):
    # 48 training sequences in batches of 8: 6 steps an epoch; the checkpoint at step 8 lies in the second.
    settings = {"max_steps": 10, "save_steps": 4, "log_steps": 5}
    straight = train(tiny_cfg(tmp_path / "straight", **settings)).run_dir
    cfg = tiny_cfg(tmp_path / "killed", **settings)
    train(cfg, stop_at_step=9)
    train(cfg)
    resumed = losses(Path(cfg.output_dir))
    assert sorted(resumed) == list(range(1, 11))
    assert resumed == pytest.approx(losses(straight), rel=1e-5, abs=1e-7)
    unbucketed = losses(train(tiny_cfg(tmp_path / "plain", bucket_batches=0, max_steps=1)).run_dir)
    assert unbucketed[1] != pytest.approx(resumed[1], rel=1e-3)  # other batches than the plain shuffle's


def test_a_process_takes_its_share_of_the_cpus_it_may_run_on(monkeypatch):
    monkeypatch.setattr(cpu_setup, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [cpu_setup.process_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [cpu_setup.process_threads(n) for n in (1, 4)] == [3, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_setup.local_processes(4) == 2
