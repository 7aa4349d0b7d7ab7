"""The suite's own set-up: its processes together run no more OpenMP threads than the machine has cores."""

import os

import pytest
import torch

from draftsmith.train.cpu_setup import usable_cpus
from tests.conftest import USER_THREADS, suite_processes


def test_the_suites_processes_together_run_no_more_threads_than_there_are_cores(pytestconfig):
    if os.environ[USER_THREADS] == "1":
        pytest.skip("OMP_NUM_THREADS was set by whoever started the suite")
    processes, cores = suite_processes(pytestconfig), usable_cpus()
    threads = int(os.environ["OMP_NUM_THREADS"])  # what training and the commands a test starts take
    assert threads * processes <= max(cores, processes)
    assert torch.get_num_threads() <= threads
