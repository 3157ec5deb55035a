"""BFCL's evaluation (evaluate.py --tasks FILE | --split heldin|train|all): every task played once as bfcl-eval's
local inference plays it (its decoding, Ω absent), scored by its multi_turn_checker; results.jsonl, scores.json
(percent per category, their average) and result/, bfcl-eval's own result files (docs/bfcl-results.md).
The oracle plays each task's ground truth through the same path as a model's output: a pipeline check.
"""

import os

from tqdm import tqdm

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play
from common.envs.bfcl import results as bfcl_results
from common.envs.bfcl.replay import read_turns
from common.jsonl import write_json, write_jsonl
from common.presets import MAX_STEPS_PER_TURN, ROOT
from common.run.scores import mean, percent_by_group


def oracle_trajectory(task, fmt="python"):
    """The ground truth as model text written in `fmt`, played: (decoded, turns) as bfcl.play_texts."""
    texts = [[C.format_calls(bfcl.ground_truth_calls(task, t), fmt)] if gt else []
             for t, gt in enumerate(task["ground_truth"])]
    return bfcl.play_texts(task, texts, fmt)


def split_tasks(split, path=None):
    """(tasks, what they are) of a split, or of the task file `path`. `all` is built at run time
    from the installed bfcl-eval's files, as data/prepare.py builds the split's records."""
    if split == "all" and not path:
        from data import prepare
        tasks = prepare.build_tasks(prepare.bfcl_data_dir())
        return list(tasks.values()), f"bfcl-eval's {len(tasks)} multi-turn tasks"
    path = path or os.path.join(ROOT, "data", f"{split}.jsonl")
    return list(bfcl.load_tasks(path).values()), os.path.relpath(path)


def without_prompts(record):
    return {**record, "turns": [{**turn, "steps": [{k: v for k, v in step.items() if k != "formatted_prompt"}
                                                   for step in turn["steps"]]} for turn in record["turns"]]}


def category_scores(results):
    """Percent solved per category and the unweighted average of the four (as BFCL reports)."""
    # a category without tasks (a --limit or a subset file) is left out, not scored 0
    scores = {c: v for c, v in percent_by_group(results, bfcl.CATEGORIES, "category", "valid").items()
              if v is not None}
    return scores | {"average": mean(scores.values()) or 0.0}


def print_table(scores, cols, title, width=12):
    print(f"\n{title}")
    print("  ".join(f"{c:>{width}}" for c in cols))
    print("  ".join(f"{scores[c]:>{width}.2f}" for c in cols))


def bfcl_settings(spec, model_context):
    """What of this run differs from bfcl-eval's own local inference (empty: scores are bfcl-eval's)."""
    from common.engine.playargs import BFCL_MAX_NEW_TOKENS
    differs = []
    if spec.max_model_len != model_context:
        differs.append(f"context {spec.max_model_len} (the model's is {model_context})")
    if spec.max_new_tokens != BFCL_MAX_NEW_TOKENS:
        differs.append(f"at most {spec.max_new_tokens} new tokens per call (bfcl-eval: {BFCL_MAX_NEW_TOKENS})")
    if spec.temperature == 0.0:
        differs.append("greedy decoding (bfcl-eval: temperature 0.001 and the model's generation_config)")
    if spec.max_steps_per_turn != MAX_STEPS_PER_TURN:
        differs.append(f"{spec.max_steps_per_turn} steps per turn (bfcl-eval: {MAX_STEPS_PER_TURN})")
    return differs


def evaluate(env, out, policy, spec, engine, limit=None):
    """Score `policy` on `env`'s tasks (env.which names them) under bfcl-eval's entry env.bfcl_model."""
    differs = []
    if policy != "oracle":
        from common.engine.models import model_context
        differs = bfcl_settings(spec, model_context(policy))
    tasks = list(env.tasks.values())
    if limit:
        tasks = bfcl.first_per_category(tasks, limit)

    if policy == "oracle":
        played = [oracle_trajectory(t, spec.fmt) for t in tqdm(tasks, desc="oracle", unit="task")]
        decoded = [dec for dec, _ in played]
        records = [{"task_id": t["id"], "turns": turns, "stop": "done"} for t, (_, turns) in zip(tasks, played, strict=True)]
    else:
        with engine() as eng:
            records, _ = play.play(tasks, 1, eng, spec, policy=os.path.abspath(policy))
        # Each step's prompt text (~25k characters) goes only into bfcl-eval's result files.
        write_jsonl(os.path.join(out, "rollouts.jsonl"), [without_prompts(r) for r in records])
        decoded = [[t.decoded for t in read_turns(task, rec["turns"]) if t.played]
                   for task, rec in zip(tasks, records, strict=True)]

    results = [{"task_id": task["id"], "category": task["category"], **bfcl.official_verdict(task, dec)}
               for task, dec in zip(tasks, decoded, strict=True)]
    scores = category_scores(results)
    if policy != "oracle":
        scores["bfcl_eval"] = {"handler": spec.handler, "registry": env.bfcl_model, "tasks": len(tasks),
                               "context": spec.max_model_len, "same_settings": not differs, "differs": differs}
    write_jsonl(os.path.join(out, "results.jsonl"), results)
    write_json(os.path.join(out, "scores.json"), scores)
    # After our scores, so that a record bfcl's format cannot hold costs only these files.
    bfcl_results.write_result_files(out, tasks, records, env.bfcl_model)
    print_table(scores, [c for c in bfcl.CATEGORIES if c in scores] + ["average"],
                f"{policy} on {len(tasks)} tasks of {env.which} (BFCL multi-turn @ bfcl-eval 2026.3.23)")
    if differs:
        print("  not bfcl-eval's settings: " + "; ".join(differs))
    if policy != "oracle" and (note := bfcl_results.leaderboard_note(env.bfcl_model, len(tasks))):
        print("  " + note)
    for r in results if policy == "oracle" else []:
        if not r["valid"]:
            print(f"  failed: {r['task_id']} {r['error_type']} turn {r['turn']}")
    return scores

