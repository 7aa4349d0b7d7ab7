import importlib.util
import os

import pytest
import torch

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.pacing import forget
from draftsmith.specdec.vllm_server import find_engine
from draftsmith.train.cpu_setup import usable_cpus

# No hub is reachable in CI; fail fast instead of waiting on network timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every vLLM server of the suite (several may run at once) takes a KV cache of 1 GiB: the tests' prompts are short.
os.environ.setdefault("DRAFTSMITH_VLLM_KV_CACHE_GIB", "1")
# Under pytest-xdist (`make test` runs two workers) the cores are shared between the workers. Training
# sets its process's threads from the CPUs it may use, capped by OMP_NUM_THREADS (``train.cpu_setup``),
# and the commands a test starts inherit it. The cap is set in ``pytest_configure`` from the number of
# workers, in the controller as in each worker: the workers inherit the controller's environment, so a
# cap the controller set for one process would give every worker all the cores. Two workers of two
# OpenMP threads each on two cores wait on each other's barriers and run many times slower.

USER_THREADS = "DRAFTSMITH_TEST_THREADS_GIVEN"


def suite_processes(config: pytest.Config) -> int:
    """How many processes run the suite: pytest-xdist's workers (``-n``), or this one."""
    if hasattr(config, "workerinput"):  # inside an xdist worker
        return int(config.workerinput["workercount"])
    chosen = getattr(config.option, "numprocesses", None)
    if chosen in ("auto", "logical"):
        return usable_cpus()
    return int(chosen) if chosen else 1


def pytest_configure(config: pytest.Config) -> None:
    # Whether the cap was the user's: the first process to get here (the controller) records it for all.
    os.environ.setdefault(USER_THREADS, "1" if "OMP_NUM_THREADS" in os.environ else "0")
    threads = max(1, min(2, usable_cpus() // suite_processes(config)))  # the cores training counts
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(min(threads, int(os.environ["OMP_NUM_THREADS"])))


# Decoder tests run on every device this machine has, or on those DRAFTSMITH_TEST_DEVICES names
# (comma-separated; the GPU check runs them on CUDA alone).
DEVICES = [name for name in os.environ.get("DRAFTSMITH_TEST_DEVICES", "").split(",") if name] or (
    ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
)

# Packages some images lack (the GPU check's has neither datasets nor gguf).
MISSING_PACKAGES = [name for name in ("datasets", "gguf") if importlib.util.find_spec(name) is None]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that cannot be imported because it needs a missing optional package, directly or
    through the library, is skipped, as ``pytest.importorskip`` at its top would skip it."""
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        for name in MISSING_PACKAGES:
            if f"No module named '{name}'" in str(report.longrepr):
                report.outcome = "skipped"
                report.longrepr = (str(collector.path), None, f"Skipped: {name} is not installed")
    return report


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="session", autouse=True)
def _draftsmith_home(tmp_path_factory):
    """Converted models and caches go to a session folder unless DRAFTSMITH_HOME is set (to reuse one).
    Under pytest-xdist the workers share one (the folder above each worker's own): the default target
    is converted once, and what two workers write at once is written atomically either way."""
    if not os.environ.get("DRAFTSMITH_HOME"):
        base = tmp_path_factory.getbasetemp()
        home = base.parent / "draftsmith-home" if "PYTEST_XDIST_WORKER" in os.environ else base / "draftsmith-home"
        home.mkdir(exist_ok=True)
        os.environ["DRAFTSMITH_HOME"] = str(home)


@pytest.fixture(params=[False, True], ids=["cpu-without-native-bfloat16", "cpu-with-native-bfloat16"])
def native_bfloat16(request, monkeypatch) -> bool:
    """``auto`` dtypes chosen as on a CPU without, then with, native bfloat16 (``loading.cpu_has_native_bfloat16``),
    whatever this CPU has: a test that asserts what ``auto`` picked runs both ways on every machine."""
    from draftsmith.specdec import loading, stream

    for module in (loading, stream):  # stream holds its own reference to the function
        monkeypatch.setattr(module, "cpu_has_native_bfloat16", lambda: request.param)
    return request.param


@pytest.fixture(autouse=True)
def pacers_start_knowing_nothing():
    """Each test's decoding calls start without what an earlier test's pacers learned of the same
    models (``pacing.PaceMemory``): a test that fakes the clock must not read another's seconds."""
    forget()
    yield
    forget()


@pytest.fixture(scope="module")
def one_torch_thread():
    """The bundled decoder on one thread, as a vLLM server beside it: two OpenMP threads crawl on a
    machine other jobs load. Modules that time both engines use it (``pytest.mark.usefixtures``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine():
    """The vLLM environment ``make vllm`` installs (or ``$DRAFTSMITH_VLLM``); tests needing it skip without it."""
    try:
        return find_engine()
    except DraftsmithError as err:
        pytest.skip(f"no vLLM environment: {err}")
