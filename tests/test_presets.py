"""common/presets.py, the one source of every setting: presets resolve, --set overrides and refuses,
the shell loop.sh evaluates gets the Python values exactly, the memory plan reads the preset, and the
move out of loop.sh's shell variables kept every value and every plan."""

import dataclasses
import os
import subprocess
import sys

import pytest

from common import memplan, presets
from common.presets import PRESETS, Preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PRESETS = [name for name, p in PRESETS.items() if p.gpu_mem_gib]
# The last commit whose loop.sh held the presets as shell variables.
BEFORE = "4862d71cc5e53177f6e4931bb57f8b0ceb22234f"
# Values a shell mangles unless each is quoted: spaces, quotes, $, a glob, a newline, nothing.
AWKWARD = {"USER_MODEL_NAME": "a b  'c' \"d\" $HOME `x` *", "OOD": "bfcl-memory tau2", "EXTRA_TRAIN": "--cpu\n--x",
           "SERVER": ""}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "common.presets", *args], cwd=ROOT, capture_output=True, text=True)


def shell_values(*args):
    """What bash holds after evaluating the presets' output: each variable, and RECORD's words."""
    names = [f.name.upper() for f in dataclasses.fields(Preset)] + ["OMEGA", "REWEIGHT", "LORA_RANK"]
    script = ('settings=$("$0" -m common.presets "$@") || exit 9\neval "$settings"\n'
              + "".join(f'printf "%s\\0" "${{{n}}}"\n' for n in names) + 'printf "%s\\0" "${RECORD[@]}"')
    res = subprocess.run(["bash", "-c", script, sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    words = res.stdout.split("\0")[:-1]
    return dict(zip(names, words[: len(names)], strict=True)), words[len(names):]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_resolves_and_names_what_it_runs_on(name):
    """A preset is its entry; a GPU preset's model has the architecture numbers the plan reads, its
    training shards the weights over its GPUs, and every preset's task file is one data/prepare.py writes."""
    p = presets.resolve(name)
    assert p == PRESETS[name] and all(isinstance(getattr(p, f.name), str) for f in dataclasses.fields(p))
    assert p.tasks in ("data/train.jsonl", "data/tiny.jsonl") and int(p.rounds) >= 1 and int(p.eval_every) >= 1
    if p.gpu_mem_gib:
        assert memplan.load_arch(p.model).params > 1e9
        assert p.sharded and int(p.nproc) > 1 and "--gradient-checkpointing" in p.extra_train.split()
    else:
        assert p.model == "offline-tiny" and not p.sharded and "--cpu" in p.extra_train.split()


def test_the_stages_defaults_are_the_presets_defaults():
    """What a stage run by hand takes (LR, KL_COEF, ...) is what a preset that keeps the default runs with."""
    qwen7b = PRESETS["qwen7b"]
    assert (presets.LR, presets.KL_COEF, presets.MINI_BATCH_TASKS) == (float(qwen7b.lr), float(qwen7b.kl),
                                                                       int(qwen7b.mini_batch))
    assert (presets.GROUP_SIZE, presets.TEMPERATURE, presets.MAX_STEPS_PER_TURN) == (int(qwen7b.n), float(qwen7b.temp),
                                                                                     int(qwen7b.max_steps))
    assert memplan.logprob_chunk() == presets.LOGPROB_CHUNK


def test_set_overrides_one_variable_and_refuses_what_is_not_one():
    p = presets.resolve("qwen7b", ["MAX_LEN=8192", "EXTRA_TRAIN=", "LR=1e-6=x", "ROUNDS=3"])
    assert dataclasses.asdict(p) == dataclasses.asdict(PRESETS["qwen7b"]) | {
        "max_len": "8192", "extra_train": "", "lr": "1e-6=x", "rounds": "3"}
    assert PRESETS["qwen7b"].max_len == "16384"  # the entry itself is left as it was
    for args, message in [(["qwen7b", "--set", "NOPE=1"], "--set NOPE: not a preset variable (ROUNDS EVAL_EVERY MODEL"),
                          (["qwen7b", "--set", "max_len=1"], "--set max_len: not a preset variable"),
                          (["qwen7b", "--set", "MAX_LEN"], "--set MAX_LEN: VAR=VALUE expected"),
                          (["qwen9b"], "unknown preset qwen9b (tiny, qwen3b, qwen7b, toolace8b)"),
                          (["tiny", "--mode", "seal-ish"], "unknown mode seal-ish (seal, vanilla, no-env"),
                          (["tiny", "--set", "KEEP=some"], "KEEP=some: use evaluated, latest or all"),
                          (["tiny", "--set", "PROMPTS=chat"], "PROMPTS=chat: use bfcl or template")]:
        res = cli(*args)
        assert res.returncode == 2 and message in res.stderr and res.stdout == "", (args, res.stderr)


@pytest.mark.parametrize("name", PRESETS)
def test_the_shell_gets_the_python_values_exactly(name):
    """bash's variables after `eval "$(python -m common.presets ...)"` are the resolved preset's fields,
    awkward values too; RECORD is what config.json records, under its keys."""
    sets = [a for k, v in AWKWARD.items() for a in ("--set", f"{k}={v}")]
    for mode, m in presets.MODES.items():
        values, record = shell_values(name, "--mode", mode, *sets)
        p = presets.resolve(name, [f"{k}={v}" for k, v in AWKWARD.items()])
        assert values == {**{f.name.upper(): getattr(p, f.name) for f in dataclasses.fields(p)},
                          "OMEGA": m.omega, "REWEIGHT": "" if m.reweight else "--no-reweight",
                          "LORA_RANK": str(presets.LORA_RANK)}
        assert values["USER_MODEL_NAME"] == AWKWARD["USER_MODEL_NAME"] and values["EXTRA_TRAIN"] == "--cpu\n--x"
        assert record == [f"{k}={v}" for k, v in presets.record(p, name, mode).items()]
    keys = dict(w.split("=", 1) for w in record)
    # the keys earlier runs recorded (readers of config.json and resumes use them)
    assert keys["max_model_len"] == p.max_len and keys["accelerate_config"] == p.accel_config
    assert keys["max_new_tokens"] == p.max_new and keys["temperature"] == p.temp and keys["preset"] == name


def test_only_sharding_accelerate_configs_count_as_sharded():
    """The plan counts FSDP / ZeRO-3 shards of the weights only where the Accelerate config asks for them."""
    sharded = {name: Preset(accel_config=f"configs/accelerate/{name}").sharded
               for name in sorted(os.listdir(os.path.join(ROOT, "configs", "accelerate")))}
    assert sharded == {"ddp_cpu2.yaml": False, "fsdp_1gpu.yaml": True, "fsdp_4gpu.yaml": True, "fsdp_cpu.yaml": True,
                       "zero3_4gpu.yaml": True}
    assert not Preset().sharded and not Preset(accel_config="configs/accelerate/none.yaml").sharded


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_the_plan_is_the_plan_of_the_preset_and_its_sets(name):
    """loop.sh --plan plans the preset's values, and a --set reaches the plan."""
    p = PRESETS[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(["bash", "loop.sh", name, "--plan"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"memory plan: {name} {p.model} (")
    assert (f"{p.nproc} GPUs x {p.gpu_mem_gib} GiB, rollouts MAX_LEN={p.max_len}" in res.stdout
            and f"MICRO_TOKENS={p.micro_tokens}, log-prob chunk {presets.LOGPROB_CHUNK}" in res.stdout)
    assert f"train stage (FSDP over {p.nproc} processes, gradient checkpointing" in res.stdout
    res = subprocess.run(["bash", "loop.sh", name, "--plan", "--rounds", "2", "--set", "NPROC=8", "--set", "LORA=--lora"],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert "8 GPUs x" in res.stdout and "train stage (FSDP over 8 processes" in res.stdout
    assert "frozen base weights (bf16, 1/8)" in res.stdout


def _git(*args, **kw):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, **kw)


@pytest.mark.skipif(_git("cat-file", "-e", f"{BEFORE}^{{commit}}").returncode != 0,
                    reason=f"commit {BEFORE} is not in this clone's history")
def test_the_move_kept_every_value_and_every_plan(tmp_path):
    """Against loop.sh of the commit BEFORE the presets moved into common/presets.py: every variable of
    every preset as its shell set it, and each GPU preset's --plan, word for word (with a few --set)."""
    archive = _git("archive", BEFORE, "loop.sh", "common/memplan.py", "common/grpo.py", "common/__init__.py",
                   "configs").stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    old = (tmp_path / "loop.sh").read_text()
    block = old.split("# ---------------------------------------------------------------------------- presets\n")[1]
    block = block.split("# The preset variables, one list")[0]
    old_names = [{"rounds": "DEFAULT_ROUNDS", "eval_every": "DEFAULT_EVAL_EVERY"}.get(f.name, f.name.upper())
                 for f in dataclasses.fields(Preset)]
    for name, p in PRESETS.items():
        script = f"PRESET={name}\n{block}\n" + "".join(f'printf "%s\\0" "${{{var}}}"\n' for var in old_names)
        res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        assert res.stdout.split("\0")[:-1] == [getattr(p, f.name) for f in dataclasses.fields(Preset)], name
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    for name in GPU_PRESETS:
        for sets in ([], ["EVAL_LEN=20480"], ["EXTRA_TRAIN="], ["LORA=--lora", "TP=2"],
                     ["ACCEL_CONFIG=configs/accelerate/zero3_4gpu.yaml"], ["ACCEL_CONFIG=configs/accelerate/ddp_cpu2.yaml"]):
            args = ["bash", "loop.sh", name, "--plan", *[a for s in sets for a in ("--set", s)]]
            was = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env)
            now = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
            assert "memory plan:" in was.stdout and (now.returncode, now.stdout, now.stderr) == (
                was.returncode, was.stdout, was.stderr), (name, sets)
