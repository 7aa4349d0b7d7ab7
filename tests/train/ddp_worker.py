"""Run by tests/train/test_multiprocess.py under torchrun: train, then save this rank's draft parameters."""

import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train


def main() -> None:
    out = Path(sys.argv[1])
    result = train(load_config(DistillConfig, config_path("tiny"), sys.argv[2:]))
    params = {k: v.detach().clone().contiguous() for k, v in result.draft.state_dict().items()}
    save_file(params, out / f"rank-{os.environ['RANK']}.safetensors")


if __name__ == "__main__":
    main()
