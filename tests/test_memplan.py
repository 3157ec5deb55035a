"""The memory plan (common/train/memplan.py): its terms against memory measured on CPU at small shapes,
the presets' architecture files, and loop.sh's --plan and its refusals."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from common import presets
from common.engine.models import model_context
from common.train import memplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_check  # noqa: E402

# every GPU preset and its model, read from common/presets.py: a preset added there is planned here too
PRESETS = {name: p.model for name, p in presets.PRESETS.items() if p.gpu_mem_gib}
PRESET_MODELS = sorted(set(PRESETS.values()))
TOKENS = 512  # with plan_check.SMALL's shape: activations and the log-prob chunk well above the parameters


@pytest.mark.parametrize("model", PRESET_MODELS)
def test_an_architecture_file_whose_numbers_miss_its_parameter_count_is_refused(model, tmp_path):
    """Each shipped file states the parameter count the model card states (Qwen3's q and k norms
    included: 4,022,468,096 and 8,190,735,360, the hub's safetensors counts), and loading holds its
    numbers to it: one parameter off, or a field the count depends on changed, is refused."""
    config = json.load(open(memplan.arch_path(model)))
    assert memplan.load_arch(model).params == config["parameters"] > 1e9
    for changed in ({"parameters": config["parameters"] + 1}, {"intermediate_size": config["intermediate_size"] + 1}):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config | changed))
        with pytest.raises(memplan.PlanError, match="parameters, the file states"):
            memplan.read_config(str(path))


@pytest.mark.parametrize("model", PRESET_MODELS)
def test_plan_check_builds_each_preset_as_its_architecture(model):
    """bench/plan_check.py --model builds each preset's own architecture (Qwen3 with its q and k
    norms, not a Qwen2), 2 layers of it on the meta device, with the parameters the plan counts."""
    cfg = json.load(open(memplan.arch_path(model)))
    built = plan_check.build(cfg, 2, "meta")
    assert type(built).__name__ == cfg["architectures"][0]
    assert sum(p.numel() for p in built.parameters()) == dataclasses.replace(memplan.read_config_dict(cfg), layers=2).params


def test_plan_terms_match_memory_measured_on_cpu():
    """Each term the plan counts for one update of a small random Qwen2 (float32, Accelerate, the
    GRPO loss of common/train/grpo.py, AdamW), against the same step measured on CPU by
    bench/plan_check.py (the allocations torch's profiler records): weights, gradients and AdamW
    state; activations kept for backward with and without gradient checkpointing; the log-prob
    chunk; the layer recomputed in backward; each within 15 %, and the plan's peak not below
    the measured one."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    arch = memplan.read_config_dict(plan_check.SMALL)
    measured_rows(arch, lambda: plan_check.build(plan_check.SMALL, None, accelerator.device), accelerator)


def measured_rows(arch, build, accelerator):
    """The plan's rows against one measured CPU step of build()'s model, without and with gradient
    checkpointing: the model has the plan's parameters and every term agrees within 15 %."""
    out = []
    for ckpt in (False, True):
        model = build()
        assert arch.params == sum(p.numel() for p in model.parameters())
        measured = plan_check.measure_step(model, TOKENS, accelerator, ckpt)
        rows = plan_check.rows(arch, *measured, TOKENS, 1, False, False, ckpt, chunk=TOKENS)
        assert len(rows) == 7 + ckpt - 1
        for term, planned, got in rows:
            assert plan_check.agrees(term, planned, got), (ckpt, term, planned, got, rows)
        out += rows
    return out


def test_qwen3s_q_and_k_norms_are_counted_as_measured_on_cpu():
    """Qwen3 normalises each head of q and k (RMSNorm: a float32 input and a normalised output kept
    for backward, and head_dim weights each): at plan_check.SMALL's shape as Qwen3, its parameters are
    the model's and each term agrees with the memory measured on CPU within 15 % (the activations
    kept for backward, where the norms count, within 5 %)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    small = plan_check.SMALL | {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False}
    arch = memplan.read_config_dict(small)
    assert arch.qk_norm and arch.params - memplan.read_config_dict(plan_check.SMALL | {"attention_bias": False,
        "architectures": ["LlamaForCausalLM"]}).params == 2 * arch.head_dim * arch.layers  # fmt: skip
    assert type(plan_check.build(small, 1, "meta")).__name__ == "Qwen3ForCausalLM"  # as --model Qwen/Qwen3-* builds it
    rows = measured_rows(arch, lambda: plan_check.build(small, None, accelerator.device), accelerator)
    for term, planned, got in rows:
        assert not term.startswith("activations") or got == pytest.approx(planned, rel=0.05), (term, planned, got)


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


ASLEEP = "sleeping vLLM server: CUDA context, CUDA-graph pool, allocator residue (allowance)"
REDUCE_SCATTER = "FSDP2 reduce-scatter input (fp32) of the largest group, the root: embeddings + output layer"


def check_fits_without_a_download(preset, res, hf_home):
    """`loop.sh PRESET --plan --set GPUS=4`: the preset's own values planned, every term present,
    largest first, every stage fits, and nothing fetched into HF_HOME."""
    p = presets.resolve(preset, ["GPUS=4"])
    out = res.stdout
    assert out.startswith(f"memory plan: {preset} {p.model} (")
    assert (f"4 GPUs x {p.gpu_mem_gib} GiB, rollouts MAX_LEN={p.max_len}" in out
            and f"MICRO_TOKENS={p.micro_tokens}, log-prob chunk {presets.LOGPROB_CHUNK}" in out)
    assert "train stage (FSDP over 4 processes, gradient checkpointing" in out
    assert "rollout server" in out and "reference pass" in out
    reference, train = out.split("reference pass", 1)[1].split("train stage", 1)
    assert ASLEEP in reference
    sizes = [float(m[1]) for m in re.finditer(r"^ +([\d.]+) GiB  (?!peak)", train, re.M)]
    assert len(sizes) >= 9 and sizes == sorted(sizes, reverse=True)  # largest term first
    for term in ("AdamW moments", "weights (fp32, 1/4)", "gradients (fp32, 1/4)", "checkpointed", "log-prob chunk",
                 "FSDP all-gathered", REDUCE_SCATTER, "CUDA context", ASLEEP):
        assert term in train
    assert out.count(": fits") == 3 and "DOES NOT FIT" not in out
    assert not os.listdir(hf_home)  # nothing fetched into HF_HOME


def served_context(model, tmp_path, max_len, eval_len=""):
    """The max_model_len loop.sh starts the server with (SERVE_LEN: max(MAX_LEN, EVAL_LEN or the
    model's own context)), the model's own read by common.engine.engines.model_context from a model folder
    holding the hub's config.json (configs/models/ carries its fields)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    shutil.copy(memplan.arch_path(model), folder / "config.json")
    return max(max_len, int(eval_len or model_context(str(folder))))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("eval_len", ["", "20480"])
def test_the_plans_kv_cache_is_counted_at_the_context_the_server_runs(preset, eval_len, tmp_path):
    """The server serves evaluation too, at the model's own context unless EVAL_LEN lowers it:
    32,768 (Qwen2.5), 131,072 (Llama 3.1), 262,144 (Qwen3-4B-Instruct-2507) and 40,960 (Qwen3-8B)
    while rollouts stop at MAX_LEN; the plan's KV cache is counted in contexts of that length, and
    the rollouts it holds besides. Without EVAL_LEN, the preset's own plan: check_fits_without_a_download."""
    max_len = int(presets.PRESETS[preset].max_len)
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    res = loop(preset, "--plan", "--set", "GPUS=4", *(["--set", f"EVAL_LEN={eval_len}"] if eval_len else []),
               env={"HF_HOME": str(hf_home)})
    assert res.returncode == 0, res.stdout + res.stderr
    if not eval_len:
        check_fits_without_a_download(preset, res, hf_home)
    serve = served_context(PRESETS[preset], tmp_path, max_len, eval_len)
    own = {"qwen3b": 32768, "qwen7b": 32768, "toolace8b": 131072, "qwen3-4b": 262144, "qwen3-8b": 40960}.get(
        preset, memplan.load_arch(PRESETS[preset]).max_pos)  # the docstring's, for the presets it names
    assert serve == max(max_len, int(eval_len or own))
    header = res.stdout.splitlines()[0]
    assert f"rollouts MAX_LEN={max_len}, server max_model_len={serve}" in header
    if serve == max_len:  # an EVAL_LEN below a thinking preset's MAX_LEN: the server's context is the rollouts'
        assert "server max_model_len=32768 (MAX_LEN)" in header and " rollouts of MAX_LEN" not in res.stdout
        return
    contexts = re.search(rf"= ([\d.]+) contexts of max_model_len=(\d+), ([\d.]+) rollouts of MAX_LEN={max_len}", res.stdout)
    assert contexts and int(contexts[2]) == serve
    assert float(contexts[3]) == pytest.approx(float(contexts[1]) * serve / max_len, rel=0.01)
    if presets.PRESETS[preset].thinking:
        return  # a thinking preset does not run (tests/test_presets.py)
    # a run's one-line plan before round 0 (a micro-batch too large to fit stops it right after)
    brief = loop(preset, "--set", "GPUS=4", "--set", "MICRO_TOKENS=262144", "--set", f"EVAL_LEN={eval_len}", "--set", f"REVISION={'0' * 40}",
                 "--runs", str(tmp_path / "r"))
    assert f"contexts of max_model_len={serve} per replica" in brief.stdout, brief.stdout + brief.stderr


def test_the_plan_runs_on_a_fresh_clone_with_nothing_installed(tmp_path):
    """The repository's files (what a clone of this working tree holds: no .venv, no .cache) and
    PATH's python3, not .venv's: `--plan` installs nothing, downloads nothing, answers in seconds,
    and counts what a sleeping vLLM server keeps and FSDP2's float32 reduce-scatter input."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    clone = tmp_path / "clone"
    for name in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(clone / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), clone / name)
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if os.path.abspath(p) != venv_bin)
    python3 = shutil.which("python3", path=path)
    assert python3 and not os.path.realpath(python3).startswith(ROOT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    # pip that reaches no package: a --plan that ran setup again would fail in seconds, not download
    (tmp_path / "no-wheels").mkdir()
    env.update(PATH=path, HF_HOME=str(tmp_path / "hf"), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(tmp_path / "no-wheels"))
    t0 = time.monotonic()
    res = subprocess.run(["bash", "loop.sh", "qwen7b", "--plan"], cwd=clone, capture_output=True, text=True,
                         timeout=60, env=env)
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert seconds < 10 and "setup:" not in res.stdout + res.stderr
    assert not (clone / ".venv").exists() and not (tmp_path / "hf").exists()
    reference, train = res.stdout.split("reference pass", 1)[1].split("train stage", 1)
    assert f"{memplan.VLLM_ASLEEP_GIB:.2f} GiB  {ASLEEP}" in reference and ASLEEP in train
    arch = memplan.load_arch("Qwen/Qwen2.5-7B-Instruct")
    assert f"{4 * arch.root_params / memplan.GIB:.2f} GiB  {REDUCE_SCATTER}" in train
    assert "server max_model_len=32768" in res.stdout and ": fits" in train


def test_the_reduce_scatter_input_is_the_largest_groups_gradients_in_float32():
    """The root group (embeddings, final norm, output layer) against one decoder layer: untied at 7B
    the root is 4.7 times a layer, tied at 3B still 4; a model whose layers outweigh its root
    (a small vocabulary) counts one layer."""
    for model in PRESET_MODELS:
        arch = memplan.load_arch(model)
        assert arch.root_params > arch.layer_params
        assert memplan.reduce_scatter_input(arch) == 4 * arch.root_params
    small = memplan.read_config_dict(plan_check.SMALL | {"vocab_size": 16})
    assert small.layer_params > small.root_params and memplan.reduce_scatter_input(small) == 4 * small.layer_params
    plan = memplan.train_plan(small, 4, True, 512, True, 80 * memplan.GIB)
    assert ("FSDP2 reduce-scatter input (fp32) of the largest group, one layer", 4 * small.layer_params, False) in plan.terms


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


def train_terms(out):
    return out.split("train stage", 1)[1]


@pytest.mark.parametrize("gpus", ["1", "2", "8"])
def test_the_plan_for_k_gpus_says_per_gpu_whether_full_fine_tuning_fits(gpus):
    """qwen3-4b on K x 80 GB: FSDP over K processes (its bf16 copies and float32 reduce-scatter on one GPU
    too), the state sharded 1/K; on one GPU full fine-tuning does not fit and the plan refuses, naming
    the settings that fit (more GPUs, LoRA), and with LORA=--lora it fits and says full would not."""
    res = loop("qwen3-4b", "--plan", "--set", f"GPUS={gpus}")
    n, shard = int(gpus), "" if gpus == "1" else f", 1/{gpus}"
    assert f"), {gpus} GPU{'s' * (n > 1)} x 79 GiB, rollouts MAX_LEN=16384" in res.stdout.splitlines()[0]
    train = train_terms(res.stdout)
    assert f" (FSDP over {gpus} process{'es' * (n > 1)}, gradient checkpointing" in train
    for term in (f"AdamW moments (fp32{shard})", f"weights (fp32{shard})", "FSDP all-gathered", REDUCE_SCATTER, ASLEEP):
        assert term in train, term
    if gpus == "1":
        assert res.returncode == 3 and "DOES NOT FIT" in train and train.count(": fits") == 0
        assert "GPUS=2 (the weights sharded over 2 GPUs); or LORA=--lora (a rank-16 adapter through PEFT" in res.stderr
        lora = loop("qwen3-4b", "--plan", "--set", "GPUS=1", "--set", "LORA=--lora")
        assert lora.returncode == 0 and lora.stdout.count(": fits") == 3, lora.stdout + lora.stderr
        assert "frozen base weights (bf16)" in train_terms(lora.stdout)
        assert re.search(r"^full fine-tuning instead of LoRA: [\d.]+ GiB per GPU of 79: DOES NOT FIT$", lora.stdout, re.M)
    else:
        assert res.returncode == 0 and res.stdout.count(": fits") == 3 and "DOES NOT FIT" not in res.stdout


def test_a_thinking_8b_on_one_gpu_is_refused_naming_lora_and_gpus():
    res = loop("qwen3-8b", "--plan", "--set", "GPUS=1")
    assert res.returncode == 3 and "micro-batch of 32768 tokens" in res.stdout
    assert "over the limit of 71.1 GiB (GPU_MEM_GIB=79 less 10%): GPUS=4 (the weights sharded over 4 GPUs); or LORA=--lora" \
        in res.stderr
    assert loop("qwen3-8b", "--plan", "--set", "GPUS=1", "--set", "LORA=--lora").returncode == 0


def test_gpus_zero_or_a_count_without_a_config_is_refused_before_any_plan():
    for gpus in ("0", "3", "16"):
        res = loop("qwen3-4b", "--plan", "--set", f"GPUS={gpus}")
        assert res.returncode == 2 and f"GPUS={gpus}: a GPU preset runs on 1, 2, 4 or 8 GPUs" in res.stderr
        assert "memory plan" not in res.stdout


def test_the_plans_docs_hardware_md_shows_are_what_plan_prints():
    """Every `$ bash loop.sh ... --plan` in docs/hardware.md is followed by exactly what it prints (the
    paper's presets on 4 GPUs, qwen3-4b on one GPU with and without LoRA): a change to the plan changes
    the docs."""
    text = open(os.path.join(ROOT, "docs", "hardware.md")).read()
    shown = re.findall(r"^\$ (bash loop\.sh .*)\n((?:(?!\$ |```).*\n)+)", text, re.M)
    assert len(shown) == 5
    for command, expected in shown:
        res = loop(*command.split()[2:])
        assert res.returncode in (0, 3) and res.stdout + res.stderr == expected.rstrip("\n") + "\n", command


def test_the_training_processes_load_is_checked_against_the_nodes_memory(tmp_path):
    """Every FSDP2 process loads the policy whole before it is sharded: qwen7b on 4 GPUs holds four
    float32 copies at once (a LoRA base: four bf16 ones). A node with less available memory is refused
    before round 0 with the figure and the fix; /proc/meminfo's MemAvailable is what is compared."""
    p = presets.resolve("qwen7b", ["GPUS=4"])
    arch, _, k = memplan.settings_plans(p)
    need = memplan.host_load_bytes(arch, 4, lora=False)
    assert need == 4 * 4 * arch.params == 2 * memplan.host_load_bytes(arch, 4, lora=True)
    meminfo = tmp_path / "meminfo"
    for have_gib, refused in ((100, True), (120, False)):
        meminfo.write_text(f"MemTotal:       {200 * 2**20} kB\nMemAvailable:   {have_gib * 2**20} kB\n")
        why = memplan.host_check(arch, k, str(meminfo))
        assert (why is not None) == refused and (need / memplan.GIB > have_gib) == refused
        if refused:
            assert "113.5 GiB of host memory" in why and "100.0 GiB available" in why and "LORA=--lora" in why
    meminfo.write_text("MemTotal: 1 kB\n")  # no MemAvailable (an old kernel): nothing to compare, no refusal
    assert memplan.host_check(arch, k, str(meminfo)) is None


def small_user_model(tmp_path):
    """A model folder with Qwen2.5-0.5B's architecture numbers (its config.json alone): a user simulator."""
    small = tmp_path / "qwen2.5-0.5b"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
        "tie_word_embeddings": True, "max_position_embeddings": 32768}))
    return small


def test_a_user_model_served_beside_the_policy_is_planned(tmp_path):
    """ENV=tau2:DOMAIN with USER_MODEL: the user simulator's server is planned on the first GPU in
    what the policy's server leaves (USER_UTILIZATION) and counted, awake, in the train stage and
    reference pass; a user model that does not fit is refused naming the endpoint alternative, and
    a GPU preset on τ² without a user simulator is refused before any plan."""
    small = small_user_model(tmp_path)
    res = loop("qwen7b", "--plan", "--set", "ENV=tau2:retail", "--set", f"USER_MODEL={small}")
    assert res.returncode == 0 and "user simulator server (vLLM, USER_MODEL, gpu_memory_utilization 0.08)" in res.stdout
    # it lives only inside the stages that play: the train stage and the reference pass are as without it
    without = loop("qwen7b", "--plan", "--set", "ENV=tau2:retail", "--set", "USER_BASE_URL=http://h/v1",
                   "--set", "USER_MODEL_NAME=u")
    assert "user simulator" not in train_terms(res.stdout).split("user simulator server")[0]
    assert res.stdout.split("train stage")[1].split("user simulator server")[0] == \
        without.stdout.split("train stage")[1].split("host memory")[0]
    # the first GPU while a stage plays: both shares and both CUDA contexts, within the GPU
    first = res.stdout.split("first GPU while a stage plays")[1]
    assert "71.10 GiB  policy's server: gpu_memory_utilization 0.9" in first
    assert "6.32 GiB  user simulator's server: gpu_memory_utilization 0.08" in first
    assert first.count("0.50 GiB") == 2 and "78.42 GiB  peak of 79 GiB (limit 79.0): fits" in first
    res = loop("qwen7b", "--plan", "--set", "ENV=tau2:retail", "--set", "USER_MODEL=Qwen/Qwen2.5-7B-Instruct")
    assert res.returncode == 3 and "serve it on other GPUs or another node" in res.stderr
    assert "USER_BASE_URL and USER_MODEL_NAME" in res.stderr
    res = loop("qwen7b", "--plan", "--set", "ENV=tau2:retail")
    assert res.returncode == 2 and "ENV=tau2:retail needs a user simulator" in res.stderr


@pytest.mark.parametrize("sets", [["GPUS=1", "LORA=--lora"], ["GPUS=4"]])
def test_the_first_gpu_holds_both_servers_and_their_cuda_contexts(tmp_path, sets):
    """qwen3-4b on τ² retail with a small USER_MODEL, on 1 x 80 GB (LoRA) and 4 x 80 GB: the plan shows
    the first GPU's total while a stage plays; at vLLM's default share for the policy (0.92) it would
    not fit, and on a 40 GB GPU the two CUDA contexts do not fit beside the two shares: refused."""
    small = small_user_model(tmp_path)
    args = ["qwen3-4b", "--plan", "--set", "ENV=tau2:retail", "--set", f"USER_MODEL={small}"]
    for s in sets:
        args += ["--set", s]
    res = loop(*args)
    first = res.stdout.split("first GPU while a stage plays")[1].split("host memory")[0]
    assert res.returncode == 0 and "78.42 GiB  peak of 79 GiB (limit 79.0): fits" in first, res.stdout + res.stderr
    assert memplan.first_gpu_plan(79 * memplan.GIB).fits
    import dataclasses
    default = memplan.first_gpu_plan(79 * memplan.GIB)
    default = dataclasses.replace(default, terms=[(n, 0.92 * 79 * memplan.GIB if "policy's server: gpu" in n else b, t)
                                                  for n, b, t in default.terms])
    assert not default.fits  # what vLLM's default would have asked for
    res = loop(*args, "--set", "GPU_MEM_GIB=40")
    assert res.returncode == 3 and "need 40.2 GiB of the first GPU with their CUDA contexts" in res.stderr, res.stderr


def test_the_user_server_gets_the_share_and_context_its_plan_counts():
    """On GPUs loop.sh serves USER_MODEL with memplan.user_serve_args (its plan's share and MAX_LEN):
    the vLLM command line the stage builds for it holds exactly those, after tool calling."""
    from common.engine import serve
    from common.envs.tau2 import tau2
    args = memplan.user_serve_args("16384")
    assert args == f"--gpu-memory-utilization {memplan.USER_UTILIZATION} --max-model-len 16384"
    extra = tau2.user_server_args(tau2.User(model="/m/Qwen2.5-1.5B-Instruct", serve_args=args))
    assert extra == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--gpu-memory-utilization",
                     "0.08", "--max-model-len", "16384"]
    argv, _ = serve.command("/m/Qwen2.5-1.5B-Instruct", port=8123, cpu=False, extra=extra)
    assert argv[-len(extra):] == extra and "--gpu-memory-utilization" not in argv[:-len(extra)]
    # the policy's server on GPUs: the share the plan counts (0.9), whatever vLLM's default (0.92)
    argv, _ = serve.command("/m/qwen3-4b", port=8000, cpu=False, max_model_len=16384, sleep_mode=True)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(memplan.VLLM_UTILIZATION) == "0.9"
    import dataclasses

    from vllm.config.cache import CacheConfig
    (field,) = [f for f in dataclasses.fields(CacheConfig) if f.name == "gpu_memory_utilization"]
    assert field.default.default == 0.92  # vLLM's own: what the server took before it was given 0.9
    p = presets.resolve("qwen7b", ["ENV=tau2:retail", "USER_MODEL=/m/u", "GPUS=4"])
    words = presets.env_shell(p)["ENV_PLAY"]  # the flags loop.sh gives rollout.py, and evaluate.py likewise
    assert words[words.index("--user-serve-args") + 1] == memplan.user_serve_args(p.max_len)
