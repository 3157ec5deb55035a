"""The real BFCL multi-turn world: tasks, executable environment, official checker: bfcl-eval's executor and
`multi_turn_checker` with the isolation they lack (unique instance caches, private long_context data, rendered
literal calls only, a deadline on every execution): docs/design.md §2.
"""

import contextlib
import copy
import functools
import importlib
import inspect
import itertools
import json
import os
import re
import signal
import tempfile
import threading

# Importing bfcl_eval.constants creates result folders under BFCL_PROJECT_ROOT (site-packages by default)
os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "seal-bfcl"))

from bfcl_eval.constants.default_prompts import (  # noqa: E402
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING as NEW_TOOLS_TEMPLATE,
)
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as _checker  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as _utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context as _long  # noqa: E402

from common.engine import calls as C  # noqa: E402
from common.jsonl import RecordError, read_jsonl  # noqa: E402

CATEGORIES = ["base", "miss_func", "miss_param", "long_context"]
TASK_FIELDS = ["id", "category", "questions", "initial_config", "involved_classes", "tools",
               "missed_function", "long_context", "ground_truth"]
EXEC_ERROR_PREFIX = C.EXEC_ERROR_PREFIX
EXEC_DEADLINE_S = 2.0  # for one batch of calls; real tool calls take milliseconds
MEMORY_DEADLINE_S = 60.0  # BFCL V4 memory_vector embeds on the CPU: seconds on a busy machine
DENY_LIST = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")  # the executor refuses these unrun
# what the checker gets for a refused call: refused unrun, the step keeps its place and an error result
REFUSED_STAND_IN = "kill()"

_PRISTINE_LONG = {k: copy.deepcopy(v) for k, v in vars(_long).items() if k.isupper() and isinstance(v, (dict, list))}
_counter = itertools.count()


def load_tasks(path):
    """Task records by id, in file order."""
    tasks = {}
    for rec in read_jsonl(path, required=TASK_FIELDS):
        if rec["category"] not in CATEGORIES:
            raise RecordError(f"{path}:{rec['_line']}: unknown category {rec['category']!r}")
        if len(rec["ground_truth"]) != len(rec["questions"]):
            raise RecordError(f"{path}:{rec['_line']}: {len(rec['questions'])} turns but "
                              f"{len(rec['ground_truth'])} ground-truth turns")
        rec.pop("_line")
        tasks[rec["id"]] = rec
    return tasks


@contextlib.contextmanager
def deadline(seconds=EXEC_DEADLINE_S):
    """TimeoutError inside the block after `seconds` (main thread only: SIGALRM): an error result, as bfcl-eval's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def overrun(*_):
        raise TimeoutError(f"tool call exceeded {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, overrun)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_bare_execute = _utils.execute_multi_turn_func_call


def execute(*args, seconds=EXEC_DEADLINE_S, **kwargs):
    """bfcl-eval's execute_multi_turn_func_call, under a deadline of `seconds`."""
    with deadline(seconds):
        return _bare_execute(*args, **kwargs)


# the checker calls the executor it imported: its executions under the deadline too
_checker.execute_multi_turn_func_call = execute


@functools.cache
def _public_methods(class_name):
    """{method: [parameter names]} as the executor maps them: an instance's public methods."""
    cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
    return {name: list(inspect.signature(m).parameters)
            for name, m in inspect.getmembers(cls(), predicate=inspect.ismethod) if not name.startswith("_")}


def methods(involved_classes):
    """{name: [parameter names]} the executor dispatches for these classes (a later class wins), minus DENY_LIST."""
    return {name: params for cls in involved_classes for name, params in _public_methods(cls).items()
            if name not in DENY_LIST}


def to_executor(call, dispatchable):
    """(call string, None) for a call the executor would dispatch, else (REFUSED_STAND_IN, error result)."""
    name = call["name"]
    if name in DENY_LIST:
        return REFUSED_STAND_IN, f"{EXEC_ERROR_PREFIX} Function call {name} is not allowed."
    if name not in dispatchable:
        shown = name if len(name) <= 80 else name[:77] + "..."
        return REFUSED_STAND_IN, f"{EXEC_ERROR_PREFIX} name {shown!r} is not defined"
    try:
        return C.render(call), None
    except C.CallError as e:
        return REFUSED_STAND_IN, f"{EXEC_ERROR_PREFIX} {e}"


def first_per_category(tasks, k):
    """The first `k` tasks of each category, categories in the usual order (a small, balanced subset)."""
    return [t for cat in CATEGORIES for t in [x for x in tasks if x["category"] == cat][:k]]


def unique_name(prefix="seal"):
    """A per-process unique instance-name prefix; bfcl-eval keys its cache by it."""
    return f"{prefix}_{os.getpid()}_{next(_counter)}"


def _forget(name):
    """Drop the executor's cached instances whose key starts with `name`."""
    cache = vars(_utils)
    for key in [k for k in cache if k.startswith(name + "_") and k.endswith("_instance")]:
        del cache[key]


@contextlib.contextmanager
def checker_run(prefix, long_context):
    """A unique model name for one checker run; its cached instances and the shared data cleaned up after."""
    name = unique_name(prefix)
    try:
        yield name
    finally:
        _forget(name)  # the model's instances and the ground truth's (name + "_ground_truth")
        if long_context:  # only long-context scenarios touch the shared data
            restore_shared_data()


def restore_shared_data():
    """Undo mutations of long_context's module-level data, in place (others hold references)."""
    for key, pristine in _PRISTINE_LONG.items():
        live = getattr(_long, key)
        if live != pristine:
            live.clear()
            if isinstance(live, dict):
                live.update(copy.deepcopy(pristine))
            else:
                live.extend(copy.deepcopy(pristine))


def tools_at(task, turn):
    """The tool schemas available at `turn`: held-out tools join at their turn (miss_func)."""
    held_out = sorted(task["missed_function"].items(), key=lambda kv: int(kv[0]))
    return task["tools"] + [tool for t, extra in held_out if int(t) <= turn for tool in extra]


def turn_messages(task, turn, new_tools=None):
    """The user messages of `turn`; a held-out turn announces its tools (`new_tools`: as shown) as bfcl-eval's."""
    msgs = task["questions"][turn]
    if not msgs and str(turn) in task["missed_function"]:
        docs = new_tools if new_tools is not None else task["missed_function"][str(turn)]
        text = NEW_TOOLS_TEMPLATE.format(functions=json.dumps(docs, ensure_ascii=False))
        return [{"role": "user", "content": text}]
    return msgs


def is_error_result(result):
    """Whether a tool result reports failure (an exception or an {"error": ...} payload)."""
    return C.result_error(result) is not None


class Environment:
    """One trajectory's executable world for one task: start_turn(t), step(text, fmt), decoded."""

    def __init__(self, task):
        self.task, self.n_turns = task, len(task["questions"])
        self.name = unique_name()
        self.tools = []
        self.methods = methods(task["involved_classes"])
        self.decoded = []  # what the checker gets: per turn, per step with calls, rendered strings
        self.memory = None
        if any(cls.startswith("MemoryAPI_") for cls in task["involved_classes"]):
            # BFCL V4 memory, as bfcl-eval's harness: the snapshot loaded before the first turn (no deadline:
            # the vector backend re-embeds it), written back when a prerequisite conversation ends
            _, instances = _bare_execute([], task["initial_config"], task["involved_classes"], self.name, task["id"])
            self.memory = next(iter(instances.values()))
        if task["long_context"]:
            # long-context instances share module-level scenario data: private copies for this trajectory
            _, instances = self._execute([])
            for inst in instances.values():
                inst.__dict__.update(copy.deepcopy(inst.__dict__))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.memory is not None and "prereq" in self.task["id"]:  # bfcl-eval's is_memory_prereq
            self.memory._flush_memory_to_local_file()
        self.memory = None
        _forget(self.name)

    def start_turn(self, turn):
        """Enter `turn`; returns the tool schemas that became available with it."""
        before = {t["name"] for t in self.tools}
        self.tools = tools_at(self.task, turn)
        self.decoded.append([])
        return [t for t in self.tools if t["name"] not in before] if turn > 0 else []

    def user_messages(self, turn):
        return turn_messages(self.task, turn)

    def step(self, text, fmt):
        """Parse one model output and run its calls: the step record's fields."""
        calls, parse_error = C.parse(text, fmt)
        results, call_errors = self.run_calls(calls)
        return {"calls": calls, "parse_error": parse_error, "results": results, "call_errors": call_errors,
                "schema_errors": [C.validate(call, self.tools) for call in calls]}

    def run_calls(self, calls):
        """(results, errors) of parsed calls run in order (a refused call: its refusal as both)."""
        if not calls:
            return [], []
        strings, refusals = zip(*(to_executor(call, self.methods) for call in calls), strict=True)
        out, _ = self._execute(list(strings))
        results = [refusal or res for refusal, res in zip(refusals, out, strict=True)]
        self.decoded[-1].append(list(strings))
        return results, [r if is_error_result(r) else None for r in results]

    def _execute(self, call_strings):
        return execute(call_strings, self.task["initial_config"], self.task["involved_classes"], self.name,
                       self.task["id"], long_context=self.task["long_context"],
                       seconds=MEMORY_DEADLINE_S if self.memory is not None else EXEC_DEADLINE_S)


def play_texts(task, texts_per_turn, fmt):
    """Fixed outputs per turn through the same path as a model's (parsed, rendered, run): (decoded, turns)."""
    turns = []
    with Environment(task) as env:
        for turn, texts in enumerate(texts_per_turn):
            env.start_turn(turn)
            turns.append({"steps": [{"text": t, **env.step(t, fmt), "feedback": None} for t in texts],
                          "end": "answer"})
        return env.decoded, turns


def official_verdict(task, decoded):
    """{"valid", "error_type", "turn"}: multi_turn_checker's verdict on per-turn, per-step call strings."""
    gt = task["ground_truth"]
    if len(decoded) != len(gt):
        return {"valid": False, "error_type": "multi_turn:force_terminated", "turn": len(decoded)}
    # the checker derives long_context from the id, as bfcl-eval's runner does
    entry = {"id": task["id"], "initial_config": task["initial_config"], "involved_classes": task["involved_classes"]}
    with checker_run("check", task["long_context"]) as name:
        res = _checker.multi_turn_checker(decoded, gt, entry, "multi_turn", name)
    if res["valid"]:
        return {"valid": True, "error_type": None, "turn": None}
    return {"valid": False, "error_type": res["error_type"], "turn": _failing_turn(res)}


def _failing_turn(res):
    m = re.search(r"turn (\d+)", res.get("error_message", ""))
    if m:
        return int(m.group(1))
    executed = res.get("execution_result") or res.get("details", {}).get("execution_result")
    return len(executed) - 1 if executed else None


def ground_truth_calls(task, turn):
    """The ground-truth calls of `turn` parsed like model output (positional args bound as Python binds them)."""
    calls = []
    for s in task["ground_truth"][turn]:
        parsed, err = C.parse_ground_truth(s, methods(task["involved_classes"]))
        if err:
            raise RecordError(f"task {task['id']}: ground truth {s!r} does not parse: {err}")
        calls.extend(parsed)
    return calls
