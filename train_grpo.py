"""SEAL train stage: one round of diagnosis-weighted GRPO on the round's rollouts.

Joins the rollouts (token ids, loss mask, engine log-probs) with their diagnoses (reward,
label profile) on (task_id, sample_index), gives each trajectory the advantage
Ã_j = w_j·A_j with the SEAL weight w_j = clip(Σ_z p_j(z)·ρ(z), 0.5, 2.0) (common/grpo.py),
and takes one optimiser step per mini-batch of tasks with the PPO-clipped token-mean loss
(with verl's dual clip: for A < 0 the loss is at most -A·clip_ratio_c, --clip-ratio-c 3,
0 off) plus a k3 KL penalty to the initial policy. Writes the next policy to --out.

    python train_grpo.py --model DIR --rollouts R.jsonl --diagnoses D.jsonl \\
        [--interface interface.json | --rho rho.json] --out round_001/policy \\
        [--ref-model ROUND0_MODEL] [--save-optimizer] [--optimizer-state round_000/policy/optimizer] [--lora]
    accelerate launch --multi_gpu --num_processes 2 train_grpo.py ... --cpu      # 2-process DDP on CPU
    accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml train_grpo.py ... --cpu  # FSDP2, 2 CPU processes
    accelerate launch --config_file configs/accelerate/fsdp_4gpu.yaml train_grpo.py ...   # 7B, 4 GPUs
    accelerate launch --config_file configs/accelerate/zero3_4gpu.yaml train_grpo.py ...  # needs deepspeed

Multi-node: the same command on every node with `--num_machines N --machine_rank R
--main_process_ip HOST --main_process_port PORT --num_processes <total GPUs>` added after
`accelerate launch` (loop.sh does it through srun inside a SLURM allocation: common/launch.py);
every node needs the input files and --model, and --out on a filesystem all nodes share (each
process writes its shard of the optimiser state).

Semantics:
- Group = all samples of one task_id in the rollouts file. A = (r - mean)/(std + 1e-6) with
  the population std. Groups with equal rewards have A = 0; their share is logged.
  --zero-variance drop (default) leaves them out of the update entirely: no forward/backward,
  no KL term, no tokens in the token-mean denominator; a round whose groups all have equal
  rewards writes the input policy (and optimiser state) unchanged. --zero-variance keep is
  verl's loss over every sample: their tokens carry no policy gradient but the KL term, and
  count in the denominator. Drop is the default because it is docs/design.md §6's rule (such groups
  contribute nothing), and because with keep the step the informative groups take shrinks
  with the share of tasks every sample solved or every sample failed, which changes from
  round to round as the policy improves, and their forward/backward is compute spent for
  a KL pull alone.
- Mini-batches: the trained groups, shuffled (--seed), split into ⌊n/B⌋ mini-batches of
  whole groups (B = --mini-batch-tasks; one when n < B) whose sizes differ by at most one:
  a leftover that does not fill a mini-batch is spread over the others, never a step of
  one or two groups.
- The weight and the advantage's sign: as in the paper, w_j = clip(Σ_z p_j(z)·ρ(z), 0.5, 2.0)
  does not look at the sign of A_j, so a high-ρ label (invalid_tool_call, 2.0) doubles the
  push up of a rewarded trajectory and the push down of a failed one alike. Σ_j A_j = 0 in
  a group but Σ_j w_j·A_j is not: differing weights shift the group's net update (a
  baseline shift); wa_mean reports it per step. This implementation keeps the formula.
- Unplayed turns: diagnose.py labels every user turn of the task, also those after a
  force-quit or context stop that the rollout never entered (typically missing_tool_call or
  correct_abstention, evidence "not played"), and p_j(z) is the fraction over all of them,
  as in the paper; so those turns weigh on w_j though the model produced no token for them.
  This implementation keeps that (the weight is the paper's) and reports their share of
  the step's labelled turns as unplayed_share.
- ρ: the interface file's "rho" if it has one, else --rho FILE (a JSON object), else
  common.taxonomy.RHO. A profile label missing from ρ is an error. --no-reweight sets w = 1.
- Old log-probs are recomputed by this trainer with the input weights before the first
  step; the engine's log-probs only feed the logprob_mismatch and is_ratio metrics.
- Temperature: old, new and reference log-probs are those of softmax(logits / T), T the
  sampling temperature the rollout records carry ("sampling": {"temperature", "top_p",
  "top_k"}, written by common/play.py), as verl and TRL score them; there is no flag that
  could disagree with the rollouts. A file that mixes temperatures is refused (file:line),
  and so is T = 0: greedy samples of one task are one trajectory (nothing to compare) and
  have no sampling distribution to take a ratio against. Records without the field (older
  files) are read as T = 1, with a warning naming the file. top-p / top-k other than off
  are refused: the trainer does not score a truncated distribution.
- KL reference (the paper's: the initial policy in every round): --ref-model, which loop.sh
  sets to the round-0 model in every round; without it, the input policy. With LoRA it is
  the base model (adapter disabled) and --ref-model is ignored. Reference log-probs are
  computed before the policy is loaded (or, with LoRA, with its adapter off), so only one
  model is held while training. --kl-coef 0 skips it.
- One optimiser across rounds: --save-optimizer writes the optimiser state (AdamW moments and
  step counts, and the float32 master weights when the policy is saved below float32) to
  <out>/optimizer with torch.distributed.checkpoint, every process its shard, plus the global
  step count (common/checkpoint.py; under DeepSpeed ZeRO-3 its own checkpoint, through
  Accelerate's save_state); --optimizer-state DIR (the previous round's <out>/optimizer) loads
  it, on any number of processes (DCP reshards), so round t+1 continues round t's optimisation
  from the float32 weights, bit-identically to one longer run of the same steps: one process,
  DDP and FSDP2 alike. --timeout (minutes, default 60) is how long a process waits for the
  others at a collective, a slow save included. The learning rate is constant (no schedule,
  as in the paper); --lr overrides the saved one. Each epoch's order of mini-batches is
  drawn from --seed and the global step it starts at, so k rounds of one epoch on the same
  rollouts take the same steps as one run of k epochs.
- Loss = Σ over model tokens of the mini-batch / number of model tokens in the mini-batch
  (on all processes together), so 1 or N processes give the same update.
- Precision: full fine-tuning keeps float32 weights and, on GPU, computes in bf16 (autocast):
  a bf16 weight cannot absorb an lr-1e-6 update. Gradients are accumulated over micro-batches
  and reduced across processes in float32 on every path (FSDP's reduce_dtype and DeepSpeed's
  communication/accumulation dtypes are set in code, whatever the config file says; DDP's
  follow the float32 weights); the log states them. The policy is saved once, in --policy-dtype:
  by default on GPU the input config's 16-bit dtype (what the engines load), on CPU float32;
  below float32 the next round resumes from the master weights of <out>/optimizer, not from the
  rounded policy. config.json keeps the input's dtype. With LoRA the frozen base is bf16 on
  GPU and the adapter float32 (its own master). CPU: float32 throughout.
- --lr: 1e-6 is the paper's full fine-tuning value; LoRA usually needs about 1e-5.
- Memory: on GPUs, common/memplan.py's plan of the update (the model's config.json, the largest
  padded micro-batch, the processes and their sharding) is checked before any model loads; one
  that cannot fit stops naming what to change (--max-tokens-per-micro-batch,
  --gradient-checkpointing, more GPUs). The CPU path is not checked.

Outputs: --out holds a Hugging Face model folder (plus the tokenizer and chat-template
files of --model), or with --lora (or when --model is an adapter folder, whose training then
continues) a PEFT adapter folder whose adapter_config.json names the base model's absolute
path (an input adapter's relative base is read as common/engines.py resolve_model reads it); with --save-optimizer also <out>/optimizer/ (a torch.distributed.checkpoint folder;
trainer_state.json holds global_step). Policy and optimiser state appear together or not at
all; a temporary folder a killed save left beside --out is removed by the rerun.
--metrics (default: train_metrics.jsonl next to --out) gets one line per optimiser step:
step (in this round), global_step (across rounds, carried in the optimiser state), epoch,
loss, pg_loss, kl, clip_frac (model tokens where PPO's clip applied), dual_clip_frac (tokens
with A < 0 whose loss the dual clip capped, verl's pg_clipfrac_lower), grad_norm (before
clipping), w_mean, w_std, wa_mean (mean w_j·A_j over the step's trajectories), unplayed_share
(of the step's labelled turns, those the rollout never played), zero_var_share (of the
round's groups), reward_mean (of the step's trajectories), model_tokens, tokens_per_s (prompt
+ response tokens per second of the update step), seconds (of the update step),
logprob_mismatch (mean |engine - trainer| log-prob over model tokens), is_ratio_mean and
is_ratio_max (of exp(trainer - engine log-prob) over those tokens), temperature (of the
rollouts), lr, ref_model (absolute folder of the KL reference; null without KL),
logprob_seconds (the round's reference and old-log-prob passes). A round with nothing to
learn writes one line with step 0, the global step so far, the weights, zero-variance share,
reward of all trajectories, temperature, ref_model and logprob_seconds.
Bad input stops with `error: file:line: ...`, a non-zero exit and no output.
"""

import argparse
import contextlib
import dataclasses
import glob
import math
import os
import random
import shutil
import sys
import time
from datetime import timedelta

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
    set_seed,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from common import checkpoint, memplan, serve
from common.grpo import (
    accumulate_gradients,
    join_trajectories,
    load_rho,
    mini_batch_slices,
    plan_micro_batches,
    rollout_temperature,
    score_trajectories,
)
from common.jsonl import RecordError, atomic_dir, read_json, read_jsonl, write_json, write_jsonl
from common.models import resolve_model

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
parser.add_argument("--lr", type=float, default=1e-6, help="1e-6 for full fine-tuning; ~1e-5 with --lora")
parser.add_argument("--kl-coef", type=float, default=0.001, help="0 disables the KL term and the reference")
parser.add_argument("--clip", type=float, default=0.2)
parser.add_argument("--clip-ratio-c", type=float, default=3.0,
                    help="dual clip for A < 0 (verl's clip_ratio_c); 0 disables")
parser.add_argument("--mini-batch-tasks", type=int, default=8, help="tasks (whole groups) per optimiser step, at least")
parser.add_argument("--zero-variance", choices=("drop", "keep"), default="drop",
                    help="groups with equal rewards: left out (default), or kept in the loss as verl does")
parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384, help="padded tokens per forward")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables")
parser.add_argument("--lora", action="store_true")
parser.add_argument("--lora-r", type=int, default=16)
parser.add_argument("--lora-alpha", type=int, default=32)
parser.add_argument("--gradient-checkpointing", action="store_true")
parser.add_argument("--save-optimizer", action="store_true", help="write <out>/optimizer/")
parser.add_argument("--optimizer-state", help="previous <out>/optimizer/ (its master weights, if any, replace --model's)")
parser.add_argument("--policy-dtype", choices=("float32", "bfloat16", "float16"),
                    help="dtype of the saved policy; default: the input config's 16-bit dtype when training on GPU, "
                         "else float32 (below float32, <out>/optimizer keeps the float32 master weights)")
parser.add_argument("--timeout", type=float, default=60,
                    help="minutes a process waits for the others at a collective (a slow save on a busy disk)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--cpu", action="store_true", help="force CPU (Accelerator(cpu=True))")
# fmt: on

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
OPTIMIZER_DIR = "optimizer"  # inside --out
TRAINER_STATE = checkpoint.INFO  # inside the optimiser folder: {"global_step": N, ...}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    try:
        train(args)
    except RecordError as e:
        sys.exit(f"error: {e}")


def train(args):
    # Everything the round needs from disk, checked before a model is loaded or a file written.
    rho = load_rho(args.interface, args.rho)
    rollouts = read_jsonl(args.rollouts, required=ROLLOUT_FIELDS)
    diagnoses = read_jsonl(args.diagnoses, required=DIAGNOSIS_FIELDS)
    trajectories = join(args, rollouts, diagnoses, rho)
    temperature, warning = read_temperature(rollouts, args.rollouts)
    policy = read_policy(args.model, args.lora)
    check_vocabulary(trajectories, rollouts, policy.vocab_size, args.rollouts)
    reference = choose_reference(args.kl_coef, args.ref_model, policy)
    state_info = check_optimizer_state(args.optimizer_state)
    metrics_path = args.metrics or os.path.join(
        os.path.dirname(os.path.abspath(args.out)), "train_metrics.jsonl"
    )

    accelerator = make_accelerator(args)
    if warning and accelerator.is_main_process:
        print(warning, file=sys.stderr)
    set_seed(args.seed)
    mini_batches, zero_var_share = plan_mini_batches(args, trajectories, accelerator)
    check_memory(args, policy, reference, mini_batches, accelerator)
    t0 = time.perf_counter()
    reference_logprobs(reference, mini_batches, temperature, accelerator)
    scoring = time.perf_counter() - t0
    model, optimizer, params, global_step = load_policy(args, policy, accelerator, state_info)
    t0 = time.perf_counter()
    old_logprobs(model, reference, mini_batches, temperature, accelerator)
    round_fields = {
        "zero_var_share": zero_var_share,
        "temperature": temperature,
        "ref_model": reference.model,
        # the reference's and the input policy's log-prob passes (verl's timing_s/ref and old_log_prob)
        "logprob_seconds": scoring + time.perf_counter() - t0,
    }
    metrics, global_step = optimise(
        args, model, optimizer, params, global_step, mini_batches, trajectories, round_fields, accelerator
    )
    save(args, policy, model, optimizer, metrics, global_step, metrics_path, accelerator)


# ---------------------------------------------------------------- inputs

ROLLOUT_FIELDS = ["task_id", "sample_index", "tokens"]
DIAGNOSIS_FIELDS = ["task_id", "sample_index", "reward", "profile"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The input policy, as --model names it."""

    base_path: str  # the model folder; for an adapter, its base (resolved as common/engines.py does)
    adapter_in: bool  # --model is a PEFT adapter folder, whose training continues
    use_lora: bool  # an adapter is trained (--lora, or an input adapter)
    saved_dtype: str | None  # the input config's dtype, which the saved config keeps
    vocab_size: int | None


@dataclasses.dataclass(frozen=True)
class Reference:
    """The KL reference: where its log-probs come from (source), and its absolute folder, which
    the metrics record as ref_model. source None: --kl-coef 0, no reference; "ref_model": a
    separate model (--ref-model), scored before the policy is loaded; "input": the input
    weights, whose old log-probs are the reference's; "base": the base under the input
    adapter, scored with the adapter disabled."""

    source: str | None
    model: str | None


def join(args, rollouts, diagnoses, rho):
    """The rollouts joined with their diagnoses: trajectories with weights and advantages."""
    trajectories = join_trajectories(
        rollouts, diagnoses, rho, reweight=not args.no_reweight,
        rollouts_path=args.rollouts, diagnoses_path=args.diagnoses,
    )  # fmt: skip
    if not trajectories:
        raise RecordError(f"{args.rollouts}: no rollout records")
    return trajectories


def read_temperature(rollouts, path):
    """The rollouts' sampling temperature, and the warning to print if some records carry none."""
    temperature, unsampled = rollout_temperature(rollouts, path)
    if not unsampled:
        return temperature, None
    return temperature, (
        f"warning: {path}: {unsampled} of {len(rollouts)} records carry no sampling temperature; "
        "read as temperature 1"
    )


def read_policy(model, lora):
    """What --model is (a model folder, or an adapter and its base) and what its config says."""
    base_path, adapter, _ = resolve_model(model)
    config = read_json(os.path.join(base_path, "config.json"))
    return Policy(
        base_path=base_path, adapter_in=adapter is not None, use_lora=lora or adapter is not None,
        saved_dtype=config.get("dtype") or config.get("torch_dtype"), vocab_size=config.get("vocab_size"),
    )  # fmt: skip


def check_vocabulary(trajectories, rollouts, vocab_size, path):
    """Every token id is one the model has (names the rollout's line)."""
    lines = {(r["task_id"], r["sample_index"]): r["_line"] for r in rollouts}
    for t in trajectories:
        if vocab_size and max(t.prompt_ids + t.ids) >= vocab_size:
            raise RecordError(
                f"{path}:{lines[t.task_id, t.sample_index]}: token id outside the model's vocabulary ({vocab_size})"
            )


def choose_reference(kl_coef, ref_model, policy):
    """The KL reference (the paper's: the initial policy): --ref-model, else the input policy;
    with LoRA the base with the adapter disabled (a fresh adapter starts out as the base)."""
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


def check_optimizer_state(path):
    """--optimizer-state, if given, is a folder this trainer wrote in the format this run reads
    (DCP; DeepSpeed's own under ZeRO-3): its trainer_state.json, or None."""
    if not path:
        return None
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return checkpoint.read_info(path, "deepspeed" if deepspeed else checkpoint.FORMAT)


# ---------------------------------------------------------------- accelerator


def make_accelerator(args, mixed_precision=None):
    """The run's Accelerator: bf16 compute on GPUs (unless --cpu), float32 on CPU; `mixed_precision`
    asks for another (tests run the GPU presets' bf16 FSDP2 on CPU processes with it)."""
    if mixed_precision is None:
        mixed_precision = "bf16" if torch.cuda.is_available() and not args.cpu else "no"
    # torch's default 10 minutes (NCCL) would abort the other ranks while a slow disk takes
    # the save, or a rank loads a large model
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=args.timeout))
    plugins = distributed_plugins(mixed_precision, args.grad_clip)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=mixed_precision, kwargs_handlers=[timeout], **plugins)
    if "fsdp_plugin" in plugins and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate 1.15 takes FSDP for accelerators only and would run DDP on CPU processes;
        # torch's fully_shard runs on gloo, so configs/accelerate/fsdp_cpu.yaml gets FSDP2 as asked
        # (PartialState too, as Accelerate's own FSDP setup does: AcceleratorState copies it back)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugins["fsdp_plugin"]
    return accelerator


def distributed_plugins(mixed_precision, grad_clip):
    """The FSDP or DeepSpeed plugin `accelerate launch` asked for (through its environment), as
    Accelerate would build it, except that gradients are accumulated and reduced in float32.

    Accelerate's bf16 policy reduces in bf16: FSDP2 would reduce-scatter each micro-batch's
    gradients in bf16, ZeRO-3 likewise; at lr 1e-6 and 7B that rounding is the size
    of the update (verl reduces in float32). Set here, not in the config files, so that no
    config can drop it. DDP needs nothing: its buckets take the float32 weights' dtype
    (checked in gradient_dtypes).

    Accelerate's policy also casts every FSDP2 module's output to bf16 (output_dtype); the
    log-probs leave the model as its output (common/grpo.py sequence_logprobs), computed in
    float32 from the bf16 logits, and that cast would round them to bf16 again (±0.012 nats at
    log p = -3): the ratio, the KL term and the clip fraction would sit on that noise while the
    reference, scored outside FSDP, stays float32. No output cast: each module returns what it
    computed (bf16 hidden states, float32 log-probs)."""
    plugins = {}
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        fsdp = FullyShardedDataParallelPlugin()
        if mixed_precision != "no":
            fsdp.set_mixed_precision(mixed_precision, override=True)
            fsdp.mixed_precision_policy = dataclasses.replace(
                fsdp.mixed_precision_policy, reduce_dtype=torch.float32, output_dtype=None
            )
        plugins["fsdp_plugin"] = fsdp
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds = DeepSpeedPlugin()
        ds.set_mixed_precision(mixed_precision)
        ds.gradient_clipping = grad_clip
        ds.deepspeed_config.update({
            # there is no DataLoader to infer it from; DeepSpeed only uses it for its logging
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": grad_clip,
            "communication_data_type": "fp32",
        })  # fmt: skip
        # ZeRO's default accumulates in the model's dtype (bf16)
        ds.deepspeed_config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
        plugins["deepspeed_plugin"] = ds
    return plugins


def gradient_dtypes(accelerator, model, params):
    """{"grad": dtype gradients are accumulated in, "reduce": dtype they are reduced in}; raises
    if either is not float32 (what bench/gpu_check.sh prints from the log)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        cfg = accelerator.state.deepspeed_plugin.deepspeed_config
        found = {
            "grad": cfg.get("data_types", {}).get("grad_accum_dtype"),
            "reduce": cfg.get("communication_data_type"),
        }
        found = {k: {"fp32": torch.float32}.get(v, v) for k, v in found.items()}
    elif kind == DistributedType.FSDP:
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        reduce = policy.reduce_dtype or policy.param_dtype if policy else None
        found = {"grad": reduce or params[0].dtype, "reduce": reduce or params[0].dtype}
    else:
        # autocast computes in bf16 but a gradient takes its weight's dtype, and DDP's buckets
        # the gradients' (a comm hook, none registered here, could compress them)
        dtypes = {p.dtype for p in params}
        grad = dtypes.pop() if len(dtypes) == 1 else dtypes
        found = {"grad": grad, "reduce": None if getattr(model, "_comm_hooks", None) else grad}
    if any(v != torch.float32 for v in found.values()):
        raise RuntimeError(f"gradients must be accumulated and reduced in float32, got {found} ({kind})")
    return found


# ---------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class MiniBatch:
    """The whole groups of one optimiser step."""

    trajs: list  # every trajectory of the mini-batch's groups
    mine: list  # this process's micro-batches (lists of trajectories)
    norm: int  # model tokens of the whole mini-batch, on all processes: the token-mean's denominator


def plan_mini_batches(args, trajectories, accelerator):
    """Whole tasks (with --zero-variance drop, those with differing rewards only), shuffled into
    balanced mini-batches of at least --mini-batch-tasks: the same plan on every process.
    Returns the mini-batches and the share of groups with equal rewards."""
    by_task = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    live = [tid for tid, ts in by_task.items() if any(t.advantage != 0.0 for t in ts)]
    zero_var_share = 1 - len(live) / len(by_task) if by_task else 0.0
    tasks = live if args.zero_variance == "drop" else list(by_task)
    random.Random(args.seed).shuffle(tasks)
    mini_batches = []
    for start, stop in mini_batch_slices(len(tasks), args.mini_batch_tasks):
        trajs = [t for tid in tasks[start:stop] for t in by_task[tid]]
        plan = plan_micro_batches(
            [t.length for t in trajs], accelerator.num_processes, args.max_tokens_per_micro_batch
        )
        mine = [[trajs[k] for k in mb] for mb in plan[accelerator.process_index]]
        mini_batches.append(MiniBatch(trajs=trajs, mine=mine, norm=sum(t.model_tokens for t in trajs)))
    return mini_batches, zero_var_share


# ---------------------------------------------------------------- memory plan


def check_memory(args, policy, reference, mini_batches, accelerator):
    """On GPUs, common/memplan.py's plan of this update (the model's config.json, the largest
    padded micro-batch, this run's processes and sharding) before any model loads: one that
    cannot fit stops here, naming the flag to change, not in an out-of-memory error minutes later."""
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
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    gpu_mem = torch.cuda.get_device_properties(accelerator.device).total_memory
    chunk = memplan.logprob_chunk()
    plans = [memplan.train_plan(arch, accelerator.num_processes, sharded, tokens, args.gradient_checkpointing,
                                gpu_mem, lora=policy.use_lora, chunk=chunk)]
    if reference.source == "ref_model":
        plans.append(memplan.reference_plan(arch, tokens, gpu_mem, chunk=chunk))
    for plan in plans:
        accelerator.print(memplan.render(plan, gpu_mem))
        if not plan.fits:
            raise RecordError(
                f"memory plan: {plan.title} needs {plan.peak / memplan.GIB:.1f} GiB per GPU, over the limit of "
                f"{plan.limit / memplan.GIB:.1f} GiB: lower --max-tokens-per-micro-batch (the largest micro-batch "
                f"pads to {tokens} tokens), add --gradient-checkpointing, or shard over more GPUs"
            )


# ---------------------------------------------------------------- reference log-probs


def reference_logprobs(reference, mini_batches, temperature, accelerator):
    """A separate reference model (the round-0 policy) scores every trajectory and is freed
    before the policy is loaded: training never holds two models. The other references are
    scored with the policy (old_logprobs)."""
    if reference.source != "ref_model" or not mini_batches:
        return
    ds = accelerator.state.deepspeed_plugin
    # ZeRO-3 would partition the reference like the policy; it is used outside DeepSpeed, whole on every GPU
    no_zero_init = ds.zero3_init_context_manager(enable=False) if ds else contextlib.nullcontext()
    with no_zero_init:
        on_gpu = accelerator.device.type != "cpu"
        ref = AutoModelForCausalLM.from_pretrained(
            reference.model, dtype=torch.bfloat16 if on_gpu else torch.float32
        ).to(accelerator.device)
    ref.eval()
    with accelerator.autocast():
        for mb in mini_batches:
            score_trajectories(ref, mb.mine, accelerator.device, "ref_logprobs", temperature)
    del ref
    accelerator.free_memory()


# ---------------------------------------------------------------- model


def load_policy(args, policy, accelerator, state_info=None):
    """The policy (full model, or base + LoRA adapter) and its AdamW, prepared; with
    --optimizer-state, the optimiser (and the float32 master weights, where the policy folder
    holds fewer bits) continue from the previous round. Returns the global step."""
    on_gpu = accelerator.device.type != "cpu"
    dtype = torch.bfloat16 if policy.use_lora and on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(policy.base_path, dtype=dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy.use_lora:
        from peft import LoraConfig, PeftModel, get_peft_model

        if policy.adapter_in:
            model = PeftModel.from_pretrained(model, args.model, is_trainable=True)
            # the saved adapter names its base as found, not as the input wrote it: a
            # relative name would point elsewhere from the new folder
            model.peft_config["default"].base_model_name_or_path = policy.base_path
        else:
            # no LoRA dropout: it would make the first step's ratio differ from 1 by noise
            lora = LoraConfig(
                r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                target_modules="all-linear", task_type="CAUSAL_LM",
            )  # fmt: skip
            model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    # no weight decay: a round is a handful of steps and decay would only shrink the policy
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP2 replaces them with sharded ones
    dtypes = gradient_dtypes(accelerator, model, params)
    accelerator.print(f"gradients accumulated in {dtypes['grad']}, reduced in {dtypes['reduce']}")
    global_step = 0
    if args.optimizer_state:
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            try:  # DeepSpeed's checkpoint: partitioned float32 master weights and moments
                accelerator.load_state(args.optimizer_state)
            except (ValueError, KeyError, RuntimeError) as e:
                raise RecordError(
                    f"{args.optimizer_state}: does not match this model's trainable parameters ({e})"
                ) from None
        else:
            checkpoint.load(args.optimizer_state, state_info, model, optimizer)
        for g in optimizer.param_groups:
            g["lr"] = args.lr
        global_step = state_info["global_step"]
        master = " and float32 master weights" if state_info.get("master_weights") else ""
        accelerator.print(
            f"resuming optimiser state{master} from {args.optimizer_state} (global step {global_step})"
        )
    return model, optimizer, params, global_step


# ---------------------------------------------------------------- old log-probs


@torch.no_grad()
def old_logprobs(model, reference, mini_batches, temperature, accelerator):
    """Log-probs of the input weights (the PPO ratio's denominator), and the reference's
    where it is the input policy or the base under the adapter."""
    model.eval()
    for mb in mini_batches:
        score_trajectories(model, mb.mine, accelerator.device, "old_logprobs", temperature)
        if reference.source == "base":
            with accelerator.unwrap_model(model).disable_adapter():
                score_trajectories(model, mb.mine, accelerator.device, "ref_logprobs", temperature)
        elif reference.source == "input":
            for t in (t for micro in mb.mine for t in micro):
                t.ref_logprobs = t.old_logprobs


# ---------------------------------------------------------------- optimiser steps


def optimise(
    args, model, optimizer, params, global_step, mini_batches, trajectories, round_fields, accelerator
):
    """Every mini-batch once per epoch; returns the metric lines and the global step reached.
    round_fields: zero_var_share, temperature and ref_model, which every line records."""
    metrics, step = [], 0
    max_norm = args.grad_clip if args.grad_clip > 0 else math.inf
    bar = tqdm(total=len(mini_batches) * args.epochs, desc="grpo optimiser steps", unit="step",
               disable=not accelerator.is_main_process)
    model.train()
    for epoch in range(args.epochs):
        # drawn from the global step, so a run split into rounds keeps one run's order
        for mb in random.Random(f"{args.seed}/{global_step}").sample(mini_batches, len(mini_batches)):
            t0 = time.perf_counter()
            sums = accumulate_gradients(
                model, accelerator, mb.mine, mb.norm, args.clip, args.kl_coef, args.clip_ratio_c,
                round_fields["temperature"],
            )  # fmt: skip
            grad_norm = accelerator.clip_grad_norm_(params, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            step += 1
            global_step += 1
            metrics.append(
                {"step": step, "global_step": global_step, "epoch": epoch}
                | step_metrics(args.kl_coef, mb, sums, grad_norm, seconds, round_fields, accelerator)
                | {"lr": optimizer.param_groups[0]["lr"]}
            )
            bar.update(1)
            bar.set_postfix(loss=f"{metrics[-1]['loss']:.4f}", reward=f"{metrics[-1]['reward_mean']:.2f}")
    bar.close()
    if not mini_batches:
        accelerator.print("no group has differing rewards: nothing to learn, the policy is written unchanged")
        # One step-0 line still records the round's weights, so runs and modes stay comparable.
        reward = sum(t.reward for t in trajectories) / len(trajectories)
        metrics.append({
            "step": 0, "global_step": global_step, **weight_stats(trajectories),
            "zero_var_share": round_fields["zero_var_share"], "reward_mean": reward,
            "temperature": round_fields["temperature"], "ref_model": round_fields["ref_model"],
            "logprob_seconds": round_fields["logprob_seconds"],
        })  # fmt: skip
    return metrics, global_step


def weight_stats(trajs):
    ws = [t.weight for t in trajs]
    w_mean = sum(ws) / len(ws)
    return {"w_mean": w_mean, "w_std": math.sqrt(sum((w - w_mean) ** 2 for w in ws) / len(ws))}


def logprob_mismatch(mb):
    """(Σ |engine - trainer| old log-prob, count, Σ ratio, max ratio) over this process's model
    tokens of a mini-batch that the engine gave a log-prob for; ratio = exp(trainer - engine),
    the importance ratio of the trainer's input policy to the engine's samples (TRL's
    importance_sampling_ratio)."""
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


def step_metrics(kl_coef, mb, sums, grad_norm, seconds, round_fields, accelerator):
    keys = ("pg_sum", "kl_sum", "clip_count", "dual_clip_count", "tokens")
    mm_sum, mm_count, ratio_sum, ratio_max = logprob_mismatch(mb)
    local = [sums[k] for k in keys] + [mm_sum, mm_count, ratio_sum]
    pg, kl, clipped, dual, tokens, mm_sum, mm_count, ratio_sum = accelerator.reduce(
        torch.tensor(local, dtype=torch.float64, device=accelerator.device), "sum"
    ).tolist()
    ratio_max = accelerator.gather(torch.tensor([ratio_max], dtype=torch.float64, device=accelerator.device))
    ratio_max = ratio_max.max().item()
    tokens = max(tokens, 1)
    labelled = sum(t.labelled_turns for t in mb.trajs)
    return {
        "loss": (pg + kl_coef * kl) / tokens,
        "pg_loss": pg / tokens,
        "kl": kl / tokens,
        "clip_frac": clipped / tokens,
        "dual_clip_frac": dual / tokens,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        **weight_stats(mb.trajs),
        "wa_mean": sum(t.weight * t.advantage for t in mb.trajs) / len(mb.trajs),
        "unplayed_share": sum(t.unplayed_turns for t in mb.trajs) / labelled if labelled else None,
        "zero_var_share": round_fields["zero_var_share"],
        "reward_mean": sum(t.reward for t in mb.trajs) / len(mb.trajs),
        "model_tokens": int(tokens),
        "tokens_per_s": sum(t.length for t in mb.trajs) / seconds,
        "seconds": seconds,
        "logprob_mismatch": mm_sum / mm_count if mm_count else None,
        "is_ratio_mean": ratio_sum / mm_count if mm_count else None,
        "is_ratio_max": ratio_max if mm_count else None,
        "temperature": round_fields["temperature"],
        "ref_model": round_fields["ref_model"],
        "logprob_seconds": round_fields["logprob_seconds"],
    }


# ---------------------------------------------------------------- save


def save(args, policy, model, optimizer, metrics, global_step, metrics_path, accelerator):
    """The next policy, written once by the main process in --policy-dtype, and the training
    state (written by every process, its own shard), renamed into --out together."""
    dtype = saved_dtype(args, policy, accelerator)
    master = not policy.use_lora and dtype != torch.float32
    probe = None if policy.use_lora else weights_probe(args, model, dtype, accelerator)
    accelerator.wait_for_everyone()
    with shared_atomic_dir(args.out, accelerator) as tmp:
        if args.save_optimizer:
            save_training_state(
                os.path.join(tmp, OPTIMIZER_DIR), model, optimizer, global_step, master, accelerator
            )
        state_dict = whole_state_dict(model, accelerator)
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
                write_json(os.path.join(tmp, serve.PROBE), probe)
            write_jsonl(metrics_path, metrics)
    steps = sum(m["step"] > 0 for m in metrics)
    accelerator.print(
        f"{steps} optimiser steps; policy written to {args.out} ({str(dtype)[6:]}); metrics to {metrics_path}"
    )
    accelerator.end_training()


def weights_probe(args, model, dtype, accelerator):
    """The log-probabilities of common/serve.py's fixed probe sequence under the weights being
    saved: a vLLM server that says it serves this policy is checked against them (a stale or
    half-loaded engine is refused before it plays). Every process runs the forward (FSDP and
    ZeRO-3 gather the weights in it); an adapter is checked by its name instead."""
    from common.models import load_tokenizer

    ids = serve.probe_ids(load_tokenizer(args.model))
    if len(ids) < 2:  # a tokenizer that cannot spell it: the label alone is checked
        return None
    x = torch.tensor([ids], dtype=torch.long, device=accelerator.device)
    training = model.training
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1].float()
    reshard(model)
    model.train(training)
    lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
    return {"ids": ids, "logprobs": lp.tolist(), "dtype": str(dtype).removeprefix("torch.")}


def reshard(model):
    """Put FSDP2's sharded parameters back on the modules after a forward with no backward.
    Accelerate shards the final norm and the output layer as one group that skips resharding
    after forward (the root likewise): after such a forward those modules hold the unsharded
    tensors in place of the sharded parameters the optimiser steps, so the optimiser's state
    would name parameters the model no longer has (get_optimizer_state_dict: KeyError). A
    backward reshards them; the probe's forward has none. Nothing to do without FSDP2."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole_state_dict(model, accelerator):
    """The weights, whole, on the main process (empty elsewhere); every process must call it:
    under FSDP2 it gathers the shards. (Not accelerator.get_state_dict: it picks FSDP2's gather
    by Accelerate's distributed_type, which on CPU processes says MULTI_CPU, and would hand
    the main process sharded DTensors whose every use in save_pretrained is a collective the
    other processes never enter.)"""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.get_state_dict(model)  # ZeRO-3's 16-bit gather
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def saved_dtype(args, policy, accelerator):
    """--policy-dtype, else: on GPU (bf16 compute) the input config's 16-bit dtype, which the
    engines load anyway; on CPU, and for an adapter (its own master copy), float32."""
    if args.policy_dtype:
        return DTYPES[args.policy_dtype]
    if (
        accelerator.mixed_precision != "no"
        and not policy.use_lora
        and policy.saved_dtype in ("bfloat16", "float16")
    ):
        return DTYPES[policy.saved_dtype]
    return torch.float32


def save_training_state(folder, model, optimizer, global_step, master, accelerator):
    """<out>/optimizer: AdamW's state and (`master`) the float32 weights, sharded (common/checkpoint.py)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DCP does not know ZeRO-3's partitions; DeepSpeed's own checkpoint holds the float32
        # master weights and moments, each rank its partition
        accelerator.save_state(folder)
        if accelerator.is_main_process:
            write_json(
                os.path.join(folder, TRAINER_STATE), {"format": "deepspeed", "global_step": global_step}
            )
        return
    checkpoint.save(
        folder, model, optimizer, global_step, master, world_size=accelerator.num_processes,
        distributed_type=accelerator.distributed_type.value, main=accelerator.is_main_process,
    )  # fmt: skip


@contextlib.contextmanager
def shared_atomic_dir(path, accelerator):
    """common.jsonl.atomic_dir opened by the main process, its temporary folder shared with all.
    The temporary folders of earlier runs that were killed before their rename (no except
    clause runs on SIGKILL) are removed first: nothing else writes --out."""
    if accelerator.is_main_process:
        for stale in glob.glob(
            os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.path.basename(path)}-*")
        ):
            shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(path) if accelerator.is_main_process else contextlib.nullcontext() as tmp:
        tmp = broadcast_object_list([tmp])[0]
        yield tmp
        accelerator.wait_for_everyone()  # every process has written its part before the rename


if __name__ == "__main__":
    main()
