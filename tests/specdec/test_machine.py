"""What a report records of the machine it measured on."""

from __future__ import annotations

import torch

from draftsmith.specdec.measure import machine
from draftsmith.specdec.measure.costs import step_weight_bytes
from tests.helpers import tiny_llama


def test_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512vl\n\n"
        "processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512vl\n"
    )
    monkeypatch.setattr(machine, "_cpuinfo", info.read_text)
    assert machine.cpu_model() == "Some CPU 9000"
    assert machine.cpu_flags() == ["avx2", "avx512_bf16", "avx512f"]  # only the kernel-deciding ones, sorted
    facts = machine.machine()
    assert facts["cpu"] == "Some CPU 9000" and facts["cpu_flags"] == ["avx2", "avx512_bf16", "avx512f"]
    assert facts["torch_threads"] == torch.get_num_threads()
    if not torch.cuda.is_available():
        line = machine.describe()
        assert line.startswith("Some CPU 9000 (avx2, avx512_bf16, avx512f), ")
        assert f"{torch.get_num_threads()} threads of" in line


def test_a_cpu_without_them_says_so(monkeypatch):
    monkeypatch.setattr(machine, "_cpuinfo", lambda: "model name\t: Old CPU\nflags\t\t: fpu sse sse2\n")
    assert machine.cpu_flags() == []
    if not torch.cuda.is_available():
        assert machine.describe().startswith("Old CPU (none of avx2, avx512f, avx512_bf16, amx_bf16, amx_tile), ")


def test_memory_bandwidth_is_the_bytes_read_over_the_fastest_pass(monkeypatch):
    passes = iter([0.0, 4.0, 10.0, 12.0, 20.0, 21.0, 30.0, 33.0])  # start/end of each pass: 4, 2, 1, 3 s
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(passes))
    assert machine.memory_read_bandwidth(size=2**20, repeats=4) == 2**20  # 1 MiB read in the fastest, 1 s


def test_a_step_reads_each_linear_weight_once():
    model = tiny_llama(vocab=32, layers=2, hidden=32)  # q, o: 32 x 32; k, v: 16 x 32; mlp: 3 of 64 x 32; head 32 x 32
    per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32
    assert step_weight_bytes(model) == 4 * (2 * per_layer + 32 * 32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the embeddings are read as the head, once
    assert step_weight_bytes(model) == 4 * (2 * per_layer + 32 * 32)
    assert step_weight_bytes(model.to(torch.bfloat16)) == 2 * (2 * per_layer + 32 * 32)
