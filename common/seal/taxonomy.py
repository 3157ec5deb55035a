"""The failure taxonomy Ψ (docs/design.md §4): one label per ground-truth user turn.

Labels come only from executable evidence, gathered by common/envs/bfcl/replay.py into a
`Turn`: the parser's and the schema validator's verdicts on the model's outputs
(re-derived, never read from the rollout), the replayed execution results (every
call bfcl-eval's executor would dispatch ran, schema or not; see common/envs/bfcl/harness.py), the
official state_checker and response_checker after the turn, and the turn's
ground-truth calls. Each label is one rule below, a small function whose
docstring is the exact rule. Reading order:

    abstention_rule       turns whose ground truth is empty
    passes                the other turns: pass, or else
    FAILURE_RULES         the first failure rule that applies, in priority order
    label_turn            applies the above to one turn
    diagnose              one diagnosis record (docs/design.md §3) per rollout record
    TAU2_FAILURE_RULES    the same labels from a τ²-bench episode's evidence (common/envs/tau2/tau2.py)

Rules return a one-line evidence string when they apply, None otherwise.
tests/test_taxonomy.py has one real-task test per rule.
"""

# bfcl-eval (common.envs.bfcl.harness, common.envs.bfcl.replay) is imported where a trajectory is labelled, not here: the
# labels and ρ are read by the trainer and bench/plan_check.py, which must run without it (a GPU
# check whose wheel install failed still measures the memory plan).

# The order other stages report labels in: the two good outcomes, then the failures by priority.
LABELS = ["pass", "correct_abstention", "invalid_tool_call", "argument_mismatch", "state_mismatch",
          "recovery_failure", "missing_tool_call", "response_mismatch"]

# Default utility ρ(z) of each label for the GRPO weight (docs/design.md §6); a file can replace it.
RHO = {
    "invalid_tool_call": 2.0,
    "correct_abstention": 1.8,
    "missing_tool_call": 1.5,
    "argument_mismatch": 1.2,
    "recovery_failure": 1.2,
    "state_mismatch": 1.0,
    "pass": 1.0,
    "response_mismatch": 0.9,
}

MAX_EVIDENCE = 200  # characters: evidence is one short line


# ----------------------------------------------------------------------------- the rules


def abstention_rule(turn):
    """Ground truth empty (the agent should not act): `correct_abstention` if the model made
    no call in the turn, else `invalid_tool_call`.

    A call is any call the parser produced, run or refused (an attempt to act
    counts). An unparsable output alone is not a call: it may be a plain answer.
    A turn never played (the trajectory stopped earlier) made no call.
    """
    if turn.calls:
        return "invalid_tool_call", f"called {_show(turn.calls[0])} on an abstention turn"
    return "correct_abstention", "no call on an abstention turn" if turn.played else "not played (trajectory stopped)"


def passes(turn):
    """Ground truth not empty: `pass` when the model made at least one call in the turn (so the
    official checker checks the turn) and the official state and response checks both hold
    after it.

    Unparsable outputs or schema-breaking calls in the turn do not matter: the
    turn recovered (or the break was harmless, as the checker sees it).
    """
    if turn.calls and turn.state["valid"] and turn.response["valid"]:
        bad = len(turn.parse_errors) + len(turn.schema_errors)
        note = f", after {bad} bad output(s)" if bad else ""
        return f"state and response match ({len(turn.calls)} call(s){note})"
    return None


def invalid_tool_call(turn):
    """Some model output in the turn did not parse into calls (its step has a parse_error),
    or a parsed call broke the schemas of the tools listed at that turn (a tool not
    listed yet or not at all, an unknown or missing required parameter, a wrong type,
    a value outside an enum). Such a call may still have run (bfcl-eval runs every
    call that names a method of the task's classes); the label records the break."""
    if turn.parse_errors:
        return f"unparsable output: {turn.parse_errors[0]}"
    if turn.schema_errors:
        call, reason = turn.schema_errors[0]
        return f"schema broken by {_show(call)}: {reason}"
    return None


def argument_mismatch(turn):
    """The model called a function f that the turn's ground truth calls, with other
    argument values: for the same f, some ground-truth call's values were never used by
    the model in the turn, and some model call's values are those of no ground-truth call.

    Values are compared per function name, as whole argument sets, both sides
    completed with the schema's defaults (so `ls()` equals `ls(a=False)`; a default
    written as the string 'None' means "absent" and is not filled in). Matching is
    by value, not one to one: how many times and in which order f was called is left
    to the state and response checks, so a dropped second call with values of its
    own is not an argument mismatch, and neither is a wrong call corrected later in
    the turn. The evidence compares the first unmatched ground-truth call with the
    unmatched model call of f that agrees with it on the most arguments (the first such).
    """
    made, wanted = {}, {}
    for call in turn.calls:
        made.setdefault(call["name"], []).append(_args(call, turn.tools))
    for call in turn.gt_calls:
        wanted.setdefault(call["name"], []).append(_args(call, turn.tools))
    for name, gts in wanted.items():
        unmatched_gt = [a for a in gts if a not in made.get(name, [])]
        unmatched_model = [a for a in made.get(name, []) if a not in gts]
        if unmatched_gt and unmatched_model:
            want = unmatched_gt[0]
            closest = max(unmatched_model, key=lambda a: sum(k in a and a[k] == v for k, v in want.items()))
            return f"{name}: {_arg_diff(closest, want)}"
    return None


def state_mismatch(turn):
    """The model made calls in the turn and the official state_checker fails: some
    public attribute of an instance differs from the ground-truth instance's after the
    turn (state is cumulative, so an earlier turn's difference counts here too)."""
    if turn.calls and not turn.state["valid"]:
        cls = turn.state["error_message"].split("Model instance for ", 1)[-1].split(" ", 1)[0]
        return f"state differs from ground truth: {cls} {', '.join(turn.state['details']['differences'])}"
    return None


def recovery_failure(turn):
    """A call in the turn failed (bfcl.is_error_result on its replayed result: an execution
    error, an error payload, or a refusal) and no successful call followed it before the
    turn ended; that is, the turn's last call failed."""
    from common.envs.bfcl import harness as bfcl

    if turn.results and bfcl.is_error_result(turn.results[-1]):
        return f"last call failed: {_show(turn.calls[-1])} -> {turn.results[-1]}"
    return None


def missing_tool_call(turn):
    """The model made no call in the turn (a turn never played included), or never called
    some function that the turn's ground truth calls."""
    if not turn.played:
        return "not played (trajectory stopped)"
    if not turn.calls:
        return "no call in the turn"
    missing = sorted({c["name"] for c in turn.gt_calls} - {c["name"] for c in turn.calls})
    if missing:
        return f"never called {', '.join(missing)}"
    return None


def response_mismatch(turn):
    """The official response_checker fails: some ground-truth result of the turn is not
    among all the model's results so far (unordered, counting duplicates)."""
    if turn.calls and not turn.response["valid"]:
        missing = turn.response["details"]["missing_items"]
        return f"{len(missing)} ground-truth result(s) missing, e.g. {missing[0]!r}"
    return None


FAILURE_RULES = [  # the paper's priority order: the first that applies is the label
    ("invalid_tool_call", invalid_tool_call),
    ("argument_mismatch", argument_mismatch),
    ("state_mismatch", state_mismatch),
    ("recovery_failure", recovery_failure),
    ("missing_tool_call", missing_tool_call),
    ("response_mismatch", response_mismatch),
]


def label_turn(turn):
    """(label, evidence) for one replayed turn."""
    if not turn.gt:
        label, evidence = abstention_rule(turn)
        return label, _line(evidence)
    evidence = passes(turn) if turn.played else None
    if evidence:
        return "pass", _line(evidence)
    for label, rule in FAILURE_RULES:
        evidence = rule(turn)
        if evidence:
            return label, _line(evidence)
    # Unreachable: a failing turn made no call (missing_tool_call) or failed the state or the response check.
    raise AssertionError(f"turn {turn.index}: no rule applies")


# ----------------------------------------------------------------------------- τ²-bench episodes
# τ²'s verdict is one per episode (its evaluator: database against the gold actions' replay,
# environment assertions, gold actions made, information communicated). common/envs/tau2/tau2.py gathers
# it into an `Episode` and each user turn's evidence into a `Turn` (steps' parse errors, schema
# breaks against τ²'s tool schemas, calls, and results with τ²'s error flag). An episode τ² solves
# passes on every turn; otherwise each turn takes the first of these rules that applies, in the
# same priority order as above: what the turn itself shows first, the episode's verdict after
# (state is cumulative, as in BFCL: a database that differs at the end differs at every turn).


def tau2_invalid_tool_call(turn, episode):
    """Some output in the turn did not parse into calls, or a call broke the tool schemas τ²
    shows the agent (an unknown tool or parameter, a missing required one, a wrong type or
    enum value). τ²'s executor answers such calls with error=True; the label records the break."""
    return invalid_tool_call(turn)


def tau2_argument_mismatch(turn, episode):
    """A call in the turn names the tool of a gold action τ²'s action check found missing, and
    matches no gold action (τ²'s own comparison: the action's compare_args, else all arguments)."""
    for call in turn.calls:
        for action in episode.unmatched_actions:
            if action.name == call["name"] and not episode.matches_gold(call):
                return f"{call['name']}: {_arg_diff(call['arguments'], action.arguments)}"
    return None


def tau2_state_mismatch(turn, episode):
    """τ²'s database check fails (the database after the episode's calls differs from the gold
    actions' replay; the evidence names the differing tables and rows), or one of the task's
    environment assertions does not hold."""
    if episode.db_match is False:
        return f"database differs from the gold actions' replay: {episode.db_diff or 'τ² hash check'}"
    if episode.failed_assertions:
        return f"environment assertion not met: {episode.failed_assertions[0]}"
    return None


def tau2_recovery_failure(turn, episode):
    """The turn's last call failed (τ²'s tool message has error=True) and nothing corrected it
    in the turn."""
    if turn.results and turn.errors[-1]:
        return f"last call failed: {_show(turn.calls[-1])} -> {turn.results[-1]}"
    return None


def tau2_missing_tool_call(turn, episode):
    """The episode ended before the user was done (τ²'s termination is not a stop by the user or
    the agent: an agent error, the step or error limit), or a gold action was never made (τ²'s
    action check) and no call of the turn names its tool."""
    if episode.early_end:
        return f"episode ended early: {episode.early_end}"
    for action in episode.unmatched_actions:
        if all(c["name"] != action.name for c in turn.calls):
            return f"never made gold action {action.name}"
    return None


def tau2_response_mismatch(turn, episode):
    """Information the task requires the agent to communicate was not (τ²'s communicate check)."""
    if episode.unmet_info:
        return f"{len(episode.unmet_info)} required piece(s) of information not communicated, e.g. " \
               f"{episode.unmet_info[0]!r}"
    return None


TAU2_FAILURE_RULES = [
    ("invalid_tool_call", tau2_invalid_tool_call),
    ("argument_mismatch", tau2_argument_mismatch),
    ("state_mismatch", tau2_state_mismatch),
    ("recovery_failure", tau2_recovery_failure),
    ("missing_tool_call", tau2_missing_tool_call),
    ("response_mismatch", tau2_response_mismatch),
]


def label_tau2_turn(turn, episode):
    """(label, evidence) for one turn of a τ² episode."""
    if episode.reward == 1:
        return "pass", _line(f"τ² reward 1 ({len(turn.calls)} call(s) in the turn)")
    for label, rule in TAU2_FAILURE_RULES:
        evidence = rule(turn, episode)
        if evidence:
            return label, _line(evidence)
    # Unreachable: a reward below 1 comes from an early end or a failed check, each a rule above.
    raise AssertionError(f"turn {turn.index}: no rule applies (reward {episode.reward})")


# ----------------------------------------------------------------------------- records


def profile(labels):
    """p_j: the fraction of the trajectory's turns per label, every label in LABELS order
    (zeros included), so that all records have the same keys."""
    return {z: labels.count(z) / len(labels) for z in LABELS}


def diagnose(task, rollout):
    """The diagnosis record of one rollout record (docs/design.md §3) against its task.

    Raises common.jsonl.RecordError when the record's turns are not a rollout's.
    """
    from common.envs.bfcl import replay

    turns = replay.read_turns(task, rollout["turns"])
    official = replay.replay(task, turns)  # reward parity with bfcl.official_verdict: tests/test_diagnose.py
    labelled = [label_turn(t) for t in turns]
    labels = [label for label, _ in labelled]
    return {"task_id": task["id"], "category": task["category"], "sample_index": rollout["sample_index"],
            "round": rollout["round"], "reward": int(official["valid"]), "official": official,
            "turn_labels": labels, "evidence": [e for _, e in labelled], "profile": profile(labels)}


# ----------------------------------------------------------------------------- helpers


def _args(call, tools):
    """A call's arguments completed with its schema's defaults."""
    schema = next((t for t in tools if t["name"] == call["name"]), None)
    args = dict(call["arguments"])
    for key, prop in (schema["parameters"].get("properties", {}) if schema else {}).items():
        if key not in args and "default" in prop and prop["default"] != "None":
            args[key] = prop["default"]
    return args


def _arg_diff(model, gt):
    for key, value in gt.items():
        if key not in model:
            return f"{key} not given, ground truth {value!r}"
        if model[key] != value:
            return f"{key}={model[key]!r}, ground truth {value!r}"
    extra = sorted(set(model) - set(gt))
    return f"{extra[0]}={model[extra[0]]!r} not in ground truth"


def _show(call, limit=80):
    text = f"{call['name']}({', '.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"
    return text if len(text) <= limit else text[: limit - 4] + "...)"


def _line(text):
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_EVIDENCE else text[: MAX_EVIDENCE - 3] + "..."
