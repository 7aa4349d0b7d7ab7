"""What a measurement ran on: the processor, the instruction sets that decide its matrix kernels,
the threads, the load and the library versions.

A speedup on a CPU depends on whether it multiplies bfloat16 in hardware (avx512_bf16, AMX) or
emulates it, so every report that carries a measured figure also carries these (``machine``), and
the one-line ``describe`` heads the Markdown reports."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import transformers

# the x86 instruction sets that change which kernels torch runs, as /proc/cpuinfo names them
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of ``FLAGS`` this CPU reports, sorted."""
    words = set(_cpuinfo().split())
    return sorted(flag for flag in FLAGS if flag in words)


def machine() -> dict:
    """The facts a figure was measured under, as the JSON reports keep them."""
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def describe() -> str:
    """One line: the GPU's name, or the CPU with its instruction sets and the threads used of those there are."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    flags = ", ".join(cpu_flags()) or "none of " + ", ".join(FLAGS)
    return f"{cpu_model()} ({flags}), {torch.get_num_threads()} threads of {os.cpu_count()}"


@torch.inference_mode()
def memory_read_bandwidth(size: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory: a sum over ``size`` bytes of float32, larger
    than a CPU's caches, the fastest of ``repeats`` (the one another process disturbed least), on
    torch's threads. A decoding step that reads weights of W bytes takes at least W over it."""
    data = torch.ones(size // 4, dtype=torch.float32)
    data.sum()  # faults the pages in
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        fastest = min(fastest, time.perf_counter() - start)
    return data.numel() * 4 / fastest
