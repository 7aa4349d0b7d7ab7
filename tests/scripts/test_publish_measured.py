"""The published draft is the measured draft: its gamma and head cut travel with it, and eval uses them."""

import json
import stat
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.distill import drafts
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.measure import machine
from draftsmith.specdec.measure.hf_compare import AssistedRounds, hf_generate
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.train.config import DistillConfig, load_config, load_run_config
from draftsmith.train.loop import train
from draftsmith.train.models import load_target
from draftsmith.train.publish import is_hub_id
from tests.helpers import check_card_usage

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
PROMPTS = str(ROOT / "distill" / "data" / "eval_prompts.jsonl")
MEASURE = ["--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12", "--no-progress"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny run measured with a 12-token draft vocabulary at gammas 1 and 3, its best published, and
    the run's target saved as a model folder."""
    root = tmp_path_factory.mktemp("pub")
    cfg = load_config(DistillConfig, TINY, [f"output_dir={root / 'run'}", "optim.max_steps=2", "save.steps=2"])
    run_dir = train(cfg).run_dir
    assert main(["eval-run", str(run_dir), *MEASURE, "--gammas", "1,3", "--draft-vocab", "12"]) == 0
    assert main(["publish", str(run_dir), "--out", str(root / "draft")]) == 0
    target, tokenizer = load_target(load_run_config(run_dir), torch.device("cpu"))
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return run_dir, root / "draft", root / "target"


def test_published_generation_config_carries_the_measured_gamma(published):
    run_dir, draft_dir, target_dir = published
    best = json.loads((run_dir / "best.json").read_text())
    config = json.loads((draft_dir / "generation_config.json").read_text())
    assert config["num_assistant_tokens"] == best["best_gamma"]
    assert config["num_assistant_tokens_schedule"] == "constant"
    assert config["assistant_confidence_threshold"] == 0
    # transformers drafts that many tokens per round with no extra arguments.
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    prompt, eos = [5, 9, 12, 7], frozenset({target.config.vocab_size - 1})
    with AssistedRounds(target, draft, max_length=len(prompt) + 16, eos_ids=eos) as rounds:
        hf_generate(target, prompt, 16, sampling=SamplingParams(0.0), eos_ids=eos, assistant=draft)
    assert rounds.short_rounds(best["best_gamma"]) == 0
    assert [r.drafted for r in rounds.rounds][0] == best["best_gamma"]


def test_published_folder_carries_the_measured_draft_vocabulary(published):
    run_dir, draft_dir, _ = published
    run_ranking = json.loads((run_dir / "draft_vocab.json").read_text())["token_ids"]
    assert json.loads((draft_dir / "draft_vocab.json").read_text())["token_ids"] == run_ranking[:12]


def test_eval_on_the_published_folder_uses_its_gamma_and_vocabulary(published, tmp_path):
    run_dir, draft_dir, target_dir = published
    best = json.loads((run_dir / "best.json").read_text())
    common = ["eval", "--target", str(target_dir), "--draft", str(draft_dir), *MEASURE, "--repeats", "1"]
    assert main([*common, "--json", str(tmp_path / "a.json")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["gamma"] == best["best_gamma"] and report["gamma_source"] == "generation_config.json"
    assert report["draft_vocab"] == 12
    assert report["greedy_match"] == 1.0
    assert main([*common, "--gamma", "2", "--draft-vocab", "0", "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert (report["gamma"], report["gamma_source"], report["draft_vocab"]) == (2, "--gamma", 0)


def test_model_card_carries_the_measured_results_as_metadata(published):
    run_dir, draft_dir, _ = published
    best = json.loads((run_dir / "best.json").read_text())
    report = json.loads((run_dir / "speedup_report.json").read_text())
    card = ModelCard.load(draft_dir / "README.md")
    data = card.data
    assert data.base_model is None  # the tiny target is no hub model: the text says what it is
    assert "the target is `tiny`, not a hub model" in card.text
    assert data.license == "other" and data.library_name == "transformers"
    results = {r.metric_type: r for r in data.eval_results}
    assert sorted(results) == ["acceptance_rate", "gamma", "mean_accepted_tokens", "speedup"]
    # the figures of the second measurement, taken after the checkpoint was chosen
    again = best["confirmation"]
    assert results["acceptance_rate"].metric_value == pytest.approx(again["acceptance_rate"])
    assert results["mean_accepted_tokens"].metric_value == pytest.approx(again["mean_accepted_tokens"])
    assert results["speedup"].metric_value == pytest.approx(again["speedup"])
    assert results["gamma"].metric_value == best["best_gamma"]
    assert f"at {best['speedup']:.2f}x: the fastest of several measured drafts" in card.text
    assert f"| 0.0 | {best['best_gamma']} | {again['acceptance_rate']:.3f} |" in card.text
    args = results["speedup"].metric_args
    auto = str(resolve_dtype(None, torch.device("cpu"))).removeprefix("torch.")  # eval-run ran with --dtype auto
    assert args["hardware"] == report["hardware"] and args["dtype"] == auto and args["draft_vocab"] == 12
    assert report["hardware"] == machine.describe() and report["machine"]["cpu_flags"] == machine.cpu_flags()
    assert args["temperature"] == 0.0 and args["gamma"] == best["best_gamma"]
    # The usage runs as written: the draft's own path, no gamma argument (its generation config has it).
    assert f'AutoModelForCausalLM.from_pretrained("{draft_dir.resolve()}")' in card.text
    assert "target.generate(**inputs, assistant_model=draft, max_new_tokens=128)" in card.text
    assert "num_assistant_tokens=" not in card.text
    text = check_card_usage(draft_dir, drafts.KINDS["lm"], best["best_gamma"])
    assert "the target truncated to its first 1 layers" in text  # configs/tiny.yaml's draft


def test_published_folder_has_normal_permissions(published):
    _, draft_dir, _ = published
    assert stat.S_IMODE(draft_dir.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in draft_dir.iterdir()} == {0o644}


def test_hub_ids_are_told_from_local_names(tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("tiny") and not is_hub_id(str(tmp_path)) and not is_hub_id("/abs/path/model")


def one_line_error(capsys, message):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_eval_run_that_measures_nothing_is_refused_and_writes_nothing(published, capsys):
    run_dir = published[0]
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    args = ["eval-run", str(run_dir), "--prompts", PROMPTS, "--limit", "1", "--max-new-tokens", "2", "--no-progress"]
    assert main(args) == 2
    one_line_error(capsys, "nothing was measured at --max-new-tokens 2")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert main(["eval-run", str(run_dir), "--prompts", PROMPTS, "--limit", "0", "--no-progress"]) == 2
    one_line_error(capsys, "--limit must be >= 1")


def test_publish_refuses_a_file_as_out_and_a_run_measured_nothing(published, tmp_path, capsys):
    import shutil

    run_dir = published[0]
    target = tmp_path / "a-file"
    target.write_text("x")
    assert main(["publish", str(run_dir), "--out", str(target)]) == 2
    one_line_error(capsys, f"--out {target} is a file, not a folder")
    assert target.read_text() == "x"
    # A run whose eval-run measured nothing (as older versions wrote it): best.json without a checkpoint.
    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    (broken / "best.json").write_text(json.dumps({"checkpoint": None}))
    assert main(["publish", str(broken), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, "best.json names no checkpoint (its eval-run measured nothing)")
    report = json.loads((broken / "speedup_report.json").read_text())
    report["results"]["checkpoint-2"]["0.0"]["speedup"] = float("nan")
    (broken / "speedup_report.json").write_text(json.dumps(report))
    assert main(["publish", str(broken / "checkpoint-2"), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, "has no figures for checkpoint-2")
    assert not (tmp_path / "out").exists()


def test_the_card_says_when_the_speedup_includes_lookup_guesses(published):
    from draftsmith.train.publish import _measured

    run_dir, _, _ = published
    report = json.loads((run_dir / "speedup_report.json").read_text())
    measured = next(iter(report["results"].values()))
    with_guesses = {t: {**r, "guesses_accepted": 7} for t, r in measured.items()}
    without = {t: {**r, "guesses_accepted": 0} for t, r in measured.items()}
    text = "\n".join(_measured(report, with_guesses))
    assert f"({7 * len(measured)} kept in these runs)" in text and "`draftsmith eval --no-guesses --no-pace`" in text
    assert "lookup guesses" not in "\n".join(_measured(report, without))
    # eval-run keeps the counts beside the speedup
    assert all({"guesses", "guesses_accepted", "lookup_rounds"} <= set(r) for r in measured.values())
