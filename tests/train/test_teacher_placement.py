"""A teacher larger than one GPU under N processes: each process loads its copy onto its own GPUs only."""

import pytest

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train.models import TeacherPlacement, teacher_placement

GIB = 2**30


def test_each_of_n_processes_gets_its_own_share_of_the_visible_gpus_with_max_memory():
    memory = [80 * GIB] * 8
    plans = [teacher_placement("auto", rank, 2, memory) for rank in range(2)]
    # rank r: GPUs r, r + 2, ... (its own cuda:r, where its draft lives, among them), 90 % of each
    assert plans[0] == TeacherPlacement("auto", {0: 72 * GIB, 2: 72 * GIB, 4: 72 * GIB, 6: 72 * GIB})
    assert plans[1] == TeacherPlacement("auto", {1: 72 * GIB, 3: 72 * GIB, 5: 72 * GIB, 7: 72 * GIB})
    four = [set(teacher_placement("auto", rank, 4, memory).max_memory) for rank in range(4)]
    assert four == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]  # disjoint, all eight used
    mixed = teacher_placement("auto", 1, 2, [40 * GIB, 80 * GIB], share=0.5)
    assert mixed.max_memory == {1: 40 * GIB}


def test_one_process_or_no_auto_keeps_the_setting_as_given():
    assert teacher_placement("auto", 0, 1, [80 * GIB] * 8) == TeacherPlacement("auto")  # all GPUs, as before
    assert teacher_placement(None, 3, 8, [80 * GIB] * 8) == TeacherPlacement(None)  # the process's own device
    assert teacher_placement("balanced", 0, 2, [80 * GIB] * 2) == TeacherPlacement("balanced")


def test_gpus_that_do_not_divide_among_the_processes_are_refused_in_one_line():
    with pytest.raises(DraftsmithError, match="needs a multiple of 4 visible GPUs .* found 6"):
        teacher_placement("auto", 0, 4, [80 * GIB] * 6)
    with pytest.raises(DraftsmithError, match="needs a multiple of 2 visible GPUs .* found 0"):
        teacher_placement("auto", 0, 2, [])
