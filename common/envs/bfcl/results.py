"""evaluate.py's plays as the result files bfcl-eval's `generate` writes (one entry per task, as its multi-turn
prompting loop and the registry handler's own `write` produce it), for its own runner to score; and the BFCL
leaderboard's figures (docs/bfcl-results.md). Only local-model (OSSHandler) entries; nothing is eval'd here.
"""

import functools
import shutil
from pathlib import Path

from common.envs.bfcl import prompts  # first: its harness import sets BFCL_PROJECT_ROOT for bfcl-eval
from common.jsonl import RecordError

# The BFCL leaderboard's multi-turn score (%) by registry entry over all tasks (as evaluate.py's average)
LEADERBOARD = {"Qwen/Qwen3-4B-Instruct-2507-FC": (22.12, "BFCL leaderboard V4, last updated 2026-04-12")}
LEADERBOARD_TASKS = 800  # 4 categories x 200


def leaderboard_note(registry_name, tasks):
    """The leaderboard's figure for this entry in one line (None if none), and whether `tasks` compares with it."""
    if registry_name not in LEADERBOARD:
        return None
    figure, source = LEADERBOARD[registry_name]
    note = f"BFCL leaderboard: {registry_name} {figure:.2f} over all {LEADERBOARD_TASKS} tasks ({source})"
    if tasks != LEADERBOARD_TASKS:
        note += f"; not comparable with a score over {tasks} tasks (evaluate.py --split all)"
    return note


@functools.cache
def handler(registry_name):
    """bfcl-eval's handler for a registry entry, built by its evaluation runner's own get_handler."""
    # Importing the runner imports bfcl-eval's whole model registry (every provider's SDK).
    from bfcl_eval.eval_checker.eval_runner import MODEL_CONFIG_MAPPING, get_handler
    from bfcl_eval.model_handler.local_inference.base_oss_handler import OSSHandler
    if registry_name not in MODEL_CONFIG_MAPPING:
        raise RecordError(f"{registry_name!r} is not in bfcl-eval's model registry (bfcl_eval/constants/model_config.py)")
    cls = MODEL_CONFIG_MAPPING[registry_name].model_handler
    if not issubclass(cls, OSSHandler):  # checked first: building an API handler wants its credentials
        raise RecordError(f"{registry_name!r} is an API model in bfcl-eval's registry ({cls.__name__}); "
                          "choose a local-model entry, whose handler reads the model's text")
    h = get_handler(registry_name)
    if h.registry_dir_name.replace("_", "/") != registry_name:
        # the runner finds a model by its folder name with every "_" read back as "/"
        raise RecordError(f"bfcl-eval's runner cannot map the folder {h.registry_dir_name!r} back to {registry_name!r}")
    return h


def write_result_files(out_dir, tasks, records, registry_name):
    """Write (replacing) `out_dir/result/<registry dir>/...` for the tasks' records (same order): the files."""
    h = handler(registry_name)
    result_dir = Path(out_dir) / "result"
    shutil.rmtree(result_dir / h.registry_dir_name, ignore_errors=True)
    entries = [result_entry(h, task, rec) for task, rec in zip(tasks, records, strict=True) if bfcl_entry(task["id"])]
    if not entries:
        return []
    h.write(entries, result_dir=result_dir)
    return sorted(str(p) for p in (result_dir / h.registry_dir_name).rglob("*_result.json"))


def bfcl_entry(task_id):
    """Whether bfcl-eval has an entry of this id (its ids end in an index; not the tiny preset's `..._1turn`)."""
    return task_id.rsplit("_", 1)[-1].isdigit()


def result_entry(h, task, record):
    """One task's entry as bfcl-eval's generate writes it."""
    if isinstance(record.get("inference_error"), str):
        # multi_threaded_inference's record of a whole entry that failed
        return {"id": task["id"], "result": f"Error during inference: {record['inference_error']}"}
    tokens = iter(_step_tokens(record))
    turns, log = [], []  # per turn: each step's parse, with its latency
    for t, turn in enumerate(record["turns"]):
        # what the model was shown at the turn's start, as bfcl-eval's loop logs it
        docs = prompts.announced(task, t)
        turn_log = {"begin_of_turn_query": prompts.new_tools_message(docs) if docs is not None else task["questions"][t]}
        turns.append([])
        for s, step in enumerate(turn["steps"]):
            parsed = h._parse_query_response_prompting(prompts.response(step["text"], *next(tokens)))
            # our records time trajectories, not steps: bfcl's aggregator skips a 0 as not measured
            turns[-1].append({**parsed, "latency": step.get("latency", 0.0)})
            last = s == len(turn["steps"]) - 1 and t == len(record["turns"]) - 1
            turn_log[f"step_{s}"] = _step_log(h, step, parsed, forced_quit=last and record.get("stop") == "step_limit",
                                              steps=len(turn["steps"]))
        log.append(turn_log)

    def per_step(key, default=None):
        return [[p.get(key, default) for p in steps] for steps in turns]

    entry = {"id": task["id"], "result": per_step("model_responses"),
             "input_token_count": per_step("input_token"), "output_token_count": per_step("output_token"),
             "latency": per_step("latency"), "inference_log": log}
    reasoning = per_step("reasoning_content", "")
    if any(r for turn in reasoning for r in turn):
        entry["reasoning_content"] = reasoning
    return entry


def _step_log(h, step, parsed, forced_quit, steps):
    """One step's inference_log entries, in the prompting loop's order."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response
    from bfcl_eval.model_handler.utils import convert_to_function_call
    log = []
    if "formatted_prompt" in step:
        log.append({"role": "inference_input", "content": {"formatted_prompt": step["formatted_prompt"]}})
    assistant = {"role": "assistant", "content": parsed["model_responses"]}
    if parsed.get("reasoning_content"):
        assistant["reasoning_content"] = parsed["reasoning_content"]
    log.append(assistant)
    if _decoder_raised(h, step, parsed["model_responses"]):
        # the error text is our parser's
        log.append({"role": "handler_log", "content": "Error decoding the model response. Proceed to next turn.",
                    "error": step["parse_error"]})
        return log
    decoded = convert_to_function_call([{c["name"]: c["arguments"]} for c in step["calls"]])
    log.append({"role": "handler_log", "content": "Successfully decoded model response.",
                "model_response_decoded": decoded})
    if is_empty_execute_response(decoded):
        log.append({"role": "handler_log", "content": "Empty response from the model. Proceed to next turn.",
                    "model_response_decoded": decoded})
        return log
    log += [{"role": "tool", "content": r} for r in step["results"]]
    if forced_quit:
        log.append({"role": "handler_log", "content": f"Model has been forced to quit after {steps - 1} steps."})
    return log


def _decoder_raised(h, step, text):
    """Whether bfcl-eval's decode_execute fails here: our parser refused it and the handler's extraction finds calls."""
    if step["calls"] or not step["parse_error"]:
        return False
    extract = getattr(h, "_extract_tool_calls", None)
    return extract is None or bool(extract(text))


def _step_tokens(record):
    """(prompt tokens, generated tokens) per step: its own counts, else its run of mask 1 (no tokens: 0)."""
    steps = sum(len(turn["steps"]) for turn in record["turns"])
    counted = [s for turn in record["turns"] for s in turn["steps"] if "output_tokens" in s]
    if counted and len(counted) == steps:  # evaluation re-renders every prompt: the step counts them
        return [(s["prompt_tokens"], s["output_tokens"]) for s in counted]
    tokens = record.get("tokens")
    if not tokens:
        return [(0, 0)] * steps
    runs, start = [], None
    for i, m in enumerate([*tokens["mask"], 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((len(tokens["prompt_ids"]) + start, i - start))
            start = None
    if len(runs) != steps:
        raise RecordError(f"task {record.get('task_id')}: {len(runs)} generations in the token mask "
                          f"but {steps} steps")
    return runs

