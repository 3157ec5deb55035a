"""The per-token log-probs the GRPO loss and the old/reference passes use, under FSDP2 with the
GPU presets' bf16 mixed precision, for tests/test_train_grpo.py (CPU processes) and
bench/gpu_check.sh (one GPU). The accelerator is train_grpo.py's own (common/train/distributed.py),
asked for bf16: weights are gathered and computed in bf16, and the log-probs must still come
back in float32, equal to a float32 log-softmax of the bf16 logits the output layer computed
(the hidden states and gathered weight it was given), not rounded again to bf16 on their way
out of the model. Rank 0 writes every process's findings to OUT and prints them in one line.

    accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml tests/fsdp_bf16_probe.py MODEL ROLLOUTS DIAGNOSES OUT
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_grpo  # noqa: E402
from common.jsonl import read_jsonl  # noqa: E402
from common.seal.taxonomy import RHO  # noqa: E402
from common.train.distributed import finish, make_accelerator  # noqa: E402
from common.train.grpo import _dummy_forward, collate, join_trajectories, sequence_logprobs, token_logprobs  # noqa: E402


def main(model_dir, rollouts, diagnoses, out):
    accelerator = make_accelerator(cpu=not torch.cuda.is_available(), timeout=10, mixed_precision="bf16")
    assert accelerator.is_fsdp2, accelerator.distributed_type
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    head = accelerator.unwrap_model(model).get_output_embeddings()
    given = []  # registered before sequence_logprobs's own hooks: sees the whole hidden state
    head.register_forward_pre_hook(lambda m, a: given.append((a[0].detach(), m.weight.detach().clone())))
    trajectories = join_trajectories(read_jsonl(rollouts), read_jsonl(diagnoses), RHO)
    found = []
    # every group, its rewards equal or not (the tiny model on real tasks often solves none)
    plan = SimpleNamespace(zero_variance="keep", seed=0, mini_batch_tasks=len(trajectories), max_tokens_per_micro_batch=100)
    (mb,), _ = train_grpo.plan_mini_batches(plan, trajectories, accelerator)
    for micro in mb.mine:
        if not micro:  # the other process has a micro-batch here: FSDP's collectives must line up
            _dummy_forward(model, accelerator.device)
            _dummy_forward(model, accelerator.device).backward()
            given.clear()
            continue
        b = collate(micro, accelerator.device)
        for grad in (False, True):  # the old/reference passes, and the loss's
            with torch.set_grad_enabled(grad):
                lp = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["off"], mask=b["mask"])
            hidden, weight = given.pop()
            targets = b["input_ids"][:, b["off"] :][b["mask"]]
            with torch.no_grad():
                want = token_logprobs(F.linear(hidden[:, :-1][b["mask"]], weight), targets)
            found.append({
                "grad": grad, "dtype": str(lp.dtype), "compute_dtype": str(hidden.dtype),
                "max_diff": (lp[b["mask"]].detach().double() - want.double()).abs().max().item(),
                "bf16_rounding": (want.double() - want.bfloat16().double()).abs().max().item(),
            })  # fmt: skip
            if grad:
                lp[b["mask"]].sum().backward()  # FSDP2 reshards in backward, as in training
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, found)
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(everyone, f)
        found = [x for process in everyone for x in process]
        print(f"log-probs {sorted({x['dtype'] for x in found})} computed in {sorted({x['compute_dtype'] for x in found})}: "
              f"max |diff| from float32 {max(x['max_diff'] for x in found):.2g} "
              f"(a bf16 cast: up to {max(x['bf16_rounding'] for x in found):.2g})")
    del model  # freed before its process groups are torn down (common/train/distributed.py finish)
    finish(accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
