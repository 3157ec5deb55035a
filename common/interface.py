"""The training-time observation interface Ω (docs/design.md §5): what the agent sees while training.

Ω never changes the environment, the tools, the tasks or the verifier; it only
adds cue text to what the agent reads. Evaluation runs with Ω = None, and then
every function here is the identity (tool_view) or returns None, so the prompt
is byte-identical to the plain one. Three cue families:

- schema cue (φ_schema): `tool_view` annotates each parameter description with
  `[required]`, its type (and array item type) and its allowed enum values;
- error feedback (φ_err): `error_hint` appends a short recovery-oriented hint to
  the tool response of a call that broke the schema (it may still have run),
  failed or was refused, or of an undecodable output, chosen by the error's class
  (ERROR_RULES) and built only from schema facts (tool and parameter names,
  types, enum values, descriptions) and fixed text, never from the error's
  own values or anything the agent has not seen;
- capability cues (φ_cap): `system_cue` renders up to 3 fixed, reviewed
  guideline lines (CAPABILITY_TEXT, one per failure label) for the system prompt.

The interface record (`interface.json`, docs/design.md §3):

    {"version": int, "round": int,
     "schema_cue": {"enabled": bool, "required": bool, "types": bool, "enums": bool},
     "error_feedback": bool,
     "capability_cues": [{"label": failure label, "text": str}],
     "profile": C_t ({} for Ω_0; written by evolve.py),
     "rho": {label: weight}}

`schema_cue.enabled` switches the family; `required`, `types` and `enums` switch
its three annotations (all on when evolve.py turns the family on; they exist
so a run can ablate one by hand). A capability cue's text is stored in Ω so a
run records exactly what the agent read.
"""

import copy
import functools
import json
import re

from common import calls as C
from common.jsonl import RecordError, read_json
from common.taxonomy import LABELS, RHO

NO_CUE_LABELS = ("pass", "correct_abstention")  # not failures: never get a cue
FAILURE_LABELS = tuple(z for z in LABELS if z not in NO_CUE_LABELS)
MAX_CUES = 3

# One fixed, reviewed guideline per failure label. Generic on purpose: they name
# behaviours, never a task, tool value or answer.
CAPABILITY_TEXT = {
    "invalid_tool_call": "Call only listed tools, by their exact names and in the required format, with every "
                         "[required] parameter and the declared types; if no tool fits or a required value is "
                         "missing, call nothing and say what is missing.",
    "argument_mismatch": "Copy argument values exactly from the user's request or earlier tool results (names, "
                         "paths, IDs, numbers), in each parameter's declared type; never invent or reformat them.",
    "state_mismatch": "Do every action the user asks for, in order, checking the current state (folder, login, "
                      "existing items) before acting on it.",
    "recovery_failure": "When a tool returns an error, fix its cause (inspect the state or correct the argument) "
                        "and retry before moving on.",
    "missing_tool_call": "If a listed tool can do or look up what the user asks, call it instead of answering "
                         "from memory, and make every call the request needs.",
    "response_mismatch": "After the calls, answer the user with the information the tool results returned.",
}

# Which cue families a selected label switches on (docs/design.md §5). Every selected
# label also gets its capability line.
ACTIVATES = {
    "invalid_tool_call": ("schema_cue",),  # + its line, the format hint
    "argument_mismatch": ("schema_cue",),  # constraint cues: required, types, enums
    "recovery_failure": ("error_feedback",),
    "missing_tool_call": (),  # its line is the tool-affordance cue
    "state_mismatch": (),
    "response_mismatch": (),
}

SCHEMA_ON = {"enabled": True, "required": True, "types": True, "enums": True}
SCHEMA_OFF = {"enabled": False, "required": False, "types": False, "enums": False}


def initial():
    """Ω_0: schema cue and error feedback on, no capability cues."""
    return {"version": 0, "round": 0, "schema_cue": dict(SCHEMA_ON), "error_feedback": True,
            "capability_cues": [], "profile": {}, "rho": dict(RHO)}


def off():
    """An Ω with every family off (Vanilla RL, w/o env-side): the agent sees the plain prompt."""
    return {**initial(), "schema_cue": dict(SCHEMA_OFF), "error_feedback": False}


def load(path):
    """Ω from an interface.json, or None (no path, "null"/"none", or a file holding null)."""
    if path is None or str(path).strip().lower() in ("", "null", "none"):
        return None
    omega = read_json(path)
    if omega is None:
        return None
    problem = check(omega)
    if problem:
        raise RecordError(f"{path}: {problem}")
    return omega


def check(omega):
    """None if `omega` has the interface record's shape, else what is wrong."""
    if not isinstance(omega, dict):
        return "interface must be a JSON object"
    keys = ["version", "round", "schema_cue", "error_feedback", "capability_cues", "profile", "rho"]
    missing = [k for k in keys if k not in omega]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    for k in ("version", "round"):
        if not isinstance(omega[k], int) or isinstance(omega[k], bool) or omega[k] < 0:
            return f"{k} must be a non-negative integer"
    cue = omega["schema_cue"]
    if not isinstance(cue, dict) or set(cue) != set(SCHEMA_ON) or not all(isinstance(v, bool) for v in cue.values()):
        return f"schema_cue must be an object of booleans with keys {', '.join(SCHEMA_ON)}"
    if not isinstance(omega["error_feedback"], bool):
        return "error_feedback must be true or false"
    cues = omega["capability_cues"]
    if not isinstance(cues, list):
        return "capability_cues must be a list"
    for i, c in enumerate(cues):
        if not isinstance(c, dict) or set(c) != {"label", "text"}:
            return f"capability_cues[{i}] must be an object with label and text"
        if c["label"] not in FAILURE_LABELS:
            return f"capability_cues[{i}]: {c['label']!r} is not a failure label"
        if not isinstance(c["text"], str) or not c["text"].strip() or "\n" in c["text"]:
            return f"capability_cues[{i}]: text must be one non-empty line"
    if not isinstance(omega["profile"], dict):
        return "profile must be an object"
    rho = omega["rho"]
    if not isinstance(rho, dict):
        return "rho must be an object"
    for z, w in rho.items():
        if z not in LABELS:
            return f"rho: unknown label {z!r}"
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0:
            return f"rho[{z}] must be a non-negative number"
    return None


# ----------------------------------------------------------------------------- schema cue


def tool_view(schemas, omega):
    """The tool schemas as the agent sees them; the input itself when the schema cue is off."""
    cue = omega["schema_cue"] if omega else SCHEMA_OFF
    if not cue["enabled"] or not (cue["required"] or cue["types"] or cue["enums"]):
        return schemas  # the very same objects: the prompt renders byte-identically
    return [_annotate(tool, cue) for tool in schemas]


def _annotate(tool, cue):
    tool = copy.deepcopy(tool)  # the caller's schemas are shared with the environment
    params = tool.get("parameters", {})
    required = set(params.get("required", []))
    for name, prop in params.get("properties", {}).items():
        notes = []
        if cue["types"]:
            notes.append(f"type: {_type_text(prop)}")
        enum = prop.get("enum", prop.get("items", {}).get("enum"))
        if cue["enums"] and enum:
            notes.append("one of: " + ", ".join(json.dumps(v, ensure_ascii=False) for v in enum))
        text = prop.get("description", "").strip()
        if notes:
            text = f"{text} ({'; '.join(notes)})".lstrip()
        if cue["required"] and name in required:
            text = f"[required] {text}"
        prop["description"] = text
    return tool


def _type_text(prop):
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"array of {prop['items'].get('type', 'any')}"
    return kind


# ----------------------------------------------------------------------------- capability cues


def system_cue(omega):
    """Guideline lines for the system prompt, one per selected failure label; None if none."""
    if not omega or not omega["capability_cues"]:
        return None
    return "\n".join(f"- {c['text']}" for c in omega["capability_cues"])


# ----------------------------------------------------------------------------- error feedback

KIND_TEXT = {  # the type named in a validation reason -> how to write it
    "an integer": "a whole number without quotes",
    "a number": "a number without quotes",
    "a string": "a quoted string",
    "true or false": "true or false, without quotes",
    "a list": "a list [...]",
    "an object": "an object {...} with the documented keys",
}
READ_ONLY = ("get_", "list_", "search_", "view_", "display", "check_", "find")


def _hint_json_format(m, tools):
    return ('Expected format: <tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": <value>}}'
            "\n</tool_call>, valid JSON, one block per call, a newline after <tool_call> and before </tool_call>.")


def _hint_python_format(m, tools):
    return ("Expected format: one Python list of calls with keyword arguments and literal values, "
            "like [tool_name(parameter=value), other_tool(parameter=value)].")


def _hint_literal(m, tools):
    return ("Use plain literal values only (strings, numbers, true/false, lists, objects): "
            "no variables, expressions or nested calls.")


def _hint_size(m, tools):
    return "Send fewer calls per output and keep the output short."


def _hint_unknown_tool(m, tools):
    names = ", ".join(t["name"] for t in tools)
    return (f"Tools available now: {names}. Call one of these by its exact name, "
            "or answer without a call if none fits.")


def _hint_unknown_param(m, tools):
    tool = _tool(tools, m["tool"])
    if tool is None:
        return None
    props = list(tool["parameters"].get("properties", {}))
    required = tool["parameters"].get("required", [])
    accepted = ", ".join(props) if props else "no parameters"
    req = f" (required: {', '.join(required)})" if required else ""
    return f"{m['tool']} accepts: {accepted}{req}. Use only these parameter names."


def _hint_missing_param(m, tools):
    prop = _prop(tools, m["tool"], m["param"])
    about = f" ({_type_text(prop)}: {_short(prop.get('description', ''))})" if prop else ""
    return (f"{m['tool']} needs {m['param']}{about}. Take its value from the user's request or an earlier "
            "tool result; if neither gives it, ask the user instead of guessing.")


def _hint_enum(m, tools):
    prop = _prop(tools, m["tool"], m["param"])
    enum = prop and (C.enum_values(prop) or prop.get("items", {}).get("enum"))
    values = f" ({', '.join(json.dumps(v, ensure_ascii=False) for v in enum)})" if enum else ""
    return f"Use exactly one of the allowed values of {m['param']}{values}, written as listed."


def _hint_type(m, tools):
    what = KIND_TEXT.get(m["kind"], m["kind"])
    where = f"each item of {m['param']}" if m["item"] else m["param"]
    prop = _prop(tools, m["tool"], m["param"].split(".")[0])
    schema = f" (schema type: {_type_text(prop)})" if prop else ""
    return f"Send {where} as {what}{schema}."


def _hint_path(m, tools):
    look = _pick(tools, ("pwd", "ls", "find"))
    return (f"Check where you are and what exists{look} before retrying; move one folder at a time "
            "and use names exactly as listed.")


def _hint_exists(m, tools):
    return f"That name is already taken: look at what is there{_pick(tools, ('ls',))} before retrying."


def _hint_auth(m, tools):
    look = _pick(tools, ("login_status",))
    login = _pick(tools, ("login", "authenticate"), exclude=("status", "logout"))
    return (f"Check the login status{look} and log in{login} with credentials the user or earlier results "
            "gave, then retry.")


def _hint_funds(m, tools):
    look = _pick(tools, ("balance", "account_info", "budget", "credit_card"), require=READ_ONLY)
    return (f"Check the available balance or budget{look} before retrying with an amount that fits, "
            "or tell the user.")


def _hint_not_found(m, tools):
    look = _lookup_tools(m.string, tools) or _pick(tools, READ_ONLY, require=READ_ONLY)
    return f"Look up what exists{look} and retry with a name or ID taken from those results."


def _hint_invalid_value(m, tools):
    look = _lookup_tools(m.string, tools)
    look = f", look up valid values{look}" if look else ""
    return ("A value is outside what the tool accepts: re-read its parameter descriptions (ranges, formats)"
            f"{look} and retry with a value from the request or earlier results, or tell the user it cannot "
            "be done.")


def _hint_precondition(m, tools):
    look = _pick(tools, ("Status", "display", "get_current"))
    return f"A precondition is not met: check the current state{look}, do the required step first, then retry."


# Error classes, tried in order: (class, source, pattern, hint). `call` errors are
# the reasons common.calls gives for an undecodable output or a schema break; `env` errors are
# what an executed call returned (an exception or an {"error": ...} payload).
# Every hint is built from fixed text and the schemas of `tools` only.
ERROR_RULES = [
    ("format_json", "call", r"<tool_call>|</tool_call>|not valid JSON|JSON object|unexpected key|is not an allowed value",
     _hint_json_format),
    ("format_python", "call", r"Python list|list of function calls|plain function names|\*args|\*\*kwargs"
     r"|too many positional|given twice", _hint_python_format),
    ("literal_value", "call", r"^argument \w+: ", _hint_literal),
    ("output_size", "call", r"^output too long|^too many calls", _hint_size),
    ("unknown_tool", "call", r"^unknown tool |^invalid function name", _hint_unknown_tool),
    ("unknown_parameter", "call", r"^(?P<tool>\w+): unknown parameter (?P<param>\w+)$", _hint_unknown_param),
    ("missing_parameter", "call", r"^(?P<tool>\w+): missing required parameter (?P<param>\w+)$",
     _hint_missing_param),
    ("enum_value", "call", r"^(?P<tool>\w+): parameter (?P<param>[\w.]+)(?: item)* must be one of ", _hint_enum),
    ("wrong_type", "call", r"^(?P<tool>\w+): parameter (?P<param>[\w.]+)(?P<item>(?: item)*) must be "
     r"(?P<kind>.+?), got ", _hint_type),
    ("not_logged_in", "env", r"(?i)not logged in|no user is currently logged in|not authenticated|\blog ?in\b"
     r"|token expired|access token|token not initialized", _hint_auth),
    ("insufficient_funds", "env", r"(?i)insufficient|budget limit|balance not found", _hint_funds),
    ("bad_path", "env", r"(?i)no such (file|directory)|not a directory|is a directory|not a file or directory"
     r"|unsupported path|path not allowed|already the root", _hint_path),
    ("already_exists", "env", r"(?i)file exists|already exists", _hint_exists),
    ("not_found", "env", r"(?i)not found|not registered|not present|not in watchlist", _hint_not_found),
    ("precondition", "env", r"(?i)brake|engine|doors must be locked|fuel tank is empty|market is closed",
     _hint_precondition),
    ("invalid_value", "env", r"(?i)invalid|must be|cannot|no available|exceeds|not supported", _hint_invalid_value),
]


def error_class(error):
    """(class, match) of a rejection reason or failed result, or (None, None)."""
    source, text = _split_error(error)
    for name, src, pattern, _ in ERROR_RULES:
        m = re.search(pattern, text) if src == source else None  # (re caches the compiled patterns)
        if m:
            return name, m
    return None, None


def error_hint(error, tools, omega):
    """A recovery hint for a schema break or parse error (reason) or a failed or refused call (result);
    None if no rule applies."""
    if not omega or not omega["error_feedback"] or not error:
        return None
    name, m = error_class(error)
    if name is None:
        return None
    hint = next(h for n, _, _, h in ERROR_RULES if n == name)
    return hint(m, tools)


def _split_error(error):
    """('env', message) for an execution failure, ('call', reason) for a rejection."""
    message = C.result_error(error)
    if message is not None:
        return "env", message
    return "call", error.removeprefix("Error: ")  # the tool response of a rejected call carries this prefix


def _tool(tools, name):
    return next((t for t in tools if t["name"] == name), None)


def _prop(tools, tool, param):
    t = _tool(tools, tool)
    return t["parameters"].get("properties", {}).get(param) if t else None


def _short(text, limit=120):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _lookup_tools(message, tools):
    """' (a, b)' naming read-only tools about a noun of the error message (ticket, stock, airport, ...)."""
    words = {w.rstrip("s") for w in re.findall(r"[a-z]{4,}", message.lower())}
    words -= {"found", "with", "registered", "invalid", "must", "cannot", "available", "given", "present"}
    return _pick(tools, tuple(sorted(words)), require=READ_ONLY)


def _pick(tools, keys, require=(), exclude=(), limit=4):
    """' (a, b)' naming available tools whose name contains one of `keys` (in key order); '' if none."""
    names = []
    for key in keys:
        for t in tools:
            name = t["name"]
            if (key in name and name not in names
                    and (not require or name.startswith(require))
                    and not any(x in name for x in exclude)):
                names.append(name)
    return f" ({', '.join(names[:limit])})" if names else ""


# ----------------------------------------------------------------------------- leakage audit
#
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
