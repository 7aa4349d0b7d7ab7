"""vLLM as the engine: a real server on the CPU with the default target, against the bundled decoder.

The tests marked ``vllm`` start real vLLM servers from the environment ``make vllm`` installs and skip
(with the reason) where there is none. Each server starts once for the module (float32, eager, so
no torch.compile warm-up; one thread, which stays fast on a machine other jobs share). The unmarked
tests at the top check the pieces that need no engine.
"""

import json
import socket
import stat

import pytest
import torch

from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.measure.vllm_pair import measure_engine_pair
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.vllm_client import (
    SpecCounters,
    complete,
    complete_batch,
    parse_spec_counters,
    read_spec_counters,
)
from draftsmith.specdec.vllm_server import (
    ENGINE_VARIABLE,
    HOST,
    KV_CACHE_VARIABLE,
    Engine,
    ServeOptions,
    check_port_free,
    connect,
    find_engine,
    free_port,
    group_alive,
    serve,
    server_arguments,
    server_environment,
)
from tests.helpers import first_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the bundled decoder beside vLLM

QUESTIONS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]
MAX_TOKENS = 24
GAMMA = 3
ONE_THREAD = ServeOptions(dtype="float32", eager=True, threads=1)  # no torch.compile warm-up; see the docstring

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 68.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.796068747282468e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 204.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 101.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 31.0
vllm:prompt_tokens_total{engine="0",model_name="t"} 4.0
"""


def test_metrics_text_gives_the_speculative_counters():
    counters = parse_spec_counters(METRICS)
    assert counters == SpecCounters(drafts=68, draft_tokens=204, accepted=101, accepted_per_position=[50, 31, 20])
    assert counters.acceptance_rate == pytest.approx(101 / 204)
    assert counters.mean_accepted_tokens == pytest.approx(1 + 101 / 68)
    assert counters.acceptance_per_position == pytest.approx([50 / 68, 31 / 68, 20 / 68])
    assert parse_spec_counters("vllm:prompt_tokens_total 3.0\n") == SpecCounters()


def test_counter_differences_keep_only_what_happened_between_readings():
    before = SpecCounters(drafts=4, draft_tokens=12, accepted=12, accepted_per_position=[4, 4, 4])
    after = SpecCounters(drafts=10, draft_tokens=30, accepted=15, accepted_per_position=[6, 5, 4])
    assert after - before == SpecCounters(drafts=6, draft_tokens=18, accepted=3, accepted_per_position=[2, 1, 0])
    assert (after - before) + before == after
    assert (after - after).acceptance_rate is None


def test_server_arguments_name_the_draft_and_gamma():
    speculative = {"method": "draft_model", "model": "/m/draft"}  # as the draft's kind gives it
    args = server_arguments("/m/target", 8123, "float32", ServeOptions(eager=True), speculative, gamma=4)
    assert args[:6] == ["--model", "/m/target", "--host", "127.0.0.1", "--port", "8123"]
    assert "--enforce-eager" in args and "--no-enable-prefix-caching" in args
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}


def test_server_arguments_pass_a_kinds_own_speculative_settings_through():
    speculative = {"method": "eagle3", "model": "/m/head", "parallel_drafting": True}
    args = server_arguments("/m/target", 8123, "float32", ServeOptions(), speculative, gamma=3)
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {"method": "eagle3", "model": "/m/head", "parallel_drafting": True, "num_speculative_tokens": 3}
    assert "--speculative-config" not in server_arguments("/m/target", 8123, "float32", ServeOptions())


def test_cpu_servers_prefill_every_prompt_in_one_step(tmp_path):
    # vLLM's CPU backend kills the engine when a seeded request's prompt is split over steps.
    eager = ServeOptions(eager=True)
    limited = ServeOptions(eager=True, max_model_len=512)
    args = server_arguments("/m/t", 1, "float32", limited, whole_prefills=True)
    assert args[args.index("--no-enable-chunked-prefill") + 1 :][:2] == ["--max-num-batched-tokens", "512"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    args = server_arguments(str(tmp_path), 1, "float32", eager, whole_prefills=True)
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    args = server_arguments("/m/t", 1, "float32", eager)
    assert "--no-enable-chunked-prefill" not in args and "--max-num-batched-tokens" not in args


def test_the_kv_cache_default_is_2_gib_or_the_variables(monkeypatch):
    monkeypatch.delenv(KV_CACHE_VARIABLE, raising=False)
    assert ServeOptions().kv_cache_gib == 2
    monkeypatch.setenv(KV_CACHE_VARIABLE, "1")
    assert ServeOptions().kv_cache_gib == 1 and ServeOptions(kv_cache_gib=3).kv_cache_gib == 3
    monkeypatch.setenv(KV_CACHE_VARIABLE, "half")
    with pytest.raises(DraftsmithError, match=f"{KV_CACHE_VARIABLE}='half' must be a whole number of GiB >= 1"):
        ServeOptions()


def test_cpu_environment_sets_threads_kv_cache_and_openmp(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    engine = Engine(command=("python",), prefix=tmp_path)
    env = server_environment(engine, "cpu", threads=1, kv_cache_gib=3)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    assert env["VLLM_HOST_IP"] == HOST and env["VLLM_NO_USAGE_STATS"] == "1"
    with pytest.raises(DraftsmithError, match="threads must be between 1 and"):
        server_environment(engine, "cpu", threads=10_000, kv_cache_gib=3)


def test_engine_variable_must_name_an_executable(tmp_path, monkeypatch):
    plain = tmp_path / "python"
    plain.write_text("")
    monkeypatch.setenv(ENGINE_VARIABLE, str(plain))
    with pytest.raises(DraftsmithError, match="is not an executable file; run `make vllm`"):
        find_engine()
    plain.chmod(plain.stat().st_mode | stat.S_IXUSR)
    engine = find_engine()
    assert engine.command == (str(plain), "-m", "vllm.entrypoints.openai.api_server")
    assert engine.prefix == tmp_path.parent


def test_engine_variable_may_name_the_environments_folder(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.chmod(0o755)
    monkeypatch.setenv(ENGINE_VARIABLE, str(tmp_path / "venv"))
    engine = find_engine()
    assert engine.command == (str(python), "-m", "vllm.entrypoints.openai.api_server")
    assert engine.prefix == tmp_path / "venv"
    monkeypatch.setenv(ENGINE_VARIABLE, str(tmp_path))  # a folder without bin/python
    with pytest.raises(DraftsmithError, match=f"{ENGINE_VARIABLE}=.* is not an executable file"):
        find_engine()


def test_a_port_in_use_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(DraftsmithError, match=f"port {port} on 127.0.0.1 is in use"):
            check_port_free(port)


# --- a real vLLM server ----------------------------------------------------------------------------


def test_a_url_where_no_server_answers_is_a_clear_error():
    url = f"http://{HOST}:{free_port()}"
    with pytest.raises(DraftsmithError, match=f"no vLLM server answers at {url}/v1/models"):
        connect(url)


@pytest.fixture(scope="module")
def default(engine):
    """The default target in float32, the prompts as token ids, and its greedy answers (the reference)."""
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = eos_token_ids(model, tokenizer)
    reference = [target_generate(model, [p], MAX_TOKENS, eos_ids=eos)[0][0] for p in prompts]
    return model, tokenizer, prompts, eos, reference


@pytest.fixture(scope="module")
def draft(default, tmp_path_factory):
    """The target's first 2 layers (untrained), and the model folder vLLM loads it from."""
    model, tokenizer, *_ = default
    folder = tmp_path_factory.mktemp("draft-2-layers")
    draft = first_layers(model, 2)
    draft.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return draft, folder


@pytest.fixture(scope="module")
def target_server(engine, default, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-logs") / "target.log"
    with serve(DEFAULT_TARGET, ONE_THREAD, engine=engine, log_path=log) as server:
        yield server
    assert not group_alive(server.process.pid)  # the server and the engine's workers are gone


@pytest.fixture(scope="module")
def draft_server(engine, default, draft, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-logs") / "draft.log"
    speculative = {"method": "draft_model", "model": str(draft[1])}
    with serve(DEFAULT_TARGET, ONE_THREAD, speculative=speculative, gamma=GAMMA, engine=engine, log_path=log) as server:
        yield server
    assert not group_alive(server.process.pid)


@pytest.mark.vllm
def test_greedy_output_equals_the_bundled_decoders_one_by_one_and_batched(target_server, default):
    *_, prompts, _, reference = default
    one_by_one = [complete(target_server, p, MAX_TOKENS).token_ids for p in prompts]
    assert one_by_one == reference
    batched, seconds = complete_batch(target_server, prompts, MAX_TOKENS, batch_size=len(prompts))
    assert [a.token_ids for a in batched] == reference
    assert seconds > 0
    assert read_spec_counters(target_server) == SpecCounters()  # no draft, no counters


@pytest.mark.vllm
def test_a_running_server_is_reached_by_its_url(target_server, default):
    server = connect(target_server.url + "/")
    assert (server.url, server.model_name, server.process) == (target_server.url, target_server.model_name, None)
    *_, prompts, _, reference = default
    assert complete(server, prompts[0], MAX_TOKENS).token_ids == reference[0]


@pytest.fixture(scope="module")
def draft_run(draft_server, default):
    """The prompts answered one by one through the draft server, and what its counters grew by."""
    *_, prompts, _, _ = default
    before = read_spec_counters(draft_server)
    answers, _ = complete_batch(draft_server, prompts, MAX_TOKENS, batch_size=1)
    return answers, read_spec_counters(draft_server) - before


@pytest.mark.vllm
def test_greedy_output_with_a_truncated_draft_equals_the_target_alone(draft_run, default):
    answers, _ = draft_run
    assert [a.token_ids for a in answers] == default[-1]


@pytest.mark.vllm
def test_acceptance_counters_match_the_tokens_drafted_and_emitted(draft_run, default, draft):
    model, _, prompts, eos, _ = default
    answers, grown = draft_run
    assert grown.draft_tokens == GAMMA * grown.drafts
    assert 0 <= grown.accepted <= grown.draft_tokens
    assert len(grown.accepted_per_position) == GAMMA
    assert sum(grown.accepted_per_position) == grown.accepted
    assert grown.accepted_per_position == sorted(grown.accepted_per_position, reverse=True)
    # Every round emits its accepted tokens plus one of the target's; the prefill emits each first token.
    # The last round of an answer may run past max_tokens (the surplus is cut), never short of it.
    emitted = sum(len(a.token_ids) - 1 for a in answers)
    assert emitted <= grown.drafts + grown.accepted <= emitted + GAMMA * len(prompts)
    # vLLM runs the same rounds and accepts the same tokens as the bundled decoder with this draft.
    # (It always drafts gamma tokens; the bundled decoder drafts fewer when max_tokens is that close.)
    options = DecodeOptions(gamma=GAMMA)
    bundled = [speculative_generate(model, draft[0], [p], MAX_TOKENS, options, eos_ids=eos)[1] for p in prompts]
    assert grown.drafts == sum(stats.rounds for stats in bundled)
    assert grown.accepted == sum(stats.accepted for stats in bundled)


@pytest.mark.vllm
def test_engine_pair_report_agrees_with_its_counters(target_server, draft_server, default):
    *_, prompts, _, _ = default
    report = measure_engine_pair(target_server, draft_server, prompts[:2], max_tokens=16, batch_size=2, repeats=2)
    assert report.greedy_match == 1.0
    assert report.gamma == GAMMA and report.batch_size == 2 and report.repeats == 2
    assert report.proposed == GAMMA * report.drafts
    assert report.acceptance_rate == pytest.approx(report.accepted / report.proposed)
    assert report.mean_accepted_tokens == pytest.approx(1 + report.accepted / report.drafts)
    assert report.speedup == pytest.approx(report.spec_tokens_per_s / report.target_tokens_per_s)
    low, high = report.speedup_spread
    assert low <= report.speedup <= high
    assert report.speculative_server["environment"]["OMP_NUM_THREADS"] == "1"
    keys = {"engine", "acceptance_rate", "acceptance_per_position", "mean_accepted_tokens", "target_tokens_per_s"}
    keys |= {"spec_tokens_per_s", "speedup", "speedup_per_repeat", "speedup_spread", "target_tokens_per_s_per_repeat"}
    keys |= {"spec_tokens_per_s_per_repeat", "drafts", "proposed", "accepted", "greedy_match", "gamma", "batch_size"}
    keys |= {"max_new_tokens", "repeats", "prompts", "temperature", "top_k", "top_p", "baseline_server"}
    assert set(json.loads(json.dumps(report.to_json()))) == keys | {"speculative_server"}  # as it was always written


@pytest.mark.vllm
def test_the_server_and_its_workers_are_gone_after_an_exception_and_its_port_is_refused_meanwhile(engine, default):
    stopped = pytest.raises(RuntimeError, match="stop inside the block")
    with stopped, serve(DEFAULT_TARGET, ONE_THREAD, engine=engine) as server:
        group = server.process.pid
        port = int(server.url.rsplit(":", 1)[1])
        refused = pytest.raises(DraftsmithError, match=f"port {port} on 127.0.0.1 is in use")
        with refused, serve(DEFAULT_TARGET, ServeOptions(port=port), engine=engine):
            pass
        assert group_alive(group)
        raise RuntimeError("stop inside the block")
    assert not group_alive(group)
    assert server.process.returncode is not None


@pytest.mark.vllm
def test_a_wrong_model_path_is_a_clear_error(engine, tmp_path):
    missing = pytest.raises(DraftsmithError, match="model not found: .*no-such-model")
    with missing, serve(str(tmp_path / "no-such-model"), engine=engine):
        pass
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    failed = pytest.raises(DraftsmithError, match="exited with status .* before it was ready")
    log = tmp_path / "broken.log"
    with failed as caught, serve(str(broken), ServeOptions(eager=True), engine=engine, log_path=log):
        pass
    assert str(log) in str(caught.value)
    assert len(str(caught.value).splitlines()) > 5  # the log's last lines come with the message
