"""The training state one round hands to the next: AdamW's moments and step counts and, when
the policy folder holds its weights below float32 (bf16 on GPUs), the float32 master weights.
Saved sharded with torch.distributed.checkpoint (DCP): every process writes its own part, in
parallel, and nothing is gathered on one rank. DCP reshards on load, so a folder written by N
processes (one, DDP or FSDP2) is read back by any number under any of them.

    save(folder, model, optimizer, global_step, master=True)   # on every process, after training
    info = read_info(folder)                    # before a model is loaded: RecordError if unusable
    load(folder, info, model, optimizer)        # on every process, after accelerator.prepare

Layout: `.metadata` and one `__<rank>_0.distcp` per process (DCP's), and trainer_state.json:
{"format": "torch.distributed.checkpoint", "global_step", "master_weights" (the folder holds
the float32 weights), "optimizer" (it holds AdamW's state; not before the first step, when AdamW
has none), "world_size", "distributed_type"} (the last two say what wrote it, for the log).
The model is the prepared one (DDP or FSDP2 wrapper, or plain) and the optimizer the torch one
(Accelerate's AcceleratedOptimizer is unwrapped here); keys are parameter names, so any
wrapping reads any other's.
"""

import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.jsonl import RecordError, read_json, write_json

FORMAT = "torch.distributed.checkpoint"
INFO = "trainer_state.json"


def save(folder, model, optimizer, global_step, master, world_size=1, distributed_type="NO", main=True):
    """Write the state into `folder` (shared by all processes; each writes its shard). `master`:
    include the float32 weights (the policy folder has them in a lower dtype)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    # AdamW has no state before its first step; asking DCP for it would take a zero-lr step to
    # create one, whose step count 1 the next round would then continue from
    has_optimizer = global_step > 0
    state = {}
    if master:
        state["model"] = get_model_state_dict(model)
    if has_optimizer:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if state:
        dcp.save(state, checkpoint_id=folder)
    if main:
        info = {
            "format": FORMAT, "global_step": global_step, "master_weights": master, "optimizer": has_optimizer,
            "world_size": world_size, "distributed_type": distributed_type,
        }  # fmt: skip
        write_json(os.path.join(folder, INFO), info)


def read_info(folder, fmt=FORMAT):
    """trainer_state.json of a state folder written in format `fmt`; RecordError naming the
    folder if it is none, was written in another format, or lacks its DCP metadata (a partial
    copy)."""
    path = os.path.join(folder, INFO)
    if not os.path.isfile(path):
        raise RecordError(f"{folder}: not an optimiser state folder (no {INFO})")
    info = read_json(path)
    found = info.get("format") if isinstance(info, dict) else None
    if found != fmt:
        if found is None and os.path.isfile(os.path.join(folder, "optimizer.bin")):
            found = "Accelerate's save_state, of an earlier train_grpo.py"
        raise RecordError(
            f"{folder}: optimiser state in the format {found}, this run reads {fmt}; "
            "rerun the round that wrote it, or start without --optimizer-state"
        )
    if (
        fmt == FORMAT
        and (info["master_weights"] or info["optimizer"])
        and not os.path.isfile(os.path.join(folder, ".metadata"))
    ):
        raise RecordError(f"{folder}: {INFO} but no .metadata: an incomplete {FORMAT} folder")
    return info


def load(folder, info, model, optimizer):
    """Read the master weights (if saved) into `model` and AdamW's state (if saved) into
    `optimizer`, whatever number of processes wrote them. RecordError if they do not fit
    (another model, or full weights against an adapter): every process raises it."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    state = {}
    if info["master_weights"]:
        state["model"] = get_model_state_dict(model)
    if info["optimizer"]:
        state["optim"] = get_optimizer_state_dict(model, optimizer)  # the template DCP fills in place
    if not state:
        return
    try:
        dcp.load(state, checkpoint_id=folder)
    except (CheckpointException, RuntimeError, KeyError, ValueError) as e:
        # DCP plans the load collectively: a mismatch raises on every process, none is left waiting
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecordError(f"{folder}: does not match this model's trainable parameters ({first})") from None
    if "model" in state:
        set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"])
