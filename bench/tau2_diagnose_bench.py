"""τ² diagnosis (diagnose.py on a τ²-bench domain's records): one process against K, side by side.

    .venv/bin/python bench/tau2_diagnose_bench.py [--domain airline] [--workers 2] [--repeats 2]

Plays every task of the domain's train split twice through τ²'s orchestrator with the scripted
oracle (common/envs/tau2/tau2.py): once as the gold script (reward 1) and once without its last gold action
(a database that differs from the gold replay: the row diff runs too), writes them as rollout
records, then times `diagnose.py --workers 1` and `--workers K` on the file in turn, `--repeats`
times, and checks their outputs are equal. Prints seconds per episode for each and the ratio.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.envs.tau2 import tau2 as T  # noqa: E402
from common.jsonl import write_jsonl  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--domain", default="airline")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--repeats", type=int, default=2)
args = parser.parse_args()

tau2 = T.import_tau2()
tasks = [t for t in tau2.tasks(args.domain, split="train") if T.playable(t)]
NO_TOKENS = {"prompt_ids": [], "ids": [], "mask": [], "logprobs": []}


class Lazy(T.OracleScript):
    def __init__(self, task, fmt):
        super().__init__(task, fmt)
        self.actions = self.actions[:-1]


def lazy(task, tools, user_tools, system, fmt):
    script = Lazy(task, fmt)
    return script.agent_text, tau2.classes[1](script)


records = []
for k, players in enumerate((tau2.oracle, lazy)):
    for task in tasks:
        row = tau2.play(args.domain, task, players, 200, "json", evaluate=False)
        records.append(T.episode_record(row, NO_TOKENS, k, 0, "oracle", "scripted (oracle)", 0.0))
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "rollouts.jsonl")
    write_jsonl(path, records)
    seconds = {1: [], args.workers: []}
    outputs = {}
    for _ in range(args.repeats):
        for w in seconds:  # interleaved, so that machine noise hits both alike
            out = os.path.join(tmp, f"d{w}.jsonl")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "diagnose.py", "--tasks", f"tau2:{args.domain}:train", "--rollouts", path,
                            "--workers", str(w), "--out", out], cwd=ROOT, check=True, capture_output=True)
            seconds[w].append(time.perf_counter() - t0)
            outputs[w] = open(out, "rb").read()
n = len(records)
one, many = min(seconds[1]), min(seconds[args.workers])
print(f"{n} {args.domain} episodes ({len(tasks)} tasks: gold and without the last gold action)")
print(f"diagnose.py --workers 1: {one:.1f} s ({one / n:.2f} s an episode)")
print(f"diagnose.py --workers {args.workers}: {many:.1f} s ({many / n:.2f} s an episode)")
print(f"ratio 1 / {args.workers} workers: {one / many:.2f}; outputs equal: {outputs[1] == outputs[args.workers]}")
