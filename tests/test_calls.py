"""Parsing, validation and rendering of model-written tool calls (common/engine/calls.py)."""

import json
import os

import helpers as T
import pytest

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl

TOOLS = [
    {"name": "cd", "description": "Change directory.",
     "parameters": {"type": "dict", "properties": {"folder": {"type": "string"}}, "required": ["folder"]}},
    {"name": "tail", "description": "Last lines.",
     "parameters": {"type": "dict", "properties": {"file_name": {"type": "string"},
                                                   "lines": {"type": "integer", "default": 10}},
                    "required": ["file_name"]}},
    {"name": "fill", "description": "Fill the tank.",
     "parameters": {"type": "dict", "properties": {"amount": {"type": "float"}}, "required": ["amount"]}},
    {"name": "mode", "description": "Set mode.",
     "parameters": {"type": "dict", "properties": {
         "m": {"type": "string", "enum": ["eco", "sport"]},
         "flags": {"type": "array", "items": {"type": "boolean"}},
         "meta": {"type": "dict"},
         "x": {"type": "any"},
         "note": {"type": "string", "default": None}}, "required": ["m"]}},
]
PARAMS = {t["name"]: list(t["parameters"]["properties"]) for t in TOOLS}  # ground truth's positional binding


# ----------------------------------------------------------------------------- Qwen <tool_call> blocks


def block(obj):
    return "<tool_call>\n" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n</tool_call>"


def test_json_single_and_several_blocks():
    text = ('Let me look.\n' + block({"name": "cd", "arguments": {"folder": "docs"}}) + "\n"
            + block({"name": "tail", "arguments": {"file_name": "a.txt", "lines": 3}}))
    calls, err = C.parse(text, "json")
    assert err is None
    assert calls == [{"name": "cd", "arguments": {"folder": "docs"}},
                     {"name": "tail", "arguments": {"file_name": "a.txt", "lines": 3}}]


def test_json_plain_answer_has_no_calls():
    assert C.parse("The file is empty.", "json") == ([], None)


def test_json_arguments_given_as_a_json_string():
    calls, err = C.parse(block('{"name": "cd", "arguments": "{\\"folder\\": \\"x\\"}"}'), "json")
    assert err is None and calls[0]["arguments"] == {"folder": "x"}


def test_json_bad_block_is_skipped_and_reported():
    """bfcl-eval skips a block that is not JSON and runs the others: so do we, and the step
    says what was skipped (Ω's feedback in training; evaluation shows the model nothing more)."""
    text = block({"name": "cd", "arguments": {"folder": "x"}}) + "\n" + block('{"name": cd}') + "\n" \
        + '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    calls, err = C.parse(text, "json")
    assert calls == [{"name": "cd", "arguments": {"folder": "x"}}]
    assert "not valid JSON" in err and "1 <tool_call> block(s) not written as" in err


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>\n{"name": "cd", "arguments": {"folder": "x"}}', "unclosed"),
    ('</tool_call>', "without <tool_call>"),
    (block('{"name": cd}'), "not valid JSON"),
    ('<tool_call>{"name": "cd", "arguments": {}}</tool_call>', "not written as"),
    (block('["cd"]'), "JSON object"),
    (block('{"name": "cd"}'), "JSON object"),
    (block('{"name": "cd", "arguments": [1]}'), "must be a JSON object"),
    (block('{"name": "fill", "arguments": {"amount": NaN}}'), "finite"),
    (block('{"name": "fill", "arguments": {"amount": 1e999}}'), "finite"),
    (block('{"name": "cd", "arguments": {"folder": ' + "[" * 50 + "]" * 50 + '}}'), "deeply"),
    (block('{"name": "cd", "arguments": {"folder": "' + "a" * 9000 + '"}}'), "too long"),
    ("x" * 40_000, "too long to parse"),
])
def test_json_malformed_and_hostile(text, reason):
    calls, err = C.parse(text, "json")
    assert calls == [] and reason in err


# ----------------------------------------------------------------------------- Python list format


def test_python_keywords_only_as_bfcl_eval_decodes():
    """bfcl-eval's prompting decoder drops positional arguments; a later duplicate keyword wins."""
    calls, err = C.parse("[cd(folder='docs'), tail('a.txt', lines=2), fill(amount=-3.5), cd(folder='a', folder='b')]",
                         "python")
    assert err is None
    assert calls == [{"name": "cd", "arguments": {"folder": "docs"}},
                     {"name": "tail", "arguments": {"lines": 2}},
                     {"name": "fill", "arguments": {"amount": -3.5}},
                     {"name": "cd", "arguments": {"folder": "b"}}]


def test_ground_truth_binds_positional_arguments_as_python_does():
    calls, err = C.parse_ground_truth("[cd(folder='docs'), tail('a.txt', lines=2)]", PARAMS)
    assert err is None
    assert calls[1] == {"name": "tail", "arguments": {"file_name": "a.txt", "lines": 2}}
    assert "too many positional" in C.parse_ground_truth("[cd('a', 'b')]", PARAMS)[1]
    assert "given twice" in C.parse_ground_truth("[cd(folder='a', folder='b')]", PARAMS)[1]


def test_python_single_call_and_literals():
    calls, err = C.parse("mode(m='eco', flags=[True, False], meta={'a': [1, None]}, x=None)", "python")
    assert err is None and calls[0]["arguments"]["meta"] == {"a": [1, None]}


@pytest.mark.parametrize("text,reason", [
    ("[cd(folder=[c for c in 'abc'])]", "literal"),
    ("[cd(folder='a' * 10**9)]", "too large"),
    ("[cd(folder=2 ** 10 ** 9)]", "too large"),
    ("[cd(folder=1 << 10**9)]", "too large"),
    ("[cd(folder='%999999999d' % 1)]", "formatting"),
    ("[cd(folder=__import__('os').system('ls') + 'x')]", "literal"),  # bfcl-eval's eval() would run it
    ("[cd(folder=len('ab') + 1)]", "literal"),
    ("[cd(folder=f'{1}')]", "literal"),
    ("[cd(folder=os.sep)]", "literal"),
    ("[cd(folder={'x': {'y': 1}})]", "nested call"),  # bfcl-eval writes it as the call x(y=1)
    ("[cd(folder=('a', 'b'))]", "tuple"),
    ("[cd(folder={1, 2})]", "Set"),
    ("[cd(folder=b'x')]", "bytes"),
    ("[cd(folder=1j)]", "complex"),
    ("[1, 2]", "list of function calls"),
    ("[cd(folder='x'", "not a Python list"),
    ("[cd(folder=" + "[" * 200 + "]" * 200 + ")]", ""),
])
def test_python_hostile_inputs_are_rejected(text, reason):
    calls, err = C.parse(text, "python")
    assert calls == [] and err and reason in err


@pytest.mark.parametrize("text,fmt,name", [
    (block({"name": "__import__", "arguments": {"name": "os"}}), "json", "__import__"),
    (block({"name": "os.system", "arguments": {"command": "ls"}}), "json", "os.system"),
    ("[os.system(command='ls')]", "python", "os.system"),
    ("[__import__('os').system('touch x')]", "python", "system"),  # bfcl-eval keeps the attribute only
    ("[getattr(x, 'y')('ls')]", "python", ""),
    ("[__class__()]", "python", "__class__"),
    ("[_load_scenario(scenario=[])]", "python", "_load_scenario"),
    ("[print(x='hi')]", "python", "print"),
])
def test_any_name_parses_as_in_bfcl_eval(text, fmt, name):
    """bfcl-eval's decoders accept any name (what may run is decided at execution, common/envs/bfcl/harness.py)."""
    calls, err = C.parse(text, fmt)
    assert err is None and [c["name"] for c in calls] == [name]


def test_unknown_format_is_a_programming_error():
    with pytest.raises(ValueError):
        C.parse("x", "xml")


# ----------------------------------------------------------------------------- parity with bfcl-eval's decoders

# Hand-written edge cases: each decodes to the same calls as bfcl-eval's own decoder code
# (tests/helpers.py compiles it from the installed package), or fails where it fails.
QWEN_CASES = [
    block({"name": "cd", "arguments": {"folder": "x"}}),
    block({"name": "cd", "arguments": {"folder": "x"}}) + "\n" + block('{"name": cd}') + "\n"
    + block({"name": "ls", "arguments": {"a": True}}),                                     # bad block among good
    '<tool_call>{"name": "cd", "arguments": {"folder": "x"}}</tool_call>',                 # no newlines
    '<tool_call>\n{"name": "cd", "arguments": {"folder": "x"}}</tool_call>\n' + block({"name": "ls", "arguments": {}}),
    '<tool_call>\n  {"name": "cd", "arguments": {"folder": "x"}}  \n</tool_call>',         # inner whitespace
    '<tool_call> \n{"name": "cd", "arguments": {"folder": "x"}}\n</tool_call>',            # space before newline
    '<tool_call>\n\n{"name": "cd", "arguments": {"folder": "x"}}\n\n</tool_call>',
    block({"name": "echo", "arguments": {"content": '{"a": [1, "b"]}'}}),                 # JSON inside a string
    block('{"name": "cd", "arguments": "{\\"folder\\": \\"x\\"}"}'),                      # arguments as a string
    block({"name": "cd", "arguments": {"folder": "x"}, "id": 7}),                          # extra key
    block({"name": "cd", "arguments": {"folder": "x", "folder ": "y"}}),
    block({"name": "cd", "arguments": {"folder": "x"}}) + block({"name": "ls", "arguments": {}}),  # glued blocks
    block({"name": 5, "arguments": {}}),
    block({"name": "mv", "arguments": {"source": "a", "destination": None, "n": 1.5, "d": {"k": [1, {}]}}}),
    "<think>\n" + block({"name": "rm", "arguments": {}}) + "</think>\n\n" + block({"name": "ls", "arguments": {}}),
    block('["cd"]'),                                                                       # not an object: fails
    block('{"name": "cd"}'),                                                               # no arguments: fails
    block('{"name": "cd", "arguments": [1]}'),
    block('{"name": "cd", "arguments": "not json"}'),
    block("{}"),
    "",
    "The answer is [1, 2].",
    "[]",
]
PYTHON_CASES = [
    "[cd(folder='x')]",
    "cd(folder='x'), ls(a=True)",
    " \n`[cd(folder='x')]`\n",
    "[cd(folder='x')",                                                                     # closed for the model
    "[cd('x'), tail('a.txt', lines=2)]",                                                   # positional dropped
    "[cd('a', 'b', 'c')]",                                                                 # too many positional
    "[cd(*['x'], folder='y')]",
    "[cd(folder=docs)]",                                                                   # bare name
    "[cd(folder=docs.sub)]",                                                               # attribute: fails
    "[fill(amount=2 * 3 + 1), fill(amount=10 / 4), fill(amount=-(2 ** 3)), fill(amount=7 // 2 % 3)]",
    "[cd(folder='a' + 'b'), cd(folder='ab' * 2), cd(folder=[1] + [2])]",                   # arithmetic on literals
    "[fill(amount=+5), fill(amount=-5), fill(amount=not True), fill(amount=~1)]",          # unary operators
    "[fill(amount=-'x')]",
    "[fill(amount=1 / 0)]",
    "[fill(amount=x + 1)]",
    "[cd(folder='x', folder='y')]",
    "[cd(**{'folder': 'x'})]",
    "[mode(meta={1: 'a', True: [1, {'c': 3}], None: {'d': 1}})]",                          # dict keys written as strings
    "[mode(meta={})]",                                                                     # bfcl-eval fails on {}
    "[mode(meta={'a': {'b': 1}, 'c': 2})]",
    "[mode(meta=[g(b=1)], x=g(), y=g(1), z=a[0])]",                                         # nested calls as text/data
    "[mode(x=...)]",
    "[cd(folder='it\\'s \"q\"\\n')]",
    "[os.path.join(a='x'), 'x'.cd(folder='y')]",
    "[1, 2]",
    "[cd]",
    "[]",
    "Done.",
    "I will call cd(folder='x') now.",
    "[cd(folder='x')] and then",
]


def _strings(calls, fmt):
    """Our calls written as bfcl-eval writes its call strings (for comparison only)."""
    sep = "," if fmt == "json" else ", "
    return [f"{c['name']}({sep.join(f'{k}={v!r}' for k, v in c['arguments'].items())})" for c in calls]


@pytest.mark.parametrize("fmt,text", [("json", t) for t in QWEN_CASES] + [("python", t) for t in PYTHON_CASES])
def test_decoded_calls_equal_bfcl_eval_decoder(fmt, text):
    calls, err = C.parse(text, fmt)
    try:
        expected = T.bfcl_eval_decode(text, fmt)
    except Exception:  # noqa: BLE001 (bfcl-eval's decoder fails: its turn ends)
        assert calls == []
        # The one labelling difference: prose (not even starting like a call) is an answer.
        starts_like_a_call = C.CALL_START_RE.match(text.strip("`\n ")) or "<tool_call>" in text
        assert bool(err) == bool(starts_like_a_call), err
        return
    assert _strings(calls, fmt) == expected
    assert err is None or fmt == "json"  # json: the skipped blocks are reported


# Decodable by bfcl-eval, refused by us (docs/differences.md §3): a nested
# call or arithmetic over calls would run model text; the other values our records cannot hold.
KNOWN_REFUSALS = [
    ("python", "[mode(meta={'ls': {'a': True}})]"),
    ("python", "[fill(amount=len('ab') + 1)]"),
    ("python", "[fill(amount=10 ** 100)]"),
    ("python", "[cd(folder='%s' % 5)]"),
    ("python", "[cd(folder=('a', 'b'))]"),
    ("python", "[cd(folder=b'x')]"),
    ("python", "[fill(amount=1e308 * 10)]"),
    ("python", "[mode(meta=[{2: 3}])]"),
    ("json", block('{"name": "fill", "arguments": {"amount": NaN}}')),
    ("json", block({"name": "fill", "arguments": {"amount": 10**30}})),
]


@pytest.mark.parametrize("fmt,text", KNOWN_REFUSALS)
def test_known_refusals_are_decoded_by_bfcl_eval(fmt, text):
    assert T.bfcl_eval_decode(text, fmt)  # the list stays honest: bfcl-eval does decode these
    calls, err = C.parse(text, fmt)
    assert calls == [] and err


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call,reason", [
    ({"name": "rm", "arguments": {}}, "unknown tool rm"),
    ({"name": "cd", "arguments": {"folder": "x", "depth": 1}}, "unknown parameter depth"),
    ({"name": "cd", "arguments": {}}, "missing required parameter folder"),
    ({"name": "cd", "arguments": {"folder": 3}}, "must be a string, got an integer"),
    ({"name": "tail", "arguments": {"file_name": "a", "lines": "3"}}, "must be an integer, got a string"),
    ({"name": "tail", "arguments": {"file_name": "a", "lines": True}}, "must be an integer, got a boolean"),
    ({"name": "tail", "arguments": {"file_name": "a", "lines": 2.5}}, "must be an integer, got a number"),
    ({"name": "fill", "arguments": {"amount": False}}, "must be a number"),
    ({"name": "mode", "arguments": {"m": "turbo"}}, "must be one of ['eco', 'sport']"),
    ({"name": "mode", "arguments": {"m": "eco", "flags": [True, 1]}}, "item must be true or false"),
    ({"name": "mode", "arguments": {"m": "eco", "meta": []}}, "must be an object"),
])
def test_validation_rejects(call, reason):
    assert reason in C.validate(call, TOOLS)


@pytest.mark.parametrize("call", [
    {"name": "fill", "arguments": {"amount": 3}},  # an int is a valid float
    {"name": "tail", "arguments": {"file_name": "a"}},  # optional parameter left out
    {"name": "mode", "arguments": {"m": "sport", "x": [{"any": 1}], "note": None}},
])
def test_validation_accepts(call):
    assert C.validate(call, TOOLS) is None


def test_enums_written_into_descriptions_are_checked():
    """BFCL's multi-turn docs carry no `enum` keys; their allowed values sit in the description."""
    tools = [{"name": "setHeadlights", "parameters": {"type": "dict", "required": ["mode"], "properties": {
        "mode": {"type": "string", "description": 'The mode. [Enum]: ["on", "off", "auto"]'}}}},
             {"name": "lockDoors", "parameters": {"type": "dict", "required": ["door"], "properties": {
                 "door": {"type": "array", "items": {"type": "string"},
                          "description": 'Doors. [Enum]: ["driver", "passenger"]'}}}}]
    assert C.validate({"name": "setHeadlights", "arguments": {"mode": "auto"}}, tools) is None
    assert "must be one of ['on', 'off', 'auto']" in C.validate(
        {"name": "setHeadlights", "arguments": {"mode": "bright"}}, tools)
    assert C.validate({"name": "lockDoors", "arguments": {"door": ["driver"]}}, tools) is None
    assert "must be one of" in C.validate({"name": "lockDoors", "arguments": {"door": ["trunk"]}}, tools)


def test_render_round_trips_through_the_parser():
    call = {"name": "mode", "arguments": {"m": "eco", "meta": {"q": "it's \"quoted\"\n"}, "flags": [True]}}
    s = C.render(call)
    assert s.startswith("mode(m='eco', ")
    assert C.parse(s, "python") == ([call], None)
    assert C.parse_ground_truth(s, PARAMS) == ([call], None)


def test_hostile_text_inside_a_literal_never_executes(tmp_path):
    """The canary: a string built to break out of the rendered call stays a string."""
    canary = tmp_path / "canary"
    task = next(iter(bfcl.load_tasks(_train()).values()))  # a GorillaFileSystem task
    payloads = [
        f"[cd(folder=\"'); __import__('os').system('touch {canary}'); ('\")]",
        block(f"{{\"name\": \"cd\", \"arguments\": {{\"folder\": \"x'); open('{canary}', 'w'); ('\"}}}}"),
        f"[cd(folder=__import__('os').system('touch {canary}'))]",
        f"[cd(folder=__import__('os').system('touch {canary}') + 'x')]",  # bfcl-eval's decoder eval()s this
        f"[cd(folder=(lambda: open('{canary}', 'w'))())]",
        f"[cd(folder={{'open': {{'file': '{canary}', 'mode': 'w'}}}})]",  # bfcl-eval: the nested call open(...)
        f"[cd(folder=[open(file='{canary}', mode='w')])]",
        block(f"{{\"name\": \"__import__('os').system('touch {canary}')\", \"arguments\": {{}}}}"),
        block(f"{{\"name\": \"open\", \"arguments\": {{\"file\": \"{canary}\", \"mode\": \"w\"}}}}"),
        f"[open(file='{canary}', mode='w')]",
        f"[cd(folder='x', **{{'a': open('{canary}', 'w')}})]",
        block(f"{{\"name\": \"cd\", \"arguments\": {{\"folder\": \"x\", \"a=open('{canary}','w'),b\": 1}}}}"),
    ]
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        for text in payloads:
            step = env.step(text, "python" if text.startswith("[") else "json")
            assert step["parse_error"] or all(step["call_errors"]) or step["results"]
    assert not canary.exists()
    assert not os.path.exists("canary")


def _train():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "train.jsonl")


def test_result_error_reads_both_failure_shapes():
    """The one reading of a tool result's failure, shared by common.envs.bfcl.harness and common.seal.interface."""
    assert C.result_error(f"{C.EXEC_ERROR_PREFIX}  boom ") == "boom"
    assert C.result_error('{"error": "No such file"}') == "No such file"
    assert C.result_error('{"error": {"code": 3}}') == "{'code': 3}"
    for ok in ('{"result": "fine"}', '{"error": ', '["error"]', "error", "", 'x {"error": 1}'):
        assert C.result_error(ok) is None, ok
