"""Diagnose rollouts: the environment's own reward and one failure label per user turn (Ψ, docs/design.md §4).

    python diagnose.py --tasks data/train.jsonl --rollouts runs/x/round_000/rollouts.jsonl --out .../diagnoses.jsonl
    python diagnose.py --tasks tau2:airline:train --rollouts ... --out ... [--workers K]

One diagnosis record per rollout record, in input order (env.diagnose: BFCL replays the trajectory with
bfcl-eval's checkers, τ² scores the transcript with τ²'s evaluator): reward, the official verdict, a label and
an evidence line per turn, and the label profile. Prints reward and label mix per category.
"""

import argparse
import collections
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

from tqdm import tqdm

from common import envs
from common.jsonl import RecordError, read_jsonl, write_jsonl
from common.seal import taxonomy

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tasks", required=True,
                    help="the environment's tasks: a task file (data/train.jsonl), KIND:... (tau2:airline:train)")
parser.add_argument("--rollouts", required=True, help="rollout records (JSONL)")
parser.add_argument("--out", required=True, help="diagnosis records (JSONL)")
parser.add_argument("--top", type=int, default=10, help="how many of the commonest evidence strings to print")
parser.add_argument("--workers", type=int, default=1,
                    help="processes diagnosing at once (a τ² episode's evaluator replay takes about a second)")

# The rollout fields this stage reads; within each turn: steps[].calls and steps[].parse_error.
ROLLOUT_FIELDS = ["task_id", "category", "sample_index", "round", "turns"]


def diagnose_file(env, path, workers=1):
    """Diagnosis records for every rollout of `path`, in order; stops at the first bad record."""
    rollouts = read_jsonl(path, required=ROLLOUT_FIELDS)
    jobs = []
    for r in rollouts:
        where = f"{path}:{r['_line']}"
        task = env.tasks.get(r["task_id"])
        if task is None:
            raise RecordError(f"{where}: unknown task id {r['task_id']!r}")
        if r["category"] != task["category"]:
            raise RecordError(f"{where}: category {r['category']!r} but task {task['id']} is {task['category']!r}")
        jobs.append((where, r))
    global _ENV
    _ENV = env  # forked workers inherit it, loaded once
    bar = dict(total=len(jobs), desc="diagnose", unit="traj")
    if workers <= 1 or len(jobs) < 2:
        return list(tqdm(map(_diagnose, jobs), **bar))
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("fork")) as pool:
        return list(tqdm(pool.map(_diagnose, jobs, chunksize=4), **bar))  # re-raises a worker's RecordError


_ENV = None  # the environment the jobs are diagnosed against (a module global: forked workers share it)


def _diagnose(job):
    """The diagnosis record of a job; a RecordError names its file and line."""
    where, r = job
    try:
        return _ENV.diagnose(_ENV.tasks[r["task_id"]], r)
    except RecordError as e:
        raise RecordError(f"{where}: {e}") from None


def print_summary(records, top, categories):
    cats = [c for c in categories if any(r["category"] == c for r in records)]
    turns = {c: collections.Counter() for c in cats}
    for r in records:
        turns[r["category"]].update(r["turn_labels"])
    total = sum(turns.values(), collections.Counter())

    print(f"\n{len(records)} trajectories, {sum(total.values())} turns")
    print(f"{'':>20}" + "".join(f"{c:>14}" for c in cats + ["all"]))
    rewards = [[r["reward"] for r in records if r["category"] == c] for c in cats]
    rewards.append([r["reward"] for r in records])
    print(f"{'reward mean':>20}" + "".join(f"{sum(x) / len(x):>14.3f}" for x in rewards))
    print("label share of turns:")
    for z in taxonomy.LABELS:
        shares = [turns[c][z] / max(1, sum(turns[c].values())) for c in cats] + [total[z] / max(1, sum(total.values()))]
        print(f"{z:>20}" + "".join(f"{s:>14.3f}" for s in shares))
    common = collections.Counter((z, e) for r in records for z, e in zip(r["turn_labels"], r["evidence"], strict=True)
                                 if z not in ("pass", "correct_abstention"))
    print(f"commonest failure evidence (of {len(common)} distinct):")
    # Ties broken by text, so the summary is as deterministic as the output file.
    for (z, e), n in sorted(common.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        print(f"{n:>8}  {z:<18} {e}")


def main(args):
    env = envs.load(args.tasks)
    records = diagnose_file(env, args.rollouts, args.workers)
    write_jsonl(args.out, records)
    if records:
        print_summary(records, args.top, env.categories)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except RecordError as e:
        sys.exit(f"error: {e}")
