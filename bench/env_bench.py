"""Our environment + checker vs bfcl-eval's bare executor + checker, same call strings.

    .venv/bin/python bench/env_bench.py [--repeats 3]

Replays the ground truth of all 800 tasks turn by turn. "ours" goes through
common/envs/bfcl/harness.py (parse, validate, render, isolated execution, official verdict
with cleanup); "bare" hands the same strings straight to bfcl-eval's
execute_multi_turn_func_call and multi_turn_checker. Both run alternately in one
process, so machine noise hits them alike; the ratio is ours / bare (target ≤ 1.3).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402

from common.engine import calls as C  # noqa: E402
from common.envs.bfcl import harness as bfcl  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tasks = [t for split in ("train", "heldin") for t in bfcl.load_tasks(os.path.join(root, "data", f"{split}.jsonl")).values()]


def ours():
    solved = 0
    for task in tasks:
        with bfcl.Environment(task) as env:
            for turn, gt in enumerate(task["ground_truth"]):
                env.start_turn(turn)
                if gt:
                    env.step(C.format_calls(bfcl.ground_truth_calls(task, turn), "python"), fmt="python")
        solved += bfcl.official_verdict(task, env.decoded)["valid"]
    return solved


def bare():
    solved = 0
    for i, task in enumerate(tasks):
        name = f"bare_{i}"
        for gt in task["ground_truth"]:
            multi_turn_utils.execute_multi_turn_func_call(
                gt, task["initial_config"], task["involved_classes"], name, task["id"],
                long_context=task["long_context"])
        decoded = [[gt] if gt else [] for gt in task["ground_truth"]]
        entry = {"id": task["id"], "initial_config": task["initial_config"], "involved_classes": task["involved_classes"]}
        solved += multi_turn_checker(decoded, task["ground_truth"], entry, "multi_turn", name)["valid"]
    # Without this the next repeat would reuse stale instances (bfcl-eval's cache).
    for key in [k for k in vars(multi_turn_utils) if k.startswith("bare_")]:
        del vars(multi_turn_utils)[key]
    return solved


times = {"ours": [], "bare": []}
for _ in range(args.repeats):
    for name, fn in (("bare", bare), ("ours", ours)):
        t = time.perf_counter()
        solved = fn()
        times[name].append(time.perf_counter() - t)
        print(f"{name:5s} {times[name][-1]:6.2f} s  solved {solved}/{len(tasks)}")

ours_s, bare_s = statistics.median(times["ours"]), statistics.median(times["bare"])
print(f"\n{len(tasks)} tasks, median of {args.repeats}: ours {ours_s:.2f} s, bare {bare_s:.2f} s, "
      f"ratio ours/bare = {ours_s / bare_s:.2f} (target <= 1.3)")
