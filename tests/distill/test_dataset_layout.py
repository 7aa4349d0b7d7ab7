"""A dataset folder as the hub lays one out (parquet shards under data/, a dataset card), trusted for
training only when complete and intact: a damaged shard is named, and building again repairs it; the
layout before (shards/ of save_to_disk folders) still loads and is converted once."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from draftsmith.distill import dataset_builder
from draftsmith.distill.dataset_builder import check_trusted, load_built, read_manifest, shard_paths
from draftsmith.specdec.errors import DraftsmithError
from tests.distill.test_dataset_builder import build, records, rows_by_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread beats OpenMP's barriers


@pytest.fixture
def built(tmp_path, model, tokenizer):
    """A finished dataset of 7 prompts in shards of 3 rows: train-ID-r0-00000 .. 00002."""
    build(tmp_path / "d", model, tokenizer, records(7))
    return tmp_path / "d"


def test_the_card_names_the_split_and_the_manifests_facts(built):
    card = (built / "README.md").read_text()
    assert card.startswith("---\n")
    metadata = yaml.safe_load(card.split("---\n")[1])
    files = [f"data/train-{read_manifest(built)['id']}-r0-0000{i}.parquet" for i in range(3)]
    assert metadata["configs"] == [{"config_name": "default", "data_files": [{"split": "train", "path": files}]}]
    size = sum((built / f).stat().st_size for f in files)
    split = {"name": "train", "num_bytes": size, "num_examples": 7}
    assert metadata["dataset_info"] == {
        "config_name": "default",
        "splits": [split],
        "download_size": size,
        "dataset_size": size,
    }
    facts = metadata["draftsmith"]
    assert (facts["complete"], facts["target"], facts["rows"], facts["prompts"]) == (True, "tiny", 7, 7)
    assert facts["answer_tokens"] == read_manifest(built)["counts"]["answer_tokens"]
    assert facts["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert sorted(f"data/{p.name}" for p in (built / "data").iterdir()) == files
    # The datasets library reads the folder by its card alone.
    loaded = datasets.load_dataset(str(built), split="train", cache_dir=str(built.parent / "hf-cache"))
    assert sorted(loaded["prompt_id"]) == sorted(load_built(built)["prompt_id"])


def test_a_text_the_user_wrote_under_the_card_is_kept(built, model, tokenizer):
    text = (built / "README.md").read_text().split("---\n", 2)[2]
    (built / "README.md").write_text("---\nold: metadata\n---\n\n# Our dataset\n\nNotes.\n")
    build(built, model, tokenizer, records(8))
    card = (built / "README.md").read_text()
    assert card.endswith("\n# Our dataset\n\nNotes.\n") and "old: metadata" not in card
    assert yaml.safe_load(card.split("---\n")[1])["draftsmith"]["rows"] == 8
    assert "load_dataset" in text  # the text written when there was none


def test_an_incomplete_build_trains_only_when_asked(built):
    manifest = read_manifest(built)
    assert check_trusted(built, "tiny")["complete"] is True
    (built / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DraftsmithError, match="is an incomplete build .* or set data.allow_incomplete=true"):
        check_trusted(built, "tiny")
    assert check_trusted(built, "tiny", allow_incomplete=True)["counts"]["rows"] == 7
    with pytest.raises(DraftsmithError, match="holds answers of target 'tiny', not of 'other'"):
        check_trusted(built, "other", allow_incomplete=True)


@pytest.mark.parametrize("damage", ["truncated", "a folder in its place", "removed"])
def test_a_damaged_shard_is_named_and_building_again_repairs_it(built, model, tokenizer, capsys, damage):
    before = rows_by_key(built)
    shard = shard_paths(built)[1]
    relative = shard.relative_to(built).as_posix()
    data = shard.read_bytes()
    shard.unlink()
    if damage == "truncated":
        shard.write_bytes(data[:100])
    elif damage == "a folder in its place":
        shard.mkdir()
    named = f"the shard {relative} is damaged" if damage != "removed" else "a shard was removed"
    with pytest.raises(DraftsmithError, match=f"{named}.*run draftsmith data on {built} again"):
        check_trusted(built, "tiny")
    if damage != "removed":
        with pytest.raises(DraftsmithError, match=named):
            load_built(built)
    build(built, model, tokenizer, records(7))
    if damage != "removed":
        assert f"{relative} is damaged; rebuilding its rows" in capsys.readouterr().err
    after = rows_by_key(built)
    assert {k: r["answer_ids"] for k, r in after.items()} == {k: r["answer_ids"] for k, r in before.items()}
    check_trusted(built, "tiny")


def test_an_old_shard_missing_its_data_file_is_named(built):
    path = shard_paths(built)[0]
    old = built / "shards" / "shard-r0-00000"
    datasets.Dataset.from_parquet(str(path), cache_dir=str(built.parent / "hf")).save_to_disk(str(old))
    path.unlink()
    next(old.glob("*.arrow")).unlink()
    with pytest.raises(DraftsmithError, match="the shard shards/shard-r0-00000 is damaged"):
        check_trusted(built, "tiny")


def test_the_old_layout_loads_and_is_converted_once(built, model, tokenizer, capsys):
    rows = load_built(built)
    old = built / "shards"
    for path in shard_paths(built):  # the folder as the layout before wrote it
        name = path.stem.replace(f"train-{read_manifest(built)['id']}-", "shard-")
        datasets.Dataset.from_parquet(str(path), cache_dir=str(built.parent / "hf")).save_to_disk(str(old / name))
        (built / "teacher-cache-k4" / name).mkdir(parents=True)
        (built / "teacher-cache-k4" / name / "meta.json").write_text("{}")
        path.unlink()
    (built / "data").rmdir()
    assert [p.name for p in shard_paths(built)] == ["shard-r0-00000", "shard-r0-00001", "shard-r0-00002"]
    assert load_built(built)["answer_ids"] == rows["answer_ids"]
    check_trusted(built, "tiny")

    build(built, model, tokenizer, records(7))
    assert capsys.readouterr().out.count("converted 3 shard(s) of the old layout (shards/) to data/*.parquet") == 1
    assert not old.exists()
    names = [f"train-{read_manifest(built)['id']}-r0-0000{i}" for i in range(3)]  # converted and given the id
    assert [p.name for p in shard_paths(built)] == [f"{name}.parquet" for name in names]
    assert sorted(p.name for p in (built / "teacher-cache-k4").iterdir()) == names
    assert load_built(built)["answer_ids"] == rows["answer_ids"]
    build(built, model, tokenizer, records(7))
    assert "converted" not in capsys.readouterr().out


def test_the_shipped_dataset_is_in_the_standard_layout():
    folder = dataset_builder.SHIPPED / "smollm2-self"
    assert not (folder / "shards").exists()
    assert len(list((folder / "data").glob("train-*-r0-*.parquet"))) == 12
    card = yaml.safe_load((folder / "README.md").read_text().split("---\n")[1])
    assert card["draftsmith"]["rows"] == 2800 and card["draftsmith"]["complete"] is True
    check_trusted(folder, "smollm2-135m-instruct")


def test_a_killed_conversion_resumes(built, model, tokenizer):
    rows = load_built(built)
    first = shard_paths(built)[0]
    legacy = built / "shards" / "shard-r0-00000"
    datasets.Dataset.from_parquet(str(first), cache_dir=str(built.parent / "hf")).save_to_disk(str(legacy))
    # Killed after the parquet file was written, before the old folder went: both are there.
    build(built, model, tokenizer, records(7))
    assert not (built / "shards").exists()
    assert load_built(built)["answer_ids"] == rows["answer_ids"]
    shutil.rmtree(built.parent / "hf", ignore_errors=True)


LOADS = """
import json, sys
import datasets
from tests.distill.test_dataset_builder import build, records
from tests.helpers import tiny_llama, tiny_tokenizer

first, second = sys.argv[1:]
model, tokenizer = tiny_llama(vocab=32, sharpness=8.0), tiny_tokenizer(32)

def ids(folder):
    return sorted(datasets.load_dataset(folder, split="train")["prompt_id"])

seen = {"first": ids(first), "second": ids(second)}
build(first, model, tokenizer, records(8))  # four rows more, into the folder just loaded
seen["first, appended"] = ids(first)
seen["second, again"] = ids(second)
print(json.dumps(seen))
"""


def test_two_folders_of_one_name_and_an_append_each_load_their_own_rows(tmp_path, model, tokenizer):
    first, second = tmp_path / "a" / "ds", tmp_path / "b" / "ds"
    build(first, model, tokenizer, records(4))
    build(second, model, tokenizer, records(4, start=10))
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", LOADS, str(first), str(second)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        check=False,
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {
        "first": ["p0", "p1", "p2", "p3"],
        "second": ["p10", "p11", "p12", "p13"],
        "first, appended": [f"p{k}" for k in range(8)],
        "second, again": ["p10", "p11", "p12", "p13"],
    }
    assert len(list((tmp_path / "hf-cache" / "ds").rglob("dataset_info.json"))) == 3  # one entry per state
