"""Evaluate a policy on an environment's split with its official checker, Ω removed.

    python evaluate.py --policy DIR --split heldin --out runs/NAME/eval/TAG [--engine vllm|hf] \
        [--schedule async|lockstep]
    python evaluate.py --policy DIR --tasks tau2:airline:test [--trials K] --out OUT \
        (--scripted-user | --user-model DIR | --user-base-url URL --user-model-name NAME)
    python evaluate.py --policy DIR --split all --bfcl-model Qwen/Qwen3-4B-Instruct-2507-FC --out OUT
    python evaluate.py --policy oracle --split heldin --out runs/oracle/eval
    python evaluate.py --compare runs/qwen7b-seal runs/qwen7b-vanilla ...

A policy folder (HF model or LoRA adapter) plays every task once with bfcl-eval's
decoding (temperature 0.001 with the model's generation_config defaults, as its vLLM
server samples; `--decoding greedy`: argmax), plain prompts (no interface) and
bfcl-eval's own turn protocol: an output that
does not decode into calls ends the turn, and a turn's 21st step with calls
(of 20) force-quits the task. `--policy oracle` plays every task's ground-truth
calls through the environment exactly as a model's output would go (parsed,
rendered, executed, turn by turn) and scores them with bfcl-eval's
multi_turn_checker: a check of the whole pipeline. Writes DIR/results.jsonl (one
verdict per task) and DIR/scores.json (percent per category and their average),
and DIR/result/, the same plays as bfcl-eval's own result files for its `bfcl
evaluate` (`--bfcl-model`, docs/bfcl-results.md). `--split all` plays every
BFCL V3 multi-turn task bfcl-eval ships (4 categories x 200, read from its files
as data/prepare.py reads them), the set the BFCL leaderboard scores; heldin and
train are the paper's 400/400 split (data/<split>.jsonl). `--compare` prints the
scores of finished runs or evaluation folders side by side (base model once, then
every evaluated round, each row with the mode its run trained in), like the paper's Tables 1 and 3, the BFCL leaderboard's
figure for the bfcl-eval entry they were scored under (common/envs/bfcl/results.py
LEADERBOARD), and their OOD scores (common/run/report.py).

`--tasks` names the environment as in the other stages (common/envs/__init__.py): a BFCL task file
(replacing the split's), or `tau2:DOMAIN:SPLIT`, a τ²-bench domain's split played greedily
against a user simulator (the flags rollout.py takes; the oracle needs none) and scored by τ²'s
evaluator, `--trials K` adding pass^1..pass^K: the same results.jsonl and scores.json as
`python -m ood.tau --domain DOMAIN --split SPLIT` (docs/environments.md §5).

The out-of-distribution benches are their own commands (docs/ood.md): BFCL V4
memory and web search, `python -m ood.memory`; τ²-bench's domains, `python -m ood.tau`.
"""

import argparse
import os
import sys

from tqdm import tqdm

from common import envs
from common.engine import calls as C
from common.engine import playargs
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play, prompts
from common.envs.bfcl import results as bfcl_results
from common.envs.bfcl.replay import read_turns
from common.envs.tau2 import tau2
from common.jsonl import RecordError, write_json, write_jsonl
from common.presets import MAX_STEPS_PER_TURN
from common.run.scores import mean, percent_by_group

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", help="policy folder, or 'oracle' (ground truth)")
parser.add_argument("--compare", nargs="+", metavar="RUN", help="print the scores of these run folders")
parser.add_argument("--split", default=None, choices=["heldin", "train", "all"],
                    help="BFCL: heldin (the default), train: the paper's split (data/<split>.jsonl); all: "
                         "bfcl-eval's 800 tasks, the BFCL leaderboard's")
parser.add_argument("--tasks", default=None,
                    help="the environment (common/envs/__init__.py): a BFCL task file (default: the --split's), or "
                         "tau2:DOMAIN:SPLIT, a τ²-bench domain's split")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category (a τ² domain's: its first K)")
parser.add_argument("--out", help="output folder")
playargs.add_play_args(parser, evaluation=True)
parser.add_argument("--decoding", default="bfcl", choices=["bfcl", "greedy"],
                    help="bfcl: temperature 0.001 with the model's generation_config defaults (bfcl-eval's "
                         "vLLM server); greedy: argmax. BFCL's: τ² tasks' agent is always greedy")
parser.add_argument("--bfcl-model", default=None,
                    help="bfcl-eval registry entry that names and decodes DIR/result/ (docs/bfcl-results.md; "
                         "default: the --handler's, common/envs/bfcl/prompts.py HANDLERS)")
tau2.add_user_args(parser)  # τ² tasks' user simulator
parser.add_argument("--trials", type=int, default=None,
                    help="τ² tasks: episodes per task (τ²'s num_trials, default 1): scores.json gets pass^1..pass^K")
parser.add_argument("--max-episode-steps", type=int, default=None,
                    help="τ² tasks: orchestrator steps per episode (default τ²'s 200)")
parser.add_argument("--concurrency", type=int, default=None,
                    help="τ² tasks: episodes played at once (default: 64 on vLLM, 16 lock-step, 1 with the oracle)")


def oracle_trajectory(task, fmt="python"):
    """The ground truth, fed turn by turn through the same path as model text written in `fmt`:
    (decoded, turns), the checker's calls and the play as a model record's turns."""
    turns = []
    with bfcl.Environment(task) as env:
        for turn, gt in enumerate(task["ground_truth"]):
            env.start_turn(turn)
            steps = []
            if gt:
                text = C.format_calls(bfcl.ground_truth_calls(task, turn), fmt)
                steps.append({"text": text, **env.step(text, fmt=fmt)})
            turns.append({"steps": steps, "end": "answer"})
        return env.decoded, turns


def split_tasks(split, path=None):
    """(tasks, what they are) of a split, or of the task file `path`. `all` is built at run time
    from the installed bfcl-eval's files, as data/prepare.py builds the split's records."""
    if split == "all" and not path:
        from data import prepare
        tasks = prepare.build_tasks(prepare.bfcl_data_dir())
        return list(tasks.values()), f"bfcl-eval's {len(tasks)} multi-turn tasks"
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"{split}.jsonl")
    return list(bfcl.load_tasks(path).values()), os.path.relpath(path)


def without_prompts(record):
    return {**record, "turns": [{**turn, "steps": [{k: v for k, v in step.items() if k != "formatted_prompt"}
                                                   for step in turn["steps"]]} for turn in record["turns"]]}


def category_scores(results):
    """Percent solved per category and the unweighted average of the four (as BFCL reports)."""
    # a category without tasks (a --limit or a subset file) is left out, not scored 0
    scores = {c: v for c, v in percent_by_group(results, bfcl.CATEGORIES, "category", "valid").items()
              if v is not None}
    average = mean(scores.values())
    return scores | {"average": 0.0 if average is None else average}


def print_table(scores, title):
    cols = [c for c in bfcl.CATEGORIES if c in scores] + ["average"]
    print(f"\n{title}")
    print("  ".join(f"{c:>12}" for c in cols))
    print("  ".join(f"{scores[c]:>12.2f}" for c in cols))


def bfcl_settings(spec, model_context):
    """What of this run differs from bfcl-eval's own local inference (empty: scores are bfcl-eval's)."""
    differs = []
    if spec.max_model_len != model_context:
        differs.append(f"context {spec.max_model_len} (the model's is {model_context})")
    if spec.max_new_tokens != playargs.BFCL_MAX_NEW_TOKENS:
        differs.append(f"at most {spec.max_new_tokens} new tokens per call (bfcl-eval: {playargs.BFCL_MAX_NEW_TOKENS})")
    if spec.temperature == 0.0:
        differs.append("greedy decoding (bfcl-eval: temperature 0.001 and the model's generation_config)")
    if spec.max_steps_per_turn != MAX_STEPS_PER_TURN:
        differs.append(f"{spec.max_steps_per_turn} steps per turn (bfcl-eval: {MAX_STEPS_PER_TURN})")
    return differs


def main(args):
    if args.compare:
        from common.run import report  # plots: only for --compare
        return report.compare(args.compare)
    if not args.policy or not args.out:
        parser.error("--policy and --out are required (or --compare RUN ...)")
    if args.tasks and envs.is_tau2(args.tasks):
        return evaluate_tau2(args)
    if tau2.user_flags_given(args) or any(v is not None for v in (args.trials, args.max_episode_steps,
                                                                  args.concurrency)):
        parser.error("a user simulator, --trials, --max-episode-steps and --concurrency are for τ² tasks "
                     "(--tasks tau2:DOMAIN:SPLIT); BFCL scripts its user turns and plays each task once")
    if args.tasks and not os.path.isfile(args.tasks):
        parser.error(f"--tasks {args.tasks}: no such task file (a BFCL task file, or tau2:DOMAIN:SPLIT)")
    args.split = args.split or "heldin"
    spec = playargs.eval_spec(args, parser, decoding=args.decoding)
    differs = []
    if args.policy != "oracle":
        from common.engine.models import model_context
        differs = bfcl_settings(spec, model_context(args.policy))
    args.bfcl_model = args.bfcl_model or prompts.registry_name(args.handler)
    try:
        bfcl_results.handler(args.bfcl_model)  # before anything is played
    except RecordError as e:
        parser.error(f"--bfcl-model: {e}")
    tasks, which = split_tasks(args.split, args.tasks)
    if args.limit:
        tasks = bfcl.first_per_category(tasks, args.limit)

    if args.policy == "oracle":
        played = [oracle_trajectory(t, spec.fmt) for t in tqdm(tasks, desc="oracle", unit="task")]
        decoded = [dec for dec, _ in played]
        records = [{"task_id": t["id"], "turns": turns, "stop": "done"} for t, (_, turns) in zip(tasks, played, strict=True)]
    else:
        with playargs.eval_player(args, spec, os.path.join(args.out, "server.log")) as run:
            records = run(tasks)
        # Each step's prompt text (~25k characters) goes only into bfcl-eval's result files.
        write_jsonl(os.path.join(args.out, "rollouts.jsonl"), [without_prompts(r) for r in records])
        decoded = [[t.decoded for t in read_turns(task, rec["turns"]) if t.played]
                   for task, rec in zip(tasks, records, strict=True)]

    results = []
    for task, dec in zip(tasks, decoded, strict=True):
        results.append({"task_id": task["id"], "category": task["category"], **bfcl.official_verdict(task, dec)})
    scores = category_scores(results)
    if args.policy != "oracle":
        scores["bfcl_eval"] = {"handler": args.handler, "registry": args.bfcl_model, "tasks": len(tasks),
                               "context": spec.max_model_len, "same_settings": not differs, "differs": differs}
    write_jsonl(os.path.join(args.out, "results.jsonl"), results)
    write_json(os.path.join(args.out, "scores.json"), scores)
    # After our scores, so that a record bfcl's format cannot hold costs only these files.
    bfcl_results.write_result_files(args.out, tasks, records, args.bfcl_model)
    print_table(scores, f"{args.policy} on {len(tasks)} tasks of {which} (BFCL multi-turn @ bfcl-eval 2026.3.23)")
    if differs:
        print("  not bfcl-eval's settings: " + "; ".join(differs))
    if args.policy != "oracle" and (note := bfcl_results.leaderboard_note(args.bfcl_model, len(tasks))):
        print("  " + note)
    if args.policy == "oracle":
        for r in results:
            if not r["valid"]:
                print(f"  failed: {r['task_id']} {r['error_type']} turn {r['turn']}")


def evaluate_tau2(args):
    """A τ² domain's split (`--tasks tau2:DOMAIN:SPLIT`), scored by τ²'s evaluator with pass^k, its
    agent greedy, against the user simulator the flags name (the oracle: none): the same files as
    `python -m ood.tau --domain DOMAIN --split SPLIT` (common/envs/tau2/tau2.py evaluate)."""
    for flag, value in (("--split", args.split), ("--bfcl-model", args.bfcl_model)):
        if value is not None:
            parser.error(f"{flag} is BFCL's; τ² tasks name their split in --tasks tau2:DOMAIN:SPLIT")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if any(v is not None and v < 1 for v in (args.trials, args.concurrency, args.max_episode_steps)):
        parser.error("--trials, --concurrency and --max-episode-steps must be at least 1")
    spec = playargs.eval_spec(args, parser)  # greedy; a policy that is not a model folder fails here
    user = tau2.user_of_args(args, parser)  # None: the oracle's scripted user
    try:
        env = envs.load(args.tasks, user, max_steps=args.max_episode_steps)
    except RecordError as e:
        parser.error(f"--tasks: {e}")

    def engine():
        return playargs.open_engine(args, args.policy, max_model_len=spec.max_model_len, seed=0,
                                    log=os.path.join(args.out, "server.log"))
    return env.evaluate(args.out, args.policy, spec, engine, limit=args.limit, trials=args.trials or 1,
                        concurrency=args.concurrency)


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except (RecordError, play.TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
