"""``eval --engine vllm`` and ``eval-run --engine vllm``: the pair in real vLLM servers beside the bundled decoder.

The refusals at the top need no engine. The tests marked ``vllm`` start two CPU servers each (the
target alone and with the draft; float32, eager, one thread) and skip where ``make vllm`` has not
installed the engine.
"""

import json

import pytest
import torch

from draftsmith import eval as eval_command
from draftsmith.cli import main
from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.loading import DEFAULT_TARGET, load_model, load_tokenizer
from draftsmith.specdec.vllm_server import ENGINE_VARIABLE
from draftsmith.train.batch_schedule import schedule_ranges
from draftsmith.train.checkpoint import begin, commit, write_draft
from draftsmith.train.config import DistillConfig, save_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the bundled decoder beside vLLM
ENGINE = ["--engine", "vllm", "--engine-eager", "--engine-threads", "1"]
SMALL = ["--limit", "2", "--max-new-tokens", "16", "--repeats", "1", "--dtype", "float32", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine-url", "http://127.0.0.1:1"], "--engine-url: the comparison starts its own two servers"),
        (["--draft-vocab", "100"], "--draft-vocab does not apply with --engine vllm"),
        (["--batch-size", "4"], "--batch-size does not apply with --engine vllm"),
        (["--engine-batch-sizes", "1,0"], "--engine-batch-sizes must be >= 1, got 1,0"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_in_one_line(extra, message, capsys):
    assert main(["eval", "--draft", "truncate:2", *ENGINE[:2], *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_missing_engine_is_said_before_anything_is_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENGINE_VARIABLE, str(tmp_path / "no-such-venv"))
    monkeypatch.setattr(eval_command, "load_model", None)  # loading the models first would fail another way
    assert main(["eval", "--draft", "truncate:2", *ENGINE, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ENGINE_VARIABLE}={tmp_path / 'no-such-venv'} is not an executable file")
    assert err.count("\n") == 1


def test_engine_settings_need_the_engine(capsys):
    assert main(["eval", "--draft", "truncate:2", "--engine-threads", "1"]) == 2
    assert capsys.readouterr().err == "error: --engine-threads applies to --engine vllm\n"


@pytest.mark.slow
def test_an_early_exit_draft_is_not_a_standalone_model(capsys):
    assert main(["eval", "--draft", "early_exit:2", *ENGINE, *SMALL]) == 2
    assert "early_exit:2 is an early-exit draft, which shares the target's layers" in capsys.readouterr().err


# --- real vLLM servers -----------------------------------------------------------------------------


@pytest.mark.vllm
def test_eval_reports_the_engines_figures_beside_the_bundled_decoders(engine, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["eval", "--draft", "truncate:2", "--gamma", "3", "--engine-batch-sizes", "1,2", "--json", str(out)]
    assert main([*argv, *ENGINE, *SMALL]) == 0
    report = json.loads(out.read_text())
    assert (report["engine"], report["gamma"], report["draft"], report["dtype"]) == ("vllm", 3, "truncate:2", "float32")
    assert [row["batch_size"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        vllm, ours = row["vllm"], row["bundled"]
        assert row["prompts"] == 2
        assert vllm["greedy_match"] == 1.0 and ours["greedy_match"] == 1.0
        assert vllm["proposed"] == 3 * vllm["drafts"] and 0 <= vllm["accepted"] <= vllm["proposed"]
        assert vllm["acceptance_rate"] == pytest.approx(vllm["accepted"] / vllm["proposed"])
        assert vllm["mean_accepted_tokens"] == pytest.approx(1 + vllm["accepted"] / vllm["drafts"])
        assert len(vllm["acceptance_per_position"]) == 3
        assert sum(vllm["acceptance_per_position"]) * vllm["drafts"] == pytest.approx(vllm["accepted"])
        assert vllm["speedup"] == pytest.approx(vllm["spec_tokens_per_s"] / vllm["target_tokens_per_s"])
        assert row["predicted_over_engine"] == pytest.approx(ours["predicted_speedup"] / vllm["speedup"])
        assert row["measured_over_engine"] == pytest.approx(ours["speedup"] / vllm["speedup"])
    # One sequence at a time, the engine and the bundled decoder accept the same draft tokens.
    assert report["rows"][0]["vllm"]["accepted"] == report["rows"][0]["bundled"]["accepted"]
    assert report["servers"]["speculative"]["gamma"] == 3 and report["servers"]["baseline"]["draft"] is None
    printed = capsys.readouterr().out
    assert "vs the bundled decoder, gamma 3, temperature 0.0, 16 new tokens, 1 repeats" in printed
    assert "vLLM acceptance per draft position, batch 2:" in printed


@pytest.mark.vllm
def test_eval_run_measures_the_best_draft_in_the_engine_too(engine, tmp_path, capsys):
    run = tmp_path / "run"
    save_config(DistillConfig(output_dir=str(run), target=DEFAULT_TARGET), run / "config.yaml")
    target = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    folder = begin(run, "initial")
    write_draft(truncate_target(target, 2), None, load_tokenizer(DEFAULT_TARGET), folder, DEFAULT_TARGET)
    commit(run, folder, "initial", {"step": 0})
    argv = ["eval-run", str(run), "--gammas", "2", "--engine-batch-sizes", "1"]
    assert main([*argv, *ENGINE, *SMALL]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    engine_part = report["engine"]
    assert (engine_part["checkpoint"], engine_part["gamma"], engine_part["draft"]) == (
        "initial",
        2,
        str(run / "initial"),
    )
    row = engine_part["rows"][0]
    assert row["batch_size"] == 1 and row["vllm"]["proposed"] == 2 * row["vllm"]["drafts"]
    assert row["vllm"]["accepted"] == row["bundled"]["accepted"]
    written = (run / "engine_report.md").read_text()
    assert written.startswith("# initial in vLLM, beside the bundled decoder")
    assert "vs the bundled decoder, gamma 2" in capsys.readouterr().out


@pytest.mark.vllm
def test_eval_chooses_the_gamma_at_each_batch_size_in_the_engine_too(engine, tmp_path, capsys):
    out = tmp_path / "schedule.json"
    argv = ["eval", "--draft", "truncate:2", "--batch-sizes", "2", "--gammas", "1,2", "--json", str(out)]
    assert main([*argv, *ENGINE, *SMALL]) == 0
    report = json.loads(out.read_text())
    vllm = report["engine_schedule"]
    assert (vllm["engine"], vllm["dtype"], vllm["gammas"], vllm["draft"]) == ("vllm", "float32", [1, 2], "truncate:2")
    assert sorted(vllm["by_batch_size"]) == ["1", "2"] and sorted(report["by_batch_size"]) == ["1", "2"]
    for entry in vllm["by_batch_size"].values():
        speedups = entry["speedup_by_gamma"]
        assert sorted(speedups) == ["1", "2"] and entry["best_gamma"] == int(max(speedups, key=speedups.get))
        assert entry["speedup"] == speedups[str(entry["best_gamma"])]
        assert entry["gamma"] == (entry["best_gamma"] if entry["speedup"] >= 1.0 else 0)
        assert entry["greedy_match"] == 1.0 and entry["prompts"] == 2
    gammas = {int(size): entry["gamma"] for size, entry in vllm["by_batch_size"].items()}
    assert vllm["num_speculative_tokens_per_batch_size"] == [list(r) for r in schedule_ranges(gammas)]
    printed = capsys.readouterr().out
    assert "float32: the fastest gamma at each batch size" in printed and "batch 2: gamma 1: " in printed
