"""The gamma per batch size: eval-run chooses it at each size, publish writes it where each engine reads it,
and eval on the published folder drafts the gamma of its batch size."""

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.distill import drafts
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.train.batch_schedule import gamma_for_batch, read_schedule, schedule_ranges, write_schedule
from draftsmith.train.config import DistillConfig, load_config, load_run_config
from draftsmith.train.loop import train
from draftsmith.train.models import load_target
from tests.train.test_batch_schedule import vllm_reads

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
PROMPTS = str(ROOT / "distill" / "data" / "eval_prompts.jsonl")
MEASURE = ["--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12", "--no-progress"]
KEY = "num_speculative_tokens_per_batch_size"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny run measured at batch sizes 1 and 4 (gammas 1 and 3), its best published, and the run's
    target saved as a model folder."""
    root = tmp_path_factory.mktemp("batch")
    cfg = load_config(DistillConfig, TINY, [f"output_dir={root / 'run'}", "optim.max_steps=2", "save.steps=2"])
    run_dir = train(cfg).run_dir
    assert main(["eval-run", str(run_dir), *MEASURE, "--gammas", "1,3", "--batch-sizes", "4"]) == 0
    assert main(["publish", str(run_dir), "--out", str(root / "draft")]) == 0
    target, tokenizer = load_target(load_run_config(run_dir), torch.device("cpu"))
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return run_dir, root / "draft", root / "target"


def best_result(run_dir: Path) -> dict:
    report = json.loads((run_dir / "speedup_report.json").read_text())
    return report, report["results"][report["best"]]["0.0"]


def test_eval_run_writes_both_batch_sizes_into_the_report(published, capsys):
    run_dir, _, _ = published
    report, best = best_result(run_dir)
    entries = best["by_batch_size"]
    assert sorted(entries, key=int) == ["1", "4"]
    one, four = entries["1"], entries["4"]
    # batch 1 is the draft's own measurement: its gamma, and the speedup of its second measurement
    assert (one["batch_size"], one["best_gamma"], one["prompts"]) == (1, best["best_gamma"], 2)
    assert one["speedup"] == best["confirmation"]["speedup"] and one["dtype"] == report["dtype"]
    # batch 4: two prompts repeated to fill a batch, float32 where the device's default is 16-bit
    assert (four["batch_size"], four["prompts"], four["greedy_match"]) == (4, 4, 1.0)
    assert four["dtype"] == "float32" and four["best_gamma"] in (1, 3)
    assert sorted(four["predicted_by_gamma"]) == ["1", "3"]
    for entry in (one, four):
        assert entry["gamma"] == (entry["best_gamma"] if entry["speedup"] >= 1.0 else 0)
    assert best["gamma_by_batch_size"] == [list(r) for r in schedule_ranges({1: one["gamma"], 4: four["gamma"]})]
    table = (run_dir / "speedup_report.md").read_text()
    assert f"| 4 | float32 | 4 | {four['best_gamma']} |" in table and KEY in table
    # measured once: a second eval-run measures nothing again
    capsys.readouterr()
    assert main(["eval-run", str(run_dir), *MEASURE, "--gammas", "1,3", "--batch-sizes", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "measuring " not in out and "choosing its gamma" not in out
    assert best_result(run_dir)[1]["by_batch_size"] == entries


def card_speculative_config(draft_dir: Path) -> dict:
    """The speculative config the published card gives vLLM with the schedule (parsed as the literal it is)."""
    text = (draft_dir / "README.md").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("speculative_config = ")]
    return ast.literal_eval(line.removeprefix("speculative_config = "))


def test_publish_writes_the_schedule_where_each_engine_reads_it(published):
    run_dir, draft_dir, _ = published
    _, best = best_result(run_dir)
    ranges = [tuple(r) for r in best["gamma_by_batch_size"]]
    config = json.loads((draft_dir / "generation_config.json").read_text())
    assert config["draftsmith"][KEY] == best["gamma_by_batch_size"]
    assert config["num_assistant_tokens"] == best["best_gamma"]  # transformers: batch 1's gamma
    assert read_schedule(draft_dir) == ranges
    # the card's vLLM speculative config: the kind's, with the schedule and a cap that keeps every gamma
    tokens = max([best["best_gamma"], *(g for _, _, g in ranges)])
    engine_config = drafts.KINDS["lm"].engine_config(draft_dir.resolve())
    assert card_speculative_config(draft_dir) == {**engine_config, "num_speculative_tokens": tokens, KEY: ranges}
    text = (draft_dir / "README.md").read_text()
    assert "(not measured in vLLM)" in text and "| 4 | draftsmith's decoder, float32 |" in text
    # the profile records it with each size's figures and dtype
    profile = json.loads((draft_dir / "draftsmith_profile.json").read_text())["gamma_by_batch_size"]
    assert profile["bundled"][KEY] == best["gamma_by_batch_size"] and profile["vllm"] is None
    assert {size: e["dtype"] for size, e in profile["bundled"]["by_batch_size"].items()} == {
        "1": str(resolve_dtype(None, torch.device("cpu"))).removeprefix("torch."),
        "4": "float32",
    }


@pytest.mark.vllm
def test_vllm_accepts_the_schedule_of_the_card(published, engine):
    """vLLM's own validator accepts the card's schedule, and its lookup gives each batch the gamma measured."""
    speculative = card_speculative_config(published[1])
    ranges = speculative[KEY]
    normalized, dense = vllm_reads(engine, ranges, max_batch=8, tokens=speculative["num_speculative_tokens"])
    assert normalized == [list(r) for r in ranges]
    assert dense[1:] == [gamma_for_batch(ranges, size) for size in range(1, 9)]


def evaluated(argv: list[str], out: Path, capsys) -> tuple[dict, str]:
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_eval_of_the_published_folder_drafts_the_gamma_of_its_batch_size(published, tmp_path, capsys):
    run_dir, draft_dir, target_dir = published
    _, best = best_result(run_dir)
    common = ["eval", "--target", str(target_dir), *MEASURE, "--repeats", "1", "--batch-size", "4"]
    served = gamma_for_batch(read_schedule(draft_dir), 4)
    report, out = evaluated([*common, "--draft", str(draft_dir)], tmp_path / "a.json", capsys)
    assert report["gamma"] == (served or best["best_gamma"]) and report["batch_size"] == 4
    # a schedule written by hand: batch 4 gets gamma 2, and eval says where it came from
    folder = tmp_path / "draft"
    shutil.copytree(draft_dir, folder)
    write_schedule(folder, [(1, 3, best["best_gamma"]), (4, 4, 2)])
    report, out = evaluated([*common, "--draft", str(folder)], tmp_path / "b.json", capsys)
    assert (report["gamma"], report["gamma_source"]) == (2, f"generation_config.json draftsmith.{KEY}")
    assert f"gamma 2: {folder}'s published gamma for batch size 4" in out
    # gamma 0 there: drafting was measured not to pay, said so, and batch 1's gamma is measured
    write_schedule(folder, [(1, 3, best["best_gamma"]), (4, 4, 0)])
    report, out = evaluated([*common, "--draft", str(folder)], tmp_path / "c.json", capsys)
    assert (report["gamma"], report["gamma_source"]) == (best["best_gamma"], "generation_config.json")
    assert "turns drafting off at batch size 4" in out
    # an explicit --gamma still wins
    report, _ = evaluated([*common, "--draft", str(folder), "--gamma", "3"], tmp_path / "d.json", capsys)
    assert (report["gamma"], report["gamma_source"]) == (3, "--gamma")


def test_eval_chooses_the_gamma_at_each_batch_size(published, tmp_path, capsys):
    _, draft_dir, target_dir = published
    argv = ["eval", "--target", str(target_dir), "--draft", str(draft_dir), *MEASURE, "--repeats", "1"]
    report, out = evaluated([*argv, "--batch-sizes", "2", "--gammas", "1,2"], tmp_path / "e.json", capsys)
    entries = report["by_batch_size"]
    assert sorted(entries, key=int) == ["1", "2"] and report["gammas"] == [1, 2]
    assert entries["2"]["dtype"] == "float32" and entries["2"]["prompts"] == 2
    for entry in entries.values():
        assert entry["best_gamma"] in (1, 2) and entry["greedy_match"] == 1.0
        assert entry["gamma"] == (entry["best_gamma"] if entry["speedup"] >= 1.0 else 0)
    gammas = {int(size): entry["gamma"] for size, entry in entries.items()}
    assert report[KEY] == [list(r) for r in schedule_ranges(gammas)]
    assert "choosing the gamma at batch size 2 (float32)" in out and f"{KEY}: " in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--batch-sizes", "1,4", "--gamma", "2"],
            "--batch-sizes chooses the gamma at each batch size; leave out --gamma",
        ),
        (
            ["--batch-sizes", "1,4", "--batch-size", "4"],
            "--batch-sizes chooses the gamma at each batch size; leave out --batch-size\n",
        ),
        (["--gammas", "1,2"], "--gammas applies with --batch-sizes"),
        (["--batch-sizes", "0,4"], "--batch-sizes must all be >= 1"),
    ],
)
def test_what_batch_sizes_cannot_take_is_refused_in_one_line(published, extra, message, capsys):
    _, draft_dir, target_dir = published
    assert main(["eval", "--target", str(target_dir), "--draft", str(draft_dir), *MEASURE, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_the_card_gives_vllm_the_schedule_vllm_measured_where_it_was(published, tmp_path):
    run_dir, _, _ = published
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    report, best = best_result(run)
    # what eval-run --engine vllm --batch-sizes 1,4 adds for the best draft (engine_eval.engine_run_schedule)
    entry = {"best_gamma": 3, "speedup": 1.1, "gamma": 3, "speedup_by_gamma": {"1": 1.0, "3": 1.1}}
    report["engine_schedule"] = {
        "checkpoint": report["best"],
        "temperature": 0.0,
        "engine_version": "0.32.0",
        "dtype": "float32",
        "by_batch_size": {"1": entry, "4": {**entry, "speedup": 0.8, "gamma": 0}},
        KEY: [[1, 3, 3], [4, 4, 0]],
    }
    (run / "speedup_report.json").write_text(json.dumps(report))
    assert main(["publish", str(run), "--out", str(tmp_path / "draft")]) == 0
    speculative = card_speculative_config(tmp_path / "draft")
    assert speculative[KEY] == [(1, 3, 3), (4, 4, 0)] and speculative["num_speculative_tokens"] == 3
    text = (tmp_path / "draft" / "README.md").read_text()
    assert "As measured by vLLM 0.32.0:" in text and "| 4 | vLLM 0.32.0, float32 | 3 | 0.80x | 0 |" in text
    # draftsmith's own decoder keeps the schedule it measured itself
    assert read_schedule(tmp_path / "draft") == [tuple(r) for r in best["gamma_by_batch_size"]]
    profile = json.loads((tmp_path / "draft" / "draftsmith_profile.json").read_text())["gamma_by_batch_size"]
    assert profile["vllm"]["by_batch_size"]["4"]["gamma"] == 0
