"""The command that starts the train stage (loop.sh's train()): one process; `accelerate launch` over
NPROC processes of this node (or one, given an ACCEL_CONFIG); or, in a SLURM allocation of several nodes,
one `accelerate launch` per node through srun (N nodes run N * NPROC processes; docs/hardware.md §2).

    python -m common.train.launch PYTHON NPROC [ACCEL_CONFIG]   # the command's words, one a line

The main port is MASTER_PORT if set, else 29500 + the job id modulo 1000.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys


def accelerate_command(accelerate, processes, config=None, machines=1, main_ip=None, port=None):
    """`accelerate launch` over `processes` in all; with machines > 1 the caller adds `--machine_rank R`."""
    cmd = [accelerate, "launch", "--num_processes", str(processes)]
    cmd += ["--config_file", config] if config else ["--multi_gpu"] if machines > 1 else []
    if machines > 1:
        cmd += ["--num_machines", str(machines), "--main_process_ip", main_ip, "--main_process_port", str(port)]
    return cmd


def train_command(python, nproc, config=None, env=None):
    env = os.environ if env is None else env
    accelerate = os.path.join(os.path.dirname(python), "accelerate")
    nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1) if env.get("SLURM_JOB_ID") else 1
    if nodes > 1:
        hosts = hostnames(env["SLURM_JOB_NODELIST"])
        port = int(env.get("MASTER_PORT") or 29500 + int(env["SLURM_JOB_ID"]) % 1000)
        launch = accelerate_command(accelerate, nodes * nproc, config, nodes, hosts[0], port)
        # SLURM_NODEID differs per node: expanded by the shell srun starts there, not here
        script = f'exec {shlex.join(launch)} --machine_rank "$SLURM_NODEID" "$@"'
        return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c", script, "train"]
    if nproc > 1 or config:  # one GPU under FSDP2 too (GPUS=1: the presets' code path on one process)
        return accelerate_command(accelerate, nproc, config)
    return [python]


def hostnames(nodelist):
    """The hosts of a SLURM node list: `scontrol show hostnames`, else parsed here (gpu[01-03,07],login1)."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi or lo) + 1)]
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: no host names in it")
    return hosts


if __name__ == "__main__":
    if not 3 <= len(sys.argv) <= 4 or not sys.argv[2].isdigit():
        sys.exit(__doc__)
    python, nproc, config = sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or [""])[0]
    print("\n".join(train_command(python, nproc, config or None)))
