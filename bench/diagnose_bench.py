"""Diagnosis speed vs the bare official checker, and reward parity, on real trajectories.

    .venv/bin/python bench/diagnose_bench.py [--repeats 3] [--limit K] [--script]

Builds the oracle trajectory of every task of data/train.jsonl and data/heldin.jsonl
plus the systematic perturbed set (tests/helpers.py: one argument changed,
one call dropped, one extra call, one turn emptied, garbage in one step, a call
on an abstention turn, stopped before a turn; schema breaks that still run: a
number written as a string, a value outside an enum, an unknown parameter, a
missing required one, a held-out function called early; names refused unrun),
all played through bfcl.Environment. Then, interleaved per trajectory so that machine noise hits
both alike: "official" = bfcl.official_verdict on each trajectory's decoded calls;
"diagnose" = common.envs.bfcl.diagnose.diagnose on its rollout record (re-derives and
replays the calls, labels every turn; unlike the checker it does not stop at the
first failing turn). Prints trajectories per second, the ratio on all
trajectories (target ≤ 2) and on the oracle ones alone, the parity counts (reward and official fields equal to
official_verdict's; reward equal to the checker's verdict on the raw strings bfcl-eval's own decoder makes of
the same texts) and the label mix. --script also times diagnose.py end to end.
"""

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.envs.bfcl import diagnose as bfcl_diagnose  # noqa: E402
from common.envs.bfcl import harness as bfcl  # noqa: E402
from common.jsonl import write_jsonl  # noqa: E402
from common.seal import taxonomy  # noqa: E402
from tests.helpers import bfcl_eval_decoded, oracle, perturbations, rollout  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category and split")
parser.add_argument("--script", action="store_true", help="also time diagnose.py on the same trajectories")
args = parser.parse_args()

t0 = time.perf_counter()
trajectories = []  # (task, kind, rollout record, decoded)
splits = {}
for split in ("train", "heldin"):
    path = os.path.join(ROOT, "data", f"{split}.jsonl")
    tasks = list(bfcl.load_tasks(path).values())
    if args.limit:
        tasks = [t for c in bfcl.CATEGORIES for t in [x for x in tasks if x["category"] == c][: args.limit]]
    splits[split] = (path, [])
    for task in tasks:
        built = [("oracle", *oracle(task))]
        built += [(kind, *rollout(task, turns, i + 1)) for i, (kind, turns) in enumerate(perturbations(task).items())]
        for kind, rec, decoded in built:
            trajectories.append((task, kind, rec, decoded))
            splits[split][1].append(rec)
print(f"built {len(trajectories)} trajectories of {sum(len(set(r['task_id'] for r in v[1])) for v in splits.values())} "
      f"tasks in {time.perf_counter() - t0:.1f} s: "
      + ", ".join(f"{k} {n}" for k, n in collections.Counter(k for _, k, _, _ in trajectories).items()))


times = collections.defaultdict(list)  # (method, "all" | "oracle") -> seconds per repeat
for _ in range(args.repeats):
    # Interleaved per trajectory, so that load from other processes hits both alike.
    spent = collections.Counter()
    verdicts, records = [], []
    for task, kind, rec, decoded in trajectories:
        t = time.perf_counter()
        verdicts.append(bfcl.official_verdict(task, decoded))
        t1 = time.perf_counter()
        records.append(bfcl_diagnose.diagnose(task, rec))
        t2 = time.perf_counter()
        for subset in ("all", "oracle") if kind == "oracle" else ("all",):
            spent["official", subset] += t1 - t
            spent["diagnose", subset] += t2 - t1
    for key, v in spent.items():
        times[key].append(v)

n = len(trajectories)
for method in ("official", "diagnose"):
    v = times[method, "all"]
    print(f"{method:>9}: {n / min(v):8.1f} traj/s (best of {len(v)}; median {n / statistics.median(v):.1f})")
for subset in ("all", "oracle"):
    ratios = [d / o for d, o in zip(times["diagnose", subset], times["official", subset], strict=True)]
    print(f"    ratio: {statistics.median(ratios):.2f}x  diagnose / official on {subset} trajectories, median of "
          f"{len(ratios)} repeats ({', '.join(f'{r:.2f}' for r in ratios)})" + ("; target <= 2" if subset == "all" else ""))

same = collections.Counter()
for (_, kind, _, _), verdict, rec in zip(trajectories, verdicts, records, strict=True):
    same[kind, rec["reward"] == int(verdict["valid"]) and rec["official"] == verdict] += 1
kinds = sorted({k for k, _ in same})
print(f"   parity: {sum(v for (_, ok), v in same.items() if ok)}/{n} trajectories with reward and official "
      f"fields equal to official_verdict's (" + ", ".join(f"{k} {same[k, True]}/{same[k, True] + same[k, False]}"
                                                        for k in kinds) + ")")
raw = collections.Counter()
for (task, kind, rec, _), r in zip(trajectories, records, strict=True):
    raw[kind, r["reward"] == int(bfcl.official_verdict(task, bfcl_eval_decoded(rec))["valid"])] += 1
print(f"   raw parity: {sum(v for (_, ok), v in raw.items() if ok)}/{n} rewards equal to the checker's verdict on "
      f"bfcl-eval's own decoding of the texts (" + ", ".join(f"{k} {raw[k, True]}/{raw[k, True] + raw[k, False]}"
                                                             for k in kinds) + ")")
print(f"  rewards: {sum(r['reward'] for r in records)}/{n} solved; oracle "
      f"{sum(r['reward'] for (_, k, _, _), r in zip(trajectories, records, strict=True) if k == 'oracle')}"
      f"/{sum(k == 'oracle' for _, k, _, _ in trajectories)}")
mix = collections.Counter(z for r in records for z in r["turn_labels"])
print("   labels: " + ", ".join(f"{z} {mix[z]}" for z in taxonomy.LABELS))

if args.script:
    with tempfile.TemporaryDirectory() as tmp:
        total = 0.0
        for split, (path, recs) in splits.items():
            rollouts, out = os.path.join(tmp, f"{split}.jsonl"), os.path.join(tmp, f"{split}.diag.jsonl")
            write_jsonl(rollouts, recs)
            t = time.perf_counter()
            subprocess.run([sys.executable, os.path.join(ROOT, "diagnose.py"), "--tasks", path, "--rollouts", rollouts,
                            "--out", out], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            total += time.perf_counter() - t
        print(f"   script: {n / total:8.1f} traj/s (diagnose.py end to end, start-up and files included)")
