"""Evaluate a policy on any environment's tasks with its own checker, Ω removed (docs/design.md §9, docs/ood.md).

    python evaluate.py --policy DIR|oracle --out OUT [--tasks TASKS] [--limit K] [play flags] [the kind's flags]
    python evaluate.py --compare runs/qwen7b-seal runs/qwen7b-vanilla ...

TASKS, as the other stages name an environment (common/envs/__init__.py): a BFCL task file or --split
heldin|train|all (the default: held-in); bfcl-memory, bfcl-web (BFCL V4); tau2:DOMAIN:SPLIT, or as τ²-bench's
OOD bench tau2 (its three domains, the paper's task sets), against a user simulator (--user-model ..., or
--scripted-user); mcp:DIR:SPLIT. `--policy oracle` plays the ground truth through the same path. Writes
OUT/results.jsonl and OUT/scores.json. `--compare` prints finished runs side by side (common/run/report.py).
"""

import argparse
import sys

from common import envs
from common.engine import playargs
from common.engine.episode import TrajectoryFailed
from common.jsonl import RecordError

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", help="policy folder, or 'oracle' (ground truth)")
parser.add_argument("--compare", nargs="+", metavar="RUN", help="print the scores of these run folders")
parser.add_argument("--tasks", default=None, help="the environment's tasks (default: BFCL held-in)")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category (a τ² domain's: its first K)")
parser.add_argument("--out", help="output folder")
playargs.add_play_args(parser, evaluation=True)
envs.add_args(parser, evaluation=True)


def main(args):
    if args.compare:
        from common.run import report  # plots: only for --compare
        return report.compare(args.compare)
    if not args.policy or not args.out:
        parser.error("--policy and --out are required (or --compare RUN ...)")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    try:
        env = envs.load(args.tasks, args, parser, evaluation=True)
    except RecordError as e:
        parser.error(f"--tasks: {e}")
    spec = playargs.eval_spec(args, parser, decoding=getattr(env, "decoding", "greedy"))  # a non-model fails here

    def engine():
        return playargs.open_engine(args, args.policy, max_model_len=spec.max_model_len, seed=0,
                                    log=f"{args.out}/server.log")
    return env.evaluate(args.out, args.policy, spec, engine, limit=args.limit)


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except (RecordError, TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
