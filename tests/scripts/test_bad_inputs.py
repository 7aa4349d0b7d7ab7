"""Bad input to every command, as a careless user gives it: exit 2 with one line on stderr and no traceback,
before any model loads, and every folder of the user's left byte for byte as it was.

The commands run in-process (``draftsmith.cli.main``) on a tiny run trained once for the module; the
paths in a case's arguments are filled in from ``world`` (``{run}``, ``{user}``, ...).
"""

import json
import pickle
import shutil
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.distill import teacher_cache
from draftsmith.distill.drafts import dflash
from draftsmith.distill.drafts.eagle3 import EagleHead, write_layout
from draftsmith.distill.drafts.early_exit import EarlyExitDraft
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from tests.helpers import save_tiny_pair, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).parents[2]
PROMPTS = str(ROOT / "distill" / "data" / "eval_prompts.jsonl")
MEASURE = ["--prompts", PROMPTS, "--limit", "1", "--max-new-tokens", "4", "--gammas", "1"]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny run (initial/, checkpoint-2), a draft published from it, a user's own folder and file, a tiny
    (target, draft) pair saved to disk, datasets that may not train, and files a careless user passes."""
    root = tmp_path_factory.mktemp("world")
    overrides = [
        "optim.max_steps=2",
        "save.steps=2",
        "log.steps=2",
        "data.heldout=2",
        "data.max_samples=10",
        "generate.max_new_tokens=8",
    ]
    cfg = load_config(DistillConfig, config_path("tiny"), [f"output_dir={root / 'run'}", *overrides])
    run = train(cfg).run_dir
    assert main(["publish", str(run / "checkpoint-2"), "--out", str(root / "pub")]) == 0
    paths = {"root": root, "run": run, "ckpt": run / "checkpoint-2", "pub": root / "pub"}
    paths["user"] = root / "user"
    paths["user"].mkdir()
    (paths["user"] / "notes.txt").write_text("my notes\n")
    paths["file"] = root / "a-file.txt"
    paths["file"].write_text("not a folder\n")
    paths["under_file"] = paths["file"] / "sub"  # cannot be created, whoever runs the test
    paths["folder"] = root / "a-folder"
    paths["folder"].mkdir()
    paths["target"], paths["draft"] = save_tiny_pair(root / "pair", max_positions=1024)  # room for 256 new tokens
    paths["badjson"] = root / "bad.jsonl"
    paths["badjson"].write_text('{"prompt": "one"}\n{"prompt": "two",\n')
    paths["empty_yaml"] = root / "empty.yaml"
    paths["empty_yaml"].write_text("# nothing set\n")
    paths["dup_yaml"] = root / "dup.yaml"
    paths["dup_yaml"].write_text("target: tiny\nlr: 0.01\nmax_steps: 2\nlr: 0.02\n")
    paths["nested_yaml"] = root / "nested.yaml"
    paths["nested_yaml"].write_text("target: tiny\ntiny_target: {num_layers: 2}\n")
    damaged(paths)
    for name, complete, target in (("incomplete", False, "tiny"), ("other_target", True, "smollm2-135m-instruct")):
        paths[name] = root / name
        paths[name].mkdir()
        manifest = {"settings": {"target": target}, "complete": complete}
        (paths[name] / "manifest.json").write_text(json.dumps(manifest))
    return paths


def damaged(paths: dict) -> None:
    """Folders and files as a careless copy or a full disk leaves them, each beside a sound original."""
    root = paths["root"]
    paths["cut_config"] = root / "cut-config"
    shutil.copytree(paths["draft"], paths["cut_config"])
    text = (paths["cut_config"] / "config.json").read_text()
    (paths["cut_config"] / "config.json").write_text(text[: len(text) // 2])
    paths["cut_weights"] = root / "cut-weights"
    shutil.copytree(paths["ckpt"], paths["cut_weights"])
    weights = (paths["cut_weights"] / "model.safetensors").read_bytes()
    (paths["cut_weights"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    paths["more_layers"] = root / "more-layers"  # a config of 30 layers over weights of 2
    shutil.copytree(paths["draft"], paths["more_layers"])
    config = json.loads((paths["more_layers"] / "config.json").read_text())
    (paths["more_layers"] / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 30}))
    other = tiny_llama(vocab=32, layers=4, hidden=64)  # a target of other sizes than the pair's
    paths["eagle_of_another"] = root / "eagle-of-another"
    write_layout(EagleHead.from_target(other, (0, 1, 3)), paths["eagle_of_another"], 3, target_name="other-tiny")
    paths["exit_of_another"] = root / "exit-of-another"
    EarlyExitDraft(other, 1).save(paths["exit_of_another"], "other-tiny")
    for folder in (paths["eagle_of_another"], paths["exit_of_another"]):
        tiny_tokenizer(32).save_pretrained(folder)
    paths["empty_prompts"] = root / "empty.jsonl"
    paths["empty_prompts"].write_text("")
    paths["hub_layout"] = root / "hub-layout"  # a dataset folder without manifest.json
    (paths["hub_layout"] / "data").mkdir(parents=True)
    (paths["hub_layout"] / "data" / "train-00000.parquet").write_bytes(b"PAR1")
    (paths["hub_layout"] / "README.md").write_text("---\nconfigs: []\n---\n")
    untrusted(paths)


class Payload:
    """A pickle that, loaded by an unpickler that runs code, writes a file beside the world's folders."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "a pickle's code ran\n"))


def untrusted(paths: dict) -> None:
    """Folders whose files would run code, or read rows outside them, if taken at their word."""
    root = paths["root"]
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path:\n    - {}\n"
    paths["copied_without_manifest"] = root / "copied-without-manifest"  # a draftsmith data folder, but
    (paths["copied_without_manifest"] / "data").mkdir(parents=True)
    (paths["copied_without_manifest"] / "data" / "train-1a2b3c4d-r0-00000.parquet").write_bytes(b"PAR1")
    text = card.format("data/train-1a2b3c4d-r0-00000.parquet") + "draftsmith:\n  target: tiny\n---\n"
    (paths["copied_without_manifest"] / "README.md").write_text(text)
    paths["card_outside"] = root / "card-outside"  # a built dataset whose card lists a file above it
    (paths["card_outside"] / "data").mkdir(parents=True)
    manifest = {"settings": {"target": "tiny"}, "complete": True}
    (paths["card_outside"] / "manifest.json").write_text(json.dumps(manifest))
    (paths["card_outside"] / "README.md").write_text(card.format("../a-file.txt") + "---\n")
    paths["pickled_mask"] = root / "pickled-mask"  # a DFlash draft whose mask_embedding.pt is a payload
    target = AutoModelForCausalLM.from_pretrained(paths["target"])
    dflash.write_layout(dflash.DFlashDraft(target, 1, [0], 4, 5), paths["pickled_mask"], target_name="tiny")
    tiny_tokenizer(32).save_pretrained(paths["pickled_mask"])
    payload = pickle.dumps(Payload(root / "payload-ran.txt"))
    (paths["pickled_mask"] / dflash.MASK_EMBEDDING).write_bytes(payload)


def refused(argv: list[str], world: dict, capsys) -> str:
    """Run ``draftsmith ARGV`` (placeholders filled from ``world``); assert it refused in one line; the line."""
    code = main([arg.format(**world) for arg in argv])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


# The three cases that destroyed data, and their neighbours: refused, every folder unchanged.
DATA_SAFETY = [
    ("publish_over_its_own_run", ["publish", "{ckpt}", "--out", "{run}", "--overwrite"], "holds the checkpoint"),
    ("publish_over_its_checkpoint", ["publish", "{ckpt}", "--out", "{ckpt}", "--overwrite"], "is the checkpoint"),
    ("publish_into_another_checkpoint", ["publish", "{ckpt}", "--out", "{run}/initial", "--overwrite"], "its run"),
    ("publish_inside_its_run", ["publish", "{ckpt}", "--out", "{run}/draft"], "lies inside its run"),
    ("publish_over_the_run_holding_it", ["publish", "{run}/initial", "--out", "{root}", "--overwrite"], "holds the"),
    ("publish_over_a_users_folder", ["publish", "{ckpt}", "--out", "{user}", "--overwrite"], "not written by"),
    ("publish_over_a_dataset", ["publish", "{ckpt}", "--out", "{incomplete}", "--overwrite"], "is a dataset"),
    ("publish_over_a_published_draft", ["publish", "{ckpt}", "--out", "{pub}"], "pass --overwrite to replace it"),
    (
        "quickstart_over_a_users_draft_folder",
        ["quickstart", "--output-dir", "{quick}", "--config", "tiny", *MEASURE],
        "/draft is not empty and was not written by draftsmith publish",
    ),
    ("distill_into_a_users_folder", ["distill", "--config", "tiny", "output_dir={user}"], "holds no run"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in DATA_SAFETY], ids=[c[0] for c in DATA_SAFETY])
def test_data_safety_refusals_leave_every_folder_byte_identical(world, tmp_path, capsys, argv, message):
    quick = tmp_path / "quick"
    (quick / "draft").mkdir(parents=True)
    (quick / "draft" / "model-notes.md").write_text("the user's own file\n")
    before = snapshot(world["root"]), snapshot(quick)
    started = time.perf_counter()
    assert message in refused(argv, {**world, "quick": quick}, capsys)
    assert time.perf_counter() - started < 10  # refused before any training or model load
    assert (snapshot(world["root"]), snapshot(quick)) == before


def test_overwrite_replaces_a_published_draft_but_not_a_file_added_to_it(world, tmp_path, capsys):
    out = tmp_path / "pub"
    assert main(["publish", str(world["run"] / "initial"), "--out", str(out)]) == 0
    marker = json.loads((out / ".draftsmith-published").read_text())
    assert marker["checkpoint"] == str((world["run"] / "initial").resolve())
    assert "model.safetensors" in marker["files"] and "README.md" in marker["files"]
    (out / "mine.txt").write_text("added by the user\n")
    before = snapshot(out)
    assert "also holds mine.txt; move it out first" in refused(
        ["publish", "{ckpt}", "--out", str(out), "--overwrite"], world, capsys
    )
    assert snapshot(out) == before
    (out / "mine.txt").unlink()
    initial_weights = (out / "model.safetensors").read_bytes()
    assert main(["publish", str(world["ckpt"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() == (world["ckpt"] / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() != initial_weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"]  # nothing left aside


def test_overwrite_fills_an_empty_folder(world, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["publish", str(world["ckpt"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() == (world["ckpt"] / "model.safetensors").read_bytes()


DATA = ["data", "--target", "{target}", "--output", "{root}/new-data", "--no-progress"]
BUILTIN = [*DATA, "--prompts", "builtin"]
DISTILL = ["distill", "--config", "tiny"]
EVAL_RUN = ["eval-run", "{run}", "--no-progress"]
QUICK = ["quickstart", "--output-dir", "{root}/quick-new", "--config", "tiny"]

# (id, arguments, what the one line says): every command, before anything loads.
CASES = [
    # draftsmith data
    ("data_output_is_a_file", [*DATA[:3], "--output", "{file}", "--prompts", "builtin"], "is a file, not a folder"),
    ("data_output_under_a_file", [*DATA[:3], "--output", "{under_file}"], "nothing can be written under it"),
    ("data_output_is_a_users_folder", [*DATA[:3], "--output", "{user}", "--prompts", "builtin"], "not a draftsmith"),
    (
        "data_output_of_another_target",
        [*DATA[:3], "--output", "{other_target}", "--prompts", "builtin"],
        "built with",
    ),
    ("data_greedy_with_top_p", [*BUILTIN, "--temperature", "0", "--top-p", "0.9"], "--top-p applies to sampled"),
    ("data_greedy_with_top_k", [*BUILTIN, "--temperature", "0", "--top-k", "5"], "--top-k applies to sampled"),
    ("data_greedy_with_samples", [*BUILTIN, "--temperature", "0", "--samples-per-prompt", "2"], "--samples-per-prompt"),
    ("data_prompt_temperature_without_self", [*BUILTIN, "--prompt-temperature", "0.5"], "self-written prompts"),
    ("data_any_prompt_text_without_self", [*BUILTIN, "--any-prompt-text"], "--any-prompt-text applies to self"),
    ("data_teacher_cache_zero", [*BUILTIN, "--teacher-cache", "0"], "--teacher-cache must be 1 to the target's"),
    ("data_teacher_cache_above_vocab", [*BUILTIN, "--teacher-cache", "100"], "vocabulary (32), got 100"),
    ("data_batch_size_zero", [*BUILTIN, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("data_shard_rows_zero", [*BUILTIN, "--shard-rows", "0"], "--shard-rows must be >= 1, got 0"),
    ("data_max_new_tokens_zero", [*BUILTIN, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("data_engine_url_without_vllm", [*BUILTIN, "--engine-url", "http://127.0.0.1:9"], "applies to --engine vllm"),
    ("data_self_without_a_count", [*DATA, "--prompts", "self"], "--prompts self needs --num-prompts N"),
    ("data_count_of_a_prompt_file", [*BUILTIN, "--num-prompts", "5"], "cap a prompt source with --max-samples"),
    ("data_prompts_with_bad_json", [*DATA, "--prompts", "{badjson}"], "bad.jsonl, line 2: not valid JSON"),
    (
        "data_prompts_folder",
        [*DATA, "--prompts", "{folder}"],
        "a-folder is a folder but neither a draftsmith data folder",
    ),
    ("data_prompts_empty_file", [*DATA, "--prompts", "{empty_prompts}"], "empty.jsonl is empty; give a file with one"),
    ("data_prompts_dev_null", [*DATA, "--prompts", "/dev/null"], "/dev/null is not a regular file (a device or pipe)"),
    ("data_prompts_folder_without_manifest", [*DATA, "--prompts", "{hub_layout}"], "neither a draftsmith data folder"),
    ("data_max_new_tokens_beyond_context", [*BUILTIN, "--max-new-tokens", "1000000000"], "context (1024 tokens)"),
    ("data_temperature_inf", [*BUILTIN, "--temperature", "inf"], "--temperature must be a finite number >= 0"),
    ("data_option_given_twice", [*BUILTIN, "--seed", "1", "--seed", "2"], "--seed is given twice; give it once"),
    (
        "data_kv_cache_without_vllm",
        [*BUILTIN, "--engine-kv-cache-gib", "4"],
        "--engine-kv-cache-gib applies to --engine",
    ),
    ("data_unknown_alias", ["data", "--target", "smollm2", "--output", "{root}/x", "--prompts", "builtin"], "alias"),
    (
        "data_hidden_layers_past_the_target",
        [*BUILTIN, "--teacher-cache", "8", "--hidden-layers", "99"],
        "--hidden-layers 99: this target has 2 layers; give layers 0 (the embeddings) to 2 (its normed output)",
    ),
    (
        "data_hidden_layers_past_the_target_in_vllm",
        [*BUILTIN, "--engine", "vllm", "--teacher-cache", "8", "--hidden-layers", "99"],
        "--hidden-layers 99: this target has 2 layers",
    ),
    (
        "data_store_larger_than_the_disk",  # the test's disk has 20 MB free; up to 44 MB asked for
        [*BUILTIN, "--teacher-cache", "4", "--hidden-layers", "0,1,2", "--max-length", "4096"],
        "--hidden-layers: the feature store of 56 rows may take up to 44.4 MB (4096 positions a row) but the disk",
    ),
    (
        "data_tensor_parallel_zero",
        [*BUILTIN, "--engine", "vllm", "--tensor-parallel-size", "0"],
        "--tensor-parallel-size must be >= 1 (GPUs or model copies), got 0",
    ),
    ("data_data_parallel_zero", [*BUILTIN, "--engine", "vllm", "--data-parallel-size", "0"], "must be >= 1"),
    (
        "data_tensor_parallel_without_vllm",
        [*BUILTIN, "--tensor-parallel-size", "2"],
        "--tensor-parallel-size applies to --engine vllm (the server it starts); leave it out",
    ),
    (
        "data_max_length_zero",
        [*BUILTIN, "--teacher-cache", "4", "--hidden-layers", "2", "--max-length", "0"],
        "--max-length must be >= 1 (tokens a stored row is cut to), got 0",
    ),
    (
        "data_prompts_copied_without_manifest",
        [*DATA, "--prompts", "{copied_without_manifest}"],
        "copied-without-manifest was built by draftsmith data but has no manifest.json (copied without it?)",
    ),
    (
        "data_output_copied_without_manifest",
        [*DATA[:3], "--output", "{copied_without_manifest}", "--prompts", "builtin"],
        "copied-without-manifest was built by draftsmith data but has no manifest.json",
    ),
    (
        "data_output_card_lists_a_file_outside",
        [*DATA[:3], "--output", "{card_outside}", "--prompts", "builtin"],
        "card-outside/README.md lists the data file ../a-file.txt, outside the folder",
    ),
    # draftsmith distill
    ("distill_without_a_config", ["distill"], "distill needs --config: a YAML file, or a shipped config (smollm2"),
    ("distill_empty_config", ["distill", "--config", "{empty_yaml}"], "empty.yaml is empty; a config says what"),
    ("distill_duplicate_yaml_key", ["distill", "--config", "{dup_yaml}"], "key 'lr' appears twice (lines 2 and 4)"),
    ("distill_unknown_tiny_target_key", ["distill", "--config", "{nested_yaml}"], "did you mean num_hidden_layers?"),
    ("distill_unknown_nested_override", [*DISTILL, "tiny_target={{hiden_size: 8}}"], "field 'hiden_size'"),
    (
        "distill_unknown_column_map_field",
        [*DISTILL, "data.column_map={{promt: q}}"],
        "data.column_map: unknown field 'promt'",
    ),
    ("distill_misspelled_key", [*DISTILL, "lrr=0.1"], "overrides: unknown config key 'lrr' (did you mean optim.lr?)"),
    ("distill_override_given_twice", [*DISTILL, "optim.lr=0.1", "optim.lr=0.2"], "override optim.lr= is given twice"),
    ("distill_config_not_found", ["distill", "--config", "tiyn"], "config not found: tiyn (give a YAML file"),
    ("distill_config_is_a_folder", ["distill", "--config", "{folder}"], "a-folder is a folder; give a YAML file"),
    ("distill_output_dir_under_a_file", [*DISTILL, "output_dir={under_file}"], "nothing can be written under it"),
    ("distill_output_dir_is_a_file", [*DISTILL, "output_dir={file}"], "is an existing file; give a folder path"),
    ("distill_incomplete_dataset", [*DISTILL, "data.dataset={incomplete}"], "or set data.allow_incomplete=true"),
    ("distill_dataset_of_another_target", [*DISTILL, "data.dataset={other_target}"], "holds answers of target"),
    ("distill_gen_batch_size_zero", [*DISTILL, "generate.batch_size=0"], "generate.batch_size must be >= 1, got 0"),
    ("distill_eval_limit_zero", [*DISTILL, "eval.speedup_steps=2", "eval.limit=0"], "eval.limit must be >= 1"),
    (
        "distill_teacher_top_k_above_vocab",
        [*DISTILL, "teacher.cache=true", "teacher.top_k=100000"],
        "teacher.top_k=100000 is more than the target's vocabulary (103 tokens)",
    ),
    (
        "distill_allow_incomplete_on_a_shipped_dataset",
        [*DISTILL, "data.dataset=smollm2-self", "data.allow_incomplete=true"],
        "data.dataset=smollm2-self is not one (a shipped dataset is complete): leave data.allow_incomplete out",
    ),
    ("distill_bad_number", [*DISTILL, "optim.max_steps=ten"], "config optim.max_steps: 'ten' is not a valid int"),
    (
        "distill_section_given_a_value",
        [*DISTILL, "optim=5"],
        "overrides: optim is a section, not a setting; set a key in it, e.g. optim.lr=5 (its keys: lr, weight_decay",
    ),
    (
        "distill_dataset_copied_without_manifest",
        [*DISTILL, "data.dataset={copied_without_manifest}"],
        "copied-without-manifest was built by draftsmith data but has no manifest.json",
    ),
    (
        "distill_dataset_card_lists_a_file_outside",
        [*DISTILL, "data.dataset={card_outside}"],
        "card-outside/README.md lists the data file ../a-file.txt, outside the folder; a dataset card names files",
    ),
    # draftsmith eval-run
    ("eval_run_gamma_zero", [*EVAL_RUN, "--gammas", "0,2"], "--gammas must all be >= 1, got 0,2"),
    ("eval_run_gammas_not_numbers", [*EVAL_RUN, "--gammas", "a,b"], "--gammas must be a comma-separated list"),
    ("eval_run_limit_zero", [*EVAL_RUN, "--limit", "0"], "--limit must be >= 1"),
    ("eval_run_max_new_tokens_zero", [*EVAL_RUN, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("eval_run_prompts_folder", [*EVAL_RUN, "--prompts", "{folder}"], "a-folder is a folder; give a JSONL file"),
    ("eval_run_prompts_bad_json", [*EVAL_RUN, "--prompts", "{badjson}"], "bad.jsonl, line 2: not valid JSON"),
    ("eval_run_draft_vocab_above_vocab", [*EVAL_RUN, "--draft-vocab", "1000"], "vocabulary (103 tokens)"),
    ("eval_run_draft_vocab_negative", [*EVAL_RUN, "--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
    ("eval_run_tree_budget_zero", [*EVAL_RUN, "--trees", "3,2:0"], "budget must be 1 to 8 (the shape 3,2 has 9"),
    ("eval_run_tree_budget_above_size", [*EVAL_RUN, "--trees", "3,2:50"], "for the fixed tree leave out :50"),
    ("eval_run_negative_temperature", [*EVAL_RUN, "--temperatures", "0,-1"], "--temperatures must all be >= 0"),
    ("eval_run_repeats_zero", [*EVAL_RUN, "--repeats", "0"], "--repeats must be >= 1"),
    ("eval_run_engine_batch_zero", [*EVAL_RUN, "--engine", "vllm", "--engine-batch-sizes", "0,1"], "must be >= 1"),
    ("eval_run_engine_threads_alone", [*EVAL_RUN, "--engine-threads", "2"], "--engine-threads applies to --engine"),
    ("eval_run_engine_batch_without_vllm", [*EVAL_RUN, "--engine-batch-sizes", "1"], "applies to --engine vllm"),
    ("eval_run_gammas_beyond_context", [*EVAL_RUN, "--gammas", "1,600"], "--gammas 600 with --max-new-tokens 64"),
    ("eval_run_option_given_twice", [*EVAL_RUN, "--limit", "1", "--limit", "2"], "--limit is given twice"),
    (
        "eval_run_draft_option_of_another_kind",
        [*EVAL_RUN, "--draft-option", "kv_reuse=false"],
        "--draft-option 'kv_reuse' is not a decode option of lm drafts (known: none)",
    ),
    ("eval_run_draft_option_without_value", [*EVAL_RUN, "--draft-option", "kv_reuse"], "takes KEY=VALUE"),
    ("eval_run_not_a_run", ["eval-run", "{folder}"], "a-folder is not a distillation run folder"),
    # draftsmith publish
    ("publish_private_without_push", ["publish", "{ckpt}", "--out", "{root}/x", "--private"], "add --push-to-hub"),
    ("publish_bad_repo_id", ["publish", "{ckpt}", "--out", "{root}/x", "--push-to-hub", "draft"], "owner/name"),
    ("publish_out_is_a_file", ["publish", "{ckpt}", "--out", "{file}"], "is a file, not a folder"),
    ("publish_out_under_a_file", ["publish", "{ckpt}", "--out", "{under_file}"], "nothing can be written under it"),
    ("publish_run_without_ranking", ["publish", "{run}", "--out", "{root}/x"], "run draftsmith eval-run"),
    ("publish_cut_off_weights", ["publish", "{cut_weights}", "--out", "{root}/x"], "is damaged or cut off"),
    ("publish_missing_checkpoint", ["publish", "{run}/checkpoint-9", "--out", "{root}/x"], "checkpoint not found"),
    # draftsmith quickstart: its evaluation and publishing options, before any training
    ("quickstart_gamma_zero", [*QUICK, "--gammas", "0"], "--gammas must all be >= 1"),
    ("quickstart_gammas_not_numbers", [*QUICK, "--gammas", "1;2"], "--gammas must be a comma-separated list"),
    ("quickstart_gammas_beyond_context", [*QUICK, "--gammas", "2,500"], "does not fit the target's context (512"),
    ("quickstart_early_exit", [*QUICK, "draft.kind=early_exit"], "early-exit drafts share the target's layers"),
    ("quickstart_limit_zero", [*QUICK, "--limit", "0"], "--limit must be >= 1"),
    ("quickstart_max_new_tokens_zero", [*QUICK, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("quickstart_prompts_folder", [*QUICK, "--prompts", "{folder}"], "a-folder is a folder; give a JSONL file"),
    ("quickstart_prompts_bad_json", [*QUICK, "--prompts", "{badjson}"], "bad.jsonl, line 2: not valid JSON"),
    ("quickstart_draft_vocab_above_vocab", [*QUICK, "--draft-vocab", "1000"], "vocabulary (103 tokens)"),
    ("quickstart_draft_vocab_negative", [*QUICK, "--draft-vocab", "-5"], "--draft-vocab must be >= 0"),
    ("quickstart_output_dir_override", [*QUICK, "output_dir=elsewhere"], "give --output-dir instead"),
    ("quickstart_output_dir_is_a_file", [*QUICK[:1], "--output-dir", "{file}"], "is a file, not a folder"),
    ("quickstart_output_dir_under_a_file", [*QUICK[:1], "--output-dir", "{under_file}"], "written under it"),
    ("quickstart_empty_config", [*QUICK[:3], "--config", "{empty_yaml}"], "is empty; a config says what"),
    ("quickstart_unknown_override", [*QUICK, "max_stpes=3"], "did you mean optim.max_steps?"),
    ("quickstart_incomplete_dataset", [*QUICK, "data.dataset={incomplete}"], "is an incomplete build"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_work(world, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(teacher_cache, "disk_free", lambda folder: 20_000_000)  # a 20 MB file system
    before = snapshot(world["root"])
    started = time.perf_counter()
    assert message in refused(argv, world, capsys)
    assert time.perf_counter() - started < 10
    assert snapshot(world["root"]) == before


def test_the_table_covers_every_command():
    cases = DATA_SAFETY + CASES + EVAL_CASES + EVAL_MAIN_CASES
    assert len(cases) >= 60
    commands = {c[1][0] for c in cases}
    assert commands == {"data", "distill", "eval", "eval-run", "publish", "quickstart"}


EVAL = ["eval", "--target", "{target}", "--draft", "{draft}", "--prompts", PROMPTS]

# draftsmith eval's own refusals (``checks.check_eval_options``), before anything loads: the messages may name
# the world's paths ({file}).
EVAL_CASES = [
    ("gamma_with_a_tree", [*EVAL, "--gamma", "3", "--tree", "3,2"], "--gamma sets a chain's length and --tree"),
    ("tree_budget_zero", [*EVAL, "--tree", "3,2:0"], "a dynamic tree's budget must be 1 to 8"),
    ("tree_budget_above_size", [*EVAL, "--tree", "2,2:7"], "budget must be 1 to 5 (the shape 2,2 has 6 nodes)"),
    ("top_k_when_greedy", [*EVAL, "--top-k", "5"], "--top-k applies when sampling; with --temperature 0"),
    ("top_p_when_greedy", [*EVAL, "--top-p", "0.9"], "--top-p applies when sampling"),
    ("draft_greedy_when_greedy", [*EVAL, "--draft-greedy"], "--draft-greedy applies when sampling"),
    ("json_under_a_file", [*EVAL, "--json", "{under_file}"], "--json {under_file}: {file} is a file"),
    ("json_is_a_folder", [*EVAL, "--json", "{folder}"], "a-folder is a folder, not a file: give a file path"),
    ("draft_vocab_above_vocab", [*EVAL, "--draft-vocab", "32"], "not smaller than the model's vocabulary (32"),
    ("repeats_zero", [*EVAL, "--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("prompts_folder", [*EVAL[:5], "--prompts", "{folder}"], "a-folder is a folder; give a JSONL file"),
    ("prompts_dev_null", [*EVAL[:5], "--prompts", "/dev/null"], "/dev/null is not a regular file"),
    (
        "temperature_inf",
        [*EVAL, "--temperature", "inf"],
        "--temperature must be a finite number >= 0 (0 = greedy), got inf",
    ),
    ("top_p_zero", [*EVAL, "--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ("gamma_beyond_context", [*EVAL, "--gamma", "100000"], "does not fit the target's context (1024 tokens)"),
    ("draft_config_cut_off", [*EVAL[:3], "--draft", "{cut_config}"], "config.json is not valid JSON (damaged or cut"),
    (
        "draft_config_not_its_weights",
        [*EVAL[:3], "--draft", "{more_layers}"],
        "config.json does not match its weights (its config describes 30 layers and its weights hold 2)",
    ),
    ("guess_tokens_huge", [*EVAL, "--guess-tokens", "100000"], "--guess-tokens must be 1 to 64 (lookup tokens a"),
    ("guess_tokens_zero", [*EVAL, "--guess-tokens", "0"], "--guess-tokens must be 1 to 64"),
    ("guess_tokens_beyond_context", [*EVAL, "--guess-tokens", "64", "--max-new-tokens", "990"], "does not fit"),
    (
        "draft_option_given_twice",
        [*EVAL, "--draft-option", "kv_reuse=true", "--draft-option", "kv_reuse=false"],
        "--draft-option kv_reuse is given twice; give it once",
    ),
    ("tree_of_a_negative_count", [*EVAL, "--tree", "-1,2"], "--tree -1,2: tree branching must be a list of counts"),
    ("tree_negative_budget", [*EVAL, "--tree", "2,2:-3"], "--tree 2,2:-3: a dynamic tree's budget must be 1 to 5"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_eval_options_are_refused_before_loading(world, capsys, argv, message):
    before = snapshot(world["root"])
    started = time.perf_counter()
    assert message.format(**world) in refused(argv, world, capsys)
    assert time.perf_counter() - started < 10
    assert snapshot(world["root"]) == before


# What eval's main refuses itself before any model loads.
EVAL_MAIN_CASES = [
    ("unknown_alias", ["eval", "--target", "smollm2-135", "--draft", "self"], "did you mean smollm2-135m-instruct?"),
    ("tree_budget_zero", [*EVAL, "--tree", "3,2:0"], "budget must be 1 to 8"),
    ("prompts_bad_json", [*EVAL[:5], "--prompts", "{badjson}"], "bad.jsonl, line 2: not valid JSON"),
    ("engine_batch_zero", [*EVAL, "--engine", "vllm", "--engine-batch-sizes", "0"], "must be >= 1"),
    ("gamma_given_twice", [*EVAL, "--gamma", "2", "--gamma", "3"], "--gamma is given twice; give it once"),
    ("engine_batch_without_vllm", [*EVAL, "--engine-batch-sizes", "1"], "applies to --engine vllm"),
    ("kv_cache_without_vllm", [*EVAL, "--engine-kv-cache-gib", "4"], "--engine-kv-cache-gib applies to"),
    ("draft_config_cut_off", [*EVAL[:3], "--draft", "{cut_config}"], "is not valid JSON (damaged or cut off)"),
    (
        "eagle3_head_of_another_target",
        [*EVAL[:3], "--draft", "{eagle_of_another}", "--prompts", PROMPTS, "--limit", "1"],
        "is an EAGLE-3 head for the target other-tiny (hidden size 64), not for this one (hidden size 32, 2 layers)",
    ),
    (
        "early_exit_draft_of_another_target",
        [*EVAL[:3], "--draft", "{exit_of_another}", "--prompts", PROMPTS, "--limit", "1"],
        "is an early-exit draft of the target other-tiny, whose layers it shares; this target is another",
    ),
    (
        "dflash_mask_embedding_holding_a_pickle",  # refused, and the payload's file is never written
        [*EVAL[:3], "--draft", "{pickled_mask}", "--prompts", PROMPTS, "--limit", "1"],
        "mask_embedding.pt holds pickled objects other than tensors, which draftsmith does not load",
    ),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in EVAL_MAIN_CASES], ids=[c[0] for c in EVAL_MAIN_CASES])
def test_eval_refuses_before_loading(world, capsys, argv, message):
    before = snapshot(world["root"])
    assert message in refused(argv, world, capsys)
    assert snapshot(world["root"]) == before


@pytest.mark.parametrize(
    "argv",
    [[*EVAL, "--engine", "vllm"], [*EVAL_RUN, "--engine", "vllm"], [*BUILTIN, "--engine", "vllm"]],
    ids=["eval", "eval-run", "data"],
)
def test_an_engine_environment_without_vllm_is_refused_before_any_work(world, capsys, monkeypatch, argv):
    python = world["root"] / "no-vllm-python"  # an executable python whose environment has no vLLM
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -I "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("DRAFTSMITH_VLLM", str(python))
    before = snapshot(world["root"])
    started = time.perf_counter()
    assert f"{python} has no vLLM (import vllm fails)" in refused(argv, world, capsys)
    assert time.perf_counter() - started < 10
    assert snapshot(world["root"]) == before


def test_a_draft_folders_custom_code_is_named_and_never_run(world, tmp_path, capsys):
    """A draft whose config.json maps the model to code of its own (``auto_map``) measures as the plain
    Llama it declares, with one line saying the code was not run."""
    draft = tmp_path / "custom-code"
    shutil.copytree(world["draft"], draft)
    config = json.loads((draft / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}
    (draft / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "custom-code-ran.txt"
    (draft / "custom.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    before = snapshot(draft)
    argv = [*EVAL[:3], "--draft", str(draft), "--prompts", PROMPTS, "--limit", "1", "--max-new-tokens", "4"]
    assert main([arg.format(**world) for arg in [*argv, "--repeats", "1", "--no-progress"]]) == 0
    err = capsys.readouterr().err
    note = "names custom code (auto_map: AutoConfig, AutoModelForCausalLM); draftsmith runs no code from a model folder"
    assert note in err and "loaded as the plain llama it declares" in err, err
    assert not marker.exists() and snapshot(draft) == before


# Settings a kind can judge only against the models it builds: refused before the first training step.
KIND_CASES = [
    (
        "lora_module_the_model_lacks",
        ["draft.lora_r=4", "draft.lora_target_modules=[q_prj, v_proj]"],
        "draft.lora_target_modules: the draft has no linear module named q_prj; it has ",
    ),
    (
        "parallel_mask_the_data_uses",
        ["draft.kind=parallel", "draft.layers=1", "draft.options={{mask_token_id: 3}}"],
        "mask_token_id 3 (<|user|>) is a token the data uses: the chat template writes it into every prompt",
    ),
]


@pytest.mark.parametrize("overrides, message", [c[1:] for c in KIND_CASES], ids=[c[0] for c in KIND_CASES])
def test_kind_settings_the_models_refuse_stop_before_training(tmp_path, capsys, overrides, message):
    run = tmp_path / "run"
    assert message in refused(
        [*DISTILL, f"output_dir={run}", "optim.max_steps=2", "save.steps=2", *overrides], {}, capsys
    )
    assert not list(run.glob("checkpoint-*")) and not (run / "metrics.jsonl").exists()
