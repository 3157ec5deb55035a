"""Throughput of the GRPO update (common/train/grpo.py, as train_grpo.py runs it) on a model of real size.

    python bench/update_throughput.py [--config qwen2.5-3b] [--seqs 8] [--seq-len 8192] [--steps 2]
    python bench/update_throughput.py --cpu --config small --seqs 2 --seq-len 512      # dry run
    python bench/update_throughput.py --compare-objective [...]   # the paper's loss vs entropy + correction
    python bench/update_throughput.py --compare-turn [...]        # seal's weight vs seal-turn's per-turn weights

A randomly initialised Qwen2 with Qwen2.5-3B-Instruct's configuration (no hub: the numbers are
written below), float32 master weights, bf16 autocast on GPU (train_grpo.py's precision), gradient
checkpointing, one sequence per micro-batch (the 7B preset's micro-batch of 8k tokens), AdamW.
Each step is the full update of `--seqs` sequences: forward and backward with the PPO-clipped
token-mean loss and the KL term, gradient clipping, optimiser step. Prints one JSON line:
tokens/s, seconds per step, peak GPU memory, and MFU against `--peak-tflops` (989: H100/H200
dense bf16). Model FLOPs per token follow PaLM (appendix B): 6·N (non-embedding parameters)
+ 6·L·s·d for causal attention, without gradient checkpointing's recomputation (so MFU is the
usual model-FLOPs utilisation, not hardware utilisation).

--compare-objective times the paper's objective (no entropy, no rollout correction) and the default
one (the entropy of the log-prob pass, token-tis weights against engine log-probs a little off the
trainer's) step for step, alternating, and prints both and their ratio (docs/benchmarks.md §13).

--compare-turn times seal (one weight per trajectory) and seal-turn (credit by turn: each run of model
tokens placed on its turn by common/train/grpo.py turn_spans, four outputs a turn, and weighed by its turn's
weight, turn_weights: a failed trajectory passes its first half of turns and fails the rest) step for
step, alternating, both with the default objective, and prints both and their ratio (docs/benchmarks.md §16).
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from common.seal.taxonomy import RHO  # noqa: E402
from common.train.grpo import (  # noqa: E402
    TrainingSequence,
    accumulate_gradients,
    diagnosis_weight,
    rollout_correction,
    score_trajectories,
    turn_spans,
    turn_weights,
)

# Qwen2.5-3B-Instruct's config.json (architecture fields only).
CONFIGS = {
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True),
    "small": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=32768,
                  rope_theta=10_000.0, tie_word_embeddings=True),
}

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--config", default="qwen2.5-3b", choices=sorted(CONFIGS))
ap.add_argument("--seqs", type=int, default=8)
ap.add_argument("--seq-len", type=int, default=8192)
ap.add_argument("--steps", type=int, default=2, help="timed update steps (after one warm-up step)")
ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
ap.add_argument("--no-gradient-checkpointing", action="store_true")
ap.add_argument("--cpu", action="store_true", help="dry run on CPU (float32)")
ap.add_argument("--compare-objective", action="store_true",
                help="the paper's objective against entropy + token-tis, alternating steps")
ap.add_argument("--compare-turn", action="store_true",
                help="seal's per-trajectory weight against seal-turn's per-turn weights, alternating steps")
args = ap.parse_args()
if args.compare_objective and args.compare_turn:
    ap.error("--compare-objective or --compare-turn: one comparison a run")


def main():
    torch.manual_seed(0)
    rng = random.Random(0)
    on_gpu = torch.cuda.is_available() and not args.cpu
    accelerator = Accelerator(cpu=not on_gpu, mixed_precision="bf16" if on_gpu else "no")
    c = CONFIGS[args.config]
    cfg = Qwen2Config(**{k: v for k, v in c.items() if k != "rope_theta"},
                      rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    with torch.device(accelerator.device):
        model = Qwen2ForCausalLM(cfg)  # float32 master weights, as train_grpo.py keeps them
    if not args.no_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = list(model.parameters())

    # BFCL-shaped sequences: a prompt, then model tokens (mask 1) interleaved with tool output.
    n_prompt = args.seq_len // 2
    trajs = []
    for k in range(args.seqs):
        ids = [rng.randrange(cfg.vocab_size) for _ in range(args.seq_len - n_prompt)]
        mask = [1 if (i // 64) % 3 != 1 else 0 for i in range(len(ids))]
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(n_prompt)]
        t = TrainingSequence("t", k, prompt, ids, mask, [None] * len(ids), float(k % 2), 1.0)
        t.advantage = 1.0 if k % 2 else -1.0
        trajs.append(t)
    turned = {}  # seal-turn's turn weights of each trajectory (its turn_spans set once, as the join does)
    if args.compare_turn:
        for t in trajs:
            n_runs = sum(1 for i, m in enumerate(t.mask) if m and (i == 0 or not t.mask[i - 1]))
            turns = [{"steps": [{"text": "x"}] * min(4, n_runs - k), "end": "answer"} for k in range(0, n_runs, 4)]
            labels = ["pass"] * len(turns) if t.advantage > 0 else \
                ["pass"] * (len(turns) // 2) + ["argument_mismatch"] * (len(turns) - len(turns) // 2)
            t.weight = diagnosis_weight({z: labels.count(z) / len(labels) for z in set(labels)}, RHO)
            (t.turn_spans,) = turn_spans([{"mask": t.mask}], turns)
            turned[t.sample_index] = turn_weights(labels, [x["end"] for x in turns], t.advantage, t.weight, RHO)
    micro = [[t] for t in trajs]  # one 8k sequence per micro-batch
    norm = sum(t.model_tokens for t in trajs)
    tokens = sum(t.length for t in trajs)

    with torch.no_grad(), accelerator.autocast():  # old and reference log-probs, as the trainer's first pass
        model.eval()
        score_trajectories(model, micro, accelerator.device, "old_logprobs")
        model.train()
    gen = torch.Generator().manual_seed(0)
    for t in trajs:
        t.ref_logprobs = t.old_logprobs
        # the engine's log-probs: the trainer's with bf16-sized noise, so that some weights leave 1
        noisy = t.old_logprobs + 0.05 * torch.randn(len(t.ids), generator=gen)
        t.engine_logprobs = [lp if m else None for lp, m in zip(noisy.tolist(), t.mask, strict=True)]

    def step(full=True, turn=False):
        """One update: the default objective (entropy, token-tis), or the paper's (full False); with
        `turn`, seal-turn's per-turn weights (else seal's one weight a trajectory)."""
        for t in trajs:
            t.turn_weights = turned[t.sample_index] if turn else None
        t0 = time.perf_counter()
        for t in trajs:  # once a round in train_grpo.py, here in every step's time
            rollout_correction(t, "token-tis" if full else "off", 2.0)
        with accelerator.autocast():
            accumulate_gradients(model, accelerator, micro, norm, clip=0.2, kl_coef=0.001, entropy=full)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()  # warm-up (allocator, kernels, AdamW state)
    if args.compare_objective:
        step(full=False)
    if args.compare_turn:
        step(turn=True)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times, paper, turn = [], [], []
    for _ in range(args.steps):
        if args.compare_objective:  # alternating: machine noise hits both alike
            paper.append(step(full=False))
        times.append(step())
        if args.compare_turn:
            turn.append(step(turn=True))
    best = min(times)

    n_params = sum(p.numel() for p in model.parameters())
    n_embed = cfg.vocab_size * cfg.hidden_size
    flops_per_token = 6 * (n_params - n_embed) + 6 * cfg.num_hidden_layers * args.seq_len * cfg.hidden_size
    tok_s = tokens / best
    out = {
        "config": args.config, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "params": n_params, "seqs": args.seqs, "seq_len": args.seq_len,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "seconds_per_step": round(best, 3), "tokens_per_s": round(tok_s, 1),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
        "mfu": round(tok_s * flops_per_token / (args.peak_tflops * 1e12), 4) if on_gpu else None,
    }
    if args.compare_objective:
        out |= {"paper_seconds_per_step": round(min(paper), 3), "paper_tokens_per_s": round(tokens / min(paper), 1),
                "objective_cost": round(best / min(paper), 4)}
    if args.compare_turn:
        out |= {"turn_seconds_per_step": round(min(turn), 3), "turn_tokens_per_s": round(tokens / min(turn), 1),
                "turn_cost": round(min(turn) / best, 4),
                "turns_per_seq": round(sum(len(w) for w in turned.values()) / len(turned), 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
