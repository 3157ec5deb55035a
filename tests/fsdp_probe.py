"""One mini-batch's gradient under FSDP2 on CPU processes, for tests/test_train_grpo.py: every
process runs accumulate_gradients over its micro-batches and, before each micro-batch after
the first, records whether every parameter's gradient is already a reduce-scattered shard
(not an unsharded gradient held back for the last micro-batch). Rank 0 writes the gathered
gradient and the records to OUT.

    accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml tests/fsdp_probe.py MODEL ROLLOUTS DIAGNOSES OUT
"""

import os
import sys
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_grpo  # noqa: E402
from common.jsonl import read_jsonl  # noqa: E402
from common.train.distributed import finish, make_accelerator  # noqa: E402
from common.train.grpo import accumulate_gradients, join_trajectories, score_trajectories  # noqa: E402

KL, OFFSET = 0.5, 0.3  # a KL term against a reference away from the policy, so it has a gradient


def plan(trajectories, accelerator):
    """The whole data as one mini-batch, in micro-batches of at most 100 tokens (several per process)."""
    args = SimpleNamespace(zero_variance="drop", seed=0, mini_batch_tasks=8, max_tokens_per_micro_batch=100)
    (mb,), _ = train_grpo.plan_mini_batches(args, trajectories, accelerator)
    return mb


def unsharded_grads(model):
    """Parameters whose FSDP2 state holds an unsharded gradient (what no_sync accumulates into)."""
    held = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if fp.unsharded_accumulated_grad is not None or getattr(unsharded, "grad", None) is not None:
                        held.append(fp._param_fqn)
    return held


def main(model_dir, rollouts, diagnoses, out):
    accelerator = make_accelerator(cpu=True, timeout=10)
    assert accelerator.is_fsdp2, accelerator.distributed_type
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    trajectories = join_trajectories(read_jsonl(rollouts), read_jsonl(diagnoses), {"missing_tool_call": 1.6})
    mb = plan(trajectories, accelerator)
    score_trajectories(model, mb.mine, accelerator.device, "old_logprobs")
    for t in (t for micro in mb.mine for t in micro):
        t.ref_logprobs = t.old_logprobs + OFFSET
    checks, calls = [], [0]

    def before_forward(module, args, kwargs):
        calls[0] += 1
        if calls[0] > 1:  # micro-batches 1.. : micro-batch 0 .. k-1's backward is done
            grads = [p.grad for p in module.parameters()]
            checks.append({
                "sharded": all(isinstance(g, DTensor) and g.to_local().shape == p.to_local().shape
                               for g, p in zip(grads, module.parameters(), strict=True)),
                "held": unsharded_grads(module),
            })  # fmt: skip

    model.register_forward_pre_hook(before_forward, with_kwargs=True)
    accumulate_gradients(model, accelerator, mb.mine, mb.norm, kl_coef=KL)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, {"micro_batches": len(mb.mine), "checks": checks})
    if accelerator.is_main_process:
        torch.save({"grads": grads, "processes": everyone}, out)
    del model  # freed before its process groups are torn down (common/train/distributed.py finish)
    finish(accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
