"""What a report records of the machine it measured on."""

from __future__ import annotations

import torch

from draftsmith.specdec.measure import machine


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
