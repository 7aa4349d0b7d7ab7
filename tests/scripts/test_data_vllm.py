"""``draftsmith data --engine vllm``: the dataset written through a real vLLM server on the CPU.

One server of the default target (float32, eager, one thread) serves the module through
``--engine-url``; one more test lets the command start (and stop) its own. All skip, with the reason,
where ``make vllm`` has not installed the engine.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import main
from draftsmith.distill.dataset_builder import load_built, read_self_prompts, shard_paths, training_examples
from draftsmith.distill.dataset_cache import dataset_entries
from draftsmith.distill.engines import read_hidden_states, vllm_features
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, load_model, load_tokenizer
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.vllm_server import HOST, ServeOptions, hidden_states_plan, serve, server_arguments
from tests.helpers import child_env
from tests.scripts.test_data_cli import KILLED_RUN

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]
ROOT = Path(__file__).parents[2]
EOS = 2  # the default target's <|im_end|>


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """The default target in vLLM, as ``draftsmith data`` starts it (prefix caching on)."""
    log = tmp_path_factory.mktemp("vllm-logs") / "data.log"
    options = ServeOptions(dtype="float32", eager=True, threads=1, prefix_caching=True)
    with serve(DEFAULT_TARGET, options, engine=engine, log_path=log) as running:
        yield running


def builtin_args(output, *extra, prompts=5, temperature=0.0, max_new_tokens=24, batch_size=8) -> list[str]:
    return [
        "data",
        "--prompts",
        "builtin",
        "--max-samples",
        str(prompts),
        "--temperature",
        str(temperature),
        "--max-new-tokens",
        str(max_new_tokens),
        "--dtype",
        "float32",
        "--batch-size",
        str(batch_size),
        "--shard-rows",
        "2",
        "--no-progress",
        "--output",
        str(output),
        *extra,
    ]


def rows_by_key(folder) -> dict:
    rows = load_built(folder)
    keys = list(zip(rows["prompt_id"], rows["sample"], strict=True))
    assert len(keys) == len(set(keys)), "a (prompt, sample) appears twice"
    return dict(zip(keys, rows, strict=True))


def test_greedy_rows_through_vllm_are_the_bundled_decoders_rows(server, tmp_path, capsys):
    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    assert main(builtin_args(ours)) == 0
    assert main(builtin_args(theirs, "--engine", "vllm", "--engine-url", server.url)) == 0
    expected, got = rows_by_key(ours), rows_by_key(theirs)
    assert len(got) == 5
    assert got == expected  # every column: ids, answer ids and text, finished, messages, topic, source
    assert load_built(theirs).column_names == load_built(ours).column_names
    manifest = json.loads((theirs / "manifest.json").read_text())
    assert manifest["settings"]["engine"] == "vllm" and manifest["settings"]["dtype"] == "float32"
    assert manifest["engine"]["name"] == "vllm" and manifest["engine"]["url"] == server.url
    assert manifest["engine"]["version"] == "0.32.0" and manifest["engine"]["concurrency"] == 8
    assert manifest["counts"] == json.loads((ours / "manifest.json").read_text())["counts"]
    capsys.readouterr()
    # One engine's rows are not continued by the other's.
    assert main(builtin_args(ours, "--engine", "vllm", "--engine-url", server.url)) == 2
    assert 'was built with engine="draftsmith", not "vllm"' in capsys.readouterr().err


def test_many_sampled_requests_at_once_keep_the_cpu_engine_alive(server, tmp_path):
    # 112 seeded requests in flight: more prompt tokens than one engine step takes by default, which
    # would split prompts over steps (and kill vLLM's CPU engine) unless the server prefills them whole.
    out = tmp_path / "d"
    extra = ["--engine", "vllm", "--engine-url", server.url, "--samples-per-prompt", "2"]
    assert main(builtin_args(out, *extra, prompts=56, temperature=1.0, max_new_tokens=4, batch_size=112)) == 0
    rows = rows_by_key(out)
    assert len(rows) == 112 and all(1 <= len(row["answer_ids"]) <= 4 for row in rows.values())


def test_the_engine_writes_the_teacher_cache_from_its_prompt_logprobs(server, tmp_path):
    out = tmp_path / "d"
    extra = ["--engine", "vllm", "--engine-url", server.url, "--teacher-cache", "8"]
    assert main(builtin_args(out, *extra, prompts=3, max_new_tokens=16)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["teacher_cache"]["8"]
    assert (record["computed_by"], record["dtype"], record["target"]) == ("vllm", "float32", DEFAULT_TARGET)
    assert record["tokens"] == manifest["counts"]["answer_tokens"]
    examples = training_examples(out, max_length=1024)
    entries = dataset_entries(out, examples, "float32", top_k=8, max_length=1024)
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    for example, (ids, logps) in zip(examples, entries, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([example["input_ids"]])).logits[0].double()  # (T, V)
        own = torch.log_softmax(logits, -1)[torch.tensor(example["loss_mask"], dtype=torch.bool)]  # (N, V)
        assert ids.shape == (sum(example["loss_mask"]), 8)
        assert torch.equal(ids[:, 0], own.argmax(-1))  # the engine's most likely token is the target's
        # Its log-probs are the target's (float16 in the cache), and its top 8 are among the target's top 9.
        assert torch.allclose(logps.double(), own.gather(1, ids), atol=2e-2)
        top9 = own.topk(9).indices
        assert all(set(row.tolist()) <= set(t.tolist()) for row, t in zip(ids, top9, strict=True))


def self_args(server, output, num_prompts) -> list[str]:
    return [
        "data",
        "--engine",
        "vllm",
        "--engine-url",
        server.url,
        "--prompts",
        "self",
        "--num-prompts",
        str(num_prompts),
        "--topics",
        "math,chat",
        "--samples-per-prompt",
        "2",
        "--temperature",
        "0.8",
        "--max-new-tokens",
        "32",
        "--dtype",
        "float32",
        "--shard-rows",
        "2",
        "--no-progress",
        "--output",
        str(output),
    ]


def test_self_prompted_build_killed_midway_resumes_and_appends_without_duplicates(server, tmp_path):
    out = tmp_path / "d"
    env = child_env(KILL_AFTER_SHARDS="2", OMP_NUM_THREADS="1")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *self_args(server, out, 6)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    named = json.loads((out / "manifest.json").read_text())["id"]
    assert [p.name for p in shard_paths(out)] == [f"train-{named}-r0-0000{i}.parquet" for i in range(2)]
    before = rows_by_key(out)
    assert len(before) == 4

    assert main(self_args(server, out, 6)) == 0  # the same command continues
    resumed = rows_by_key(out)
    prompts = read_self_prompts(out)
    assert len(prompts) == 6 and sorted(p.topic for p in prompts) == ["chat"] * 3 + ["math"] * 3
    assert sorted(resumed) == sorted((p.id, s) for p in prompts for s in (0, 1))
    assert all(resumed[key] == row for key, row in before.items())  # finished rows are kept as they were

    assert main(self_args(server, out, 8)) == 0  # two more prompts, four more rows
    grown = rows_by_key(out)
    assert len(grown) == 16 and all(grown[key] == row for key, row in resumed.items())
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    for row in grown.values():  # the rows the bundled decoder would write, made by vLLM
        assert row["source"] == "self" and row["messages"][0]["role"] == "user"
        assert row["prompt_ids"] == encode_chat(tokenizer, row["messages"])
        assert 1 <= len(row["answer_ids"]) <= 32
        assert row["finished"] == (row["answer_ids"][-1] == EOS)
        assert row["answer_text"] == tokenizer.decode(row["answer_ids"], skip_special_tokens=True)
    assert len({p.text for p in read_self_prompts(out)}) == 8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["counts"]["rows"] == 16
    assert manifest["counts"]["rows_by_topic"] == {"chat": 8, "math": 8}
    assert manifest["self_prompts"]["kept"] == 8


def test_the_command_starts_its_own_server_and_stops_it(engine, tmp_path):
    out = tmp_path / "d"
    assert main(builtin_args(out, "--engine", "vllm", "--engine-eager", "--engine-threads", "1", prompts=2)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    started = manifest["engine"]["server"]
    assert started["prefix_caching"] is True and started["dtype"] == "float32" and started["eager"] is True
    assert started["environment"]["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ConnectionRefusedError):  # the server is gone (its port may linger in TIME_WAIT)
        socket.create_connection((HOST, started["port"]), timeout=5).close()
    assert manifest["counts"]["rows"] == 2


# ---- the target's hidden states through vLLM's extract_hidden_states ------------------------------


def test_the_hidden_states_server_is_started_with_the_method_the_connector_and_the_parallel_sizes(tmp_path):
    speculative, kv_transfer = hidden_states_plan([15, 2, 27], tmp_path / "states")
    options = ServeOptions(tensor_parallel_size=8, data_parallel_size=2, kv_transfer=kv_transfer)
    args = server_arguments("/models/t", 8000, "bfloat16", options, speculative, gamma=1)
    flag = {name: args[i + 1] for i, name in enumerate(args) if name.startswith("--") and i + 1 < len(args)}
    assert (flag["--tensor-parallel-size"], flag["--data-parallel-size"]) == ("8", "2")
    assert json.loads(flag["--speculative-config"]) == {
        "method": "extract_hidden_states",
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}},
        "num_speculative_tokens": 1,  # the method proposes exactly one
    }
    assert json.loads(flag["--kv-transfer-config"]) == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "states")},
    }
    plain = server_arguments("/models/t", 8000, "bfloat16", ServeOptions(), None)
    assert not {"--tensor-parallel-size", "--data-parallel-size", "--kv-transfer-config"} & set(plain)


def test_the_connector_files_are_read_back_per_example_by_their_token_ids(tmp_path):
    storage = tmp_path / "states"
    storage.mkdir()
    examples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [9, 8], "loss_mask": [0, 1]}]
    written = {}
    for request, example in zip(["cmpl-b", "cmpl-a"], examples, strict=True):  # the request ids, not the order
        states = torch.randn(len(example["input_ids"]), 3, 4)  # (L, aux layers, H), as the connector writes
        save_file(
            {"hidden_states": states, "token_ids": torch.tensor(example["input_ids"])},
            storage / f"{request}.safetensors",
        )
        (storage / f"{request}.safetensors.lock").touch()  # released: the write is whole
        written[tuple(example["input_ids"])] = states
    found = read_hidden_states(storage, examples[::-1], [27, 2, 15])
    for example, states in zip(examples[::-1], found, strict=True):
        expected = written[tuple(example["input_ids"])]
        assert sorted(states) == [2, 15, 27]
        for i, layer in enumerate([2, 15, 27]):  # the server's aux layers in sorted order
            assert torch.equal(states[layer], expected[:, i])
    with pytest.raises(DraftsmithError, match="wrote no hidden states for 1 of 2 rows"):
        read_hidden_states(storage, [examples[0], {"input_ids": [1], "loss_mask": [1]}], [2, 15, 27])
    with pytest.raises(
        DraftsmithError,
        match=r"cmpl-a.safetensors: hidden_states of shape \(2, 3, 4\) for 2 tokens and layers \[2, 15\]",
    ):
        read_hidden_states(storage, examples, [2, 15])


CPU_LIMIT = "pin_memory=True requires a CUDA or other accelerator backend"  # the connector's copy, on vLLM's CPU build


def test_the_vllm_feature_store_matches_the_bundled_targets_states(engine, tmp_path):
    """The hidden states vLLM writes (TP 1) are the bundled target's within bfloat16 rounding. vLLM 0.32's
    ExampleHiddenStatesConnector copies through pinned memory and a CUDA stream: on its CPU build the
    engine dies at the first request, and the test skips with that error (gpu_check.sh runs it on a GPU)."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    ids = tokenizer("Why is the sky blue? Because air scatters blue light most.")["input_ids"]
    examples = [{"input_ids": ids, "loss_mask": [0] * (len(ids) - 5) + [1] * 4 + [0]}]
    layers, storage, log = [2, 15, 27], tmp_path / "states", tmp_path / "server.log"
    speculative, kv_transfer = hidden_states_plan(layers, storage)
    options = ServeOptions(dtype="float32", eager=True, threads=1, kv_transfer=kv_transfer, max_logprobs=4)
    try:
        with serve(DEFAULT_TARGET, options, speculative=speculative, gamma=1, engine=engine, log_path=log) as server:
            entries, hidden = vllm_features(server, examples, storage, 4, layers)
    except Exception:
        failed = [line for line in log.read_text().splitlines() if CPU_LIMIT in line] if log.is_file() else []
        if failed:
            pytest.skip(f"vLLM's CPU build cannot extract hidden states: {failed[-1].split('] ', 1)[-1]}")
        raise
    target = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for layer in layers:
        torch.testing.assert_close(hidden[0][layer].float(), out.hidden_states[layer][0], rtol=2e-2, atol=2e-2)
    top = torch.log_softmax(out.logits[0].float(), -1).topk(4)
    assert torch.equal(entries[0][0], top.indices[len(ids) - 5 : len(ids) - 1])
