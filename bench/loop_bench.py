"""Per-round overhead of the loop: wall time spent outside generation and training.

    .venv/bin/python bench/loop_bench.py [RUN]      # default: runs the tiny preset first

For every round of a run, from its artifacts: the round's wall time (the stages
rollout, diagnose, evolve, train, as timed by loop.sh), the time inside the
engine's generate calls (rollout_summary.json) and inside optimiser steps
(train_metrics.jsonl). Everything else is overhead: process start, imports,
model loading, the trainer's log-prob pass, saving, diagnosis and evolve.
Target at tiny scale: overhead <= 25 % of the round.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("rollout", "diagnose", "evolve", "train")

run = sys.argv[1] if len(sys.argv) > 1 else None
if run is None:
    run = os.path.join(ROOT, "runs", "bench-loop")
    subprocess.run(["bash", "loop.sh", "tiny", "--name", "bench-loop"], cwd=ROOT, check=True)

timing = [json.loads(line) for line in open(os.path.join(run, "timing.jsonl"))]
rounds = sorted({x["round"] for x in timing if x["stage"] == "rollout"})
print(f"{'round':>5} {'wall s':>8} {'generate s':>11} {'train s':>8} {'overhead':>9}   per stage (s)")
shares = []
for t in rounds:
    folder = os.path.join(run, f"round_{t:03d}")
    stage_s = {s: sum(x["seconds"] for x in timing if x["round"] == t and x["stage"] == s) for s in STAGES}
    wall = sum(stage_s.values())
    with open(os.path.join(folder, "rollout_summary.json")) as f:
        gen = json.load(f)["engine_seconds"]
    with open(os.path.join(folder, "train_metrics.jsonl")) as f:
        train = sum(m.get("seconds") or 0.0 for m in map(json.loads, f))
    share = (wall - gen - train) / wall
    shares.append(share)
    print(f"{t:>5} {wall:8.1f} {gen:11.1f} {train:8.1f} {share:9.1%}   "
          + ", ".join(f"{s} {v:.1f}" for s, v in stage_s.items()))
print(f"\nmean overhead share {sum(shares) / len(shares):.1%} (target <= 25%)")
