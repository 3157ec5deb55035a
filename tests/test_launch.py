"""common/train/launch.py: the train stage's command line on one process, one node, and a two-node
SLURM allocation (fake SLURM variables: only the command is built here; that two machine ranks
train as one machine does is tests/test_train_grpo.py's test_two_machines_match_one)."""

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from common import presets
from common.train import launch

PY = ".venv/bin/python"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_node():
    assert launch.train_command(PY, 1, None, env={}) == [PY]
    assert launch.train_command(PY, 4, "configs/accelerate/fsdp_4gpu.yaml", env={}) == [
        ".venv/bin/accelerate", "launch", "--num_processes", "4", "--config_file", "configs/accelerate/fsdp_4gpu.yaml",
    ]  # fmt: skip
    # an allocation of one node is a node
    one = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu01"}
    assert launch.train_command(PY, 4, None, env=one) == [".venv/bin/accelerate", "launch", "--num_processes", "4"]


@pytest.mark.parametrize("gpus", ["1", "2", "8"])
def test_gpus_k_launches_k_fsdp2_processes(gpus):
    """GPUS=K as loop.sh's train() builds it (common.train.launch's command line, from the preset's NPROC and
    ACCEL_CONFIG): accelerate launch over K processes with FSDP2's config for K, one GPU included;
    each config is fsdp_4gpu.yaml's but for its process count (bf16 compute, full sharding, no offload)."""
    p = presets.resolve("qwen3-4b", [f"GPUS={gpus}"])
    config = f"configs/accelerate/fsdp_{gpus}gpu.yaml"
    res = subprocess.run([sys.executable, "-m", "common.train.launch", PY, p.nproc, p.accel_config], cwd=ROOT,
                         capture_output=True, text=True, check=True, env={**os.environ, "SLURM_JOB_ID": ""})
    assert res.stdout.splitlines() == [".venv/bin/accelerate", "launch", "--num_processes", gpus, "--config_file", config]
    with open(os.path.join(ROOT, config)) as f, open(os.path.join(ROOT, "configs/accelerate/fsdp_4gpu.yaml")) as g:
        mine, four = yaml.safe_load(f), yaml.safe_load(g)
    assert mine["num_processes"] == int(gpus) and mine["distributed_type"] == "FSDP" and mine["mixed_precision"] == "bf16"
    same = {k: v for k, v in four["fsdp_config"].items() if k != "fsdp_state_dict_type"}  # not read by train_grpo.py
    assert {k: mine["fsdp_config"][k] for k in same} == same and same["fsdp_version"] == 2
    assert {k: v for k, v in mine.items() if k not in ("num_processes", "fsdp_config")} == {
        k: v for k, v in four.items() if k not in ("num_processes", "fsdp_config")}
    assert launch.train_command(PY, 1, None, env={}) == [PY]  # the CPU presets' one process stays plain python


def test_two_node_allocation(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)  # no scontrol here: the list is parsed
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    cmd = launch.train_command(PY, 4, "configs/accelerate/fsdp_4gpu.yaml", env=env)
    assert cmd[:7] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c", cmd[6]]
    assert cmd[7:] == ["train"]  # $0 of the shell; the script and its arguments follow as "$@"
    assert cmd[6] == (
        "exec .venv/bin/accelerate launch --num_processes 8 --config_file configs/accelerate/fsdp_4gpu.yaml"
        " --num_machines 2 --main_process_ip gpu07 --main_process_port 29742"
        ' --machine_rank "$SLURM_NODEID" "$@"'
    )
    # what srun's shell on the second node runs: its own rank, the script's arguments intact
    words = [*cmd[4:], "train_grpo.py", "--out", "runs/a b/policy"]
    shown = subprocess.run(
        [*words[:2], words[2].replace("exec ", "printf '%s\\n' "), *words[3:]],
        env={"SLURM_NODEID": "1"}, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert shown[0] == ".venv/bin/accelerate"
    assert shown[-5:] == ["--machine_rank", "1", "train_grpo.py", "--out", "runs/a b/policy"]
    # no config file: accelerate's multi-GPU launcher; MASTER_PORT wins over the job's port
    cmd = launch.train_command(PY, 2, None, env=env | {"MASTER_PORT": "31000"})
    assert "--multi_gpu" in shlex.split(cmd[6]) and "--main_process_port 31000" in cmd[6]


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu07", ["gpu07"]),
        ("gpu[07-09,12]", ["gpu07", "gpu08", "gpu09", "gpu12"]),
        ("a[1-2],login1,b[009-010]", ["a1", "a2", "login1", "b009", "b010"]),
    ],
)
def test_node_lists(monkeypatch, nodelist, hosts):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    assert launch.hostnames(nodelist) == hosts
