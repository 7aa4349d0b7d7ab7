"""How a training process uses its host: the threads its matrix products run on, and the memory allocator.

Threads: torch starts with as many threads as the machine has cores, whatever the CPUs the process
may run on (a container, ``taskset``) and however many training processes share them. A training
process takes the CPUs of its affinity shared evenly among the processes on this machine
(``LOCAL_WORLD_SIZE``, set by ``torchrun`` / ``accelerate launch``), and no more than
``OMP_NUM_THREADS`` when that is set (a user's choice, or a launcher's).

Allocator: a training step makes large temporaries (activations, logits at the loss rows) and frees
them, over and over. glibc's malloc serves blocks above its mmap threshold (at most 32 MB by
default) with fresh ``mmap`` pages and hands freed memory back to the system, so every step faults
its pages in again and the kernel zeroes them (measured: 0.65-1.5 M page faults per step, a third
of the CPU time in the system). Raising the mmap and trim thresholds keeps freed blocks in the heap
for the next step; a training process reuses the same sizes step after step, so it holds about its
peak, which it needed anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

import torch

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 1 << 30  # blocks up to 1 GiB come from the heap and stay there once freed
NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system has one)."""
    return len(os.sched_getaffinity(0)) if sys.platform.startswith("linux") else os.cpu_count() or 1


def process_threads(local_processes: int) -> int:
    """Threads for one of ``local_processes`` training processes on this machine: the CPUs this process
    may run on, shared evenly, capped by ``OMP_NUM_THREADS`` when set."""
    threads = max(1, usable_cpus() // max(1, local_processes))
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(cap)) if cap.isdigit() and int(cap) > 0 else threads


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks up to ``KEEP_BELOW`` for reuse instead of unmapping them
    (no page faults for the next step's temporaries); False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":  # macOS, Windows, musl: other allocators, other knobs
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def set_up_host(local_processes: int) -> str:
    """Set this training process's threads and allocator; the line that says what was set."""
    threads = process_threads(local_processes)
    torch.set_num_threads(threads)
    allocator = "freed memory kept for reuse" if keep_freed_memory() else "allocator as the system sets it"
    return f"host: {threads} threads ({usable_cpus()} CPUs for {local_processes} local process(es)), {allocator}"


def local_processes(num_processes: int) -> int:
    """The training processes on this machine: ``LOCAL_WORLD_SIZE`` from the launcher, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
