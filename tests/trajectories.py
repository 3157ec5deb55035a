"""Rollout records built by really playing model texts through bfcl.Environment.

Shared by tests/test_taxonomy.py, tests/test_diagnose.py and bench/diagnose_bench.py:
calls, parse errors, results, call_errors and schema_errors in these records are
what the environment produced, not made up. `perturbations()` derives the
systematic perturbed set from a task's ground truth; `bfcl_eval_decoded()` gives
what bfcl-eval's own pipeline would hand its checker for the same model texts.
"""

import json
import re
import zlib

from common import bfcl
from common import calls as C

ANSWER = "Done."  # the plain answer that ends a turn (json format: no call, no parse error)
GARBAGE = '<tool_call>{"name": "cd", "arguments": {"folder": </tool_call>'  # does not parse


def text(calls):
    """Model text (Qwen's json format) for a list of call dicts."""
    return C.format_calls(calls, "json")


def rollout(task, turns, sample_index=0):
    """(rollout record, env.decoded) for per-turn lists of model texts (json format).

    `turns` may be shorter than the task: the trajectory stopped early.
    """
    record_turns = []
    with bfcl.Environment(task) as env:
        for t, texts in enumerate(turns):
            env.start_turn(t)
            steps = [{"text": s, **env.step(s, "json"), "feedback": None} for s in texts]
            record_turns.append({"steps": steps, "end": "answer"})
        decoded = env.decoded
    stopped = len(turns) < len(task["ground_truth"])
    return {
        "task_id": task["id"],
        "category": task["category"],
        "sample_index": sample_index,
        "round": 0,
        "policy": "test",
        "interface_version": None,
        "turns": record_turns,
        "stop": "step_limit" if stopped else "done",
        "tokens": {"prompt_ids": [], "ids": [], "mask": [], "logprobs": []},
        "stats": {"gen_tokens": 0, "cue_tokens": 0, "seconds": 0.0},
    }, decoded


def play(task, calls_per_turn, sample_index=0):
    """A rollout from per-turn lists of call dicts: one step with the calls, then an answer."""
    return rollout(
        task, [[text(calls), ANSWER] if calls else [ANSWER] for calls in calls_per_turn], sample_index
    )


# bfcl-eval's Qwen decoding (QwenFCHandler._extract_tool_calls + utils.convert_to_function_call,
# copied: importing bfcl_eval.model_handler needs tree_sitter, which is not installed).
QWEN_TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def bfcl_eval_decode(text):
    """The raw call strings bfcl-eval's inference and checker run for one Qwen-format output."""
    out = []
    for match in QWEN_TOOL_CALL_RE.findall(text):
        try:
            item = json.loads(match)
        except Exception:  # noqa: BLE001 (as bfcl-eval: a bad block is skipped)
            continue
        out.append(f"{item['name']}({','.join(f'{k}={v!r}' for k, v in item['arguments'].items())})")
    return out


def bfcl_eval_decoded(record):
    """Per turn, per step with calls: the raw strings bfcl-eval would check for this record's texts."""
    turns = []
    for turn in record["turns"]:
        steps = [bfcl_eval_decode(step["text"]) for step in turn["steps"]]
        turns.append([s for s in steps if s])
    return turns


def gt_calls(task):
    return [bfcl.ground_truth_calls(task, t) for t in range(len(task["ground_truth"]))]


def oracle(task):
    return play(task, gt_calls(task))


def changed_value(value, prop):
    """A different value of the same schema type (None when there is no obvious one)."""
    if "enum" in prop:
        others = [v for v in prop["enum"] if v != value]
        return others[0] if others else None
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, list) and value:
        return value[:-1]
    return None


def perturbations(task):
    """{name: rollout text per turn} for the systematic perturbed set of one task.

    Each perturbation hits one turn, chosen deterministically from the task id:
    arg (one argument value changed, same type), drop (one call dropped), extra
    (a call of another turn added), empty (no call in the turn), garbage (an
    unparsable output before the turn's calls), abstain_call (a call on an
    abstention turn; only tasks that have one), stop (the trajectory stops before
    the turn).

    Schema breaks (each call still runs, as in bfcl-eval), where the task has a
    call to break: number_as_string (an int or float argument written as a
    string), enum (a value outside the description's [Enum] list), unknown_param
    (an extra argument), missing_required (a required argument left out),
    early_held_out (miss_func: a held-out function called on the turn before it
    is revealed). Calls bfcl-eval's executor would not dispatch, refused by ours:
    unknown_name (a builtin's name added after the turn's calls), refused_only
    (the turn's only call names no tool), deny_listed (`exit()` added).
    """
    gt = gt_calls(task)
    acting = [t for t, c in enumerate(gt) if c]
    seed = zlib.crc32(task["id"].encode())
    pick = acting[seed % len(acting)]
    out = {}

    def with_turn(t, calls):
        return [calls if i == t else c for i, c in enumerate(gt)]

    order = acting[acting.index(pick) :] + acting[: acting.index(pick)]
    changed = next(_with_changed_argument(task, gt, order), None)
    if changed:
        out["arg"] = with_turn(*changed)
    out["drop"] = with_turn(pick, gt[pick][:-1])
    other = acting[(acting.index(pick) + 1) % len(acting)]
    out["extra"] = with_turn(pick, gt[pick] + gt[other][:1])
    out["empty"] = with_turn(pick, [])
    turns = {name: [[text(c), ANSWER] if c else [ANSWER] for c in calls] for name, calls in out.items()}

    oracle_turns = [[text(c), ANSWER] if c else [ANSWER] for c in gt]
    turns["garbage"] = [[GARBAGE] + s if t == pick else s for t, s in enumerate(oracle_turns)]
    abstain = [t for t, c in enumerate(gt) if not c]
    if abstain:
        t = abstain[seed % len(abstain)]
        before = [c for c in gt[:t] if c]
        call = before[-1][-1] if before else gt[acting[0]][0]  # a call the model has seen work
        turns["abstain_call"] = [[text([call]), ANSWER] if i == t else s for i, s in enumerate(oracle_turns)]
    turns["stop"] = oracle_turns[:pick]

    for kind, broken in _schema_breaks(task, gt, order).items():
        turns[kind] = [[text(c), ANSWER] if c else [ANSWER] for c in broken]
    refused = {"unknown_name": gt[pick] + [{"name": "print", "arguments": {"x": "hi"}}],
               "refused_only": [{"name": "seal_no_such_tool", "arguments": {}}],
               "deny_listed": gt[pick] + [{"name": "exit", "arguments": {}}]}
    for kind, calls in refused.items():
        turns[kind] = [[text(calls), ANSWER] if i == pick else s for i, s in enumerate(oracle_turns)]
    return turns


SCHEMA_KINDS = ("number_as_string", "enum", "unknown_param", "missing_required", "early_held_out")
REFUSED_KINDS = ("unknown_name", "refused_only", "deny_listed")


def _schema_breaks(task, gt, order):
    """{kind: per-turn calls} for the schema-breaking perturbations this task allows."""
    out = {}

    def first(change):
        for t in order:
            tools = {x["name"]: x for x in bfcl.tools_at(task, t)}
            for i, call in enumerate(gt[t]):
                params = tools[call["name"]]["parameters"] if call["name"] in tools else {}
                new = change(call, params)
                if new is not None:
                    return [gt[u][:i] + [new] + gt[u][i + 1 :] if u == t else c for u, c in enumerate(gt)]
        return None

    def number_as_string(call, params):
        for k, v in call["arguments"].items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                return {"name": call["name"], "arguments": {**call["arguments"], k: str(v)}}
        return None

    def enum(call, params):
        for k in call["arguments"]:
            prop = params.get("properties", {}).get(k, {})
            if C.enum_values(prop):
                bad = ["seal_other"] if prop.get("type") == "array" else "seal_other"
                return {"name": call["name"], "arguments": {**call["arguments"], k: bad}}
        return None

    def unknown_param(call, params):
        return {"name": call["name"], "arguments": {**call["arguments"], "seal_extra": 1}}

    def missing_required(call, params):
        for k in params.get("required", []):
            if k in call["arguments"]:
                return {"name": call["name"], "arguments": {a: v for a, v in call["arguments"].items() if a != k}}
        return None

    for kind, change in (("number_as_string", number_as_string), ("enum", enum), ("unknown_param", unknown_param),
                         ("missing_required", missing_required)):
        broken = first(change)
        if broken:
            out[kind] = broken
    for turn, held in sorted(task["missed_function"].items(), key=lambda kv: int(kv[0])):
        names = {h["name"] for h in held}
        later = [c for calls in gt[int(turn):] for c in calls if c["name"] in names]
        if later and int(turn) > 0:
            out["early_held_out"] = [c + later[:1] if u == int(turn) - 1 else c for u, c in enumerate(gt)]
            break
    return out


def _with_changed_argument(task, gt, order):
    """(turn, calls) with one argument value changed, for the first changeable call of `order`'s turns."""
    for t in order:
        tools = {x["name"]: x for x in bfcl.tools_at(task, t)}
        for i, call in enumerate(gt[t]):
            props = tools.get(call["name"], {}).get("parameters", {}).get("properties", {})
            for key, value in call["arguments"].items():
                new = changed_value(value, props.get(key, {}))
                if new is not None:
                    changed = {"name": call["name"], "arguments": {**call["arguments"], key: new}}
                    yield t, gt[t][:i] + [changed] + gt[t][i + 1 :]
