"""The training-time interface Ω: identity without Ω, schema cue, error hints, and the leakage audit."""

import copy
import json
import os

import helpers
import pytest

from common.envs.bfcl import harness as bfcl
from common.envs.bfcl.play import HINT_RULES
from common.jsonl import RecordError
from common.seal import interface as I

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "data", "train.jsonl")

# A schema with every annotation the cue knows (BFCL's multi-turn tools have no enums).
LAMP = {"name": "set_lamp", "description": "Set the lamp.",
        "parameters": {"type": "dict", "required": ["mode", "rooms"], "properties": {
            "mode": {"type": "string", "description": "Lamp mode.", "enum": ["on", "off", "dim"]},
            "rooms": {"type": "array", "items": {"type": "string"}, "description": "Rooms."},
            "level": {"type": "integer", "description": "Brightness.", "default": 5},
            "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]},
                       "description": "Colors."}}}}
LS = {"name": "ls", "description": "List.", "parameters": {"type": "dict", "required": [], "properties": {
    "a": {"type": "boolean", "description": "Show hidden.", "default": False}}}}
LOGIN = [{"name": n, "description": "", "parameters": {"type": "dict", "properties": {}, "required": []}}
         for n in ("ticket_get_login_status", "ticket_login", "get_ticket", "get_user_tickets", "pwd", "cd",
                   "get_account_info", "displayCarStatus")]


@pytest.fixture(scope="module")
def tasks():
    return bfcl.load_tasks(TRAIN)


def test_without_omega_nothing_changes(tasks):
    task = tasks["multi_turn_base_0"]
    tools = bfcl.tools_at(task, 0)
    assert I.tool_view(tools, {**I.initial(), "schema_cue": {**I.SCHEMA_ON, "enabled": False}}) is tools
    for omega in (None, I.off()):
        assert I.tool_view(tools, omega) is tools
        assert I.system_cue(omega) is None
        for error in ("unknown tool foo", "cd: missing required parameter folder",
                      json.dumps({"error": "cd: 'x': No such file or directory"})):
            assert I.error_hint(error, tools, omega) is None
    # The miss_func announcement is byte-identical to the plain one too.
    mf = next(t for t in tasks.values() if t["missed_function"])
    turn = int(next(iter(mf["missed_function"])))
    revealed = mf["missed_function"][str(turn)]
    assert bfcl.turn_messages(mf, turn, new_tools=I.tool_view(revealed, None)) == bfcl.turn_messages(mf, turn)


def test_tool_view_annotates_a_copy(tasks):
    before = copy.deepcopy([LAMP, LS])
    view = I.tool_view([LAMP, LS], I.initial())
    assert [LAMP, LS] == before  # input untouched
    props = view[0]["parameters"]["properties"]
    assert props["mode"]["description"] == '[required] Lamp mode. (type: string; one of: "on", "off", "dim")'
    assert props["rooms"]["description"] == "[required] Rooms. (type: array of string)"
    assert props["level"]["description"] == "Brightness. (type: integer)"
    assert props["colors"]["description"] == 'Colors. (type: array of string; one of: "red", "blue")'
    assert view[1]["parameters"]["properties"]["a"]["description"] == "Show hidden. (type: boolean)"
    only_required = {**I.initial(), "schema_cue": {**I.SCHEMA_ON, "types": False, "enums": False}}
    assert I.tool_view([LAMP], only_required)[0]["parameters"]["properties"]["level"]["description"] == "Brightness."
    # Tools revealed later (miss_func) are annotated in their announcement.
    mf = next(t for t in tasks.values() if t["missed_function"])
    turn = int(next(iter(mf["missed_function"])))
    revealed = mf["missed_function"][str(turn)]
    text = bfcl.turn_messages(mf, turn, new_tools=I.tool_view(revealed, I.initial()))[0]["content"]
    assert "(type: " in text and text != bfcl.turn_messages(mf, turn)[0]["content"]


def test_initial_and_load(tmp_path):
    omega = I.initial()
    assert I.check(omega) is None and omega["version"] == 0 and omega["round"] == 0
    assert omega["schema_cue"]["enabled"] and omega["error_feedback"] and omega["capability_cues"] == []
    assert I.check(I.off()) is None
    assert I.load(None) is None and I.load("null") is None
    path = tmp_path / "interface.json"
    path.write_text("null")
    assert I.load(str(path)) is None
    path.write_text(json.dumps(omega))
    assert I.load(str(path)) == omega
    for bad in ({**omega, "error_feedback": "yes"}, {k: v for k, v in omega.items() if k != "rho"},
                {**omega, "capability_cues": [{"label": "pass", "text": "x"}]}, {**omega, "rho": {"nope": 1.0}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(RecordError, match=str(path)):
            I.load(str(path))
    path.write_text("{")
    with pytest.raises(RecordError, match=f"{path}:1"):
        I.load(str(path))
    with pytest.raises(RecordError, match="no such file"):
        I.load(str(tmp_path / "absent.json"))


def test_system_cue():
    omega = {**I.initial(), "capability_cues": [{"label": z, "text": I.CAPABILITY_TEXT[z]}
                                                for z in ("argument_mismatch", "missing_tool_call")]}
    lines = I.system_cue(omega).split("\n")
    assert lines == [f"- {I.CAPABILITY_TEXT['argument_mismatch']}", f"- {I.CAPABILITY_TEXT['missing_tool_call']}"]
    assert I.system_cue(I.initial()) is None
    assert set(I.CAPABILITY_TEXT) == set(I.FAILURE_LABELS) == set(I.ACTIVATES)


@pytest.mark.parametrize("error, cls, expect", [
    ("tool call is not valid JSON (Expecting value)", "format_json", "<tool_call>\n{"),
    ("1 <tool_call> block(s) not written as <tool_call>\\n{...}", "format_json", "a newline after <tool_call>"),
    ("unclosed <tool_call> block", "format_json", "one block per call"),
    ("not a Python list of calls (invalid syntax)", "format_python", "[tool_name(parameter=value)"),
    ("argument mode: only literal values are allowed, not Name", "literal_value", "no variables"),
    ("too many calls in one output (70 > 64)", "output_size", "fewer calls"),
    ("Error: unknown tool set_lights", "unknown_tool", "Tools available now: set_lamp, ls."),
    ("set_lamp: unknown parameter room", "unknown_parameter", "set_lamp accepts: mode, rooms, level, colors "
                                                              "(required: mode, rooms)"),
    ("set_lamp: missing required parameter rooms", "missing_parameter", "set_lamp needs rooms (array of string"),
    ("set_lamp: parameter mode must be one of ['on', 'off', 'dim']", "enum_value", '("on", "off", "dim")'),
    ("set_lamp: parameter colors item must be one of ['red', 'blue']", "enum_value", '("red", "blue")'),
    ("set_lamp: parameter level must be an integer, got a string", "wrong_type", "level as a whole number"),
    ("set_lamp: parameter rooms item must be a string, got an integer", "wrong_type", "each item of rooms"),
    ("ls: parameter a must be true or false, got a string", "wrong_type", "(schema type: boolean)"),
])
def test_call_error_hints(error, cls, expect):
    assert I.error_class(error)[0] == cls
    hint = I.error_hint(error, [LAMP, LS], I.initial())
    assert expect in hint


@pytest.mark.parametrize("error, cls, expect", [
    ({"error": "cd: 'seal': No such file or directory"}, "bad_path", "(pwd)"),
    ({"error": "touch: cannot touch 'a': File exists"}, "already_exists", "already taken"),
    ({"error": "User not authenticated. Please log in to create a ticket."}, "not_logged_in",
     "(ticket_get_login_status) and log in (ticket_login)"),
    ({"error": "No user is currently logged in."}, "not_logged_in", "login status"),
    ({"error": "Token expired"}, "not_logged_in", "log in"),
    ({"error": "Insufficient funds"}, "insufficient_funds", "(get_account_info)"),
    ({"error": "Ticket with ID 7 not found."}, "not_found", "(get_ticket, get_user_tickets)"),
    ({"error": "Brake pedal needs to be pressed when starting the engine."}, "precondition", "(displayCarStatus)"),
    ({"error": "Invalid priority. Priority must be between 1 and 5."}, "invalid_value", "ranges, formats"),
    ("Error during execution: No available route for the given airports.", "invalid_value", "cannot be done"),
])
def test_env_error_hints(error, cls, expect):
    error = error if isinstance(error, str) else json.dumps(error)
    assert I.error_class(error, HINT_RULES)[0] == cls
    hint = I.error_hint(error, LOGIN, I.initial(), HINT_RULES)
    assert expect in hint
    assert "7" not in hint and "seal" not in hint  # never echoes the error's values


def test_no_rule_no_hint():
    assert I.error_hint("Error during execution: boom", LOGIN, I.initial()) is None
    assert I.error_hint(json.dumps({"result": "ok"}), LOGIN, I.initial()) is None
    # An execution error is never read as a call rejection, and vice versa.
    assert I.error_class(json.dumps({"error": "unknown tool cd"}))[0] is None
    assert I.error_class("cd: 'x': No such file or directory", HINT_RULES)[0] is None
    # an environment's own failures are its rules' (BFCL's file system), not Ω's generic ones
    assert I.error_class(json.dumps({"error": "cd: 'x': No such file or directory"}))[0] is None


def test_literal_rule():
    assert helpers.literals({"a": ["final_report.pdf", "ab", 7, 12, 3.5, 20.0, True, None]}) == \
        ["final_report.pdf", "12", "20.0", "20"]
    assert helpers.occurs("10", "costs 10 usd") and not helpers.occurs("10", "costs 100") and not helpers.occurs("10", "2.10")
    assert helpers.occurs("Report.PDF", "the report.pdf file")
    assert helpers.leaks("move to budget", ["budget", "temp"], "temp folder") == ["budget"]


def test_leakage_audit_all_training_tasks(tasks):
    """No cue of a fully switched-on Ω reveals a ground-truth literal the agent has not seen (400 tasks)."""
    omega = {**I.initial(), "capability_cues": [{"label": z, "text": t} for z, t in I.CAPABILITY_TEXT.items()][:3]}
    cases = [c for task in tasks.values() for c in helpers.audit(task, omega)]
    leaked = [c for c in cases if c["leaks"]]
    assert not leaked, leaked[:5]
    hinted = [c for c in cases if c["cue"] and c["case"] not in ("schema_cue", "capability_cue")]
    by_case = {}
    for c in hinted:
        by_case[c["case"]] = by_case.get(c["case"], 0) + 1
    print(f"\nleakage audit: {len(tasks)} tasks, {len(cases)} cues checked, {len(hinted)} error hints, "
          f"0 leaks; hints by case: {json.dumps(by_case, sort_keys=True)}")
    assert len(tasks) == 400
    for case in ("unknown_tool", "unknown_parameter", "missing_parameter", "wrong_type", "parse_json",
                 "parse_python", "exec_wrong_value", "env_template"):
        assert by_case.get(case, 0) > 100, case
    assert {I.error_class(c["error"], HINT_RULES)[0] for c in hinted if c["case"] == "exec_wrong_value"} >= \
        {"bad_path", "not_found", "not_logged_in", "invalid_value"}


def test_audit_catches_a_leaky_hint(tasks, monkeypatch):
    """The audit has teeth: a hint that echoed the error (and so the ground truth) is caught."""
    monkeypatch.setattr(helpers, "error_hint", lambda error, tools, omega, rules=(): error)
    some = list(tasks.values())[::20]
    leaked = [c for task in some for c in helpers.audit(task, I.initial()) if c["leaks"]]
    assert len(leaked) > 50 and any(c["case"] == "env_template" for c in leaked)
