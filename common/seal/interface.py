"""The training-time observation interface Ω (docs/design.md §5): cue text added to what the agent reads,
never a change to the environment, tools, tasks or verifier; with Ω None every function here is the identity
or None. Three cue families: the schema cue (`tool_view`), error feedback (`error_hint`, from schema facts and
fixed text only) and capability cues (`system_cue`). The interface record, interface.json: docs/design.md §3.
"""

import copy
import json
import re

from common.engine import calls as C
from common.jsonl import RecordError, read_json
from common.seal.taxonomy import LABELS, RHO

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
    missing = [k for k in initial() if k not in omega]
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


# The hints of fixed text; the others are functions of the rule's match and the tools.
JSON_FORMAT = ('Expected format: <tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": <value>}}'
               "\n</tool_call>, valid JSON, one block per call, a newline after <tool_call> and before "
               "</tool_call>.")
PYTHON_FORMAT = ("Expected format: one Python list of calls with keyword arguments and literal values, "
                 "like [tool_name(parameter=value), other_tool(parameter=value)].")
LITERAL = ("Use plain literal values only (strings, numbers, true/false, lists, objects): "
           "no variables, expressions or nested calls.")
SIZE = "Send fewer calls per output and keep the output short."


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


def _hint_auth(m, tools):
    look = pick(tools, ("login_status",))
    login = pick(tools, ("login", "authenticate"), exclude=("status", "logout"))
    return (f"Check the login status{look} and log in{login} with credentials the user or earlier results "
            "gave, then retry.")


def _hint_funds(m, tools):
    look = pick(tools, ("balance", "account_info", "budget", "credit_card"), require=READ_ONLY)
    return (f"Check the available balance or budget{look} before retrying with an amount that fits, "
            "or tell the user.")


def _hint_not_found(m, tools):
    look = _lookup_tools(m.string, tools) or pick(tools, READ_ONLY, require=READ_ONLY)
    return f"Look up what exists{look} and retry with a name or ID taken from those results."


def _hint_invalid_value(m, tools):
    look = _lookup_tools(m.string, tools)
    look = f", look up valid values{look}" if look else ""
    return ("A value is outside what the tool accepts: re-read its parameter descriptions (ranges, formats)"
            f"{look} and retry with a value from the request or earlier results, or tell the user it cannot "
            "be done.")


# Error classes, tried in order after an environment's own (its `rules`): (class, source, pattern, hint).
# `call` errors are the reasons common.engine.calls gives for an undecodable output or a schema break; `env`
# errors are what an executed call returned (an exception or an {"error": ...} payload). Every hint is fixed
# text or built from fixed text and the schemas of `tools` only.
ERROR_RULES = [
    ("format_json", "call", r"<tool_call>|</tool_call>|not valid JSON|JSON object|unexpected key|is not an allowed value",
     JSON_FORMAT),
    ("format_python", "call", r"Python list|list of function calls|plain function names|\*args|\*\*kwargs"
     r"|too many positional|given twice", PYTHON_FORMAT),
    ("literal_value", "call", r"^argument \w+: ", LITERAL),
    ("output_size", "call", r"^output too long|^too many calls", SIZE),
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
    ("not_found", "env", r"(?i)not found|not registered|not present|not in watchlist", _hint_not_found),
    ("invalid_value", "env", r"(?i)invalid|must be|cannot|no available|exceeds|not supported", _hint_invalid_value),
]


def error_class(error, rules=()):
    """(class, match, hint) of a rejection reason or failed result by the environment's `rules`, then
    ERROR_RULES; (None, None, None) where none applies."""
    source, text = _split_error(error)
    for name, src, pattern, hint in [*rules, *ERROR_RULES]:
        m = re.search(pattern, text) if src == source else None  # (re caches the compiled patterns)
        if m:
            return name, m, hint
    return None, None, None


def error_hint(error, tools, omega, rules=()):
    """A recovery hint for a schema break or parse error (reason) or a failed or refused call (result);
    None if no rule applies."""
    if not omega or not omega["error_feedback"] or not error:
        return None
    name, m, hint = error_class(error, rules)
    if name is None or isinstance(hint, str):
        return hint
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
    return pick(tools, tuple(sorted(words)), require=READ_ONLY)


def pick(tools, keys, require=(), exclude=(), limit=4):
    """' (a, b)' naming available tools whose name contains one of `keys` (in key order); '' if none."""
    names = [t["name"] for key in keys for t in tools if key in t["name"]
             and t["name"].startswith(require or "") and not any(x in t["name"] for x in exclude)]
    names = list(dict.fromkeys(names))  # in key order, each once
    return f" ({', '.join(names[:limit])})" if names else ""
