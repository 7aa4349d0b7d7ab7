"""``draftsmith eval`` end to end on tiny models saved to disk."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.specdec.measure import machine
from tests.helpers import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": i, "category": cat, "turns": [f"w{3 + i} w{10 + i}", "w20 w21"]}
        for i, cat in enumerate(["writing", "writing", "math", "coding"])
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_eval(pair, prompts, tmp_path, *extra, draft=None):
    """``draftsmith eval`` on the pair, 16 new tokens and 2 repeats unless ``extra`` gives its own
    (an option may be given once)."""
    out = tmp_path / "report.json"
    defaults = [flag for flag in (("--max-new-tokens", "16"), ("--repeats", "2")) if flag[0] not in extra]
    code = main(
        [
            "eval",
            "--target",
            str(pair[0]),
            "--draft",
            draft or str(pair[1]),
            "--prompts",
            str(prompts),
            *[item for flag in defaults for item in flag],
            "--json",
            str(out),
            "--no-progress",
            *extra,
        ]
    )
    return code, out


def test_greedy_report(pair, prompts, tmp_path, capsys):
    code, out = run_eval(pair, prompts, tmp_path, "--gamma", "3", "--compare-hf")
    assert code == 0
    report = json.loads(out.read_text())
    for key in (
        "acceptance_rate",
        "mean_accepted_tokens",
        "target_tokens_per_s",
        "spec_tokens_per_s",
        "speedup",
        "cost_ratio_c",
        "verify_ratio_v",
        "predicted_speedup",
        "efficiency",
        "greedy_match",
        "per_category",
        "hf_assisted_tokens_per_s",
        "hf_generate_tokens_per_s",
        "batch_size",
    ):
        assert key in report, key
    assert report["greedy_match"] == 1.0
    assert report["machine"]["cpu_flags"] == machine.cpu_flags()  # what the figures were measured on
    assert report["machine"]["torch_threads"] == torch.get_num_threads()
    assert sorted(report["per_category"]) == ["coding", "math", "writing"]
    assert 0 < report["acceptance_rate"] < 1
    assert 1 < report["mean_accepted_tokens"] <= 4
    assert len(report["speedup_per_repeat"]) == 2
    spread = report["speedup_spread"]
    assert spread["min"] == min(report["speedup_per_repeat"]) and spread["max"] == max(report["speedup_per_repeat"])
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert report["cost_ratio_c_spread"]["min"] <= report["cost_ratio_c_spread"]["max"]
    assert report["batch_size"] == 1 and report["gamma"] == 3
    assert report["hf_drafted_per_round"] == 3.0  # transformers drafted at the same gamma, on stock models
    table = capsys.readouterr().out
    assert "overall" in table and "greedy output identical to the target's: 100% of prompts" in table
    assert f"speedup over 2 repeats: min {spread['min']:.2f}, max {spread['max']:.2f}" in table


def test_rounds_verify_lookup_guesses_unless_asked_not_to(pair, prompts, tmp_path):
    # an untrained draft is paused; rounds verify lookup guesses, counted apart from alpha
    code, out = run_eval(pair, prompts, tmp_path, "--gamma", "2", "--max-new-tokens", "32", "--guesses")
    assert code == 0
    report = json.loads(out.read_text())
    assert report["greedy_match"] == 1.0 and report["paused_share"] > 0
    assert report["guesses"] > 0 and 0 <= report["guesses_accepted"] <= report["guesses"]
    code, out = run_eval(pair, prompts, tmp_path, "--gamma", "2", "--max-new-tokens", "32", "--no-guesses")
    assert code == 0
    report = json.loads(out.read_text())
    assert report["greedy_match"] == 1.0 and report["guesses"] == 0
    # by default as many as pay by the costs the pacer measures (how many is the machine's): exact in both dtypes
    for dtype in ("bfloat16", "float32"):
        code, out = run_eval(pair, prompts, tmp_path, "--gamma", "2", "--max-new-tokens", "32", "--dtype", dtype)
        assert code == 0
        report = json.loads(out.read_text())
        assert report["greedy_match"] == 1.0 and report["guesses_accepted"] <= report["guesses"], dtype


def test_matmul_form_is_chosen_recorded_and_keeps_greedy_output(pair, prompts, tmp_path, capsys):
    # a test-sized pair fits the CPU's caches: auto keeps torch's linear without timing
    for flag, form in (("auto", "linear"), ("columns", "columns"), ("linear", "linear")):
        code, out = run_eval(pair, prompts, tmp_path, "--gamma", "2", "--dtype", "float32", "--matmul", flag)
        assert code == 0
        report = json.loads(out.read_text())
        assert report["matmul"] == form and report["greedy_match"] == 1.0, flag
        assert f"float32 on cpu, few-row products: {form} (--matmul)" in capsys.readouterr().out


def test_sampling_batched_all_turns(pair, prompts, tmp_path):
    sampled = ["--temperature", "0.8", "--top-p", "0.9", "--batch-size", "2", "--repeats", "1"]
    reports = []
    for turns in ([], ["--all-turns"]):
        code, out = run_eval(pair, prompts, tmp_path, *sampled, *turns)
        assert code == 0
        reports.append(json.loads(out.read_text()))
    first, every = reports
    assert first["greedy_match"] is None and every["greedy_match"] is None
    assert first["batch_size"] == every["batch_size"] == 2
    assert first["prompts"] == every["prompts"] == 4
    # The same seeds give the same first turns; the second turns come on top of them.
    assert 0 < first["proposed"] < every["proposed"]
    for category in ("coding", "math", "writing"):
        assert first["per_category"][category]["proposed"] < every["per_category"][category]["proposed"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gamma", "0"], "gamma must be an integer >= 1, got 0"),
        (["--confidence-threshold", "1.5"], "confidence threshold must be in [0, 1], got 1.5"),
        (["--confidence-threshold", "5"], "confidence threshold must be in [0, 1], got 5"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "1", "--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--guess-tokens", "0"], "--guess-tokens must be 1 to 64 (lookup tokens a round verifies), got 0"),
        (["--max-new-tokens", "100000"], "exceeds the model's context of 256 tokens"),
    ],
)
def test_bad_input_is_one_clear_line(pair, prompts, tmp_path, capsys, extra, message):
    code, _ = run_eval(pair, prompts, tmp_path, *extra)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_mismatched_draft_is_refused(tmp_path, prompts, capsys):
    target, _ = save_tiny_pair(tmp_path / "a", vocab=32)
    _, other = save_tiny_pair(tmp_path / "b", vocab=24)
    code = main(["eval", "--target", str(target), "--draft", str(other), "--prompts", str(prompts), "--no-progress"])
    assert code == 2
    assert "draft's tokenizer has 24 tokens and the target's has 32" in capsys.readouterr().err


def test_unknown_model_path(prompts, capsys):
    code = main(["eval", "--target", "./no/such/model", "--draft", "self", "--prompts", str(prompts)])
    assert code == 2
    assert "model not found: ./no/such/model" in capsys.readouterr().err


def test_early_exit_draft_with_and_without_kv_reuse(pair, prompts, tmp_path, capsys):
    outs = []
    # unpaced: the rounds a pacer pauses depend on the clock, and the counts below are compared exactly
    for extra in ([], ["--draft-option", "kv_reuse=false"], ["--no-kv-reuse"]):
        code, out = run_eval(pair, prompts, tmp_path, "--no-pace", *extra, draft="early_exit:1")
        assert code == 0
        outs.append(json.loads(out.read_text()))
    shown = capsys.readouterr()
    assert "--no-kv-reuse is now --draft-option kv_reuse=false" in shown.err
    assert [o["kv_reuse"] for o in outs] == [True, False, False]
    assert all(o["greedy_match"] == 1.0 for o in outs)
    assert outs[0]["proposed"] == outs[1]["proposed"] and outs[0]["accepted"] == outs[1]["accepted"]
    assert "verify_time_saved" in outs[0]
    assert "with KV reuse" in shown.out


def test_a_draft_option_is_checked_by_the_drafts_kind(pair, prompts, tmp_path, capsys):
    code, _ = run_eval(pair, prompts, tmp_path, "--draft-option", "kv_reus=false", draft="early_exit:1")
    assert code == 2
    assert (
        "--draft-option 'kv_reus' is not a decode option of early_exit drafts (known: kv_reuse); "
        "did you mean 'kv_reuse'?" in capsys.readouterr().err
    )
    code, _ = run_eval(pair, prompts, tmp_path, "--draft-option", "kv_reuse=false")
    assert code == 2
    assert "--draft-option 'kv_reuse' is not a decode option of lm drafts (known: none)" in capsys.readouterr().err
    code, _ = run_eval(pair, prompts, tmp_path, "--draft-option", "kv_reuse=3", draft="early_exit:1")
    assert code == 2
    assert "--draft-option kv_reuse must be a bool, got 3" in capsys.readouterr().err


def test_draft_vocab_cuts_the_head_and_keeps_greedy_output(pair, prompts, tmp_path, capsys):
    import shutil

    from draftsmith.specdec.draft_vocab import save_ranking

    run = tmp_path / "run"
    checkpoint = run / "checkpoint-5"
    shutil.copytree(pair[1], checkpoint)
    code, _ = run_eval((pair[0], checkpoint), prompts, tmp_path, "--draft-vocab", "12")
    assert code == 2 and "draft_vocab.json not found" in capsys.readouterr().err
    save_ranking(run, list(range(3, 32)))
    code, out = run_eval((pair[0], checkpoint), prompts, tmp_path, "--draft-vocab", "12", "--gamma", "2")
    assert code == 0
    report = json.loads(out.read_text())
    assert report["draft_vocab"] == 12
    assert report["greedy_match"] == 1.0
    assert report["proposed"] > 0
    code, _ = run_eval((pair[0], checkpoint), prompts, tmp_path, "--draft-vocab", "12", "--compare-hf")
    assert code == 2 and "leave out --draft-vocab" in capsys.readouterr().err
