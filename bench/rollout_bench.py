"""Speed of the multi-turn rollout loop, measured side by side in one run.

    .venv/bin/python bench/rollout_bench.py [--n 4] [--max-new-tokens 96] [--max-steps-per-turn 3] \
        [--temperature 1] [--repeats 4] [--task-ids ID,ID,...] [--hf]

Workload: the CPU (`tiny`) preset's model, its 8 training tasks played whole (every
turn, from data/train.jsonl; the preset itself trains on their first turns), its
rollout settings (4 samples a task, up to 96 new tokens a call, up to 3 calls a
turn, temperature 1). Trajectories differ in turns (2-6), calls and generation
lengths, and every run draws other samples, so per-run figures vary with what was
drawn; at --temperature 0 both schedules produce the same records
(tests/test_async.py) and do exactly the same work. The prefix cache is emptied
before every run.
1. per-trajectory (async) vs lock-step scheduling on one vLLM server: trajectories/s,
   runs interleaved (lockstep, async, lockstep, ...) and summed; target >= 1.3; with
   the share of prompt tokens served from vLLM's prefix cache;
2. loop vs bare engine on the async schedule: the time inside the engine's steps over
   the loop's wall time (parse, execute, render, tokenise between steps); target >= 0.8;
3. with --hf (minutes more on CPU): vLLM (async) vs HF generate (lock-step, its only
   schedule), each running the whole loop.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.engine import serve
from common.engine.engines import make_engine  # noqa: E402
from common.envs.bfcl import harness as bfcl  # noqa: E402
from common.envs.bfcl import play
from common.envs.bfcl.tiny import PRESET_TASKS  # noqa: E402
from common.run.tiny import build_cached  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--task-ids", default=None, help="training task ids (default: the tiny preset's tasks, whole)")
parser.add_argument("--n", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--max-steps-per-turn", type=int, default=3)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--repeats", type=int, default=4, help="runs of each schedule, interleaved")
parser.add_argument("--hf", action="store_true", help="also the HF generate row (slow on CPU)")
args = parser.parse_args()

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
train = bfcl.load_tasks(os.path.join(root, "data", "train.jsonl"))
if args.task_ids:
    ids = args.task_ids.split(",")
else:  # the preset's tasks are training tasks cut to their first turn (data/prepare.py)
    ids = [i.removesuffix("_1turn") for i in bfcl.load_tasks(PRESET_TASKS)]
tasks = [train[i] for i in ids]
model = build_cached()
settings = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                max_steps_per_turn=args.max_steps_per_turn)


def run(engine, schedule):
    if hasattr(engine, "slots"):  # each run starts cold: no prompt cached by the previous one
        serve.request(engine.slots[0][0], "/reset_prefix_cache", {})
    cpu = time.process_time()
    recs, timing = play.play(tasks, args.n, engine, play.PlaySpec(schedule=schedule, **settings), progress=False)
    timing["cpu_seconds"] = time.process_time() - cpu
    calls = [len(s["text"]) for r in recs for turn in r["turns"] for s in turn["steps"]]
    return {"trajectories": len(recs), "tokens": sum(r["stats"]["gen_tokens"] for r in recs),
            "calls": len(calls), **timing}


def add(total, row):
    return {k: total.get(k, 0) + v for k, v in row.items()}


def show(name, row):
    share = f" | prefix cache {row['cached_tokens'] / row['prompt_tokens']:6.1%} of {row['prompt_tokens']} prompt tokens" \
        if "prompt_tokens" in row else ""
    print(f"{name:14s} {row['trajectories']:4d} traj {row['calls']:5d} calls {row['tokens']:6d} tokens "
          f"in {row['seconds']:7.2f} s = {row['trajectories'] / row['seconds']:6.2f} traj/s "
          f"{row['tokens'] / row['seconds']:7.1f} tok/s, CPU {row['cpu_seconds']:6.1f} s | "
          f"inside the engine {row['engine_seconds']:6.2f} s{share}")


turns = sum(len(t["questions"]) for t in tasks)
print(f"{len(tasks)} tasks ({turns} turns) x {args.n} samples, temperature {args.temperature:g}, "
      f"up to {args.max_new_tokens} new tokens per call, {args.max_steps_per_turn} calls per turn, "
      f"tiny model, {args.repeats} interleaved runs per schedule; load average {os.getloadavg()[0]:.1f}")
t0 = time.perf_counter()
state = serve.start(model, os.path.join(tempfile.mkdtemp(prefix="rollout-bench-"), "server.log"), max_model_len=16384)
engine = make_engine("vllm", model, max_model_len=16384, seed=0, servers=[state["url"]])
print(f"vLLM server start {time.perf_counter() - t0:.1f} s")
run(engine, "lockstep")  # warm-up: first calls allocate
run(engine, "async")
rows = {"lockstep": {}, "async": {}}
pairs, cpu_pairs = [], []
for _ in range(args.repeats):
    pair = {}
    for schedule in rows:
        pair[schedule] = run(engine, schedule)
        rows[schedule] = add(rows[schedule], pair[schedule])
    a, s = pair["async"], pair["lockstep"]
    pairs.append((a["trajectories"] / a["seconds"]) / (s["trajectories"] / s["seconds"]))
    cpu_pairs.append(s["cpu_seconds"] / a["cpu_seconds"])
    print("  " + "  ".join(f"{k} {r['trajectories'] / r['seconds']:.2f} traj/s ({r['calls']} calls, {r['tokens']} tokens, "
                           f"CPU {r['cpu_seconds']:.1f} s)" for k, r in pair.items())
          + f"  ratio {pairs[-1]:.2f} (CPU {cpu_pairs[-1]:.2f}), load {os.getloadavg()[0]:.1f}")
engine.close()
serve.stop_group(state["pid"])
for schedule, row in rows.items():
    show(f"vllm {schedule}", row)
if args.hf:
    engine = make_engine("hf", model, max_model_len=16384, seed=0)
    run(engine, "lockstep")
    rows["hf"] = run(engine, "lockstep")
    engine.close()
    show("hf lockstep", rows["hf"])

a, s = rows["async"], rows["lockstep"]
print("\nratios")
print(f"  async / lockstep trajectories/s: {(a['trajectories'] / a['seconds']) / (s['trajectories'] / s['seconds']):.2f}"
      f"  (target >= 1.3)")
print(f"  async / lockstep trajectories per CPU second: {s['cpu_seconds'] / a['cpu_seconds']:.2f}"
      "  (this process's CPU time, all threads: less sensitive to other jobs on a shared machine)")
print(f"  median of the per-pair ratios:   {statistics.median(pairs):.2f} wall, {statistics.median(cpu_pairs):.2f} CPU"
      f"  (pairs run back to back; range {min(pairs):.2f}-{max(pairs):.2f})")
print(f"  tokens generated async / lockstep: {a['tokens'] / s['tokens']:.2f}")
print(f"  loop / bare engine (vLLM async): {a['engine_seconds'] / a['seconds']:.2f}  (target >= 0.8)")
print(f"  loop / bare engine (vLLM lockstep): {s['engine_seconds'] / s['seconds']:.2f}")
if "hf" in rows:
    h = rows["hf"]
    print(f"  loop / bare engine (HF):         {h['engine_seconds'] / h['seconds']:.2f}")
    print(f"  vLLM async / HF tokens/s:        {(a['tokens'] / a['seconds']) / (h['tokens'] / h['seconds']):.2f}")
print(f"  prefix cache share: async {a['cached_tokens'] / a['prompt_tokens']:.1%}, "
      f"lockstep {s['cached_tokens'] / s['prompt_tokens']:.1%}")
