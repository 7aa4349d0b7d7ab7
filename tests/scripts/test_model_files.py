"""A model folder is read for what it is before it loads: config.json parses, the safetensors files are
whole, and the weights are the ones the config describes (from_pretrained would fill the gap with random
weights and say nothing)."""

import json
import shutil

import pytest
import torch

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_model_files, load_model
from tests.helpers import tiny_llama


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "m"
    tiny_llama(vocab=32, layers=2, hidden=32).save_pretrained(folder)
    return folder


def edited(saved, tmp_path, **changes):
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_a_sound_folder_passes_and_loads(saved):
    check_model_files(saved)
    assert load_model(str(saved), torch.device("cpu"), torch.float32).config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 30}, "its config describes 30 layers and its weights hold 2"),
        ({"num_hidden_layers": 1}, "its config describes 1 layers and its weights hold 2"),
        ({"intermediate_size": 48}, "model.layers.0.mlp.down_proj.weight has shape [32, 64], its config says [32, 48]"),
    ],
)
def test_a_config_that_is_not_its_weights_is_refused_before_loading(saved, tmp_path, changes, message):
    folder = edited(saved, tmp_path, **changes)
    with pytest.raises(DraftsmithError, match="config.json does not match its weights") as refused:
        load_model(str(folder), torch.device("cpu"), torch.float32)
    assert message in str(refused.value)


def test_cut_off_files_are_named(saved, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:-10])
    with pytest.raises(DraftsmithError, match=r"model.safetensors holds \d+ bytes but its header describes \d+"):
        check_model_files(folder)
    (folder / "model.safetensors").write_bytes(weights[:20])  # the header itself cut
    with pytest.raises(DraftsmithError, match="model.safetensors is damaged or cut off"):
        check_model_files(folder)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:-5])
    with pytest.raises(DraftsmithError, match=r"config.json is not valid JSON \(damaged or cut off\)"):
        check_model_files(folder)
