"""common/presets.py, the one source of every setting: presets resolve, --set overrides and refuses,
a GPU preset is placed on GPUS GPUs, the shell loop.sh evaluates gets the Python values exactly, the
memory plan reads the preset, the paper's presets hold the paper's settings, and a thinking preset
takes only the view that drops its reasoning as bfcl-eval does."""

import dataclasses
import os
import subprocess
import sys

import pytest

from common import presets
from common.envs.tau2 import Tau2Env
from common.presets import PRESETS, Preset
from common.train import memplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PRESETS = [name for name, p in PRESETS.items() if p.gpu_mem_gib]
# Values a shell mangles unless each is quoted: spaces, quotes, $, a glob, a newline, nothing.
AWKWARD = {"USER_MODEL_NAME": "a b  'c' \"d\" $HOME `x` *", "USER_BASE_URL": "http://h/v1", "OOD": "bfcl-memory tau2",
           "EXTRA_TRAIN": "--cpu\n--x", "SERVER": ""}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "common.presets", *args], cwd=ROOT, capture_output=True, text=True)


def shell_values(*args):
    """What bash holds after evaluating the presets' output: each variable, and RECORD's words."""
    names = [f.name.upper() for f in dataclasses.fields(Preset)] + ["OMEGA", "REWEIGHT", "ADAPTIVE_RHO", "TURN_CREDIT",
                                                                     "LORA_RANK"]
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
    # with no GPUs listed, a GPU preset runs on its own NPROC
    assert p == dataclasses.replace(PRESETS[name], gpus=PRESETS[name].nproc if p.gpu_mem_gib else "",
                                    lr=PRESETS[name].lr or presets.LR_FULL)
    assert all(isinstance(getattr(p, f.name), str) for f in dataclasses.fields(p))
    assert p.tasks in ("data/train.jsonl", "data/tiny.jsonl") and int(p.rounds) >= 1 and int(p.eval_every) >= 1
    if p.gpu_mem_gib:
        assert memplan.load_arch(p.model).params > 1e9
        assert p.sharded and int(p.nproc) > 1 and "--gradient-checkpointing" in p.extra_train.split()
    else:
        assert p.model == "offline-tiny" and not p.sharded and "--cpu" in p.extra_train.split()


def test_a_stage_run_by_hand_takes_the_presets_defaults():
    """Each stage's own parser defaults to what a preset that keeps the shared defaults runs with;
    evaluation's lengths are bfcl-eval's instead."""
    import evaluate
    import rollout
    import train_grpo
    from common.engine import playargs
    from common.envs.bfcl import play

    d = Preset()
    roll = rollout.parser.parse_args(["--model", "m", "--tasks", "t", "--out", "o"])
    assert (roll.n, roll.temperature, roll.max_model_len, roll.max_new_tokens, roll.prompts) == (
        int(d.n), float(d.temp), int(d.max_len), int(d.max_new), d.prompts)
    spec = playargs.play_spec(roll, rollout.parser, temperature=roll.temperature, prompts=roll.prompts)
    assert spec == dataclasses.replace(play.PlaySpec(), schedule="async")  # PlaySpec's defaults are these too
    ev = evaluate.parser.parse_args([])
    for args in (roll, ev):
        assert (args.engine, args.handler, args.max_steps_per_turn, args.call_format) == (
            d.engine, d.bfcl_handler, int(d.max_steps), d.call_format)
    assert (ev.max_model_len, ev.max_new_tokens) == (None, playargs.BFCL_MAX_NEW_TOKENS)
    for args in (roll, ev):  # the τ² user simulator's
        assert (args.user_timeout, args.user_tool_parser) == (float(d.user_timeout), d.user_tool_parser)
    train = train_grpo.parser.parse_args(["--model", "m", "--rollouts", "r", "--diagnoses", "d", "--out", "o"])
    assert (train.kl_coef, train.mini_batch_tasks, train.max_tokens_per_micro_batch, train.lora_r) == (
        float(d.kl), int(d.mini_batch), int(d.micro_tokens), presets.LORA_RANK)
    # the objective: the presets' values, and the same choices as the trainer's (common/train/grpo.py)
    assert (train.rollout_is, train.rollout_is_cap, train.clip_high, train.adv_scale, train.ratio_level, train.cut,
            train.max_model_len) == (d.rollout_is, float(d.rollout_is_cap), None, d.adv_scale, d.ratio_level, d.cut,
                                     int(d.max_len))
    choices = {a.dest: tuple(a.choices) for a in train_grpo.parser._actions if a.choices}
    for field in ("rollout_is", "adv_scale", "ratio_level", "cut"):
        assert presets.CHOICES[field] == choices[field], field


def test_set_overrides_one_variable_and_refuses_what_is_not_one():
    p = presets.resolve("qwen7b", ["MAX_LEN=8192", "EXTRA_TRAIN=", "LR=1e-6=x", "ROUNDS=3"])
    assert dataclasses.asdict(p) == dataclasses.asdict(PRESETS["qwen7b"]) | {
        "max_len": "8192", "extra_train": "", "lr": "1e-6=x", "rounds": "3", "gpus": "4"}
    assert PRESETS["qwen7b"].max_len == "16384"  # the entry itself is left as it was
    for args, message in [(["qwen7b", "--set", "NOPE=1"], "--set NOPE: not a preset variable (ROUNDS EVAL_EVERY MODEL"),
                          (["qwen7b", "--set", "max_len=1"], "--set max_len: not a preset variable"),
                          (["qwen7b", "--set", "MAX_LEN"], "--set MAX_LEN: VAR=VALUE expected"),
                          (["qwen9b"], f"unknown preset qwen9b ({', '.join(PRESETS)})"),
                          (["tiny", "--mode", "seal-ish"], "unknown mode seal-ish (seal, vanilla, no-env"),
                          (["tiny", "--set", "KEEP=some"], "KEEP=some: use evaluated, latest or all"),
                          (["tiny", "--set", "PROMPTS=chat"], "PROMPTS=chat: use bfcl or template"),
                          (["tiny", "--set", "THINKING=yes"], "THINKING=yes: use '' or 1"),
                          (["tiny", "--set", "ROLLOUT_IS=tis"], "ROLLOUT_IS=tis: use off, token-tis, token-mask"),
                          (["tiny", "--set", "ROLLOUT_IS_CAP=1"], "ROLLOUT_IS_CAP=1: the rollout correction's cap"),
                          (["tiny", "--set", "CLIP_HIGH=x"], "CLIP_HIGH=x: the clip's upper ε"),
                          (["tiny", "--set", "CUT=drop"], "CUT=drop: use mask or keep"),
                          (["qwen7b", "--set", "GPUS=0"], "GPUS=0: a GPU preset runs on 1, 2, 4 or 8 GPUs; the preset "
                                                          "that runs on CPU is tiny"),
                          (["qwen7b", "--set", "GPUS=3"], "GPUS=3: a GPU preset runs on 1, 2, 4 or 8 GPUs"),
                          (["qwen7b", "--set", "GPUS=1", "--set", "TP=2"], "TP=2: the server's tensor parallel size "
                                                                          "must divide GPUS=1")]:
        res = cli(*args)
        assert res.returncode == 2 and message in res.stderr and res.stdout == "", (args, res.stderr)


@pytest.mark.parametrize("name", PRESETS)
def test_the_shell_gets_the_python_values_exactly(name):
    """bash's variables after `eval "$(python -m common.presets ...)"` are the resolved preset's fields,
    awkward values too; RECORD is what config.json records, under its keys."""
    sets = [a for k, v in AWKWARD.items() for a in ("--set", f"{k}={v}")]
    for mode, m in presets.MODES.items():
        values, record = shell_values(name, "--mode", mode, *sets)
        p = presets.resolve(name, [f"{k}={v}" for k, v in AWKWARD.items()], presets.visible_gpus())
        assert values == {**{f.name.upper(): getattr(p, f.name) for f in dataclasses.fields(p)},
                          "OMEGA": m.omega, "REWEIGHT": "" if m.reweight else "--no-reweight",
                          "ADAPTIVE_RHO": "--adaptive-rho" if m.adaptive_rho else "",
                          "TURN_CREDIT": "--turn-credit" if m.turn_credit else "",
                          "LORA_RANK": str(presets.LORA_RANK)}
        assert values["USER_MODEL_NAME"] == AWKWARD["USER_MODEL_NAME"] and values["EXTRA_TRAIN"] == "--cpu\n--x"
        assert record == [f"{k}={v}" for k, v in presets.record(p, name, mode).items()]
    keys = dict(w.split("=", 1) for w in record)
    # the keys earlier runs recorded (readers of config.json and resumes use them)
    assert keys["max_model_len"] == p.max_len and keys["accelerate_config"] == p.accel_config
    assert keys["max_new_tokens"] == p.max_new and keys["temperature"] == p.temp and keys["preset"] == name


def test_only_sharding_accelerate_configs_count_as_sharded():
    """The plan counts FSDP shards of the weights only where the Accelerate config asks for them."""
    sharded = {name: Preset(accel_config=f"configs/accelerate/{name}").sharded
               for name in sorted(os.listdir(os.path.join(ROOT, "configs", "accelerate")))}
    assert sharded == {"ddp_cpu2.yaml": False, "fsdp_1gpu.yaml": True, "fsdp_2gpu.yaml": True, "fsdp_4gpu.yaml": True,
                       "fsdp_8gpu.yaml": True, "fsdp_cpu.yaml": True}
    assert not Preset().sharded and not Preset(accel_config="configs/accelerate/none.yaml").sharded


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_a_set_reaches_the_plan(name):
    """loop.sh --plan plans a --set's value (the preset's own: tests/test_memplan.py)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(["bash", "loop.sh", name, "--plan", "--rounds", "2", "--set", "NPROC=8", "--set", "LORA=--lora"],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert "8 GPUs x" in res.stdout and "train stage (FSDP over 8 processes" in res.stdout
    assert "frozen base weights (bf16, 1/8)" in res.stdout


@pytest.mark.parametrize("gpus", ["1", "2", "4", "8"])
def test_gpus_k_places_the_server_and_the_trainer_on_k_gpus(gpus):
    """GPUS=K: the server's data parallel size K / TP, K training processes and the FSDP file for K;
    what --set names itself stays; with no GPUS, the GPUs found, else the preset's own count."""
    p = presets.resolve("qwen3-4b", [f"GPUS={gpus}"])
    assert (p.gpus, p.dp, p.tp, p.nproc, p.accel_config) == (gpus, gpus, "1", gpus, f"configs/accelerate/fsdp_{gpus}gpu.yaml")
    assert p.sharded and os.path.isfile(os.path.join(ROOT, p.accel_config))
    if gpus != "1":
        assert presets.resolve("qwen3-4b", [f"GPUS={gpus}", "TP=2"]).dp == str(int(gpus) // 2)
    p = presets.resolve("qwen7b", [f"GPUS={gpus}", "ACCEL_CONFIG=configs/accelerate/fsdp_cpu.yaml", "DP=1"])
    assert (p.nproc, p.dp, p.accel_config) == (gpus, "1", "configs/accelerate/fsdp_cpu.yaml")
    assert presets.resolve("qwen7b", found=int(gpus)).nproc == gpus
    assert presets.resolve("qwen7b", found=0).nproc == PRESETS["qwen7b"].nproc == "4"
    with pytest.raises(presets.PresetError, match="nvidia-smi -L lists 3: choose with --set GPUS=K"):
        presets.resolve("qwen7b", found=3)
    assert presets.resolve("qwen7b", ["GPUS=2"], found=3).nproc == "2"
    assert presets.resolve("tiny", found=int(gpus)) == PRESETS["tiny"]  # a CPU preset has no GPUs to place


# The paper's settings (docs/design.md §7), shared by its presets: GRPO groups of 8, 32 tasks a round in
# mini-batches of 8, 18 rounds evaluated every 6, lr 1e-6, KL 0.001, temperature 1.0, bfcl-eval's step
# limit of 20, 16k context and 1024 new tokens a call, evaluation as bfcl-eval's local inference.
PAPER = dict(rounds="18", eval_every="6", engine="vllm", server="", gpus="", tp="1", lora="", tasks_per_round="32",
             n="8", mini_batch="8", lr="", kl="0.001", temp="1.0", max_steps="20", max_len="16384",
             max_new="1024", train_limit="", eval_limit="", keep="evaluated", tasks="data/train.jsonl", seed="0",
             ood="", ood_limit="", prompts="bfcl", eval_len="", eval_new="", thinking="", report_to="none",
             bfcl_model="", call_format="", env="bfcl", tau_k="1",
             # beyond the paper, in every preset: the rollout correction that drops nothing (docs/design.md §6)
             rollout_is="token-tis", rollout_is_cap="2", clip_high="", adv_scale="group", ratio_level="token",
             cut="mask",
             # the τ² user simulator's requests and a served USER_MODEL's tool-call parser
             user_timeout="180", user_tool_parser="hermes")
FOUR_GPUS = dict(nproc="4", dp="4", accel_config="configs/accelerate/fsdp_4gpu.yaml", gpu_mem_gib="79",
                 extra_train="--gradient-checkpointing")
EXPECTED = {
    "qwen3b": PAPER | FOUR_GPUS | dict(model="Qwen/Qwen2.5-3B-Instruct", revision="aa8e72537993ba99e69dfaafa59ed015b17504d1",
                                       micro_tokens="16384", bfcl_handler="QwenFCHandler"),
    "qwen7b": PAPER | FOUR_GPUS | dict(model="Qwen/Qwen2.5-7B-Instruct", revision="a09a35458c702b33eeacc393d103063234e8bc28",
                                       micro_tokens="8192", bfcl_handler="QwenFCHandler"),
    "toolace8b": PAPER | FOUR_GPUS | dict(model="Team-ACE/ToolACE-2-Llama-3.1-8B", revision="", micro_tokens="8192",
                                          bfcl_handler="LlamaHandler"),
    "tiny": PAPER | dict(model="offline-tiny", tasks="data/tiny.jsonl", eval_limit="1", tasks_per_round="8", n="4",
                         mini_batch="2", lr="1e-4", max_steps="3", max_new="96", rounds="2", eval_every="2",
                         ood_limit="1", eval_new="256", extra_train="--cpu", nproc="1", dp="1", accel_config="",
                         gpu_mem_gib="", micro_tokens="32768", revision="", bfcl_handler="QwenFCHandler"),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_the_papers_presets_hold_the_papers_settings(name):
    """Every variable of the paper's presets and of tiny, written out: adding a preset or a variable
    changes none of them."""
    p = dataclasses.asdict(PRESETS[name])
    user = {k: p.pop(k) for k in ("user_model", "user_base_url", "user_model_name")}
    assert p == EXPECTED[name] and set(user.values()) == {""}
    assert presets.resolve(name).lr == EXPECTED[name]["lr"] or "1e-6"  # the paper's, as recorded


def test_lora_trains_at_a_lora_learning_rate_unless_lr_is_set(tmp_path):
    """An adapter at the full fine-tuning rate would move ~10x less than the run intends, with no error:
    LORA=--lora takes LR_LORA, a user's LR wins, and what config.json records, --plan and the one-line
    plan before round 0 print is the rate the trainer gets."""
    lora = presets.resolve("qwen3-4b", ["GPUS=1", "LORA=--lora"])
    assert lora.lr == presets.LR_LORA == "1e-5" and float(lora.lr) == presets.LORA_LR == pytest.approx(10 * presets.LR)
    assert presets.record(lora, "qwen3-4b", "seal")["lr"] == "1e-5"
    assert presets.resolve("qwen3-4b", ["GPUS=1", "LORA=--lora", "LR=3e-6"]).lr == "3e-6"
    assert presets.resolve("qwen3-4b", ["GPUS=1"]).lr == "1e-6"
    assert presets.resolve("tiny", ["LORA=--lora"]).lr == "1e-4"  # a preset's own rate is kept
    shell = presets.shell(lora, "qwen3-4b", "seal").splitlines()
    assert "LR=1e-5" in shell and "lr=1e-5" in shell[-1]  # loop.sh's --lr "$LR", and config.json
    for flag in ("--plan", "--brief"):
        cmd = [sys.executable, "-m", "common.train.memplan", "qwen3-4b", "--set", "GPUS=1", "--set", "LORA=--lora"]
        res = subprocess.run(cmd + ([flag] if flag == "--brief" else []), cwd=ROOT, capture_output=True, text=True)
        assert "LoRA rank 16 at lr 1e-5" in res.stdout.splitlines()[0], res.stdout


def test_the_qwen3_presets_are_bfcl_evals_models_as_its_handler_runs_them():
    """bfcl-eval registers both models for local inference under QwenFCHandler; its handler's prompt
    ends at the assistant's header (Qwen3-8B then thinks, as its template defaults); evaluation keeps
    bfcl-eval's context and new tokens; a thinking model's rollouts get bfcl-eval's 4096 new tokens."""
    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING
    from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler

    for name, registry in (("qwen3-4b", "Qwen/Qwen3-4B-Instruct-2507-FC"), ("qwen3-8b", "Qwen/Qwen3-8B-FC")):
        p, config = PRESETS[name], MODEL_CONFIG_MAPPING[registry]
        assert config.model_name == p.model and config.model_handler is QwenFCHandler and config.is_fc_model
        assert p.bfcl_model == registry  # held-in scores recorded under it, beside the leaderboard's figure
        assert p.bfcl_handler == "QwenFCHandler" and p.prompts == "bfcl" and (p.eval_len, p.eval_new) == ("", "")
        assert len(p.revision) == 40 and memplan.load_arch(p.model).params > 4e9
    prompt = QwenFCHandler._format_prompt(None, [{"role": "user", "content": "hi"}], [])
    assert prompt.endswith("<|im_start|>assistant\n")  # no empty <think></think>: thinking stays on
    assert PRESETS["qwen3-4b"].thinking == "" and PRESETS["qwen3-8b"].thinking == "1"
    assert PRESETS["qwen3-8b"].max_new == "4096" and int(PRESETS["qwen3-8b"].max_len) <= memplan.load_arch(
        "Qwen/Qwen3-8B").max_pos


def test_a_thinking_preset_refuses_a_view_that_keeps_reasoning_before_anything_downloads(tmp_path):
    """THINKING=1 trains on QwenFCHandler's prompts (reasoning dropped at a new user turn, each
    re-rendered segment its own sequence); the chat template or another handler is refused, in
    seconds, before setup or a download."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    for bad in ("PROMPTS=template", "BFCL_HANDLER=LlamaHandler"):
        res = subprocess.run(["bash", "loop.sh", "qwen3-8b", "--runs", str(tmp_path / "runs"), "--set", bad],
                             cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 2 and "THINKING=1" in res.stderr and bad in res.stderr, res.stderr
        assert "setup:" not in res.stdout + res.stderr and not os.listdir(tmp_path)
    res = subprocess.run(["bash", "loop.sh", "qwen3-8b", "--plan", "--set", "GPUS=4"], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("memory plan: qwen3-8b Qwen/Qwen3-8B (8.19 B parameters")


def test_seal_adaptive_is_seal_with_the_rounds_own_rho():
    """The one mode beyond the paper differs from seal only in train_grpo.py's --adaptive-rho;
    seal and every ablation keep the fixed table."""
    assert presets.MODES["seal-adaptive"] == dataclasses.replace(presets.MODES["seal"], adaptive_rho=True)
    assert [name for name, m in presets.MODES.items() if m.adaptive_rho] == ["seal-adaptive"]
    record = presets.record(presets.resolve("tiny"), "tiny", "seal-adaptive")
    assert record["adaptive_rho"] == "--adaptive-rho" and presets.record(presets.resolve("tiny"), "tiny", "seal")[
        "adaptive_rho"] == ""


def test_seal_turn_is_seal_with_credit_by_turn():
    """seal-turn differs from seal only in train_grpo.py's --turn-credit, which loop.sh passes and
    config.json records; both modes beyond the paper are the research modes --compare marks."""
    assert presets.MODES["seal-turn"] == dataclasses.replace(presets.MODES["seal"], turn_credit=True)
    assert [name for name, m in presets.MODES.items() if m.turn_credit] == ["seal-turn"]
    assert presets.RESEARCH_MODES == ("seal-adaptive", "seal-turn")
    record = presets.record(presets.resolve("tiny"), "tiny", "seal-turn")
    assert record["turn_credit"] == "--turn-credit" and record["adaptive_rho"] == ""
    assert presets.record(presets.resolve("tiny"), "tiny", "seal")["turn_credit"] == ""
    loop = open(os.path.join(ROOT, "loop.sh")).read()
    assert "$REWEIGHT $ADAPTIVE_RHO $TURN_CREDIT --lr" in loop and "|seal-adaptive|seal-turn]" in loop


def test_env_tau2_plays_a_domains_train_split_and_checks_its_user():
    """ENV=tau2:DOMAIN: the rollouts' tasks are the domain's train split unless TASKS says otherwise;
    a malformed ENV, a half-named endpoint, two user simulators, or the τ² OOD bench (which holds the
    training domain) are refused (a GPU preset without a user: tests/test_memplan.py)."""
    assert presets.resolve("tiny", ["ENV=tau2:airline"]).tasks == "tau2:airline:train"
    assert presets.resolve("tiny", ["ENV=tau2:airline", "TASKS=tau2:airline:test"]).tasks == "tau2:airline:test"
    assert presets.resolve("tiny").env == "bfcl" and presets.resolve("tiny").tasks == "data/tiny.jsonl"
    # tiny on τ²: the tasks its model's warm start learnt (common/envs/tau2/tiny.py) and room for a τ² call
    tiny = presets.resolve("tiny", ["ENV=tau2:airline"])
    assert (tiny.train_limit, tiny.max_new) == (str(Tau2Env.TINY_TASKS), str(Tau2Env.TINY_MAX_NEW))
    assert presets.resolve("tiny", ["ENV=tau2:airline", "TRAIN_LIMIT=3", "MAX_NEW=64"]).train_limit == "3"
    user = ["USER_BASE_URL=http://h/v1", "USER_MODEL_NAME=u"]
    gpu = presets.resolve("qwen3-4b", ["ENV=tau2:airline", "GPUS=4", *user])
    assert gpu.train_limit == ""
    # a GPU preset's training context on τ²: sized from the oracle's episodes (bench/tau2_context.py)
    assert gpu.max_len == str(Tau2Env.MAX_LEN) == "32768" and presets.resolve("qwen3-4b", ["GPUS=4"]).max_len == "16384"
    assert presets.resolve("qwen3-4b", ["ENV=tau2:airline", "GPUS=4", "MAX_LEN=20000", *user]).max_len == "20000"
    assert presets.resolve("tiny", ["ENV=tau2:airline"]).max_len == presets.resolve("tiny").max_len
    res = subprocess.run(["bash", "loop.sh", "qwen3-4b", "--plan", "--set", "ENV=tau2:retail", "--set", "GPUS=4",
                          *[w for u in user for w in ("--set", u)]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and ("training context MAX_LEN=32768 is shorter than evaluation's 262144 (the model's "
                                    "own, max_position_embeddings=262144)") in res.stdout, res.stdout + res.stderr
    for sets, message in [(["ENV=tau2"], "use bfcl or tau2:DOMAIN"),
                          (["ENV=tau2:airline", "TAU_K=0"], "TAU_K=0: τ²'s trials per task"),
                          (["ENV=tau2:airline", "OOD=bfcl-memory tau2"], "OOD=tau2 scores the τ² domains"),
                          (["ENV=tau2:airline", "USER_BASE_URL=http://h/v1"], "go together"),
                          (["OOD=bfcl-heldin"], "OOD=bfcl-heldin is another environment's run's"),
                          (["OOD=tau2"], "OOD tau2 needs a user simulator"),
                          (["OOD=nope"], "the benches are bfcl-heldin"),
                          (["ENV=nope:x"], "ENV=nope:x: an environment of bfcl, tau2"),
                          (["ENV=tau2:airline", "USER_MODEL=/m", "USER_BASE_URL=http://h/v1", "USER_MODEL_NAME=n"],
                           "one user simulator")]:
        with pytest.raises(presets.PresetError, match=message):
            presets.resolve("tiny", sets)
