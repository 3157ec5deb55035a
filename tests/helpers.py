"""What the tests share (and bench/diagnose_bench.py and bench/interface_cost.py with them): one module,
so that no test module imports another.

- Rollout records built by really playing model texts through bfcl.Environment: calls, parse
  errors, results, call_errors and schema_errors in these records are what the environment
  produced, not made up. `perturbations()` derives the systematic perturbed set from a task's
  ground truth; `bfcl_eval_decoded()` gives what bfcl-eval's own pipeline would hand its checker
  for the same model texts, by its own decoder code (`bfcl_eval_decode`).
- Scripted engines (`Scripted`, `Script`) and bfcl-eval's own multi-turn loop replaying their
  texts (`theirs`), for prompt parity.
- `in_process`: train_grpo.py as its main() in the test process.
- The viewer's synthetic run (`synthetic_run`) and headless Chromium reading the page it rendered
  (`browse`, `rows`, `view`, `data`; `check_tiny_runs` for tests/test_loop.py's tiny runs).
- The cue leakage audit (`audit`): no cue of Ω may reveal a ground-truth value (docs/design.md §5);
  a test oracle, which the stages never run.
"""

import ast
import contextlib
import copy
import functools
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zlib
from html.parser import HTMLParser
from typing import Any

from common.engine import calls as C
from common.engine.engines import Generation
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import prompts
from common.envs.bfcl.harness import ground_truth_calls
from common.envs.bfcl.play import HINT_RULES
from common.seal.interface import CAPABILITY_TEXT, error_hint, tool_view
from common.seal.taxonomy import LABELS, RHO

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
    from bfcl_eval.constants.enums import (
        ReturnFormat,  # after common.envs.bfcl.harness, which sets BFCL_PROJECT_ROOT
    )

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


# ----------------------------------------------------------------------------- teachers


class Teacher:
    """Writes `script(task, prompt_text)` and gives each token the policy's own log-probability."""

    def __init__(self, model, tokenizer, script):
        self.model, self.tokenizer, self.script = model, tokenizer, script
        self.stop_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, max_new_tokens, temperature):
        import torch
        out = []
        for p, limit in zip(prompts, max_new_tokens, strict=True):
            tail = self.tokenizer.decode(p[-200:])
            ids = self.tokenizer(self.script(tail), add_special_tokens=False)["input_ids"][: limit - 1]
            ids.append(self.tokenizer.eos_token_id)
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()
            out.append(Generation(ids=ids, logprobs=lp, finish="stop"))
        return out


def seq_logprob(model, rec):
    """Sum of log p(token) over the model-generated tokens of a rollout record."""
    import torch
    toks = rec["tokens"]
    x = torch.tensor([toks["prompt_ids"] + toks["ids"]])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(toks["prompt_ids"]) - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks["ids"])[:, None]).squeeze(1)
    return float((lp * torch.tensor(toks["mask"], dtype=torch.float32)).sum())


# ----------------------------------------------------------------------------- prompt parity

_names = itertools.count()


class Script(Scripted):
    """Writes the texts `script(task_id, turn, step)` gives for the one trajectory it plays."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, lambda prompt: script(self.traj.task["id"], len(self.traj.turns) - 1,
                                                          len(self.traj.turns[-1]["steps"])))
        self.traj = None


def theirs(entry, texts, handler="QwenFCHandler"):
    """The prompts bfcl-eval's multi-turn loop formats when the model answers `texts` in order,
    and the exception it raises, if any (an inference error: the entry fails as a whole)."""
    seen, answers = [], iter(texts)
    name = f"parity_{next(_names)}"
    # bfcl-eval's handler, a copy per replay (a new one would build an API client it never uses)
    h = copy.copy(prompts.handler(handler))
    h.registry_name = h.registry_dir_name = name
    h.model_name_underline_replaced = name  # its executor's instance-cache key: one per replay

    def query(inference_data):  # the model's side of _query_prompting: the recorded answer
        seen.append(h._format_prompt(inference_data["message"], inference_data["function"]))
        return prompts.response(next(answers)), 0.0
    h._query_prompting = query
    error = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            h.inference_multi_turn_prompting(json.loads(json.dumps(entry)), include_input_log=False,
                                             exclude_state_log=True)
    except Exception as e:  # bfcl-eval's runner records it as the entry's result
        error = e
    finally:
        bfcl.restore_shared_data()  # its executor mutates long_context's module data
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        for k in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
            delattr(multi_turn_utils, k)
    return seen, error


# ----------------------------------------------------------------------------- train_grpo.py in process


def train_one_round(model, records, diagnoses, folder):
    """train_grpo.py (in this process) on `records` and `diagnoses` with Ω_0, lr 1e-4 and no KL, one
    task a mini-batch; asserts it ran and returns its train_metrics.jsonl lines."""
    from common.jsonl import write_json, write_jsonl
    from common.seal import interface as omega_api

    write_jsonl(folder / "rollouts.jsonl", records)
    write_jsonl(folder / "diagnoses.jsonl", diagnoses)
    write_json(folder / "interface.json", omega_api.initial())
    res = in_process(["--model", str(model), "--rollouts", str(folder / "rollouts.jsonl"),
                      "--diagnoses", str(folder / "diagnoses.jsonl"), "--interface", str(folder / "interface.json"),
                      "--lr", "1e-4", "--kl-coef", "0", "--mini-batch-tasks", "1", "--cpu",
                      "--out", str(folder / "policy")])
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in open(folder / "train_metrics.jsonl")]


def in_process(argv):
    """`python train_grpo.py ARGV` as its main() in this process: exit status, stdout and stderr
    as the command gives them. A fresh process spends ~13 s importing torch and transformers,
    most of a one-process round here; the single-process runs share this one. Accelerate's
    state is reset around each run, and torch uses one thread, as ENV gives launched processes."""
    import io

    import torch
    from accelerate.state import AcceleratorState

    import train_grpo

    out, err, code = io.StringIO(), io.StringIO(), 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                train_grpo.main(argv)
            except SystemExit as e:  # as the interpreter reports it: a message goes to stderr, status 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = 1 if isinstance(e.code, str) else e.code or 0
    finally:
        AcceleratorState._reset_state(True)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["train_grpo.py", *argv], code, out.getvalue(), err.getvalue())


# ----------------------------------------------------------------------------- the cue leakage audit

# The cues may name schema facts and state the agent has already seen, never a
# ground-truth value (docs/design.md §5). `audit` checks that on one task, for every error
# case the hint rules cover, built from the task's ground-truth calls.
#
# A *literal* of a task is a value in its ground-truth call arguments (all turns),
# as text: every string (and every dictionary key) of at least 3 characters, and
# every number with |x| >= 10 (a float also as its integer text when it is whole);
# booleans, None, shorter strings and single digits are ignored (they occur in any
# text). A literal *occurs* in a text case-insensitively as a substring; a number
# only where no digit or '.' touches it on either side (10 is not in 100 or 2.10).
# A cue *leaks* a literal when the literal occurs in the cue but not in what the
# agent has seen by then: the questions of the turns so far, the schemas of the
# tools available at the turn (plain JSON), and the results of the ground-truth
# calls executed before the case. The error message itself does not count as
# seen, so a hint that merely echoed the error's values would be caught too.

AUDIT_STRING = "seal_missing_zz"  # wrong values that cannot be a task's ground truth
AUDIT_INT = 987654321
AUDIT_EXEC_INT = 404  # executed: small, since MathAPI takes an int as its precision (10**9 digits never ends)
# Execution errors as the tools phrase them, each filled with every literal of the task:
# whatever value an error carries, the hint must not repeat it.
AUDIT_ENV_TEMPLATES = [
    "cd: '{v}': No such file or directory", "mv: cannot move '{v}': No such file or directory",
    "touch: cannot touch '{v}': File exists", "Ticket with ID {v} not found.", "Stock with symbol '{v}' not found.",
    "Receiver ID '{v}' not found.", "User '{v}' not found in the workspace.", "Invalid departure airport code: {v}",
    "Booking not found", "Card not registered", "No user is currently logged in.", "Token expired",
    "User not authenticated. Please log in to place an order.", "Insufficient funds",
    "Balance is less than budget limit", "Must press the brake fully before starting the engine.",
]


def literals(value):
    """The literal texts in one ground-truth argument value (see the rule above)."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, str):
        return [value] if len(value.strip()) >= 3 else []
    if isinstance(value, (int, float)):
        if abs(value) < 10:
            return []
        texts = [str(value)]
        if isinstance(value, float) and value.is_integer():
            texts.append(str(int(value)))
        return texts
    if isinstance(value, list):
        return [t for v in value for t in literals(v)]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in literals(k) + literals(v)]
    return []


def occurs(literal, text_lower):
    number = _number_pattern(literal)
    if number:
        return number.search(text_lower) is not None
    return literal.lower() in text_lower


@functools.lru_cache(maxsize=4096)
def _number_pattern(literal):
    if re.fullmatch(r"-?\d+(\.\d+)?", literal):
        return re.compile(rf"(?<![\d.]){re.escape(literal)}(?![\d])")
    return None


def leaks(cue, task_literals, seen_lower):
    """The literals `cue` reveals that the agent has not seen."""
    cue_lower = cue.lower()
    return sorted({x for x in task_literals if occurs(x, cue_lower) and not occurs(x, seen_lower)})


def audit(task, omega):
    """Every cue Ω would show on this task's error cases, with its leaks.

    Returns dicts {"turn", "case", "error", "cue", "leaks"}; "cue" is None where no
    rule applies. Cases, per ground-truth call with the tools of its turn: unknown
    tool, unknown parameter, each argument removed (a case where it is required),
    each argument given a value of the wrong type, each enum argument given a value
    outside the enum, three unparsable outputs (broken JSON, unclosed block, broken
    Python) and one non-literal argument; then real execution errors: the call with
    every string/number argument replaced by a missing name/ID, run in a sandbox
    environment that follows the ground truth, and every ground-truth call that
    itself fails; then AUDIT_ENV_TEMPLATES filled with each literal; plus the
    schema cue's annotations and every capability line.
    """
    from common.envs.bfcl import harness as bfcl  # bfcl-eval is only needed for the audit

    task_literals = sorted({x for t in range(len(task["questions"])) for c in bfcl.ground_truth_calls(task, t)
                            for v in c["arguments"].values() for x in literals(v)})
    out = []
    seen = []  # texts the agent has seen so far
    seen_lower = {}  # len(seen) -> their joined lower-case text

    def check(turn, case, error, cue):
        found = []
        if cue and any(occurs(x, cue.lower()) for x in task_literals):
            if len(seen) not in seen_lower:
                seen_lower.clear()
                seen_lower[len(seen)] = "\n".join(seen).lower()
            found = leaks(cue, task_literals, seen_lower[len(seen)])
        out.append({"turn": turn, "case": case, "error": error, "cue": cue, "leaks": found})

    with bfcl.Environment(task) as env, bfcl.Environment(task) as sandbox:
        for turn in range(len(task["questions"])):
            env.start_turn(turn)
            sandbox.start_turn(turn)
            tools = env.tools
            seen += [m["content"] for m in task["questions"][turn]] + [json.dumps(t) for t in tools]
            before = {t["name"] for t in bfcl.tools_at(task, turn - 1)} if turn else set()
            for tool in tool_view([t for t in tools if t["name"] not in before], omega):  # as they appear
                for name, prop in tool["parameters"].get("properties", {}).items():
                    check(turn, "schema_cue", name, prop.get("description", ""))
            if turn == 0:
                for text in CAPABILITY_TEXT.values():
                    check(turn, "capability_cue", None, text)

            for call in bfcl.ground_truth_calls(task, turn):
                for case, error in _call_errors(call, tools):
                    check(turn, case, error, error_hint(error, tools, omega, HINT_RULES))
                wrong = {k: _missing_value(v) for k, v in call["arguments"].items()}
                if wrong != call["arguments"]:
                    _, errors = sandbox.run_calls([{"name": call["name"], "arguments": wrong}])
                    if errors[0]:
                        check(turn, "exec_wrong_value", errors[0], error_hint(errors[0], tools, omega, HINT_RULES))
                sandbox.run_calls([call])
                results, errors = env.run_calls([call])
                if errors[0]:
                    check(turn, "exec_ground_truth", errors[0], error_hint(errors[0], tools, omega, HINT_RULES))
                seen += results
        for lit in task_literals:
            for template in AUDIT_ENV_TEMPLATES:
                error = json.dumps({"error": template.format(v=lit)})
                check(turn, "env_template", error, error_hint(error, tools, omega, HINT_RULES))
    return out


def _call_errors(call, tools):
    """(case, reason) for the schema-breaking and unparsable variants of one valid call."""
    name, args = call["name"], call["arguments"]
    props = next(t for t in tools if t["name"] == name)["parameters"].get("properties", {})
    variants = [("unknown_tool", {"name": "seal_no_such_tool", "arguments": args}),
                ("unknown_parameter", {"name": name, "arguments": {**args, "seal_extra": 1}})]
    for p in args:  # a case where p is required
        variants.append(("missing_parameter", {"name": name, "arguments": {k: v for k, v in args.items() if k != p}}))
    for p in args:
        kind = props[p].get("type", "any")
        bad = AUDIT_INT if kind == "string" else AUDIT_STRING
        variants.append(("wrong_type", {"name": name, "arguments": {**args, p: bad}}))
        item = props[p].get("items", {})
        if kind == "array" and item.get("type", "any") != "any":
            bad_item = AUDIT_INT if item["type"] == "string" else AUDIT_STRING
            variants.append(("wrong_type", {"name": name, "arguments": {**args, p: [bad_item]}}))
        enum = C.enum_values(props[p])  # BFCL writes its enums into descriptions
        if enum and kind != "array":
            variants.append(("enum_value", {"name": name, "arguments": {**args, p: AUDIT_STRING}}))
        if "enum" in item or (enum and kind == "array"):
            variants.append(("enum_value", {"name": name, "arguments": {**args, p: [AUDIT_STRING]}}))
    out = [(case, C.validate(v, tools)) for case, v in variants]
    text = json.dumps(call, ensure_ascii=False)
    for case, output, fmt in [("parse_json", f"<tool_call>\n{text[:-1]}\n</tool_call>", "json"),
                              ("parse_json", f"<tool_call>\n{text}", "json"),
                              ("parse_python", f"[{C.render(call)[:-1]}]", "python"),
                              ("parse_python", f"[{name}({next(iter(props), 'x')}=some_variable + 1)]", "python")]:
        out.append((case, C.parse(output, fmt)[1]))
    return [(case, reason) for case, reason in out if reason]


def _missing_value(value):
    if isinstance(value, str):
        return AUDIT_STRING
    if isinstance(value, int) and not isinstance(value, bool):
        return AUDIT_EXEC_INT
    if isinstance(value, float):
        return float(AUDIT_EXEC_INT)
    return value


# ---------------------------------------------------------------- the viewer: a synthetic run, a browser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "</textarea>"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---------------------------------------------------------------------------------- a synthetic run


def _rollout(task, sample, t, wrong, hostile, step_chars, segment_at=None):
    """A rollout record: each turn's ground-truth calls (one argument changed when `wrong`), then an
    answer; from turn `segment_at` on, a further token segment (a thinking model's re-rendered prompt)."""
    turns, runs, segments = [], [], []
    for k in range(len(task["questions"])):
        calls = [dict(c, arguments=dict(c["arguments"])) for c in ground_truth_calls(task, k)]
        if wrong and calls:
            key = next(iter(calls[0]["arguments"]), None)
            if key:
                calls[0]["arguments"][key] = "wrong_value"
        filler = ("x" * (step_chars - 40) + "\n") if step_chars > 40 else ""
        text = filler + "\n".join('<tool_call>\n' + json.dumps(c) + '\n</tool_call>' for c in calls)
        results = [(hostile[0] if hostile else "ok") + filler for _ in calls]
        steps = [{"text": text, "calls": calls, "parse_error": None, "results": results,
                  "call_errors": [None] * len(calls), "schema_errors": [None] * len(calls), "feedback": None},
                 {"text": "Done. " + " ".join(hostile), "calls": [], "parse_error": None, "results": [],
                  "call_errors": [], "schema_errors": [], "feedback": None}]
        turns.append({"steps": steps, "end": "answer"})
        if k == segment_at:
            segments.append({"turn": k, "prompt_ids": [1] * 500})
        (segments[-1].setdefault("runs", []) if segments else runs).extend(
            [(1, max(1, len(text) // 4)), (0, 30 + len("".join(results)) // 4), (1, 12), (0, 20)])
    tokens = [{"prompt_ids": [1] * 3000, "runs": runs}, *segments]
    for seg in tokens:
        mask = [m for m, n in seg.pop("runs") for _ in range(n)]
        seg.update(ids=[7] * len(mask), mask=mask, logprobs=[-0.5 if m else None for m in mask])
    first, *more = tokens
    return {"task_id": task["id"], "category": task["category"], "sample_index": sample, "round": t, "policy": "p",
            "interface_version": t, "turns": turns, "stop": "done", "decode_failure": "feedback",
            "tokens": first | ({"segments": more} if more else {}),
            "stats": {"gen_tokens": sum(sum(seg["mask"]) for seg in tokens), "cue_tokens": 100, "seconds": 1.0},
            "sampling": {"temperature": 1.0}}


def _diagnosis(rec, reward, label, hostile, first_pass=False):
    """`first_pass`: a failed trajectory's first turn is labelled pass (verified right), its others `label`."""
    n = len(rec["turns"])
    labels = ["pass" if reward else label] * n
    if first_pass and not reward and n > 1:
        labels[0] = "pass"
    return {"task_id": rec["task_id"], "category": rec["category"], "sample_index": rec["sample_index"],
            "round": rec["round"], "reward": reward,
            "official": {"valid": bool(reward), "error_type": None if reward else "multi_turn:instance_state_mismatch",
                         "turn": None if reward else 0},
            "turn_labels": labels, "evidence": ["ok" if reward else "wrong_value " + " ".join(hostile)] * n,
            "profile": {z: labels.count(z) / n for z in LABELS}}


def _write(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def synthetic_run(path, tasks, eval_tasks, rounds=2, n=4, step_chars=0, hostile=True, mode="seal", thinking=False):
    """Write a finished run of `rounds` rounds (each task x n samples; sample 0 of every task
    right, the others wrong in odd-numbered tasks: mixed and zero-variance groups), a held-in
    evaluation of `eval_tasks` after the last round, and the task file it names. `thinking`: each
    task's last sample re-rendered at turn 1, as a thinking model's is. mode "seal-turn": a failed
    trajectory passes its first turn and fails the others, and the train metrics carry the turn figures."""
    bad = HOSTILE if hostile else []
    os.makedirs(path, exist_ok=True)
    task_file = os.path.join(path, "tasks.jsonl")
    _write(task_file, [dict(t, questions=[[{"role": "user", "content": m["content"] + " " + " ".join(bad)}
                                           for m in q] for q in t["questions"]]) for t in tasks])
    settings = {"preset": "synthetic", "mode": mode, "rounds": str(rounds), "model": "tiny", "tasks": task_file,
                "reweight": "--no-reweight" if mode == "vanilla" else "",
                "adaptive_rho": "--adaptive-rho" if mode == "seal-adaptive" else "",
                "turn_credit": "--turn-credit" if mode == "seal-turn" else ""}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"settings": settings, "git_commit": "0" * 40}, f)
    for t in range(rounds):
        folder = os.path.join(path, f"round_{t:03d}")
        rollouts, diagnoses = [], []
        for i, task in enumerate(tasks):
            for s in range(n):
                right = s == 0 or i % 2 == 0
                rec = _rollout(task, s, t, not right, bad, step_chars, segment_at=1 if thinking and s == n - 1 else None)
                rollouts.append(rec)
                diagnoses.append(_diagnosis(rec, int(right), "argument_mismatch" if s % 2 else "invalid_tool_call", bad,
                                            first_pass=mode == "seal-turn"))
        _write(os.path.join(folder, "rollouts.jsonl"), rollouts)
        _write(os.path.join(folder, "diagnoses.jsonl"), diagnoses)
        omega = {"version": t, "round": t, "schema_cue": {"enabled": True, "required": True, "types": True, "enums": True},
                 "error_feedback": True, "capability_cues": [{"label": "argument_mismatch", "text": "Copy values. " + " ".join(bad)}],
                 "profile": {}, "rho": RHO}
        with open(os.path.join(folder, "interface.json"), "w") as f:
            json.dump(omega, f)
        turn = {"turn_w_mean": 0.9, "turn_zeroed_share": 0.25} if mode == "seal-turn" else {}
        _write(os.path.join(folder, "train_metrics.jsonl"), [{"step": 0, "global_step": 0, "w_mean": 1.2, "w_std": 0.4,
                 "zero_var_share": 0.5, "reward_mean": 0.625, "temperature": 1.0, "ref_model": None, "logprob_seconds": 1.0}]
               + ([{"step": 1, "global_step": 1, "w_mean": 1.2, "w_std": 0.4, **turn}] if turn else []))
    ev = os.path.join(path, "eval", f"round_{rounds - 1:03d}")
    plays = [dict(_rollout(task, 0, rounds - 1, i % 2 == 1, bad, step_chars), interface_version=None)
             for i, task in enumerate(eval_tasks)]
    _write(os.path.join(ev, "rollouts.jsonl"), plays)
    _write(os.path.join(ev, "results.jsonl"), [
        {"task_id": p["task_id"], "category": p["category"], "valid": i % 2 == 0,
         "error_type": None if i % 2 == 0 else "multi_turn:instance_state_mismatch", "turn": None if i % 2 == 0 else 0}
        for i, p in enumerate(plays)])
    with open(os.path.join(ev, "scores.json"), "w") as f:
        json.dump({"base": 50.0, "miss_func": 50.0, "miss_param": 50.0, "long_context": 50.0, "average": 50.0}, f)
    return path


# ---------------------------------------------------------------------------------- the browser


class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def all(self, tag=None, cls=None, **attrs):
        for c in self.children:
            if isinstance(c, Node):
                if (tag is None or c.tag == tag) and (cls is None or cls in (c.attrs.get("class") or "").split()) \
                        and all(c.attrs.get(k) == v for k, v in attrs.items()):
                    yield c
                yield from c.all(tag, cls, **attrs)


class Tree(HTMLParser):
    VOID = {"meta", "link", "img", "input", "br", "hr"}

    def __init__(self, html):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs)
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def browse(page, fragment=""):
    """The DOM headless Chromium rendered for file://page#fragment, once its scripts ran."""
    assert CHROMIUM, "no chromium on PATH: bash tests/system.sh installs Debian's chromium package"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom",
             "file://" + os.path.abspath(page) + (f"#{fragment}" if fragment else "")],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "data-ready" in out.stdout, out.stderr[-2000:]
    return Tree(out.stdout).root


def rows(dom):
    return [r for table in dom.all("table", id="trajectories") for r in table.all("tr", cls="traj")]


def view(run, *extra):
    return subprocess.run([sys.executable, "-m", "common.run.view", str(run), *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def data(page, name):
    text = open(os.path.join(os.path.dirname(page), "data", name + ".js")).read()
    return json.loads(text[len("SEAL_LOADED = "):].rstrip().rstrip(";"))


def check_tiny_runs(runs):
    """tests/test_loop.py: the viewer loop.sh rebuilt after every round of its two tiny runs."""
    for mode in ("seal", "vanilla"):
        page = runs / mode / "viewer" / "index.html"
        for t in (0, 1):
            records = [json.loads(line) for line in open(runs / mode / f"round_00{t}" / "rollouts.jsonl")]
            dom = browse(page, f"round/{t}")
            assert len(rows(dom)) == len(records)
            diag = [json.loads(line) for line in open(runs / mode / f"round_00{t}" / "diagnoses.jsonl")]
            failed = [d for d in diag if d["reward"] == 0]
            assert len(rows(browse(page, f"round/{t}?reward=0"))) == len(failed)
        d = diag[0]
        text = browse(page, f"traj/1/{d['task_id']}/{d['sample_index']}").text()
        assert ("valid" if d["official"]["valid"] else d["official"]["error_type"]) in text
        assert d["turn_labels"][0] in text
