"""Parsing, validation and rendering of model-written tool calls (common/calls.py)."""

import os

import pytest

from common import bfcl
from common import calls as C

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
PARAMS = {t["name"]: list(t["parameters"]["properties"]) for t in TOOLS}  # positional binding order


# ----------------------------------------------------------------------------- Qwen <tool_call> blocks


def test_json_single_and_several_blocks():
    text = ('Let me look.\n<tool_call>\n{"name": "cd", "arguments": {"folder": "docs"}}\n</tool_call>\n'
            '<tool_call>{"name": "tail", "arguments": {"file_name": "a.txt", "lines": 3}}</tool_call>')
    calls, err = C.parse(text, "json")
    assert err is None
    assert calls == [{"name": "cd", "arguments": {"folder": "docs"}},
                     {"name": "tail", "arguments": {"file_name": "a.txt", "lines": 3}}]


def test_json_plain_answer_has_no_calls():
    assert C.parse("The file is empty.", "json") == ([], None)


def test_json_arguments_given_as_a_json_string():
    calls, err = C.parse('<tool_call>{"name": "cd", "arguments": "{\\"folder\\": \\"x\\"}"}</tool_call>', "json")
    assert err is None and calls[0]["arguments"] == {"folder": "x"}


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>{"name": "cd", "arguments": {"folder": "x"}}', "unclosed"),
    ('</tool_call>', "without <tool_call>"),
    ('<tool_call>{"name": cd}</tool_call>', "not valid JSON"),
    ('<tool_call>["cd"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "cd", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "cd", "arguments": {}, "id": 3}</tool_call>', "unexpected key"),
    ('<tool_call>{"name": "fill", "arguments": {"amount": NaN}}</tool_call>', "not an allowed value"),
    ('<tool_call>{"name": "fill", "arguments": {"amount": 1e999}}</tool_call>', "finite"),
    ('<tool_call>{"name": "cd", "arguments": {"folder": ' + "[" * 50 + "]" * 50 + '}}</tool_call>', "deeply"),
    ('<tool_call>{"name": "cd", "arguments": {"folder": "' + "a" * 9000 + '"}}</tool_call>', "too long"),
    ("x" * 40_000, "too long to parse"),
])
def test_json_malformed_and_hostile(text, reason):
    calls, err = C.parse(text, "json")
    assert calls == [] and reason in err


# ----------------------------------------------------------------------------- Python list format


def test_python_list_keywords_and_positional_binding():
    calls, err = C.parse("[cd(folder='docs'), tail('a.txt', lines=2), fill(amount=-3.5)]", "python", PARAMS)
    assert err is None
    assert calls == [{"name": "cd", "arguments": {"folder": "docs"}},
                     {"name": "tail", "arguments": {"file_name": "a.txt", "lines": 2}},
                     {"name": "fill", "arguments": {"amount": -3.5}}]


def test_python_single_call_and_literals():
    calls, err = C.parse("mode(m='eco', flags=[True, False], meta={'a': [1, None]}, x=None)", "python", PARAMS)
    assert err is None and calls[0]["arguments"]["meta"] == {"a": [1, None]}


@pytest.mark.parametrize("text,reason", [
    ("[__import__('os').system('touch /tmp/x')]", "plain function names"),
    ("[getattr(x, 'y')('ls')]", "plain function names"),
    ("[cd(folder=open('/etc/passwd').read())]", "literal"),
    ("[cd(folder=(lambda: 'x')())]", "literal"),
    ("[cd(folder=[c for c in 'abc'])]", "literal"),
    ("[cd(folder='a' * 10**9)]", "literal"),
    ("[cd(folder=x)]", "literal"),
    ("[cd(folder=f'{1}')]", "literal"),
    ("[cd(**{'folder': 'x'})]", "**kwargs"),
    ("[cd(*['x'])]", "*args"),
    ("[cd(folder=('a', 'b'))]", "tuple"),
    ("[cd(folder={1, 2})]", "set"),
    ("[cd(folder=b'x')]", "bytes"),
    ("[cd(folder='x', folder='y')]", "given twice"),
    ("[cd('a', 'b')]", "too many positional"),
    ("[1, 2]", "list of function calls"),
    ("[cd(folder='x')", "not a Python list"),
    ("[cd(folder=" + "[" * 200 + "]" * 200 + ")]", ""),
])
def test_python_hostile_inputs_are_rejected(text, reason):
    calls, err = C.parse(text, "python", PARAMS)
    assert calls == [] and err and reason in err


@pytest.mark.parametrize("text,fmt,name", [
    ('<tool_call>{"name": "__import__", "arguments": {"name": "os"}}</tool_call>', "json", "__import__"),
    ('<tool_call>{"name": "os.system", "arguments": {"command": "ls"}}</tool_call>', "json", "os.system"),
    ("[os.system('ls')]", "python", "os.system"),
    ("[__class__()]", "python", "__class__"),
    ("[_load_scenario(scenario={})]", "python", "_load_scenario"),
    ("[print(x='hi')]", "python", "print"),
])
def test_any_name_parses_as_in_bfcl_eval(text, fmt, name):
    """bfcl-eval's decoders accept any name (what may run is decided at execution, common/bfcl.py);
    positional arguments of a name that is no tool are checked and dropped, as its decoder drops them."""
    calls, err = C.parse(text, fmt, PARAMS)
    assert err is None and [c["name"] for c in calls] == [name]
    assert C.parse("[os.system(open('x'))]", "python", PARAMS)[1]  # still literals only


def test_unknown_format_is_a_programming_error():
    with pytest.raises(ValueError):
        C.parse("x", "xml")


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
    assert C.parse(s, "python", PARAMS) == ([call], None)


def test_hostile_text_inside_a_literal_never_executes(tmp_path):
    """The canary: a string built to break out of the rendered call stays a string."""
    canary = tmp_path / "canary"
    task = next(iter(bfcl.load_tasks(_train()).values()))  # a GorillaFileSystem task
    payloads = [
        f"[cd(folder=\"'); __import__('os').system('touch {canary}'); ('\")]",
        f"<tool_call>{{\"name\": \"cd\", \"arguments\": {{\"folder\": \"x'); open('{canary}', 'w'); ('\"}}}}</tool_call>",
        f"[cd(folder=__import__('os').system('touch {canary}'))]",
        f"<tool_call>{{\"name\": \"__import__('os').system('touch {canary}')\", \"arguments\": {{}}}}</tool_call>",
        f"<tool_call>{{\"name\": \"open\", \"arguments\": {{\"file\": \"{canary}\", \"mode\": \"w\"}}}}</tool_call>",
        f"[open(file='{canary}', mode='w')]",
        f"[cd(folder='x', **{{'a': open('{canary}', 'w')}})]",
        f"<tool_call>{{\"name\": \"cd\", \"arguments\": {{\"folder\": \"x\", \"a=open('{canary}','w'),b\": 1}}}}</tool_call>",
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
