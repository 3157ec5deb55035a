"""Tool calls: parse untrusted model text, check against the schemas, render.

Model output never reaches bfcl-eval's `eval()`-based executor as written. It is
parsed into (name, literal arguments) and, when its name is a method the task's
environment dispatches (common.bfcl decides), rendered by `render()` into a call
string built from `repr()` of plain Python literals. Two formats:

- "json":   Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
- "python": a Python list of calls, `[func(a=1, b='x'), g()]` (ToolACE, BFCL ground truth)

A call is the dict `{"name": str, "arguments": {param: value}}`. Parsing accepts
any name, as bfcl-eval's decoders do (deciding what may run is the executor's
gate, not the parser's); arguments must be literals. `validate` checks a call
against the schemas listed at that moment: its verdict labels the call and
chooses a hint, it does not decide execution. Every reason is a short sentence
meant to be shown to the model.
"""

import ast
import json
import math
import re

MAX_TEXT_CHARS = 32_000  # longer outputs are not parsed at all
MAX_CALLS = 64  # per model output
MAX_VALUE_CHARS = 8_000  # a single argument rendered as a literal
MAX_DEPTH = 8  # nesting of lists/dicts inside one argument
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")  # no dunders, no attributes, no leading underscore

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class CallError(ValueError):
    """A call (or a whole output) that must not run; str(e) goes back to the model."""


# ----------------------------------------------------------------------------- parsing


def parse(text, fmt, params=None):
    """(calls, error) for one model output; no calls and no error means a plain answer.

    `params` ({name: [parameter names in signature order]}, common.bfcl.methods)
    binds positional arguments of the Python format to names, as Python would
    when the call runs. Positional arguments of a name not in `params` are
    checked and dropped, as bfcl-eval's decoder drops them: such a call never runs.
    """
    if fmt not in ("json", "python"):
        raise ValueError(f"unknown call format {fmt!r}")
    if len(text) > MAX_TEXT_CHARS:
        return [], f"output too long to parse ({len(text)} characters)"
    try:
        calls = parse_json_calls(text) if fmt == "json" else parse_python_calls(text, params or {})
    except CallError as e:
        return [], str(e)
    if len(calls) > MAX_CALLS:
        return [], f"too many calls in one output ({len(calls)} > {MAX_CALLS})"
    return calls, None


def parse_json_calls(text):
    if "<tool_call>" not in text:
        if "</tool_call>" in text:
            raise CallError("found </tool_call> without <tool_call>")
        return []
    blocks = TOOL_CALL_RE.findall(text)
    if text.count("<tool_call>") != len(blocks):
        raise CallError("unclosed <tool_call> block")
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block, parse_constant=_reject_constant)
        except (json.JSONDecodeError, RecursionError) as e:
            raise CallError(f"tool call is not valid JSON ({getattr(e, 'msg', 'too deeply nested')})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise CallError('a tool call must be a JSON object with a "name" string and an "arguments" object')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args, parse_constant=_reject_constant)
            except (json.JSONDecodeError, RecursionError):
                raise CallError(f'"arguments" of {obj["name"]} is a string that is not a JSON object') from None
        if not isinstance(args, dict):
            raise CallError(f'"arguments" of {obj["name"]} must be a JSON object')
        extra = set(obj) - {"name", "arguments"}
        if extra:
            raise CallError(f"unexpected key(s) in tool call: {', '.join(sorted(extra))}")
        for key, value in args.items():
            _check_value(value, key, 0)
        calls.append({"name": obj["name"], "arguments": args})
    return calls


def _reject_constant(name):
    raise CallError(f"{name} is not an allowed value")


CALL_START_RE = re.compile(r"[\[(]|[A-Za-z_][\w.]*\s*\(")


def parse_python_calls(text, params):
    src = text.strip()
    # Like bfcl-eval's decoding, text that does not even start like a call is an answer.
    if not CALL_START_RE.match(src):
        return []
    try:
        tree = ast.parse(src, mode="eval")
    except SyntaxError as e:
        raise CallError(f"not a Python list of calls ({e.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise CallError("not a Python list of calls (too deeply nested)") from None
    body = tree.body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise CallError("expected a list of function calls like [func(a=1)]")
        name = _dotted(node.func)
        if name is None:
            raise CallError("only plain function names may be called (no expressions)")
        args = {}
        order = params.get(name)
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Starred):
                raise CallError("*args are not allowed")
            if order is None:
                _literal(arg, f"#{i + 1}")  # checked, then dropped: this call will be refused anyway
                continue
            if i >= len(order):
                raise CallError(f"{name}: too many positional arguments")
            args[order[i]] = _literal(arg, order[i])
        for kw in node.keywords:
            if kw.arg is None:
                raise CallError("**kwargs are not allowed")
            if kw.arg in args:
                raise CallError(f"{name}: argument {kw.arg} given twice")
            args[kw.arg] = _literal(kw.value, kw.arg)
        calls.append({"name": name, "arguments": args})
    return calls


def _dotted(func):
    """`f` or `a.b.f` as a name (bfcl-eval's decoder joins attribute paths); None for anything else."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    return ".".join([func.id] + parts[::-1])


def _literal(node, key):
    """The value of a literal expression; anything that would compute is refused."""
    if isinstance(node, (ast.Call, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
                         ast.Attribute, ast.Subscript, ast.Name, ast.NamedExpr, ast.Await, ast.Yield,
                         ast.JoinedStr, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp)):
        raise CallError(f"argument {key}: only literal values are allowed, not {type(node).__name__}")
    try:
        value = ast.literal_eval(node)  # literal_eval evaluates nothing but literals
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise CallError(f"argument {key}: only literal values are allowed") from None
    if isinstance(value, (tuple, set, frozenset, bytes, complex)):
        raise CallError(f"argument {key}: {type(value).__name__} values are not allowed")
    _check_value(value, key, 0)
    return value


def _check_name(name):
    if not NAME_RE.match(name) or len(name) > 64:
        raise CallError(f"invalid function name {name[:40]!r}")


def _check_value(value, key, depth):
    """Plain JSON-like data only, finite, of sane size."""
    if depth > MAX_DEPTH:
        raise CallError(f"argument {key}: nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
            raise CallError(f"argument {key}: number too large")
        if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
            raise CallError(f"argument {key}: string too long")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CallError(f"argument {key}: number must be finite")
        return
    if isinstance(value, list):
        for v in value:
            _check_value(v, key, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CallError(f"argument {key}: dictionary keys must be strings")
            _check_value(v, key, depth + 1)
    else:
        raise CallError(f"argument {key}: {type(value).__name__} values are not allowed")
    if depth == 0 and len(repr(value)) > MAX_VALUE_CHARS:
        raise CallError(f"argument {key}: value too large")


# ----------------------------------------------------------------------------- validation

TYPE_NAMES = {"string": "a string", "integer": "an integer", "float": "a number", "boolean": "true or false",
              "array": "a list", "dict": "an object", "any": "any value"}


def validate(call, tools):
    """None if `call` fits one of `tools` (the schemas listed now), else the reason.

    Labels and hints only: bfcl-eval runs a call that breaks its schema, or names
    a tool not listed yet, all the same (common.bfcl.Environment does too).
    """
    by_name = {t["name"]: t for t in tools}
    tool = by_name.get(call["name"])
    if tool is None:
        return f"unknown tool {call['name']}"
    params = tool["parameters"].get("properties", {})
    for key in call["arguments"]:
        if key not in params:
            return f"{call['name']}: unknown parameter {key}"
    for key in tool["parameters"].get("required", []):
        if key not in call["arguments"]:
            return f"{call['name']}: missing required parameter {key}"
    for key, value in call["arguments"].items():
        reason = _check_type(value, params[key], f"{call['name']}: parameter {key}")
        if reason:
            return reason
    return None


def _check_type(value, schema, where):
    kind = schema.get("type", "any")
    ok = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "tuple": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
        "object": lambda v: isinstance(v, dict),
        "any": lambda v: True,
    }.get(kind, lambda v: True)
    # An optional parameter whose schema default is None accepts an explicit None.
    if value is None and "default" in schema and schema["default"] is None:
        return None
    if not ok(value):
        return f"{where} must be {TYPE_NAMES.get(kind, kind)}, got {_type_name(value)}"
    enum = enum_values(schema)
    if enum is not None:
        for v in (value if kind == "array" and "enum" not in schema else [value]):
            if v not in enum:
                return f"{where} must be one of {enum}"
    if kind == "array" and "items" in schema:
        for item in value:
            reason = _check_type(item, schema["items"], f"{where} item")
            if reason:
                return reason
    if kind == "dict" and "properties" in schema:
        for k, v in value.items():
            if k in schema["properties"]:
                reason = _check_type(v, schema["properties"][k], f"{where}.{k}")
                if reason:
                    return reason
    return None


ENUM_NOTE_RE = re.compile(r"\[Enum\]: (\[[^\]]*\])")


def enum_values(schema):
    """Allowed values: the schema's `enum`, or the `[Enum]: [...]` note BFCL writes into descriptions
    (its multi-turn docs have no `enum` keys; for an array the note constrains the items)."""
    if "enum" in schema:
        return schema["enum"]
    m = ENUM_NOTE_RE.search(schema.get("description", ""))
    if m:
        try:
            values = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        return values if isinstance(values, list) else None
    return None


def _type_name(value):
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- rendering


def render(call):
    """The call string bfcl-eval's executor and checker take: `name(k=<repr>, ...)`.

    Names and keys must match NAME_RE and values are plain literals, so the
    string cannot contain anything but one literal call (CallError otherwise).
    """
    _check_name(call["name"])
    parts = []
    for key, value in call["arguments"].items():
        if not NAME_RE.match(key) or len(key) > 64:
            raise CallError(f"invalid parameter name {key[:40]!r}")
        _check_value(value, key, 0)
        parts.append(f"{key}={value!r}")
    return f"{call['name']}({', '.join(parts)})"


def format_calls(calls, fmt):
    """Model-side text for calls (used to render ground-truth turns for the warm start)."""
    if fmt == "json":
        return "\n".join("<tool_call>\n" + json.dumps(c, ensure_ascii=False) + "\n</tool_call>" for c in calls)
    return "[" + ", ".join(render(c) for c in calls) + "]"
