"""Throughput of the GRPO update (common/grpo.py, as train_grpo.py runs it) against a bare
forward+backward loop over the same micro-batches, and the padding that length grouping saves.

    python bench/train_bench.py [--tasks 4 --samples 4 --prompt 384 --response 192 --repeats 2]

Builds a tiny random Qwen2 in memory (no hub, no files) and a batch of BFCL-shaped
trajectories: one long prompt per task, responses mixing model tokens (mask 1) and tool
output (mask 0). Both loops see identical micro-batches and take an AdamW step; the bare
loop is the usual causal-LM cross-entropy over every position. Target: GRPO/bare >= 0.8.
Tokens/s counts prompt + response tokens (not padding), as train_metrics.jsonl does.
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from common.grpo import (  # noqa: E402
    TrainingSequence,
    accumulate_gradients,
    collate,
    group_advantages,
    padding_share,
    plan_micro_batches,
    score_trajectories,
)

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--tasks", type=int, default=4)
ap.add_argument("--samples", type=int, default=4)
ap.add_argument("--prompt", type=int, default=384, help="mean prompt tokens")
ap.add_argument("--response", type=int, default=192, help="mean response tokens")
ap.add_argument("--max-tokens-per-micro-batch", type=int, default=4096)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--vocab", type=int, default=4096)
ap.add_argument("--hidden", type=int, default=128)
args = ap.parse_args()


def make_batch(rng):
    trajs = []
    for task in range(args.tasks):
        prompt = [rng.randrange(args.vocab) for _ in range(int(args.prompt * rng.uniform(0.8, 1.2)))]
        for k in range(args.samples):
            n = int(args.response * rng.uniform(0.3, 1.7))
            mask = [
                1 if (i // 32) % 3 != 1 else 0 for i in range(n)
            ]  # every third block of 32 is tool output
            ids = [rng.randrange(args.vocab) for _ in range(n)]
            trajs.append(
                TrainingSequence(f"t{task}", k, prompt, ids, mask, [None] * n, float(rng.random() < 0.5), 1.3)
            )
    adv, _ = group_advantages([t.task_id for t in trajs], [t.reward for t in trajs])
    for t, a in zip(trajs, adv, strict=True):
        t.advantage = a if a else 0.5  # a zero-variance draw would skip no compute here; keep a signal
    return trajs


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    torch.manual_seed(0)
    rng = random.Random(0)
    accelerator = Accelerator(cpu=True)
    cfg = Qwen2Config(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=args.vocab, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = list(model.parameters())

    trajs = make_batch(rng)
    lengths = [t.length for t in trajs]
    plan = plan_micro_batches(lengths, 1, args.max_tokens_per_micro_batch)[0]
    micro = [[trajs[i] for i in mb] for mb in plan]
    norm = sum(t.model_tokens for t in trajs)
    tokens = sum(lengths)

    def old_logprobs():
        model.eval()
        score_trajectories(model, micro, accelerator.device, "old_logprobs")
        for t in trajs:
            t.ref_logprobs = t.old_logprobs
        model.train()

    def grpo_step():
        accumulate_gradients(model, accelerator, micro, norm, clip=0.2, kl_coef=0.001)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bare_step():
        for mb in micro:
            b = collate(mb, accelerator.device)
            labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    old_logprobs()
    grpo_step(), bare_step()  # warm-up
    t_old, t_grpo, t_bare = [], [], []
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits both alike
        t_old.append(timed(old_logprobs))
        t_grpo.append(timed(grpo_step))
        t_bare.append(timed(bare_step))
    best = {k: min(v) for k, v in (("old", t_old), ("grpo", t_grpo), ("bare", t_bare))}

    print(f"batch: {len(trajs)} trajectories, {tokens} tokens ({norm} model tokens), {len(micro)} micro-batches, "
          f"model hidden {args.hidden}, vocab {args.vocab}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"bare forward+backward+step : {tokens / best['bare']:9.0f} tokens/s")
    print(
        f"GRPO update step           : {tokens / best['grpo']:9.0f} tokens/s   ratio to bare {best['bare'] / best['grpo']:.2f}"
    )
    print(f"GRPO update + old log-probs: {tokens / (best['grpo'] + best['old']):9.0f} tokens/s   "
          f"ratio to bare {best['bare'] / (best['grpo'] + best['old']):.2f}")  # fmt: skip

    # padding: a round-sized set of lengths (prompt shared per task, responses vary a lot)
    prng = random.Random(1)
    round_lengths = []
    for _ in range(32):
        p = int(args.prompt * prng.uniform(0.6, 1.5))
        round_lengths += [p + int(args.response * prng.uniform(0.1, 3.0)) for _ in range(8)]
    budget = args.max_tokens_per_micro_batch
    for grouped in (False, True):
        mbs = [mb for plan in plan_micro_batches(round_lengths, 1, budget, grouped) for mb in plan]
        print(f"padding share, length grouping {'on ' if grouped else 'off'}: {padding_share(round_lengths, mbs):.3f} "
              f"({len(mbs)} micro-batches for {len(round_lengths)} sequences)")  # fmt: skip


if __name__ == "__main__":
    main()
