import os

import pytest
import torch

# No hub is reachable in CI; fail fast instead of waiting on network timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def _draftsmith_home(tmp_path_factory):
    """Converted models and caches go to a session folder unless DRAFTSMITH_HOME is set (to reuse one)."""
    if not os.environ.get("DRAFTSMITH_HOME"):
        os.environ["DRAFTSMITH_HOME"] = str(tmp_path_factory.mktemp("draftsmith-home"))
