"""The launch configs in configs/accelerate read through accelerate's own config reader and launcher,
with the settings their comments promise (FSDP2 for fsdp.yaml)."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env
from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


@pytest.mark.parametrize(
    ("name", "distributed_type"),
    [
        ("cpu-2proc.yaml", DistributedType.MULTI_CPU),
        ("ddp.yaml", DistributedType.MULTI_GPU),
        ("fsdp.yaml", DistributedType.FSDP),
    ],
)
def test_each_config_reads_through_accelerates_reader_and_opens_with_its_command(name, distributed_type):
    path = CONFIGS / name
    config = load_config_from_file(str(path))  # refuses keys accelerate does not know
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == distributed_type
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# accelerate launch --config_file configs/accelerate/{name} -m draftsmith.cli distill")


def test_fsdp_config_launches_fsdp2_with_the_settings_it_names(monkeypatch):
    path = CONFIGS / "fsdp.yaml"
    fsdp = load_config_from_file(str(path)).fsdp_config
    assert fsdp == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT",
    }
    # What `accelerate launch --config_file configs/accelerate/fsdp.yaml` hands each process, short of starting them.
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "draftsmith.cli", "distill"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes == 8
    env = {key: value for key, value in prepare_multi_gpu_env(args).items() if key.startswith("FSDP_")}
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert env["FSDP_STATE_DICT_TYPE"] == "FULL_STATE_DICT"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # as the Accelerator of each process reads it
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.cpu_ram_efficient_loading is True
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # parameters stay on the GPUs
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
