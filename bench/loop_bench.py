"""Per-round overhead of the loop: wall time spent outside generation and training.

    .venv/bin/python bench/loop_bench.py [RUN]      # default: runs the tiny preset first

For every round of a run, from its artifacts: the round's wall time (the stages
rollout, diagnose, evolve, train, as timed by loop.sh), the time inside the
engine's generate calls (rollout_summary.json), inside optimiser steps and inside
the trainer's reference and old-log-prob passes (train_metrics.jsonl: seconds,
logprob_seconds). Everything else is overhead: process start, imports, model
loading, saving, diagnosis and evolve. Two shares are printed: outside generation
and training (the log-prob passes counted as training, as verl's timing_s/ref and
timing_s/old_log_prob are), and outside generation and optimiser steps alone.
Target at tiny scale: overhead <= 25 % of the round.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("rollout", "diagnose", "evolve", "train")

if len(sys.argv) > 2 or sys.argv[1:2] and sys.argv[1].startswith("-"):
    sys.exit(__doc__)
run = sys.argv[1] if len(sys.argv) > 1 else None
if run is None:
    run = os.path.join(ROOT, "runs", "bench-loop")
    subprocess.run(["bash", "loop.sh", "tiny", "--name", "bench-loop"], cwd=ROOT, check=True)

timing = [json.loads(line) for line in open(os.path.join(run, "timing.jsonl"))]
rounds = sorted({x["round"] for x in timing if x["stage"] == "rollout"})
print(f"{'round':>5} {'wall s':>8} {'generate s':>11} {'steps s':>8} {'logprob s':>10} {'overhead':>9} "
      f"{'(steps only)':>13}   per stage (s)")
shares, strict = [], []
for t in rounds:
    folder = os.path.join(run, f"round_{t:03d}")
    stage_s = {s: sum(x["seconds"] for x in timing if x["round"] == t and x["stage"] == s) for s in STAGES}
    wall = sum(stage_s.values())
    with open(os.path.join(folder, "rollout_summary.json")) as f:
        gen = json.load(f)["engine_seconds"]
    with open(os.path.join(folder, "train_metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = sum(m.get("seconds") or 0.0 for m in lines)
    scoring = lines[0].get("logprob_seconds") or 0.0  # once per round, on every line
    shares.append((wall - gen - steps - scoring) / wall)
    strict.append((wall - gen - steps) / wall)
    print(f"{t:>5} {wall:8.1f} {gen:11.1f} {steps:8.1f} {scoring:10.1f} {shares[-1]:9.1%} {strict[-1]:13.1%}   "
          + ", ".join(f"{s} {v:.1f}" for s, v in stage_s.items()))
print(f"\nmean overhead share {sum(shares) / len(shares):.1%} (target <= 25%); "
      f"counting the log-prob passes as overhead too: {sum(strict) / len(strict):.1%}")
