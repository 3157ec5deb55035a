"""Replay a trajectory against the ground truth turn by turn with bfcl-eval's own checks: multi_turn_checker's
loop without its early return, so every turn keeps its outcome and the first failure is the official verdict.
What to replay is re-derived from the untrusted records through the environment's own gate (docs/design.md §3).
"""

import functools
from dataclasses import dataclass, field

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as _checker
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as _utils

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl
from common.jsonl import RecordError


@dataclass
class Turn:
    """The executable evidence of one ground-truth user turn."""
    index: int
    gt: list  # ground-truth call strings of the turn (what the checker executes)
    tools: list  # schemas available at this turn
    played: bool = True  # False: the trajectory stopped before this turn
    parse_errors: list = field(default_factory=list)  # per unparsable output: the parser's reason
    schema_errors: list = field(default_factory=list)  # (call, reason) for calls that broke the listed schemas
    calls: list = field(default_factory=list)  # every parsed call, in order (run or refused)
    decoded: list = field(default_factory=list)  # per step with calls: what the checker executes
    results: list = field(default_factory=list)  # replayed result per call (a refused call's is an error)
    state: dict | None = None  # official state_checker result after the turn (None: not checked)
    response: dict | None = None  # official response_checker result (None: not checked)
    failure: str | None = None  # the error type the official checker would stop with here
    task: dict = field(default=None, repr=False)

    @functools.cached_property
    def gt_calls(self):
        """The ground-truth calls parsed like model output; parsed on first use (failing turns only)."""
        return bfcl.ground_truth_calls(self.task, self.index)


def read_turns(task, rollout_turns):
    """One Turn per ground-truth turn from a rollout record's `turns` (their `calls` and `parse_error` only)."""
    n = len(task["ground_truth"])
    if not isinstance(rollout_turns, list) or len(rollout_turns) > n:
        raise RecordError(f"turns must be a list of at most {n} turns (the task's), "
                          f"got {len(rollout_turns) if isinstance(rollout_turns, list) else type(rollout_turns).__name__}")
    turns = [Turn(t, gt, bfcl.tools_at(task, t), played=t < len(rollout_turns), task=task)
             for t, gt in enumerate(task["ground_truth"])]
    dispatchable = bfcl.methods(task["involved_classes"])
    for turn, record in zip(turns, rollout_turns, strict=False):  # the played turns
        _read_steps(turn, record, dispatchable)
    return turns


def _read_steps(turn, record, dispatchable):
    if not isinstance(record, dict) or not isinstance(record.get("steps"), list):
        raise RecordError(f"turn {turn.index}: expected an object with a 'steps' list")
    for s, step in enumerate(record["steps"]):
        where = f"turn {turn.index} step {s}"
        if not isinstance(step, dict) or "calls" not in step or "parse_error" not in step:
            raise RecordError(f"{where}: expected an object with 'calls' and 'parse_error'")
        if step["parse_error"] is not None:
            if not isinstance(step["parse_error"], str):
                raise RecordError(f"{where}: parse_error must be null or a string")
            turn.parse_errors.append(step["parse_error"])
        if not isinstance(step["calls"], list):
            raise RecordError(f"{where}: calls must be a list")
        strings = []
        for call in step["calls"]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
                raise RecordError(f"{where}: a call must be an object with a 'name' string and an 'arguments' object")
            call = {"name": call["name"], "arguments": call["arguments"]}
            strings.append(bfcl.to_executor(call, dispatchable)[0])  # the gate of bfcl.Environment.run_calls
            turn.calls.append(call)
            reason = C.validate(call, turn.tools)
            if reason:
                turn.schema_errors.append((call, reason))
        if strings:
            turn.decoded.append(strings)


def replay(task, turns):
    """Run the turns as multi_turn_checker does, never stopping: each turn's outcome; the official verdict."""
    # The checker derives long_context from the id, not from the task record.
    category = task["id"].rsplit("_", 1)[0]
    long_context = "long_context" in category or "composite" in category

    def execute(call_strings, who):
        # bfcl.execute: the official executor under a deadline (a schema-valid call can hang)
        return bfcl.execute(call_strings, task["initial_config"], task["involved_classes"], who, task["id"],
                            long_context=long_context, is_evaL_run=True)

    model_results = []  # all model results so far: the response check reads every turn's
    with bfcl.checker_run("replay", long_context) as name:
        for turn in turns:
            if not turn.played:
                break  # nothing to execute; the verdict is force_terminated below
            model_instances = {}
            for step in turn.decoded:
                results, model_instances = execute(step, name)
                turn.results.extend(results)
            gt_results, gt_instances = execute(turn.gt, name + "_ground_truth")
            model_results.extend(turn.results)
            if not turn.gt:
                continue  # the checker does not check abstention turns
            if _utils.is_empty_execute_response(turn.decoded):
                turn.failure = "multi_turn:empty_turn_model_response"
                continue
            turn.state = _checker.state_checker(model_instances, gt_instances)
            turn.response = _checker.response_checker(list(model_results), gt_results, turn.index)
            for check in (turn.state, turn.response):
                if not check["valid"]:
                    turn.failure = check["error_type"]
                    break

    played = sum(t.played for t in turns)
    if played < len(turns):
        return {"valid": False, "error_type": "multi_turn:force_terminated", "turn": played}
    for turn in turns:
        if turn.failure:
            return {"valid": False, "error_type": turn.failure, "turn": turn.index}
    return {"valid": True, "error_type": None, "turn": None}
