"""Run by tests/train/test_multiprocess.py under torchrun: train, then save this rank's draft parameters."""

import sys
from pathlib import Path

from accelerate import Accelerator
from safetensors.torch import save_file

from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train


def main() -> None:
    out = Path(sys.argv[1])
    cfg = load_config(DistillConfig, str(Path(__file__).parents[2] / "configs" / "tiny.yaml"), sys.argv[2:])
    end_training = Accelerator.end_training

    def save_then_end(accelerator: Accelerator) -> None:
        draft = accelerator.unwrap_model(accelerator._models[0])  # the one model the loop prepared
        params = {k: v.detach().clone().contiguous() for k, v in draft.state_dict().items() if "lm_head" not in k}
        save_file(params, out / f"rank-{accelerator.process_index}.safetensors")
        accelerator.wait_for_everyone()
        end_training(accelerator)

    Accelerator.end_training = save_then_end
    train(cfg)


if __name__ == "__main__":
    main()
