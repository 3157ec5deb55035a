"""Start-up of a stage process: what loading the policy's tokenizer costs, AutoTokenizer vs ours.

    .venv/bin/python bench/start_bench.py [--repeats 5] [--model DIR]

Every stage that plays (rollout.py, evaluate.py) loads the policy's tokenizer and talks to a
server; it never needs a model's code. transformers' AutoTokenizer imports its auto module,
which imports every model's code (torch, generation, scikit-learn); `common.models.
load_tokenizer` picks the same class (the model type's own, read from the folder) and imports
only it. Each variant runs in a fresh process, interleaved, `--repeats` times; the median wall
times and their ratio are printed, and the trainer's import (`train_grpo.py --help`, which
needs the model code) for scale. Default model: the tiny model (built if missing).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--model", default=None)
args = parser.parse_args()

if args.model is None:
    from common.tiny import build_cached
    args.model = build_cached()

VARIANTS = {
    "AutoTokenizer": f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({args.model!r})",
    "load_tokenizer": f"from common.models import load_tokenizer; load_tokenizer({args.model!r})",
    "python alone": "pass",
}
times = {k: [] for k in VARIANTS}
trainer = []
for _ in range(args.repeats):
    for name, code in VARIANTS.items():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        times[name].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "train_grpo.py", "--help"], cwd=ROOT, check=True, capture_output=True)
    trainer.append(time.perf_counter() - t0)

med = {k: statistics.median(v) for k, v in times.items()}
for name, v in times.items():
    print(f"{name:>15}: median {med[name]:.2f} s  (" + ", ".join(f"{x:.2f}" for x in v) + ")")
print(f"{'trainer import':>15}: median {statistics.median(trainer):.2f} s")
print(f"\nload_tokenizer / AutoTokenizer: {med['load_tokenizer'] / med['AutoTokenizer']:.2f} "
      f"({med['AutoTokenizer'] - med['load_tokenizer']:.1f} s saved per stage process)")
