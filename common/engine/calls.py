"""Tool calls: untrusted model text decoded as bfcl-eval's decoder does ("json" <tool_call> blocks or a "python"
list of calls) into literal arguments, never eval'd; what would compute is refused (docs/differences.md §3).
`validate` checks a call against the tools listed now; `render` writes it as bfcl-eval's executor takes it.
"""
import ast
import contextlib
import json
import math
import operator
import re

MAX_TEXT_CHARS = 32_000  # longer outputs are not parsed at all
MAX_CALLS = 64  # per model output
MAX_VALUE_CHARS = 8_000  # a single argument rendered as a literal
MAX_DEPTH = 8  # nesting of lists/dicts inside one argument
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")  # no dunders, no attributes, no leading underscore

# bfcl-eval's QwenFCHandler._extract_tool_calls: a block without these newlines is not a call
TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


class CallError(ValueError):
    """A call (or a whole output) that must not run; str(e) goes back to the model."""


# ----------------------------------------------------------------------------- parsing
def parse(text, fmt):
    """(calls, error) of one model output; an error with calls names the blocks bfcl-eval skips."""
    if fmt not in ("json", "python"):
        raise ValueError(f"unknown call format {fmt!r}")
    if len(text) > MAX_TEXT_CHARS:
        return [], f"output too long to parse ({len(text)} characters)"
    try:
        calls, error = parse_json_calls(text) if fmt == "json" else (parse_python_calls(text), None)
    except CallError as e:
        return [], str(e)
    if len(calls) > MAX_CALLS:
        return [], f"too many calls in one output ({len(calls)} > {MAX_CALLS})"
    return calls, error


def parse_ground_truth(text, params):
    """(calls, error) of a ground-truth string as Python reads it, positional arguments bound by `params`."""
    try:
        return _parse_source(text, params), None
    except CallError as e:
        return [], str(e)


# -- Qwen: QwenFCHandler._parse_query_response_prompting + decode_execute + convert_to_function_call
def parse_json_calls(text):
    if "</think>" in text:  # bfcl-eval decodes only what follows the reasoning
        text = text.split("</think>")[-1].lstrip("\n")
    if "<tool_call>" not in text:
        if "</tool_call>" in text:
            raise CallError("found </tool_call> without <tool_call>")
        return [], None
    items, skipped = [], []
    for block in TOOL_CALL_RE.findall(text):
        try:
            items.append(json.loads(block))
        except (ValueError, RecursionError) as e:  # bfcl-eval skips a block json.loads rejects
            skipped.append(f"tool call is not valid JSON ({getattr(e, 'msg', 'too deeply nested')})")
    unmatched = text.count("<tool_call>") - len(items) - len(skipped)
    if text.count("<tool_call>") > text.count("</tool_call>"):
        skipped.append("unclosed <tool_call> block")
    elif unmatched > 0:
        skipped.append(f"{unmatched} <tool_call> block(s) not written as <tool_call>\\n{{...}}\\n</tool_call> "
                       "(a newline after <tool_call> and before </tool_call>) were ignored")
    calls = []
    for obj in items:
        if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:  # bfcl-eval fails
            raise CallError('a tool call must be a JSON object with a "name" and an "arguments" object')
        name, args = obj["name"], obj["arguments"]
        if isinstance(name, (list, dict)):
            raise CallError('a tool call must be a JSON object with a "name" string')
        name = name if isinstance(name, str) else f"{name}"  # bfcl-eval formats the key into the call string
        if isinstance(args, str):  # some models emit the arguments as a JSON string; bfcl-eval loads it
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                raise CallError(f'"arguments" of {name} is a string that is not a JSON object') from None
        if not isinstance(args, dict):
            raise CallError(f'"arguments" of {name} must be a JSON object')
        for key, value in args.items():
            _check_value(value, key, 0)
        calls.append({"name": name, "arguments": args})
    return calls, "; ".join(skipped) or None


# -- Python list: default_decode_execute_prompting + ast_parse + resolve_ast_by_type + parse_nested_value
CALL_START_RE = re.compile(r"[\[(]|[A-Za-z_][\w.]*\s*\(")
FOLD_MAX_BITS = 256  # integer arithmetic is folded only while it stays this small
NESTED_KEY_BREAKERS = "'\\\n\r\x00"  # parse_nested_value writes keys as '{k}': these would change or break them


def parse_python_calls(text):
    """The calls bfcl-eval's prompting decoder gives, without its eval()s."""
    src = text.strip("`\n ")
    if not src.startswith("["):
        src = "[" + src
    if not src.endswith("]"):
        src = src + "]"
    try:
        return _decode_python(src.strip().strip("'"))
    except CallError:
        # text that does not even start like a call is an answer (its turn ends all the same)
        if not CALL_START_RE.match(text.strip("`\n ")):
            return []
        raise


def _parse_expression(src):
    """The syntax tree of `src` as one Python expression (read, never run), or CallError."""
    try:
        return ast.parse(src, mode="eval")
    except SyntaxError as e:
        raise CallError(f"not a Python list of calls ({e.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise CallError("not a Python list of calls (too deeply nested)") from None


def _decode_python(src):
    tree = _parse_expression(src)
    nodes = [tree.body] if isinstance(tree.body, ast.Call) else getattr(tree.body, "elts", None)
    if nodes is None:
        raise CallError("not a Python list of calls")
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise CallError("expected a list of function calls like [func(a=1)]")
        name, args = _resolve_call(node)
        for key, value in args.items():
            args[key] = _nested(value, key)
            _check_value(args[key], key, 0)
        calls.append({"name": name, "arguments": args})
    return calls


def _resolve_call(node):
    """resolve_ast_call: the attribute path's name, keyword arguments only (`**x` as the keyword None)."""
    args = {f"{kw.arg}": _resolve(kw.value, kw.arg) for kw in node.keywords}
    return _dotted(node.func, strict=False), args


def _resolve(node, key):
    """resolve_ast_by_type, where it computes nothing; its eval() of arithmetic is folded here."""
    if isinstance(node, ast.Constant):
        if node.value is Ellipsis:
            return "..."
        if isinstance(node.value, (bytes, complex)):
            raise CallError(f"argument {key}: {type(node.value).__name__} values are not allowed")
        return node.value
    if isinstance(node, ast.UnaryOp):  # bfcl-eval negates the operand, whatever the operator
        operand = node.operand
        if isinstance(operand, ast.Constant) and type(operand.value) in (bool, int, float):
            return -operand.value
        raise CallError(f"argument {key}: only literal values are allowed, not {type(node.op).__name__} "
                        f"of {type(operand).__name__}")
    if isinstance(node, ast.List):
        return [_resolve(v, key) for v in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise CallError(f"argument {key}: ** inside a dict is not allowed")
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            k = _resolve(k, key)
            if isinstance(k, (list, dict)):
                raise CallError(f"argument {key}: dictionary keys must be strings")
            out[k] = _resolve(v, key)
        return out
    if isinstance(node, ast.BinOp):
        return _fold(node, key)
    if isinstance(node, ast.Name):  # a bare name is its own text
        return node.id
    if isinstance(node, ast.Call):
        if not node.keywords:  # a call without keywords is its source text, unrun
            return ast.unparse(node)
        name, args = _resolve_call(node)
        return {name: args}  # a nested call, as bfcl-eval represents it (see _nested)
    if isinstance(node, ast.Subscript):  # its source text
        return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
    if isinstance(node, ast.Tuple):
        raise CallError(f"argument {key}: tuple values are not allowed")
    raise CallError(f"argument {key}: only literal values are allowed, not {type(node).__name__}")


def _nested(value, key):
    """parse_nested_value's reading: a dict of dicts is a nested call (refused); keys become strings."""
    if not isinstance(value, dict):
        return value
    if not value:
        raise CallError(f"argument {key}: an empty dict {{}} cannot be decoded")
    if all(isinstance(v, dict) for v in value.values()):
        raise CallError(f"argument {key}: a nested call ({next(iter(value))!s:.40}) is not allowed")
    out = {}
    for k, v in value.items():
        k = f"{k}"
        if any(c in k for c in NESTED_KEY_BREAKERS):
            raise CallError(f"argument {key}: a dictionary key with quotes, backslashes or newlines")
        out[k] = _nested(v, key)
    return out


FOLD_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
            ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
            ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
            ast.BitOr: operator.or_, ast.BitXor: operator.xor}
FOLD_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}


def _fold(node, key):
    """The value of an expression of literals and operators (bfcl-eval's eval()), bounded, or CallError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_fold(v, key) for v in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    try:
        if isinstance(node, ast.UnaryOp) and type(node.op) in FOLD_UNARY:
            return FOLD_UNARY[type(node.op)](_fold(node.operand, key))
        if isinstance(node, ast.BinOp) and type(node.op) in FOLD_OPS:
            left, right = _fold(node.left, key), _fold(node.right, key)
            _check_fold(node.op, left, right, key)
            out = FOLD_OPS[type(node.op)](left, right)
            if isinstance(out, int) and out.bit_length() > FOLD_MAX_BITS:
                raise CallError(f"argument {key}: arithmetic result too large")
            return out
    except CallError:
        raise
    except (ArithmeticError, TypeError, ValueError) as e:  # bfcl-eval's eval() raises these too
        raise CallError(f"argument {key}: arithmetic fails ({type(e).__name__})") from None
    raise CallError(f"argument {key}: only literal values are allowed, not {type(node).__name__}")


def _check_fold(op, left, right, key):
    """Refuse, before computing, what could take unbounded time or memory."""
    ints = all(isinstance(v, int) for v in (left, right))
    if isinstance(op, ast.Pow) and ints and right > 0 and abs(left) > 1 \
            and abs(left).bit_length() * right > FOLD_MAX_BITS:
        raise CallError(f"argument {key}: arithmetic result too large")
    if isinstance(op, ast.LShift) and ints and right > FOLD_MAX_BITS:
        raise CallError(f"argument {key}: arithmetic result too large")
    if isinstance(op, ast.Mult):
        seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(repr(seq)) * max(n, 0) > MAX_VALUE_CHARS:
            raise CallError(f"argument {key}: value too large")
    if isinstance(op, ast.Mod) and isinstance(left, str):  # %-formatting: widths could be huge
        raise CallError(f"argument {key}: string formatting with % is not allowed")


# -- ground-truth strings: Python's own reading (literals only, positional arguments bound)
def _parse_source(text, params):
    body = _parse_expression(text.strip()).body
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


def _dotted(func, strict=True):
    """`f` or `a.b.f` as a name (bfcl-eval's decoder joins attribute paths); None for anything else, where
    `strict`, else the attributes alone (`x[0].f` is `f`), as resolve_ast_call reads them."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    elif strict:
        return None
    return ".".join(reversed(parts))


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


def _check_value(value, key, depth):
    """Plain JSON-like data only, finite, of sane size."""
    if depth > MAX_DEPTH:
        raise CallError(f"argument {key}: nested too deeply")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
        raise CallError(f"argument {key}: number too large")
    if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
        raise CallError(f"argument {key}: string too long")
    if isinstance(value, float) and not math.isfinite(value):
        raise CallError(f"argument {key}: number must be finite")
    if value is None or isinstance(value, (bool, int, float, str)):
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
VALUE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def validate(call, tools):
    """None if `call` fits one of `tools` (listed now), else the reason: for labels and hints only."""
    tool = {t["name"]: t for t in tools}.get(call["name"])
    if tool is None:
        return f"unknown tool {call['name']}"
    name, args, params = call["name"], call["arguments"], tool["parameters"].get("properties", {})
    unknown = [k for k in args if k not in params]
    if unknown:
        return f"{name}: unknown parameter {unknown[0]}"
    missing = [k for k in tool["parameters"].get("required", []) if k not in args]
    if missing:
        return f"{name}: missing required parameter {missing[0]}"
    checks = (_check_type(v, params[k], f"{name}: parameter {k}") for k, v in args.items())
    return next(filter(None, checks), None)


TYPE_CHECKS = {"string": str, "integer": int, "float": (int, float), "number": (int, float), "boolean": bool,
               "array": list, "tuple": list, "dict": dict, "object": dict}  # a bool counts only as a boolean


def _check_type(value, schema, where):
    kind = schema.get("type", "any")
    types = TYPE_CHECKS.get(kind)  # "any", or a type not listed: anything
    if value is None and "default" in schema and schema["default"] is None:
        return None
    if types and not (isinstance(value, types) and (kind == "boolean" or not isinstance(value, bool))):
        got = VALUE_NAMES.get(type(value), type(value).__name__)
        return f"{where} must be {TYPE_NAMES.get(kind, kind)}, got {got}"
    enum = enum_values(schema)
    values = value if kind == "array" and "enum" not in schema else [value]
    if enum is not None and any(v not in enum for v in values):
        return f"{where} must be one of {enum}"
    inner = []  # (value, schema, where) of the items or properties inside
    if kind == "array" and "items" in schema:
        inner = [(item, schema["items"], f"{where} item") for item in value]
    elif kind == "dict" and "properties" in schema:
        props = schema["properties"]
        inner = [(v, props[k], f"{where}.{k}") for k, v in value.items() if k in props]
    return next(filter(None, (_check_type(*args) for args in inner)), None)


ENUM_NOTE_RE = re.compile(r"\[Enum\]: (\[[^\]]*\])")


def enum_values(schema):
    """Allowed values: the schema's `enum`, or the `[Enum]: [...]` note BFCL writes into descriptions."""
    if "enum" in schema:
        return schema["enum"]
    m = ENUM_NOTE_RE.search(schema.get("description", ""))
    with contextlib.suppress(json.JSONDecodeError):
        values = json.loads(m.group(1)) if m else None
        return values if isinstance(values, list) else None
    return None


# ----------------------------------------------------------------------------- rendering
def render(call):
    """`name(k=<repr>, ...)`, as bfcl-eval's executor takes it: nothing but one literal call, else CallError."""
    if not NAME_RE.match(call["name"]) or len(call["name"]) > 64:
        raise CallError(f"invalid function name {call['name'][:40]!r}")
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


# ----------------------------------------------------------------------------- results
EXEC_ERROR_PREFIX = "Error during execution:"  # how bfcl-eval's executor reports an exception


def result_error(result):
    """The failure a tool result reports (after EXEC_ERROR_PREFIX, or an {"error": ...} payload), or None."""
    if result.startswith(EXEC_ERROR_PREFIX):
        return result[len(EXEC_ERROR_PREFIX):].strip()
    if result.startswith("{") and '"error"' in result:  # cheap test first: results can be large
        with contextlib.suppress(json.JSONDecodeError):
            payload = json.loads(result)
            if isinstance(payload, dict) and "error" in payload:
                return str(payload["error"])
    return None
