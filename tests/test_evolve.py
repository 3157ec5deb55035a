"""evolve.py: failure profile, cue activation rules and thresholds, modes, determinism, bad input."""

import json
import os
import subprocess
import sys

import pytest

from common.seal import interface as I
from common.seal.taxonomy import RHO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def diag(labels, reward, task="multi_turn_base_0", category="base", k=0, round_=0):
    return {"task_id": task, "category": category, "sample_index": k, "round": round_, "reward": reward,
            "official": {"valid": bool(reward), "error_type": None, "turn": None}, "turn_labels": labels,
            "evidence": [""] * len(labels), "profile": {}}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def evolve(tmp_path, records, *extra, name="out.json"):
    """Run evolve.py; (returncode, Ω or None, stdout+stderr)."""
    src = write(tmp_path / f"diag-{name}.jsonl", records) if records is not None else None
    out = tmp_path / name
    cmd = [sys.executable, "evolve.py", "--out", str(out), *extra] + (["--diagnoses", src] if src else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    omega = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, omega, proc.stdout + proc.stderr


def dominated(label, n=10, turns=4):
    """n failed trajectories whose turns are mostly `label`, plus passing ones."""
    return ([diag([label] * (turns - 1) + ["pass"], 0, k=k) for k in range(n)]
            + [diag(["pass"] * turns, 1, k=n + k) for k in range(n)])


@pytest.mark.parametrize("label", I.FAILURE_LABELS)
def test_dominant_label_selects_its_cues(tmp_path, label):
    prev = tmp_path / "off.json"
    prev.write_text(json.dumps(I.off()))  # families off, so activation is visible
    rc, omega, log = evolve(tmp_path, dominated(label), "--previous", str(prev))
    assert rc == 0, log
    assert omega["capability_cues"] == [{"label": label, "text": I.CAPABILITY_TEXT[label]}]
    assert omega["schema_cue"]["enabled"] == (label in ("argument_mismatch", "invalid_tool_call"))
    assert omega["error_feedback"] == (label == "recovery_failure")
    assert f"capability cue on: {label} (count 30, share 0.375, mean reward 0.000, pressure 0.375)" in log
    assert omega["version"] == 1 and omega["round"] == 1
    s = omega["profile"]["labels"][label]
    assert (s["count"], s["share"], s["mean_reward"], s["pressure"]) == (30, 0.375, 0.0, 0.375)
    assert omega["profile"]["categories"]["base"]["labels"][label]["count"] == 30


def test_good_labels_never_get_a_cue(tmp_path):
    records = [diag(["pass", "correct_abstention"], 0, k=k) for k in range(20)]
    rc, omega, log = evolve(tmp_path, records)
    assert rc == 0, log
    assert omega["capability_cues"] == []


def test_thresholds(tmp_path):
    def run(records, **opts):
        extra = [x for k, v in opts.items() for x in (f"--{k}", str(v))]
        rc, omega, log = evolve(tmp_path, records, *extra)
        assert rc == 0, log
        return [c["label"] for c in omega["capability_cues"]]

    z = "state_mismatch"
    # count: 8 turns pass, 7 do not (share 8/20, 7/20 well above 10 %)
    assert run([diag([z] * 8 + ["pass"] * 12, 0)]) == [z]
    assert run([diag([z] * 7 + ["pass"] * 13, 0)]) == []
    # share: exactly 10 % passes, 9 % does not (count 10 and 9 >= 8)
    assert run([diag([z] * 10 + ["pass"] * 90, 0)]) == [z]
    assert run([diag([z] * 9 + ["pass"] * 91, 0)]) == []
    # mean reward of trajectories carrying the label: 4/7 < 0.6 passes, 3/5 = 0.6 does not
    carry = lambda rewards: [diag([z] * 2 + ["pass"] * 2, r, k=k) for k, r in enumerate(rewards)]  # noqa: E731
    assert run(carry([1, 1, 1, 1, 0, 0, 0])) == [z]
    assert run(carry([1, 1, 1, 0, 0])) == []
    # the thresholds are options
    assert run([diag([z] * 7 + ["pass"] * 13, 0)], **{"min-count": 7}) == [z]
    assert run(carry([1, 1, 1, 0, 0]), **{"max-reward": 0.61}) == [z]


def test_rank_by_pressure_and_at_most_three(tmp_path):
    # pressure = share × (1 − mean reward); four labels pass every threshold
    labels = ["invalid_tool_call"] * 10 + ["argument_mismatch"] * 20 + ["missing_tool_call"] * 30 + \
        ["response_mismatch"] * 40
    records = [diag(labels[i::10], 0, k=i) for i in range(10)]
    rc, omega, log = evolve(tmp_path, records)
    assert rc == 0, log
    assert [c["label"] for c in omega["capability_cues"]] == \
        ["response_mismatch", "missing_tool_call", "argument_mismatch"]
    rc, omega, log = evolve(tmp_path, records, "--max-cues", "1")
    assert [c["label"] for c in omega["capability_cues"]] == ["response_mismatch"]
    # the next round drops cues whose labels went away, and says why
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(omega))
    rc, omega, log = evolve(tmp_path, dominated("recovery_failure"), "--previous", str(prev), name="next.json")
    assert [c["label"] for c in omega["capability_cues"]] == ["recovery_failure"]
    assert "capability cue off: response_mismatch (not seen this round)" in log
    assert omega["version"] == 2


def test_same_diagnoses_same_file(tmp_path):
    records = dominated("argument_mismatch") + [diag(["missing_tool_call"] * 3, 0.0, category="miss_func")]
    evolve(tmp_path, records, name="a.json")
    evolve(tmp_path, records, name="b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert I.load(str(tmp_path / "a.json"))["profile"]["categories"]["miss_func"]["turns"] == 3


def test_no_closed_loop_keeps_omega_0(tmp_path):
    rc, omega, log = evolve(tmp_path, dominated("argument_mismatch"), "--mode", "no-closed-loop")
    assert rc == 0, log
    base = I.initial()
    for key in ("schema_cue", "error_feedback", "capability_cues", "rho"):
        assert omega[key] == base[key]
    assert omega["profile"]["labels"]["argument_mismatch"]["count"] == 30 and omega["version"] == 1


@pytest.mark.parametrize("mode", ["vanilla", "no-env"])
def test_vanilla_and_no_env_turn_everything_off(tmp_path, mode):
    rc, omega, log = evolve(tmp_path, dominated("recovery_failure"), "--mode", mode)
    assert rc == 0, log
    assert f"schema cue off: --mode {mode}" in log and f"error feedback off: --mode {mode}" in log
    assert omega["capability_cues"] == [] and not omega["error_feedback"] and not omega["schema_cue"]["enabled"]
    tools = [{"name": "cd", "description": "", "parameters": {"type": "dict", "properties": {}, "required": []}}]
    assert I.tool_view(tools, omega) is tools
    assert I.system_cue(omega) is None
    assert I.error_hint("unknown tool ls", tools, omega) is None


def test_initial_interface_without_diagnoses(tmp_path):
    rc, omega, log = evolve(tmp_path, None)
    assert rc == 0 and omega == I.initial()
    rc, omega, log = evolve(tmp_path, None, "--mode", "vanilla", name="off.json")
    assert rc == 0 and omega == I.off()


def test_rho_is_copied_from_omega_t(tmp_path):
    # a ρ unlike the default in every label, so that a reset to the default (or to ρ ≡ 1) fails
    rho = {z: 1.5 + i / 8 for i, z in enumerate(RHO)}
    assert all(rho[z] != RHO[z] and rho[z] != 1 for z in RHO)
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({**I.initial(), "rho": rho}))
    rc, omega, log = evolve(tmp_path, dominated("state_mismatch"), "--previous", str(prev))
    assert rc == 0, log
    assert omega["rho"] == rho


@pytest.mark.parametrize("line, message", [
    ("{not json", ":2: not valid JSON"),
    (json.dumps(diag(["pass", "no_such_label"], 0)), ":2: unknown label 'no_such_label'"),
    (json.dumps({k: v for k, v in diag(["pass"], 0).items() if k != "reward"}), ":2: missing field(s) reward"),
    (json.dumps(diag(["pass"], 2)), ":2: reward must be a number in [0, 1]"),
    (json.dumps(diag([], 0)), ":2: turn_labels must be a non-empty list"),
])
def test_bad_input(tmp_path, line, message):
    src = tmp_path / "diag.jsonl"
    src.write_text(json.dumps(diag(["pass"], 1)) + "\n" + line + "\n")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "evolve.py", "--diagnoses", str(src), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.startswith(f"error: {src}{message}"), proc.stderr
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_bad_previous(tmp_path):
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({**I.initial(), "error_feedback": "yes"}))
    rc, omega, log = evolve(tmp_path, dominated("state_mismatch"), "--previous", str(prev))
    assert rc != 0 and omega is None and f"error: {prev}: error_feedback must be true or false" in log
