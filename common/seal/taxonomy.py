"""The failure taxonomy Ψ (docs/design.md §4): one label per user turn, from executable evidence only.

What every environment shares lives here: the labels, ρ's default table, the priority order the failure
rules are tried in (`label`), the rule all environments share (invalid_tool_call), the profile, the evidence
helpers. Each environment passes its own rules (common/envs/*/diagnose.py), each returning a one-line evidence
string when it applies, None otherwise.
"""

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
PRIORITY = LABELS[2:]  # the failure labels in the paper's priority order: the first rule that applies labels


def label(turn, rules, *evidence):
    """(label, evidence) of a failing turn: the first label of PRIORITY whose rule (`rules[label](turn,
    *evidence)`) applies."""
    for z in PRIORITY:
        found = rules[z](turn, *evidence)
        if found:
            return z, line(found)
    # Unreachable where each environment's rules cover its failures (tests/test_taxonomy.py, test_tau2_env.py).
    raise AssertionError(f"turn {turn.index}: no rule applies")


def invalid_tool_call(turn):
    """Some model output in the turn did not parse into calls, or a parsed call broke the schemas of the tools
    listed at that turn (docs/design.md §4); such a call may still have run: the label records the break."""
    if turn.parse_errors:
        return f"unparsable output: {turn.parse_errors[0]}"
    if turn.schema_errors:
        call, reason = turn.schema_errors[0]
        return f"schema broken by {show(call)}: {reason}"
    return None


def profile(labels):
    """p_j: the fraction of the trajectory's turns per label, every label of LABELS (zeros included)."""
    return {z: labels.count(z) / len(labels) for z in LABELS}


# ----------------------------------------------------------------------------- evidence helpers
def arg_diff(model, gt):
    for key, value in gt.items():
        if key not in model:
            return f"{key} not given, ground truth {value!r}"
        if model[key] != value:
            return f"{key}={model[key]!r}, ground truth {value!r}"
    extra = sorted(set(model) - set(gt))
    return f"{extra[0]}={model[extra[0]]!r} not in ground truth"


def show(call, limit=80):
    text = f"{call['name']}({', '.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"
    return text if len(text) <= limit else text[: limit - 4] + "...)"


def line(text):
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_EVIDENCE else text[: MAX_EVIDENCE - 3] + "..."
