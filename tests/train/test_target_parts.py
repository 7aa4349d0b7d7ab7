"""A run whose teacher is read from a feature store loads only the target tensors its draft reads
(embeddings, final norm, head, the layers its initialisation copies), and trains exactly as a run that
loads the whole target; the rest of the target loads, in the teacher's dtype, the first time it runs."""

import json

import pytest
import torch

from draftsmith.distill import dataset_builder
from draftsmith.distill.drafts.kind import TargetParts
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.loading import load_model
from draftsmith.specdec.partial_model import cast_parameters, count_loaded, load_partial
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train
from draftsmith.train.models import part_modules


def read_losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


def summary(run) -> dict:
    return json.loads((run / "train_summary.json").read_text())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny target saved as a model folder (safetensors), with a tied head as SmolLM2's."""
    model, tokenizer = tiny_target(seed=3, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_body_loads_on_the_first_forward_as_from_pretrained_would(tiny_folder):
    partial = load_partial(str(tiny_folder), torch.device("cpu"), torch.float32)
    model = partial.model
    total = count_loaded(model)[0]
    assert count_loaded(model) == (total, 0)
    partial.load(part_modules(model, TargetParts((1,))), torch.float32)
    total, loaded = count_loaded(model)
    layer = sum(p.numel() for p in model.model.layers[1].parameters())
    embeddings = model.model.embed_tokens.weight.numel()
    assert loaded == embeddings + 64 + layer  # the head is the embeddings' tensor (tied), and the norm's 64
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[5, 9, 30, 2, 41, 7]])
    whole = load_model(str(tiny_folder), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, whole(ids).logits, rtol=0, atol=0)
    assert count_loaded(model) == (total, total)


def test_a_bfloat16_teacher_is_the_target_from_pretrained_gives(tiny_folder):
    # Parts read in float32 (for the draft), then cast; the body read in bfloat16 directly: the same
    # model as from_pretrained in bfloat16, rotary frequencies in float32 included.
    partial = load_partial(str(tiny_folder), torch.device("cpu"), torch.bfloat16)
    partial.load(part_modules(partial.model, TargetParts((0,))), torch.float32)
    model = cast_parameters(partial.model, torch.bfloat16)
    whole = load_model(str(tiny_folder), torch.device("cpu"), torch.bfloat16)
    ids = torch.arange(5, 60)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, whole(ids).logits, rtol=0, atol=0)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


STORE_FED = ["smollm2-135m", "smollm2-135m-eagle3", "smollm2-135m-dflash"]


@pytest.mark.slow
@pytest.mark.parametrize("config", STORE_FED)
def test_a_store_fed_run_on_the_default_target_loads_only_what_its_draft_reads(tmp_path, config):
    items = [
        "data.max_samples=20",
        "data.heldout=4",
        "optim.batch_size=4",
        "teacher.cache=true",
        "teacher.cache_fill=before",
        "teacher.dtype=float32",  # the same teacher on every CPU
    ]

    def run(name: str, steps: int = 3, *extra: str):
        extra = (f"optim.max_steps={steps}", f"save.steps={steps}", f"log.steps={steps}", *extra)
        cfg = load_config(DistillConfig, config_path(config), [*items, *extra, f"output_dir={tmp_path / name}"])
        return train(cfg).run_dir

    build = run("build", 1)  # the store: the target runs, unless the top-k that ships with the data serves (LM)
    shipped = summary(build)["store"].startswith(str(dataset_builder.SHIPPED))
    assert summary(build)["target_parameters_loaded"] == [summary(build)["target_parameters"]] or shipped
    parts, whole = run("parts"), run("whole", 3, "teacher.load_parts=false")
    fed, loaded_whole = summary(parts), summary(whole)
    total = fed["target_parameters"]
    assert total == 134_515_008 and fed["teacher_forwards"] == 0 and fed["teacher"] == "store"
    # lm: embeddings (tied head), norm and 2 layers, 0.26 of the target; EAGLE-3 and DFlash: 0.21
    assert fed["target_parameters_loaded"][0] <= 0.3 * total
    assert loaded_whole["target_parameters_loaded"] == [total]
    assert read_losses(parts) == pytest.approx(read_losses(whole), rel=1e-6)
