"""Run by tests/train/test_multiprocess.py under torchrun: train each run of a plan in turn, saving this
rank's draft parameters after each (one launch for every case: the processes start and join once)."""

import json
import os
import sys
from pathlib import Path

from accelerate.state import PartialState
from safetensors.torch import save_file

from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train


def main() -> None:
    """argv[1]: a JSON list of runs, each {"out": folder for the ranks' parameters, "home": DRAFTSMITH_HOME
    for the run or null, "items": config overrides of the tiny config}."""
    for run in json.loads(Path(sys.argv[1]).read_text()):
        if run["home"]:
            os.environ["DRAFTSMITH_HOME"] = run["home"]
        result = train(load_config(DistillConfig, config_path("tiny"), run["items"]))
        params = {k: v.detach().clone().contiguous() for k, v in result.draft.state_dict().items()}
        save_file(params, Path(run["out"]) / f"rank-{os.environ['RANK']}.safetensors")
        PartialState._reset_state()  # the run ended the process group; the next run starts its own


if __name__ == "__main__":
    main()
