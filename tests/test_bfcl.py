"""The BFCL environment and the official checker wrapper, on real tasks (common/envs/bfcl/harness.py)."""

import json
import os
import subprocess
import sys

import pytest

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Held-in tasks whose ground truth breaks the schema: ticket_id is declared integer but
# given as 'ticket_001' (*_173), and miss_func_49 calls `tail` two turns before the task
# reveals it. bfcl-eval runs such calls, and so do we: the oracle solves them.
HELDIN_SCHEMA_BREAKS = {"multi_turn_base_173", "multi_turn_long_context_173", "multi_turn_miss_func_173",
                        "multi_turn_miss_param_173", "multi_turn_miss_func_49"}


@pytest.fixture(scope="module")
def train():
    return bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))


def play(task, turns, fmt="python"):
    """Run per-turn lists of model texts; returns (decoded calls, all step records)."""
    steps = []
    with bfcl.Environment(task) as env:
        for turn, texts in enumerate(turns):
            env.start_turn(turn)
            for text in texts:
                steps.append(env.step(text, fmt))
        return env.decoded, steps


def gt_turns(task):
    return [[C.format_calls(bfcl.ground_truth_calls(task, t), "python")] if gt else []
            for t, gt in enumerate(task["ground_truth"])]


def test_split_is_100_per_category_and_disjoint(train, heldin):
    assert len(train) == len(heldin) == 400
    assert not set(train) & set(heldin)
    for tasks in (train, heldin):
        assert sorted(t["category"] for t in tasks.values()).count("miss_func") == 100
        assert {t["category"] for t in tasks.values()} == set(bfcl.CATEGORIES)


def test_oracle_solves_every_task(train, heldin):
    broken = set()
    for tasks in (train, heldin):
        for task in tasks.values():
            decoded, steps = play(task, gt_turns(task))
            assert bfcl.official_verdict(task, decoded)["valid"], task["id"]
            if any(e for s in steps for e in s["schema_errors"]):
                broken.add(task["id"])
    # The ground truth's own schema breaks ran, as in bfcl-eval, and are still recorded as breaks.
    assert HELDIN_SCHEMA_BREAKS <= broken, HELDIN_SCHEMA_BREAKS - broken


def test_perturbed_ground_truth_fails_with_the_official_error_type(train):
    task = train["multi_turn_base_0"]
    gt = [[C.render(c) for c in bfcl.ground_truth_calls(task, t)] for t in range(len(task["ground_truth"]))]

    def verdict(turns):
        return bfcl.official_verdict(task, play(task, [["[" + ", ".join(g) + "]"] if g else [] for g in turns])[0])

    assert verdict(gt)["valid"]
    emptied = [g if i != 1 else [] for i, g in enumerate(gt)]
    assert verdict(emptied) == {"valid": False, "error_type": "multi_turn:empty_turn_model_response", "turn": 1}
    # A changed argument of a state-changing call leaves a different file system.
    changed = json.loads(json.dumps(gt))
    i = next(i for i, c in enumerate(changed[0]) if c.startswith("mv("))
    changed[0][i] = changed[0][i].replace("destination='", "destination='x_", 1)
    assert verdict(changed) == {"valid": False, "error_type": "multi_turn:instance_state_mismatch", "turn": 0}
    # Dropping the last call of turn 0 changes the state too.
    dropped = [g[:-1] if i == 0 else g for i, g in enumerate(gt)]
    assert verdict(dropped)["error_type"] in ("multi_turn:instance_state_mismatch",
                                              "multi_turn:execution_response_mismatch")
    assert verdict(dropped)["turn"] == 0
    # An extra state-changing call (a new directory) breaks the state check.
    extra = [g + ["mkdir(dir_name='surplus')"] if i == 0 else g for i, g in enumerate(gt)]
    assert verdict(extra) == {"valid": False, "error_type": "multi_turn:instance_state_mismatch", "turn": 0}
    # Stopping early is bfcl-eval's force termination.
    assert bfcl.official_verdict(task, [[]])["error_type"] == "multi_turn:force_terminated"


def test_same_trajectory_twice_and_interleaved_give_identical_results(train):
    task = train["multi_turn_base_0"]
    turns = gt_turns(task)
    first = play(task, turns)
    assert play(task, turns) == first
    # Two environments of the same task, stepped alternately, must not share state.
    envs = [bfcl.Environment(task), bfcl.Environment(task)]
    steps = [[], []]
    for turn, texts in enumerate(turns):
        for k, env in enumerate(envs):
            env.start_turn(turn)
            for text in texts:
                steps[k].append(env.step(text, "python"))
    assert steps[0] == steps[1] == first[1]
    assert envs[0].decoded == envs[1].decoded == first[0]
    for env in envs:
        env.close()


def test_closed_environment_leaves_no_cached_instances(train):
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    task = train["multi_turn_base_0"]
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        env.step("[ls()]", "python")
        name = env.name
        assert any(k.startswith(name + "_") for k in vars(multi_turn_utils))
    bfcl.official_verdict(task, env.decoded + [[]] * (len(task["ground_truth"]) - 1))
    leftovers = [k for k in vars(multi_turn_utils) if k.endswith("_instance")]
    assert leftovers == []


def test_checker_run_forgets_its_instances_however_it_ends(train):
    """What official_verdict and common.envs.bfcl.replay execute under a checker_run name is dropped on exit."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    task = train["multi_turn_base_0"]
    with pytest.raises(RuntimeError, match="stop"), bfcl.checker_run("t", False) as name:
        for who in (name, name + "_ground_truth"):
            bfcl.execute(["ls()"], task["initial_config"], task["involved_classes"], who, task["id"],
                         long_context=False, is_evaL_run=True)
        assert len([k for k in vars(multi_turn_utils) if k.startswith(name + "_")]) >= 2
        raise RuntimeError("stop")
    assert [k for k in vars(multi_turn_utils) if k.endswith("_instance")] == []


def test_long_context_spending_does_not_leak_into_the_next_trajectory(train):
    """Long-context credit cards are module-level dicts in bfcl-eval; a refund must stay private."""
    task = train["multi_turn_long_context_153"]
    token = task["initial_config"]["TravelAPI"]["access_token"]
    balance = f"[get_credit_card_balance(access_token='{token}', card_id='1234567812345678')]"
    refund = f"[cancel_booking(access_token='{token}', booking_id='booking_901')]"
    _, steps = play(task, [[balance, refund, balance]])
    before, after = json.loads(steps[0]["results"][0]), json.loads(steps[2]["results"][0])
    assert after["card_balance"] == before["card_balance"] + 400.0
    _, steps = play(task, [[balance]])
    assert json.loads(steps[0]["results"][0]) == before
    # The official checker shares those dicts between its instances; we restore them after it.
    decoded, _ = play(task, [[refund]] + [[]] * (len(task["ground_truth"]) - 1))
    bfcl.official_verdict(task, decoded)
    _, steps = play(task, [[balance]])
    assert json.loads(steps[0]["results"][0]) == before


def test_miss_func_tools_appear_only_from_their_turn(train):
    task = next(t for t in train.values() if t["missed_function"])
    turn, held = next(iter(task["missed_function"].items()))
    turn, name = int(turn), held[0]["name"]
    assert name not in {t["name"] for t in bfcl.tools_at(task, turn - 1)}
    assert name in {t["name"] for t in bfcl.tools_at(task, turn)}
    with bfcl.Environment(task) as env:
        assert env.start_turn(0) == []
        step = env.step(f"<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {{}}}}\n</tool_call>", "json")
        # Not listed yet, but a method of the task's classes: it runs, as in bfcl-eval, and is a schema break.
        assert step["schema_errors"] == [f"unknown tool {name}"]
        assert env.decoded[-1] == [[f"{name}()"]] and not step["results"][0].startswith("Error during execution: name")
        for t in range(1, turn + 1):
            revealed = env.start_turn(t)
        assert [t["name"] for t in revealed] == [t["name"] for t in held]
    msgs = bfcl.turn_messages(task, turn)
    assert msgs[0]["role"] == "user" and f'"name": "{name}"' in msgs[0]["content"]


def test_execution_errors_are_reported_per_call(train):
    task = train["multi_turn_base_0"]
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        step = env.step("[cd(folder='no_such_folder'), ls(a=True), cd(folder=5)]", "python")
    assert step["call_errors"][0] and "no_such_folder" in step["call_errors"][0]
    assert step["call_errors"][1] is None and step["results"][1].startswith("{")
    # A schema break runs (bfcl-eval does not check types) and fails inside the tool.
    assert step["schema_errors"] == [None, None, "cd: parameter folder must be a string, got an integer"]
    assert step["call_errors"][2] == step["results"][2] == "Error during execution: 'int' object has no attribute 'rstrip'"


@pytest.mark.parametrize("text,refusal", [
    ("[book_flight(travel_class='economy')]", "name 'book_flight' is not defined"),  # another class's method
    ("[print(x='hi')]", "name 'print' is not defined"),  # a builtin: eval would run it
    ("[_load_scenario(scenario=[])]", "name '_load_scenario' is not defined"),  # private
    ("[__import__(name='os')]", "name '__import__' is not defined"),
    ("[os.system(command='ls')]", "name 'os.system' is not defined"),
    ("[exit()]", "Function call exit is not allowed."),  # bfcl-eval's deny-list
    ('<tool_call>\n{"name": "cd", "arguments": {"a b": 1}}\n</tool_call>', "invalid parameter name 'a b'"),
])
def test_calls_the_executor_would_not_dispatch_are_refused_unrun(train, text, refusal):
    task = train["multi_turn_base_0"]  # GorillaFileSystem, TwitterAPI
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        step = env.step(text, "json" if text.startswith("<") else "python")
        assert step["parse_error"] is None and len(step["calls"]) == 1
        assert step["results"] == step["call_errors"] == [f"{bfcl.EXEC_ERROR_PREFIX} {refusal}"]
        assert step["schema_errors"][0]
        # The checker gets a stand-in that bfcl-eval's executor refuses before its eval().
        assert env.decoded[-1] == [[bfcl.REFUSED_STAND_IN]]
        out, _ = bfcl.execute([bfcl.REFUSED_STAND_IN], task["initial_config"], task["involved_classes"], env.name,
                              task["id"])
        assert out == [f"{bfcl.EXEC_ERROR_PREFIX} Function call kill is not allowed."]


def test_dispatch_table_is_the_executors(train):
    """Public methods of the task's classes, as the executor maps them, minus its deny-list."""
    task = train["multi_turn_base_0"]
    table = bfcl.methods(task["involved_classes"])
    assert {"cd", "ls", "post_tweet", "tail"} <= set(table) and "book_flight" not in table
    assert not any(n.startswith("_") or n in bfcl.DENY_LIST for n in table)
    assert table["mv"] == ["source", "destination"]  # the signature's order binds positional arguments


def test_oracle_evaluation_command_writes_scores(tmp_path):
    out = tmp_path / "eval"
    res = subprocess.run([sys.executable, "evaluate.py", "--policy", "oracle", "--split", "train", "--limit", "5",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "scores.json").read_text()) == {
        "base": 100.0, "miss_func": 100.0, "miss_param": 100.0, "long_context": 100.0, "average": 100.0}
    assert len((out / "results.jsonl").read_text().splitlines()) == 20


def test_bad_task_file_names_file_and_line(tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"id": "x"}\n')
    res = subprocess.run([sys.executable, "evaluate.py", "--policy", "oracle", "--tasks", str(bad),
                          "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and f"{bad}:1: missing field" in res.stderr
    assert not (tmp_path / "o").exists()


def test_a_call_that_would_run_for_ever_fails_with_an_error_result(train):
    """Schema-valid, but mpmath would compute 987654321 digits: the deadline turns it into an error."""
    task = next(t for t in train.values() if "MathAPI" in t["involved_classes"])
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        step = env.step("[logarithm(value=20, base=10, precision=987654321), logarithm(value=100, base=10, "
                        "precision=2)]", "python")
    assert "exceeded" in step["call_errors"][0]
    assert step["call_errors"][1] is None and "2.0" in step["results"][1]
    decoded = env.decoded + [[]] * (len(task["ground_truth"]) - 1)
    assert bfcl.official_verdict(task, decoded)["valid"] is False
