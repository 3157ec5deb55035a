"""Speed of the multi-turn rollout loop, measured side by side in one run.

    .venv/bin/python bench/rollout_bench.py [--tasks 4] [--n 4] [--max-new-tokens 48]

Same tiny model, same tasks (one per category, the shortest prompts), same settings:
1. loop vs bare engine: generated tokens/s of common.play's loop (parse, validate,
   execute, render, tokenise) vs the engine's own time for the very calls the loop
   made (the bare engine generating the same tokens from the same prompts);
   target >= 0.8;
2. vLLM vs HF generate, each running the whole loop;
3. batched stepping (all trajectories in one engine call per step) vs one
   trajectory at a time.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from common import bfcl, play  # noqa: E402
from common.engines import make_engine  # noqa: E402
from common.tiny import build_cached  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--per-category", type=int, default=1)
parser.add_argument("--n", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--max-steps-per-turn", type=int, default=3)
args = parser.parse_args()

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
all_tasks = list(bfcl.load_tasks(os.path.join(root, "data", "train.jsonl")).values())
tasks = [t for c in bfcl.CATEGORIES
         for t in sorted((x for x in all_tasks if x["category"] == c), key=lambda x: len(str(x["tools"])))
         [: args.per_category]]
model = build_cached()
settings = dict(temperature=1.0, max_new_tokens=args.max_new_tokens, max_steps_per_turn=args.max_steps_per_turn,
                progress=False)


def run(engine, batched=True):
    if batched:
        recs, timing = play.play(tasks, args.n, engine, **settings)
    else:
        recs, timing = [], {"seconds": 0.0, "engine_seconds": 0.0}
        for task in tasks:
            for _ in range(args.n):
                r, t = play.play([task], 1, engine, **settings)
                recs += r
                timing = {k: timing[k] + t[k] for k in timing}
    tokens = sum(r["stats"]["gen_tokens"] for r in recs)
    return tokens, timing


print(f"{len(tasks)} tasks x {args.n} samples, up to {args.max_new_tokens} new tokens per step, tiny model")
rows = {}
for kind in ("vllm", "hf"):
    t0 = time.perf_counter()
    engine = make_engine(kind, model, max_model_len=16384, seed=0)
    load = time.perf_counter() - t0
    run(engine)  # warm-up: first calls compile / allocate
    tokens, timing = run(engine)
    rows[kind] = (tokens, timing)
    print(f"{kind:5s} loop: {tokens:6d} tokens in {timing['seconds']:7.2f} s = {tokens / timing['seconds']:8.1f} tok/s"
          f" | inside the engine {timing['engine_seconds']:7.2f} s = {tokens / timing['engine_seconds']:8.1f} tok/s"
          f" | engine load {load:.1f} s")
    if kind == "vllm":
        tokens1, timing1 = run(engine, batched=False)
        rows["vllm_one_at_a_time"] = (tokens1, timing1)
        print(f"vllm one trajectory at a time: {tokens1:6d} tokens in {timing1['seconds']:7.2f} s = "
              f"{tokens1 / timing1['seconds']:8.1f} tok/s")
    engine.close()

v_tok, v = rows["vllm"]
h_tok, h = rows["hf"]
o_tok, o = rows["vllm_one_at_a_time"]
print("\nratios")
print(f"  loop / bare engine (vLLM):  {v['engine_seconds'] / v['seconds']:.2f}  (target >= 0.8)")
print(f"  loop / bare engine (HF):    {h['engine_seconds'] / h['seconds']:.2f}")
print(f"  vLLM / HF tokens/s:         {(v_tok / v['seconds']) / (h_tok / h['seconds']):.2f}")
print(f"  batched / one-at-a-time:    {(v_tok / v['seconds']) / (o_tok / o['seconds']):.2f}")
