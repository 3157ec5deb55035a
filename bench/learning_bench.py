"""The tiny preset's learning curve, measured: SEAL and vanilla side by side, at two seeds.

    .venv/bin/python bench/learning_bench.py [--rounds 6] [--seeds 0,1] [--modes seal,vanilla] \
        [--runs runs/bench-learning] [--set VAR=VALUE ...]

For every mode and seed it runs `bash loop.sh tiny --mode M --rounds R --set SEED=S` (the
preset's fixed training tasks, data/tiny.jsonl, all of them every round; held-in evaluation of
the last policy), then scores every policy of the run greedily on those same training tasks
with `evaluate.py --split train --tasks data/tiny.jsonl` (the HF engine: 8 short games start
faster there). Prints per round and mode: the sampled training reward (official verdict, the
round's rollouts), the per-turn `pass` share, the greedy success of the policy that played the
round, the mean SEAL weight w and the zero-variance share of the round's GRPO groups; then the
greedy success of the last policy and the held-in score of the first (base) and last policy.

Target: in every mode and seed, the last round's sampled reward >= round 0's + 0.15.
A sampled reward is a mean over 8 tasks x N samples: its standard error is about
sqrt(p (1 - p) / (8 N)) (0.08 at p = 0.4, N = 4), besides the seed-to-seed spread printed here;
the last table gives each run's gain with that error of the difference (se: about 0.12 at N = 4,
0.085 at N = 8), so a gain of 0.15 is one or two standard errors.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.run.report import collect  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--seeds", default="0,1")
ap.add_argument("--modes", default="seal,vanilla")
ap.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench-learning"))
ap.add_argument("--set", action="append", default=[], help="a preset variable for loop.sh (VAR=VALUE)")
args = ap.parse_args()
PY = os.path.join(ROOT, ".venv", "bin", "python")
TASKS = os.path.join(ROOT, "data", "tiny.jsonl")


def sh(cmd, log):
    with open(log, "w") as f:
        if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"learning_bench: {' '.join(cmd[:3])} failed; see {log}")


def greedy_success(policy, out, settings):
    """Share of the training tasks the policy solves greedily (evaluate.py, official verdict)."""
    if not os.path.isfile(os.path.join(out, "results.jsonl")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        sh([PY, "evaluate.py", "--policy", policy, "--split", "train", "--tasks", TASKS, "--engine", "hf",
            "--max-new-tokens", str(settings["max_new_tokens"]), "--max-steps-per-turn", str(settings["max_steps"]),
            "--max-model-len", str(settings["max_model_len"]), "--out", out], out + ".log")
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sum(r["valid"] for r in rows) / len(rows)


def task_successes(run, t):
    """Successes per training task among round t's sampled rollouts (the official verdict), and
    how many rollouts the round had."""
    wins, n = {}, 0
    with open(os.path.join(run, f"round_{t:03d}", "diagnoses.jsonl")) as f:
        for d in map(json.loads, filter(str.strip, f)):
            wins[d["task_id"]] = wins.get(d["task_id"], 0) + d["reward"]
            n += 1
    return wins, n


def zero_var_share(run, t):
    path = os.path.join(run, f"round_{t:03d}", "train_metrics.jsonl")
    with open(path) as f:
        return json.loads(f.readline())["zero_var_share"]


HEADER = f"{'run':<12}{'round':>6}{'sampled':>9}{'pass':>7}{'greedy':>8}{'w':>7}{'zero-var':>10}{'steps':>7}"


def rows(name, res):
    for r in res["rounds"]:
        print(f"{name:<12}{r['round']:>6}{r['reward']:>9.3f}{r['pass']:>7.3f}{r['greedy']:>8.3f}"
              f"{r['w_mean'] or 0:>7.3f}{r['zero_var']:>10.3f}{r['steps']:>7}")


os.makedirs(args.runs, exist_ok=True)
results, t_start = {}, time.time()
for seed in [int(s) for s in args.seeds.split(",")]:
    for mode in args.modes.split(","):
        name = f"{mode}-s{seed}"
        run = os.path.join(args.runs, name)
        t0 = time.time()
        # KEEP=all: every round's policy is scored greedily below
        sets = [x for kv in [f"SEED={seed}", "KEEP=all", *args.set] for x in ("--set", kv)]
        sh(["bash", "loop.sh", "tiny", "--mode", mode, "--rounds", str(args.rounds), "--eval-every", str(args.rounds),
            "--name", name, "--runs", args.runs, *sets], os.path.join(args.runs, f"{name}.log"))
        rounds, evals, base, config = collect(run)
        settings = config["settings"]
        policies = [settings["model"]] + [os.path.join(run, f"round_{t:03d}", "policy") for t in range(args.rounds)]
        greedy = [greedy_success(p, os.path.join(run, "train_eval", f"policy_{k}"), settings)
                  for k, p in enumerate(policies)]
        first, last = task_successes(run, 0), task_successes(run, args.rounds - 1)
        results[name] = {
            "rounds": [{"round": r["round"], "reward": r["reward"], "pass": r["label_share"].get("pass", 0.0),
                        "greedy": greedy[r["round"]], "w_mean": r["w_mean"], "steps": r["steps"],
                        "zero_var": zero_var_share(run, r["round"])} for r in rounds],
            "tasks_first": first[0], "tasks_last": last[0], "samples": [first[1], last[1]],
            "greedy_last": greedy[-1],
            "heldin_first": base["average"] if base else None,
            "heldin_last": evals.get(f"round_{args.rounds - 1:03d}", {}).get("average"),
            "minutes": round((time.time() - t0) / 60, 1)}
        print(f"{name}: {results[name]['minutes']} min\n{HEADER}", flush=True)
        rows(name, results[name])
        sys.stdout.flush()

with open(os.path.join(args.runs, "learning.json"), "w") as f:
    json.dump(results, f, indent=1)
print(f"\ntiny preset, {args.rounds} rounds, {len(results)} runs in {(time.time() - t_start) / 60:.1f} min")
print("sampled = mean training reward of the round's rollouts; pass = share of turns labelled pass;")
print("greedy = training tasks solved greedily by the policy that played the round; w = mean SEAL weight;")
print("zero-var = share of GRPO groups with equal rewards; steps = optimiser steps of the round\n")
print(HEADER)
for name, res in results.items():
    rows(name, res)
# where a gain or a loss comes from: the same tasks, first and last round (successes of N samples)
tasks = sorted({t for res in results.values() for t in res["tasks_first"]})
short = [t.removeprefix("multi_turn_").removesuffix("_1turn") for t in tasks]
print(f"\nsuccesses per task, round 0 -> last round\n{'run':<12}" + "".join(f"{s:>18}" for s in short))
for name, res in results.items():
    print(f"{name:<12}" + "".join(f"{res['tasks_first'].get(t, 0):>13g} ->{res['tasks_last'].get(t, 0):>3g}" for t in tasks))
# se: the standard error of the gain from sampling alone (two independent binomial means)
print(f"\n{'run':<12}{'gain':>7}{'se':>7}{'target':>8}{'greedy first->last':>20}{'held-in first->last':>21}")
for name, res in results.items():
    (p0, p1), (n0, n1) = (res["rounds"][0]["reward"], res["rounds"][-1]["reward"]), res["samples"]
    gain, se = p1 - p0, (p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1) ** 0.5
    held = f"{res['heldin_first']} -> {res['heldin_last']}"
    print(f"{name:<12}{gain:>+7.3f}{se:>7.3f}{'met' if gain >= 0.15 else 'NOT met':>8}"
          f"{res['rounds'][0]['greedy']:>10.3f} -> {res['greedy_last']:.3f}{held:>21}")
