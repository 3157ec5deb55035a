"""diagnose.py on real tasks: reward parity with the official checker, bad input, determinism."""

import collections
import json
import os
import subprocess
import sys

import pytest
from helpers import REFUSED_KINDS, SCHEMA_KINDS, bfcl_eval_decoded, oracle, perturbations, rollout

from common.envs.bfcl import diagnose as D
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import replay
from common.jsonl import write_jsonl
from common.seal import taxonomy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "data", "train.jsonl")
# Held-in tasks whose ground truth breaks the schema (see tests/test_bfcl.py); bfcl-eval runs those calls.
HELDIN_SCHEMA_BREAKS = {
    "multi_turn_base_173",
    "multi_turn_long_context_173",
    "multi_turn_miss_func_173",
    "multi_turn_miss_param_173",
    "multi_turn_miss_func_49",
}


@pytest.fixture(scope="module")
def tasks():
    return bfcl.load_tasks(TRAIN) | bfcl.load_tasks(os.path.join(ROOT, "data", "heldin.jsonl"))


def built(task):
    """{kind: (rollout record, decoded)}: the oracle and the systematic perturbations."""
    return {"oracle": oracle(task)} | {
        k: rollout(task, turns, i + 1) for i, (k, turns) in enumerate(perturbations(task).items())
    }


def test_reward_parity_with_the_official_checker(tasks):
    """Every 8th task of both splits and those whose ground truth breaks the schema, oracle and
    perturbed; the full set (800 tasks) runs in bench/diagnose_bench.py.

    Two parities: with the checker on what our environment ran (rendered calls, stand-ins
    for refused ones), and with the checker on the raw strings bfcl-eval's own decoder
    makes of the same model texts: schema breaks, held-out tools called early and
    refused names included, so our reward is bfcl-eval's score of the same outputs."""
    sample = list(tasks)[::8] + sorted(HELDIN_SCHEMA_BREAKS - set(list(tasks)[::8]))
    rewards = collections.Counter()
    for task in map(tasks.get, sample):
        for kind, (record, decoded) in built(task).items():
            rec = D.diagnose(task, record)
            verdict = bfcl.official_verdict(task, decoded)
            assert rec["official"] == verdict and rec["reward"] == int(verdict["valid"]), (task["id"], kind)
            raw = bfcl.official_verdict(task, bfcl_eval_decoded(record))
            assert rec["reward"] == int(raw["valid"]), (task["id"], kind, rec["official"], raw)
            # What was replayed is re-derived from the record's calls, and equals what the environment ran.
            assert [t.decoded for t in replay.read_turns(task, record["turns"]) if t.played] == decoded
            assert len(rec["turn_labels"]) == len(rec["evidence"]) == len(task["ground_truth"])
            steps = [s for turn in record["turns"] for s in turn["steps"]]
            if kind in SCHEMA_KINDS:  # the perturbation did break the schema, and the call still ran
                assert any(e for s in steps for e in s["schema_errors"]), (task["id"], kind)
            if kind in REFUSED_KINDS:
                assert any(d == bfcl.REFUSED_STAND_IN for turn in decoded for step in turn for d in step)
            if kind == "oracle":
                assert rec["reward"] == 1, task["id"]
            rewards[kind, rec["reward"]] += 1
    # The perturbations do break trajectories (and garbage before the right calls does not).
    for kind in ("arg", "drop", "empty", "stop"):
        assert rewards[kind, 0] > rewards[kind, 1], kind
    assert rewards["garbage", 0] == 0
    print("\nrewards by perturbation:", dict(sorted(rewards.items())))
    for kind in SCHEMA_KINDS + REFUSED_KINDS:  # every kind was built, on several tasks
        assert rewards[kind, 0] + rewards[kind, 1] >= 5, kind


# ----------------------------------------------------------------------------- the script


def run(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "diagnose.py"), *args], cwd=ROOT, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def records(tasks):
    """Rollout records of three tasks (base, miss_param, long_context), oracle and perturbed."""
    ids = ["multi_turn_base_0", "multi_turn_miss_param_0", "multi_turn_long_context_0"]
    return [rec for i in ids for rec, _ in built(tasks[i]).values()]


def test_script_output_is_deterministic(tmp_path, records):
    rollouts = tmp_path / "rollouts.jsonl"
    write_jsonl(rollouts, records)
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for out in outs:
        proc = run("--tasks", TRAIN, "--rollouts", str(rollouts), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()
    lines = [json.loads(line) for line in outs[0].read_text().splitlines()]
    assert len(lines) == len(records)
    for rec, src in zip(lines, records, strict=True):
        assert list(rec) == [
            "task_id",
            "category",
            "sample_index",
            "round",
            "reward",
            "official",
            "turn_labels",
            "evidence",
            "profile",
        ]
        assert (rec["task_id"], rec["sample_index"]) == (src["task_id"], src["sample_index"])
        assert list(rec["profile"]) == taxonomy.LABELS and abs(sum(rec["profile"].values()) - 1) < 1e-9
        assert all("\n" not in e and 0 < len(e) <= taxonomy.MAX_EVIDENCE for e in rec["evidence"])
    assert "reward mean" in proc.stdout and "commonest failure evidence" in proc.stdout


def bad_line(records, tasks):
    """Each bad input as (name, line 2 of the rollout file)."""
    good = records[0]
    too_long = dict(good, turns=good["turns"] + good["turns"][:1])
    no_args = json.loads(json.dumps(good))
    del no_args["turns"][0]["steps"][0]["calls"][0]["arguments"]
    return {
        "malformed": '{"task_id": "multi_turn_base_0", ',
        "missing_field": json.dumps({k: v for k, v in good.items() if k != "round"}),
        "unknown_task": json.dumps(dict(good, task_id="multi_turn_base_9999")),
        "too_many_turns": json.dumps(too_long),
        "bad_call": json.dumps(no_args),
        "wrong_category": json.dumps(dict(good, category="miss_func")),
    }


@pytest.mark.parametrize(
    "case", ["malformed", "missing_field", "unknown_task", "too_many_turns", "bad_call", "wrong_category"]
)
def test_bad_input_stops_with_file_and_line_and_no_output(tmp_path, records, tasks, case):
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps(records[0]) + "\n" + bad_line(records, tasks)[case] + "\n")
    out = tmp_path / "diagnoses.jsonl"
    proc = run("--tasks", TRAIN, "--rollouts", str(rollouts), "--out", str(out))
    assert proc.returncode != 0
    assert f"{rollouts}:2:" in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["rollouts.jsonl"]  # no output, not even a partial one


def test_missing_rollout_file(tmp_path):
    proc = run(
        "--tasks", TRAIN, "--rollouts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o.jsonl")
    )
    assert proc.returncode != 0 and "none.jsonl: no such file" in proc.stderr
