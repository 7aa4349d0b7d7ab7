"""Atomic writes: the destination holds the old version or the new one, never a half, and no temporary is left."""

from pathlib import Path

import pytest

from draftsmith.specdec.files import atomic_path, write_text


def test_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_text(path, "one")
    write_text(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "report.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_folder_replaces_a_non_empty_folder(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "stale.bin").write_text("x")
    with atomic_path(final) as tmp:
        assert not tmp.exists() and tmp.parent == tmp_path and tmp.name.startswith(".model.")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_folder_is_removed(tmp_path):
    with pytest.raises(ValueError), atomic_path(Path(tmp_path / "model")) as tmp:
        tmp.mkdir()
        (tmp / "part").write_text("x")
        raise ValueError
    assert list(tmp_path.iterdir()) == []
