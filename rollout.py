"""Roll out a policy on BFCL multi-turn tasks (or a τ²-bench domain's) through the training-time interface Ω.

    python rollout.py --model DIR --tasks data/train.jsonl --out rollouts.jsonl [--n 8] \
        [--interface interface.json] [--engine vllm|hf] [--limit K] [--temperature 1.0] \
        [--seed S] [--max-steps-per-turn 20] [--max-model-len 16384] [--max-new-tokens 1024] \
        [--schedule async|lockstep] [--prompts bfcl|template] [--handler QwenFCHandler] [--server URL[,URL...]]
    python rollout.py --model DIR --tasks tau2:airline:train --out rollouts.jsonl \
        (--scripted-user | --user-model DIR | --user-base-url URL --user-model-name NAME) [--user-timeout S] [...]

The defaults of the settings a preset holds (--n, --temperature, lengths, handler, ...) are the
presets' (common/presets.py): run by hand, the stage plays as the loop plays it.

Each task is played `--n` times against the real bfcl-eval environment; every
trajectory is one JSONL record (docs/design.md §3) holding the transcript, the parsed
calls and what the environment returned, and the exact token ids the engine
consumed and produced with a mask that is 1 only on model-generated tokens.
What the model is shown is what bfcl-eval's handler for it builds (common/envs/bfcl/prompts.py),
token-in/token-out: its own generated ids stay in the context, where bfcl-eval's
harness would re-render its decoded calls (`--prompts template` renders with the
model's chat template instead). Turns follow bfcl-eval's inference loop
(common/envs/bfcl/play.py): an output that does
not decode into calls ends the turn, unless Ω's error feedback is on, which
answers it with the parse error and a hint; the record's `decode_failure` says
which. `--model` is a HF model folder or a LoRA adapter folder. The engine is
vLLM's own server (common/engine/serve.py): the ones --server names, which must serve
--model's weights (checked before anything plays), or one started for this
stage's lifetime (its log beside --out). Each trajectory's next generation is
submitted as soon as its previous one is handled (`--schedule async`, the default);
`lockstep` waits for the whole step, and is the only schedule of `--engine hf`
(transformers generate in this process). The summary reports the share of prompt
tokens served from vLLM's prefix cache.

`--tasks tau2:DOMAIN:SPLIT` plays a τ²-bench domain's split instead (common/envs/__init__.py,
common/envs/tau2/tau2.py): each episode runs through τ²'s orchestrator against a user simulator (a
served model, or `--scripted-user`, which needs none), with the model's chat template and
τ²'s tool schemas, token-in/token-out, and its record holds the same fields plus τ²'s
transcript, which diagnose.py scores with τ²'s evaluator. Episodes play 64 at once on vLLM, each
sending its next generation as soon as it needs it (`--schedule async`); `lockstep` (and `--engine
hf`) batches the generations they wait on, 16 episodes at once. A user simulator that does not answer a
request within `--user-timeout` seconds, or still fails after two more tries (a 429, a 5xx), stops
the stage with a message naming it and writes nothing; on a domain whose user acts through tool
calls (telecom), one that answers a tool offer with text is refused before any episode plays.
"""

import argparse
import json
import os
import random
import sys

from common import envs, presets
from common.engine import playargs
from common.envs.bfcl import play
from common.envs.tau2 import tau2 as tau2_env
from common.jsonl import RecordError, write_json, write_jsonl
from common.seal import interface as omega_api

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="policy folder (HF model or LoRA adapter)")
parser.add_argument("--tasks", required=True, help="task file (data/train.jsonl), or tau2:DOMAIN:SPLIT")
parser.add_argument("--n", type=int, default=presets.GROUP_SIZE, help="samples per task (the GRPO group)")
parser.add_argument("--out", required=True, help="output JSONL")
parser.add_argument("--interface", default=None, help="Ω (interface.json); absent: plain prompts")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category")
parser.add_argument("--task-ids", default=None, help="comma-separated task ids to play (after --limit)")
parser.add_argument("--batch", type=int, default=None,
                    help="play only K tasks: round R takes the R-th slice of a fixed shuffle (cycling)")
parser.add_argument("--temperature", type=float, default=play.PlaySpec.temperature)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--prompts", default=play.PlaySpec.prompts, choices=["bfcl", "template"],
                    help="bfcl: the prompts bfcl-eval's --handler builds (evaluation's); template: the "
                         "model's chat template with tools= (verl's convention)")
parser.add_argument("--round", type=int, default=0)
playargs.add_play_args(parser)
parser.add_argument("--summary", default=None, help="also write the summary as JSON here")
parser.add_argument("--scripted-user", action="store_true",
                    help="τ² tasks: the scripted user (common/envs/tau2/tau2.py ScenarioUser), no model")
parser.add_argument("--user-model", default=None, help="τ² tasks: a user simulator model folder, served here")
parser.add_argument("--user-base-url", default=None, help="τ² tasks: a user simulator's OpenAI-compatible endpoint")
parser.add_argument("--user-model-name", default=None, help="the model name to ask --user-base-url for")
parser.add_argument("--user-tool-parser", default=presets.USER_TOOL_PARSER,
                    help="vLLM tool-call parser of the served --user-model (hermes for Qwen, llama3_json for Llama 3)")
parser.add_argument("--user-serve-args", default="", help="extra arguments for the --user-model server, one string")
parser.add_argument("--user-max-tokens", type=int, default=None,
                    help="cap on each user-simulator message (default: none, as τ²-bench)")
parser.add_argument("--user-timeout", type=float, default=presets.USER_TIMEOUT,
                    help="seconds one user-simulator request may wait for its answer; past it the stage stops")
parser.add_argument("--max-episode-steps", type=int, default=None,
                    help="τ² tasks: orchestrator steps an episode may take (default: τ²'s 200)")


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
        order = list(tasks)
        random.Random(0).shuffle(order)
        start = (round_ * batch) % len(order)
        tasks = (order + order)[start:start + min(batch, len(order))]
    return tasks


def user_of(args):
    """The τ² user simulator the flags name ("scripted": the scripted user); refused for BFCL tasks."""
    given = [bool(args.scripted_user), args.user_model is not None,
             args.user_base_url is not None or args.user_model_name is not None]
    if not envs.is_tau2(args.tasks):
        if any(given) or args.max_episode_steps is not None or args.user_max_tokens is not None:
            parser.error("a user simulator is for τ² tasks (--tasks tau2:DOMAIN:SPLIT); BFCL scripts its user turns")
        return None
    if sum(given) != 1:
        parser.error("τ² tasks need one user: --scripted-user, --user-model DIR, or --user-base-url URL "
                     "--user-model-name NAME")
    if given[2] and not (args.user_base_url and args.user_model_name):
        parser.error("--user-base-url and --user-model-name go together")
    if not presets.positive(args.user_timeout):
        parser.error(f"--user-timeout {args.user_timeout:g}: seconds a user-simulator request may wait, above 0")
    if args.scripted_user:
        return "scripted"
    return tau2_env.User(args.user_model, args.user_base_url and args.user_base_url.rstrip("/"), args.user_model_name,
                         tool_parser=args.user_tool_parser, serve_args=args.user_serve_args,
                         max_tokens=args.user_max_tokens, timeout=args.user_timeout)


def main(args):
    user = user_of(args)
    spec = playargs.play_spec(args, parser, omega=omega_api.load(args.interface), temperature=args.temperature,
                              prompts=args.prompts)
    env = envs.load(args.tasks, user, user_log=os.path.splitext(args.out)[0] + ".user.log",
                    max_steps=args.max_episode_steps)
    tasks = select_tasks(env, args.limit, args.task_ids, args.batch, args.round)
    log = os.path.splitext(args.out)[0] + ".server.log"
    with playargs.open_engine(args, args.model, max_model_len=spec.max_model_len, seed=args.seed, log=log) as engine:
        records, timing = env.play(tasks, args.n, engine, spec, round_=args.round, policy=os.path.abspath(args.model))
    write_jsonl(args.out, records)
    stats = {**play.summary(records), "schedule": spec.schedule, **play.cache_summary(timing),
             "seconds": round(timing["seconds"], 3), "engine_seconds": round(timing["engine_seconds"], 3)}
    print(json.dumps(stats, indent=1))
    if args.summary:
        write_json(args.summary, stats)


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except (RecordError, play.TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
