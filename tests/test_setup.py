"""setup.sh's checks and the GPU presets' guards before any download: the Python version and the
NVIDIA driver before anything is installed, a GPU preset on a machine without GPUs, an unpinned
revision, a failed download in one line, and a resume that depends neither on the hub's latest
commit nor on HF_HOME."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from common.run import runinfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN7B = "Qwen/Qwen2.5-7B-Instruct"
REV = "a09a35458c702b33eeacc393d103063234e8bc28"


def run(cmd, env=None, cwd=ROOT):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


FIX = "install Python 3.11 or 3.12 (e.g. apt-get install python3.12-venv, or uv python install 3.12), then run " \
      "PYTHON=python3.12 bash setup.sh"
# nvidia-smi as a 4 x H100 node answers setup.sh's three questions, with the driver of $DRIVER and the
# compute mode of $MODE
NVIDIA_SMI = """#!/bin/sh
case "$*" in
  -L) for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done ;;
  "--query-gpu=driver_version,name --format=csv,noheader")
    for i in 0 1 2 3; do echo "$DRIVER, NVIDIA H100 80GB HBM3"; done ;;
  "--query-gpu=index,compute_mode --format=csv,noheader")
    for i in 0 1 2 3; do echo "$i, ${MODE:-Default}"; done ;;
  *) echo "stub nvidia-smi: unexpected $*" >&2; exit 6 ;;
esac
"""


def setup_copy(tmp_path):
    """setup.sh and the requirements files in a folder of their own, without a .venv."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(ROOT):
        if name == "setup.sh" or name.startswith("requirements"):
            shutil.copy(os.path.join(ROOT, name), repo / name)
    return repo


def executable(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def timed_setup(repo, env):
    t0 = time.monotonic()
    res = run(["bash", str(repo / "setup.sh")], env=env)
    return res, time.monotonic() - t0


# what each stand-in interpreter answers: its version, and whether it can import ensurepip
PYTHONS = {"old": "#!/bin/sh\necho 3.9\n",
           "without venv": '#!/bin/sh\ncase "$2" in *ensurepip*) exit 1 ;; *) echo 3.12 ;; esac\n'}


@pytest.mark.parametrize("python, message", [
    ("old", "is Python 3.9; vLLM, bfcl-eval and this project need Python >= 3.11: " + FIX),
    ("missing", "/no/python does not run: " + FIX),
    ("without venv", "(Python 3.12) cannot create a virtual environment with pip: install python3.12-venv"),
])
def test_setup_refuses_an_unusable_python_in_seconds_naming_what_to_install(tmp_path, python, message):
    """PYTHON naming an interpreter that reports 3.9, none, or a 3.12 without ensurepip (Debian's
    python3.12 without python3.12-venv): refused before .venv exists."""
    repo = setup_copy(tmp_path)
    exe = executable(tmp_path / "python", PYTHONS[python]) if python in PYTHONS else "/no/python"
    res, seconds = timed_setup(repo, {"PYTHON": exe})
    assert res.returncode == 1 and message in res.stderr, res.stdout + res.stderr
    assert "setup: nothing was installed" in res.stderr and "installing" not in res.stdout
    assert seconds < 10 and not (repo / ".venv").exists()


def gpu_env(tmp_path, driver):
    """PATH with the stand-in nvidia-smi first, and pip that can reach no package at all, so that
    a check that let the install start fails in seconds instead of downloading."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "no-wheels").mkdir()
    executable(tmp_path / "bin" / "nvidia-smi", NVIDIA_SMI)
    return {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "DRIVER": driver, "PYTHON": sys.executable,
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "no-wheels")}


def test_setup_refuses_an_old_nvidia_driver_before_installing_anything(tmp_path):
    """Driver 535 on a GPU node: the pinned build's torch (CUDA 13) needs 580, so setup stops in
    seconds, naming the driver and the fix, before .venv or any download."""
    repo = setup_copy(tmp_path)
    res, seconds = timed_setup(repo, gpu_env(tmp_path, "535.104.05"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "NVIDIA driver 535.104.05 is older than 580, which torch 2.14 (CUDA 13) needs" in res.stderr
    assert "update the driver" in res.stderr and "GPUs: 4 x NVIDIA H100 80GB HBM3" in res.stderr
    assert "setup: nothing was installed" in res.stderr and "installing" not in res.stdout
    assert seconds < 10 and not (repo / ".venv").exists()


def test_setup_refuses_gpus_in_exclusive_process_mode_before_installing_anything(tmp_path):
    """A node whose GPUs admit one process each (a common cluster default) could not hold the sleeping
    server beside the trainer: refused in seconds, naming the GPUs and the command that fixes it."""
    repo = setup_copy(tmp_path)
    res, seconds = timed_setup(repo, gpu_env(tmp_path, "580.65.06") | {"MODE": "Exclusive_Process"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "GPUs not in the Default compute mode (0, Exclusive_Process;1, Exclusive_Process;" in res.stderr
    assert "sudo nvidia-smi -c DEFAULT" in res.stderr and "nothing was installed" in res.stderr
    assert "installing" not in res.stdout and seconds < 10 and not (repo / ".venv").exists()


def test_a_driver_the_build_runs_on_goes_on_to_the_gpu_install(tmp_path):
    """Driver 580 passes the check: setup names it and the GPUs and starts the GPU build (which
    fails here at once: pip can reach no package)."""
    repo = setup_copy(tmp_path)
    res, _ = timed_setup(repo, gpu_env(tmp_path, "580.65.06"))
    assert "setup: NVIDIA driver 580.65.06, GPUs: 4 x NVIDIA H100 80GB HBM3" in res.stdout, res.stdout + res.stderr
    assert "installing into .venv (gpu build)" in res.stdout and "older than" not in res.stderr
    assert res.returncode != 0 and "vllm==0.33.0" in res.stderr  # the GPU requirements, unreachable here


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has GPUs")
def test_a_gpu_preset_on_a_machine_without_gpus_stops_before_any_download(tmp_path):
    res = run(["bash", "loop.sh", "qwen7b", "--runs", str(tmp_path / "runs")], env={"HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2 and "runs on 4 GPUs and this machine has 0" in res.stderr
    assert "bash loop.sh tiny" in res.stderr and "Traceback" not in res.stderr
    assert not os.listdir(tmp_path)  # no download, no run folder


def test_a_hub_model_without_a_pinned_revision_is_refused(tmp_path):
    res = run(["bash", "loop.sh", "toolace8b", "--runs", str(tmp_path / "runs")], env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 2 and "REVISION=''" in res.stderr and "--set REVISION=<40-hex commit>" in res.stderr
    assert not os.listdir(tmp_path)


def test_a_failed_download_is_one_line_naming_model_revision_and_hf_home(tmp_path):
    """The hub client's own failure (offline here: nothing cached under HF_HOME)."""
    res = run([sys.executable, "-m", "common.run.fetch", QWEN7B, REV], env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"cannot download {QWEN7B} at revision {REV} into HF_HOME={tmp_path}" in res.stderr


def test_a_run_records_the_hub_id_and_revision_so_another_hf_home_resumes(tmp_path):
    """config.json written by older loop.sh (the snapshot path under one HF_HOME) and by this one
    (id + revision): a rerun with the same revision resumes, another commit is refused."""
    old = str(tmp_path / "old.json")
    runinfo.main(old, [f"model=/home/a/.cache/huggingface/hub/models--Qwen--Qwen2.5-7B-Instruct/snapshots/{REV}",
                       "lr=1e-6"])
    runinfo.main(old, [f"model={QWEN7B}", f"revision={REV}", "lr=1e-6"])  # resumes, and records the id
    assert json.load(open(old))["settings"] == {"model": QWEN7B, "revision": REV, "lr": "1e-6"}
    new = str(tmp_path / "new.json")
    runinfo.main(new, [f"model={QWEN7B}", f"revision={REV}", "gpu_mem_gib=79"])
    runinfo.main(new, [f"model={QWEN7B}", f"revision={REV}", "gpu_mem_gib=80"])  # another GPU: the same run
    with pytest.raises(SystemExit, match=f"revision: '{REV}' -> '{'0' * 40}'"):
        runinfo.main(new, [f"model={QWEN7B}", f"revision={'0' * 40}", "gpu_mem_gib=80"])


@pytest.mark.parametrize("module", ["common.run.runinfo", "common.run.report", "common.train.launch", "common.run.fetch"])
def test_helper_commands_answer_help_without_writing_a_file(tmp_path, module):
    # runinfo once took "--help" for its output path and wrote a file named --help
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": repo})
    assert r.returncode != 0 and "python -m " + module in r.stderr
    assert os.listdir(tmp_path) == []
