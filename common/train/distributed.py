"""The training processes and what they share: Accelerate, FSDP2, one or N processes alike, with gradients
accumulated and reduced in float32 on every path, whatever `accelerate launch` config (docs/design.md §6).
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

GRAD_CLIP = 1.0  # max gradient norm (train_grpo.py --grad-clip)
# minutes a process waits for the others at a collective (--timeout): torch's 10 would abort a slow save
TIMEOUT_MINUTES = 60


def make_accelerator(cpu=False, timeout=TIMEOUT_MINUTES, mixed_precision=None):
    """The run's Accelerator: bf16 compute on GPUs; on CPU float32 unless the launch asks for bf16."""
    if mixed_precision is None:  # on CPU the launch's choice is honoured for bf16 only: float32 by default
        gpu = torch.cuda.is_available() and not cpu
        mixed_precision = "bf16" if gpu or os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" else "no"
    plugins = distributed_plugins(mixed_precision)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **plugins,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=timeout))])
    if "fsdp_plugin" in plugins and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Accelerate 1.15 would run DDP on CPU processes; torch's fully_shard runs on gloo (PartialState too)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugins["fsdp_plugin"]
    return accelerator


def finish(accelerator):
    """Ends the run on every process at once: one leaving early can abort another at exit over gloo."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


def distributed_plugins(mixed_precision):
    """The FSDP plugin `accelerate launch` asked for, reducing in float32 with no output cast (docs/design.md §6)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return {}
    fsdp = FullyShardedDataParallelPlugin()
    if mixed_precision != "no":
        fsdp.set_mixed_precision(mixed_precision, override=True)
        mp = dataclasses.replace(fsdp.mixed_precision_policy, reduce_dtype=torch.float32, output_dtype=None)
        fsdp.mixed_precision_policy = mp
    return {"fsdp_plugin": fsdp}


def gradient_dtypes(accelerator, model, params):
    """{"grad": accumulation dtype, "reduce": reduction dtype}; raises if either is not float32."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        reduce = policy.reduce_dtype or policy.param_dtype if policy else None
        found = {"grad": reduce or params[0].dtype, "reduce": reduce or params[0].dtype}
    else:
        # a gradient takes its weight's dtype (whatever autocast computes in), DDP's buckets the gradients'
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
    """Put FSDP2's sharded parameters back after a forward with no backward (docs/design.md §6)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole_state_dict(model, accelerator, trainable_only=False):
    """The weights (`trainable_only`: an adapter's alone), whole, on the main process; every process calls it."""
    if not trainable_only:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {}  # not torch's ignore_frozen_params: it would still gather a tied output layer
    for name, p in accelerator.unwrap_model(model).named_parameters():
        if p.requires_grad:
            # FSDP2: one all-gather per tensor, every process in the same (module) order
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            if accelerator.is_main_process:
                state[name] = whole.detach().cpu()
    return state


@contextlib.contextmanager
def shared_atomic_dir(path, accelerator):
    """common.jsonl.atomic_dir of the main process, shared with all; killed runs' leftovers removed first."""
    if accelerator.is_main_process:
        for stale in glob.glob(os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.path.basename(path)}-*")):
            shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(path) if accelerator.is_main_process else contextlib.nullcontext() as tmp:
        tmp = broadcast_object_list([tmp])[0]
        yield tmp
        accelerator.wait_for_everyone()  # every process has written its part before the rename
