"""Rollout records built by really playing model texts through bfcl.Environment.

Shared by tests/test_taxonomy.py, tests/test_diagnose.py and bench/diagnose_bench.py:
calls, parse errors, results, call_errors and schema_errors in these records are
what the environment produced, not made up. `perturbations()` derives the
systematic perturbed set from a task's ground truth; `bfcl_eval_decoded()` gives
what bfcl-eval's own pipeline would hand its checker for the same model texts, by
its own decoder code (`bfcl_eval_decode`).
"""

import ast
import importlib.util
import json
import re
import types
import zlib
from typing import Any

from common import bfcl
from common import calls as C
from common.engines import Generation

ANSWER = "Done."  # the plain answer that ends a turn (json format: no call, no parse error)
GARBAGE = '<tool_call>\n{"name": "cd", "arguments": {"folder": \n</tool_call>'  # does not parse


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


def _installed(module, names, cls=None):
    """bfcl-eval's own functions, compiled from its installed source file (importing their modules
    needs tree_sitter and tenacity, which are not installed; these functions use neither)."""
    from bfcl_eval.constants.enums import ReturnFormat  # after common.bfcl, which sets BFCL_PROJECT_ROOT

    path = importlib.util.find_spec(module).origin
    with open(path) as f:
        body = ast.parse(f.read()).body
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    defs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(d.name for d in defs) == sorted(names), f"{module} changed: {names}"
    for d in defs:
        d.decorator_list = []  # @override, @staticmethod: called as plain functions below
    namespace = {"ast": ast, "json": json, "re": re, "ReturnFormat": ReturnFormat, "Any": Any}
    exec(compile(ast.Module(defs, type_ignores=[]), path, "exec"), namespace)  # noqa: S102 (bfcl-eval's code)
    return namespace


_QWEN = _installed("bfcl_eval.model_handler.local_inference.qwen_fc",
                   ["_parse_query_response_prompting", "decode_execute", "_extract_tool_calls"], cls="QwenFCHandler")
_QWEN.update(_installed("bfcl_eval.model_handler.utils", ["convert_to_function_call"]))
_PROMPTING = _installed("bfcl_eval.model_handler.utils", [
    "default_decode_execute_prompting", "ast_parse", "resolve_ast_call", "resolve_ast_by_type",
    "parse_nested_value", "decoded_output_to_execution_list"])


def bfcl_eval_decode(text, fmt="json"):
    """The raw call strings bfcl-eval's decoder hands its executor for one model output, by its own
    code: QwenFCHandler (response parsing, then decode_execute) for "json", OSSHandler's
    default_decode_execute_prompting for "python". Raises where that code raises (a decode failure)."""
    if fmt == "python":
        return _PROMPTING["default_decode_execute_prompting"](text)
    handler = types.SimpleNamespace(_extract_tool_calls=_QWEN["_extract_tool_calls"])
    response = types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)],
                                     usage=types.SimpleNamespace(prompt_tokens=0, completion_tokens=0))
    parsed = _QWEN["_parse_query_response_prompting"](handler, response)
    return _QWEN["decode_execute"](handler, parsed["model_responses"], False)


def bfcl_eval_decoded(record):
    """Per turn, per step with calls: the raw strings bfcl-eval would check for this record's texts."""
    turns = []
    for turn in record["turns"]:
        steps = [_decoded_or_nothing(step["text"]) for step in turn["steps"]]
        turns.append([s for s in steps if s])
    return turns


def _decoded_or_nothing(text):
    try:
        return bfcl_eval_decode(text)
    except Exception:  # noqa: BLE001 (a decode failure: bfcl-eval runs nothing for this output)
        return []


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


class Scripted:
    """A policy that writes `script(prompt_ids)`; real tokenizer, no model."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.stop_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, max_new_tokens, temperature):
        out = []
        for p, limit in zip(prompts, max_new_tokens, strict=True):
            ids = self.tokenizer(self.script(p), add_special_tokens=False)["input_ids"][: limit - 1]
            ids.append(self.tokenizer.eos_token_id)
            out.append(Generation(ids=ids, logprobs=[-0.5] * len(ids), finish="stop"))
        return out
