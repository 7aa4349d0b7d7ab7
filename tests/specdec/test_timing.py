"""Model modes around measurements."""

import pytest
import torch

from draftsmith.specdec.clock import eval_mode


def test_eval_mode_gives_each_model_its_own_mode_back_even_after_an_error():
    training, frozen = torch.nn.Linear(2, 2).train(), torch.nn.Linear(2, 2).eval()
    with eval_mode(training, frozen):
        assert not training.training and not frozen.training
    assert training.training and not frozen.training
    with pytest.raises(RuntimeError, match="stop"), eval_mode(training):
        raise RuntimeError("stop")
    assert training.training
