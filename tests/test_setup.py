"""setup.sh's checks and the GPU presets' guards before any download: the Python version, a GPU
preset on a machine without GPUs, an unpinned revision, a failed download in one line, and a
resume that depends neither on the hub's latest commit nor on HF_HOME."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from common import runinfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN7B = "Qwen/Qwen2.5-7B-Instruct"
REV = "a09a35458c702b33eeacc393d103063234e8bc28"


def run(cmd, env=None, cwd=ROOT):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("python, message", [("old", "is Python 3.10; vLLM, bfcl-eval and this project need Python >= 3.11"),
                                             ("missing", "does not run; set PYTHON")])
def test_setup_refuses_an_old_python_before_creating_the_venv(tmp_path, python, message):
    """A copy of setup.sh without a .venv, given (PYTHON) an interpreter that reports 3.10 or none."""
    for name in os.listdir(ROOT):
        if name == "setup.sh" or name.startswith("requirements"):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10\n")
    fake.chmod(0o755)
    res = run(["bash", str(tmp_path / "setup.sh")], env={"PYTHON": str(fake) if python == "old" else "/no/python"})
    assert res.returncode == 1 and message in res.stderr, res.stdout + res.stderr
    assert not (tmp_path / ".venv").exists()


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
    res = run([sys.executable, "-m", "common.fetch", QWEN7B, REV], env={"HF_HOME": str(tmp_path)})
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


@pytest.mark.parametrize("module", ["common.runinfo", "common.report", "common.launch", "common.fetch"])
def test_helper_commands_answer_help_without_writing_a_file(tmp_path, module):
    # runinfo once took "--help" for its output path and wrote a file named --help
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": repo})
    assert r.returncode != 0 and "python -m " + module in r.stderr
    assert os.listdir(tmp_path) == []
