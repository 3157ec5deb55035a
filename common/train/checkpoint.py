"""The training state one round hands to the next: AdamW's moments and step counts and, where the policy folder
holds its weights below float32, the float32 master weights, saved sharded with torch.distributed.checkpoint (DCP)
and read back by any number of processes; trainer_state.json describes it. Every process calls save and load.
"""

import os

import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as sd

from common.jsonl import RecordError, read_json, write_json

FORMAT = "torch.distributed.checkpoint"
INFO = "trainer_state.json"


def save(folder, model, optimizer, global_step, master, world_size=1, distributed_type="NO", main=True):
    """Write the state into `folder`, each process its shard; `master`: the float32 weights too."""
    # no AdamW state before its first step: asking DCP for one would take a zero-lr step, counted
    has_optimizer = global_step > 0
    state = _template(model, optimizer, master, has_optimizer)
    if state:
        dcp.save(state, checkpoint_id=folder)
    if main:
        write_json(os.path.join(folder, INFO), {"format": FORMAT, "global_step": global_step, "master_weights": master,
                                                "optimizer": has_optimizer, "world_size": world_size,
                                                "distributed_type": distributed_type})


def _template(model, optimizer, master, optim):
    """The state dict DCP saves from or loads into: the master weights and the AdamW state, as asked."""
    state = {"model": sd.get_model_state_dict(model)} if master else {}
    if optim:  # Accelerate's wrapper unwrapped
        state["optim"] = sd.get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))
    return state


def read_info(folder):
    """trainer_state.json of a state folder in FORMAT; RecordError naming the folder otherwise."""
    path = os.path.join(folder, INFO)
    if not os.path.isfile(path):
        raise RecordError(f"{folder}: not an optimiser state folder (no {INFO})")
    info = read_json(path)
    found = info.get("format") if isinstance(info, dict) else None
    if found != FORMAT:
        if found is None and os.path.isfile(os.path.join(folder, "optimizer.bin")):
            found = "Accelerate's save_state, of an earlier train_grpo.py"
        raise RecordError(f"{folder}: optimiser state in the format {found}, this run reads {FORMAT}; "
                          "rerun the round that wrote it, or start without --optimizer-state")
    saved = info["master_weights"] or info["optimizer"]
    if saved and not os.path.isfile(os.path.join(folder, ".metadata")):
        raise RecordError(f"{folder}: {INFO} but no .metadata: an incomplete {FORMAT} folder")
    return info


def load(folder, info, model, optimizer):
    """Read what was saved into `model` and `optimizer`; RecordError, on every process, if it does not fit."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    state = _template(model, optimizer, info["master_weights"], info["optimizer"])  # DCP fills it in place
    if not state:
        return
    try:
        dcp.load(state, checkpoint_id=folder)
    except (dcp.CheckpointException, RuntimeError, KeyError, ValueError) as e:
        # DCP plans the load collectively: a mismatch raises on every process, none is left waiting
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecordError(f"{folder}: does not match this model's trainable parameters ({first})") from None
    if "model" in state:
        sd.set_model_state_dict(model, state["model"])
    if "optim" in state:
        sd.set_optimizer_state_dict(model, optimizer, state["optim"])
