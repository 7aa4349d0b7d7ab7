"""``draftsmith data --engine vllm``: the dataset written through a real vLLM server on the CPU.

One server of the default target (float32, eager, one thread) serves the module through
``--engine-url``; one more test lets the command start (and stop) its own. The feature-store tests let
the command start both of its servers (the answers', then the hidden states') and compare the store
with draftsmith's own build of the same rows, at tensor parallelism 1 and 2 (the second on a random
model with 4 heads: the default target's 9 do not split over 2 processes). All skip, with the reason,
where ``make vllm`` has not installed the engine.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith import data
from draftsmith.cli import main
from draftsmith.distill.dataset_builder import load_built, read_self_prompts, shard_paths, training_examples
from draftsmith.distill.dataset_cache import dataset_entries
from draftsmith.distill.engines import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    install_connector,
    prompt_file_name,
    take_hidden_states,
)
from draftsmith.distill.teacher_cache import Store
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, load_model, load_tokenizer, resolve_model
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.vllm_server import (
    HOST,
    Engine,
    ServeOptions,
    hidden_states_plan,
    serve,
    server_arguments,
    server_plan,
)
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


def builtin_args(
    output, *extra, prompts=5, temperature=0.0, max_new_tokens=24, batch_size=8, shard_rows=2
) -> list[str]:
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
        str(shard_rows),
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
    record = json.loads((out / "teacher-cache-k8" / "cache.json").read_text())
    assert (record["computed_by"], record["dtype"], record["target"]) == ("vllm", "float32", DEFAULT_TARGET)
    assert record["tokens"] == manifest["counts"]["answer_tokens"]
    examples = training_examples(out, max_length=1024)
    entries, _ = dataset_entries(out, examples, "float32", top_k=8, max_length=1024)
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


# ---- the feature store through vLLM's extract_hidden_states and draftsmith's connector ------------


def test_the_hidden_states_server_is_started_with_the_method_our_connector_and_the_parallel_sizes(tmp_path):
    plan = hidden_states_plan([15, 2, 27], tmp_path / "states", (CONNECTOR_CLASS, CONNECTOR_MODULE))
    speculative, kv_transfer = plan
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
        "kv_connector": "DraftsmithHiddenStatesConnector",
        "kv_connector_module_path": "draftsmith_vllm_connector",  # imported from the server's PYTHONPATH
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "states")},
    }
    assert hidden_states_plan([2], tmp_path)[1]["kv_connector"] == "ExampleHiddenStatesConnector"  # vLLM's own
    plain = server_arguments("/models/t", 8000, "bfloat16", ServeOptions(), None)
    assert not {"--tensor-parallel-size", "--data-parallel-size", "--kv-transfer-config"} & set(plain)


def test_the_connector_folder_goes_first_on_the_servers_pythonpath(tmp_path, monkeypatch):
    model = tmp_path / "model"
    LlamaConfig(num_hidden_layers=1, max_position_embeddings=64).save_pretrained(model)
    engine = Engine(command=("python", "-m", "vllm"), prefix=tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/theirs")
    options = ServeOptions(device="cpu", dtype="float32", threads=1, python_path=(str(tmp_path / "python"),))
    _, env, settings = server_plan(str(model), options, None, 1, engine)
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "python"), "/theirs"])
    assert settings["environment"]["PYTHONPATH"] == env["PYTHONPATH"]  # recorded with the server's settings
    _, env, _ = server_plan(str(model), ServeOptions(device="cpu", dtype="float32", threads=1), None, 1, engine)
    assert "PYTHONPATH" not in env  # the caller's own, inherited unchanged


def test_the_vllm_environment_imports_the_connector_and_names_files_as_draftsmith_does(engine, tmp_path):
    folder = install_connector(tmp_path / "python")
    assert sorted(p.name for p in folder.iterdir()) == ["draftsmith_vllm_connector.py"]  # nothing else of ours
    probe = (
        "import draftsmith_vllm_connector as c\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import "
        "ExampleHiddenStatesConnector as E\n"
        "assert issubclass(c.DraftsmithHiddenStatesConnector, E)\n"
        "print(c.prompt_file_name([5, 6, 7]), c.prompt_file_name([]))"
    )
    python = engine.prefix / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", probe], env=os.environ | {"PYTHONPATH": str(folder)}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [prompt_file_name([5, 6, 7]), prompt_file_name([])]


def write_connector_file(storage, token_ids, states):
    """A file as the connector writes it: (L, layers, H) states and the prompt's ids, beside its released lock."""
    path = storage / prompt_file_name(token_ids)
    save_file({"hidden_states": states, "token_ids": torch.tensor(token_ids)}, path)
    path.with_name(path.name + ".lock").touch()
    return path


def test_a_prompts_connector_file_is_read_once_and_removed(tmp_path):
    storage = tmp_path / "states"
    storage.mkdir()
    states = torch.randn(3, 3, 4)  # (L, aux layers, H)
    path = write_connector_file(storage, [5, 6, 7], states)
    found = take_hidden_states(storage, [5, 6, 7], [27, 2, 15])
    assert sorted(found) == [2, 15, 27]
    for i, layer in enumerate([2, 15, 27]):  # the server's aux layers in sorted order
        assert torch.equal(found[layer], states[:, i])
    assert list(storage.iterdir()) == []  # the file and its lock are gone
    with pytest.raises(DraftsmithError, match=f"wrote no hidden states into {path}"):
        take_hidden_states(storage, [5, 6, 7], [2, 15, 27])
    other = write_connector_file(storage, [9, 8], torch.randn(2, 3, 4))
    other.rename(path)  # a prompt's name over another prompt's states
    with pytest.raises(DraftsmithError, match="holds the states of another prompt"):
        take_hidden_states(storage, [5, 6, 7], [2, 15, 27])
    write_connector_file(storage, [9, 8], torch.randn(2, 3, 4))
    with pytest.raises(DraftsmithError, match=r"hidden_states of shape \(2, 3, 4\) for 2 tokens and layers \[2, 15\]"):
        take_hidden_states(storage, [9, 8], [2, 15])


def test_hidden_layers_vllm_cannot_give_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "d"
    store = ["--teacher-cache", "4", "--hidden-layers", "2,15"]
    assert main(builtin_args(out, "--engine", "vllm", "--engine-url", f"http://{HOST}:9", *store)) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--hidden-layers with --engine vllm needs a server draftsmith starts" in err
    # 31 is past the target's layers for any engine; 30 (its normed output) is one only draftsmith gives
    resolve_model("smollm2-135m-instruct")  # the layer count is read from its config: converted once, first
    capsys.readouterr()
    assert main(builtin_args(out, "--engine", "vllm", "--teacher-cache", "4", "--hidden-layers", "2,30,31")) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--hidden-layers 31: this target has 30 layers" in err
    assert main(builtin_args(out, "--engine", "vllm", "--teacher-cache", "4", "--hidden-layers", "2,30")) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert "--hidden-layers 30 with --engine vllm: vLLM gives the states entering layers 0 to 29" in err
    assert not out.exists()  # nothing was answered, cached or started


BF16 = 1.6e-2  # torch's bfloat16 tolerance: both stores round float32 states to bfloat16 once
LOGP = 2e-2  # log-probs of two engines in float32, stored in float16


def feature_store_of(folder: Path) -> Store:
    """A dataset folder's one feature store (nothing else is left in feature-store/: no connector files)."""
    (store,) = (folder / "feature-store").iterdir()
    return Store(store)


def assert_same_features(theirs: Store, ours: Store, layers: list[int]) -> None:
    """vLLM's store holds draftsmith's features of the same rows: every hidden state within bfloat16
    tolerance, the top-1 token wherever draftsmith's margin over the second exceeds the log-probs' tolerance."""
    assert theirs.meta["content"] == ours.meta["content"]  # the same rows: vLLM's greedy answers are draftsmith's
    for key in ("examples", "tokens", "top_k", "layers", "hidden_size", "hidden_dtype"):
        assert theirs.meta[key] == ours.meta[key], key
    clear_rows = 0
    for digest, (ids, logps) in ours.entries.items():
        their_ids, their_logps = theirs.entries[digest]
        length = ours.where[digest][2]
        assert theirs.where[digest][2] == length
        mine = ours.hidden([digest], layers, length, torch.float32, torch.device("cpu"))  # (1, L, H) per layer
        got = theirs.hidden([digest], layers, length, torch.float32, torch.device("cpu"))
        for layer in layers:
            torch.testing.assert_close(got[layer], mine[layer], rtol=BF16, atol=BF16)
        clear = logps[:, 0] - logps[:, 1] > LOGP
        assert torch.equal(their_ids[clear, 0], ids[clear, 0])
        torch.testing.assert_close(their_logps[:, 0], logps[:, 0], rtol=0, atol=LOGP)
        clear_rows += int(clear.sum())
    assert clear_rows >= theirs.meta["tokens"] // 2  # the top-1 comparison covers most positions


def store_args(out, *extra, layers="0,2,15,27") -> list[str]:
    """Three greedy rows, one per shard, their top 4 and the states entering ``layers``."""
    store = ["--teacher-cache", "4", "--hidden-layers", layers, "--max-length", "64"]
    return builtin_args(out, *store, *extra, prompts=3, max_new_tokens=16, shard_rows=1)


VLLM_ENGINE = ["--engine", "vllm", "--engine-eager", "--engine-threads", "1"]


def test_the_vllm_feature_store_is_draftsmiths_own_build_of_the_same_rows(engine, tmp_path):
    theirs, ours = tmp_path / "vllm", tmp_path / "ours"
    assert main(store_args(theirs, *VLLM_ENGINE)) == 0
    assert main(store_args(ours)) == 0
    store = feature_store_of(theirs)
    assert len(store.meta["files"]) == 3 and store.meta["examples"] == 3  # one row per shard (--shard-rows)
    assert (store.meta["layers"], store.meta["hidden_size"], store.meta["dtype"]) == ([0, 2, 15, 27], 576, "float32")
    assert_same_features(store, feature_store_of(ours), [0, 2, 15, 27])


@pytest.fixture(scope="module")
def even_heads_target(tmp_path_factory):
    """A random Llama whose 4 heads and 2 KV heads split over 2 processes (the default target's 9 heads do
    not), with the default target's tokenizer and chat template; its head is scaled so that its
    distributions are peaked, like a trained model's, and greedy answers do not hang on near ties."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=EOS,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    folder = tmp_path_factory.mktemp("even-heads")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


KILLED_STORE_RUN = """
import os, signal, sys
from draftsmith.distill import teacher_cache
real_write = teacher_cache.write_shard
def write_then_die(folder, *args, **kwargs):
    written = real_write(folder, *args, **kwargs)
    if folder.parent.name == "feature-store":  # the first shard of the feature store, not of the top-k cache
        os.kill(os.getpid(), signal.SIGKILL)
    return written
teacher_cache.write_shard = write_then_die
from draftsmith import data
from draftsmith.cli import main
sys.exit(main(sys.argv[1:]))
"""


def processes_naming(text: str) -> list[str]:
    """The command lines of running processes that contain ``text``."""
    return subprocess.run(["pgrep", "-af", text], capture_output=True, text=True, check=False).stdout.splitlines()


def test_a_tensor_parallel_feature_build_killed_midway_resumes_to_draftsmiths_store(
    engine, even_heads_target, tmp_path
):
    theirs, ours = tmp_path / "vllm", tmp_path / "ours"
    layers = "0,1,2,3"
    command = store_args(
        theirs, *VLLM_ENGINE, "--tensor-parallel-size", "2", "--target", str(even_heads_target), layers=layers
    )
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_STORE_RUN, *command],
        cwd=ROOT,
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (folder,) = (theirs / "feature-store").glob("k4-*")
    (staging,) = (theirs / "feature-store").glob(".*.vllm-states.tmp")  # the killed build's connector files
    assert sorted(p.name for p in folder.iterdir()) == ["shard-00000.safetensors"]  # no meta.json: incomplete
    kept = (folder / "shard-00000.safetensors").stat()
    deadline = time.monotonic() + 120
    while processes_naming(str(staging)) and time.monotonic() < deadline:
        time.sleep(1)  # the killed command's server got SIGTERM and shuts its workers down
    assert processes_naming(str(staging)) == []

    assert main(command) == 0  # the same command resumes
    assert not staging.exists()
    store = feature_store_of(theirs)
    assert store.meta["files"] == [f"shard-0000{i}.safetensors" for i in range(3)]  # the kept shard and two more
    again = (folder / "shard-00000.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # not written again
    assert main(store_args(ours, "--target", str(even_heads_target), layers=layers)) == 0
    assert_same_features(store, feature_store_of(ours), [0, 1, 2, 3])


def test_a_failed_feature_build_removes_its_connector_files(even_heads_target, tmp_path, monkeypatch):
    out = tmp_path / "d"
    assert main(store_args(out, "--target", str(even_heads_target), layers="1,2")) == 0  # the rows, by draftsmith
    shutil.rmtree(out / "feature-store")
    seen = []

    @contextmanager
    def dying_server(model, options, **kwargs):
        staging = Path(options.python_path[0]).parent
        seen.append(sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")))
        raise DraftsmithError("the vLLM server exited with status 1 before it was ready")
        yield

    monkeypatch.setattr(data, "serve", dying_server)
    args = data.parser().parse_args(store_args(out, *VLLM_ENGINE, "--target", str(even_heads_target), layers="1,2")[1:])
    options = data.serve_options(args, torch.device("cpu"), torch.float32)
    with pytest.raises(DraftsmithError, match="exited with status 1"):
        data.vllm_feature_store(args, options, torch.float32, out)
    assert seen == [["python", "python/draftsmith_vllm_connector.py"]]  # the connector, installed for the server
    assert list((out / "feature-store").iterdir()) == []  # its folder is gone, and no store was begun
