"""Token trees through the commands: ``eval --tree``, ``eval-run --trees`` choosing between chains and
trees by measured speedup, and ``publish`` carrying the chosen shape to ``eval --draft FOLDER``."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from draftsmith.cli import main
from draftsmith.train.config import DistillConfig, load_config, load_run_config
from draftsmith.train.loop import train
from draftsmith.train.models import load_target
from tests.helpers import save_tiny_pair

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
PROMPTS = str(ROOT / "distill" / "data" / "eval_prompts.jsonl")
MEASURE = ["--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12", "--no-progress"]
TREES = ["2", "3,1"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"question_id": i, "category": cat, "turns": [f"w{3 + i} w{10 + i}"]}
        for i, cat in enumerate(["writing", "writing", "math", "coding"])
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_eval(target, draft, prompts, out, *extra) -> int:
    common = ["eval", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    return main([*common, "--max-new-tokens", "16", "--repeats", "1", "--no-progress", "--json", str(out), *extra])


def one_line_error(capsys, message):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_eval_tree_keeps_the_targets_output_and_reports_the_tree_pass(pair, prompts, tmp_path, capsys):
    target, draft = pair
    assert run_eval(target, draft, prompts, tmp_path / "fixed.json", "--tree", "3,2,1,1") == 0
    report = json.loads((tmp_path / "fixed.json").read_text())
    assert (report["tree"], report["tree_source"]) == ("3,2,1,1", "--tree")
    assert report["greedy_match"] == 1.0
    # At most the shape's 3 + 6 + 6 + 6 nodes a round (fewer only where the token limit cuts the depth).
    assert 15 < report["nodes_per_round"] <= 21
    assert 1 < report["mean_accepted_tokens"] <= 5
    assert report["cost_ratio_c"] > 0 and report["verify_ratio_v"] > 0 and report["predicted_speedup"] > 0
    assert f"tree=3,2,1,1 ({report['nodes_per_round']:.1f} nodes per round)" in capsys.readouterr().out

    assert run_eval(target, draft, prompts, tmp_path / "dynamic.json", "--tree", "3,2,2,1:8") == 0
    dynamic = json.loads((tmp_path / "dynamic.json").read_text())
    assert dynamic["tree"] == "3,2,2,1:8" and dynamic["greedy_match"] == 1.0
    assert 4 <= dynamic["nodes_per_round"] <= 8


def test_a_draft_equal_to_the_target_fills_the_fixed_shape_every_round(pair, prompts, tmp_path):
    target, _ = pair
    assert run_eval(target, target, prompts, tmp_path / "r.json", "--tree", "3,2,1,1") == 0
    report = json.loads((tmp_path / "r.json").read_text())
    # 16 tokens: the prefill's, then three rounds each verifying all 21 nodes and accepting the full
    # depth plus the target's token (5), none cut by the limit (15 -> 10 -> 5 -> 0 left).
    assert report["nodes_per_round"] == 21.0
    assert report["mean_accepted_tokens"] == 5.0
    assert report["acceptance_rate"] == pytest.approx(4 / 21)
    assert report["greedy_match"] == 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tree", "3,x"], "--tree takes branching per depth, e.g. 3,2,1,1"),
        (["--tree", ""], "--tree takes branching per depth"),
        (["--tree", "3,0"], "tree branching must be a list of counts >= 1, got [3, 0]"),
        (["--tree", "3,2:-1"], "--tree 3,2:-1: a dynamic tree's budget must be 1 to 8"),
        (["--tree", "3,2", "--batch-size", "2"], "--tree decodes one prompt at a time"),
        (["--tree", "3", "--confidence-threshold", "0.5"], "--confidence-threshold cuts chains"),
    ],
)
def test_bad_tree_settings_are_one_line_errors(pair, prompts, tmp_path, capsys, extra, message):
    assert run_eval(*pair, prompts, tmp_path / "r.json", *extra) == 2
    one_line_error(capsys, message)
    assert not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    """A tiny run measured by eval-run at gammas 1 and 2 and the trees ``TREES``."""
    root = tmp_path_factory.mktemp("trees")
    cfg = load_config(DistillConfig, TINY, [f"output_dir={root / 'run'}", "optim.max_steps=2", "save.steps=2"])
    run_dir = train(cfg).run_dir
    assert main(["eval-run", str(run_dir), *MEASURE, "--gammas", "1,2", "--trees", *TREES]) == 0
    target, tokenizer = load_target(load_run_config(run_dir), torch.device("cpu"))
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return run_dir, root / "target"


def test_eval_run_measures_each_tree_and_chooses_by_measured_speedup(measured_run):
    run_dir, _ = measured_run
    report = json.loads((run_dir / "speedup_report.json").read_text())
    assert report["trees"] == TREES
    for name in ("initial", "checkpoint-2"):
        result = report["results"][name]["0.0"]
        trees = result["trees"]
        assert sorted(trees) == TREES
        for shape, nodes in (("2", 2), ("3,1", 6)):
            assert trees[shape]["greedy_match"] == 1.0
            assert 0 < trees[shape]["nodes_per_round"] <= nodes
            assert trees[shape]["speedup"] > 0 and trees[shape]["cost_ratio_c"] > 0
        fastest = max(trees, key=lambda s: trees[s]["speedup"])
        expected = fastest if trees[fastest]["speedup"] > result["speedup"] else None
        assert result["best_tree"] == expected
    best = json.loads((run_dir / "best.json").read_text())
    assert best["best_tree"] == report["results"][best["checkpoint"]]["0.0"]["best_tree"]
    table = (run_dir / "speedup_report.md").read_text()
    assert "Token trees measured: 2, 3,1" in table and "fastest tree: speedup, nodes per round |" in table


def test_eval_run_refuses_a_bad_tree_shape(measured_run, capsys):
    run_dir, _ = measured_run
    assert main(["eval-run", str(run_dir), *MEASURE, "--trees", "3,,1"]) == 2
    one_line_error(capsys, "--trees takes branching per depth")


def chosen(run_dir: Path, tmp_path: Path, tree: str | None) -> Path:
    """A copy of the measured run whose report chose ``tree`` (a measured shape) or the chain for every draft."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    report = json.loads((copy / "speedup_report.json").read_text())
    for by_temp in report["results"].values():
        by_temp["0.0"]["best_tree"] = tree
    (copy / "speedup_report.json").write_text(json.dumps(report))
    return copy


def test_publish_carries_a_chosen_tree_and_eval_on_the_folder_decodes_with_it(measured_run, tmp_path, capsys):
    run_dir, target = measured_run
    run = chosen(run_dir, tmp_path, "3,1")
    assert main(["publish", str(run / "checkpoint-2"), "--out", str(tmp_path / "draft")]) == 0
    gamma = json.loads((run / "speedup_report.json").read_text())["results"]["checkpoint-2"]["0.0"]["best_gamma"]
    carried = json.loads((tmp_path / "draft" / "generation_config.json").read_text())["draftsmith"]
    assert carried["tree"] == "3,1"  # beside the gamma per batch size every published folder carries
    assert set(carried) == {"tree", "num_speculative_tokens_per_batch_size"}
    # transformers' assisted generation still drafts the measured chain.
    config = GenerationConfig.from_pretrained(tmp_path / "draft")
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (gamma, "constant")
    assert "shape 3,1" in (tmp_path / "draft" / "README.md").read_text()

    common = ["eval", "--target", str(target), "--draft", str(tmp_path / "draft"), *MEASURE, "--repeats", "1"]
    assert main([*common, "--json", str(tmp_path / "a.json")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert (report["tree"], report["tree_source"], report["gamma"]) == ("3,1", "generation_config.json", gamma)
    assert report["greedy_match"] == 1.0 and 0 < report["nodes_per_round"] <= 6
    assert main([*common, "--gamma", "2", "--json", str(tmp_path / "b.json")]) == 0  # a chain asked for
    report = json.loads((tmp_path / "b.json").read_text())
    assert (report["tree"], report["tree_source"], report["gamma"]) == (None, None, 2)
    capsys.readouterr()


def test_publish_of_a_chain_choice_writes_no_tree(measured_run, tmp_path):
    run_dir, target = measured_run
    run = chosen(run_dir, tmp_path, None)
    assert main(["publish", str(run / "checkpoint-2"), "--out", str(tmp_path / "draft")]) == 0
    carried = json.loads((tmp_path / "draft" / "generation_config.json").read_text())["draftsmith"]
    assert set(carried) == {"num_speculative_tokens_per_batch_size"}  # no tree
    common = ["eval", "--target", str(target), "--draft", str(tmp_path / "draft"), *MEASURE, "--repeats", "1"]
    assert main([*common, "--json", str(tmp_path / "a.json")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert (report["tree"], report["tree_source"], report["gamma_source"]) == (None, None, "generation_config.json")


def test_a_chosen_tree_is_measured_again_as_the_tree(measured_run, tmp_path, capsys):
    run_dir, _ = measured_run
    run = chosen(run_dir, tmp_path, "3,1")
    report = json.loads((run / "speedup_report.json").read_text())
    for by_temp in report["results"].values():
        by_temp["0.0"].pop("confirmation", None)
    (run / "speedup_report.json").write_text(json.dumps(report))
    assert main(["eval-run", str(run), *MEASURE, "--gammas", "1,2", "--trees", *TREES]) == 0
    assert "timing it once more" in capsys.readouterr().out
    report = json.loads((run / "speedup_report.json").read_text())
    best = report["results"][json.loads((run / "best.json").read_text())["checkpoint"]]["0.0"]
    again = best["confirmation"]
    # the tree it was chosen with ran again (a chain's round has no tree nodes), not the chain
    assert again["tree"] == "3,1" and 1 < again["nodes_per_round"] <= 6 and again["greedy_match"] == 1.0
    table = (run / "speedup_report.md").read_text()
    assert (
        f"as token tree 3,1, alpha {again['acceptance_rate']:.3f}, against {best['trees']['3,1']['speedup']:.2f}"
        in table
    )
