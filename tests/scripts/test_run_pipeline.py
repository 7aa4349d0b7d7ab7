"""eval-run, publish and quickstart on a tiny run: reports, the best checkpoint, a loadable published draft."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.specdec.decoder import target_generate
from draftsmith.specdec.measure import runs
from draftsmith.train import eval_run, models, speedup
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train
from draftsmith.train.speedup import choose_best

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
PROMPTS = str(ROOT / "distill" / "data" / "eval_prompts.jsonl")
EVAL = ["--prompts", PROMPTS, "--limit", "2", "--max-new-tokens", "12", "--gammas", "1,2", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = load_config(
        DistillConfig,
        TINY,
        [f"output_dir={out}", "optim.max_steps=4", "save.steps=2", "log.steps=2", "save.keep_last=2"],
    )
    return train(cfg).run_dir


def test_eval_run_measures_every_checkpoint_once(run_dir, capsys):
    assert main(["eval-run", str(run_dir), *EVAL, "--temperatures", "0,1"]) == 0
    first = capsys.readouterr().out
    assert first.count("measuring ") == 6  # initial, checkpoint-2, checkpoint-4 at two temperatures
    report = json.loads((run_dir / "speedup_report.json").read_text())
    assert sorted(report["results"]) == ["checkpoint-2", "checkpoint-4", "initial"]
    for name, by_temp in report["results"].items():
        assert sorted(by_temp) == ["0.0", "1.0"]
        greedy = by_temp["0.0"]
        assert greedy["greedy_match"] == 1.0
        assert greedy["best_gamma"] in (1, 2)
        predicted = greedy["predicted_by_gamma"]  # from alpha, c and v measured at the base gamma
        assert sorted(predicted) == ["1", "2"] and greedy["best_gamma"] == int(max(predicted, key=predicted.get))
        assert by_temp["1.0"]["greedy_match"] is None
        assert greedy["step"] == {"initial": 0, "checkpoint-2": 2, "checkpoint-4": 4}[name]
    best = json.loads((run_dir / "best.json").read_text())
    speedups = {n: r["0.0"]["speedup"] for n, r in report["results"].items()}
    assert best["checkpoint"] == max(speedups, key=speedups.get)
    # the best draft alone is measured once more, at its gamma, after the choice
    assert first.count("timing it once more") == 1 and f"{best['checkpoint']} is the best draft" in first
    confirmed = [n for n, r in report["results"].items() if "confirmation" in r["0.0"] or "confirmation" in r["1.0"]]
    assert confirmed == [best["checkpoint"]]
    again = best["confirmation"]
    assert again["greedy_match"] == 1.0 and again["speedup"] > 0 and 0 <= again["acceptance_rate"] <= 1
    assert (run_dir / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    table = (run_dir / "speedup_report.md").read_text()
    assert f"| {best['checkpoint']} **best** |" in table
    assert f"{best['checkpoint']}, measured again once chosen (the figure its model card gives): speedup " in table
    assert report["matmul"] == "linear"  # a test-sized target fits the caches: torch's linear, untimed
    assert f"hardware: {report['hardware']}, {report['dtype']}, few-row products: linear." in table
    assert main(["eval-run", str(run_dir), *EVAL, "--temperatures", "0,1"]) == 0
    again_out = capsys.readouterr().out
    assert "measuring " not in again_out and "timing it once more" not in again_out  # nothing measured twice


def test_drafts_measured_in_the_other_product_form_are_measured_again(run_dir, monkeypatch, capsys):
    assert main(["eval-run", str(run_dir), *EVAL]) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:  # as if this machine's timing chose the column form
        patch.setattr(eval_run, "use_column_products", lambda model, columns=None: True)
        assert main(["eval-run", str(run_dir), *EVAL]) == 0
    assert capsys.readouterr().out.count("measuring ") == 3  # initial, checkpoint-2, checkpoint-4
    assert json.loads((run_dir / "speedup_report.json").read_text())["matmul"] == "columns"
    assert main(["eval-run", str(run_dir), *EVAL]) == 0  # and back: measured again in linear
    assert capsys.readouterr().out.count("measuring ") == 3
    assert json.loads((run_dir / "speedup_report.json").read_text())["matmul"] == "linear"


class PhaseClock:
    """A ``time.perf_counter`` that ticks a fixed amount per call, so decoding times are counts of the
    clock's reads and a measurement is the same every time; ``slow`` multiplies the tick from the
    draft named ``slow_from`` on, as a machine that gets busy in the middle of an eval-run."""

    def __init__(self, slow: float = 1.0, slow_from: str | None = None):
        self.now, self.tick, self.slow, self.slow_from = 0.0, 1e-3, slow, slow_from

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def measuring(self, name: str) -> None:
        if name == self.slow_from:
            self.tick *= self.slow


def measured_under(clock: PhaseClock, run_dir, monkeypatch, capsys) -> dict:
    """eval-run of ``run_dir`` (greedy, two repeats, measured again) with ``clock`` as the time source."""
    measure = speedup.measure_draft
    names = iter(["initial", "checkpoint-2", "checkpoint-4"])

    def measure_in_phase(*args, **kwargs):
        clock.measuring(next(names))
        return measure(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(speedup, "measure_draft", measure_in_phase)
        patch.setattr(time, "perf_counter", clock)
        assert main(["eval-run", str(run_dir), *EVAL, "--repeats", "2", "--force"]) == 0
    capsys.readouterr()
    return json.loads((run_dir / "speedup_report.json").read_text())


def test_a_machine_slowing_down_mid_run_changes_no_ratio_and_no_ranking(run_dir, monkeypatch, capsys):
    calm = measured_under(PhaseClock(), run_dir, monkeypatch, capsys)
    busy = measured_under(PhaseClock(slow=4.0, slow_from="checkpoint-2"), run_dir, monkeypatch, capsys)
    assert busy["side_by_side"] is True
    for name in ("initial", "checkpoint-2", "checkpoint-4"):
        before, after = calm["results"][name]["0.0"], busy["results"][name]["0.0"]
        # Every figure is a ratio of two decoders timed in the same phase: the slowdown cancels.
        for figure in ("speedup", "cost_ratio_c", "verify_ratio_v", "predicted_speedup"):
            assert after[figure] == pytest.approx(before[figure], rel=1e-9), (name, figure)
        assert after["best_gamma"] == before["best_gamma"]
    slowed = busy["results"]["checkpoint-4"]["0.0"]["target_tokens_per_s"]
    assert slowed == pytest.approx(calm["results"]["checkpoint-4"]["0.0"]["target_tokens_per_s"] / 4, rel=1e-9)
    assert (busy["best"], busy["best_note"]) == (calm["best"], calm["best_note"])
    table = (run_dir / "speedup_report.md").read_text()
    assert "Each draft is timed side by side with the target alone" in table


def test_eval_run_times_the_target_beside_every_draft(run_dir, monkeypatch, native_bfloat16, capsys):
    calls = []
    target_generate_, speculative_generate_ = runs.target_generate, runs.speculative_generate
    monkeypatch.setattr(runs, "target_generate", lambda *a, **k: calls.append("T") or target_generate_(*a, **k))
    monkeypatch.setattr(
        runs, "speculative_generate", lambda *a, **k: calls.append("S") or speculative_generate_(*a, **k)
    )
    assert main(["eval-run", str(run_dir), *EVAL, "--temperatures", "0,1", "--repeats", "2", "--force"]) == 0
    capsys.readouterr()
    # Each pair run (warm-up, then two repeats over two prompts) alternates the two decoders.
    assert calls and calls == ["T", "S"] * (len(calls) // 2)
    report = json.loads((run_dir / "speedup_report.json").read_text())
    assert "baselines" not in report and "draft_cost_ratios" not in report
    auto = "bfloat16" if native_bfloat16 else "float32"  # what --dtype auto picks on such a CPU
    assert report["dtype"] == auto
    rates = set()
    for by_temp in report["results"].values():
        for r in by_temp.values():
            assert r["speedup_spread"]["min"] <= r["speedup"] <= r["speedup_spread"]["max"]
            assert r["measured_cost_ratio"]["cost_ratio_c"] == r["at_base_gamma"]["cost_ratio_c"]
            # The base gamma's run drafts every round (what theory predicts from); the best gamma's is
            # paced as a user's decoding is, and says how many sequence rounds it did not draft.
            assert r["at_base_gamma"]["paused_share"] == 0.0 and 0.0 <= r["paused_share"] < 1.0
            rates.add(r["target_tokens_per_s"])
    assert len(rates) == 6  # each draft and temperature timed its own target runs
    greedy = {name: r["0.0"] for name, r in report["results"].items()}
    assert (report["best"], report["best_note"]) == choose_best(greedy)
    table = (run_dir / "speedup_report.md").read_text()
    for name, r in greedy.items():
        low, high = r["speedup_spread"]["min"], r["speedup_spread"]["max"]
        assert low == high or f"{r['speedup']:.2f} ({low:.2f}-{high:.2f})" in table, name


def test_eval_run_bad_input(tmp_path, run_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text(yaml.safe_dump({"target": "tiny"}))
    assert main(["eval-run", str(empty), *EVAL]) == 2
    assert "has no checkpoints yet" in capsys.readouterr().err
    assert main(["eval-run", str(tmp_path), *EVAL]) == 2
    assert "is not a distillation run folder" in capsys.readouterr().err


def test_publish_writes_a_loadable_draft_with_a_model_card(tmp_path, run_dir, capsys):
    main(["eval-run", str(run_dir), *EVAL])
    out = tmp_path / "draft"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0  # the run folder stands for its best
    best = json.loads((run_dir / "best.json").read_text())["checkpoint"]
    published = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(run_dir / best)
    prompts = [[3, 20, 30, 4]]
    assert target_generate(published, prompts, 10)[0] == target_generate(original, prompts, 10)[0]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in front and front["library_name"] == "transformers"  # tiny is no hub id
    assert {"speculative-decoding", "draft-model"} <= set(front["tags"])
    assert "assistant_model=draft" in card and "speculative_config" in card
    assert "| 0.0 |" in card  # the measured row

    assert main(["publish", str(run_dir / best), "--out", str(out)]) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    (run_dir / "checkpoint-2" / "model.safetensors").rename(tmp_path / "moved")
    try:
        assert main(["publish", str(run_dir / "checkpoint-2"), "--out", str(tmp_path / "x")]) == 2
        assert "is missing model.safetensors" in capsys.readouterr().err
    finally:
        (tmp_path / "moved").rename(run_dir / "checkpoint-2" / "model.safetensors")


def test_a_published_draft_carries_its_acceptance_profile_and_provenance(tmp_path, run_dir, capsys):
    main(["eval-run", str(run_dir), *EVAL])
    out = tmp_path / "draft"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    report = json.loads((run_dir / "speedup_report.json").read_text())
    best = json.loads((run_dir / "best.json").read_text())["checkpoint"]
    profile = json.loads((out / "draftsmith_profile.json").read_text())
    card = speedup.card_figures(report["results"][best]["0.0"])  # the figures the card gives
    at = profile["acceptance"]["0.0"]
    assert (at["gamma"], at["acceptance_rate"], at["speedup"]) == (
        card["best_gamma"],
        card["acceptance_rate"],
        card["speedup"],
    )
    assert at["acceptance_by_position"] == card["acceptance_by_position"] and len(at["acceptance_by_position"]) >= 1
    # the two prompts measured: one category each (eval_prompts.jsonl)
    assert len(at["by_category"]) >= 1 and all(0 <= c["acceptance_rate"] <= 1 for c in at["by_category"].values())
    made = profile["provenance"]
    assert made["target"] == "tiny" and len(made["target_weights_sha256"]) == 64 and made["checkpoint"] == best
    assert made["config"]["optim.max_steps"] == 4 and made["draftsmith_version"]
    assert profile["measured_under"]["max_new_tokens"] == 12 and profile["measured_under"]["hardware"]
    text = (out / "README.md").read_text()
    assert "## Acceptance profile" in text and "![acceptance by draft position](acceptance.png)" in text
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    # measured against another target, it says so, naming both
    other = tmp_path / "other-target"
    shutil.copytree(run_dir / best, other)  # a model folder with its tokenizer: another target
    common = ["eval", "--draft", str(out), *EVAL[:4], "--max-new-tokens", "4", "--repeats", "1", "--no-progress"]
    assert main([*common, "--target", str(other)]) == 0
    assert f"was distilled and measured for the target tiny, not {other}" in capsys.readouterr().err


def test_push_without_credentials_keeps_the_local_folder(tmp_path, run_dir, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    out = tmp_path / "pushed"
    code = main(["publish", str(run_dir / "checkpoint-4"), "--out", str(out), "--push-to-hub", "me/draft"])
    assert code == 2
    assert "no Hugging Face credentials" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file()


def test_quickstart_end_to_end_on_the_tiny_config(tmp_path, capsys, monkeypatch):
    loads = []
    load_target = models.load_target
    monkeypatch.setattr(models, "load_target", lambda *a, **k: loads.append(a[1:]) or load_target(*a, **k))
    code = main(
        [
            "quickstart",
            "--output-dir",
            str(tmp_path / "qs"),
            "--config",
            TINY,
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--gammas",
            "1,2",
            "optim.max_steps=4",
            "save.steps=2",
            "log.steps=2",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    best = json.loads((tmp_path / "qs" / "run" / "best.json").read_text())["checkpoint"]
    assert f"after ({best})" in out and "measured speedup" in out
    assert "greedy output identical                     100%" in out
    # The tiny run's held-out alpha: 0.634 untrained, 0.721 after these 4 steps.
    assert re.search(r"held-out sum min\(p,q\) +0\.634 +0\.721\n", out), out
    assert (tmp_path / "qs" / "draft" / "README.md").is_file()
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "qs" / "draft")
    assert draft.config.num_hidden_layers == 1  # configs/tiny.yaml truncates to one layer
    # The three stages share one target: training loads it, eval-run and publish reuse it.
    assert loads == [(torch.device("cpu"),)]


def test_early_exit_draft_trains_evaluates_with_kv_reuse_and_is_not_published(tmp_path, capsys):
    cfg = load_config(
        DistillConfig,
        TINY,
        [
            f"output_dir={tmp_path / 'ee'}",
            "draft.kind=early_exit",
            "draft.layers=2",
            "optim.max_steps=4",
            "save.steps=4",
            "log.steps=2",
        ],
    )
    run = train(cfg).run_dir
    ckpt = run / "checkpoint-4"
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "draftsmith.json",
        "early_exit.json",
        "exit_head.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((ckpt / "early_exit.json").read_text()) == {"target": "tiny", "k": 2, "adapter": True}
    alpha = [json.loads(line)["acceptance_rate"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The target's own first 2 layers plus an exit head start close to it and train closer (0.748 -> 0.811).
    assert 0.7 < alpha[0] < 0.78 and alpha[-1] > alpha[0] + 0.04

    assert main(["eval-run", str(run), *EVAL]) == 0
    report = json.loads((run / "speedup_report.json").read_text())
    assert report["results"]["checkpoint-4"]["0.0"]["greedy_match"] == 1.0

    assert main(["publish", str(ckpt), "--out", str(tmp_path / "pub")]) == 2
    assert "is an early-exit draft" in capsys.readouterr().err


def test_drafts_measured_with_other_draft_options_are_measured_again(tmp_path, capsys):
    out = tmp_path / "early-exit"
    items = [f"output_dir={out}", "draft.kind=early_exit", "optim.max_steps=2", "save.steps=2", "log.steps=2"]
    run_dir = train(load_config(DistillConfig, TINY, items)).run_dir
    assert main(["eval-run", str(run_dir), *EVAL]) == 0
    assert capsys.readouterr().out.count("measuring ") == 2  # initial, checkpoint-2
    assert main(["eval-run", str(run_dir), *EVAL, "--draft-option", "kv_reuse=false"]) == 0
    assert capsys.readouterr().out.count("measuring ") == 2  # not the KV-reusing figures again
    assert json.loads((run_dir / "speedup_report.json").read_text())["draft_options"] == {"kv_reuse": False}
    assert main(["eval-run", str(run_dir), *EVAL, "--draft-option", "kv_reuse=false"]) == 0
    assert capsys.readouterr().out.count("measuring ") == 0
