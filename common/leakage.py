"""The cue leakage audit: no cue of Ω may reveal a ground-truth value (docs/design.md §5).

Used by tests/test_interface.py and bench/interface_cost.py; the stages never run it.
"""

import functools
import json
import re

from common import calls as C
from common.interface import CAPABILITY_TEXT, error_hint, tool_view

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
    from common import bfcl  # bfcl-eval is only needed for the audit

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
                    check(turn, case, error, error_hint(error, tools, omega))
                wrong = {k: _missing_value(v) for k, v in call["arguments"].items()}
                if wrong != call["arguments"]:
                    _, errors = sandbox.run_calls([{"name": call["name"], "arguments": wrong}])
                    if errors[0]:
                        check(turn, "exec_wrong_value", errors[0], error_hint(errors[0], tools, omega))
                sandbox.run_calls([call])
                results, errors = env.run_calls([call])
                if errors[0]:
                    check(turn, "exec_ground_truth", errors[0], error_hint(errors[0], tools, omega))
                seen += results
        for lit in task_literals:
            for template in AUDIT_ENV_TEMPLATES:
                error = json.dumps({"error": template.format(v=lit)})
                check(turn, "env_template", error, error_hint(error, tools, omega))
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
