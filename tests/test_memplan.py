"""The memory plan (common/memplan.py): its terms against memory measured on CPU at small shapes,
the presets' architecture files, and loop.sh's --plan and its refusals."""

import json
import os
import re
import subprocess
import sys

import pytest

from common import memplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_check  # noqa: E402

PRESET_MODELS = ["Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Team-ACE/ToolACE-2-Llama-3.1-8B"]
TOKENS = 512  # with plan_check.SMALL's shape: activations and the log-prob chunk well above the parameters


@pytest.mark.parametrize("model", PRESET_MODELS)
def test_preset_architecture_files_hold_their_parameter_count(model):
    """The shipped numbers give the parameter count the model card states (read_config checks it)."""
    arch = memplan.load_arch(model)
    assert arch.params == json.load(open(memplan.arch_path(model)))["parameters"]


def test_plan_terms_match_memory_measured_on_cpu():
    """Each term the plan counts for one update of a small random Qwen2 (float32, Accelerate, the
    GRPO loss of common/grpo.py, AdamW), against the same step measured on CPU by
    bench/plan_check.py (the allocations torch's profiler records): weights, gradients and AdamW
    state; activations kept for backward with and without gradient checkpointing; the log-prob
    chunk; the layer recomputed in backward; each within 15 %, and the plan's peak not below
    the measured one."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    arch = memplan.read_config_dict(plan_check.SMALL)
    for ckpt in (False, True):
        model = plan_check.build(plan_check.SMALL, None, accelerator.device)
        assert arch.params == sum(p.numel() for p in model.parameters())
        measured = plan_check.measure_step(model, TOKENS, accelerator, ckpt)
        rows = plan_check.rows(arch, *measured, TOKENS, 1, False, False, ckpt, chunk=TOKENS)
        assert len(rows) == 7 + ckpt - 1
        for term, planned, got in rows:
            assert plan_check.agrees(term, planned, got), (ckpt, term, planned, got, rows)


def test_plan_check_command_line_runs_and_times_a_sharded_save(tmp_path):
    """bench/plan_check.py as bench/gpu_check.sh runs it (its CPU dry run): every row within 15 %,
    the sharded state's file the size docs/hardware.md §6 gives (12 bytes a parameter), written,
    read back and removed."""
    state, table = tmp_path / "state", tmp_path / "plan.md"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plan_check.py"), "--cpu", "--table", str(table),
                          "--save-load", str(state)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in table.read_text().splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == 8 and all(line.endswith("| ok |") for line in rows), rows
    assert "sharded state on disk" in rows[-1]
    assert re.search(r"^sharded state: [\d.e-]+ GiB a process, saved in [\d.]+ s", res.stdout, re.M), res.stdout
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["save_load"]["load_s"] >= 0 and not state.exists()


def loop(*args, env=None, timeout=120):
    return subprocess.run(["bash", "loop.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("preset", ["qwen3b", "qwen7b", "toolace8b"])
def test_every_gpu_preset_fits_its_gpus_and_plans_without_a_download(preset, tmp_path):
    res = loop(preset, "--plan", env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "rollout server" in out and "contexts of 16384" in out and "reference pass" in out
    train = out.split("train stage", 1)[1]
    sizes = [float(m[1]) for m in re.finditer(r"^ +([\d.]+) GiB  (?!peak)", train, re.M)]
    assert len(sizes) >= 7 and sizes == sorted(sizes, reverse=True)  # largest term first
    for term in ("AdamW moments", "weights (fp32, 1/4)", "gradients (fp32, 1/4)", "checkpointed", "log-prob chunk",
                 "FSDP all-gathered", "CUDA context"):
        assert term in train
    assert out.count(": fits") == 3 and "DOES NOT FIT" not in out
    assert not os.listdir(tmp_path)  # nothing fetched into HF_HOME


def test_a_setting_that_cannot_fit_is_refused_naming_the_variable(tmp_path):
    res = loop("qwen7b", "--plan", "--set", "EXTRA_TRAIN=")
    assert res.returncode == 3 and "DOES NOT FIT" in res.stdout
    assert "add --gradient-checkpointing to EXTRA_TRAIN" in res.stderr
    # a run stops before round 0, before any check of the machine, and writes nothing
    res = loop("qwen7b", "--set", "MICRO_TOKENS=262144", "--runs", str(tmp_path / "runs"), env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 2 and "lower MICRO_TOKENS to" in res.stderr and "stopped by the memory plan" in res.stderr
    assert not os.listdir(tmp_path)


def test_a_model_whose_numbers_cannot_be_read_is_named(tmp_path):
    res = loop("qwen7b", "--plan", "--set", "MODEL=Org/Unknown-7B")
    assert res.returncode != 0 and "configs/models/Org/Unknown-7B.json does not exist" in res.stderr
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(memplan.PlanError, match=f"{tmp_path}/config.json: cannot read the architecture numbers"):
        memplan.load_arch(str(tmp_path))
