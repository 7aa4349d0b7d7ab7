"""``draftsmith data`` end to end on a tiny target saved to disk: killed midway, resumed, extended, refused."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.distill.dataset_builder import load_built, read_self_prompts, read_shard, shard_paths
from tests.helpers import child_env, save_tiny_pair

ROOT = Path(__file__).parents[2]
# Runs the command, but SIGKILLs itself right after its Nth answer shard is saved: a hard kill
# mid-build, with rows still in flight.
KILLED_RUN = """
import os, signal, sys
from draftsmith.distill import dataset_builder
real_write = dataset_builder.write_shard
written = []
def write_then_die(*args, **kwargs):
    path = real_write(*args, **kwargs)
    written.append(path)
    if len(written) == int(os.environ["KILL_AFTER_SHARDS"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return path
dataset_builder.write_shard = write_then_die
from draftsmith.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are latency-bound: on a shared machine, OpenMP's thread barriers cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), max_positions=1024)[0]


def self_args(target, output, num_prompts, *extra):
    """The self-prompt command; an option in ``extra`` replaces its value here (an option is given once)."""
    args = [
        "data",
        "--target",
        str(target),
        "--prompts",
        "self",
        "--num-prompts",
        str(num_prompts),
        "--topics",
        "coding,math,chat",
        "--any-prompt-text",  # the tiny vocabulary has no English questions
        "--prompt-max-tokens",
        "64",
        "--max-new-tokens",
        "16",
        "--temperature",
        "1.0",
        "--batch-size",
        "8",
        "--shard-rows",
        "4",
        "--no-progress",
        "--output",
        str(output),
    ]
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def keys_and_answers(folder) -> dict:
    rows = load_built(folder)
    keys = list(zip(rows["prompt_id"], rows["sample"], strict=True))
    assert len(keys) == len(set(keys)), "duplicate rows"
    return dict(zip(keys, rows["answer_ids"], strict=True))


def test_killed_build_resumes_without_duplicates_or_loss(target, tmp_path):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    env = child_env(KILL_AFTER_SHARDS="2", OMP_NUM_THREADS="1")
    args = self_args(target, killed, 18, "--samples-per-prompt", "2")
    result = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == -9, result.stderr[-3000:]
    named = json.loads((killed / "manifest.json").read_text())["id"]
    assert [p.name for p in shard_paths(killed)] == [f"train-{named}-r0-0000{i}.parquet" for i in range(2)]
    assert len(load_built(killed)) == 8
    assert json.loads((killed / "manifest.json").read_text())["complete"] is False

    assert main(args) == 0  # the same command continues
    assert main(self_args(target, whole, 18, "--samples-per-prompt", "2")) == 0  # never interrupted
    resumed = keys_and_answers(killed)
    prompt_ids = [p.id for p in read_self_prompts(killed)]
    assert len(prompt_ids) == 18
    assert sorted(resumed) == sorted((p, s) for p in prompt_ids for s in (0, 1))
    assert resumed == keys_and_answers(whole)  # the same rows, sample for sample
    manifest = json.loads((killed / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["counts"]["rows"] == 36 and manifest["counts"]["prompts"] == 18
    assert manifest["counts"]["rows_by_topic"] == {"chat": 12, "coding": 12, "math": 12}


def test_more_prompts_are_appended_and_a_changed_setting_is_refused(target, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(self_args(target, out, 6)) == 0
    first = keys_and_answers(out)
    assert len(first) == 6
    assert main(self_args(target, out, 9)) == 0
    grown = keys_and_answers(out)
    assert len(grown) == 9 and all(grown[key] == answer for key, answer in first.items())
    capsys.readouterr()

    assert main(self_args(target, out, 9, "--max-new-tokens", "20")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} was built with max_new_tokens=16, not 20")
    assert err.count("\n") == 1
    assert main(self_args(target, out, 9, "--topics", "coding")) == 2
    assert 'prompt_source.topics=["coding", "math", "chat"], not ["coding"]' in capsys.readouterr().err
    assert len(load_built(out)) == 9


# Run with nothing of draftsmith importable (another folder, no PYTHONPATH): the datasets library alone.
LOAD_ALONE = """
import json, sys
import datasets
rows = datasets.load_dataset(sys.argv[1], split="train", cache_dir=sys.argv[2])
drafted = sorted(name for name in sys.modules if name.split(".")[0] in ("draftsmith", "scripts", "distill"))
print(json.dumps({"keys": sorted([r["prompt_id"], r["sample"]] for r in rows), "imported": drafted}))
"""


def test_a_built_and_appended_dataset_loads_with_the_datasets_library_alone(target, tmp_path):
    out = tmp_path / "d"
    base = ["data", "--target", str(target), "--prompts", "builtin", "--max-new-tokens", "8", "--shard-rows", "3"]
    assert main([*base, "--max-samples", "4", "--no-progress", "--output", str(out)]) == 0
    assert main([*base, "--max-samples", "7", "--no-progress", "--output", str(out)]) == 0  # appends 3 rows
    ours = sorted([k, s] for k, s in keys_and_answers(out))
    assert len(ours) == 7
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_ALONE, str(out), str(tmp_path / "hf-cache")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded == {"keys": ours, "imported": []}


def test_a_prompt_file_with_a_column_map_and_bad_rows_skipped(target, tmp_path, capsys):
    rows = [{"q": f"w{3 + k} w{10 + k} w{20 + k % 5}"} for k in range(5)] + [{"other": "x"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["data", "--target", str(target), "--prompts", str(path), "--temperature", "0", "--no-progress"]
    out = tmp_path / "d"
    assert main([*base, "--column-map", "prompt=q", "--output", str(out), "--max-new-tokens", "8"]) == 2
    assert "row 5 (counting from 0): none of the fields" in capsys.readouterr().err
    argv = [*base, "--column-map", "prompt=q", "--skip-bad-rows", "--output", str(out), "--max-new-tokens", "8"]
    assert main(argv) == 0
    assert "skipped 1 bad row(s) of 6" in capsys.readouterr().err
    rows_out = read_shard(shard_paths(out)[0])
    assert sorted(rows_out["prompt_id"]) == ["0", "1", "2", "3", "4"]
    assert all(len(a) <= 8 for a in rows_out["answer_ids"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "self"], "--prompts self needs --num-prompts N"),
        (["--prompts", "builtin", "--num-prompts", "5"], "cap a prompt source with --max-samples"),
        (["--prompts", "self", "--num-prompts", "5", "--topics", "cooking"], "unknown topic(s) cooking"),
        (
            ["--prompts", "builtin", "--samples-per-prompt", "2", "--temperature", "0"],
            "--samples-per-prompt applies to",
        ),
        (["--prompts", "./missing.jsonl"], "prompt file not found: ./missing.jsonl"),
    ],
)
def test_bad_arguments_are_one_line_errors(target, tmp_path, capsys, argv, message):
    assert main(["data", "--target", str(target), "--output", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_help_explains_the_sources(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--prompts" in text and "the target writes user messages itself" in text and "coding" in text


def test_distill_trains_from_a_built_dataset_by_path(target, tmp_path, capsys):
    data = tmp_path / "ds"
    assert main(self_args(target, data, 12)) == 0
    built = load_built(data)
    run = tmp_path / "run"
    base = ["distill", "--config", "tiny", f"target={target}", "draft.init=truncate", "draft.layers=1"]
    overrides = [
        f"data.dataset={data}",
        "data.heldout=2",
        "optim.max_steps=2",
        "save.steps=2",
        "optim.batch_size=4",
        "device=cpu",
    ]
    assert main([*base, *overrides, f"output_dir={run}"]) == 0
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and 0 < record["acceptance_rate"] <= 1
    # every built row is used and none is generated anew: 12 rows, 2 held out
    assert len(built) == 12
    assert "; 10 training sequences" in capsys.readouterr().out
    other = ["distill", "--config", "tiny", f"data.dataset={data}", f"output_dir={tmp_path / 'other'}"]
    assert main(other) == 2
    assert "holds answers of target" in capsys.readouterr().err


def test_the_target_through_a_link_or_with_a_trailing_slash_continues_the_same_dataset(target, tmp_path, capsys):
    out = tmp_path / "d"
    base = ["data", "--prompts", "builtin", "--max-new-tokens", "8", "--shard-rows", "3", "--no-progress"]
    assert main([*base, "--target", str(target), "--max-samples", "3", "--output", str(out)]) == 0
    link = tmp_path / "target-link"
    link.symlink_to(target)
    assert main([*base, "--target", str(link), "--max-samples", "5", "--output", str(out)]) == 0  # appends 2 rows
    assert main([*base, "--target", f"{target}/", "--max-samples", "6", "--output", str(out)]) == 0  # appends 1
    capsys.readouterr()
    assert len(load_built(out)) == 6
    assert json.loads((out / "manifest.json").read_text())["settings"]["target"] == str(target)  # as first named


def test_a_finished_datasets_teacher_cache_alone_and_what_it_records(target, tmp_path, capsys):
    data = tmp_path / "ds"
    assert main(self_args(target, data, 6)) == 0
    capsys.readouterr()
    manifest = (data / "manifest.json").read_bytes()
    only = ["--output", str(data), "--cache-only", "--teacher-cache", "4", "--teacher-encoding", "uint8"]
    only += ["--max-length", "40", "--dtype", "float32", "--no-progress"]
    assert main(["data", *only]) == 0  # no build option restated: the folder's own target computes it
    cache = data / "teacher-cache-k4-uint8"
    record = json.loads((cache / "cache.json").read_text())
    assert (record["target"], record["dtype"], record["top_k"], record["max_length"]) == (str(target), "float32", 4, 40)
    assert record["encoding"] == {"indices": "uint16", "logprobs": "uint8"}
    assert record["command"] == " ".join(["draftsmith", "data", *only])
    assert record["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    assert (data / "manifest.json").read_bytes() == manifest  # the rows and the manifest are untouched
    line = f"teacher cache: top 4 at {record['tokens']} answer positions, float32, uint16-uint8, rows cut at 40 tokens"
    assert capsys.readouterr().out == f"{line} ({cache})\n"

    # Another cut into the same folder is refused by name; the options that would write rows are refused.
    assert main(["data", *only[:7], "--max-length", "30"]) == 2
    assert "max_length 40 (now 30); delete it to compute it again this way" in capsys.readouterr().err
    for extra, message in [
        ([], "--cache-only needs --teacher-cache K"),
        (["--teacher-cache", "4", "--hidden-layers", "1"], "leave out --hidden-layers and --engine"),
    ]:
        assert main(["data", "--output", str(data), "--cache-only", *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["data", "--output", str(tmp_path / "none"), "--cache-only", "--teacher-cache", "4"]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
