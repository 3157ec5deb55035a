"""SEAL train stage: one round of diagnosis-weighted GRPO on the round's rollouts.

    python train_grpo.py --model DIR --rollouts R.jsonl --diagnoses D.jsonl --out round_001/policy [...]
    accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml train_grpo.py ... --cpu  # FSDP2

Writes the next policy to --out and one metrics line per optimiser step (docs/design.md §6 and §3).
"""

import argparse
import dataclasses
import math
import os
import random
import shutil
import sys
import time
from typing import NamedTuple

import torch
from accelerate.utils import set_seed
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from common import presets
from common.engine import serve
from common.engine.models import load_tokenizer, model_context, resolve_model
from common.envs import checks_turns, cut_stops
from common.jsonl import RecordError, read_json, read_jsonl, write_json, write_jsonl
from common.train import checkpoint, grpo, memplan
from common.train import distributed as dist

# fmt: off
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", required=True, help="HF model folder, or a PEFT adapter folder to keep training")
parser.add_argument("--rollouts", required=True)
parser.add_argument("--diagnoses", required=True)
rho_source = parser.add_mutually_exclusive_group()
rho_source.add_argument("--interface", help="interface.json; its 'rho' (if any) is the utility table")
rho_source.add_argument("--rho", help="JSON object {label: utility}")
parser.add_argument("--out", required=True, help="folder for the next policy")
parser.add_argument("--metrics", help="default: train_metrics.jsonl in the folder that holds --out")
parser.add_argument("--ref-model", help="the initial policy, KL reference (default: --model)")
parser.add_argument("--no-reweight", action="store_true", help="w = 1 for every trajectory (ρ ≡ 1)")
parser.add_argument("--adaptive-rho", action="store_true", help="this round's ρ_t from its own diagnoses (seal-adaptive)")
parser.add_argument("--turn-credit", action="store_true", help="a model token's advantage is A times its turn's weight")
parser.add_argument("--lr", type=float, help=f"default {presets.LR:g}, or {presets.LORA_LR:g} training an adapter")
parser.add_argument("--kl-coef", type=float, default=presets.KL_COEF, help="0 disables the KL term and the reference")
parser.add_argument("--clip", type=float, default=0.2)
parser.add_argument("--clip-high", type=float, help="the clip's upper ε (DAPO's clip-higher); default --clip")
parser.add_argument("--rollout-is", choices=grpo.ROLLOUT_IS, default=presets.ROLLOUT_IS,
                    help="rollout correction against the engine's log-probs; off: the paper's objective")
parser.add_argument("--rollout-is-cap", type=float, default=presets.ROLLOUT_IS_CAP,
                    help="C: tis weighs by min(π_old/μ, C), mask drops ratios outside [1/C, C]")
parser.add_argument("--adv-scale", choices=grpo.ADV_SCALES, default=presets.ADV_SCALE,
                    help="group: (r − mean) / std (the paper's); none: r − mean (Dr. GRPO)")
parser.add_argument("--ratio-level", choices=grpo.RATIO_LEVELS, default=presets.RATIO_LEVEL,
                    help="token: PPO's per-token ratio; sequence: GSPO's")
parser.add_argument("--cut", choices=("mask", "keep"), default=presets.CUT,
                    help="trajectories whose end is not the policy's failure: left out (mask) or trained (keep)")
parser.add_argument("--max-model-len", type=int, default=presets.MAX_MODEL_LEN, help="the rollouts' context")
parser.add_argument("--eval-len", type=int, help="evaluation's context (default: the model's own)")
parser.add_argument("--clip-ratio-c", type=float, default=3.0, help="dual clip for A < 0; 0 disables")
parser.add_argument("--mini-batch-tasks", type=int, default=presets.MINI_BATCH_TASKS, help="tasks per optimiser step, at least")
parser.add_argument("--zero-variance", choices=("drop", "keep"), default="drop", help="groups with equal rewards")
parser.add_argument("--max-tokens-per-micro-batch", type=int, default=presets.MICRO_TOKENS, help="padded tokens per forward")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--grad-clip", type=float, default=dist.GRAD_CLIP, help="max gradient norm; 0 disables")
parser.add_argument("--lora", action="store_true")
parser.add_argument("--lora-r", type=int, default=presets.LORA_RANK)
parser.add_argument("--lora-alpha", type=int, default=32)
parser.add_argument("--gradient-checkpointing", action="store_true")
parser.add_argument("--save-optimizer", action="store_true", help="write <out>/optimizer/")
parser.add_argument("--optimizer-state", help="previous <out>/optimizer/ (its master weights, if any, replace --model's)")
parser.add_argument("--policy-dtype", choices=("float32", "bfloat16", "float16"),
                    help="the saved policy's; default: on GPU the input config's 16-bit dtype, else float32")
parser.add_argument("--timeout", type=float, default=dist.TIMEOUT_MINUTES, help="minutes to wait at a collective")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--cpu", action="store_true", help="force CPU (Accelerator(cpu=True))")
# fmt: on

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
OPTIMIZER_DIR = "optimizer"  # inside --out


def main(argv=None):
    args = parser.parse_args(argv)
    if args.mini_batch_tasks < 1 or args.epochs < 1 or args.max_tokens_per_micro_batch < 1:
        parser.error("--mini-batch-tasks, --epochs and --max-tokens-per-micro-batch must be positive")
    if args.clip_ratio_c != 0 and args.clip_ratio_c <= 1:
        parser.error("--clip-ratio-c must be above 1 (or 0 to disable the dual clip)")
    if args.lora and args.policy_dtype not in (None, "float32"):
        parser.error("--policy-dtype: an adapter is saved in float32 (it is its own master copy)")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.rollout_is_cap <= 1:
        parser.error("--rollout-is-cap must be above 1 (the band [1/C, C] holds ratio 1)")
    if args.clip_high is not None and args.clip_high <= 0 or not 0 < args.clip < 1:
        parser.error("--clip must lie in (0, 1) and --clip-high be positive")
    if args.max_model_len < 1 or args.eval_len is not None and args.eval_len < 1:
        parser.error("--max-model-len and --eval-len must be positive")
    if args.adaptive_rho and args.rho:
        parser.error("--adaptive-rho and --rho: --rho fixes the utility table, the adaptive rule computes it "
                     "(it scales the table of --interface, else the default)")
    if args.adaptive_rho and args.no_reweight:
        parser.error("--adaptive-rho and --no-reweight: without the diagnosis weight (w = 1) there is no ρ to adapt")
    try:
        train(args)
    except RecordError as e:
        sys.exit(f"error: {e}")


def train(args):
    # Inputs: everything the round needs from disk, checked before a model is loaded or a file written.
    rho = grpo.load_rho(args.interface, args.rho)
    rollouts = read_jsonl(args.rollouts, required=ROLLOUT_FIELDS)
    diagnoses = read_jsonl(args.diagnoses, required=DIAGNOSIS_FIELDS)
    policy = read_policy(args.model, args.lora)
    stops = round_cut_stops(args, rollouts, policy)
    trajectories, adapted = join(args, rollouts, diagnoses, rho, stops)
    temperature, unsampled = grpo.rollout_temperature(rollouts, args.rollouts)
    check_tokens(trajectories, rollouts, policy.vocab_size, args.rollouts, engine=args.rollout_is != "off")
    reference = choose_reference(args.kl_coef, args.ref_model, policy)
    state_info = checkpoint.read_info(args.optimizer_state) if args.optimizer_state else None

    accelerator = dist.make_accelerator(args.cpu, args.timeout)
    if unsampled and accelerator.is_main_process:
        print(f"warning: {args.rollouts}: {unsampled} of {len(rollouts)} records carry no sampling temperature; "
              "read as temperature 1", file=sys.stderr)
    if adapted:
        accelerator.print(rho_line(adapted))
    set_seed(args.seed)
    # Plan: the same mini-batches on every process, and the memory they need.
    mini_batches, zero_var_share = plan_mini_batches(args, trajectories, accelerator)
    check_memory(args, policy, reference, mini_batches, accelerator)
    # Score: the reference's log-probs and the input policy's, before any step.
    t0 = time.perf_counter()
    reference_logprobs(reference, mini_batches, temperature, accelerator)
    scoring = time.perf_counter() - t0
    training = load_policy(args, policy, accelerator, state_info)
    start = start_probe(args, policy, training, state_info, accelerator)
    t0 = time.perf_counter()
    old_logprobs(training.model, reference, mini_batches, temperature, accelerator)
    for mb in mini_batches:  # against the engine's log-probs, once the old ones are known
        for seq in (s for micro in mb.mine for s in micro):
            grpo.rollout_correction(seq, args.rollout_is, args.rollout_is_cap)
    # verl's timing_s/ref and timing_s/old_log_prob
    this_round = Round(zero_var_share, temperature, reference.model, scoring + time.perf_counter() - t0, adapted,
                       sum(t.cut for t in trajectories) / len(trajectories), sorted(stops), objective(args),
                       args.turn_credit)
    # Optimise, then save.
    metrics = optimise(args, training, mini_batches, this_round, accelerator)
    if not metrics:
        metrics = [nothing_to_learn(trajectories, training.global_step, this_round, accelerator)]
    save(args, policy, training, metrics, accelerator, start)
    del training  # the prepared model holds its process groups: freed with the interpreter whole
    dist.finish(accelerator)


# ---------------------------------------------------------------- inputs
ROLLOUT_FIELDS = ["task_id", "sample_index", "tokens"]
DIAGNOSIS_FIELDS = ["task_id", "sample_index", "reward", "profile"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The input policy, as --model names it."""
    base_path: str  # the model folder; for an adapter, its base (common/engine/models.py resolve_model)
    adapter_in: bool  # --model is a PEFT adapter folder, whose training continues
    use_lora: bool  # an adapter is trained (--lora, or an input adapter)
    saved_dtype: str | None  # the input config's dtype, which the saved config keeps
    vocab_size: int | None


@dataclasses.dataclass(frozen=True)
class Reference:
    """The KL reference's source (None: no KL, "ref_model", "input" or "base": under the adapter), its folder."""
    source: str | None
    model: str | None


@dataclasses.dataclass(frozen=True)
class Round:
    """What every metrics line of the round records beside its step's own figures."""
    zero_var_share: float  # of the round's groups, those whose rewards are all equal
    temperature: float  # the rollouts' sampling temperature, at which every log-prob is taken
    ref_model: str | None  # the KL reference's absolute folder; None without KL
    logprob_seconds: float  # the round's reference and old-log-prob passes
    adapted: object = None  # --adaptive-rho: the round's AdaptedRho (common/train/grpo.py)
    cut_share: float = 0.0  # of the round's trajectories, those cut (--cut mask)
    cut_stops: list = dataclasses.field(default_factory=list)  # the stop values that cut (none with --cut keep)
    objective: dict = dataclasses.field(default_factory=dict)  # the objective's flags (objective())
    turn_credit: bool = False  # --turn-credit: every metrics line records turn_stats

    def recorded(self):
        """The fields every metrics line ends with (a step's before its lr); --adaptive-rho's ρ_t among them."""
        out = {"objective": self.objective, "cut_share": self.cut_share, "cut_stops": self.cut_stops,
               "temperature": self.temperature, "ref_model": self.ref_model, "logprob_seconds": self.logprob_seconds}
        if self.adapted:
            a = self.adapted
            out |= {"rho": a.rho, "rho_adapted": a.kept is None, "rho_learnable": a.learnable, "rho_scale": a.scale}
        return out


class Training(NamedTuple):
    """The prepared policy and its AdamW, and the global step the round starts at."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list  # the trainable parameters, as prepared (FSDP2's are sharded)
    global_step: int


def join(args, rollouts, diagnoses, rho, stops=()):
    """(trajectories, those whose stop is in `stops` cut; the round's AdaptedRho or None)."""
    trajectories, adapted = grpo.join_round(
        rollouts, diagnoses, rho, reweight=not args.no_reweight, adaptive=args.adaptive_rho,
        rollouts_path=args.rollouts, diagnoses_path=args.diagnoses, adv_scale=getattr(args, "adv_scale", "group"),
        cut=(lambda r: r.get("stop") in stops) if stops else None, turn_credit=getattr(args, "turn_credit", False),
        checked=checks_turns,
    )  # fmt: skip
    if not trajectories:
        raise RecordError(f"{args.rollouts}: no rollout records")
    return trajectories, adapted


def objective(args):
    """The objective's settings as every metrics line records them (docs/design.md §6)."""
    return {"rollout_is": args.rollout_is, "rollout_is_cap": args.rollout_is_cap, "clip": args.clip,
            "clip_high": args.clip if args.clip_high is None else args.clip_high, "clip_ratio_c": args.clip_ratio_c,
            "adv_scale": args.adv_scale, "ratio_level": args.ratio_level, "cut": args.cut}


def round_cut_stops(args, rollouts, policy):
    """The stops --cut mask leaves out, as each record's environment names them (none with --cut keep)."""
    if args.cut == "keep":
        return set()
    short = args.max_model_len < (args.eval_len or model_context(policy.base_path))
    return set().union(*(cut_stops(r, short) for r in rollouts))


def rho_line(adapted):
    """What the adaptive rule did this round, one line."""
    if adapted.kept:
        return f"adaptive ρ: kept as the table ({adapted.kept})"
    moved = ", ".join(f"{z} {adapted.rho[z]:.3f} (s={s:.2f})" for z, s in adapted.learnable.items())
    return f"adaptive ρ (scale {adapted.scale:.3f}): {moved}"


def read_policy(model, lora):
    """What --model is (a model folder, or an adapter and its base) and what its config says."""
    base_path, adapter, _ = resolve_model(model)
    config = read_json(os.path.join(base_path, "config.json"))
    return Policy(
        base_path=base_path, adapter_in=adapter is not None, use_lora=lora or adapter is not None,
        saved_dtype=config.get("dtype") or config.get("torch_dtype"), vocab_size=config.get("vocab_size"),
    )  # fmt: skip


def check_tokens(trajectories, rollouts, vocab_size, path, engine):
    """Every token id is in the vocabulary; with `engine`, every model token has the engine's log-prob."""
    lines = {(r["task_id"], r["sample_index"]): r["_line"] for r in rollouts}
    for t in (seq for traj in trajectories for seq in traj.sequences()):
        where = f"{path}:{lines[t.task_id, t.sample_index]}"
        if vocab_size and max(t.prompt_ids + t.ids) >= vocab_size:
            raise RecordError(f"{where}: token id outside the model's vocabulary ({vocab_size})")
        missing = sum(1 for e, m in zip(t.engine_logprobs, t.mask, strict=True) if m and e is None) if engine else 0
        if missing:
            raise RecordError(f"{where}: {missing} model token(s) without the engine's log-prob (tokens.logprobs "
                              "null): the rollout correction needs them (--rollout-is off trains without it)")


def choose_reference(kl_coef, ref_model, policy):
    """The KL reference: --ref-model, else the input policy; with LoRA the base under the adapter."""
    if kl_coef <= 0:
        return Reference(None, None)
    if policy.use_lora:
        return Reference("base" if policy.adapter_in else "input", policy.base_path)
    if ref_model and os.path.abspath(ref_model) != policy.base_path:
        folder = os.path.abspath(ref_model)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise RecordError(f"{ref_model}: not a model folder (no config.json)")
        return Reference("ref_model", folder)
    return Reference("input", policy.base_path)


# ---------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class MiniBatch:
    """The whole groups of one optimiser step."""
    trajs: list  # every trajectory of the mini-batch's groups
    mine: list  # this process's micro-batches (lists of sequences: a segmented trajectory's segments apart)
    norm: int  # model tokens of the whole mini-batch, on all processes: the token-mean's denominator


def plan_mini_batches(args, trajectories, accelerator):
    """(mini-batches of whole tasks, alike on every process; the share of groups with equal rewards)."""
    by_task = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    live = [tid for tid, ts in by_task.items() if any(t.advantage != 0.0 for t in ts)]
    zero_var_share = 1 - len(live) / len(by_task) if by_task else 0.0
    tasks = live if args.zero_variance == "drop" else [tid for tid, ts in by_task.items() if not all(t.cut for t in ts)]
    random.Random(args.seed).shuffle(tasks)
    mini_batches = []
    for start, stop in grpo.mini_batch_slices(len(tasks), args.mini_batch_tasks):
        # a cut trajectory is in no loss: its tokens count in no token-mean, its KL pulls nothing
        trajs = [t for tid in tasks[start:stop] for t in by_task[tid] if not t.cut]
        seqs = [s for t in trajs for s in t.sequences()]  # each segment is scored as its own sequence
        plan = grpo.plan_micro_batches([s.length for s in seqs], accelerator.num_processes, args.max_tokens_per_micro_batch)
        mine = [[seqs[k] for k in mb] for mb in plan[accelerator.process_index]]
        mini_batches.append(MiniBatch(trajs=trajs, mine=mine, norm=sum(s.model_tokens for s in seqs)))
    return mini_batches, zero_var_share


def check_memory(args, policy, reference, mini_batches, accelerator):
    """On GPUs, memplan's plan of this update before any model loads: one that cannot fit stops here."""
    if accelerator.device.type != "cuda":
        return
    tokens = max((len(m) * max(t.length for t in m) for mb in mini_batches for m in mb.mine if m), default=0)
    try:
        arch = memplan.load_arch(policy.base_path)
    except memplan.PlanError as e:
        accelerator.print(f"memory plan skipped: {e}")
        return
    if not tokens:
        return
    gpu_mem = torch.cuda.get_device_properties(accelerator.device).total_memory
    plans = [memplan.train_plan(arch, accelerator.num_processes, dist.sharded(accelerator), tokens,
                                args.gradient_checkpointing, gpu_mem, lora=policy.use_lora)]
    if reference.source == "ref_model":
        plans.append(memplan.reference_plan(arch, tokens, gpu_mem))
    for plan in plans:
        accelerator.print(memplan.render(plan, gpu_mem))
        if not plan.fits:
            raise RecordError(f"memory plan: {plan.title} needs {plan.peak / memplan.GIB:.1f} GiB per GPU, over the "
                              f"limit of {plan.limit / memplan.GIB:.1f} GiB: lower --max-tokens-per-micro-batch (the "
                              f"largest micro-batch pads to {tokens} tokens), add --gradient-checkpointing, or shard "
                              "over more GPUs")


# ---------------------------------------------------------------- score
def reference_logprobs(reference, mini_batches, temperature, accelerator):
    """A separate reference model scores every trajectory and is freed before the policy loads."""
    if reference.source != "ref_model" or not mini_batches:
        return
    on_gpu = accelerator.device.type != "cpu"
    ref = AutoModelForCausalLM.from_pretrained(reference.model, dtype=torch.bfloat16 if on_gpu else torch.float32)
    ref = ref.to(accelerator.device).eval()
    with accelerator.autocast():
        for mb in mini_batches:
            grpo.score_trajectories(ref, mb.mine, accelerator.device, "ref_logprobs", temperature)
    del ref
    accelerator.free_memory()


def load_policy(args, policy, accelerator, state_info=None):
    """The prepared policy (or base + LoRA adapter) and AdamW: a Training, continuing --optimizer-state."""
    # a frozen base is only computed with: bf16 under bf16 compute; the adapter peft adds stays float32
    bf16_base = policy.use_lora and accelerator.mixed_precision == "bf16"
    model = AutoModelForCausalLM.from_pretrained(policy.base_path, dtype=torch.bfloat16 if bf16_base else torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy.use_lora:
        from peft import LoraConfig, PeftModel, get_peft_model
        if policy.adapter_in:
            model = PeftModel.from_pretrained(model, args.model, is_trainable=True)
            # the saved adapter names its base as found: a relative name would point elsewhere from the new folder
            model.peft_config["default"].base_model_name_or_path = policy.base_path
        else:
            # no LoRA dropout: it would make the first step's ratio differ from 1 by noise
            model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                     target_modules="all-linear", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    # no weight decay: a round is a handful of steps and decay would only shrink the policy
    lr = args.lr if args.lr is not None else presets.LORA_LR if policy.use_lora else presets.LR
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP2 replaces them with sharded ones
    dtypes = dist.gradient_dtypes(accelerator, model, params)
    accelerator.print(f"gradients accumulated in {dtypes['grad']}, reduced in {dtypes['reduce']}")
    if policy.use_lora:
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        accelerator.print(f"adapter in {sorted(map(str, {p.dtype for p in params}))}, "
                          f"frozen base in {sorted(map(str, frozen))}")
    if not args.optimizer_state:
        return Training(model, optimizer, params, 0)
    checkpoint.load(args.optimizer_state, state_info, model, optimizer)
    for g in optimizer.param_groups:
        g["lr"] = lr
    master = " and float32 master weights" if state_info.get("master_weights") else ""
    accelerator.print(f"resuming optimiser state{master} from {args.optimizer_state} "
                      f"(global step {state_info['global_step']})")
    return Training(model, optimizer, params, state_info["global_step"])


@torch.no_grad()
def old_logprobs(model, reference, mini_batches, temperature, accelerator):
    """Log-probs of the input weights (π_old), and the reference's where it is the input or the base."""
    model.eval()
    for mb in mini_batches:
        grpo.score_trajectories(model, mb.mine, accelerator.device, "old_logprobs", temperature)
        if reference.source == "base":
            with accelerator.unwrap_model(model).disable_adapter():
                grpo.score_trajectories(model, mb.mine, accelerator.device, "ref_logprobs", temperature)
        elif reference.source == "input":
            for t in (t for micro in mb.mine for t in micro):
                t.ref_logprobs = t.old_logprobs


# ---------------------------------------------------------------- optimise
def optimise(args, training, mini_batches, this_round, accelerator):
    """Every mini-batch once per epoch: one metrics line per optimiser step."""
    model, optimizer, params, global_step = training
    metrics = []
    max_norm = args.grad_clip if args.grad_clip > 0 else math.inf
    bar = tqdm(total=len(mini_batches) * args.epochs, desc="grpo optimiser steps", unit="step",
               disable=not accelerator.is_main_process)
    model.train()
    for epoch in range(args.epochs):
        # drawn from the global step, so a run split into rounds keeps one run's order
        for mb in random.Random(f"{args.seed}/{global_step}").sample(mini_batches, len(mini_batches)):
            t0 = time.perf_counter()
            sums = grpo.accumulate_gradients(model, accelerator, mb.mine, mb.norm, args.clip, args.kl_coef,
                                             args.clip_ratio_c, this_round.temperature, args.clip_high, args.ratio_level)
            grad_norm = accelerator.clip_grad_norm_(params, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            global_step += 1
            metrics.append({"step": len(metrics) + 1, "global_step": global_step, "epoch": epoch}
                           | step_metrics(args.kl_coef, mb, sums, grad_norm, seconds, this_round, accelerator)
                           | {"lr": optimizer.param_groups[0]["lr"]})
            bar.update(1)
            bar.set_postfix(loss=f"{metrics[-1]['loss']:.4f}", reward=f"{metrics[-1]['reward_mean']:.2f}")
    bar.close()
    return metrics


def nothing_to_learn(trajectories, global_step, this_round, accelerator):
    """The one metrics line of a round with no optimiser step (its weights, for comparison)."""
    accelerator.print("no group has differing rewards: nothing to learn, the policy is written unchanged")
    return {
        "step": 0, "global_step": global_step, **weight_stats(trajectories),
        "zero_var_share": this_round.zero_var_share, "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
        **(turn_stats(trajectories) if this_round.turn_credit else {}), **this_round.recorded(),
    }  # fmt: skip


def weight_stats(trajs):
    ws = [t.weight for t in trajs]
    w_mean = sum(ws) / len(ws)
    return {"w_mean": w_mean, "w_std": math.sqrt(sum((w - w_mean) ** 2 for w in ws) / len(ws))}


def turn_stats(trajs):
    """Of the model tokens with A < 0 those in weight-0 turns; the mean weight of turns holding tokens."""
    neg = zeroed = 0
    ws = []
    for t in trajs:
        for v, n in zip(t.turn_weights, t.turn_tokens, strict=True):
            if n:
                ws.append(v)
                if t.advantage < 0:
                    neg += n
                    zeroed += n if v == 0 else 0
    return {"turn_zeroed_share": zeroed / neg if neg else None, "turn_w_mean": sum(ws) / len(ws) if ws else None}


def logprob_mismatch(mb):
    """(Σ |engine - trainer|, count, Σ ratio, max ratio) over this process's model tokens; ratio π_old/μ."""
    mm_sum = mm_count = ratio_sum = 0.0
    ratio_max = -math.inf
    for t in (t for micro in mb.mine for t in micro):
        engine = torch.tensor([math.nan if e is None else e for e in t.engine_logprobs])
        used = torch.tensor(t.mask, dtype=torch.bool) & ~engine.isnan()
        diff = (t.old_logprobs - engine)[used]
        mm_sum += diff.abs().sum().item()
        mm_count += used.sum().item()
        if used.any():
            ratio = diff.double().exp()
            ratio_sum += ratio.sum().item()
            ratio_max = max(ratio_max, ratio.max().item())
    return mm_sum, mm_count, ratio_sum, ratio_max


def step_metrics(kl_coef, mb, sums, grad_norm, seconds, this_round, accelerator):
    keys = ("pg_sum", "kl_sum", "clip_count", "dual_clip_count", "tokens", "entropy_sum")
    mm_sum, mm_count, ratio_sum, ratio_max = logprob_mismatch(mb)
    seqs = [s for micro in mb.mine for s in micro]
    is_hits = [sum(s.is_hits for s in seqs), sum(s.is_hits > 0 for s in seqs), len(seqs)]
    local = [sums.get(k, 0.0) for k in keys] + [mm_sum, mm_count, ratio_sum] + is_hits
    pg, kl, clipped, dual, tokens, ent, mm_sum, mm_count, ratio_sum, hit_tokens, hit_seqs, n_seqs = accelerator.reduce(
        torch.tensor(local, dtype=torch.float64, device=accelerator.device), "sum"
    ).tolist()
    ratio_max = accelerator.gather(torch.tensor([ratio_max], dtype=torch.float64, device=accelerator.device)).max().item()
    tokens = max(tokens, 1)
    labelled = sum(t.labelled_turns for t in mb.trajs)
    return {
        "loss": (pg + kl_coef * kl) / tokens, "pg_loss": pg / tokens, "kl": kl / tokens, "clip_frac": clipped / tokens,
        "dual_clip_frac": dual / tokens, "entropy": ent / tokens,
        # of model tokens, those truncated (tis) or masked (mask); of sequences, those with such a token
        "rollout_is_frac": hit_tokens / tokens, "rollout_is_seq_frac": hit_seqs / n_seqs if n_seqs else 0.0,
        "grad_norm": float(grad_norm) if grad_norm is not None else None, **weight_stats(mb.trajs),
        "wa_mean": sum(t.weight * t.advantage for t in mb.trajs) / len(mb.trajs),
        **(turn_stats(mb.trajs) if this_round.turn_credit else {}),
        "unplayed_share": sum(t.unplayed_turns for t in mb.trajs) / labelled if labelled else None,
        "zero_var_share": this_round.zero_var_share, "reward_mean": sum(t.reward for t in mb.trajs) / len(mb.trajs),
        "model_tokens": int(tokens), "tokens_per_s": sum(s.length for t in mb.trajs for s in t.sequences()) / seconds,
        "seconds": seconds, "logprob_mismatch": mm_sum / mm_count if mm_count else None,
        "is_ratio_mean": ratio_sum / mm_count if mm_count else None, "is_ratio_max": ratio_max if mm_count else None,
        **this_round.recorded(),
    }


# ---------------------------------------------------------------- save
def save(args, policy, training, metrics, accelerator, start=None):
    """The next policy and the training state, renamed into --out together, and the metrics."""
    model = training.model
    global_step = metrics[-1]["global_step"]
    metrics_path = args.metrics or os.path.join(os.path.dirname(os.path.abspath(args.out)), "train_metrics.jsonl")
    dtype = saved_dtype(args, policy, accelerator)
    probe = None if policy.use_lora else weights_probe(args, model, dtype, accelerator)
    accelerator.wait_for_everyone()
    with dist.shared_atomic_dir(args.out, accelerator) as tmp:
        if args.save_optimizer:
            master = not policy.use_lora and dtype != torch.float32
            checkpoint.save(os.path.join(tmp, OPTIMIZER_DIR), model, training.optimizer, global_step, master,
                            accelerator.num_processes, accelerator.distributed_type.value, accelerator.is_main_process)
        # an adapter's folder keeps its trainable weights alone: the frozen base is never gathered
        state_dict = dist.whole_state_dict(model, accelerator, trainable_only=policy.use_lora)
        if accelerator.is_main_process:
            cast = {}  # tied weights share one tensor, and keep sharing it
            for k, v in state_dict.items():
                state_dict[k] = cast.setdefault(v.data_ptr(), v.to(dtype))  # the float32 one freed as it goes
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
            del state_dict, cast
            if not policy.use_lora and policy.saved_dtype:
                # save_pretrained records the dtype of the weights; engines should keep loading the input's
                saved = read_json(os.path.join(tmp, "config.json"))
                write_json(os.path.join(tmp, "config.json"), saved | {"dtype": policy.saved_dtype})
            for name in TOKENIZER_FILES:
                for folder in (args.model, policy.base_path):
                    if os.path.isfile(os.path.join(folder, name)):
                        shutil.copy(os.path.join(folder, name), os.path.join(tmp, name))
                        break
            if probe:
                write_json(os.path.join(tmp, serve.PROBE), probe | weights_record(args, tmp, start))
            write_jsonl(metrics_path, metrics)
    steps = sum(m["step"] > 0 for m in metrics)
    accelerator.print(f"{steps} optimiser steps; policy written to {args.out} ({str(dtype)[6:]}); metrics to "
                      f"{metrics_path}")


def weights_probe(args, model, dtype, accelerator):
    """serve.py's probe log-probabilities under the weights being saved (every process runs the forward)."""
    ids = serve.probe_ids(load_tokenizer(args.model))
    if len(ids) < 2:  # a tokenizer that cannot spell it: the label alone is checked
        return None
    x = torch.tensor([ids], dtype=torch.long, device=accelerator.device)
    training = model.training
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1].float()
    dist.reshard(model)  # FSDP2: a forward with no backward leaves the root group gathered
    model.train(training)
    lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
    return {"ids": ids, "logprobs": lp.tolist(), "dtype": str(dtype).removeprefix("torch.")}


def start_probe(args, policy, training, state_info, accelerator):
    """The probe's log-probabilities under --model's own weights: serve.py measures its tolerance on them."""
    if policy.use_lora or (state_info or {}).get("master_weights"):
        return None
    probe = weights_probe(args, training.model, None, accelerator)
    return probe and probe["logprobs"]


def weights_record(args, folder, start):
    """Beside the probe: every saved tensor's sha256, the previous policy's of those changed, the start."""
    digests = serve.file_digests(folder)
    before = os.path.join(args.model, serve.PROBE)
    before = read_json(before).get("sha256") if os.path.isfile(before) else None
    before = before or serve.file_digests(args.model)
    changed = {k: v for k, v in before.items() if k in digests and digests[k] != v}
    return {"sha256": digests, "previous": changed,
            "start": {"model": os.path.abspath(args.model), **({"logprobs": start} if start else {})}}


def saved_dtype(args, policy, accelerator):
    """--policy-dtype, else on GPU the input config's 16-bit dtype; on CPU and for an adapter float32."""
    if args.policy_dtype:
        return getattr(torch, args.policy_dtype)
    if accelerator.mixed_precision != "no" and not policy.use_lora and policy.saved_dtype in ("bfloat16", "float16"):
        return getattr(torch, policy.saved_dtype)
    return torch.float32


if __name__ == "__main__":
    main()
