"""Run by tests/train/test_multiprocess.py under torchrun: train each run of a plan in turn, saving this
rank's draft parameters after each (one launch for every case: the processes start and join once)."""

import gc
import json
import os
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.state import PartialState
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train


def end_training_after_ddp_is_gone(self: Accelerator) -> None:
    """Accelerator.end_training for the runs of one launch: it checks that no DDP wrapper is alive (a
    reducer freed after the process group ends can hang in gloo's destructor once the other process
    has exited) and leaves the group to the next run; the last run's group ends with the process."""
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)], "DDP outlives the group"
    for tracker in self.trackers:
        tracker.finish()


def main() -> None:
    """argv[1]: a JSON list of runs, each {"out": folder for the ranks' parameters, "home": DRAFTSMITH_HOME
    for the run or null, "items": config overrides of the tiny config}."""
    Accelerator.end_training = end_training_after_ddp_is_gone
    for run in json.loads(Path(sys.argv[1]).read_text()):
        if run["home"]:
            os.environ["DRAFTSMITH_HOME"] = run["home"]
        result = train(load_config(DistillConfig, config_path("tiny"), run["items"]))
        params = {k: v.detach().clone().contiguous() for k, v in result.draft.state_dict().items()}
        save_file(params, Path(run["out"]) / f"rank-{os.environ['RANK']}.safetensors")
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
