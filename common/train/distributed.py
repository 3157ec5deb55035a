"""The training processes and what they share: Accelerate, FSDP2, one or N processes alike, with gradients accumulated and reduced in float32 on every path.

    accelerator = make_accelerator(cpu=False, grad_clip=1.0, timeout=60, mixed_precision=None)
    gradient_dtypes(accelerator, model, params)   # after prepare: {"grad", "reduce"}, both float32
    sharded(accelerator)                          # FSDP2: weights split over the processes
    reshard(model)                                # after a forward with no backward (FSDP2)
    whole_state_dict(model, accelerator)          # the weights, whole, on the main process
    whole_state_dict(model, accelerator, trainable_only=True)   # a LoRA adapter's alone
    save_training_state(folder, model, optimizer, global_step, master, accelerator)
    load_training_state(folder, info, model, optimizer, accelerator)
    with shared_atomic_dir(out, accelerator) as tmp: ...   # one temporary folder, renamed once
    finish(accelerator)                           # every process leaves together

`accelerate launch --config_file configs/accelerate/X.yaml` picks the kind of run through the
environment it starts the processes in; train_grpo.py and bench/plan_check.py build their
Accelerator here, so the benches measure the trainer's own. docs/design.md §6 says why each
setting is what it is.
"""

import contextlib
import dataclasses
import glob
import os
import shutil
from datetime import timedelta

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common.jsonl import atomic_dir
from common.train import checkpoint

GRAD_CLIP = 1.0  # max gradient norm (train_grpo.py --grad-clip)
# Minutes a process waits for the others at a collective (train_grpo.py --timeout): torch's
# default 10 (NCCL) would abort the other ranks while a slow disk takes the save, or a rank
# loads a large model.
TIMEOUT_MINUTES = 60


def make_accelerator(cpu=False, grad_clip=GRAD_CLIP, timeout=TIMEOUT_MINUTES, mixed_precision=None):
    """The run's Accelerator: bf16 compute on GPUs (unless `cpu`); on CPU float32, unless the
    launch asks for bf16 (`accelerate launch --mixed_precision bf16`: the GPU presets' bf16
    FSDP2 on CPU processes, where the tests run it); `mixed_precision` asks for another."""
    if mixed_precision is None:
        if torch.cuda.is_available() and not cpu:
            mixed_precision = "bf16"
        else:  # the launch's choice is honoured only for bf16: float32 stays the CPU default
            mixed_precision = "bf16" if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" else "no"
    plugins = distributed_plugins(mixed_precision, grad_clip)
    accelerator = Accelerator(
        cpu=cpu, mixed_precision=mixed_precision, **plugins,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=timeout))],
    )  # fmt: skip
    if "fsdp_plugin" in plugins and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate 1.15 takes FSDP for accelerators only and would run DDP on CPU processes;
        # torch's fully_shard runs on gloo, so configs/accelerate/fsdp_cpu.yaml gets FSDP2 as asked
        # (PartialState too, as Accelerate's own FSDP setup does: AcceleratorState copies it back)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugins["fsdp_plugin"]
    return accelerator


def finish(accelerator):
    """Ends the run on every process at once: a process that tears its process group down while
    another still holds the connections (the main process writing its files) can abort at exit
    over gloo (SIGABRT, "terminate called without an active exception"), failing a stage whose
    outputs are complete. The prepared models and optimisers are freed first, while the process
    groups they hold are alive and the interpreter whole (the caller drops its own references)."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


def distributed_plugins(mixed_precision, grad_clip):
    """The FSDP plugin `accelerate launch` asked for (through its environment), as Accelerate
    would build it, except that gradients are accumulated and reduced in float32.

    Accelerate's bf16 policy reduces in bf16: FSDP2 would reduce-scatter each micro-batch's
    gradients in bf16; at lr 1e-6 and 7B that rounding is the size
    of the update (verl reduces in float32). Set here, not in the config files, so that no
    config can drop it. DDP needs nothing: its buckets take the float32 weights' dtype
    (checked in gradient_dtypes).

    Accelerate's policy also casts every FSDP2 module's output to bf16 (output_dtype); the
    log-probs leave the model as its output (common/train/grpo.py sequence_logprobs), computed in
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
    return plugins


def gradient_dtypes(accelerator, model, params):
    """{"grad": dtype gradients are accumulated in, "reduce": dtype they are reduced in}; raises
    if either is not float32 (what bench/gpu_check.sh prints from the log)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
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


def sharded(accelerator):
    """The weights, gradients and optimiser state are split over the processes (FSDP2)."""
    return accelerator.distributed_type == DistributedType.FSDP


def reshard(model):
    """Put FSDP2's sharded parameters back on the modules after a forward with no backward.
    Accelerate shards the final norm and the output layer as one group that skips resharding
    after forward (the root likewise): after such a forward those modules hold the unsharded
    tensors in place of the sharded parameters the optimiser steps, so the optimiser's state
    would name parameters the model no longer has (get_optimizer_state_dict: KeyError). A
    backward reshards them; a forward alone (train_grpo.py's weights probe) does not. Nothing
    to do without FSDP2."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole_state_dict(model, accelerator, trainable_only=False):
    """The weights, whole, on the main process (empty elsewhere); every process must call it:
    under FSDP2 it gathers the shards. (Not accelerator.get_state_dict: it picks FSDP2's gather
    by Accelerate's distributed_type, which on CPU processes says MULTI_CPU, and would hand
    the main process sharded DTensors whose every use in save_pretrained is a collective the
    other processes never enter.)

    `trainable_only`: the trainable parameters alone, which are all a LoRA adapter's folder
    keeps; the frozen base is neither gathered nor copied (at 4B that was 8 GB gathered and
    16 GB cast to float32 on the main process each round, to write tens of MB). Not torch's
    ignore_frozen_params: it drops frozen parameters by their first name only, and a tied
    output layer (Qwen3-4B's) would still be gathered."""
    if not trainable_only:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {}
    for name, p in accelerator.unwrap_model(model).named_parameters():
        if p.requires_grad:
            # FSDP2: one all-gather per tensor, every process in the same (module) order
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            if accelerator.is_main_process:
                state[name] = whole.detach().cpu()
    return state


def save_training_state(folder, model, optimizer, global_step, master, accelerator):
    """AdamW's state and (`master`) the float32 weights into `folder`, each process its shard."""
    checkpoint.save(
        folder, model, optimizer, global_step, master, world_size=accelerator.num_processes,
        distributed_type=accelerator.distributed_type.value, main=accelerator.is_main_process,
    )  # fmt: skip


def load_training_state(folder, info, model, optimizer, accelerator):
    """What save_training_state wrote (`info`: its checkpoint.read_info), into the prepared pair."""
    checkpoint.load(folder, info, model, optimizer)


@contextlib.contextmanager
def shared_atomic_dir(path, accelerator):
    """common.jsonl.atomic_dir opened by the main process, its temporary folder shared with all.
    The temporary folders of earlier runs that were killed before their rename (no except
    clause runs on SIGKILL) are removed first: nothing else writes `path`."""
    if accelerator.is_main_process:
        for stale in glob.glob(
            os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.path.basename(path)}-*")
        ):
            shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(path) if accelerator.is_main_process else contextlib.nullcontext() as tmp:
        tmp = broadcast_object_list([tmp])[0]
        yield tmp
        accelerator.wait_for_everyone()  # every process has written its part before the rename
