"""Every setting of the loop in one place: the presets, the modes, and the defaults the stages share.

    python -m common.presets PRESET [--mode MODE] [--set VAR=VALUE ...]

prints the shell assignments `bash loop.sh` evaluates: each preset variable, the mode's, RECORD (what
config.json records) and what the environment (ENV, common/envs/__init__.py) decides: its stages' flags, what
evaluation scores, each OOD bench's flags, the run's folder names. A bad preset, mode or value stops with exit 2.
Standard library only, Python >= 3.8: `loop.sh PRESET --plan` runs it on a fresh clone, before setup.sh.
"""

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PresetError(ValueError):
    """An unknown preset, mode or variable, or a value its setting does not take."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """loop.sh's variables, a field each (--set MAX_LEN=... sets max_len), values as text (empty: unset);
    the defaults are the paper's (docs/design.md §7)."""

    rounds: str = "18"  # --rounds
    eval_every: str = "6"  # --eval-every: held-in scores every K rounds, and after the last
    # A hub id at its pinned commit REVISION (docs/hardware.md §1), or a model folder.
    model: str = ""
    engine: str = "vllm"
    server: str = ""  # URL[,URL...]: play on servers the user started instead of loop.sh's own
    # GPUs of the node a GPU preset runs on, 1, 2, 4 or 8 (empty: what `nvidia-smi -L` lists), from which DP,
    # NPROC and ACCEL_CONFIG follow (docs/hardware.md §2)
    gpus: str = ""
    dp: str = "1"  # the vLLM server's data parallel size
    tp: str = "1"  # and tensor parallel size
    nproc: str = "1"  # training processes (accelerate launch)
    accel_config: str = ""  # their Accelerate config (configs/accelerate/)
    lora: str = ""  # --lora: train a LoRA adapter of rank LORA_RANK instead of every weight
    # how the model writes calls (common/engine/calls.py); empty: as the handler's prompts ask (common/envs/bfcl/prompts.py
    # HANDLERS), and a value that contradicts them is refused
    call_format: str = ""
    tasks_per_round: str = "32"
    n: str = "8"  # samples per task: the GRPO group
    mini_batch: str = "8"  # tasks per optimiser step, at least
    lr: str = ""  # empty: LR_FULL, or LR_LORA with LORA=--lora (what the run records is the value used)
    kl: str = "0.001"
    # The objective beyond the paper's (train_grpo.py's flags, docs/design.md §6): the rollout correction
    # and its cap (ROLLOUT_IS=off: the paper's objective exactly), clip-higher, Dr. GRPO's advantages
    # (ADV_SCALE=none), GSPO's ratio (RATIO_LEVEL=sequence), CUT=keep (cut trajectories trained as failures).
    rollout_is: str = "token-tis"
    rollout_is_cap: str = "2"
    clip_high: str = ""
    adv_scale: str = "group"
    ratio_level: str = "token"
    cut: str = "mask"
    temp: str = "1.0"  # rollouts' sampling temperature
    max_steps: str = "20"  # bfcl-eval's step limit: a turn's 21st step with calls force-quits the task
    max_len: str = "16384"  # rollouts' context
    max_new: str = "1024"  # rollouts' new tokens per model call
    train_limit: str = ""  # first K training tasks only
    eval_limit: str = ""  # first K held-in tasks per category only
    micro_tokens: str = "32768"  # padded tokens per training forward (a longer sequence goes alone)
    extra_train: str = ""  # more train_grpo.py flags
    # What stays on disk of earlier rounds: evaluated policies, the latest only, or all (docs/hardware.md §6)
    keep: str = "evaluated"
    # The environment trained on (common/envs/__init__.py KINDS): bfcl, tau2:DOMAIN (a τ²-bench domain against
    # USER_MODEL or USER_BASE_URL and USER_MODEL_NAME; on CPU the scripted user), mcp:DIR (docs/environments.md).
    env: str = "bfcl"
    tasks: str = "data/train.jsonl"  # another ENV's: ENV:train
    seed: str = "0"
    # Out-of-distribution benches after the last round (OOD_BENCHES: evaluate.py --tasks; docs/ood.md), their
    # first K per category/domain, and τ²'s user simulator: USER_MODEL or USER_BASE_URL and USER_MODEL_NAME.
    ood: str = ""
    ood_limit: str = ""
    user_model: str = ""
    user_base_url: str = ""
    user_model_name: str = ""
    # Seconds a user-simulator request may wait, a served USER_MODEL's tool parser (docs/environments.md §2)
    user_timeout: str = "180"
    user_tool_parser: str = "hermes"
    # τ² evaluations: episodes per task; K > 1 adds pass^1..pass^K to scores.json (τ²'s own pass^k)
    tau_k: str = "1"
    # What the model is shown: bfcl-eval's handler BFCL_HANDLER's prompts, in training too (PROMPTS=template:
    # the model's chat template). Evaluation: the model's own context and 4096 new tokens a call, unless
    # EVAL_LEN / EVAL_NEW lower them (scores.json then says they are not bfcl-eval's).
    bfcl_handler: str = "QwenFCHandler"
    # bfcl-eval's registry entry held-in scores are recorded under (evaluate.py --bfcl-model; empty: the handler's)
    bfcl_model: str = ""
    prompts: str = "bfcl"
    # 1: the model writes <think>...</think> before its answer (Qwen3-8B); QwenFCHandler drops it at a new
    # user turn, and the rollout continues there as a new segment (docs/prompts.md)
    thinking: str = ""
    eval_len: str = ""
    eval_new: str = ""
    revision: str = ""
    # Memory of one GPU (GiB, as torch reports it) for the memory plan (common/train/memplan.py); empty: CPU
    gpu_mem_gib: str = ""
    report_to: str = "none"  # experiment trackers (Accelerate's log_with names, comma-separated; all; none)

    @property
    def sharded(self):
        """Whether training shards the weights over its processes, as ACCEL_CONFIG asks: FSDP (the
        file's distributed_type)."""
        path = os.path.join(ROOT, self.accel_config)
        if not self.accel_config or not os.path.isfile(path):
            return False
        with open(path) as f:
            lines = [line.split("#", 1)[0].split(":", 1) for line in f]
        keys = {kv[0].strip(): kv[1].strip().strip("'\"") for kv in lines if len(kv) == 2}
        return keys.get("distributed_type") == "FSDP"


# The values a setting takes, where it takes few.
CHOICES = {"keep": ("evaluated", "latest", "all"), "prompts": ("bfcl", "template"), "thinking": ("", "1"),
           # train_grpo.py's (common/train/grpo.py ROLLOUT_IS, ADV_SCALES, RATIO_LEVELS)
           "rollout_is": ("off", "token-tis", "token-mask", "seq-tis", "seq-mask"), "adv_scale": ("group", "none"),
           "ratio_level": ("token", "sequence"), "cut": ("mask", "keep")}
GPU_COUNTS = ("1", "2", "4", "8")  # GPUS: the node sizes configs/accelerate/ has an FSDP file for
OOD_BENCHES = ("bfcl-heldin", "bfcl-memory", "bfcl-web", "tau2")  # OOD's names, each an evaluate.py --tasks
# config.json's keys for the fields whose key is not the field's name: what earlier runs recorded,
# what a resume compares and what readers of config.json use.
RECORDED_AS = {"accel_config": "accelerate_config", "temp": "temperature", "max_len": "max_model_len",
               "max_new": "max_new_tokens"}
# Settings a rerun may change, and config.json follows: they do not change the loop's results
# (what stays on disk, which OOD benches run after the last round, which trackers get the figures).
MAY_CHANGE = {"server", "keep", "report_to", "ood", "ood_limit", "user_model", "user_base_url", "user_model_name",
              "user_timeout", "user_tool_parser", "gpu_mem_gib"}

# The GPU presets: rollouts on one vLLM server, data parallel over 4 GPUs x TP 1, then FSDP full fine-tuning
# over the same 4 GPUs (docs/hardware.md §2, §8).
FOUR_GPUS = dict(nproc="4", dp="4", accel_config="configs/accelerate/fsdp_4gpu.yaml", gpu_mem_gib="79",
                 extra_train="--gradient-checkpointing")
PRESETS = {
    # the offline tiny model on CPU: 8 first-turn training tasks (data/tiny.jsonl), minutes per round
    "tiny": Preset(
        model="offline-tiny",  # built (once, cached) by loop.sh, unless --set MODEL=... names another
        tasks="data/tiny.jsonl", eval_limit="1", tasks_per_round="8", n="4", mini_batch="2", lr="1e-4",  # LoRA too
        max_steps="3", max_new="96", rounds="2", eval_every="2", ood_limit="1",
        eval_new="256",  # CPU minutes: a tiny model that misses its stop would write 4096 tokens a call
        extra_train="--cpu"),
    "qwen3b": Preset(model="Qwen/Qwen2.5-3B-Instruct", revision="aa8e72537993ba99e69dfaafa59ed015b17504d1",
                     micro_tokens="16384", **FOUR_GPUS),
    "qwen7b": Preset(model="Qwen/Qwen2.5-7B-Instruct", revision="a09a35458c702b33eeacc393d103063234e8bc28",
                     micro_tokens="8192", **FOUR_GPUS),
    # No commit of this repository is pinned: a run names one (--set REVISION=<commit>; docs/hardware.md §1).
    "toolace8b": Preset(model="Team-ACE/ToolACE-2-Llama-3.1-8B", bfcl_handler="LlamaHandler",
                        micro_tokens="8192", **FOUR_GPUS),
    # Beside the paper's: the models bfcl-eval 2026.3.23 registers for local inference with QwenFCHandler,
    # evaluated as that handler runs them (docs/hardware.md §9). Revisions: the hub's commits.
    "qwen3-4b": Preset(model="Qwen/Qwen3-4B-Instruct-2507", revision="cdbee75f17c01a7cc42f958dc650907174af0554",
                       bfcl_model="Qwen/Qwen3-4B-Instruct-2507-FC", micro_tokens="16384", **FOUR_GPUS),  # non-thinking only
    "qwen3-8b": Preset(model="Qwen/Qwen3-8B", revision="b968826d9c46dd6066d109eabc6255188de91218", thinking="1",
                       bfcl_model="Qwen/Qwen3-8B-FC",
                       max_new="4096", max_len="32768", **FOUR_GPUS),
}


@dataclasses.dataclass(frozen=True)
class Mode:
    omega: str  # what evolve.py does to Ω: evolve it, keep it fixed after round 0, or switch every cue off
    reweight: bool  # train_grpo.py's diagnosis weight (else --no-reweight)
    adaptive_rho: bool = False  # ρ from the round's own diagnoses (train_grpo.py --adaptive-rho), not the table
    turn_credit: bool = False  # each turn's tokens weighed by its own label (train_grpo.py --turn-credit)


# SEAL, its baseline and its ablations: modes of the same code (docs/design.md §1).
MODES = {
    "seal": Mode("evolve", True),
    "vanilla": Mode("off", False),
    "no-env": Mode("off", True),
    "no-reweight": Mode("evolve", False),
    "no-closed-loop": Mode("fixed", True),
    "seal-adaptive": Mode("evolve", True, adaptive_rho=True),  # beyond the paper: docs/design.md §6
    "seal-turn": Mode("evolve", True, turn_credit=True),  # beyond the paper: docs/design.md §6
}
# The modes beyond the paper: research modes no GPU run has tested (evaluate.py --compare marks their rows).
RESEARCH_MODES = ("seal-adaptive", "seal-turn")

# The learning rates an empty LR takes: the paper's for full fine-tuning, 10x that for a LoRA adapter
# (docs/design.md §6).
LR_FULL = "1e-6"
LR_LORA = "1e-5"

# The defaults a stage run by hand takes: the presets' own (tests/test_presets.py reads them back from
# each stage's parser).
LR = float(LR_FULL)  # train_grpo.py --lr
LORA_LR = float(LR_LORA)  # train_grpo.py --lr with --lora
KL_COEF = float(Preset.kl)  # train_grpo.py --kl-coef
MINI_BATCH_TASKS = int(Preset.mini_batch)  # train_grpo.py --mini-batch-tasks
MICRO_TOKENS = int(Preset.micro_tokens)  # train_grpo.py --max-tokens-per-micro-batch
ROLLOUT_IS = Preset.rollout_is  # train_grpo.py --rollout-is
ROLLOUT_IS_CAP = float(Preset.rollout_is_cap)  # train_grpo.py --rollout-is-cap
ADV_SCALE = Preset.adv_scale  # train_grpo.py --adv-scale
RATIO_LEVEL = Preset.ratio_level  # train_grpo.py --ratio-level
CUT = Preset.cut  # train_grpo.py --cut
GROUP_SIZE = int(Preset.n)  # rollout.py --n
TEMPERATURE = float(Preset.temp)  # rollout.py --temperature
PROMPTS = Preset.prompts  # rollout.py --prompts
MAX_MODEL_LEN = int(Preset.max_len)  # rollout.py --max-model-len
MAX_NEW_TOKENS = int(Preset.max_new)  # rollout.py --max-new-tokens
# of rollouts and evaluation (common/engine/playargs.py): bfcl-eval's step limit, handler and engine
MAX_STEPS_PER_TURN = int(Preset.max_steps)  # --max-steps-per-turn
HANDLER = Preset.bfcl_handler  # --handler
ENGINE = Preset.engine  # --engine
USER_TIMEOUT = float(Preset.user_timeout)  # --user-timeout (τ² tasks)
USER_TOOL_PARSER = Preset.user_tool_parser  # --user-tool-parser (τ² tasks)
LORA_RANK = 16  # train_grpo.py --lora-r, and the rank the vLLM server is started for
# Positions projected onto the vocabulary at once (common/train/grpo.py sequence_logprobs; docs/design.md §6)
LOGPROB_CHUNK = 1024


def resolve(name, sets=(), found=0):
    """PRESETS[name] with each "VAR=VALUE" of `sets` applied, checked; a GPU preset placed on GPUS
    GPUs (else on the `found` GPUs `nvidia-smi -L` lists, else on its own NPROC)."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name} ({', '.join(PRESETS)})")
    fields = {f.name.upper(): f.name for f in dataclasses.fields(Preset)}
    changes = {}
    for kv in sets:
        var, eq, value = kv.partition("=")
        if not eq:
            raise PresetError(f"--set {kv}: VAR=VALUE expected")
        if var not in fields:
            raise PresetError(f"--set {var}: not a preset variable ({' '.join(fields)})")
        changes[fields[var]] = value
    preset = dataclasses.replace(PRESETS[name], **changes)
    for field, choices in CHOICES.items():
        value = getattr(preset, field)
        if value not in choices:
            words = [c or "''" for c in choices]
            raise PresetError(f"{field.upper()}={value}: use {', '.join(words[:-1])} or {words[-1]}")
    if not (preset.tau_k.isdigit() and int(preset.tau_k) >= 1):
        raise PresetError(f"TAU_K={preset.tau_k}: τ²'s trials per task, a whole number from 1")
    if not positive(preset.user_timeout):
        raise PresetError(f"USER_TIMEOUT={preset.user_timeout}: seconds a user-simulator request may wait, above 0")
    if not _number(preset.rollout_is_cap, above=1):
        raise PresetError(f"ROLLOUT_IS_CAP={preset.rollout_is_cap}: the rollout correction's cap, a number above 1")
    if preset.clip_high and not _number(preset.clip_high, above=0):
        raise PresetError(f"CLIP_HIGH={preset.clip_high}: the clip's upper ε, a positive number (empty: CLIP's)")
    preset = environment(preset, changes)
    if preset.gpu_mem_gib:
        preset = place(preset, changes, found)
    if not preset.lr:
        preset = dataclasses.replace(preset, lr=LR_LORA if preset.lora else LR_FULL)
    return preset


def _number(text, above):
    try:
        return float(text) > above
    except ValueError:
        return False


def positive(text):
    """Whether `text` is a number above 0 (finite)."""
    return _number(text, 0) and float(text) < float("inf")


def environment(preset, changes):
    """The preset as ENV's kind changes it (common/envs/__init__.py preset), its OOD benches checked: another
    ENV than the default plays its train split unless TASKS is set."""
    from common import envs
    if preset.env.split(":", 1)[0] not in envs.KINDS:
        raise PresetError(f"ENV={preset.env}: an environment of {', '.join(envs.KINDS)} (common/envs/__init__.py)")
    if preset.env != Preset.env and "tasks" not in changes:
        preset = dataclasses.replace(preset, tasks=f"{preset.env}:train")
    preset = dataclasses.replace(preset, **envs.preset(preset, changes))
    for bench in preset.ood.split():
        if bench not in OOD_BENCHES:
            raise PresetError(f"OOD={preset.ood}: the benches are {', '.join(OOD_BENCHES)}")
        envs.eval_args(preset, bench)  # a bench that cannot run here stops now
    return preset


def slug(text):
    return "-" + re.sub(r"[^\w.]+", "-", text).strip("-") if text else ""


def folders(env):
    """(the run name's suffix, the base model's folder's) on ENV=`env`: none on the default, else
    -DOMAIN and -tau2-DOMAIN (a run name PRESET-MODE-DOMAIN; base-PRESET-tau2-DOMAIN)."""
    if env in ("", Preset.env):
        return "", ""
    return slug(env.split(":", 1)[-1]), slug(env)


def env_shell(p):
    """What ENV's kind decides for loop.sh, as {variable: value or [words]}: ENV_PLAY (rollout.py's flags),
    EVAL_TASKS and ENV_EVAL (evaluate.py's), OOD_0, OOD_1, ... (each bench's --tasks and flags), the folders."""
    from common import envs
    run, base = folders(p.env)
    tasks = envs.kind_of(p.env).eval_tasks(p.env)
    out = {"ENV_PLAY": envs.play_args(p), "EVAL_TASKS": tasks, "ENV_EVAL": envs.eval_args(p, tasks),
           "RUN_SUFFIX": run, "BASE_SUFFIX": base}
    for i, bench in enumerate(p.ood.split()):
        out[f"OOD_{i}"] = [bench, *envs.eval_args(p, bench)]
    return out


def place(preset, changes, found):
    """A GPU preset on GPUS GPUs: the server's data parallel size, the training processes and their
    FSDP config follow, each unless `changes` (the --set values) names it."""
    gpus = preset.gpus or (str(found) if found else preset.nproc)
    if gpus not in GPU_COUNTS:
        where = "" if preset.gpus else f" (nvidia-smi -L lists {found}: choose with --set GPUS=K)"
        raise PresetError(f"GPUS={gpus}{where}: a GPU preset runs on {', '.join(GPU_COUNTS[:-1])} or "
                          f"{GPU_COUNTS[-1]} GPUs; the preset that runs on CPU is tiny")
    k, tp = int(gpus), int(preset.tp) if preset.tp.isdigit() else 0
    if "dp" not in changes and (tp < 1 or k % tp):
        raise PresetError(f"TP={preset.tp}: the server's tensor parallel size must divide GPUS={gpus}")
    derived = {"gpus": gpus, "nproc": gpus, "dp": str(k // max(tp, 1)),
               "accel_config": f"configs/accelerate/fsdp_{gpus}gpu.yaml"}
    return dataclasses.replace(preset, **{f: v for f, v in derived.items() if f not in changes or f == "gpus"})


def visible_gpus():
    """The GPUs `nvidia-smi -L` lists (0 without nvidia-smi or a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def record(preset, preset_name, mode_name):
    """The settings config.json records, as {key: text}: the preset, the mode and every variable."""
    if mode_name not in MODES:
        raise PresetError(f"unknown mode {mode_name} ({', '.join(MODES)})")
    m = MODES[mode_name]
    out = {"preset": preset_name, "mode": mode_name, "omega": m.omega, "reweight": "" if m.reweight else "--no-reweight",
           "adaptive_rho": "--adaptive-rho" if m.adaptive_rho else "",
           "turn_credit": "--turn-credit" if m.turn_credit else ""}
    for f in dataclasses.fields(Preset):
        out[RECORDED_AS.get(f.name, f.name)] = getattr(preset, f.name)
    return out


def shell(preset, preset_name, mode_name):
    """The bash assignments loop.sh evaluates (every value quoted)."""
    settings = record(preset, preset_name, mode_name)
    lines = [f"{f.name.upper()}={shlex.quote(getattr(preset, f.name))}" for f in dataclasses.fields(Preset)]
    lines += [f"{k.upper()}={shlex.quote(settings[k])}"
              for k in ("omega", "reweight", "adaptive_rho", "turn_credit")]
    lines.append(f"LORA_RANK={LORA_RANK}")
    for var, value in env_shell(preset).items():
        lines.append(f"{var}=" + (shlex.quote(value) if isinstance(value, str) else
                                  "(" + " ".join(shlex.quote(w) for w in value) + ")"))
    return "\n".join(lines + ["RECORD=(" + " ".join(shlex.quote(f"{k}={v}") for k, v in settings.items()) + ")"])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m common.presets", description=__doc__.split("\n\n")[0])
    p.add_argument("preset", help=", ".join(PRESETS))
    p.add_argument("--mode", default="seal", help=", ".join(MODES))
    p.add_argument("--set", action="append", default=[], metavar="VAR=VALUE", help="override one preset variable")
    a = p.parse_args(argv)
    try:
        print(shell(resolve(a.preset, a.set, visible_gpus()), a.preset, a.mode))
    except PresetError as e:
        print(f"loop: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from common import presets  # the module the environments import: one PresetError

    presets.main()

