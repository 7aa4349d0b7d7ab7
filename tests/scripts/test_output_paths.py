"""Output paths that are not regular files: a symbolic link keeps pointing where it did (its target is
written), and a device or FIFO is written through in place, never renamed over or turned into a file."""

import os
import stat
import threading
from pathlib import Path

import pytest

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import check_writable, write_text


def kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode) else "char" if stat.S_ISCHR(mode) else "file"


def test_a_link_to_a_file_stays_a_link_and_its_target_is_replaced(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    check_writable(link, "--json out.json")
    write_text(link, "new\n")
    assert kind(link) == "link" and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "real.json"]


def test_a_link_to_nothing_creates_its_target(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "made.json")
    write_text(link, "made\n")
    assert kind(link) == "link" and (tmp_path / "made.json").read_text() == "made\n"


def test_a_fifo_is_written_through_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    check_writable(fifo, "--json pipe")
    write_text(fifo, '{"alpha": 0.5}\n')
    reader.join(timeout=10)
    assert got == ['{"alpha": 0.5}\n']
    assert kind(fifo) == "fifo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_link_to_standard_output_prints_and_stays_a_link(tmp_path, capfd):
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    write_text(link, "to the terminal\n")
    assert "to the terminal\n" in capfd.readouterr().out
    assert kind(link) == "link" and os.readlink(link) == "/proc/self/fd/1"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_dev_full_refuses_in_one_line_and_stays_a_device():
    check_writable(Path("/dev/full"), "--json /dev/full")  # writable: the device says full only when written
    with pytest.raises(
        DraftsmithError, match=r"^cannot write /dev/full \(No space left on device\); give a file path$"
    ):
        write_text(Path("/dev/full"), "{}\n")
    assert kind(Path("/dev/full")) == "char"


def test_dev_null_is_written_through_and_a_device_is_no_folder():
    write_text(Path("/dev/null"), "{}\n")
    assert kind(Path("/dev/null")) == "char"
    with pytest.raises(DraftsmithError, match="--output /dev/null is a device, pipe or link to a file, not a folder"):
        check_writable(Path("/dev/null"), "--output /dev/null", folder=True)
