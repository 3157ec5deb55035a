"""Ψ's rules on BFCL turns (docs/design.md §4; common/seal/taxonomy.py holds the labels and their order).
Evidence is gathered by common/envs/bfcl/replay.py into a `Turn`; tests/test_taxonomy.py tests each rule.
"""

from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import replay
from common.seal import taxonomy
from common.seal.taxonomy import arg_diff, invalid_tool_call, line, profile, show


def abstention_rule(turn):
    """Ground truth empty: `correct_abstention` if the model made no call (parsed, run or refused) in the
    turn, else `invalid_tool_call`; an unparsable output alone is not a call (it may be a plain answer)."""
    if turn.calls:
        return "invalid_tool_call", f"called {show(turn.calls[0])} on an abstention turn"
    return "correct_abstention", "no call on an abstention turn" if turn.played else "not played (trajectory stopped)"


def passes(turn):
    """Ground truth not empty: `pass` when the model made a call in the turn (so the checker checks it) and
    the official state and response checks both hold after it; earlier bad outputs do not matter."""
    if turn.calls and turn.state["valid"] and turn.response["valid"]:
        bad = len(turn.parse_errors) + len(turn.schema_errors)
        note = f", after {bad} bad output(s)" if bad else ""
        return f"state and response match ({len(turn.calls)} call(s){note})"
    return None


def argument_mismatch(turn):
    """For a function f of the ground truth, some ground-truth argument set of f was never used and some
    model call of f has values of no ground-truth call (docs/design.md §4). Matching is by value, not one to
    one: call counts and order are left to the state and response checks, so a dropped second call or a
    wrong call corrected later is no mismatch. The evidence compares the first unmatched ground-truth call
    with the unmatched model call of f that agrees with it on the most arguments."""
    made, wanted = {}, {}
    for calls, by_name in ((turn.calls, made), (turn.gt_calls, wanted)):
        for call in calls:
            by_name.setdefault(call["name"], []).append(_args(call, turn.tools))
    for name, gts in wanted.items():
        unmatched_gt = [a for a in gts if a not in made.get(name, [])]
        unmatched_model = [a for a in made.get(name, []) if a not in gts]
        if unmatched_gt and unmatched_model:
            want = unmatched_gt[0]
            closest = max(unmatched_model, key=lambda a: sum(k in a and a[k] == v for k, v in want.items()))
            return f"{name}: {arg_diff(closest, want)}"
    return None


def state_mismatch(turn):
    """The model made calls and the official state_checker fails (cumulative: earlier turns count too)."""
    if turn.calls and not turn.state["valid"]:
        cls = turn.state["error_message"].split("Model instance for ", 1)[-1].split(" ", 1)[0]
        return f"state differs from ground truth: {cls} {', '.join(turn.state['details']['differences'])}"
    return None


def recovery_failure(turn):
    """The turn's last call failed (bfcl.is_error_result on its replayed result: an error or a refusal)."""
    if turn.results and bfcl.is_error_result(turn.results[-1]):
        return f"last call failed: {show(turn.calls[-1])} -> {turn.results[-1]}"
    return None


def missing_tool_call(turn):
    """No call in the turn (a turn never played included), or a function of the ground truth never called."""
    if not turn.played:
        return "not played (trajectory stopped)"
    if not turn.calls:
        return "no call in the turn"
    missing = sorted({c["name"] for c in turn.gt_calls} - {c["name"] for c in turn.calls})
    if missing:
        return f"never called {', '.join(missing)}"
    return None


def response_mismatch(turn):
    """The official response_checker fails: some ground-truth result of the turn is not among all the
    model's results so far (unordered, counting duplicates)."""
    if turn.calls and not turn.response["valid"]:
        missing = turn.response["details"]["missing_items"]
        return f"{len(missing)} ground-truth result(s) missing, e.g. {missing[0]!r}"
    return None


FAILURE_RULES = {  # by label; taxonomy.label tries them in its priority order
    "invalid_tool_call": invalid_tool_call,
    "argument_mismatch": argument_mismatch,
    "state_mismatch": state_mismatch,
    "recovery_failure": recovery_failure,
    "missing_tool_call": missing_tool_call,
    "response_mismatch": response_mismatch,
}


def label_turn(turn):
    """(label, evidence) for one replayed turn."""
    if not turn.gt:
        label, evidence = abstention_rule(turn)
        return label, line(evidence)
    evidence = passes(turn) if turn.played else None
    if evidence:
        return "pass", line(evidence)
    # a failing turn made no call (missing_tool_call) or failed the state or the response check
    return taxonomy.label(turn, FAILURE_RULES)


def diagnose(task, rollout):
    """The diagnosis record of one rollout record (docs/design.md §3) against its task; RecordError when the
    record's turns are not a rollout's."""
    turns = replay.read_turns(task, rollout["turns"])
    official = replay.replay(task, turns)  # reward parity with bfcl.official_verdict: tests/test_diagnose.py
    labelled = [label_turn(t) for t in turns]
    labels = [z for z, _ in labelled]
    return {"task_id": task["id"], "category": task["category"], "sample_index": rollout["sample_index"],
            "round": rollout["round"], "reward": int(official["valid"]), "official": official,
            "turn_labels": labels, "evidence": [e for _, e in labelled], "profile": profile(labels)}


def _args(call, tools):
    """A call's arguments completed with its schema's defaults (a default of 'None' means absent)."""
    schema = next((t for t in tools if t["name"] == call["name"]), None)
    args = dict(call["arguments"])
    for key, prop in (schema["parameters"].get("properties", {}) if schema else {}).items():
        if key not in args and "default" in prop and prop["default"] != "None":
            args[key] = prop["default"]
    return args
