"""Roll out a policy on any environment's tasks through the training-time interface Ω (docs/design.md §3).

    python rollout.py --model DIR --tasks data/train.jsonl --out rollouts.jsonl [--n 8] [--interface interface.json]
        [--engine vllm|hf] [--limit K] [--batch K --round R] [play flags] [the kind's flags]
    python rollout.py --model DIR --tasks tau2:airline:train --out ... (--scripted-user | --user-model DIR | ...)

Each task is played `--n` times (its defaults are the presets'); one JSONL record per trajectory: the
transcript, the parsed calls, what the environment returned, and the exact token ids with a mask that is 1
only on generated tokens. `--model` is a model or LoRA adapter folder, played on vLLM servers (--server, or one
started for the stage, its log beside --out) or in this process (--engine hf).
"""

import argparse
import json
import os
import random
import sys

from common import envs, presets
from common.engine import episode, playargs
from common.jsonl import RecordError, write_json, write_jsonl
from common.seal import interface as omega_api

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="policy folder (HF model or LoRA adapter)")
parser.add_argument("--tasks", required=True, help="the environment's tasks: a task file (data/train.jsonl), KIND:... (tau2:airline:train)")
parser.add_argument("--n", type=int, default=presets.GROUP_SIZE, help="samples per task (the GRPO group)")
parser.add_argument("--out", required=True, help="output JSONL")
parser.add_argument("--interface", default=None, help="Ω (interface.json); absent: plain prompts")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category")
parser.add_argument("--task-ids", default=None, help="comma-separated task ids to play (after --limit)")
parser.add_argument("--batch", type=int, default=None,
                    help="play only K tasks: round R takes the R-th slice of a fixed shuffle (cycling)")
parser.add_argument("--temperature", type=float, default=episode.PlaySpec.temperature)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--prompts", default=episode.PlaySpec.prompts, choices=["bfcl", "template"],
                    help="bfcl: the prompts bfcl-eval's --handler builds (evaluation's); template: the "
                         "model's chat template with tools= (verl's convention)")
parser.add_argument("--round", type=int, default=0)
playargs.add_play_args(parser)
parser.add_argument("--summary", default=None, help="also write the summary as JSON here")
envs.add_args(parser)  # the kind's own: τ²'s user simulator


def select_tasks(env, limit=None, ids=None, batch=None, round_=0):
    tasks = list(env.tasks.values())
    if limit:
        tasks = [t for cat in env.categories for t in [x for x in tasks if x["category"] == cat][:limit]]
    if ids:
        wanted = ids.split(",")
        known = {t["id"] for t in tasks}
        unknown = [i for i in wanted if i not in known]
        if unknown:
            raise RecordError(f"{env.source}: unknown task id {unknown[0]}")
        tasks = [t for t in tasks if t["id"] in set(wanted)]
    if batch:
        # A fixed order (not --seed) so that every run and mode sees the same tasks per round.
        random.Random(0).shuffle(tasks)
        start = (round_ * batch) % len(tasks)
        tasks = (tasks + tasks)[start:start + min(batch, len(tasks))]
    return tasks


def main(args):
    env = envs.load(args.tasks, args, parser)
    spec = playargs.play_spec(args, parser, omega=omega_api.load(args.interface), temperature=args.temperature,
                              prompts=args.prompts)
    tasks = select_tasks(env, args.limit, args.task_ids, args.batch, args.round)
    log = os.path.splitext(args.out)[0] + ".server.log"
    with playargs.open_engine(args, args.model, max_model_len=spec.max_model_len, seed=args.seed, log=log) as engine:
        records, timing = env.play(tasks, args.n, engine, spec, round_=args.round, policy=os.path.abspath(args.model))
    write_jsonl(args.out, records)
    stats = {**episode.summary(records), "schedule": spec.schedule, **episode.cache_summary(timing),
             "seconds": round(timing["seconds"], 3), "engine_seconds": round(timing["engine_seconds"], 3)}
    print(json.dumps(stats, indent=1))
    if args.summary:
        write_json(args.summary, stats)


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except (RecordError, episode.TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
