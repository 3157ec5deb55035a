"""loop.sh end to end on the tiny preset: artifacts, modes, KL reference and optimiser state
handed from round to round, disk retention (KEEP), resume after an interruption."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two rounds of 2 tasks x 2 samples, 1 held-in task per category. One model call per turn
# (a call ends the trajectory at the step limit) and the HF engine, which starts in a
# third of vLLM's time: at this size process start-up is most of the cost.
SMALL = ["--rounds", "2", "--eval-every", "2", "--set", "TASKS_PER_ROUND=2", "--set", "N=2", "--set", "MAX_NEW=32",
         "--set", "EVAL_LIMIT=1", "--set", "MAX_STEPS=1", "--set", "ENGINE=hf"]
ARTIFACTS = ["config.json", "timing.jsonl", "report.md", "curves.png", "eval/round_001/scores.json",
             "round_002/interface.json", "round_001/policy/optimizer/trainer_state.json"] + [
                 f"round_00{t}/{f}" for t in (0, 1) for f in (
                     "interface.json", "rollouts.jsonl", "rollout_summary.json", "diagnoses.jsonl",
                     "train_metrics.jsonl")] + [
                 f"round_001/policy/{f}" for f in ("config.json", "model.safetensors", "tokenizer.json")]
# The seal run keeps the default KEEP=evaluated, the vanilla run KEEP=all.
KEEP = {"seal": [], "vanilla": ["--set", "KEEP=all"], "resumed": [], "other": []}


def loop(runs, name, mode, *extra, **kw):
    cmd = ["bash", "loop.sh", "tiny", "--mode", mode, "--name", name, "--runs", str(runs), *SMALL, *KEEP[name], *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, **kw)


def finish(proc):
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


def optimizer_state(folder, scratch):
    """AdamW's state from a torch.distributed.checkpoint folder, as one dict of whole tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, scratch)
    return torch.load(scratch, weights_only=False)["optim"]


def jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    runs = tmp_path_factory.mktemp("runs")
    for mode in ("seal", "vanilla"):
        finish(loop(runs, mode, mode))
    return runs


@pytest.mark.parametrize("mode", ["seal", "vanilla"])
def test_two_round_loop_leaves_every_artifact(runs, mode):
    run = runs / mode
    for rel in ARTIFACTS:
        assert (run / rel).is_file(), rel
    assert (runs / "base-tiny" / "eval" / "scores.json").is_file()
    config = json.loads((run / "config.json").read_text())
    assert config["settings"]["mode"] == mode and config["versions"]["bfcl-eval"] == "2026.3.23"
    assert config["git_commit"]
    stages = [(x["round"], x["stage"]) for x in jsonl(run / "timing.jsonl")]
    for t in (0, 1):
        for stage in ("rollout", "diagnose", "evolve", "train"):
            assert stages.count((t, stage)) == 1
    report = (run / "report.md").read_text()
    assert "| 0 |" in report and "| 1 |" in report and "round_001" in report

    # KL to the round-0 model in every round; round 1 continues round 0's optimiser
    model = os.path.abspath(os.path.join(ROOT, config["settings"]["model"]))
    carried = 0  # the tiny preset learns: a round may or may not step; the count carries over either way
    for t in (0, 1):
        lines = jsonl(run / f"round_00{t}" / "train_metrics.jsonl")
        assert {m["ref_model"] for m in lines} == {model}
        assert [m["global_step"] for m in lines] == [carried + m["step"] for m in lines]
        carried = lines[-1]["global_step"]
    assert "resuming optimiser state from" in (run / "logs" / "round_001_train.log").read_text()
    # disk: round 0 was not evaluated, so once round 1's policy exists it goes (KEEP=evaluated)
    if mode == "seal":
        assert not (run / "round_000" / "policy").exists() and (run / "round_000" / "policy.deleted").is_file()
    else:
        assert (run / "round_000" / "policy" / "optimizer" / "trainer_state.json").is_file()


def test_modes_differ_where_they_should(runs):
    seal, vanilla = runs / "seal", runs / "vanilla"
    s_omega = json.loads((seal / "round_000" / "interface.json").read_text())
    v_omega = json.loads((vanilla / "round_000" / "interface.json").read_text())
    assert s_omega["schema_cue"]["enabled"] and s_omega["error_feedback"]
    assert not v_omega["schema_cue"]["enabled"] and not v_omega["error_feedback"]
    assert not v_omega["capability_cues"]
    for t in (0, 1):
        s_roll = jsonl(seal / f"round_00{t}" / "rollouts.jsonl")
        v_roll = jsonl(vanilla / f"round_00{t}" / "rollouts.jsonl")
        assert all(r["stats"]["cue_tokens"] > 0 for r in s_roll)
        assert all(r["stats"]["cue_tokens"] == 0 for r in v_roll)
        # Same tasks in both modes (a fixed order per round), different prompts.
        assert [r["task_id"] for r in s_roll] == [r["task_id"] for r in v_roll]
        assert s_roll[0]["tokens"]["prompt_ids"] != v_roll[0]["tokens"]["prompt_ids"]
        # Diagnosis weights: ρ in SEAL, 1 everywhere in vanilla.
        s_w = [m["w_mean"] for m in jsonl(seal / f"round_00{t}" / "train_metrics.jsonl")]
        v_w = [m for m in jsonl(vanilla / f"round_00{t}" / "train_metrics.jsonl")]
        assert all(m["w_mean"] == 1.0 and m["w_std"] == 0.0 for m in v_w)
        assert any(w != 1.0 for w in s_w)
    # Evaluation never sees Ω: the same base policy gives the same held-in prompts in both runs.
    assert (runs / "base-tiny" / "eval" / "rollouts.jsonl").is_file()


def test_interrupted_loop_resumes_to_the_same_artifacts(runs):
    name = "resumed"
    run = runs / name
    proc = loop(runs, name, "seal", start_new_session=True)
    deadline = time.time() + 600
    while not (run / "round_000" / "diagnoses.jsonl").exists():
        assert proc.poll() is None and time.time() < deadline, "loop ended before the interruption"
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, inside evolve or train
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not (run / "round_000" / "policy").exists() or not (run / "round_001" / "rollouts.jsonl").exists()
    rollouts_mtime = (run / "round_000" / "rollouts.jsonl").stat().st_mtime_ns

    out = finish(loop(runs, name, "seal"))
    assert "round 0 rollout: done" in out and "round 0 diagnose: done" in out
    assert (run / "round_000" / "rollouts.jsonl").stat().st_mtime_ns == rollouts_mtime
    stages = [(x["round"], x["stage"]) for x in jsonl(run / "timing.jsonl")]
    assert len(stages) == len(set(stages)), "a finished stage ran twice"
    assert not list(run.rglob(".tmp-*")), "a half-written artifact was left behind"

    ref = runs / "seal"
    for t in (0, 1):
        for f in ("rollouts.jsonl", "diagnoses.jsonl"):
            a, b = jsonl(ref / f"round_00{t}" / f), jsonl(run / f"round_00{t}" / f)
            for r in a + b:
                r.pop("policy", None)
                r.get("stats", {}).pop("seconds", None)
            assert a == b, f
        assert (ref / f"round_00{t}" / "interface.json").read_text() == (run / f"round_00{t}" / "interface.json").read_text()
    wa = load_file(ref / "round_001" / "policy" / "model.safetensors")
    wb = load_file(run / "round_001" / "policy" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    sa, sb = (optimizer_state(r / "round_001" / "policy" / "optimizer", runs / f"{r.name}.pt") for r in (ref, run))
    assert sa["state"].keys() == sb["state"].keys() and sa["param_groups"] == sb["param_groups"]
    assert all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"] for n in sa["state"][k])
    assert json.loads((ref / "eval/round_001/scores.json").read_text()) == \
        json.loads((run / "eval/round_001/scores.json").read_text())


def test_compare_prints_runs_side_by_side(runs):
    res = subprocess.run([sys.executable, "evaluate.py", "--compare", str(runs / "seal"), str(runs / "vanilla")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "average" in lines[0]
    assert [ln.split()[0:2] for ln in lines[1:]] == [["tiny", "base"], ["seal", "r001"], ["vanilla", "r001"]]


def test_finished_loop_reruns_nothing_after_deletions(runs):
    """Round 0's policy is gone (KEEP=evaluated): a rerun must still find every round done.
    KEEP may change on a rerun (config.json follows); other settings may not."""
    run = runs / "seal"
    timing = (run / "timing.jsonl").read_text()
    out = finish(loop(runs, "seal", "seal", "--set", "KEEP=latest"))
    assert "round 0 train: done" in out and "round 1 train: done" in out
    assert (run / "timing.jsonl").read_text() == timing
    assert not (run / "round_000" / "policy").exists() and (run / "round_001" / "policy").is_dir()
    assert json.loads((run / "config.json").read_text())["settings"]["keep"] == "latest"
    bad = loop(runs, "seal", "seal", "--set", "LR=7e-7")
    out, _ = bad.communicate(timeout=300)
    assert bad.returncode != 0 and "-> '7e-7'" in out


def test_base_scores_are_shared_only_under_the_same_settings(runs):
    """Every run of a preset under one --runs reuses base-tiny's held-in scores, so a run that
    would score the base model with other limits stops before writing anything."""
    bad = loop(runs, "other", "seal", "--set", "EVAL_LIMIT=2")
    out, _ = bad.communicate(timeout=300)
    assert bad.returncode == 2 and "eval_limit: '1' -> '2'" in out and "use another --runs" in out, out[-2000:]
    assert not (runs / "other").exists()
    assert json.loads((runs / "base-tiny" / "config.json").read_text())["settings"]["eval_limit"] == "1"


def test_config_records_every_preset_variable(runs):
    """config.json holds one key per variable --set can change, as PRESET_VARS names it."""
    block = open(os.path.join(ROOT, "loop.sh")).read().split('PRESET_VARS="', 1)[1].split('"', 1)[0]
    keys = [e.split(":")[1] if ":" in e else e.lower() for e in block.split()]
    settings = json.loads((runs / "seal" / "config.json").read_text())["settings"]
    assert "micro_tokens" in keys and not set(keys) - set(settings)
    assert settings["max_new_tokens"] == "32" and settings["max_steps"] == "1"  # SMALL's --set, under their keys


def test_a_setting_recorded_later_is_taken_up_and_then_held(tmp_path):
    """A run whose config.json predates a RECORDED_LATER key resumes and records it; after that
    the key is checked like any other."""
    from common import runinfo
    path = str(tmp_path / "config.json")
    runinfo.main(path, ["lr=1e-6"])
    with pytest.raises(SystemExit, match="lr: '1e-6' -> '7e-7'"):
        runinfo.main(path, ["lr=7e-7", "micro_tokens=8192"])
    runinfo.main(path, ["lr=1e-6", "micro_tokens=8192"])
    assert json.loads(open(path).read())["settings"] == {"lr": "1e-6", "micro_tokens": "8192"}
    with pytest.raises(SystemExit, match="micro_tokens: '8192' -> '32768'"):
        runinfo.main(path, ["lr=1e-6", "micro_tokens=32768"])


def test_ood_without_a_user_simulator_stops_before_round_0(tmp_path, tiny_model):
    res = subprocess.run(
        ["bash", "loop.sh", "tiny", "--ood", "--name", "ood", "--runs", str(tmp_path), *SMALL],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and "needs a user simulator" in res.stderr
    assert not (tmp_path / "ood").exists()


@pytest.mark.parametrize("setting, message", [("BFCL_HANDLER=NoSuchHandler", "choices: QwenFCHandler, LlamaHandler"),
                                              ("PROMPTS=chat", "use bfcl or template")])
def test_a_bad_prompt_setting_stops_before_round_0(tmp_path, tiny_model, setting, message):
    res = subprocess.run(
        ["bash", "loop.sh", "tiny", "--name", "bad", "--runs", str(tmp_path), *SMALL, "--set", setting],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and message in res.stderr
    assert not (tmp_path / "bad").exists()
