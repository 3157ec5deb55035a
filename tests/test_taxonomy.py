"""The label rules of common/envs/bfcl/diagnose.py (Ψ, common/seal/taxonomy.py), one real BFCL task per rule (no mocks).

Each test plays a trajectory through the real environment (tests/helpers.py),
perturbs one turn of the ground truth and checks that exactly the expected label
lands there. The rule under test is quoted from its docstring.
"""

import os

import pytest
from helpers import ANSWER, GARBAGE, gt_calls, oracle, play, rollout, text

from common.envs.bfcl import diagnose as D
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import replay
from common.seal import taxonomy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def train():
    return bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))


@pytest.fixture(scope="module")
def base0(train):
    """4 turns, file system + twitter. Ground truth:
    0: cd(folder='document'), mkdir(dir_name='temp'), mv(source='final_report.pdf', destination='temp')
    1: cd(folder='temp'), grep(file_name='final_report.pdf', pattern='budget analysis')
    2: sort(file_name='final_report.pdf')
    3: cd(folder='..'), mv(source='previous_report.pdf', destination='temp'), cd(folder='temp'), diff(...)"""
    return train["multi_turn_base_0"]


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def diagnose(task, built):
    """The diagnosis, after checking its reward against the official checker on the same calls."""
    record, decoded = built
    rec = D.diagnose(task, record)
    assert rec["official"] == bfcl.official_verdict(task, decoded)
    assert rec["reward"] == int(rec["official"]["valid"])
    return rec


def turns_of(task, built):
    """The replayed Turns, to ask each rule on its own."""
    turns = replay.read_turns(task, built[0]["turns"])
    replay.replay(task, turns)
    return turns


def test_labels_rho_and_rules_agree():
    assert set(taxonomy.RHO) == set(taxonomy.LABELS) and len(taxonomy.LABELS) == 8
    assert list(D.FAILURE_RULES) == taxonomy.PRIORITY == taxonomy.LABELS[2:]
    assert taxonomy.RHO["invalid_tool_call"] == 2.0 and taxonomy.RHO["response_mismatch"] == 0.9


# ----------------------------------------------------------------------------- one test per label


def test_pass_oracle_and_after_recovery(base0):
    """pass: at least one valid call and the official state and response checks hold; bad
    outputs earlier in the turn do not matter."""
    assert diagnose(base0, oracle(base0))["turn_labels"] == ["pass"] * 4
    gt = gt_calls(base0)
    steps = [[text(c), ANSWER] for c in gt]
    steps[1] = [
        GARBAGE,
        text([call("cd", folder=7)]),
        text(gt[1]),
        ANSWER,
    ]  # unparsable, schema broken, then right
    rec = diagnose(base0, rollout(base0, steps))
    assert rec["reward"] == 1 and rec["turn_labels"] == ["pass"] * 4
    assert "after 2 bad output(s)" in rec["evidence"][1]


def test_correct_abstention(train):
    """Empty ground truth and no call in the turn; also when the turn was never played."""
    task = train["multi_turn_miss_param_0"]  # turn 3 has an empty ground truth
    rec = diagnose(task, oracle(task))
    assert rec["turn_labels"] == ["pass", "pass", "pass", "correct_abstention", "pass"]
    # An unparsable output alone is not a call.
    steps = [[text(c), ANSWER] if c else [GARBAGE, ANSWER] for c in gt_calls(task)]
    assert diagnose(task, rollout(task, steps))["turn_labels"][3] == "correct_abstention"


def test_invalid_tool_call_on_abstention_turn(train):
    """Empty ground truth and the model made a call: invalid_tool_call, even though the
    official checker does not penalise it; a call that broke the schema counts too."""
    task = train["multi_turn_miss_param_0"]
    gt = gt_calls(task)
    rec = diagnose(task, play(task, gt[:3] + [[call("ls")]] + gt[4:]))
    assert rec["reward"] == 1 and rec["turn_labels"][3] == "invalid_tool_call"
    assert rec["evidence"][3] == "called ls() on an abstention turn"
    # miss_func: `sort` is revealed at turn 3; calling it at the abstention turn 2 runs (as in bfcl-eval).
    task = train["multi_turn_miss_func_0"]
    gt = gt_calls(task)
    rec = diagnose(task, play(task, gt[:2] + [gt[3]] + gt[3:]))
    assert rec["reward"] == 1
    assert rec["turn_labels"] == ["pass", "pass", "invalid_tool_call", "pass", "pass"]


def test_invalid_tool_call(base0):
    """Some output did not parse, named a tool not listed or broke the schema; such a call
    may still have run (bfcl-eval runs every method of the task's classes)."""
    gt = gt_calls(base0)
    cases = [
        (call("cd", folder=5), "cd: parameter folder must be a string, got an integer", True),
        (call("cd"), "cd: missing required parameter folder", True),
        (call("cd", folder="temp", depth=1), "cd: unknown parameter depth", True),
        (call("sort"), "sort: missing required parameter file_name", True),
        (call("book_flight", travel_class="economy"), "unknown tool book_flight", False),  # not this task's
    ]
    for calls, reason, ran in cases:
        built = play(base0, [gt[0], [calls], gt[2], gt[3]])
        rec = diagnose(base0, built)  # reward checked against the official checker
        assert rec["turn_labels"][1] == "invalid_tool_call", calls
        assert rec["evidence"][1].endswith(reason)
        assert (built[1][1] != [[bfcl.REFUSED_STAND_IN]]) == ran, calls
        assert rec["official"]["error_type"] != "multi_turn:empty_turn_model_response"  # the turn has a call
    # A schema break in a turn that the checker passes: the turn is pass (a break that did no harm).
    rec = diagnose(base0, play(base0, [gt[0] + [call("ls", a="yes")]] + gt[1:]))  # a boolean written as a string
    assert rec["reward"] == 1 and rec["turn_labels"][0] == "pass" and "after 1 bad output(s)" in rec["evidence"][0]
    steps = [[text(c), ANSWER] for c in gt]
    steps[1] = [GARBAGE]
    rec = diagnose(base0, rollout(base0, steps))
    assert rec["turn_labels"][1] == "invalid_tool_call" and rec["evidence"][1].startswith(
        "unparsable output:"
    )


def test_argument_mismatch(base0):
    """A ground-truth function called with other values; later turns keep their own labels."""
    gt = gt_calls(base0)
    wrong = [gt[1][0], call("grep", file_name="final_report.pdf", pattern="budget plan")]
    rec = diagnose(base0, play(base0, [gt[0], wrong, gt[2], gt[3]]))
    # grep only reads: the state carries over intact and turns 2 and 3 pass.
    assert rec["turn_labels"] == ["pass", "argument_mismatch", "pass", "pass"]
    assert rec["evidence"][1] == "grep: pattern='budget plan', ground truth 'budget analysis'"
    assert rec["official"] == {
        "valid": False,
        "error_type": "multi_turn:execution_response_mismatch",
        "turn": 1,
    }


def test_argument_matching_rule(train, base0):
    """Per function, by value, defaults filled in; count and order are not its business."""
    gt = gt_calls(base0)
    # Schema defaults: ls() and ls(a=False) are the same call; a 'None' string default means absent.
    tools = bfcl.tools_at(base0, 0)
    assert D._args(call("ls"), tools) == D._args(call("ls", a=False), tools) == {"a": False}
    assert D._args(call("echo", content="hi"), tools) == {"content": "hi"}
    # A wrong call corrected later in the turn is no mismatch (the turn passes anyway).
    fixed = [gt[1][0], call("grep", file_name="final_report.pdf", pattern="x"), gt[1][1]]
    assert diagnose(base0, play(base0, [gt[0], fixed, gt[2], gt[3]]))["turn_labels"][1] == "pass"
    # Ground truth copies two files with cp; dropping the second is not an argument mismatch.
    task = train["multi_turn_base_3"]
    gt = gt_calls(task)
    assert [c["name"] for c in gt[1]] == ["cd", "cd", "cp", "cp"]
    rec = diagnose(task, play(task, [gt[0], gt[1][:3]]))
    assert rec["turn_labels"][1] == "state_mismatch"


def test_state_mismatch(base0):
    """Valid calls made, all ground-truth values used, and the official state check fails;
    the wrong state carries into every later turn."""
    gt = gt_calls(base0)
    rec = diagnose(base0, play(base0, [gt[0] + [call("mkdir", dir_name="extra")]] + gt[1:]))
    assert rec["turn_labels"] == ["state_mismatch"] * 4
    assert rec["evidence"][0] == "state differs from ground truth: GorillaFileSystem root"
    assert rec["official"] == {"valid": False, "error_type": "multi_turn:instance_state_mismatch", "turn": 0}


def test_recovery_failure(base0):
    """The turn's last executed call failed (state intact, response check fails)."""
    gt = gt_calls(base0)
    rec = diagnose(base0, play(base0, [gt[0], [gt[1][0], call("cat", file_name="nope.txt")], gt[2], gt[3]]))
    assert rec["turn_labels"] == ["pass", "recovery_failure", "pass", "pass"]
    assert rec["evidence"][1].startswith("last call failed: cat(file_name='nope.txt') -> {\"error\"")


def test_missing_tool_call(base0):
    """No call in the turn, or some ground-truth function never called."""
    gt = gt_calls(base0)
    rec = diagnose(base0, play(base0, [gt[0], gt[1][:1], gt[2], gt[3]]))
    assert rec["turn_labels"] == ["pass", "missing_tool_call", "pass", "pass"]
    assert rec["evidence"][1] == "never called grep"
    rec = diagnose(base0, play(base0, [gt[0], [], gt[2], gt[3]]))
    assert rec["turn_labels"][1] == "missing_tool_call" and rec["evidence"][1] == "no call in the turn"
    assert rec["official"] == {
        "valid": False,
        "error_type": "multi_turn:empty_turn_model_response",
        "turn": 1,
    }


def test_response_mismatch(base0):
    """Only the official response check fails: grep ran before cd reached its folder, so it
    failed, but a successful call followed and every ground-truth function was called with
    the ground truth's values."""
    gt = gt_calls(base0)
    rec = diagnose(base0, play(base0, [gt[0], [gt[1][1], gt[1][0]], gt[2], gt[3]]))
    assert rec["turn_labels"] == ["pass", "response_mismatch", "pass", "pass"]
    assert rec["evidence"][1].startswith("1 ground-truth result(s) missing")


# ----------------------------------------------------------------------------- priority, later turns, stops


def test_priority_decides_when_rules_compete(base0):
    gt = gt_calls(base0)
    wrong0 = [gt[0][0], call("mkdir", dir_name="tmp"), gt[0][2]]
    # mkdir with another name: argument_mismatch and state_mismatch both apply -> argument_mismatch.
    built = play(base0, [wrong0] + gt[1:])
    turn = turns_of(base0, built)[0]
    assert D.argument_mismatch(turn) and D.state_mismatch(turn)
    assert diagnose(base0, built)["turn_labels"][0] == "argument_mismatch"
    # Add an unparsable output before it: invalid_tool_call outranks both.
    built = rollout(base0, [[GARBAGE, text(wrong0), ANSWER]] + [[text(c), ANSWER] for c in gt[1:]])
    turn = turns_of(base0, built)[0]
    assert (
        taxonomy.invalid_tool_call(turn)
        and D.argument_mismatch(turn)
        and D.state_mismatch(turn)
    )
    assert diagnose(base0, built)["turn_labels"][0] == "invalid_tool_call"
    # A failed last call and a never-called function: recovery_failure outranks missing_tool_call.
    built = play(base0, [gt[0], [gt[1][0], call("cat", file_name="nope.txt")], gt[2], gt[3]])
    turn = turns_of(base0, built)[1]
    assert (
        D.recovery_failure(turn)
        and D.missing_tool_call(turn)
        and D.response_mismatch(turn)
    )
    assert diagnose(base0, built)["turn_labels"][1] == "recovery_failure"


def test_turns_after_the_first_failure_are_labelled(base0):
    """The official checker stops at turn 1; the replay goes on: without cd into temp, turn 2's
    sort fails, and turn 3's mv moves a file the ground truth never saw."""
    gt = gt_calls(base0)
    rec = diagnose(base0, play(base0, [gt[0], [], gt[2], gt[3]]))
    assert rec["official"]["turn"] == 1
    assert rec["turn_labels"] == ["pass", "missing_tool_call", "recovery_failure", "state_mismatch"]
    assert rec["profile"] == {
        "pass": 0.25,
        "correct_abstention": 0.0,
        "invalid_tool_call": 0.0,
        "argument_mismatch": 0.0,
        "state_mismatch": 0.25,
        "recovery_failure": 0.25,
        "missing_tool_call": 0.25,
        "response_mismatch": 0.0,
    }


def test_stopped_trajectory_labels_the_turns_it_never_played(train):
    """Force-terminated, as official_verdict says; turns never played made no call."""
    task = train["multi_turn_miss_param_0"]
    steps = [[text(c), ANSWER] for c in gt_calls(task)[:2]]
    rec = diagnose(task, rollout(task, steps))
    assert rec["official"] == {"valid": False, "error_type": "multi_turn:force_terminated", "turn": 2}
    assert rec["turn_labels"] == [
        "pass",
        "pass",
        "missing_tool_call",
        "correct_abstention",
        "missing_tool_call",
    ]
    assert rec["evidence"][2] == "not played (trajectory stopped)"
